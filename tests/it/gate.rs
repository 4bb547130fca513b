//! `kvx gate` run as a real process on fixture summaries (tests/fixtures/gate/, described in
//! its README) and edited copies of them: verdicts, exit codes, JSON and Markdown output,
//! thresholds files, `--update`, and what is refused (partial runs, implausible calibration).

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gate").join(name)
}

fn kvx() -> Command {
    let mut c = Command::cargo_bin("kvx").expect("kvx binary");
    c.timeout(Duration::from_secs(60));
    c
}

/// Runs `kvx gate --baseline baseline.json --current NAME extra...`.
fn gate(current: &str, extra: &[&str]) -> assert_cmd::assert::Assert {
    kvx()
        .arg("gate")
        .arg("--baseline")
        .arg(fixture("baseline.json"))
        .arg("--current")
        .arg(fixture(current))
        .args(extra)
        .assert()
}

fn stdout(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stdout).into_owned()
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

/// Output with this machine's checkout path taken out, for snapshots.
fn redact(s: &str) -> String {
    s.replace(env!("CARGO_MANIFEST_DIR"), "[ROOT]")
}

#[test]
fn unchanged_within_noise_passes() {
    let a = gate("pass.json", &[]).code(0);
    let out = stdout(&a);
    assert!(out.contains("verdict: PASS"), "{out}");
    assert!(out.contains("noise floor: ±"), "{out}");
}

#[test]
fn a_twenty_percent_slowdown_is_a_regression() {
    let a = gate("regress.json", &[]).code(1);
    let out = stdout(&a);
    assert!(out.contains("verdict: REGRESSION (throughput_gbps -20.0%"), "{out}");
    insta::assert_snapshot!("gate_regression_table", redact(&out));
}

#[test]
fn an_improvement_passes_and_says_so() {
    let a = gate("improve.json", &[]).code(0);
    let out = stdout(&a);
    assert!(out.contains("improved"), "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
}

#[test]
fn a_slower_machine_is_not_a_slower_kvx() {
    let a = gate("slower-machine.json", &[]).code(0);
    let out = stdout(&a);
    assert!(out.contains("machine speed, current over baseline: 0.500x"), "{out}");
    // Raw ratio shown next to the normalised one.
    assert!(out.contains("0.500x ┆     1.000x"), "{out}");
}

#[test]
fn new_failures_are_a_regression() {
    let a = gate("failures.json", &[]).code(1);
    assert!(
        stdout(&a).contains("verdict: REGRESSION (requests_failed +3, verify_failures +1)"),
        "{}",
        stdout(&a)
    );
}

#[test]
fn a_missing_metric_is_an_error_naming_it() {
    let a = gate("missing-metric.json", &[]).code(2);
    let err = stderr(&a);
    assert!(err.contains("metric `stages.e2e.p50_us` is missing from the current summary"), "{err}");
    assert!(err.contains("missing-metric.json"), "{err}");
}

#[test]
fn a_wrong_schema_is_an_error() {
    let a = gate("wrong-schema.json", &[]).code(2);
    let err = stderr(&a);
    assert!(err.contains("schema_version 2, but this kvx reads schema_version 1"), "{err}");
}

#[test]
fn unreadable_files_are_errors() {
    let a = gate("not-json.json", &[]).code(2);
    assert!(stderr(&a).contains("is not valid JSON"), "{}", stderr(&a));
    let a = gate("does-not-exist.json", &[]).code(2);
    assert!(stderr(&a).contains("cannot read"), "{}", stderr(&a));
    assert!(stderr(&a).contains("does-not-exist.json"), "{}", stderr(&a));
}

#[test]
fn json_verdicts() {
    let parse = |a: &assert_cmd::assert::Assert| -> Value {
        serde_json::from_str(&stdout(a)).expect("JSON on stdout")
    };
    let pass = parse(&gate("pass.json", &["--format", "json"]).code(0));
    assert_eq!(pass["verdict"], "pass");
    assert!(pass["noise_floor"].as_f64().is_some_and(|n| n > 0.0 && n < 0.1), "{}", pass["noise_floor"]);
    let reg = parse(&gate("regress.json", &["--format", "json"]).code(1));
    assert_eq!(reg["verdict"], "regression");
    let tput = reg["metrics"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["metric"] == "throughput_gbps"))
        .expect("throughput metric");
    assert_eq!(tput["verdict"], "regression");
    assert_eq!(tput["better"], "higher");
    assert!((tput["ratio"].as_f64().expect("ratio") - 0.8).abs() < 1e-9);
    assert_eq!(tput["baseline_samples"], 5);
    let err = parse(&gate("wrong-schema.json", &["--format", "json"]).code(2));
    assert_eq!(err["verdict"], "error");
    assert!(err["error"].as_str().is_some_and(|e| e.contains("schema_version")), "{err}");
}

