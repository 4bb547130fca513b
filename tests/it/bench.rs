//! `kvx bench` end to end: real worker processes, real UCX on loopback, real ZMQ. Every
//! run is a child process with a hard timeout; waits are on events (rows in
//! `requests.csv`, a process's exit), never on sleeps; no fixed ports (workers talk over
//! ipc:// paths and ports the kernel picks).
//!
//! Faults: a worker is SIGKILLed mid-run and the bench must still end within a bound, count
//! every request and every block, and say what died. The policy these tests pin down: once
//! a rank of either engine is gone, that engine cannot serve (every decode rank reads from
//! its prefill ranks, every request needs every decode rank), so every later request fails
//! fast with cause `peer_gone` (or is recomputed under `--on-load-failure recompute`)
//! instead of waiting for a timeout, and the run still writes a complete report.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::kvx;
use crate::procs::{
    Spawned, alive, bench_cmd, children_of, complete_rows, exclusive, n, read_rows, run_dir, signal,
    summary_json, wait_gone, wait_rows, worker_of,
};

/// A small model shape: runs take a second or two even in a debug build.
const TINY: &[&str] = &["--num-kv-heads", "4", "--layers", "2", "--head-dim", "64"];
/// [`TINY`] with 8 heads, for 8 prefill ranks of one head each.
const TINY8: &[&str] = &["--num-kv-heads", "8", "--layers", "2", "--head-dim", "64"];
/// Hard limit on one bench run (debug builds on a loaded two-core machine).
const RUN_TIMEOUT: Duration = Duration::from_secs(180);
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bench");
/// A small hybrid model (Mamba2 state, full attention, a sliding window; `n_groups` 2).
const TINY_HYBRID: &[&str] =
    &["--model", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid-model-tiny.toml")];
/// [`TINY_HYBRID`] with `n_groups` 8 and no window: at prefill TP 8 its KV heads are replicated.
const TINY_HYBRID_G8: &[&str] =
    &["--model", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid-model-tiny-g8.toml")];
/// [`TINY_HYBRID`] with `n_groups` 1: its B and C are replicated across TP ranks.
const TINY_HYBRID_G1: &[&str] =
    &["--model", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid-model-tiny-g1.toml")];

/// A finished run: its JSON summary (stdout), its run directory, and the temp dir holding it.
struct Run {
    summary: Value,
    dir: PathBuf,
    _results: tempfile::TempDir,
}

/// Runs a bench to completion and checks that it exited 0.
fn run_bench(case: &str, args: &[&str]) -> Run {
    let results = tempfile::tempdir().expect("temp dir");
    let mut bench = Spawned::start(case, bench_cmd(results.path(), args));
    let status = bench.expect_exit(RUN_TIMEOUT);
    assert!(status.success(), "{case}: kvx bench exited {status}; stderr:\n{}", bench.stderr());
    let summary = summary_json(&bench);
    let dir = run_dir(results.path()).unwrap_or_else(|| panic!("{case}: no run directory"));
    Run { summary, dir, _results: results }
}

/// Everything a clean run promises: every request ok and verified, every block back, and a
/// complete run directory.
fn check_clean(case: &str, run: &Run, requests: u64) {
    let s = &run.summary;
    assert_eq!(n(s, "requests_ok"), requests, "{case}: {s}");
    assert_eq!(n(s, "requests_failed"), 0, "{case}: {s}");
    assert_eq!(n(s, "requests_recomputed"), 0, "{case}: {s}");
    assert_eq!(n(s, "verify_failures"), 0, "{case}: {s}");
    assert!(n(s, "bytes_read") > 0, "{case}: {s}");
    assert_eq!(n(s, "bytes_verified"), n(s, "bytes_read"), "{case}: --verify full checks every byte read");
    assert_eq!(n(s, "blocks_leaked"), 0, "{case}: {s}");
    assert_eq!(n(s, "blocks_expired"), 0, "{case}: every request was notified, none expired");
    assert_eq!(s["partial"], false, "{case}");
    for stage in ["queue", "plan", "post", "transfer", "notify", "e2e"] {
        let st = &s["stages"][stage];
        assert_eq!(st["count"].as_u64(), Some(requests), "{case}: stage {stage}: {st}");
        for p in ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
            assert!(st[p].as_f64().is_some_and(|v| v >= 0.0), "{case}: stages.{stage}.{p}: {st}");
        }
    }
    assert!(s["stages"]["handshake"]["count"].as_u64().is_some_and(|c| c >= 1), "{case}: a handshake");
    assert!(s["ucx"]["transports"].as_array().is_some_and(|t| !t.is_empty()), "{case}: UCX transports");

    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(run.dir.join("summary.json")).expect("summary.json"))
            .expect("summary.json is JSON");
    assert_eq!(on_disk["run_id"], s["run_id"], "{case}");
    assert_eq!(on_disk["requests_ok"], s["requests_ok"], "{case}");
    assert_eq!(on_disk["partial"], false, "{case}: the final summary replaced the partial one");
    let rows = read_rows(&run.dir);
    assert_eq!(rows.len() as u64, requests, "{case}: one requests.csv row per request");
    let pull = s["scenario"]["mode"] != "push";
    for r in &rows {
        assert_eq!(r["outcome"], "ok", "{case}: {r:?}");
        assert!(r["bytes"].parse::<u64>().is_ok_and(|b| b > 0), "{case}: {r:?}");
        // Pull: each decode rank's reads, their bytes adding up to the request's.
        let reads: Vec<Vec<&str>> = r["rank_reads"].split(';').map(|x| x.split(':').collect()).collect();
        if pull {
            let bytes: u64 = reads.iter().map(|f| f[3].parse::<u64>().expect("bytes")).sum();
            assert_eq!(bytes.to_string(), r["bytes"], "{case}: rank_reads {:?}", r["rank_reads"]);
            assert_eq!(reads.len(), r["d_ranks"].split(';').count(), "{case}: a read per decode rank: {r:?}");
        }
    }
    let stages = std::fs::read_to_string(run.dir.join("stages.csv")).expect("stages.csv");
    assert!(stages.lines().count() > 1 && stages.contains("transfer"), "{case}: stages.csv:\n{stages}");
    let svgs: Vec<PathBuf> = std::fs::read_dir(&run.dir)
        .expect("run dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "svg"))
        .collect();
    assert!(!svgs.is_empty(), "{case}: SVG charts in {}", run.dir.display());
    for svg in svgs {
        let text = std::fs::read_to_string(&svg).expect("svg");
        assert!(text.contains("<svg"), "{case}: {} is an SVG", svg.display());
    }
    // The run on one page: the request waterfall and the run over time inline.
    let page = std::fs::read_to_string(run.dir.join("report.html")).expect("report.html");
    for want in ["<figure id=\"waterfall\">", "<figure id=\"over-time\">", "Scenario and environment"] {
        assert!(page.contains(want), "{case}: report.html has {want}");
    }
    if pull {
        assert!(page.contains("<figure id=\"rank-bandwidth\">"), "{case}: per-rank bandwidth");
    }
}

fn args<'a>(extra: &[&'a str], shape: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--requests", "6", "--prompt-len", "512", "--verify", "full"];
    v.extend_from_slice(shape);
    v.extend_from_slice(extra);
    v
}

macro_rules! clean_case {
    ($name:ident, $shape:expr, [$($arg:expr),* $(,)?]) => {
        #[test]
        fn $name() {
            let _turn = exclusive();
            let a = args(&[$($arg),*], $shape);
            let run = run_bench(stringify!($name), &a);
            check_clean(stringify!($name), &run, 6);
        }
    };
}

clean_case!(p2_to_d1, TINY, ["--p-tp", "2", "--d-tp", "1"]);
clean_case!(p1_to_d2, TINY, ["--p-tp", "1", "--d-tp", "2"]);
clean_case!(mla_p2_to_d1, &[], ["--model", "deepseek-v3", "--layers", "2", "--p-tp", "2", "--d-tp", "1"]);
clean_case!(mla_p1_to_d2, &[], ["--model", "deepseek-v3", "--layers", "2", "--p-tp", "1", "--d-tp", "2"]);
clean_case!(
    block_size_ratio,
    TINY,
    ["--p-tp", "1", "--d-tp", "2", "--p-block-size", "16", "--d-block-size", "32"]
);
clean_case!(vllm_019_hnd, TINY, ["--vllm", "0.19", "--layout", "HND", "--p-tp", "2", "--d-tp", "1"]);
clean_case!(open_loop_rate, TINY, ["--rate", "40", "--p-tp", "2", "--d-tp", "2"]);
clean_case!(random_alloc, TINY, ["--alloc", "random", "--p-tp", "2", "--d-tp", "2"]);

