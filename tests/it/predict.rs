//! Issue 51: `kvx calibrate` fits a rates file, `kvx plan --rates` predicts from it (and
//! exports simulator profiles), `kvx bench --rates` puts predicted beside measured; a rates
//! file that is malformed, of another version or lacks the path a run takes is refused with
//! exit 2 naming the field.

use crate::common::kvx;

const FIXTURE: &str = "tests/fixtures/rates/host.json";

fn stdout(args: &[&str]) -> String {
    let out = kvx().args(args).output().expect("runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The prediction section of `kvx plan`'s table view.
fn prediction(args: &[&str]) -> String {
    let text = stdout(args);
    let at = text.find("\npredicted transfer").unwrap_or_else(|| panic!("no prediction in:\n{text}"));
    text[at + 1..].to_string()
}

#[test]
fn plan_predicts_each_rank_and_the_span_for_pull_push_and_hybrid() {
    let pull = prediction(&[
        "plan",
        "--p-tp",
        "8",
        "--d-tp",
        "2",
        "--model",
        "llama-3.1-70b",
        "--prompt-len",
        "2048",
        "--rates",
        FIXTURE,
    ]);
    // 2 decode ranks, each 4 peers x 10,240 descriptors of 8 KiB = 320 MiB; with 2 readers at
    // once: 2 us + 40,960 x 800 ns + 335,544,320 B / 2.5 GB/s.
    let want_us = 2.0 + 40_960.0 * 0.8 + 335_544_320.0 / 2.5 / 1e3;
    assert!(pull.contains(&format!("span {:.2} ms, bound by bytes", want_us / 1e3)), "{pull}");
    assert!(!pull.contains("EXTRAPOLATED"), "{pull}");
    insta::assert_snapshot!("predict_plan_pull_8_2", pull);
    let push = prediction(&[
        "plan",
        "--mode",
        "push",
        "--p-tp",
        "8",
        "--d-tp",
        "2",
        "--model",
        "llama-3.1-70b",
        "--prompt-len",
        "2048",
        "--rates",
        FIXTURE,
    ]);
    // Eight prefill ranks write at once: more than the fit measured.
    assert!(
        push.contains("8 prefill ranks at once") && push.contains("EXTRAPOLATED: 8 ranks at once"),
        "{push}"
    );
    let hybrid = prediction(&[
        "plan",
        "--p-tp",
        "1",
        "--d-tp",
        "1",
        "--model",
        "qwen3-next-80b-a3b",
        "--prompt-len",
        "8192",
        "--rates",
        FIXTURE,
    ]);
    assert!(hybrid.contains("decode rank 0:"), "{hybrid}");
    insta::assert_snapshot!("predict_plan_hybrid_qwen3_next", hybrid);
    // Without a calibrated model there is no prediction, as before.
    let plain =
        stdout(&["plan", "--p-tp", "8", "--d-tp", "2", "--model", "llama-3.1-70b", "--prompt-len", "2048"]);
    assert!(!plain.contains("predicted transfer"));
}

#[test]
fn plan_exports_each_simulators_profile() {
    let base = [
        "plan",
        "--p-tp",
        "2",
        "--d-tp",
        "4",
        "--model",
        "llama-3.1-8b",
        "--prompt-len",
        "8192",
        "--rates",
        FIXTURE,
    ];
    let llmd = stdout(&[&base[..], &["--export", "llm-d-sim"]].concat());
    let keys: Vec<&str> = llmd.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(keys.len(), 2, "{llmd}");
    assert!(
        keys[0].starts_with("kv-cache-transfer-latency: ")
            && keys[1].starts_with("kv-cache-transfer-time-per-token: ")
    );
    insta::assert_snapshot!("predict_export_llm_d_sim", llmd);
    let dynamo = stdout(&[&base[..], &["--export", "dynamo-mocker"]].concat());
    // Llama-3.1-8B: 32 layers x 8 heads x 128 x 2 (K, V) x 2 B = 128 KiB per token.
    assert!(dynamo.contains("--kv-bytes-per-token 131072"), "{dynamo}");
    insta::assert_snapshot!("predict_export_dynamo_mocker", dynamo);
    let out = kvx().args([&base[..9], &["--export", "llm-d-sim"]].concat()).output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--export"));
}

/// A rates file `kvx calibrate` could not have written: exit 2, the field named.
#[test]
fn bad_rates_files_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().expect("tmp");
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(FIXTURE).expect("fixture")).expect("json");
    let mut cases: Vec<(String, &str)> = Vec::new();
    let mut v = good.clone();
    v["kvx_rates_version"] = 2.into();
    cases.push((v.to_string(), "kvx_rates_version"));
    let mut v = good.clone();
    v["provenance"].as_object_mut().expect("object").remove("host");
    cases.push((v.to_string(), "provenance.host"));
    let mut v = good.clone();
    v["paths"]["ucx"]["model"].as_object_mut().expect("object").remove("gbps");
    cases.push((v.to_string(), "paths.ucx.model"));
    let mut v = good.clone();
    v["paths"]["ucx"]["model"]["gbps"] = (-1.0).into();
    cases.push((v.to_string(), "paths.ucx.model.gbps"));
    let mut v = good.clone();
    v.as_object_mut().expect("object").remove("kvx_rates_version");
    cases.push((v.to_string(), "kvx_rates_version"));
    cases.push(("{\"kvx_rates_version\": 1, ".into(), "not JSON"));
    for (i, (text, field)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("bad{i}.json"));
        std::fs::write(&f, text).expect("write");
        let f = f.to_str().expect("utf-8 path");
        for args in [
            vec![
                "plan",
                "--p-tp",
                "1",
                "--d-tp",
                "1",
                "--model",
                "llama-3.1-8b",
                "--prompt-len",
                "64",
                "--rates",
                f,
            ],
            vec![
                "bench",
                "--p-tp",
                "1",
                "--d-tp",
                "1",
                "--model",
                "llama-3.1-8b",
                "--prompt-len",
                "64",
                "--rates",
                f,
            ],
        ] {
            let out = kvx().args(&args).output().expect("runs");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(field) && err.contains("--rates"), "{args:?} should name {field}: {err}");
        }
    }
    // A file without the path this run takes: bench names the missing model.
    let mut v = good.clone();
    let ucx = v["paths"]["ucx"].clone();
    v["paths"] = serde_json::json!({"cuda-batch": ucx});
    let f = dir.path().join("gpu-only.json");
    std::fs::write(&f, v.to_string()).expect("write");
    let out = kvx()
        .args([
            "bench",
            "--p-tp",
            "1",
            "--d-tp",
            "1",
            "--prompt-len",
            "64",
            "--rates",
            f.to_str().expect("utf-8"),
        ])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("paths.ucx.model"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The real thing, short: a quick calibration over UCX on this host, then a small bench that
/// reports predicted beside measured.
#[test]
fn calibrate_writes_a_rates_file_bench_predicts_with() {
    let dir = tempfile::tempdir().expect("tmp");
    let rates = dir.path().join("rates.json");
    let r = rates.to_str().expect("utf-8");
    let out = stdout(&["calibrate", "--quick", "--case-time", "20ms", "--out", r]);
    assert!(out.contains("per descriptor") && out.contains("2 readers at once"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rates).expect("written")).expect("json");
    assert_eq!(v["kvx_rates_version"], 1);
    for f in ["command", "host", "kvx_version", "ucx_version", "date"] {
        assert!(v["provenance"][f].is_string(), "provenance.{f}: {v}");
    }
    assert!(!v["provenance"]["ucx_library"].as_str().unwrap_or("/").contains('/'), "a file name, not a path");
    let m = &v["paths"]["ucx"]["model"];
    assert!(m["gbps"].as_f64().is_some_and(|g| g > 0.0), "{m}");
    assert_eq!(m["concurrency"].as_array().map(Vec::len), Some(2), "{m}");
    assert!(v["points"].as_array().is_some_and(|p| p.len() >= 8), "every point kept");
    // Compared with itself later: each term and the verdict.
    let again = dir.path().join("again.json");
    let out = stdout(&[
        "calibrate",
        "--quick",
        "--case-time",
        "20ms",
        "--out",
        again.to_str().expect("utf-8"),
        "--compare",
        r,
    ]);
    assert!(out.contains("compared with the earlier fit") && out.contains("gbps"), "{out}");
    let runs = dir.path().join("runs");
    let bench = |rank_start: &str| -> serde_json::Value {
        let json = stdout(&[
            "bench",
            "--p-tp",
            "1",
            "--d-tp",
            "2",
            "--model",
            "llama-3.1-8b",
            "--prompt-len",
            "256",
            "--requests",
            "4",
            "--warmup",
            "1",
            "--concurrency",
            "2",
            "--rank-start",
            rank_start,
            "--no-calibrate",
            "--rates",
            r,
            "--format",
            "json",
            "--results-dir",
            runs.to_str().expect("utf-8"),
        ]);
        serde_json::from_str(json.trim()).expect("summary JSON")
    };
    // Ranks that start each request together (the default): the point prediction alone, no
    // range for ranks drifting apart.
    let together = bench("together");
    assert_eq!(together["scenario"]["rank_start"], "together", "{}", together["scenario"]);
    assert!(together["prediction"]["transfer_span_p50_us"].as_f64().is_some_and(|x| x > 0.0));
    assert!(together["prediction"]["closed_loop"].is_null(), "{}", together["prediction"]);
    // Ranks that each start the next request when free: the span's range too.
    let s = bench("free");
    assert_eq!(s["scenario"]["rank_start"], "free", "{}", s["scenario"]);
    let p = &s["prediction"];
    let (pred, meas, ratio) = (
        p["transfer_span_p50_us"].as_f64().expect("predicted"),
        p["measured_transfer_span_p50_us"].as_f64().expect("measured"),
        p["ratio"].as_f64().expect("ratio"),
    );
    assert!(pred > 0.0 && meas > 0.0 && (ratio - meas / pred).abs() < 1e-9, "{p}");
    assert_eq!(p["readers"], 2);
    assert_eq!(p["ranks"].as_array().map(Vec::len), Some(2), "{p}");
    // Two decode ranks on one clock: how far apart they started, per request. A request's
    // skew is at most its span (the last start comes before the last end), so its p50 too.
    let skew = &s["transfer_bandwidth"]["start_skew_us"];
    assert!(skew["count"].as_u64().is_some_and(|n| n >= 1), "{skew}");
    let p50 = skew["p50"].as_f64().expect("skew p50");
    assert_eq!(p["measured_start_skew_p50_us"].as_f64(), Some(p50), "{p}");
    assert!((0.0..=meas).contains(&p50), "skew {p50} us beyond the span {meas} us");
    // Two at once: the closed loop's range, one to two busiest-rank transfers, and whether the
    // measured span stayed under its top.
    let busiest = p["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .filter_map(|r| r["transfer_us"].as_f64())
        .fold(0.0, f64::max);
    let b = &p["closed_loop"];
    assert_eq!(b["concurrency"], 2, "{p}");
    // Equal to the last bit but for JSON's float parsing (serde_json's fast path may land one
    // unit in the last place off).
    let close =
        |x: &serde_json::Value, want: f64| x.as_f64().is_some_and(|v| (v - want).abs() <= 1e-9 * want);
    assert!(close(&b["span_min_us"], busiest), "{p}");
    assert!(close(&b["span_max_us"], 2.0 * busiest), "{p}");
    let span_max = b["span_max_us"].as_f64().expect("span_max_us");
    assert_eq!(b["measured_p50_at_most_max"].as_bool(), Some(meas <= span_max), "{p}");
}