#[test]
fn markdown_summary_for_ci() {
    let dir = tempfile::tempdir().expect("tmp");
    let md = dir.path().join("summary.md");
    gate("regress.json", &["--markdown", md.to_str().expect("utf8")]).code(1);
    let text = std::fs::read_to_string(&md).expect("markdown written");
    assert!(text.starts_with("## kvx gate: ❌ regression"), "{text}");
    insta::assert_snapshot!("gate_regression_markdown", redact(&text));
    let err_md = dir.path().join("err.md");
    gate("missing-metric.json", &["--markdown", err_md.to_str().expect("utf8")]).code(2);
    let text = std::fs::read_to_string(&err_md).expect("error markdown written");
    assert!(text.contains("error") && text.contains("stages.e2e.p50_us"), "{text}");
}

/// `--html-file FILE`: the verdict as one page (the metric table, each metric's change against its
/// threshold, baseline and current side by side), checked as a browser parses it; a gate that
/// cannot decide writes the reason there too; `--update` has no page.
#[test]
fn html_page_of_the_verdict() {
    let dir = tempfile::tempdir().expect("tmp");
    let page = dir.path().join("gate.html");
    gate("regress.json", &["--html-file", page.to_str().expect("utf8")]).code(1);
    let html = std::fs::read_to_string(&page).expect("page written");
    assert_eq!(crate::report::check_html(&html), vec!["gate-change", "latency", "compare-throughput"]);
    for want in
        ["<h1>kvx gate: REGRESSION</h1>", "throughput_gbps", "REGRESSION; threshold 10%", "baseline e2e"]
    {
        assert!(html.contains(want), "{want}");
    }
    gate("missing-metric.json", &["--html-file", page.to_str().expect("utf8")]).code(2);
    let html = std::fs::read_to_string(&page).expect("error page written");
    crate::report::check_html(&html);
    assert!(html.contains("kvx gate: error") && html.contains("stages.e2e.p50_us"), "{html}");
    let baseline = dir.path().join("baseline.json");
    let a = kvx()
        .args(["gate", "--update", "--html-file", page.to_str().expect("utf8"), "--baseline"])
        .arg(&baseline)
        .arg("--current")
        .arg(fixture("pass.json"))
        .assert()
        .code(2);
    assert!(!baseline.exists(), "refused before anything was written");
    assert!(stderr(&a).contains("--html-file") && stderr(&a).contains("--update"), "{}", stderr(&a));
}

#[test]
fn thresholds_file_changes_the_verdict() {
    let dir = tempfile::tempdir().expect("tmp");
    let loose = dir.path().join("loose.toml");
    std::fs::write(
        &loose,
        "[settings]\nreplace_defaults = true\n[[metric]]\nname = \"throughput_gbps\"\nbetter = \"higher\"\nthreshold = 0.25\n",
    )
    .expect("write");
    let a = gate("regress.json", &["--thresholds", loose.to_str().expect("utf8")]).code(0);
    assert!(stdout(&a).contains("verdict: PASS"), "{}", stdout(&a));
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[[metric]]\nname = \"throughput_gbps\"\nbetter = \"up\"\nthreshold = 0.1\n")
        .expect("write");
    let a = gate("pass.json", &["--thresholds", bad.to_str().expect("utf8")]).code(2);
    assert!(stderr(&a).contains("bad.toml"), "{}", stderr(&a));
    // A metric the summaries do not have is an error unless it is optional.
    let extra = dir.path().join("extra.toml");
    std::fs::write(
        &extra,
        "[[metric]]\nname = \"stages.nope.p50_us\"\nbetter = \"lower\"\nthreshold = 0.1\n",
    )
    .expect("write");
    let a = gate("pass.json", &["--thresholds", extra.to_str().expect("utf8")]).code(2);
    assert!(stderr(&a).contains("stages.nope.p50_us"), "{}", stderr(&a));
}

#[test]
fn a_run_directory_stands_for_its_summary() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::copy(fixture("pass.json"), dir.path().join("summary.json")).expect("copy");
    kvx()
        .arg("gate")
        .arg("--baseline")
        .arg(fixture("baseline.json"))
        .arg("--current")
        .arg(dir.path())
        .assert()
        .code(0);
}