// Push mode (prefill WRITEs into decode's registered blocks): every byte verified on decode
// against its own geometry, for the shapes the issue names.
clean_case!(push_p8_to_d2, TINY8, ["--mode", "push", "--p-tp", "8", "--d-tp", "2"]);
clean_case!(push_p2_to_d4, TINY, ["--mode", "push", "--p-tp", "2", "--d-tp", "4"]);
clean_case!(
    push_mla_p2_to_d1,
    &[],
    ["--mode", "push", "--model", "deepseek-v3", "--layers", "2", "--p-tp", "2", "--d-tp", "1"]
);
clean_case!(
    push_mla_p1_to_d2,
    &[],
    ["--mode", "push", "--model", "deepseek-v3", "--layers", "2", "--p-tp", "1", "--d-tp", "2"]
);
clean_case!(push_prefix_hit, TINY, ["--mode", "push", "--p-tp", "2", "--d-tp", "2", "--prefix-hit", "0.5"]);
clean_case!(push_notify_zmq, TINY, ["--mode", "push", "--p-tp", "2", "--d-tp", "1", "--notify", "zmq"]);

/// Push and pull move the same bytes for the same scenario (each verified against decode's
/// own geometry); `--compare-modes` runs both and reports each.
#[test]
fn compare_modes_runs_pull_and_push_on_the_same_workload() {
    let _turn = exclusive();
    let a = args(&["--compare-modes", "pull,push", "--p-tp", "8", "--d-tp", "2"], TINY8);
    let run = run_bench("compare modes", &a);
    let points = run.summary["sweep"].as_array().expect("one point per mode").clone();
    let labels: Vec<&str> = points.iter().filter_map(|p| p["label"].as_str()).collect();
    assert_eq!(labels, ["pull", "push"]);
    let descs: Vec<f64> =
        points.iter().map(|p| p["descriptors_per_request"]["raw"].as_f64().expect("descriptors")).collect();
    assert_eq!(descs[0], descs[1], "no duplicate writes for 8 heads over 8 ranks: {points:?}");
    for p in &points {
        assert_eq!(p["requests_ok"], 6, "{p}");
        assert_eq!(p["requests_failed"], 0, "{p}");
    }
    assert_eq!(n(&run.summary, "verify_failures"), 0);
    assert_eq!(n(&run.summary, "bytes_verified"), n(&run.summary, "bytes_read"));
    assert!(run.dir.join("modes.svg").exists(), "a chart of the comparison");
    // Its page: the runs side by side, not their requests pooled as one run's.
    let html = std::fs::read_to_string(run.dir.join("report.html")).expect("report.html");
    let figures = crate::report::check_html(&html);
    assert_eq!(figures[0], "compare-throughput", "{figures:?}");
    assert!(
        figures.iter().any(|f| f == "latency") && figures.last().is_some_and(|f| f == "request-waterfall")
    );
    assert!(!figures.iter().any(|f| f == "over-time"), "no run over time of two runs pooled");
    for want in ["kvx bench --compare-modes run", "pull: median request", "push: median request"] {
        assert!(html.contains(want), "{want}");
    }
    check_run_charts(&run.dir);
}

/// The rules every chart of a real run keeps: at most six series overlaid.
fn check_run_charts(dir: &std::path::Path) {
    let run = kvx::report::files::load_run(dir).expect("load the run");
    let runs = kvx::report::side_charts::split_runs(&run.summary, &run.rows);
    assert!(runs.iter().all(|r| !r.rows.is_empty()), "every run's requests found");
    let series = kvx::report::side_charts::stage_cdfs(&runs, kvx::report::Stage::E2e, "");
    assert!(series.len() <= kvx::report::run_charts::MAX_SERIES);
    assert_eq!(series.len(), runs.len().min(kvx::report::run_charts::MAX_SERIES));
}

/// A sweep's page: its figures against the swept setting, each point's requests found and
/// drawn side by side (one line per point), the chart files beside it.
#[test]
fn a_sweep_page_draws_its_setting_and_its_points() {
    let _turn = exclusive();
    let tmp = tempfile::tempdir().expect("temp dir");
    let file = tmp.path().join("conc.toml");
    std::fs::write(&file, "name = \"conc\"\n[sweep]\nconcurrency = [1, 2]\n").expect("sweep file");
    let file = file.to_str().expect("utf8");
    let run = run_bench("sweep", &args(&["--sweep", file, "--p-tp", "2", "--d-tp", "1"], TINY));
    let labels: Vec<&str> =
        run.summary["sweep"].as_array().expect("points").iter().filter_map(|p| p["label"].as_str()).collect();
    assert_eq!(labels, ["concurrency=1", "concurrency=2"]);
    let html = std::fs::read_to_string(run.dir.join("report.html")).expect("report.html");
    let figures = crate::report::check_html(&html);
    assert_eq!(figures.first().map(String::as_str), Some("sweep"), "{figures:?}");
    assert!(figures.iter().any(|f| f == "request-waterfall"), "{figures:?}");
    assert!(html.contains("conc against concurrency"), "the figure against the setting");
    for svg in ["sweep.svg", "latency.svg", "request-waterfall.svg"] {
        assert!(run.dir.join(svg).exists(), "{svg}");
    }
    check_run_charts(&run.dir);
}

/// A run of three seconds or more: its time chart has at least thirty points, its latency
/// chart at most six lines, and its page every chart.
#[test]
fn a_three_second_run_has_thirty_points_over_time() {
    let _turn = exclusive();
    let mut a = vec!["--duration", "4s", "--rate", "12", "--prompt-len", "512", "--p-tp", "2", "--d-tp", "2"];
    a.extend_from_slice(TINY);
    let run = run_bench("four seconds", &a);
    let loaded = kvx::report::files::load_run(&run.dir).expect("load the run");
    assert!(loaded.summary.duration_s >= 3.0, "{}", loaded.summary.duration_s);
    let ot = kvx::report::run_charts::over_time(&loaded.summary, &loaded.rows).expect("over time");
    assert!(ot.buckets.len() >= 30, "{} points over {} s", ot.buckets.len(), loaded.summary.duration_s);
    let series = kvx::report::run_charts::latency_series(&loaded.summary, &loaded.rows);
    assert!(!series.is_empty() && series.len() <= kvx::report::run_charts::MAX_SERIES, "{}", series.len());
    let html = std::fs::read_to_string(run.dir.join("report.html")).expect("report.html");
    assert_eq!(crate::report::check_html(&html), vec!["waterfall", "latency", "rank-bandwidth", "over-time"]);
}

/// `--rounds 3`: a comparison's runs interleaved over three rounds, the order reversed in the
/// second; each point holds its rounds' throughputs, their median, and the median of the
/// rounds' ratios to the first run within their range; the table says how it was run.
#[test]
fn rounds_interleave_a_comparison_and_report_the_median_ratio() {
    let _turn = exclusive();
    let a = args(&["--compare-modes", "pull,push", "--rounds", "3", "--p-tp", "2", "--d-tp", "1"], TINY);
    let results = tempfile::tempdir().expect("temp dir");
    let mut bench = Spawned::start("rounds", bench_cmd(results.path(), &a));
    let status = bench.expect_exit(RUN_TIMEOUT);
    let err = bench.stderr();
    assert!(status.success(), "kvx bench exited {status}; stderr:\n{err}");
    let order: Vec<&str> =
        err.lines().filter_map(|l| l.split_once("--compare-modes: round ").map(|(_, rest)| rest)).collect();
    assert_eq!(
        order,
        [
            "1/3: pull (1/2)",
            "1/3: push (2/2)",
            "2/3: push (1/2)",
            "2/3: pull (2/2)",
            "3/3: pull (1/2)",
            "3/3: push (2/2)"
        ],
        "{err}"
    );
    let summary = summary_json(&bench);
    let points = summary["sweep"].as_array().expect("one point per mode").clone();
    for p in &points {
        let rounds: Vec<f64> = p["params"]["round_gbps"]
            .as_array()
            .expect("round_gbps")
            .iter()
            .filter_map(|g| g.as_f64())
            .collect();
        assert_eq!(rounds.len(), 3, "{p}");
        assert_eq!(p["params"]["rounds"], 3, "{p}");
        let mut sorted = rounds.clone();
        sorted.sort_by(f64::total_cmp);
        let gbps = p["throughput_gbps"].as_f64().expect("gbps");
        assert!((gbps - sorted[1]).abs() < 1e-3, "the median of the rounds: {gbps} of {rounds:?}");
        let (lo, mid, hi) = (
            p["params"]["ratio_to_first_min"].as_f64().expect("min"),
            p["params"]["ratio_to_first"].as_f64().expect("ratio"),
            p["params"]["ratio_to_first_max"].as_f64().expect("max"),
        );
        assert!(lo <= mid && mid <= hi && lo > 0.0, "{p}");
        assert_eq!(p["requests_ok"], 18, "three rounds of 6: {p}");
    }
    assert_eq!(points[0]["params"]["ratio_to_first"], 1.0, "the first run is the reference");
    // The page draws each round's throughput on its run's whisker.
    let dir = run_dir(results.path()).expect("run directory");
    let html = std::fs::read_to_string(dir.join("report.html")).expect("report.html");
    assert_eq!(crate::report::check_html(&html)[0], "compare-throughput");
    assert!(html.contains("3 rounds)"), "the rounds' range on the bars");
    check_run_charts(&dir);
    assert_eq!(n(&summary, "requests_ok"), 36);
    assert_eq!(n(&summary, "verify_failures"), 0);
}

