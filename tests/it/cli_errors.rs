//! Bad input: each gives exit code 2 and a message naming the flag to change, never a panic.

use crate::common::kvx;

const CASES: &[(&[&str], &str)] = &[
    (&["topo", "--p-tp", "0", "--d-tp", "2"], "--p-tp"),
    (&["topo", "--p-tp", "5000", "--d-tp", "2"], "--p-tp"),
    (&["topo", "--p-tp", "3", "--d-tp", "2"], "--p-tp"),
    (&["topo", "--p-tp", "2", "--d-tp", "3"], "--d-tp"),
    (&["topo", "--p-tp", "8", "--d-tp", "2", "--num-kv-heads", "4"], "--p-tp"),
    (&["topo", "--p-tp", "4", "--d-tp", "4", "--num-kv-heads", "6"], "--p-tp"),
    (&["topo", "--num-kv-heads", "0"], "--num-kv-heads"),
    (&["topo", "--layers", "0"], "--layers"),
    (&["topo", "--head-dim", "0"], "--head-dim"),
    (&["topo", "--model", "gpt-5"], "--model"),
    (&["topo", "--model-config", "/nonexistent/config.json"], "--model-config"),
    (&["topo", "--dtype", "fp7"], "--dtype"),
    (&["topo", "--vllm", "0.25"], "--vllm"),
    (&["topo", "--layout", "XYZ"], "--layout"),
    (&["topo", "--vllm", "0.19", "--layout", "LBHNC"], "--layout"),
    (&["topo", "--p-tp", "1", "--d-tp", "2", "--layout", "LBNHC"], "--d-layout"),
    (&["topo", "--p-tp", "1", "--d-tp", "2", "--layout", "BHLNC"], "--d-layout"),
    (&["topo", "--p-tp", "1", "--d-tp", "2", "--vllm", "0.19", "--layout", "NHD"], "--d-layout"),
    (&["topo", "--p-layout", "LBHNC", "--d-layout", "LBNHC"], "--d-layout"),
    (&["topo", "--p-layout", "LBHNC", "--d-layout", "BLHNC", "--permute"], "--d-layout"),
    (&["topo", "--p-block-size", "32", "--d-block-size", "16"], "--d-block-size"),
    (&["topo", "--p-block-size", "16", "--d-block-size", "24"], "--d-block-size"),
    (
        &["topo", "--p-tp", "2", "--d-tp", "1", "--p-block-size", "16", "--d-block-size", "32"],
        "--d-block-size",
    ),
    (&["topo", "--layout", "BLHNC", "--p-block-size", "16", "--d-block-size", "32"], "--d-block-size"),
    (&["topo", "--block-size", "0"], "--block-size"),
    (&["topo", "--port-scheme", "foo"], "--port-scheme"),
    (&["topo", "--side-channel-port", "65530", "--p-dp", "20"], "--side-channel-port"),
    (&["topo", "--p-dp", "0"], "--p-dp"),
    (&["plan", "--prompt-len", "0"], "--prompt-len"),
    // Issue 23: every missing choice named, numbers bounded, kinds of run not mixed.
    (&["load", "--url", "http://127.0.0.1:9"], "--rate or --concurrency"),
    (&["load", "--url", "http://127.0.0.1:9", "--rate", "1e-300"], "--rate"),
    (&["load", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--duration", "1e30"], "--duration"),
    (&["load", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--timeout", "1e-308"], "--timeout"),
    (&["bench", "--rate", "1e-300"], "--rate"),
    (&["bench", "--serve", "--compare-modes", "pull,push"], "--compare-modes"),
    (&["serve-engine", "--role", "prefill", "--prefill-tokens-per-s", "1e-300"], "--prefill-tokens-per-s"),
    // Issue 23, point 9: a list that names a choice twice, flags the null backend never uses,
    // a charts directory that is a file, a duration unit the hint names.
    (&["bench", "--compare-modes", "pull,pull"], "--compare-modes"),
    (&["bench", "--compare-transports", "ucx,storage,ucx"], "--compare-transports"),
    (&["bench", "--rounds", "3"], "--rounds"),
    (&["bench", "--rounds", "0", "--compare-modes", "pull,push"], "--rounds"),
    (&["xfer", "--nixl-requests", "reuse"], "--nixl-requests"),
    (&["xfer", "--rounds", "2"], "--rounds"),
    (&["serve-engine", "--role", "decode", "--kv-backend", "null", "--devices", "99"], "--devices"),
    (&["serve-engine", "--role", "decode", "--kv-backend", "null", "--mode", "push"], "--mode"),
    (&["report", "Cargo.toml", "--charts-dir", "Cargo.toml"], "--charts-dir"),
    (&["bench", "--timeout", "5h"], "ns, us, ms, s, m"),
    (&["serve-engine", "--role", "decode", "--max-body-size", "10"], "--max-body-size"),
    // A host buffer is staged for UCX reads in pull mode only; a comparison names each once.
    (&["bench", "--kv-buffer-device", "cpu", "--mode", "push"], "--kv-buffer-device"),
    (&["bench", "--kv-buffer-device", "cpu", "--transport", "storage"], "--kv-buffer-device"),
    (&["bench", "--compare-kv-buffer-device", "cpu,cpu"], "--compare-kv-buffer-device"),
    (&["bench", "--compare-kv-buffer-device", "cuda,cpu", "--mode", "push"], "--kv-buffer-device"),
    (
        &["serve-engine", "--role", "decode", "--kv-backend", "null", "--kv-buffer-device", "cpu"],
        "--kv-buffer-device",
    ),
    // kvx's switch for vLLM's conv-offset rule: hybrid models only.
    (&["plan", "--model", "llama-3.1-8b", "--prompt-len", "64", "--state-slices", "exact"], "--state-slices"),
    (&["plan", "--model", "gemma-3-4b", "--prompt-len", "64", "--host-copy", "per-group"], "--host-copy"),
    (
        &["plan", "--model", "nemotron-h-8b", "--prompt-len", "64", "--host-state-page", "padded"],
        "--host-state-page",
    ),
    // Hybrid engine flags on a uniform model, and the host buffer's switches without it.
    (
        &["plan", "--p-tp", "2", "--d-tp", "2", "--prompt-len", "64", "--kernel-block-size", "16"],
        "--kernel-block-size",
    ),
    (&["bench", "--requests", "1", "--no-prefix-caching"], "--no-prefix-caching"),
    (&["bench", "--model", "nemotron-h-8b", "--requests", "1", "--host-copy", "per-group"], "--host-copy"),
    (
        &["bench", "--model", "nemotron-h-8b", "--requests", "1", "--kernel-block-size", "7"],
        "--kernel-block-size",
    ),
    // What the serving path does not do with hybrid models, and the host buffer's switches
    // where they do not apply.
    (&["bench", "--model", "nemotron-h-8b", "--mode", "push", "--overlap", "layers"], "--overlap"),
    (&["bench", "--model", "gemma-3-4b", "--p-tp", "1", "--d-tp", "8", "--mode", "push"], "--d-tp"),
    (
        &[
            "bench",
            "--model",
            "qwen3-next-80b-a3b",
            "--gdn-prefill",
            "triton",
            "--p-tp",
            "4",
            "--d-tp",
            "2",
            "--mode",
            "push",
        ],
        "--mode",
    ),
    (&["bench", "--mode", "push", "--push-attention", "every-rank"], "--push-attention"),
    (&["bench", "--model", "nemotron-h-8b", "--push-attention", "every-rank"], "--push-attention"),
    (&["serve-engine", "--role", "decode", "--host-copy", "per-group"], "--host-copy"),
    (&["serve-engine", "--role", "decode", "--kernel-block-size", "16"], "--kernel-block-size"),
    (&["serve-engine", "--role", "decode", "--state-slices", "exact"], "--state-slices"),
    (
        &["bench", "--model", "nemotron-h-8b", "--requests", "1", "--host-descriptors", "per-group"],
        "--host-descriptors",
    ),
    (&["plan", "--prompt-len", "64", "--host-descriptors", "per-group"], "--host-descriptors"),
    (
        &["serve-engine", "--role", "decode", "--model", "nemotron-h-8b", "--host-state-page", "padded"],
        "--host-state-page",
    ),
    (
        &["plan", "--model", "llama-3.1-8b", "--prompt-len", "64", "--kv-buffer-device", "cpu"],
        "--kv-buffer-device",
    ),
    (
        &["serve-proxy", "--prefiller-host", "h", "--decoder-host", "h", "--max-body-size", "5GiB"],
        "--max-body-size",
    ),
    // Push for hybrid models where vLLM's push refuses it (kernel blocks of 272 and 544 tokens,
    // triton GDN prefill),
    // and its attention switch where it does not apply.
    (
        &[
            "plan",
            "--model",
            "qwen3-next-80b-a3b",
            "--gdn-prefill",
            "triton",
            "--p-tp",
            "4",
            "--d-tp",
            "2",
            "--prompt-len",
            "100",
            "--mode",
            "push",
        ],
        "--mode",
    ),
    (
        &["plan", "--prompt-len", "100", "--mode", "push", "--push-attention", "every-rank"],
        "--push-attention",
    ),
    (&["topo", "--model", "nemotron-h-8b", "--push-attention", "every-rank"], "--push-attention"),
    (&["layout", "--model", "llama-3.1-8b", "--kv-buffer-device", "cpu"], "--kv-buffer-device"),
    (&["plan"], "--prompt-len"),
    (&["plan", "--prompt-len", "100", "--prefix-hit", "1.5"], "--prefix-hit"),
    (&["plan", "--prompt-len", "100", "--alloc", "weird"], "--alloc"),
    (&["plan", "--prompt-len", "1000", "--p-num-blocks", "3"], "--p-num-blocks"),
    (&["plan", "--local-blocks", "9", "--remote-blocks", "0", "--d-num-blocks", "4"], "--local-blocks"),
    (&["plan", "--local-blocks", "0", "--remote-blocks", "9", "--p-num-blocks", "4"], "--remote-blocks"),
    (&["plan", "--scenario", "/nonexistent/case.json"], "--scenario"),
    (&["plan", "--prompt-len", "64", "--d-tp", "2", "--d-rank", "5"], "--d-rank"),
    (&["layout", "--tp", "2", "--rank", "9"], "--rank"),
    (&["layout", "--tp", "3"], "--tp"),
    (&["layout", "--tokens", "0"], "--tokens"),
    (&["xfer", "--device", "1"], "--device"),
    (&["xfer", "--mem", "cuda", "--ucx-alloc"], "--mem"),
    (&["xfer", "--batch-copy", "kernel"], "--batch-copy"),
    (&["bench", "--batch-copy", "kernel"], "--batch-copy"),
    (&["bench", "--batch-copy", "kernel", "--compare-transports", "ucx,storage"], "--batch-copy"),
];

#[test]
fn bad_inputs_exit_2_and_name_the_flag() {
    for (args, flag) in CASES {
        let out = kvx().args(*args).output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2; stderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: message should name {flag}: {stderr}");
    }
}

#[test]
fn json_rejection_is_a_json_object() {
    let out = kvx()
        .args(["topo", "--p-tp", "8", "--d-tp", "2", "--num-kv-heads", "4", "--format", "json"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(v["status"], "rejected");
    assert!(v["error"].as_str().is_some_and(|e| e.contains("--p-tp")), "{v}");
}

#[test]
fn help_lists_every_subcommand_and_examples() {
    let out = kvx().arg("--help").output().expect("runs");
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "topo",
        "layout",
        "plan",
        "xfer",
        "probe",
        "doctor",
        "bench",
        "report",
        "gate",
        "serve-engine",
        "serve-proxy",
        "load",
        "completions",
    ] {
        assert!(help.contains(cmd), "kvx --help lists {cmd}");
    }
    assert!(!help.contains("worker"), "the worker subcommand is hidden");
    for cmd in ["topo", "layout", "plan", "completions"] {
        let out = kvx().args([cmd, "--help"]).output().expect("runs");
        assert!(String::from_utf8_lossy(&out.stdout).contains("Example"), "{cmd} --help has an example");
    }
    let out = kvx().args(["completions", "bash"]).output().expect("runs");
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("kvx"));
}

/// Bad model configs through `--model-config` and `--model PATH`: truncated JSON, wrong types,
/// zero and negative sizes, a million layers, an unknown architecture, a path that does not
/// exist: exit 2 naming the flag and the field, no panic; the million layers refused before any
/// work (the hard timeout holds).
#[test]
fn bad_model_configs_exit_2_and_name_the_field() {
    let dir = tempfile::tempdir().expect("temp dir");
    let million: Vec<&str> = vec!["linear_attention"; 1_000_000];
    let cases: Vec<(String, &str)> = vec![
        (r#"{"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4"#.into(), "not valid JSON"),
        (r#"{"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": "four"}"#.into(), "`num_hidden_layers`"),
        (r#"{"architectures": ["JambaForCausalLM"], "mamba_d_state": -16}"#.into(), "`mamba_d_state`"),
        (r#"{"architectures": ["FalconH1ForCausalLM"], "num_attention_heads": 0}"#.into(), "`num_attention_heads`"),
        (r#"{"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 1000000}"#.into(), "4096"),
        (
            serde_json::json!({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 100_000, "layer_types": &million[..100_000]})
                .to_string(),
            "at most 4096",
        ),
        // A million layers listed is a 19 MB file: refused by its size before it is parsed.
        (
            serde_json::json!({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 1_000_000, "layer_types": million})
                .to_string(),
            "a model config is at most",
        ),
        (r#"{"architectures": ["BertForMaskedLM"], "num_hidden_layers": 12}"#.into(), "`architectures`"),
        (r#"{"num_hidden_layers": 12}"#.into(), "`architectures`"),
        (r#"[1, 2, 3]"#.into(), "not a JSON object"),
        (
            r#"{"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2, "layer_types": ["mamba", "conv"]}"#
                .into(),
            "`layer_types`",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("config-{i}.json"));
        std::fs::write(&path, text).expect("write config");
        for flag in ["--model-config", "--model"] {
            let out = kvx().args(["layout", flag]).arg(&path).output().expect("kvx runs");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag} config {i}: {stderr}");
            assert!(!stderr.contains("panicked"), "{flag} config {i} panicked: {stderr}");
            assert!(
                stderr.contains(flag) && stderr.contains(want),
                "{flag} config {i} names {want}: {stderr}"
            );
        }
    }
    // A path that does not exist is never a preset's name, and the old suffix says what replaced it.
    for (model, want) in [("/no/such/dir/jamba", "does not exist"), ("gpt-oss-120b:hma", "--hma")] {
        let out = kvx().args(["layout", "--model", model]).output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{model}: {stderr}");
        assert!(stderr.contains(want), "{model}: {stderr}");
    }
    // A folder holding a config.json reads as the config.
    let folder = dir.path().join("Jamba-v0.1");
    std::fs::create_dir(&folder).expect("folder");
    std::fs::write(
        folder.join("config.json"),
        r#"{"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8}"#,
    )
    .expect("write");
    let out =
        kvx().args(["layout", "--model"]).arg(&folder).args(["--format", "json"]).output().expect("kvx runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["engine"]["groups"].as_array().map(Vec::len), Some(8), "7 Mamba1 groups and 1 attention");
}

/// Input files are regular files of a bounded size: a device (`/dev/zero`, which was read until
/// memory ran out) or a directory given as a scenario, a rates file, a config or a gate's
/// baseline is exit 2 naming the flag, at once.
#[test]
fn input_files_that_are_devices_are_refused_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let dir_path = dir.path().to_string_lossy().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["plan", "--scenario", "/dev/zero"], "--scenario"),
        (vec!["plan", "--model", "llama-3.1-8b", "--prompt-len", "64", "--rates", "/dev/zero"], "--rates"),
        (vec!["bench", "--config", "/dev/zero"], "--config"),
        (vec!["layout", "--model-config", "/dev/zero"], "--model-config"),
        (vec!["plan", "--scenario", &dir_path], "--scenario"),
    ];
    for (args, flag) in cases {
        let out = kvx().args(&args).output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?} names {flag}: {stderr}");
    }
    let out =
        kvx().args(["gate", "--baseline", "/dev/zero", "--current", "/dev/zero"]).output().expect("kvx runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "gate: {stderr}");
    assert!(stderr.contains("not a regular file"), "gate says what is wrong: {stderr}");
}

/// Issue 47: each error names the flag the user typed, once: `--pool-blocks` (was "change
/// --p-num-blocks", not a bench flag), `--mla-dim` (was `--mla`), `--timeout` (was
/// `--lease`), `--ucx-tls` (was ucp_init's status from a worker), `--side-channel-host` (was a
/// worker's ZMQ error), `--ceiling-gbps` of 1e-320 (was accepted: "inf s"), and a refusal by
/// vLLM's rules or an oversized model state (was "(change --block-size)" twice); an empty
/// proxy backend host and port 0 (were accepted).
#[test]
fn errors_name_the_flag_the_user_typed_once() {
    let dir = tempfile::tempdir().expect("dir");
    let fixture = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hybrid-model-tiny.toml"
    ))
    .expect("fixture");
    let huge_state = dir.path().join("huge-state.toml");
    std::fs::write(&huge_state, fixture.replace("d_state = 16", "d_state = 4294967295")).expect("write");
    let huge_state = huge_state.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["bench", "--pool-blocks", "0", "--requests", "1"], "--pool-blocks"),
        (vec!["bench", "--pool-blocks", "4294967295", "--requests", "1"], "--pool-blocks"),
        (vec!["bench", "--mla-dim", "0", "--requests", "1"], "--mla-dim"),
        (vec!["plan", "--mla-dim", "4294967295", "--prompt-len", "64"], "--mla-dim"),
        (vec!["serve-engine", "--role", "decode", "--timeout", "0", "--port", "0"], "--timeout"),
        (
            vec!["serve-engine", "--role", "prefill", "--side-channel-host", "ü日本", "--port", "0"],
            "--side-channel-host",
        ),
        (vec!["bench", "--ucx-tls", "0", "--requests", "1", "--no-calibrate"], "--ucx-tls"),
        (
            vec!["plan", "--model", "llama-3.1-8b", "--prompt-len", "64", "--ceiling-gbps", "ucx=1e-320"],
            "--ceiling-gbps",
        ),
        (
            vec!["plan", "--model", "llama-3.1-8b", "--prompt-len", "64", "--post-ns", "ucx=1e308"],
            "--post-ns",
        ),
        (vec!["plan", "--model", "gemma-3-4b", "--prompt-len", "64", "--block-size", "4"], "--block-size"),
        (vec!["layout", "--model", &huge_state], "--block-size"),
        (
            vec![
                "serve-proxy",
                "--prefiller-hosts",
                "",
                "--prefiller-ports",
                "8100",
                "--decoder-hosts",
                "d",
                "--decoder-ports",
                "8200",
            ],
            "--prefiller-hosts",
        ),
        (
            vec![
                "serve-proxy",
                "--prefiller-hosts",
                "p",
                "--prefiller-ports",
                "0",
                "--decoder-hosts",
                "d",
                "--decoder-ports",
                "8200",
            ],
            "--prefiller-ports",
        ),
    ];
    for (args, flag) in cases {
        let out = kvx().args(&args).env("RUST_BACKTRACE", "0").output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("(change {flag})")), "{args:?} names {flag}: {stderr}");
        assert_eq!(stderr.matches("change --").count(), 1, "{args:?} names one flag, once: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("rank 0 died"), "{args:?}: {stderr}");
    }
}

/// Issue 47: a hybrid scenario cut off anywhere says that the file ends early (it said
/// "missing field `num_layers`", a field the cut-off document has, further on).
#[test]
fn a_cut_off_scenario_says_the_file_ends_early() {
    let dir = tempfile::tempdir().expect("dir");
    let whole = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hybrid-case-nemotronh-p1-d2.json"
    ))
    .expect("fixture");
    for cut in [100, whole.len() / 2, whole.len() - 10] {
        let path = dir.path().join(format!("cut-{cut}.json"));
        std::fs::write(&path, &whole[..cut]).expect("write");
        let out = kvx().args(["plan", "--scenario"]).arg(&path).output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "cut at {cut}: {stderr}");
        assert!(
            stderr.contains("ends early") && stderr.contains("(change --scenario)"),
            "cut at {cut}: {stderr}"
        );
    }
}
