//! The edge of the binary: a closed stdout ends a run quietly (exit 0, no panic), the gate
//! keeps its verdict as its exit code whatever happens to its output, and no `unsafe` lives
//! outside the transfer layer's fence.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt as _;

/// Hard limit for one command of this module.
const LIMIT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(rel: &str) -> String {
    root().join("tests/fixtures").join(rel).display().to_string()
}

/// What a command did with its stdout taken away.
pub struct Closed {
    pub status: ExitStatus,
    pub stderr: String,
}

/// How the reader of the command's stdout goes away.
#[derive(Clone, Copy, Debug)]
pub enum Reader {
    /// Closed before the command starts: its first write fails (EPIPE), deterministically.
    ClosedAtStart,
    /// Reads this many bytes, then closes (`| head -c N`).
    ClosesAfter(usize),
}

/// Runs `cmd` with its stdout on a pipe whose reader goes away as `reader` says; kills it
/// (and fails the test) past `LIMIT`.
pub fn run_with_closed_stdout(mut cmd: Command, reader: Reader) -> Closed {
    let (mut read_end, write_end) = std::io::pipe().expect("pipe");
    let stderr_file = tempfile::tempfile().expect("temp file for stderr");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::from(stderr_file.try_clone().expect("clone stderr file")));
    if let Reader::ClosedAtStart = reader {
        drop(read_end);
        let mut child = cmd.spawn().expect("spawn kvx");
        let status = wait(&mut child);
        return Closed { status, stderr: read_all(stderr_file) };
    }
    let mut child = cmd.spawn().expect("spawn kvx");
    // The command's own copy of the write end is its only one once `cmd` is dropped.
    drop(cmd);
    if let Reader::ClosesAfter(n) = reader {
        let mut buf = vec![0u8; n];
        // A short or failed read is fine: the reader goes away either way.
        let _ = read_end.read_exact(&mut buf);
    }
    drop(read_end);
    let status = wait(&mut child);
    Closed { status, stderr: read_all(stderr_file) }
}

fn wait(child: &mut std::process::Child) -> ExitStatus {
    match child.wait_timeout(LIMIT).expect("wait for kvx") {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvx did not exit within {LIMIT:?} of its stdout closing");
        }
    }
}

fn read_all(mut f: std::fs::File) -> String {
    use std::io::Seek as _;
    let mut s = String::new();
    let _ = f.rewind();
    let _ = f.read_to_string(&mut s);
    s
}

fn kvx(args: &[&str]) -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("kvx"));
    c.args(args);
    c
}

/// Every printing subcommand, with the exit code its verdict asks for.
fn printing_commands() -> Vec<(Vec<String>, i32)> {
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_string()).collect::<Vec<_>>();
    let (run_a, run_b) = (fixture("report/run-a"), fixture("report/run-b"));
    let (base, pass, regress) =
        (fixture("gate/baseline.json"), fixture("gate/pass.json"), fixture("gate/regress.json"));
    vec![
        (s(&["topo", "--p-tp", "8", "--d-tp", "2"]), 0),
        (s(&["topo", "--p-tp", "8", "--d-tp", "2", "--format", "json"]), 0),
        (s(&["layout", "--tp", "8", "--show-regions", "3"]), 0),
        (s(&["layout", "--tp", "8", "--format", "json"]), 0),
        (s(&["plan", "--p-tp", "8", "--d-tp", "2", "--prompt-len", "4096"]), 0),
        (s(&["plan", "--p-tp", "8", "--d-tp", "2", "--prompt-len", "4096", "--format", "json"]), 0),
        (s(&["report", &run_a, "--no-charts"]), 0),
        (s(&["report", &run_a, "--no-charts", "--format", "json"]), 0),
        (s(&["report", &run_a, &run_b]), 0),
        (s(&["report", &run_a, &run_b, "--format", "json"]), 0),
        (s(&["report", &run_a, &run_b, "--format", "markdown"]), 0),
        (s(&["gate", "--baseline", &base, "--current", &pass]), 0),
        (s(&["gate", "--baseline", &base, "--current", &pass, "--format", "json"]), 0),
        (s(&["gate", "--baseline", &base, "--current", &regress]), 1),
        (s(&["gate", "--baseline", &base, "--current", &regress, "--format", "json"]), 1),
        (s(&["doctor", "--no-self-test"]), -1),
        (s(&["doctor", "--no-self-test", "--format", "json"]), -1),
        (s(&["completions", "bash"]), 0),
        (s(&["--help"]), 0),
        (s(&["plan", "--help"]), 0),
        (s(&["--version"]), 0),
    ]
}