/// `--kv-buffer-device cpu` (vLLM's host buffer): prefill copies each request's blocks from its
/// pool to a host buffer, decode reads host buffer to host buffer and copies into its pool, and
/// every byte is verified in decode's pool (so a copy that missed a block fails the run). Both
/// copies are their own stages, one per request; `--compare-kv-buffer-device` runs the direct
/// path and the staged one on the same workload.
#[test]
fn host_buffers_stage_every_block_and_time_both_copies() {
    let _turn = exclusive();
    let a = args(&["--kv-buffer-device", "cpu", "--p-tp", "2", "--d-tp", "1"], TINY);
    let run = run_bench("host buffer", &a);
    check_clean("host buffer", &run, 6);
    let s = &run.summary;
    assert!(s["scenario"]["kv_buffer_device"].as_str().is_some_and(|t| t.contains("memcpy")), "{s}");
    for stage in ["save_to_host", "sync_to_device"] {
        assert_eq!(s["stages"][stage]["count"].as_u64(), Some(6), "{stage}: {s}");
        assert!(s["stages"][stage]["min_us"].as_f64().is_some_and(|v| v > 0.0), "{stage}: {s}");
    }

    let a = args(&["--compare-kv-buffer-device", "cuda,cpu", "--p-tp", "2", "--d-tp", "1"], TINY);
    let run = run_bench("compare kv buffer", &a);
    let points = run.summary["sweep"].as_array().expect("one point per buffer").clone();
    let labels: Vec<&str> = points.iter().filter_map(|p| p["label"].as_str()).collect();
    assert_eq!(labels, ["cuda", "cpu"]);
    for p in &points {
        assert_eq!(p["requests_ok"], 6, "{p}");
        assert_eq!(p["requests_failed"], 0, "{p}");
    }
    assert_eq!(n(&run.summary, "verify_failures"), 0);
    assert_eq!(n(&run.summary, "bytes_verified"), n(&run.summary, "bytes_read"));
    assert!(run.dir.join("kv-buffer.svg").exists(), "a chart of the comparison");
}

// Concurrent dispatch: decode registers before prefill answered (push needs only its identity).
clean_case!(
    push_concurrent_dispatch,
    TINY,
    [
        "--mode",
        "push",
        "--p-tp",
        "2",
        "--d-tp",
        "1",
        "--dispatch",
        "concurrent",
        "--prefill-time-per-layer",
        "2ms"
    ]
);

// A prefill that computes for longer than the lease (400 ms against 300 ms): the lease runs
// from the end of the prefill, as vLLM's abort timeout does, so no block is freed under its
// reader (before, every request failed with its blocks freed by lease expiry).
clean_case!(
    lease_runs_from_the_end_of_prefill,
    TINY,
    ["--p-tp", "2", "--d-tp", "1", "--prefill-time-per-layer", "200ms", "--lease", "300ms"]
);
clean_case!(
    push_lease_runs_from_the_end_of_prefill,
    TINY,
    ["--mode", "push", "--p-tp", "2", "--d-tp", "1", "--prefill-time-per-layer", "200ms", "--lease", "300ms"]
);

/// `--overlap layers`: each layer's slice of the blocks is written as the simulated prefill
/// computes it; every byte still lands (verified on decode), the WRITE time spent while prefill
/// computed is reported, and the KV-ready stage covers prefill and transfer.
#[test]
fn push_overlap_writes_layer_by_layer_while_prefill_computes() {
    let _turn = exclusive();
    let a = args(
        &[
            "--mode",
            "push",
            "--p-tp",
            "8",
            "--d-tp",
            "2",
            "--overlap",
            "layers",
            "--prefill-time-per-layer",
            "5ms",
        ],
        TINY8,
    );
    let run = run_bench("push overlap", &a);
    check_clean("push overlap", &run, 6);
    let s = &run.summary;
    assert_eq!(s["scenario"]["overlap"], "layers", "{s}");
    assert_eq!(s["scenario"]["dispatch"], "concurrent", "the default with --overlap layers");
    let stage = |name: &str, p: &str| s["stages"][name][p].as_f64().unwrap_or_else(|| panic!("{name}: {s}"));
    assert_eq!(s["stages"]["push_hidden"]["count"].as_u64(), Some(6), "{s}");
    assert_eq!(s["stages"]["push_write"]["count"].as_u64(), Some(6), "{s}");
    // A request's KV is ready no sooner than its prefill of 2 layers x 5 ms computed.
    assert!(stage("kv_ready", "min_us") >= 10_000.0, "{s}");
    let notes = s["notes"].as_array().expect("notes");
    assert!(
        notes.iter().any(|n| n.as_str().is_some_and(|t| t.contains("ran while prefill computed"))),
        "the hidden share is reported: {notes:?}"
    );
}

#[test]
fn push_refusals_name_their_flag() {
    for (extra, flag) in [
        (&["--mode", "push", "--p-block-size", "16", "--d-block-size", "32"][..], "--d-block-size"),
        (&["--mode", "push", "--transport", "storage"][..], "--transport"),
        (&["--mode", "push", "--vllm", "0.19"][..], "--vllm"),
        (&["--overlap", "layers"][..], "--overlap"),
        (&["--dispatch", "concurrent"][..], "--dispatch"),
        (&["--mode", "push", "--overlap", "layers", "--dispatch", "sequential"][..], "--dispatch"),
        (&["--mode", "push", "--overlap", "layers", "--layout", "BHLNC"][..], "--layout"),
        (&["--mode", "push", "--prefill-time-per-layer", "-1ms"][..], "--prefill-time-per-layer"),
    ] {
        let out = kvx().arg("bench").args(extra).args(["--requests", "1"]).output().expect("run");
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{extra:?} names {flag}: {stderr}");
    }
}

#[test]
fn prefix_hit_reads_only_the_missing_blocks() {
    let _turn = exclusive();
    let full = run_bench("prefix 0", &args(&["--p-tp", "2", "--d-tp", "1"], TINY));
    let half = run_bench("prefix 0.5", &args(&["--p-tp", "2", "--d-tp", "1", "--prefix-hit", "0.5"], TINY));
    check_clean("prefix 0.5", &half, 6);
    // 512 tokens are 32 decode blocks; a 0.5 hit leaves 16 to read.
    assert_eq!(n(&half.summary, "bytes_read") * 2, n(&full.summary, "bytes_read"));
    for r in read_rows(&half.dir) {
        assert_eq!(r["blocks"], "16", "{r:?}");
    }
}

#[test]
fn fragmented_allocation_reads_the_same_bytes_in_more_descriptors() {
    let _turn = exclusive();
    let shape = ["--p-tp", "2", "--d-tp", "2"];
    let contiguous = run_bench("contiguous", &args(&shape, TINY));
    let mut frag_args = args(&shape, TINY);
    frag_args.extend(["--alloc", "fragmented"]);
    let fragmented = run_bench("fragmented", &frag_args);
    check_clean("contiguous", &contiguous, 6);
    check_clean("fragmented", &fragmented, 6);
    let d = |r: &Run, k: &str| r.summary["descriptors_per_request"][k].as_f64().expect("descriptors");
    assert_eq!(n(&contiguous.summary, "bytes_read"), n(&fragmented.summary, "bytes_read"));
    assert_eq!(
        d(&contiguous, "raw"),
        d(&fragmented, "raw"),
        "vLLM posts one descriptor per block either way"
    );
    assert!(
        d(&fragmented, "coalesced") > d(&contiguous, "coalesced"),
        "scattered blocks coalesce less: {} vs {}",
        d(&fragmented, "coalesced"),
        d(&contiguous, "coalesced")
    );
}

