//! Ctrl-C and SIGTERM to a running `kvx bench`, as a terminal sends them (to the whole
//! process group): at start-up, during calibration and mid-run. Each case must end within
//! 2 s of the signal with exit 130 (SIGINT) or 143 (SIGTERM), leave no process and no
//! engine temp directory behind, and keep its partial results on stdout and on disk
//! (marked partial). Waits are on events (a line on stderr, rows in `requests.csv`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::procs::{Spawned, exclusive, kvx_path, n, read_rows, run_dir, signal, summary_json, wait_rows};

/// What the user waits for after Ctrl-C.
const PROMPT_EXIT: Duration = Duration::from_secs(2);
/// Hard limit before the test gives up on a run that ignores the signal.
const HARD: Duration = Duration::from_secs(60);
const TINY: &[&str] = &["--num-kv-heads", "4", "--layers", "2", "--head-dim", "64"];
/// A small hybrid model (Mamba2 state, full attention, a sliding window).
const TINY_HYBRID: &[&str] =
    &["--model", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid-model-tiny.toml")];

/// Where the signal is sent.
#[derive(Debug, Clone, Copy)]
enum When {
    /// Right after the bench announced itself, with calibration off: the engines are starting.
    StartUp,
    /// Right after it announced itself, with calibration on (it runs before the engines).
    Calibration,
    /// After some requests finished.
    MidRun,
}

/// A long bench in its own process group, its temp files under `tmp`.
fn long_bench(results: &Path, tmp: &Path, when: When, model: &[&str]) -> Command {
    let mut cmd = Command::new(kvx_path());
    cmd.arg("bench").args(["--p-tp", "2", "--d-tp", "1", "--requests", "100000", "--prompt-len", "1024"]);
    cmd.args(model).arg("--results-dir").arg(results).args(["--format", "json"]);
    if !matches!(when, When::Calibration) {
        cmd.arg("--no-calibrate");
    }
    cmd.env("TMPDIR", tmp);
    cmd
}

fn interrupt(case: &str, when: When, sig: i32, code: i32) {
    interrupt_model(case, when, sig, code, TINY);
}

fn interrupt_model(case: &str, when: When, sig: i32, code: i32, model: &[&str]) {
    let _turn = exclusive();
    let results = tempfile::tempdir().expect("results dir");
    let tmp = tempfile::tempdir().expect("TMPDIR of the bench");
    let mut bench = Spawned::start(case, long_bench(results.path(), tmp.path(), when, model));
    match when {
        When::StartUp | When::Calibration => {
            let started = bench.wait_line(HARD, |l| l.starts_with("kvx bench: P tp"));
            assert!(started.is_some(), "{case}: the bench never announced itself:\n{}", bench.stderr());
        }
        When::MidRun => {
            wait_rows(&mut bench, results.path(), 3, HARD);
        }
    }
    assert!(signal(-(bench.pid as i32), sig), "{case}: signal the process group");
    let sent = Instant::now();
    let status = bench.expect_exit(HARD);
    let took = sent.elapsed();
    eprintln!("{case}: exited {status} {took:?} after the signal");
    assert_eq!(status.code(), Some(code), "{case}: stderr:\n{}", bench.stderr());
    assert!(took <= PROMPT_EXIT, "{case}: took {took:?} to end after the signal:\n{}", bench.stderr());
    assert!(bench.stderr().contains("interrupted by"), "{case}: says why it ended:\n{}", bench.stderr());
    assert!(!bench.stderr().contains("panicked"), "{case}:\n{}", bench.stderr());

    // Partial results, on stdout and on disk, agreeing.
    let s = summary_json(&bench);
    assert_eq!(s["partial"], true, "{case}: {s}");
    let notes = s["notes"].to_string();
    assert!(notes.contains("interrupted by SIG"), "{case}: the report says it was interrupted: {notes}");
    let run = run_dir(results.path()).unwrap_or_else(|| panic!("{case}: no run directory"));
    let on_disk: Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).expect("summary.json"))
            .expect("JSON");
    assert_eq!(on_disk["partial"], true, "{case}");
    assert_eq!(on_disk["requests_ok"], s["requests_ok"], "{case}");
    if matches!(when, When::MidRun) {
        let rows = read_rows(&run);
        let finished = n(&s, "requests_ok") + n(&s, "requests_failed") + n(&s, "requests_recomputed");
        assert!(rows.len() >= 3, "{case}: the rows written before the signal are kept");
        assert_eq!(rows.len() as u64, finished, "{case}: one row per finished request");
        assert!(n(&s, "requests_ok") >= 3, "{case}: {s}");
        assert_eq!(n(&s, "verify_failures"), 0, "{case}: {s}");
    }

    // Nothing left behind: no process of the group, no engine temp directory.
    assert!(!signal(-(bench.pid as i32), 0), "{case}: a process of the bench's group outlived it");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).expect("tmp").flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "{case}: temp files left behind: {left:?}");
}

#[test]
fn ctrl_c_at_start_up_ends_the_bench_cleanly() {
    interrupt("SIGINT at start-up", When::StartUp, libc::SIGINT, 130);
}

#[test]
fn ctrl_c_during_calibration_ends_the_bench_cleanly() {
    interrupt("SIGINT during calibration", When::Calibration, libc::SIGINT, 130);
}

#[test]
fn ctrl_c_mid_run_ends_the_bench_cleanly_with_partial_results() {
    interrupt("SIGINT mid-run", When::MidRun, libc::SIGINT, 130);
}

#[test]
fn sigterm_mid_run_ends_the_bench_cleanly_with_partial_results() {
    interrupt("SIGTERM mid-run", When::MidRun, libc::SIGTERM, 143);
}

#[test]
fn ctrl_c_mid_run_of_a_hybrid_model_ends_the_bench_cleanly_with_partial_results() {
    interrupt_model("SIGINT mid-run, hybrid model", When::MidRun, libc::SIGINT, 130, TINY_HYBRID);
}