#[test]
fn every_printing_command_exits_quietly_when_its_stdout_is_closed() {
    for reader in [Reader::ClosedAtStart, Reader::ClosesAfter(16)] {
        for (args, want) in printing_commands() {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = run_with_closed_stdout(kvx(&a), reader);
            let case = format!("kvx {} ({reader:?})", args.join(" "));
            assert!(!out.stderr.contains("panicked"), "{case}: {}", out.stderr);
            // `doctor` exits 2 on a host that lacks something it needs: a verdict, as the gate's.
            let want = if want < 0 { doctor_verdict(&a) } else { want };
            assert_eq!(out.status.code(), Some(want), "{case}: stderr: {}", out.stderr);
            if want == 0 {
                assert!(
                    !out.stderr.contains("error") && !out.stderr.contains("Broken pipe"),
                    "{case}: a closed stdout is no error: {}",
                    out.stderr
                );
            }
        }
    }
}

/// `kvx doctor`'s exit code with a stdout that stays open (its verdict on this host).
fn doctor_verdict(args: &[&str]) -> i32 {
    let out = kvx(args).stdout(Stdio::null()).stderr(Stdio::null()).status().expect("run kvx doctor");
    out.code().expect("doctor exit code")
}

#[test]
fn a_large_plan_piped_into_head_exits_0() {
    // The reproduction: megabytes of JSON, the reader gone after 100 bytes.
    let cmd = kvx(&["plan", "--p-tp", "8", "--d-tp", "2", "--prompt-len", "131072", "--format", "json"]);
    let out = run_with_closed_stdout(cmd, Reader::ClosesAfter(100));
    assert_eq!(out.status.code(), Some(0), "stderr: {}", out.stderr);
    assert!(out.stderr.is_empty(), "no message for a closed stdout: {}", out.stderr);
}

#[test]
fn a_bench_with_a_closed_stdout_finishes_its_run_and_exits_0() {
    let _turn = crate::procs::exclusive();
    let results = tempfile::tempdir().expect("tmp");
    let a = [
        "--requests",
        "3",
        "--prompt-len",
        "256",
        "--num-kv-heads",
        "4",
        "--layers",
        "2",
        "--head-dim",
        "64",
    ];
    let out = run_with_closed_stdout(crate::procs::bench_cmd(results.path(), &a), Reader::ClosedAtStart);
    assert_eq!(out.status.code(), Some(0), "{}", out.stderr);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    let run = crate::procs::run_dir(results.path()).expect("a run directory");
    let summary = std::fs::read_to_string(run.join("summary.json")).expect("the summary is written");
    assert!(summary.contains("\"requests_ok\": 3"), "{summary}");
}

#[test]
fn the_gate_keeps_its_verdict_and_writes_its_markdown_with_a_closed_stdout() {
    let dir = tempfile::tempdir().expect("tmp");
    let md = dir.path().join("verdict.md");
    let base = fixture("gate/baseline.json");
    for (current, want) in [("gate/regress.json", 1), ("gate/pass.json", 0), ("gate/wrong-schema.json", 2)] {
        for format in ["table", "json"] {
            let cmd = kvx(&[
                "gate",
                "--baseline",
                &base,
                "--current",
                &fixture(current),
                "--format",
                format,
                "--markdown",
                md.to_str().expect("utf8"),
            ]);
            let out = run_with_closed_stdout(cmd, Reader::ClosedAtStart);
            assert_eq!(out.status.code(), Some(want), "{current} --format {format}: {}", out.stderr);
            assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
            let text = std::fs::read_to_string(&md).expect("the markdown verdict is written");
            assert!(!text.is_empty());
            std::fs::remove_file(&md).expect("rm");
        }
    }
}