#[test]
fn config_file_with_flag_overrides_and_prompt_lengths_file() {
    let _turn = exclusive();
    let config = format!("{FIXTURES}/tiny.toml");
    let lens = format!("{FIXTURES}/prompt-lens.txt");
    let run = run_bench(
        "config",
        &["--config", &config, "--requests", "8", "--warmup", "0", "--prompt-lens", &lens, "--d-tp", "2"],
    );
    check_clean("config", &run, 8);
    let sc = &run.summary["scenario"];
    assert_eq!(sc["name"], "tiny", "the config file names the run");
    assert_eq!((sc["p_tp"].as_u64(), sc["d_tp"].as_u64()), (Some(2), Some(2)), "--d-tp overrides d_tp");
    // With no warm-up, request i has the i-th length of the file, cycled.
    let expected = [17u64, 512, 100, 300];
    for r in read_rows(&run.dir) {
        let id = &r["request_id"];
        let req: usize = id.rsplit('-').nth(1).and_then(|x| x.parse().ok()).expect("request number");
        assert_eq!(r["prompt_tokens"], expected[req % 4].to_string(), "{r:?}");
    }
}

/// Bad flags and configs: exit 2 with a message naming the flag, before any work starts
/// (the run directory, created just before the engines start their workers, never appears).
#[test]
fn bad_flags_exit_2_before_any_worker_starts() {
    let lens = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(lens.path(), "100\nlots\n").expect("write");
    let lens = lens.path().to_string_lossy().into_owned();
    let bad_config = format!("{FIXTURES}/tiny.toml.missing");
    let cases: &[(&[&str], &str)] = &[
        (&["--p-tp", "8", "--d-tp", "2", "--num-kv-heads", "4"], "--p-tp"),
        (&["--prefix-hit", "2"], "--prefix-hit"),
        (&["--prefix-hit", "-0.5"], "--prefix-hit"),
        (&["--transport", "bogus"], "--transport"),
        (&["--rate", "-1"], "--rate"),
        (&["--rate", "0"], "--rate"),
        (&["--concurrency", "0"], "--concurrency"),
        (&["--requests", "0"], "--requests"),
        (&["--duration", "0s"], "--duration"),
        (&["--alloc", "weird"], "--alloc"),
        (&["--verify", "maybe"], "--verify"),
        (&["--on-load-failure", "retry"], "--on-load-failure"),
        (&["--lease", "0s"], "--lease"),
        (&["--timeout", "0s"], "--timeout"),
        (&["--mem", "cuda"], "--mem"),
        (&["--err-mode", "x"], "--err-mode"),
        (&["--progress", "x"], "--progress"),
        (&["--inflight", "0"], "--inflight"),
        (&["--slowdown", "nan"], "--slowdown"),
        (&["--slowdown", "11"], "--slowdown"),
        (&["--prompt-len", "0"], "--prompt-len"),
        (&["--prompt-lens", &lens], "--prompt-lens"),
        (&["--repeat", "0"], "--repeat"),
        (&["--pool-blocks", "1", "--prompt-len", "1024"], "--pool-blocks"),
        (&["--config", &bad_config], "--config"),
        (&["--listen", "bogus"], "--listen"),
        (&["--listen", "tcp://10.0.0.1:65535"], "--listen"),
        (&["--p-block-size", "32", "--d-block-size", "16"], "--d-block-size"),
        (&["--model", "gpt-5"], "--model"),
    ];
    for (extra, flag) in cases {
        let results = tempfile::tempdir().expect("temp dir");
        let root = results.path().join("results");
        let out = kvx()
            .arg("bench")
            .args(*extra)
            .arg("--results-dir")
            .arg(&root)
            .arg("--no-calibrate")
            .timeout(Duration::from_secs(30))
            .output()
            .expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?} should exit 2; stderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{extra:?} panicked: {stderr}");
        assert!(stderr.contains(flag), "{extra:?}: the message should name {flag}: {stderr}");
        assert!(!root.exists(), "{extra:?}: no run directory (no engine, no worker) for a bad flag");
        assert!(!stderr.contains("[P0]"), "{extra:?}: no worker started: {stderr}");
    }
}

/// What a fault run observed.
struct Fault {
    summary: Value,
    rows: Vec<std::collections::BTreeMap<String, String>>,
    /// Rows (request ids) that were finished before the kill.
    before: Vec<String>,
    stderr: String,
}

/// Starts a long bench, waits for `rows_first` rows, SIGKILLs the worker of `role`/`rank`,
/// and waits for the bench to end within `bound` of the kill.
fn kill_mid_run(case: &str, extra: &[&str], role: &str, rank: u32, bound: Duration) -> Fault {
    let results = tempfile::tempdir().expect("temp dir");
    let mut a =
        vec!["--requests", "3000", "--concurrency", "2", "--prompt-len", "1024", "--verify", "sample"];
    a.extend_from_slice(TINY);
    a.extend_from_slice(extra);
    let mut bench = Spawned::start(case, bench_cmd(results.path(), &a));
    let run = wait_rows(&mut bench, results.path(), 8, RUN_TIMEOUT);
    let workers: Vec<u32> = children_of(bench.pid).iter().map(|p| p.pid).collect();
    let victim = worker_of(bench.pid, role, rank)
        .unwrap_or_else(|| panic!("{case}: no live {role} rank {rank} worker among {workers:?}"));
    let before: Vec<String> = read_rows(&run).into_iter().map(|r| r["request_id"].clone()).collect();
    assert!(signal(victim.pid as i32, libc::SIGKILL), "{case}: kill {}", victim.pid);
    let killed_at = Instant::now();
    let status = bench.expect_exit(bound);
    let took = killed_at.elapsed();
    eprintln!("{case}: the bench ended {took:?} after the kill");
    // A worker killed from outside (no --fault) fails requests: the run completed with failed
    // (or recomputed) requests, exit 1, and stderr says how many.
    assert_eq!(
        status.code(),
        Some(1),
        "{case}: the bench reports the failed requests and exits 1, got {status}:\n{}",
        bench.stderr()
    );
    let says = |l: &str| l.contains("of 3000 requests");
    assert!(
        bench.stderr().contains("of 3000 requests")
            || bench.wait_line(Duration::from_secs(5), says).is_some(),
        "{case}: says how many failed:\n{}",
        bench.stderr()
    );
    for pid in workers {
        assert!(!alive(pid), "{case}: worker {pid} outlived the bench");
    }
    let summary = summary_json(&bench);
    let rows = read_rows(&run);
    assert!(
        (before.len() as u64) < 3000 && complete_rows(&run) == 3000,
        "{case}: every request has a row, also those after the kill (kill at row {}, {took:?} to end)",
        before.len()
    );
    Fault { summary, rows, before, stderr: bench.stderr() }
}

/// Checks shared by both fault runs: every request is counted once, the requests finished
/// before the kill stayed ok, later ones failed fast with a cause, no block leaked.
fn check_fault(case: &str, f: &Fault, failed_outcome: &str) {
    let s = &f.summary;
    let (ok, failed, recomputed) =
        (n(s, "requests_ok"), n(s, "requests_failed"), n(s, "requests_recomputed"));
    assert_eq!(ok + failed + recomputed, 3000, "{case}: every request counted once: {s}");
    assert_eq!(s["partial"], false, "{case}: a complete report");
    assert_eq!(n(s, "blocks_leaked"), 0, "{case}: every block accounted for: {s}");
    assert_eq!(n(s, "verify_failures"), 0, "{case}: {s}");
    let by_id: std::collections::HashMap<&str, &std::collections::BTreeMap<String, String>> =
        f.rows.iter().map(|r| (r["request_id"].as_str(), r)).collect();
    assert_eq!(by_id.len(), 3000, "{case}: one row per request");
    for id in &f.before {
        assert_eq!(by_id[id.as_str()]["outcome"], "ok", "{case}: {id} finished before the kill and stays ok");
    }
    let not_ok = f.rows.iter().filter(|r| r["outcome"] != "ok").count() as u64;
    assert_eq!(not_ok, failed + recomputed, "{case}");
    assert!(not_ok > 0, "{case}: requests after the kill cannot succeed: {s}");
    // Only requests in flight around the kill (concurrency 2: those finishing between the
    // snapshot and the kill, those in flight at the kill) may still succeed.
    assert!(ok <= f.before.len() as u64 + 4, "{case}: ok {ok}, {} finished before the kill", f.before.len());
    eprintln!("{case}: {} ok before the kill, {ok} ok in all, {not_ok} not ok", f.before.len());
    for r in f.rows.iter().filter(|r| r["outcome"] != "ok") {
        assert_eq!(r["outcome"], failed_outcome, "{case}: {r:?}");
        assert!(
            ["peer_gone", "transfer", "timeout", "notify"].contains(&r["failure_cause"].as_str()),
            "{case}: a failed request names its cause: {r:?}"
        );
    }
    let causes = &s["failures_by_cause"];
    let peer_gone = causes["peer_gone"].as_u64().unwrap_or(0);
    assert!(peer_gone + 2 >= not_ok, "{case}: later requests fail fast as peer_gone: {causes}");
    let total: u64 = causes.as_object().expect("failures_by_cause").values().filter_map(Value::as_u64).sum();
    assert_eq!(total, not_ok, "{case}: failures_by_cause adds up: {causes}");
    assert!(!f.stderr.contains("panicked"), "{case}: {}", f.stderr);
}

