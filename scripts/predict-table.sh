#!/usr/bin/env bash
# The prediction accuracy table (docs/prediction.md): fits this host's transfer-time model with
# `kvx calibrate` (twice, the second compared with the first: is every term stable?), then runs
# `kvx bench --rates` over 12 shapes fixed before the fit and writes predicted against measured
# transfer span p50/p90 per shape.
#
#   scripts/predict-table.sh [--mem host|cuda] [--path ucx|cuda-ipc|cuda-batch] [--out DIR]
#
# Writes DIR/rates-<path>.json, DIR/rates-<path>-again.json, DIR/stability-<path>.txt and
# DIR/table-<path>.json (default DIR: results/prediction). Uses target/release/kvx (KVX=...).
set -euo pipefail
cd "$(dirname "$0")/.."

KVX=${KVX:-target/release/kvx}
OUT=results/prediction
MEM=host
PATHKEY=ucx
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --mem) MEM="$2"; shift 2 ;;
    --path) PATHKEY="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "predict-table: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
TRANSPORT=ucx
[ "$PATHKEY" = cuda-batch ] && TRANSPORT=cuda-batch
mkdir -p "$OUT"
RATES="$OUT/rates-$PATHKEY.json"
"$KVX" calibrate --path "$PATHKEY" --out "$RATES"
"$KVX" calibrate --path "$PATHKEY" --out "$OUT/rates-$PATHKEY-again.json" --compare "$RATES" | tee "$OUT/stability-$PATHKEY.txt"

# `--verify sample` (1 block in 16 checked): with `--verify full` the fill and check of every byte
# run beside other ranks' and requests' transfers on this host and are measured with them
# (`prediction.shared_host` in a run's summary says so); the model predicts transfers.
VERIFY=sample

# The 12 shapes, fixed before any fit: name model p_tp d_tp prompt_len concurrency [extra flags].
SHAPES=(
  "llama8b-1to1-2k      llama-3.1-8b        1 1 2048  1"
  "llama8b-1to1-32k     llama-3.1-8b        1 1 32768 1"
  "llama8b-2to4-8k-c2   llama-3.1-8b        2 4 8192  2"
  "llama70b-8to2-2k     llama-3.1-70b       8 2 2048  1"
  "llama70b-4to2-8k     llama-3.1-70b       4 2 8192  1"
  "llama70b-2to4-2k-c2  llama-3.1-70b       2 4 2048  2"
  "qwen3next-1to1-32k   qwen3-next-80b-a3b  1 1 32768 1"
  "qwen3next-4to2-32k   qwen3-next-80b-a3b  4 2 32768 1 --block-size 576"
  "nemotronh-2to4-8k    nemotron-h-8b       2 4 8192  1"
  "nemotronh-4to2-32k-c2 nemotron-h-8b      4 2 32768 2"
  "gptoss-8to2-8k-hma   gpt-oss-120b        8 2 8192  1 --hma on"
  "dsv3mla-4to2-2k-c2   deepseek-v3         4 2 2048  2"
)
RUNS=$(mktemp -d)
trap 'rm -rf "$RUNS"' EXIT
for s in "${SHAPES[@]}"; do
  read -r name model ptp dtp len conc extra <<<"$s"
  echo "predict-table: $name" >&2
  # shellcheck disable=SC2086
  "$KVX" bench --model "$model" --p-tp "$ptp" --d-tp "$dtp" --prompt-len "$len" --concurrency "$conc" \
    --requests 8 --warmup 2 --no-calibrate --verify "$VERIFY" --mem "$MEM" --transport "$TRANSPORT" --rates "$RATES" \
    --results-dir "$RUNS/runs" --name "$name" --format json $extra > "$RUNS/$name.json" \
    || echo "{\"failed\": true}" > "$RUNS/$name.json"