#[test]
fn exit_codes_are_documented_in_the_top_level_help() {
    let out = kvx(&["--help"]).output().expect("kvx --help");
    // clap wraps the text to the terminal width: compare words, not lines.
    let help = String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in
        ["Exit status: 0", "1 the run completed with failed or unverified requests", "2 bad input", "130/143"]
    {
        assert!(help.contains(needle), "`{needle}` in kvx --help:\n{help}");
    }
}

#[test]
fn a_bad_ucx_library_is_the_first_line_of_xfer_s_error() {
    let out = kvx(&["xfer", "--ucx-lib", "/nonexistent/libucp.so", "--sizes", "4096", "--iters", "1"])
        .output()
        .expect("kvx xfer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error: ") && first.contains("--ucx-lib"),
        "first line names the cause: {stderr}"
    );
    assert!(!stderr.contains("control connection"), "no broken-connection noise before or after: {stderr}");
}

#[test]
fn a_bad_ucx_library_is_the_first_line_of_bench_s_error_and_no_worker_starts() {
    let results = tempfile::tempdir().expect("tmp");
    let out =
        kvx(&["bench", "--requests", "2", "--ucx-lib", "/nonexistent/libucp.so", "--num-kv-heads", "4"])
            .arg("--results-dir")
            .arg(results.path())
            .output()
            .expect("kvx bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("error: ") && first.contains("--ucx-lib"),
        "first line names the cause: {stderr}"
    );
    assert!(!stderr.contains("[P0]") && !stderr.contains("rank 0"), "no worker started: {stderr}");
    let runs = std::fs::read_dir(results.path()).expect("results dir").count();
    assert_eq!(runs, 0, "no run directory for a bad flag");
}

/// Source files allowed to hold `unsafe`: the UCX and NIXL bindings and the memory modules
/// of the transfer layer (host memory, and the CUDA memory modules beside it).
fn in_fence(rel: &Path) -> bool {
    let s = rel.to_string_lossy();
    s.starts_with("src/transfer/ucx/")
        || (s.starts_with("src/transfer/nixl/") && s != "src/transfer/nixl/blob.rs")
        || s == "src/transfer/memory.rs"
        || s.starts_with("src/transfer/memory/")
        || (s.starts_with("src/transfer/") && s.contains("cuda"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Code of a source line without its `//` comment (close enough for a token search: a `//`
/// inside a string only hides more text, never adds any).
fn code_of(line: &str) -> &str {
    line.split_once("//").map_or(line, |(code, _)| code)
}

#[test]
fn no_unsafe_outside_the_transfer_fence() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    assert!(files.len() > 50, "found the sources: {}", files.len());
    let mut found = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(root()).expect("under the root");
        if in_fence(rel) {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        for (i, line) in text.lines().enumerate() {
            let code = code_of(line).replace("forbid(unsafe_code)", "");
            let has_word = code
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .any(|w| w == "unsafe" || w == "unsafe_code");
            if has_word {
                found.push(format!("{}:{}: {}", rel.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "`unsafe` outside src/transfer/ucx/, src/transfer/memory.rs and the CUDA memory modules \
         (wrap the call in a crate such as rustix or nix, or behind a safe function inside the fence):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_module_outside_the_fence_forbids_unsafe() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).expect("lib.rs");
    let mut roots = vec!["src/bin/kvx.rs".to_string(), "src/error.rs".into(), "src/output.rs".into()];
    for m in [
        "cli", "clock", "config", "diagnose", "host", "input", "layouts", "pipeline", "report", "serve",
        "settings", "topology", "vocab",
    ] {
        assert!(lib.contains(&format!("pub mod {m};")), "src/lib.rs declares `{m}`");
        let dir = format!("src/{m}/mod.rs");
        roots.push(if root().join(&dir).exists() { dir } else { format!("src/{m}.rs") });
    }
    for f in &roots {
        let text = std::fs::read_to_string(root().join(f)).expect(f);
        assert!(
            text.contains("\n#![forbid(unsafe_code)]\n"),
            "{f} forbids unsafe code (`#![forbid(unsafe_code)]`)"
        );
    }
}
