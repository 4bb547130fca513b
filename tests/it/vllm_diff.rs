//! kvx's model reading and KV cache rules against vLLM 0.33.0's own functions
//! (`scripts/vllm-diff.py`): generated configs and layer patterns, each at TP 1, 2, 4 and 8
//! under each GDN prefill backend, prefix caching on and off, HMA on and off. Runs where a
//! Python with vLLM 0.33.0 exists (`KVX_VLLM_PYTHON`, or `.venv-vllm/bin/python` in the
//! checkout) and says it skipped where none does: vLLM with torch is gigabytes, which CI does
//! not install. The committed run of 1,200 models is `results/docs/vllm-diff/summary.json`.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::ucx_common::{Part, skip};

#[test]
fn kvx_agrees_with_vllms_own_functions_on_generated_models() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("KVX_VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv-vllm/bin/python"));
    if !python.exists() {
        skip(
            Part::Vllm,
            &format!(
                "vllm_diff: no Python with vllm==0.33.0 at {} (set KVX_VLLM_PYTHON, or python3 -m venv \
             .venv-vllm && .venv-vllm/bin/pip install vllm==0.33.0)",
                python.display()
            ),
        );
        return;
    }
    let has_vllm = Command::new(&python)
        .args(["-c", "import vllm, sys; sys.exit(0 if vllm.__version__ == '0.33.0' else 1)"])
        .env("VLLM_LOGGING_LEVEL", "ERROR")
        .status()
        .is_ok_and(|s| s.success());
    if !has_vllm {
        skip(Part::Vllm, &format!("vllm_diff: {} has no vllm 0.33.0", python.display()));
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("summary.json");
    let run = assert_cmd::Command::new(&python)
        .arg(root.join("scripts/vllm-diff.py"))
        .arg("--kvx")
        .arg(assert_cmd::cargo::cargo_bin!("kvx"))
        .args(["--models", "150", "--seed", "7", "--out"])
        .arg(&out)
        .timeout(Duration::from_secs(900))
        .output()
        .expect("the harness runs");
    let status = run.status;
    eprintln!("{}", String::from_utf8_lossy(&run.stdout));
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("summary written")).expect("summary is JSON");
    assert_eq!(summary["disagreements"], 0, "kvx and vLLM disagree: {summary}");
    assert!(summary["engines"].as_u64().unwrap_or(0) >= 600, "too few engines compared: {summary}");
    assert!(summary["engines_built"].as_u64().unwrap_or(0) >= 300, "too few engines built: {summary}");
    assert!(status.success(), "the harness failed: {summary}");
}
