#!/usr/bin/env python3
"""The GPU figures the README and docs quote, derived from committed gpu-check results.

    scripts/gpu-figures.py results/gpu-<card>-<date>.json [...] > results/gpu-figures.json

Each input is a scripts/gpu-check.sh results file (gpu-check.json as committed); the output
maps `<card-slug>-<date>[-runN]` to flat figures whose names carry no spaces, so the docs'
`<!--fig results/gpu-figures.json#RUN.FIGURE FMT-->` markers can name them. Figures are only
copied or divided here, never typed: tests/it/docs.rs checks every marker against this file.
A `-xfer-post.json` input (kvx xfer output wrapped with its command) adds the posting breakdown.
"""
import json, os, re, sys


def span_p50(d):
    t = (d or {}).get("transfer_bandwidth") or {}
    return ((t.get("span_gbps") or {}).get("p50")) if isinstance(t, dict) else None


def run_key(path, doc):
    base = os.path.basename(path)[: -len(".json")]
    return base[len("gpu-"):] if base.startswith("gpu-") else base


def figures(doc):
    steps = {s["step"]: s for s in doc.get("steps", [])}
    out = {"card": doc.get("card"), "date": doc.get("date"), "commit": doc.get("commit")}

    def output(name):
        s = steps.get(name)
        return s.get("output") if s and s.get("status") == "ok" else None

    for name, s in steps.items():
        m = re.match(
            r"bench cuda-batch P8->D2 70B --batch-launch (\w+) --concurrency (\d)( --batch-descriptors device)?"
            r"( under MPS)?$", name)
        if m and s.get("status") == "ok":
            d = s["output"]
            key = f"launch_{m[1]}_c{m[2]}" + ("_dev" if m[3] else "") + ("_mps" if m[4] else "")
            dev = (d.get("calibration") or {}).get("device_bandwidth_gbps")
            out[key] = {
                "span_gbps_p50": span_p50(d),
                "device_gbps": dev,
                "share_of_device": span_p50(d) / dev if span_p50(d) and dev else None,
                "transfer_p50_us": d["stages"]["transfer"]["p50_us"],
                "post_p50_us": d["stages"]["post"]["p50_us"],
                "requests_ok": d["requests_ok"],
                "requests_failed": d["requests_failed"],
                "verify_failures": d["verify_failures"],
                "blocks_leaked": d["blocks_leaked"],
                "calls_per_request": (d.get("cuda_batch") or {}).get("calls_per_request"),
            }
            # Per decode rank and request (kvx from fe8fc0c on): host packing, posting, waiting.
            for k in ("pack_us_per_rank", "post_us_per_rank", "wait_us_per_rank"):
                if k in (d.get("cuda_batch") or {}):
                    out[key][k] = d["cuda_batch"][k]
        if name.startswith("bench cuda-batch P8->D1 70B --batch-launch rank --concurrency 1") and s.get("status") == "ok":
            d = s["output"]
            dev = (d.get("calibration") or {}).get("device_bandwidth_gbps")
            cb = d.get("cuda_batch") or {}
            out["launch_rank_c1_d1" + ("_dev" if "--batch-descriptors device" in name else "")] = {
                "span_gbps_p50": span_p50(d), "device_gbps": dev,
                "share_of_device": span_p50(d) / dev if span_p50(d) and dev else None,
                "requests_ok": d["requests_ok"], "verify_failures": d["verify_failures"],
                "blocks_leaked": d["blocks_leaked"],
                **{k: cb.get(k) for k in ("pack_us_per_rank", "post_us_per_rank", "wait_us_per_rank")}}
        if name.startswith("bench --mem cuda --p-tp 8 --d-tp 2 --compare-kv-buffer-device") and s.get("status") == "ok":
            d = s["output"]
            pts = {p["label"]: p for p in d.get("sweep") or []}
            hb = {"requests_ok": d["requests_ok"], "requests_failed": d["requests_failed"],
                  "verify_failures": d["verify_failures"], "blocks_leaked": d["blocks_leaked"],
                  "bytes_verified": d["bytes_verified"]}
            for label, p in pts.items():
                prm = p.get("params") or {}
                hb[label] = {"throughput_gbps": p["throughput_gbps"], "kv_ready_p50_us": p["kv_ready_p50_us"],
                             "transfer_p50_us": p["transfer_p50_us"]}
                for k in ("save_to_host_p50_us", "sync_to_device_p50_us"):
                    if k in prm:
                        hb[label][k] = prm[k]
            if "cpu" in pts and "cuda" in pts:
                hb["throughput_cpu_over_cuda"] = pts["cpu"]["throughput_gbps"] / pts["cuda"]["throughput_gbps"]
                hb["kv_ready_cpu_over_cuda"] = pts["cpu"]["kv_ready_p50_us"] / pts["cuda"]["kv_ready_p50_us"]
            out["hostbuf"] = hb
        m = re.match(r"xfer --transport cuda-batch --batch-copy kernel 8KiB x1024,10240,40960", name)
        if m and s.get("status") == "ok":
            post = {}
            for r in s["output"]["results"]:
                n = r["inflight"]
                post[f"x{n}"] = {k: r.get(k) for k in ("gbps", "post_us", "pack_us", "fill_us", "complete_us", "bulk_copy_gbps")}
                post[f"x{n}"]["fill_ns_per_desc"] = r["fill_us"] * 1e3 / n
            out["xfer_post"] = post
        m = re.match(r"xfer --transport cuda-batch --batch-copy ([\w-]+) 8KiB (16-byte aligned|--misalign 3|--misalign 0,1)$", name)
        if m and s.get("status") == "ok":
            r = s["output"]["results"][0]
            tag = {"16-byte aligned": "aligned", "--misalign 3": "misalign_3", "--misalign 0,1": "misalign_0_1"}[m[2]]
            out.setdefault("paths", {}).setdefault(m[1].replace("-", "_"), {})[tag] = {
                "gbps": r["gbps"], "verified_batches": r["verified_batches"], "timed_batches": r["timed_batches"]}
    for p in out.get("paths", {}).values():
        for tag in ("misalign_3", "misalign_0_1"):
            if tag in p and "aligned" in p:
                p[tag]["over_aligned"] = p[tag]["gbps"] / p["aligned"]["gbps"]
    pull, push = output("bench --mem cuda --p-tp 8 --d-tp 2"), output("bench --mem cuda --p-tp 8 --d-tp 2 --mode push")
    if pull and push:
        out["push_pull"] = {
            "pull_gbps": pull["throughput_gbps"], "push_gbps": push["throughput_gbps"],
            "push_over_pull": push["throughput_gbps"] / pull["throughput_gbps"],
            "push_requests_ok": push["requests_ok"], "push_verify_failures": push["verify_failures"],
            "push_blocks_leaked": push["blocks_leaked"]}
    for name, s in steps.items():
        if name.startswith("serve-engine --mem cuda") and s.get("status") == "ok":
            d = s["output"]
            out["serve"] = {
                "seconds": d["duration_s"], "requests_ok": d["requests_ok"], "requests_failed": d["requests_failed"],
                "leases_expired": d["prefill"]["at_exit"]["leases_expired"],
                "blocks_leaked": d["prefill"]["at_exit"]["blocks_leaked"] + d["decode"]["at_exit"]["blocks_leaked"],
                "verify_failures": d["decode"]["metrics_at_end"].get("kvx:kv_verify_failures_total"),
                "bytes_verified": d["decode"]["metrics_at_end"].get("kvx:kv_bytes_verified_total"),
                "kv_usage_at_end_prefill": d["prefill"]["metrics_at_end"].get("vllm:kv_cache_usage_perc"),
                "kv_usage_at_end_decode": d["decode"]["metrics_at_end"].get("vllm:kv_cache_usage_perc")}
    # Hybrid models on device memory (gpu-check step "hybrid", and the by-hand runs of a
    # -extra.json: vLLM's rule and --state-slices exact on Falcon-H1, gpt-oss, --batch-launch auto).
    for name, s in steps.items():
        d = s.get("output") or {}
        if not d.get("run_id"):
            continue
        key = None
        if name.startswith("bench --mem cuda hybrid-qwen3-next"):
            key = "hybrid_qwen3_next" + ("_batch" if "cuda-batch" in name else "")
        elif name.startswith("bench --mem cuda nemotron-h-8b --compare-kv-buffer-device"):
            key = "hybrid_nemotron_hostbuf"
        elif re.match(r"(falcon-p\dd\d-(vllm|exact)|gptoss-p\dd\d|auto-c\d-nomps)$", name):
            key = name.replace("-", "_")
        elif m := re.match(r"bench --mem cuda falcon-h1-7b P(\d)->D(\d) (\(vLLM|--state-slices exact)", name):
            key = f"falcon_p{m[1]}d{m[2]}_" + ("vllm" if m[3] == "(vLLM" else "exact")
        elif re.match(r"bench --mem cuda gpt-oss-120b P2->D2", name):
            key = "gptoss_p2d2"
        if not key:
            continue
        tb = d.get("transfer_bandwidth") or {}
        fig = {"status": s.get("status"), "requests_ok": d["requests_ok"], "requests_failed": d["requests_failed"],
               "verify_failures": d["verify_failures"], "blocks_leaked": d["blocks_leaked"],
               "bytes_read": d["bytes_read"], "bytes_verified": d["bytes_verified"],
               "throughput_gbps": d["throughput_gbps"]}
        if tb.get("rank_gbps"):
            fig["rank_gbps_p50"] = tb["rank_gbps"]["p50"]
        for st in ("transfer", "post", "kv_ready", "verify"):
            if st in (d.get("stages") or {}):
                fig[st + "_p50_us"] = d["stages"][st]["p50_us"]
        if d.get("cuda_batch"):
            fig["launches"] = d["cuda_batch"].get("launches")
            fig["calls_per_request"] = d["cuda_batch"].get("calls_per_request")
        pts = {p["label"]: p for p in d.get("sweep") or []}
        for label, p in pts.items():
            prm = p.get("params") or {}
            fig[label] = {"kv_ready_p50_us": p["kv_ready_p50_us"], "transfer_p50_us": p["transfer_p50_us"],
                          "descriptors": (p.get("descriptors_per_request") or {}).get("raw"),
                          **{k: prm[k] for k in ("save_to_host_p50_us", "sync_to_device_p50_us") if k in prm}}
        if "cpu" in pts and "cuda" in pts:
            fig["kv_ready_cpu_over_cuda"] = pts["cpu"]["kv_ready_p50_us"] / pts["cuda"]["kv_ready_p50_us"]
        out[key] = fig
    # Every byte of a cuda-batch P8->D2 run checked (step "batch", and step "device"'s with
    # --batch-descriptors device); a decode rank's rayon pool (by-hand runs of a -rayon.json).
    for name, s in steps.items():
        d = s.get("output") or {}
        if s.get("status") != "ok" or not d.get("run_id"):
            continue
        key = None
        if name == "bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --verify full":
            key = "batch_verify"
        elif name.startswith("bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --batch-descriptors device"):
            key = "device_verify"
        elif m := re.match(r"rayon-(\d+)$", name):
            key = f"rayon_{m[1]}"
        if not key:
            continue
        cb = d.get("cuda_batch") or {}
        dev = (d.get("calibration") or {}).get("device_bandwidth_gbps")
        out[key] = {"requests_ok": d["requests_ok"], "requests_failed": d["requests_failed"],
                    "verify_failures": d["verify_failures"], "blocks_leaked": d["blocks_leaked"],
                    "bytes_read": d["bytes_read"], "bytes_verified": d["bytes_verified"],
                    "span_gbps_p50": span_p50(d), "device_gbps": dev,
                    "share_of_device": span_p50(d) / dev if span_p50(d) and dev else None,
                    "descriptors_made_on": cb.get("descriptors_made_on") or ["host"],
                    **{k: cb.get(k) for k in ("pack_us_per_rank", "post_us_per_rank", "wait_us_per_rank")}}
    # The ratio table's rows gpu-check printed (ucx_perftest, the transports compared alone).
    for r in doc.get("ratios") or []:
        what = r.get("what", "")
        if m := re.match(r"kvx / ucx_perftest ucp_get @ (\d+) KiB", what):
            out.setdefault("perftest", {})[f"kib{m[1]}"] = {k: r.get(k) for k in ("kvx_gbps", "peer_gbps", "ratio")}
        elif what.startswith("bench P8->D2 alone (--concurrency 1) request span p50: cuda-batch / ucx"):
            out["compare_c1"] = {k: r.get(k) for k in ("kvx_gbps", "peer_gbps", "ratio")}
    for name, s in steps.items():
        if name.startswith("kvx gate:"):
            tag = "same" if "unchanged vs the same-session" in name else "slow" if "--slowdown" in name else "committed"
            out.setdefault("gate", {})[tag + "_exit"] = int(re.search(r"exit (\d)", s.get("note", "")).group(1))
    return out