fn update(baseline: &Path, current: &str, extra: &[&str]) -> assert_cmd::assert::Assert {
    kvx()
        .arg("gate")
        .arg("--baseline")
        .arg(baseline)
        .arg("--current")
        .arg(fixture(current))
        .arg("--update")
        .args(extra)
        .assert()
}

fn json_file(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).expect("read")).expect("json")
}

#[test]
fn update_writes_the_baseline_and_shows_what_changed() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("baseline.json");
    std::fs::copy(fixture("baseline.json"), &base).expect("copy");
    // A regression is accepted on purpose with --update: exit 0, and the change is printed.
    let a = update(&base, "regress.json", &[]).code(0);
    let out = stdout(&a);
    assert!(out.contains("what changed"), "{out}");
    assert!(out.contains("throughput_gbps"), "{out}");
    assert!(out.contains("baseline updated"), "{out}");
    assert_eq!(json_file(&base), json_file(&fixture("regress.json")));
    // The new baseline is what the next gate compares with.
    kvx()
        .arg("gate")
        .arg("--baseline")
        .arg(&base)
        .arg("--current")
        .arg(fixture("regress.json"))
        .assert()
        .code(0);
}

#[test]
fn update_creates_a_missing_baseline() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("new").join("baseline.json");
    std::fs::create_dir_all(base.parent().expect("parent")).expect("mkdir");
    let a = update(&base, "pass.json", &["--format", "json"]).code(0);
    let v: Value = serde_json::from_str(&stdout(&a)).expect("json");
    assert_eq!(v["verdict"], "updated");
    assert!(v["previous"].is_null());
    assert_eq!(json_file(&base), json_file(&fixture("pass.json")));
}

#[test]
fn update_refuses_an_unclean_run_unless_forced() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("baseline.json");
    std::fs::copy(fixture("baseline.json"), &base).expect("copy");
    let a = update(&base, "failures.json", &[]).code(2);
    let err = stderr(&a);
    assert!(err.contains("refusing to update the baseline"), "{err}");
    assert!(err.contains("3 requests failed") && err.contains("1 verification failures"), "{err}");
    assert!(err.contains("--force"), "{err}");
    assert_eq!(json_file(&base), json_file(&fixture("baseline.json")), "baseline untouched");
    update(&base, "failures.json", &["--force"]).code(0);
    assert_eq!(json_file(&base), json_file(&fixture("failures.json")));
}

#[test]
fn update_refuses_a_wrong_schema() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("baseline.json");
    std::fs::copy(fixture("baseline.json"), &base).expect("copy");
    update(&base, "wrong-schema.json", &["--force"]).code(2);
    assert_eq!(json_file(&base), json_file(&fixture("baseline.json")));
}

#[test]
fn update_refuses_a_run_missing_a_gated_metric() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("baseline.json");
    std::fs::copy(fixture("baseline.json"), &base).expect("copy");
    let a = update(&base, "missing-metric.json", &[]).code(2);
    assert!(stderr(&a).contains("stages.e2e.p50_us"), "{}", stderr(&a));
    assert_eq!(json_file(&base), json_file(&fixture("baseline.json")));
}

#[test]
fn force_needs_update() {
    gate("pass.json", &["--force"]).code(2);
}

/// A copy of fixture `name` in `dir`, as `out`, with `edit` applied to its JSON.
fn edited(dir: &Path, name: &str, out: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut v = json_file(&fixture(name));
    edit(&mut v);
    let p = dir.join(out);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).expect("encode")).expect("write");
    p
}

fn gate_files(baseline: &Path, current: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    kvx().arg("gate").arg("--baseline").arg(baseline).arg("--current").arg(current).args(extra).assert()
}

#[test]
fn a_partial_baseline_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = edited(dir.path(), "baseline.json", "partial-baseline.json", |v| v["partial"] = true.into());
    let a = gate_files(&base, &fixture("pass.json"), &[]).code(2);
    let err = stderr(&a);
    assert!(err.contains("partial-baseline.json") && err.contains("baseline"), "{err}");
    assert!(err.contains("interrupted or failed half-way"), "{err}");
    assert!(err.contains("--allow-partial"), "{err}");
    assert!(stdout(&a).is_empty(), "no verdict printed: {}", stdout(&a));
    // With --allow-partial it is judged as before, with a note.
    let a = gate_files(&base, &fixture("pass.json"), &["--allow-partial"]).code(0);
    let out = stdout(&a);
    assert!(out.contains("note: the baseline is a partial run"), "{out}");
    assert!(out.contains("verdict: PASS"), "{out}");
}