fn notes(s: &Value) -> String {
    s["notes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"))
        .unwrap_or_default()
}

/// After the kill, the bench ends within 5 s: the engine sees its worker's process end at
/// once, fails what needed it, later requests fail without waiting, failed loads release
/// their prefill blocks (no lease is waited out), and the workers shut down.
const FAULT_BOUND: Duration = Duration::from_secs(5);

#[test]
fn killed_prefill_worker_fails_later_requests_fast_and_accounts_every_block() {
    let _turn = exclusive();
    let extra = ["--p-tp", "2", "--d-tp", "2", "--timeout", "2s", "--lease", "3s"];
    let f = kill_mid_run("kill P1", &extra, "prefill", 1, FAULT_BOUND);
    check_fault("kill P1", &f, "failed");
    let s = &f.summary;
    assert_eq!(n(s, "requests_recomputed"), 0);
    let notes = notes(s);
    assert!(
        notes.contains("ranks that died: prefill [1], decode []"),
        "exactly the killed rank is reported dead (a clean shutdown is no death): {notes}"
    );
    assert!(notes.contains("blocks written off"), "{notes}");
    assert!(f.stderr.contains("prefill rank 1 is gone"), "the user is told what died:\n{}", f.stderr);
}

#[test]
fn killed_prefill_worker_with_recompute_policy_recomputes() {
    let _turn = exclusive();
    let extra =
        ["--p-tp", "2", "--d-tp", "1", "--timeout", "2s", "--lease", "3s", "--on-load-failure", "recompute"];
    let f = kill_mid_run("kill P0, recompute", &extra, "prefill", 0, FAULT_BOUND);
    check_fault("kill P0, recompute", &f, "recomputed");
    assert_eq!(n(&f.summary, "requests_failed"), 0, "recomputed requests are not failures");
    assert!(n(&f.summary, "requests_recomputed") > 0);
    assert!(notes(&f.summary).contains("ranks that died: prefill [0], decode []"), "{}", notes(&f.summary));
}

#[test]
fn killed_decode_worker_frees_prefill_blocks_at_once() {
    let _turn = exclusive();
    // A lease longer than the bound: a block left to expire would fail the bound.
    let extra = ["--p-tp", "1", "--d-tp", "2", "--timeout", "2s", "--lease", "30s"];
    let f = kill_mid_run("kill D1", &extra, "decode", 1, FAULT_BOUND);
    check_fault("kill D1", &f, "failed");
    let s = &f.summary;
    assert_eq!(
        n(s, "blocks_expired"),
        0,
        "failed loads release their prefill blocks, none waits for its lease: {s}"
    );
    let notes = notes(s);
    assert!(notes.contains("ranks that died: prefill [], decode [1]"), "{notes}");
    assert!(f.stderr.contains("decode rank 1 is gone"), "the user is told what died:\n{}", f.stderr);
}

/// The run directory of a bench killed outright keeps every row it wrote and a partial
/// summary (the report's promise for a run killed half-way).
#[test]
fn killed_bench_keeps_its_partial_results() {
    let _turn = exclusive();
    let results = tempfile::tempdir().expect("temp dir");
    let mut a = vec!["--requests", "3000", "--prompt-len", "1024", "--verify", "off", "--p-tp", "2"];
    a.extend_from_slice(TINY);
    let mut bench = Spawned::start("killed bench", bench_cmd(results.path(), &a));
    let run = wait_rows(&mut bench, results.path(), 5, RUN_TIMEOUT);
    bench.kill_group();
    bench.expect_exit(Duration::from_secs(30));
    let rows = read_rows(&run);
    assert!(rows.len() >= 5 && rows.iter().all(|r| r["outcome"] == "ok"), "{} rows", rows.len());
    let partial: Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).expect("a partial summary.json"))
            .expect("JSON");
    assert_eq!(partial["partial"], true, "{partial}");
}

/// Workers do not outlive the bench that spawned them, even one killed outright (no
/// shutdown message ever reaches them).
#[test]
fn workers_exit_when_their_bench_is_killed() {
    let _turn = exclusive();
    let results = tempfile::tempdir().expect("temp dir");
    let mut a =
        vec!["--requests", "3000", "--prompt-len", "1024", "--verify", "off", "--p-tp", "2", "--d-tp", "2"];
    a.extend_from_slice(TINY);
    let mut bench = Spawned::start("bench killed alone", bench_cmd(results.path(), &a));
    wait_rows(&mut bench, results.path(), 5, RUN_TIMEOUT);
    let workers: Vec<u32> = children_of(bench.pid).iter().map(|p| p.pid).collect();
    assert_eq!(workers.len(), 4, "two prefill and two decode workers");
    assert!(signal(bench.pid as i32, libc::SIGKILL), "kill the bench alone, not its process group");
    bench.expect_exit(Duration::from_secs(30));
    let left = wait_gone(&workers, Duration::from_secs(20));
    assert!(left.is_empty(), "workers {left:?} outlived their bench");
}

