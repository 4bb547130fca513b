//! Golden outputs: the human and machine output of `topo`, `layout`, `plan`, `report`, the
//! two-run `report` comparison and `gate`, from the real binary on fixed inputs (fixtures under
//! tests/fixtures/), snapshot-tested with insta so a change to a table or a JSON field is a
//! reviewed diff (`cargo insta review`). Filters take out what varies between machines: the
//! checkout path.

use assert_cmd::Command;

fn kvx(args: &[&str]) -> String {
    let mut c = Command::cargo_bin("kvx").expect("kvx binary");
    c.timeout(std::time::Duration::from_secs(60));
    let out = c.args(args).output().expect("run kvx");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let code = out.status.code();
    assert!(
        matches!(code, Some(0 | 1)),
        "kvx {args:?} exited {code:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn fixture(rel: &str) -> String {
    format!("{}/tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"))
}

/// `s` as a regex matching itself.
fn escape(s: &str) -> String {
    s.chars()
        .map(|c| if "\\.+*?()|[]{}^$#&-~".contains(c) { format!("\\{c}") } else { c.to_string() })
        .collect()
}

/// Snapshots `value` under `name` with the machine-specific parts redacted.
fn golden(name: &str, value: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(&escape(env!("CARGO_MANIFEST_DIR")), "[ROOT]");
    settings.set_prepend_module_to_snapshot(true);
    settings.bind(|| insta::assert_snapshot!(name, value));
}

#[test]
fn topo_outputs() {
    let a = ["topo", "--p-tp", "8", "--d-tp", "2", "--model", "llama-3.1-70b"];
    golden("topo_table", &kvx(&a));
    golden("topo_json", &kvx(&[&a[..], &["--format", "json"]].concat()));
    let hetero = ["topo", "--p-tp", "2", "--d-tp", "4", "--model", "llama-3.1-8b", "--port-scheme", "worker"];
    golden("topo_fan_out_table", &kvx(&hetero));
}

#[test]
fn layout_outputs() {
    let a = ["layout", "--model", "llama-3.1-70b", "--tp", "8", "--show-regions", "3"];
    golden("layout_table", &kvx(&a));
    golden("layout_json", &kvx(&["layout", "--model", "qwen3-8b", "--tp", "2", "--format", "json"]));
}

/// Hybrid models (issue 25): a Mamba2/attention preset's groups, aligned block size, state
/// parts and regions, and one case of vLLM's hybrid oracle planned from the file as it stands.
#[test]
fn hybrid_outputs() {
    let a = ["layout", "--model", "nemotron-h-8b", "--tp", "2", "--show-regions", "3"];
    golden("hybrid_layout_table", &kvx(&a));
    let case = fixture("hybrid-case-nemotronh-p1-d2.json");
    golden("hybrid_plan_table", &kvx(&["plan", "--scenario", &case]));
    let json = kvx(&["plan", "--scenario", &case, "--format", "json"]);
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    golden("hybrid_plan_json", &serde_json::to_string_pretty(&v).expect("pretty"));
    // From flags: a GDN preset, its request allocated as vLLM's allocator leaves it.
    let flags =
        ["plan", "--model", "qwen3-next-80b-a3b", "--p-tp", "1", "--d-tp", "2", "--prompt-len", "4096"];
    golden("hybrid_plan_flags_table", &kvx(&flags));
    // Per group sources: GDN state from both prefill ranks of the slice, attention from one.
    // Triton GDN prefill: its 272- and 544-token blocks divide (FlashInfer's 320 and 576 do not).
    let topo =
        ["topo", "--model", "qwen3-next-80b-a3b", "--gdn-prefill", "triton", "--p-tp", "4", "--d-tp", "2"];
    golden("hybrid_topo_table", &kvx(&topo));
    let json = kvx(&[&topo[..], &["--format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    golden("hybrid_topo_json", &serde_json::to_string_pretty(&v).expect("pretty"));
    // Push: each prefill rank's WRITEs, vLLM's attention rule named where it applies.
    let push = [
        "--model",
        "qwen3-next-80b-a3b",
        "--gdn-prefill",
        "triton",
        "--p-tp",
        "1",
        "--d-tp",
        "4",
        "--block-size",
        "544",
        "--mode",
        "push",
    ];
    golden("hybrid_plan_push_table", &kvx(&[&["plan"][..], &push[..], &["--prompt-len", "2048"]].concat()));
    golden("hybrid_topo_push_table", &kvx(&[&["topo"][..], &push[..]].concat()));
}

#[test]
fn plan_outputs() {
    let a = ["plan", "--p-tp", "4", "--d-tp", "2", "--model", "llama-3.1-8b", "--prompt-len", "64"];
    golden("plan_table", &kvx(&a));
    golden("plan_json", &kvx(&[&a[..], &["--format", "json"]].concat()));
}

/// The posting-cost section with the user's measured rates in place of the defaults, on the
/// GPU notes' post-bound case (P8 -> D2 Llama-3.1-70B).
#[test]
fn plan_posting_cost_outputs() {
    let a = ["plan", "--p-tp", "8", "--d-tp", "2", "--model", "llama-3.1-70b", "--prompt-len", "4096"];
    let measured = ["--post-ns", "ucx=80,cuda-ipc=5000,cuda-batch=150,cuda-batch-call=9000"];
    golden(
        "plan_posting_table",
        &kvx(&[&a[..], &measured[..], &["--ceiling-gbps", "cuda-batch=1000"]].concat()),
    );
    let json = kvx(&[&a[..], &measured[..], &["--format", "json"]].concat());
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    golden("plan_posting_json", &serde_json::to_string_pretty(&v["posting"]).expect("posting"));
}

#[test]
fn report_outputs() {
    let run = fixture("report/run-a");
    golden("report_markdown", &kvx(&["report", &run, "--no-charts", "--format", "markdown"]));
    golden("report_json", &kvx(&["report", &run, "--no-charts", "--format", "json"]));
}

#[test]
fn comparison_outputs() {
    let (a, b) = (fixture("report/run-a"), fixture("report/run-b"));
    golden("compare_markdown", &kvx(&["report", &a, &b, "--format", "markdown"]));
    golden("compare_json", &kvx(&["report", &a, &b, "--format", "json"]));
}

#[test]
fn gate_outputs() {
    let base = fixture("gate/baseline.json");
    let gate = |current: &str, format: &str| {
        kvx(&["gate", "--baseline", &base, "--current", &fixture(current), "--format", format])
    };
    golden("gate_pass_table", &gate("gate/pass.json", "table"));
    golden("gate_pass_json", &gate("gate/pass.json", "json"));
    golden("gate_regression_json", &gate("gate/regress.json", "json"));
    golden("gate_failures_table", &gate("gate/failures.json", "table"));
}