def main():
    res = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            doc = json.load(f)
        if path.endswith("-xfer-post.json"):
            key = run_key(path, doc)[: -len("-xfer-post")]
            post = {}
            for r in doc["output"]["results"]:
                n = r["inflight"]
                post[f"x{n}"] = {k: r.get(k) for k in ("gbps", "post_us", "pack_us", "fill_us", "complete_us", "bulk_copy_gbps")}
                post[f"x{n}"]["pack_ns_per_desc"] = r["pack_us"] * 1e3 / n
                post[f"x{n}"]["fill_ns_per_desc"] = r["fill_us"] * 1e3 / n
                post[f"x{n}"]["post_ns_per_desc"] = r["post_us"] * 1e3 / n
                # What the GPU took: from the end of posting to the event (complete less post).
                gpu_us = r["complete_us"] - r["post_us"]
                post[f"x{n}"]["gpu_us"] = gpu_us
                post[f"x{n}"]["gpu_share_of_bulk"] = (8192 * n / gpu_us / 1e3) / r["bulk_copy_gbps"]
            res.setdefault(key + "-run2", {})["xfer_post"] = post
            continue
        res.setdefault(run_key(path, doc), {}).update(figures(doc))
    json.dump(res, sys.stdout, indent=1, sort_keys=True)
    print()


main()