#[test]
fn a_partial_current_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().expect("tmp");
    let cur = edited(dir.path(), "regress.json", "partial-current.json", |v| v["partial"] = true.into());
    let a = gate_files(&fixture("baseline.json"), &cur, &[]).code(2);
    let err = stderr(&a);
    assert!(err.contains("current") && err.contains("partial-current.json"), "{err}");
    assert!(err.contains("fewer requests"), "{err}");
    assert!(err.contains("--allow-partial"), "{err}");
    // The JSON verdict of a refusal is an error, not a pass.
    let a = gate_files(&fixture("baseline.json"), &cur, &["--format", "json"]).code(2);
    let v: Value = serde_json::from_str(&stdout(&a)).expect("JSON on stdout");
    assert_eq!(v["verdict"], "error");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("--allow-partial")), "{v}");
    // Allowed, a partial run's regression is still a regression.
    let a = gate_files(&fixture("baseline.json"), &cur, &["--allow-partial"]).code(1);
    let out = stdout(&a);
    assert!(out.contains("note: the current run is partial"), "{out}");
    assert!(out.contains("verdict: REGRESSION"), "{out}");
}

#[test]
fn update_refuses_a_partial_run_unless_allowed() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("baseline.json");
    std::fs::copy(fixture("baseline.json"), &base).expect("copy");
    let cur = edited(dir.path(), "pass.json", "partial-pass.json", |v| v["partial"] = true.into());
    for extra in [&[][..], &["--force"][..]] {
        let a = gate_files(&base, &cur, &[&["--update"][..], extra].concat()).code(2);
        let err = stderr(&a);
        assert!(err.contains("partial-pass.json") && err.contains("--allow-partial"), "{extra:?}: {err}");
        assert_eq!(json_file(&base), json_file(&fixture("baseline.json")), "baseline untouched");
    }
    let a = gate_files(&base, &cur, &["--update", "--allow-partial"]).code(0);
    assert!(stdout(&a).contains("baseline updated"), "{}", stdout(&a));
    assert_eq!(json_file(&base), json_file(&cur));
}

#[test]
fn implausible_calibration_is_refused_on_either_side() {
    let dir = tempfile::tempdir().expect("tmp");
    // 1e-320 is subnormal: the gate once printed "machine speed 0.000x" and "improved -100%".
    for (i, (bad, shown)) in [
        (serde_json::json!(1e-320), Some("1e-320")),
        (serde_json::json!(1e308), Some("1e308")),
        (serde_json::json!(0.001), Some("0.001")),
        (serde_json::json!(200_000.0), Some("200000")),
        (serde_json::json!(0.0), None),
        (serde_json::json!(-4.0), None),
        (serde_json::json!("NaN"), None),
        (Value::Null, None),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("cal-{i}.json");
        let set = |v: &mut Value| v["calibration"]["ucx_loopback_gbps"] = bad.clone();
        let cur = edited(dir.path(), "pass.json", &name, set);
        let base = edited(dir.path(), "baseline.json", &format!("base-{name}"), set);
        for (side, b, c) in
            [("current", fixture("baseline.json"), cur), ("baseline", base, fixture("pass.json"))]
        {
            let a = gate_files(&b, &c, &[]).code(2);
            let err = stderr(&a);
            let file = if side == "current" { &c } else { &b };
            assert!(err.contains(&file.display().to_string()), "{bad}: {err}");
            // A string where the schema has a number is refused by the summary reader already.
            if !bad.is_string() {
                assert!(err.contains(&format!("of the {side} summary")), "{bad}: {err}");
                assert!(err.contains("`ucx_loopback_gbps`"), "{bad}: {err}");
            }
            if let Some(shown) = shown {
                assert!(err.contains(shown), "{bad}: {err}");
                assert!(err.contains("0.01") && err.contains("100000 GB/s"), "{bad}: {err}");
            }
            assert!(!stdout(&a).contains("verdict: PASS"), "{bad}: {}", stdout(&a));
        }
    }
    // The edges of the range are plausible.
    for ok in [0.01, 100_000.0] {
        let cur = edited(dir.path(), "pass.json", "edge.json", |v| {
            v["calibration"]["ucx_loopback_gbps"] = ok.into();
        });
        let a = gate_files(&fixture("baseline.json"), &cur, &[]);
        assert_ne!(a.get_output().status.code(), Some(2), "{ok}: {}", stderr(&a));
    }
}