done
python3 - "$RUNS" "$OUT/table-$PATHKEY.json" "$RATES" "$VERIFY" "${SHAPES[@]}" <<'PY'
import json, sys
runs, out, rates, verify = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
rows = []
for s in sys.argv[5:]:
    f = s.split()
    name, model, ptp, dtp, length, conc = f[:6]
    row = {"shape": name, "model": model, "p_tp": int(ptp), "d_tp": int(dtp), "prompt_len": int(length),
           "concurrency": int(conc), "flags": " ".join(f[6:])}
    try:
        summary = json.load(open(f"{runs}/{name}.json"))
    except Exception as e:  # a run that printed no summary
        summary = {"failed": True, "why": str(e)}
    p = summary.get("prediction")
    if p is None:
        row["failed"] = True
    else:
        row.update({
            "predicted_span_p50_us": round(p["transfer_span_p50_us"], 1),
            "measured_span_p50_us": round(p["measured_transfer_span_p50_us"], 1),
            "ratio_p50": round(p["ratio"], 3),
            "predicted_span_p90_us": round(p["transfer_span_p90_us"], 1),
            "measured_span_p90_us": round(p["measured_transfer_span_p90_us"], 1),
            "ratio_p90": round(p["ratio_p90"], 3),
            # The slowest rank's own transfer (p50) beside the busiest rank's prediction, and
            # how far apart the ranks started (p50): span = start skew + a rank's transfer, at most.
            "measured_rank_transfer_p50_us": round(p["measured_rank_transfer_p50_us"], 1),
            "predicted_rank_transfer_us": round(max(r["transfer_us"] for r in p["ranks"]), 1),
            "ratio_rank_p50": round(p["measured_rank_transfer_p50_us"] / max(r["transfer_us"] for r in p["ranks"]), 3),
            "measured_start_skew_p50_us": round(p.get("measured_start_skew_p50_us") or 0.0, 1),
            "bound": p["bound"], "readers": p["readers"],
            "extrapolated": p.get("extrapolated", []),
            "bytes_per_request": summary.get("bytes_per_request"),
            "within_15pct": abs(p["ratio"] - 1) <= 0.15,
        })
        # Several at once: the closed loop's range for the span (one to `concurrency` busiest-rank
        # transfers), and whether the measured p50 stayed under its top.
        if p.get("closed_loop"):
            row["span_max_us"] = round(p["closed_loop"]["span_max_us"], 1)
            row["at_most_closed_loop_max"] = p["closed_loop"]["measured_p50_at_most_max"]
    rows.append(row)
ok = [r for r in rows if not r.get("failed")]
worst = max((abs(r["ratio_p50"] - 1) for r in ok), default=None)
rates_file = json.load(open(rates))
doc = {
    "generated_by": "scripts/predict-table.sh",
    "rates": rates.split("/")[-1],
    "provenance": rates_file["provenance"],
    "verify": verify,
    "shapes": rows,
    "within_15pct": sum(1 for r in ok if r["within_15pct"]),
    "measured": len(ok),
    "worst_miss_pct": round(100 * worst, 1) if worst is not None else None,
    "rank_within_15pct": sum(1 for r in ok if abs(r["ratio_rank_p50"] - 1) <= 0.15),
    "rank_worst_miss_pct": round(100 * max((abs(r["ratio_rank_p50"] - 1) for r in ok), default=0), 1),
    "c1_within_15pct": sum(1 for r in ok if r["within_15pct"] and r["concurrency"] == 1),
    "c1_measured": sum(1 for r in ok if r["concurrency"] == 1),
    "several_at_most_max": sum(1 for r in ok if r.get("at_most_closed_loop_max")),
    "several_measured": sum(1 for r in ok if r["concurrency"] > 1),
}
json.dump(doc, open(out, "w"), indent=2)
open(out, "a").write("\n")
print(f"predict-table: spans {doc['within_15pct']} of {len(rows)} within 15% (worst miss {doc['worst_miss_pct']}%), "
      f"slowest rank's transfer {doc['rank_within_15pct']} of {len(ok)} (worst {doc['rank_worst_miss_pct']}%); {out}")
PY
