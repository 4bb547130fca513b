//! A results directory that fills up half-way loses nothing that was measured: the tables
//! are printed before any file is written, `requests.csv` keeps whole rows, the rows it could
//! not take are printed on stderr (CSV, with the header), every other file is tried, and the
//! run exits 2 naming what was not written and what was kept.
//!
//! `kvx load` runs under a file-size limit (`ulimit -f`: a write past it fails as on a full
//! disk); `kvx bench` (whose UCX workers need shared-memory files larger than such a limit)
//! writes into a 64 KiB tmpfs, where one can be mounted (root), else it says `SKIPPED: why`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::procs::{Spawned, exclusive, kvx_path};
use crate::ucx_common::{Part, skip};

/// The request ids of CSV text whose header names `request_id` (any other lines skipped).
fn ids(csv_text: &str) -> Vec<String> {
    let mut lines = csv_text.lines().skip_while(|l| !l.starts_with("request_id,"));
    let Some(_header) = lines.next() else { return Vec::new() };
    lines
        .take_while(|l| !l.is_empty() && !l.starts_with("kvx") && !l.starts_with("error"))
        .filter_map(|l| l.split(',').next().map(str::to_string))
        .collect()
}

/// What a run that hit the limit must show: exit 2, its tables on stdout, the message naming
/// requests.csv and what was kept, and `expect` distinct rows between the file and stderr.
fn check(what: &str, out: &Output, run_dir: &Path, expect: usize) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: stderr:\n{stderr}");
    assert!(stdout.contains("results: "), "{what}: the tables are printed:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("not all of it could be written") && stderr.contains("kept there:"),
        "{what}: says what was not written and what was kept:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{what}:\n{stderr}");
    let file = std::fs::read_to_string(run_dir.join("requests.csv")).expect("requests.csv");
    assert!(file.ends_with('\n') || file.is_empty(), "{what}: requests.csv keeps whole rows: {file:?}");
    let in_file = ids(&file);
    let on_stderr = ids(&stderr);
    assert!(!on_stderr.is_empty(), "{what}: the rows not written are on stderr:\n{stderr}");
    let all: BTreeSet<_> = in_file.iter().chain(&on_stderr).collect();
    assert_eq!(in_file.len() + on_stderr.len(), all.len(), "{what}: no row twice");
    assert_eq!(
        all.len(),
        expect,
        "{what}: {} rows in the file, {} on stderr",
        in_file.len(),
        on_stderr.len()
    );
    assert!(
        stderr.contains(&format!("requests.csv ({} of {expect} rows)", in_file.len())),
        "{what}: names how many rows the file kept:\n{stderr}"
    );
}

fn only_run_dir(root: &Path) -> std::path::PathBuf {
    let dirs: Vec<_> = std::fs::read_dir(root).expect("results").flatten().map(|e| e.path()).collect();
    assert_eq!(dirs.len(), 1, "one run directory: {dirs:?}");
    dirs[0].clone()
}

#[test]
fn a_load_run_past_the_file_size_limit_keeps_every_row() {
    let _turn = exclusive();
    let mut engine = Command::new(kvx_path());
    engine.args(["serve-engine", "--role", "decode", "--port", "0", "--kv-backend", "null", "--itl-ms", "0"]);
    let engine = Spawned::start("engine", engine);
    let listening = engine
        .wait_stdout(Duration::from_secs(30), |t| {
            t.lines().next().is_some_and(|l| l.starts_with("listening on "))
        })
        .unwrap_or_else(|| panic!("engine never listened:\n{}", engine.stderr()));
    let addr = listening
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("listening on "))
        .expect("address")
        .trim()
        .to_string();
    let results = tempfile::tempdir().expect("results");
    // 8 KiB per file: room for a few dozen of the 300 rows.
    let script = format!(
        "ulimit -f 8 && exec \"$0\" load --url {addr} --requests 300 --concurrency 8 --max-tokens 4 \
         --results-dir {}",
        results.path().display()
    );
    let out = assert_cmd::Command::new("bash")
        .args(["-c", &script])
        .arg(kvx_path())
        .timeout(Duration::from_secs(120))
        .output()
        .expect("kvx load");
    engine.kill_group();
    check("kvx load under ulimit -f 8", &out, &only_run_dir(results.path()), 300);
}

#[test]
fn a_bench_into_a_full_tmpfs_keeps_every_row() {
    let _turn = exclusive();
    let mnt = tempfile::tempdir().expect("mount point");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(mnt.path())
        .stderr(Stdio::piped())
        .output();
    match mounted {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return skip(
                Part::Tmpfs,
                &format!(
                    "a_bench_into_a_full_tmpfs_keeps_every_row: cannot mount a tmpfs: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ),
            );
        }
        Err(e) => {
            return skip(Part::Tmpfs, &format!("a_bench_into_a_full_tmpfs_keeps_every_row: no mount: {e}"));
        }
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(mnt.path());
    // A big file leaves 4 KiB: the header and a few rows of requests.csv.
    std::fs::write(mnt.path().join("filler"), vec![0u8; 60 * 1024]).expect("fill the tmpfs");
    let results = mnt.path().join("results");
    let out = assert_cmd::Command::new(kvx_path())
        .args(["bench", "--p-tp", "2", "--d-tp", "1", "--model", "llama-3.1-8b", "--requests", "200"])
        .args(["--no-calibrate", "--results-dir"])
        .arg(&results)
        .timeout(Duration::from_secs(300))
        .output()
        .expect("kvx bench");
    check("kvx bench into a 64 KiB tmpfs", &out, &only_run_dir(&results), 200);
}