/// A prefill worker that stalls (SIGSTOP) but does not die: requests time out, the other
/// rank's lease runs out first (it frees its share while the request still waits for the
/// stalled rank), and once the worker resumes the run finishes with every block back.
#[test]
fn stalled_prefill_worker_times_out_requests_and_leaks_no_block() {
    let _turn = exclusive();
    let results = tempfile::tempdir().expect("temp dir");
    let mut a =
        vec!["--requests", "300", "--prompt-len", "1024", "--verify", "sample", "--p-tp", "2", "--d-tp", "1"];
    a.extend_from_slice(&["--timeout", "1s", "--lease", "1s"]);
    a.extend_from_slice(TINY);
    let mut bench = Spawned::start("stalled P1", bench_cmd(results.path(), &a));
    let run = wait_rows(&mut bench, results.path(), 5, RUN_TIMEOUT);
    let p1 = worker_of(bench.pid, "prefill", 1).expect("prefill rank 1");
    assert!(signal(p1.pid as i32, libc::SIGSTOP));
    // Resume it once a request has timed out on it (the engine waits 4 x --timeout).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !read_rows(&run).iter().any(|r| r["failure_cause"] == "timeout") {
        assert!(Instant::now() < deadline, "no request timed out on the stalled rank");
        assert!(bench.wait_exit(Duration::ZERO).is_none(), "bench ended early:\n{}", bench.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(signal(p1.pid as i32, libc::SIGCONT));
    let status = bench.expect_exit(RUN_TIMEOUT);
    // Requests timed out: the run completed with failed requests, exit 1.
    assert_eq!(status.code(), Some(1), "{status}:\n{}", bench.stderr());
    let s = summary_json(&bench);
    assert_eq!(n(&s, "requests_ok") + n(&s, "requests_failed"), 300, "{s}");
    assert!(s["failures_by_cause"]["timeout"].as_u64().is_some_and(|t| t > 0), "{s}");
    assert_eq!(n(&s, "blocks_leaked"), 0, "{s}");
    assert!(n(&s, "blocks_expired") > 0, "the waiting rank's lease ran out: {s}");
    assert!(!notes(&s).contains("ranks that died"), "a stalled rank is not dead: {}", notes(&s));
    assert!(n(&s, "requests_ok") > 5 + 2, "requests after the resume succeed: {s}");
}

/// `--fault exit:d1@5`: decode rank 1 exits after 5 measured requests. Every later request
/// fails the way a lost peer fails, and that is the failure policy holding: exit 0, with the
/// summary's counters saying the fault explains every failure (see `report::verdict`).
#[test]
fn a_fault_that_explains_every_failure_exits_0() {
    let _turn = exclusive();
    let results = tempfile::tempdir().expect("temp dir");
    let mut a = vec!["--requests", "30", "--concurrency", "2", "--prompt-len", "1024", "--verify", "full"];
    a.extend_from_slice(&["--p-tp", "1", "--d-tp", "2", "--timeout", "2s", "--lease", "2s"]);
    a.extend_from_slice(&["--fault", "exit:d1@5"]);
    a.extend_from_slice(TINY);
    let mut bench = Spawned::start("fault exit:d1@5", bench_cmd(results.path(), &a));
    let status = bench.expect_exit(RUN_TIMEOUT);
    assert_eq!(status.code(), Some(0), "the failure policy held: {status}\n{}", bench.stderr());
    let s = summary_json(&bench);
    let not_ok = n(&s, "requests_failed") + n(&s, "requests_recomputed");
    assert!(not_ok > 0, "requests after the fault fail: {s}");
    assert_eq!(n(&s, "requests_ok") + not_ok, 30, "{s}");
    assert_eq!(s["counters"]["fault_injected"], 1, "{s}");
    assert_eq!(s["counters"]["failures_after_fault"].as_u64(), Some(not_ok), "the fault explains all: {s}");
    assert_eq!(n(&s, "verify_failures"), 0, "{s}");
    assert_eq!(n(&s, "blocks_leaked"), 0, "{s}");
}

/// The fault matrix of `--fault`: each fault ends the run within 5 s of its injection (the
/// engines detect it at once: a worker's process ends, or a rank reports its UCX side torn
/// down), with the failure policy holding (exit 0: only requests after the fault failed, as a
/// lost peer fails), every request counted, no wrong byte, no leaked block, no process and
/// no temp file left behind.
#[test]
fn each_fault_ends_the_run_within_5_s_with_the_policy_held() {
    const OVERLAP: &[&str] = &["--mode", "push", "--overlap", "layers", "--prefill-time-per-layer", "1ms"];
    const NIXL: &[&str] = &["--transport", "nixl"];
    const NIXL_PUSH: &[&str] = &["--transport", "nixl", "--mode", "push"];
    let cases: [(&str, Vec<&str>); 22] = [
        ("kill-ucx:p1@5, err-mode none", vec!["--fault", "kill-ucx:p1@5", "--err-mode", "none"]),
        ("kill-ucx:p1@5, err-mode peer", vec!["--fault", "kill-ucx:p1@5", "--err-mode", "peer"]),
        ("exit:p0@5", vec!["--fault", "exit:p0@5"]),
        ("exit:d1@5", vec!["--fault", "exit:d1@5"]),
        ("push, kill-ucx:p1@5", vec!["--mode", "push", "--fault", "kill-ucx:p1@5"]),
        ("push, exit:p0@5", vec!["--mode", "push", "--fault", "exit:p0@5"]),
        ("push, exit:d1@5", vec!["--mode", "push", "--fault", "exit:d1@5"]),
        // Layer overlap: WRITEs under way while prefill computes, both legs sent at once.
        ("push overlap, kill-ucx:p1@5", [OVERLAP, &["--fault", "kill-ucx:p1@5"]].concat()),
        ("push overlap, exit:p0@5", [OVERLAP, &["--fault", "exit:p0@5"]].concat()),
        ("push overlap, exit:d1@5", [OVERLAP, &["--fault", "exit:d1@5"]].concat()),
        // A hybrid model (state and attention groups from one pool, vLLM's hybrid descriptors).
        ("hybrid, kill-ucx:p1@5", [TINY_HYBRID, &["--fault", "kill-ucx:p1@5"]].concat()),
        ("hybrid, exit:p0@5", [TINY_HYBRID, &["--fault", "exit:p0@5"]].concat()),
        ("hybrid, exit:d1@5", [TINY_HYBRID, &["--fault", "exit:d1@5"]].concat()),
        // Its push mode: per-group registrations, WRITEs planned on the prefill side.
        (
            "hybrid push, kill-ucx:p1@5",
            [TINY_HYBRID, &["--mode", "push", "--fault", "kill-ucx:p1@5"]].concat(),
        ),
        ("hybrid push, exit:p0@5", [TINY_HYBRID, &["--mode", "push", "--fault", "exit:p0@5"]].concat()),
        ("hybrid push, exit:d1@5", [TINY_HYBRID, &["--mode", "push", "--fault", "exit:d1@5"]].concat()),
        // Through NIXL (vLLM's transport): its UCX backend's own error mode (peer), its transfer
        // state reporting the lost remote.
        ("nixl, kill-ucx:p1@5", [NIXL, &["--fault", "kill-ucx:p1@5"]].concat()),
        ("nixl, exit:p0@5", [NIXL, &["--fault", "exit:p0@5"]].concat()),
        ("nixl, exit:d1@5", [NIXL, &["--fault", "exit:d1@5"]].concat()),
        // Push through NIXL: WRITEs carrying vLLM's notification, registrations as NIXL
        // notifications.
        ("nixl push, kill-ucx:p1@5", [NIXL_PUSH, &["--fault", "kill-ucx:p1@5"]].concat()),
        ("nixl push, exit:p0@5", [NIXL_PUSH, &["--fault", "exit:p0@5"]].concat()),
        ("nixl push, exit:d1@5", [NIXL_PUSH, &["--fault", "exit:d1@5"]].concat()),
    ];
    for (case, fault) in cases {
        let _turn = exclusive();
        let results = tempfile::tempdir().expect("temp dir");
        let tmp = tempfile::tempdir().expect("TMPDIR of the bench");
        let mut a =
            vec!["--requests", "400", "--concurrency", "2", "--prompt-len", "1024", "--verify", "full"];
        // A lease and a timeout far above the bound: waiting out either would fail it.
        a.extend_from_slice(&["--p-tp", "2", "--d-tp", "2", "--timeout", "10s", "--lease", "30s"]);
        a.extend_from_slice(&fault);
        if !case.starts_with("hybrid") {
            a.extend_from_slice(TINY);
        }
        let mut cmd = bench_cmd(results.path(), &a);
        cmd.env("TMPDIR", tmp.path());
        let mut bench = Spawned::start(case, cmd);
        let injected = bench.wait_line(RUN_TIMEOUT, |l| l.contains("injecting"));
        assert!(injected.is_some(), "{case}: the fault was never injected:\n{}", bench.stderr());
        let at = Instant::now();
        let status = bench.expect_exit(RUN_TIMEOUT);
        let took = at.elapsed();
        eprintln!("{case}: the bench ended {took:?} after the fault was injected");
        assert_eq!(status.code(), Some(0), "{case}: the failure policy held: {status}\n{}", bench.stderr());
        assert!(took <= FAULT_BOUND, "{case}: {took:?} from the fault to the end");
        let s = summary_json(&bench);
        let not_ok = n(&s, "requests_failed") + n(&s, "requests_recomputed");
        assert!(not_ok > 0, "{case}: requests after the fault fail: {s}");
        assert_eq!(n(&s, "requests_ok") + not_ok, 400, "{case}: every request counted: {s}");
        assert_eq!(s["counters"]["failures_after_fault"].as_u64(), Some(not_ok), "{case}: {s}");
        assert_eq!(n(&s, "verify_failures"), 0, "{case}: {s}");
        assert_eq!(n(&s, "blocks_leaked"), 0, "{case}: {s}");
        assert_eq!(n(&s, "blocks_expired"), 0, "{case}: no lease was waited out: {s}");
        assert!(!signal(-(bench.pid as i32), 0), "{case}: a process of the bench outlived it");
        let left: Vec<_> =
            std::fs::read_dir(tmp.path()).expect("tmp").flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "{case}: temp files left behind: {left:?}");
    }
}

/// Hybrid models through real processes: at each TP pair vLLM accepts for the tiny hybrid
/// model (Mamba2 `n_groups` 2, full attention, a 64-token window), with prefix hits and
/// prompts over several blocks, every request is read by vLLM's hybrid descriptors and every
/// byte read is checked against what its position means; nothing leaks. A pair vLLM refuses
/// exits 2 naming the flag.
#[test]
fn hybrid_models_move_verified_at_every_accepted_tp_pair() {
    for (p, d) in [(1, 1), (1, 2), (2, 1), (2, 2)] {
        let case = format!("tiny hybrid P{p} D{d}");
        let (p, d) = (p.to_string(), d.to_string());
        let mut a =
            vec!["--requests", "6", "--prompt-len", "100..1200", "--prefix-hit", "0.3", "--verify", "full"];
        a.extend_from_slice(&["--p-tp", &p, "--d-tp", &d]);
        a.extend_from_slice(TINY_HYBRID);
        let run = run_bench(&case, &a);
        check_clean(&case, &run, 6);
        // What was read, per group and part: state and attention both, adding up to the bytes.
        let parts = run.summary["hybrid_parts"].as_array().cloned().unwrap_or_default();
        let sum: u64 = parts.iter().filter_map(|p| p["bytes"].as_u64()).sum();
        assert_eq!(sum, n(&run.summary, "bytes_read"), "{case}: {parts:?}");
        for part in ["attention", "mamba_conv_x", "mamba_ssm"] {
            assert!(parts.iter().any(|p| p["part"] == part), "{case}: {part} in {parts:?}");
        }
    }
    let out = kvx()
        .args(["bench", "--p-tp", "1", "--d-tp", "4", "--requests", "1"])
        .args(TINY_HYBRID)
        .timeout(Duration::from_secs(60))
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--d-tp") && err.contains("n_groups"), "{err}");
}

/// Hybrid models in push mode between real processes (vLLM 0.33's `NixlPushConnector`): decode
/// registers its clipped per-group lists, each prefill rank plans and WRITEs them, decode
/// checks every block of the request in its pool by meaning. At each TP pair of the tiny model,
/// with prefix hits, every byte lands and nothing leaks. With heads replicated over prefill
/// ranks every prefill rank writes its copy (more bytes written than the pool holds), and with
/// decode TP above prefill TP and the KV heads vLLM's rule leaves decode ranks without
/// attention: the run exits 1 naming the rule and its switch, and with the switch it is clean.
#[test]
fn hybrid_models_push_verified_and_vllms_attention_rule_is_named() {
    let _turn = exclusive();
    for (p, d) in [(1, 1), (2, 1), (1, 2)] {
        let case = format!("tiny hybrid push P{p} D{d}");
        let (p, d) = (p.to_string(), d.to_string());
        let mut a = vec![
            "--mode",
            "push",
            "--requests",
            "6",
            "--prompt-len",
            "100..1200",
            "--prefix-hit",
            "0.3",
            "--verify",
            "full",
        ];
        a.extend_from_slice(&["--p-tp", &p, "--d-tp", &d]);
        a.extend_from_slice(TINY_HYBRID);
        let run = run_bench(&case, &a);
        check_clean(&case, &run, 6);
        let parts = run.summary["hybrid_parts"].as_array().cloned().unwrap_or_default();
        let sum: u64 = parts.iter().filter_map(|p| p["bytes"].as_u64()).sum();
        assert_eq!(sum, n(&run.summary, "bytes_read"), "{case}: {parts:?}");
    }
    let a =
        ["--mode", "push", "--requests", "3", "--warmup", "0", "--prompt-len", "300", "--block-size", "64"];
    // Prefill TP 8 over 4 KV heads: two prefill ranks write each head, the same bytes.
    let case = "push P8 D1, replicated heads";
    let run = run_bench(
        case,
        &[&a[..], TINY_HYBRID_G8, &["--p-tp", "8", "--d-tp", "1", "--verify", "full"]].concat(),
    );
    let s = &run.summary;
    assert_eq!(
        (n(s, "requests_ok"), n(s, "verify_failures"), n(s, "blocks_leaked")),
        (3, 0, 0),
        "{case}: {s}"
    );
    assert!(n(s, "bytes_read") > n(s, "bytes_verified"), "{case}: duplicate head writes: {s}");
    // Decode TP 8 over 4 KV heads from one prefill rank: vLLM's rule, then the switch.
    let case = "push P1 D8";
    let d8 = [&a[..], TINY_HYBRID_G8, &["--p-tp", "1", "--d-tp", "8"]].concat();
    let results = tempfile::tempdir().expect("temp dir");
    let mut bench = Spawned::start(case, bench_cmd(results.path(), &d8));
    let status = bench.expect_exit(RUN_TIMEOUT);
    assert_eq!(status.code(), Some(1), "{case}: decode ranks without attention fail: {}", bench.stderr());
    let err = bench.stderr();
    assert!(
        err.contains("self_attn")
            && err.contains("holds zeros")
            && err.contains("--push-attention every-rank"),
        "{case}: the missing bytes and the rule are named: {err}"
    );
    let run = run_bench(case, &[&d8[..], &["--push-attention", "every-rank", "--verify", "full"]].concat());
    let s = &run.summary;
    assert_eq!(
        (n(s, "requests_ok"), n(s, "verify_failures"), n(s, "blocks_leaked")),
        (3, 0, 0),
        "{case}: {s}"
    );
}

/// A hybrid run's reads mix descriptor sizes (attention pages, conv parts, SSM state): the
/// calibration measures `kvx xfer` at each size of the plan and weighs them by the bytes each
/// carries, and each rank's transfer bandwidth is shown against that, not against one
/// region's block.
#[test]
fn a_hybrid_run_is_compared_with_kvx_xfer_at_its_own_descriptor_sizes() {
    let results = tempfile::tempdir().expect("temp dir");
    let out = kvx()
        .args([
            "bench",
            "--p-tp",
            "1",
            "--d-tp",
            "2",
            "--requests",
            "2",
            "--warmup",
            "0",
            "--prompt-len",
            "300",
        ])
        .args(TINY_HYBRID)
        .arg("--results-dir")
        .arg(results.path())
        .timeout(Duration::from_secs(120))
        .output()
        .expect("runs");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        table.contains("vs kvx xfer at the plan's") && table.contains("p50 vs kvx xfer, plan's sizes"),
        "{table}"
    );
    assert!(
        !table.contains("vs kvx xfer of "),
        "one region's block is not a hybrid run's reference: {table}"
    );
    let dir = run_dir(results.path()).expect("run directory");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).expect("summary"))
        .expect("summary JSON");
    let c = &s["calibration"];
    let mix = c["xfer_mix"].as_array().expect("xfer_mix");
    assert!(mix.len() >= 3, "attention, conv and SSM sizes: {c}");
    // The sizes of every byte a request reads (every request here reads the same).
    let bytes: u64 = mix.iter().filter_map(|m| m["bytes_per_request"].as_u64()).sum();
    assert_eq!(bytes * 2, n(&s, "bytes_read"), "{c}");
    assert_eq!(c["xfer_mix_share"].as_f64(), Some(1.0), "{c}");
    let seconds: f64 = mix
        .iter()
        .map(|m| m["bytes_per_request"].as_f64().unwrap_or(0.0) / m["gbps"].as_f64().unwrap_or(f64::NAN))
        .sum();
    let want = bytes as f64 / seconds;
    let got = c["xfer_mix_gbps"].as_f64().expect("xfer_mix_gbps");
    assert!((got - want).abs() <= 1e-9 * want, "bytes over the time each size takes: {got} vs {want}");
    // Each decode rank over the whole run, beside its per-request figures.
    let b = &s["transfer_bandwidth"];
    assert_eq!(b["rank_busy_gbps"]["count"], 2, "one figure per decode rank: {b}");
    assert!(table.contains("each rank, whole run"), "{table}");
}

/// vLLM 0.33's `remote_conv_offsets` on a Mamba2 model with `n_groups` below a TP size, moved
/// between real processes (P1 -> D2 and P2 -> D1): B and C land wrong, and the run says so and
/// exits 1, naming the bytes; `--state-slices exact` reads each part as the model splits it,
/// and every byte lands.
#[test]
fn replicated_mamba2_groups_land_wrong_by_vllm_rules_and_right_with_exact_slices() {
    // Prefill TP above decode TP too: each prefill rank gives its piece of decode's slice.
    for (p, d, named) in [
        ("1", "2", "mamba_conv_C bytes 0..96: holds prefill rank 0's model.layers.0.mixer mamba_ssm"),
        ("2", "1", "mamba_conv_"),
    ] {
        let case = format!("P{p} -> D{d}");
        let a = ["--p-tp", p, "--d-tp", d, "--requests", "3", "--warmup", "0", "--prompt-len", "300"];
        let results = tempfile::tempdir().expect("temp dir");
        let mut bench = Spawned::start(&case, bench_cmd(results.path(), &[&a[..], TINY_HYBRID_G1].concat()));
        let status = bench.expect_exit(RUN_TIMEOUT);
        assert_eq!(status.code(), Some(1), "{case}: wrong bytes fail the run: {}", bench.stderr());
        let s = summary_json(&bench);
        assert_eq!(n(&s, "requests_ok"), 0, "{case}: {s}");
        assert!(n(&s, "verify_failures") > 0, "{case}: {s}");
        let err = bench.stderr();
        assert!(err.contains(named) && err.contains(": holds "), "{case}: the wrong bytes are named: {err}");
        let run = run_bench(&case, &[&a[..], TINY_HYBRID_G1, &["--state-slices", "exact"]].concat());
        check_clean(&case, &run, 3);
    }
}

/// Hybrid models through host buffers (`--kv-buffer-device cpu`) between real processes:
/// vLLM 0.33's two host-buffer rules put bytes wrong in decode's KV cache (the host-to-device
/// copy passes every group's blocks through every layer; host tensors hold unpadded state
/// pages under regions that step by padded ones). Each run under one of them exits 1 naming
/// the rule and its switch, and only the rules that ran; with both switches every block of
/// every request checks out in each decode rank's KV cache, and the two copies are their own
/// stages.
#[test]
fn hybrid_host_buffers_land_wrong_by_vllm_rules_and_right_with_both_switches() {
    let a = [
        "--p-tp",
        "1",
        "--d-tp",
        "2",
        "--requests",
        "3",
        "--warmup",
        "0",
        "--prompt-len",
        "300..900",
        "--prefix-hit",
        "0.3",
        "--kv-buffer-device",
        "cpu",
        "--verify",
        "full",
    ];
    let page = "--host-state-page padded pads them";
    let copy = "--host-copy per-group copies each layer's own";
    for (case, extra, named, not_named) in [
        ("vllm rules", &[][..], &[page, copy][..], None),
        ("per-group copy", &["--host-copy", "per-group"][..], &[page][..], Some(copy)),
        ("padded pages", &["--host-state-page", "padded"][..], &[copy][..], Some(page)),
    ] {
        let results = tempfile::tempdir().expect("temp dir");
        let mut bench =
            Spawned::start(case, bench_cmd(results.path(), &[&a[..], TINY_HYBRID, extra].concat()));
        let status = bench.expect_exit(RUN_TIMEOUT);
        let err = bench.stderr();
        assert_eq!(status.code(), Some(1), "{case}: wrong bytes fail the run: {err}");
        let s = summary_json(&bench);
        assert_eq!(n(&s, "requests_ok"), 0, "{case}: {s}");
        assert!(n(&s, "verify_failures") > 0, "{case}: {s}");
        assert_eq!(n(&s, "blocks_leaked"), 0, "{case}: {s}");
        assert!(err.contains("in its KV cache after the host-to-device copy: holds"), "{case}: {err}");
        for rule in named {
            assert!(err.contains(rule), "{case}: names {rule}: {err}");
        }
        if let Some(rule) = not_named {
            assert!(!err.contains(rule), "{case}: the switched rule is not blamed: {err}");
        }
    }
    let fixed = [&a[..], TINY_HYBRID, &["--host-copy", "per-group", "--host-state-page", "padded"]].concat();
    let run = run_bench("both switches", &fixed);
    let s = &run.summary;
    assert_eq!(n(s, "requests_ok"), 3, "{s}");
    assert_eq!(n(s, "verify_failures"), 0, "{s}");
    assert_eq!(n(s, "blocks_leaked"), 0, "{s}");
    assert!(n(s, "bytes_verified") > 0, "{s}");
    for stage in ["save_to_host", "sync_to_device"] {
        assert_eq!(s["stages"][stage]["count"].as_u64(), Some(3), "{stage}: {s}");
    }
    assert_eq!(s["scenario"]["host_copy"], "per-group", "{s}");
    assert_eq!(s["scenario"]["host_state_page"], "padded", "{s}");
    // Finding 5's switch on top: each group's blocks read from its own layers' host tensors
    // only; fewer bytes on the wire, the same blocks verified in the KV caches.
    let own = [&fixed[..], &["--host-descriptors", "per-group"]].concat();
    let own = run_bench("three switches", &own);
    let o = &own.summary;
    assert_eq!((n(o, "requests_ok"), n(o, "verify_failures"), n(o, "blocks_leaked")), (3, 0, 0), "{o}");
    assert_eq!(n(o, "bytes_verified"), n(s, "bytes_verified"), "the same blocks checked: {o}");
    assert!(n(o, "bytes_read") < n(s, "bytes_read"), "fewer bytes read: {o} vs {s}");
    assert_eq!(o["scenario"]["host_descriptors"], "per-group", "{o}");
}

/// Finding 4 between real processes: with more prefill ranks than KV heads (heads replicated)
/// vLLM lets an LBNHC decode cache gather its heads from several prefill ranks into head slots
/// of its blocks, where a slot's bytes are token rows of every head: the run exits 1 naming a
/// head that holds another head's bytes. The same pair with LBHNC (heads contiguous in a
/// block) verifies. 16-token kernel blocks and prefix caching off, as vLLM requires for these
/// TP sizes' hybrid block sizes.
#[test]
fn lbnhc_head_slots_from_replicated_prefill_ranks_land_wrong_and_lbhnc_lands_right() {
    let a = [
        "--p-tp",
        "8",
        "--d-tp",
        "1",
        "--kernel-block-size",
        "16",
        "--no-prefix-caching",
        "--prompt-len",
        "600",
        "--requests",
        "2",
        "--warmup",
        "0",
        "--verify",
        "full",
    ];
    let results = tempfile::tempdir().expect("temp dir");
    let args = [&a[..], TINY_HYBRID_G8, &["--layout", "LBNHC"]].concat();
    let mut bench = Spawned::start("lbnhc", bench_cmd(results.path(), &args));
    let status = bench.expect_exit(RUN_TIMEOUT);
    let err = bench.stderr();
    assert_eq!(status.code(), Some(1), "wrong bytes fail the run: {err}");
    assert!(
        err.contains("self_attn.attn KV head 1 bytes 0..256: holds prefill rank 0's model.layers.1.self_attn.attn KV head 0"),
        "a head holds another head's bytes: {err}"
    );
    let s = summary_json(&bench);
    assert_eq!(n(&s, "blocks_leaked"), 0, "{s}");
    let run = run_bench("lbhnc", &[&a[..], TINY_HYBRID_G8, &["--layout", "LBHNC"]].concat());
    assert_eq!(n(&run.summary, "requests_ok"), 2, "{}", run.summary);
    assert_eq!(n(&run.summary, "verify_failures"), 0, "{}", run.summary);
    assert_eq!(n(&run.summary, "blocks_leaked"), 0, "{}", run.summary);
}

/// The engines of a bench, started from its flags (workers: this build's kvx), three requests
/// prefilled, then all three handed to the decode engine at once; each request's ranks' read
/// spans (start, end on the host's shared clock), in the order the requests started.
fn three_loads_at_once(rank_start: &str) -> Vec<(u64, u64)> {
    use clap::Parser;
    use kvx::pipeline::bench::Engines;
    use kvx::settings::bench::{BenchFlags, resolve};
    use kvx::settings::env::ProcessEnv;
    let mut args = vec!["bench", "--p-tp", "1", "--d-tp", "2", "--prompt-len", "512", "--timeout", "30s"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--rank-start", rank_start]);
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchFlags,
    }
    let flags = Cli::try_parse_from(args).expect("flags").bench;
    let env = ProcessEnv {
        results_dir: None,
        stderr_is_terminal: false,
        launcher: Ok(None),
        exe: Ok(PathBuf::from(env!("CARGO_BIN_EXE_kvx"))),
    };
    let s = resolve(&flags, &env).expect("settings");
    let engines = Engines::start(&s).expect("engines start");
    let d_tokens = s.workers.pair.d.block_tokens;
    let prefilled: Vec<_> = (0..3u64)
        .map(|req| {
            let rx = engines.prefill.prefill(req, format!("p-{req}"), 512, req, 2);
            rx.blocking_recv().expect("prefill answered").expect("prefill ok").params
        })
        .collect();
    let loads: Vec<_> = prefilled
        .into_iter()
        .enumerate()
        .map(|(req, params)| {
            let blocks = engines.decode.info().request_blocks(512, d_tokens, 0);
            engines.decode.load(req as u64, format!("d-{req}"), params, blocks, req as u64)
        })
        .collect();
    let mut spans: Vec<(u64, u64)> = loads
        .into_iter()
        .map(|rx| {
            let done = rx.blocking_recv().expect("load answered").expect("load ok");
            assert_eq!(done.ranks.len(), 2, "both decode ranks answered");
            let ranks: Vec<_> = done
                .ranks
                .iter()
                .map(|r| {
                    assert!(r.error.is_none(), "rank {} failed: {:?}", r.d_rank, r.error);
                    r.transfer_span.expect("a read span on the shared clock")
                })
                .collect();
            let first = ranks.iter().map(|s| s.start_ns).min().expect("two ranks");
            let last = ranks.iter().map(|s| s.end_ns).max().expect("two ranks");
            (first, last)
        })
        .collect();
    engines.prefill.shutdown();
    engines.decode.shutdown();
    spans.sort_unstable();
    spans
}

/// `--rank-start together` (the default, vLLM's TP ranks stepping together): a request's
/// ranks start only once every rank finished the request before it, so the requests' spans,
/// first rank's start to last rank's end, never overlap; `free` runs the same requests.
#[test]
fn decode_ranks_start_a_request_together_after_every_rank_finished_the_one_before() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let together = three_loads_at_once("together");
        let free = three_loads_at_once("free");
        let _ = tx.send((together, free));
    });
    let (together, free) = rx.recv_timeout(RUN_TIMEOUT).expect("both runs finish within the hard timeout");
    for w in together.windows(2) {
        assert!(
            w[1].0 >= w[0].1,
            "a request's first rank started at {} before the request before it ended on its last rank at {}",
            w[1].0,
            w[0].1
        );
    }
    assert_eq!(free.len(), 3, "free: every request answered");
}
