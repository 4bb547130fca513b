//! SIGINT and SIGTERM, sent to the process and to its process group, for every subcommand
//! that can run longer than a second. The subcommands are listed from kvx's own clap
//! definition, so a new one fails [`every_subcommand_is_classified`] until it is given a
//! long-running invocation here or a reason why it ends by itself within a second.
//!
//! Each run must end within 2 s of the signal, with exit 130 (SIGINT) or 143 (SIGTERM) for a
//! run (a process that dies of the signal itself, whose shell status is the same 128+n, is
//! accepted where it holds nothing to clean up), and exit 0 for the servers (their documented
//! clean shutdown); no process it started may outlive it, whatever process group it runs in,
//! and nothing may be left in its temp directory. Waits are on events: a line the process
//! prints, a connection it opens, a process it starts (`/proc`, polled: processes that are not
//! our children give no event).

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::CommandFactory as _;

use crate::procs::{Spawned, default_signals, descendants_of, exclusive, kvx_path, signal, wait_gone};

/// What the user waits for after Ctrl-C.
const PROMPT_EXIT: Duration = Duration::from_secs(2);
/// Hard limit for a run to get going, and before the test gives up on one that ignores a signal.
const HARD: Duration = Duration::from_secs(60);
const TINY: &[&str] = &["--num-kv-heads", "4", "--layers", "2", "--head-dim", "64"];

/// How a subcommand is expected to end on a signal.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ends {
    /// A run: exit 130/143 (or death by the signal itself, where `dies_ok`).
    Interrupted { dies_ok: bool },
    /// A server: a clean shutdown, exit 0.
    Shutdown,
}

/// What tells the test that a run is under way.
enum Ready {
    /// A stderr line starting with this.
    StderrLine(&'static str),
    /// Stdout containing this.
    Stdout(&'static str),
    /// The silent listener has accepted this many connections.
    Connections(usize),
    /// A descendant process whose argv holds these two words side by side.
    Descendant(&'static str, &'static str),
}

/// A long-running invocation of a subcommand.
struct Long {
    args: Vec<String>,
    ready: Ready,
    ends: Ends,
}

/// How each subcommand is treated: `Ok(long)` or `Err(why it ends by itself within a second)`.
fn classify(name: &str, silent: &str, results: &Path) -> Option<Result<Long, &'static str>> {
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (host, port) = silent.split_once(':').expect("host:port");
    Some(match name {
        "bench" => {
            let mut args =
                words(&["bench", "--p-tp", "2", "--d-tp", "1", "--requests", "100000", "--no-calibrate"]);
            args.extend(words(TINY));
            args.extend(["--results-dir".into(), results.display().to_string()]);
            Ok(Long {
                args,
                ready: Ready::StderrLine("kvx bench: P tp"),
                ends: Ends::Interrupted { dies_ok: false },
            })
        }
        "xfer" => Ok(Long {
            args: words(&["xfer", "--sizes", "64KiB,1MiB", "--inflight", "1,8", "--duration", "20s"]),
            ready: Ready::Descendant("--xfer-role", "target"),
            ends: Ends::Interrupted { dies_ok: false },
        }),
        "calibrate" => Ok(Long {
            args: words(&["calibrate", "--out", &results.join("rates.json").display().to_string()]),
            ready: Ready::Descendant("--xfer-role", "target"),
            ends: Ends::Interrupted { dies_ok: false },
        }),
        "load" => Ok(Long {
            args: words(&[
                "load",
                "--url",
                &format!("http://{silent}"),
                "--requests",
                "100000",
                "--concurrency",
                "4",
                "--results-dir",
                &results.display().to_string(),
            ]),
            ready: Ready::Connections(1),
            ends: Ends::Interrupted { dies_ok: false },
        }),
        "probe" => Ok(Long {
            args: words(&["probe", silent, "--timeout", "60s"]),
            ready: Ready::Connections(1),
            ends: Ends::Interrupted { dies_ok: true },
        }),
        "serve-engine" => Ok(Long {
            args: words(&["serve-engine", "--role", "decode", "--port", "0", "--kv-backend", "null"]),
            ready: Ready::Stdout("listening on http://"),
            ends: Ends::Shutdown,
        }),
        "serve-proxy" => Ok(Long {
            args: words(&[
                "serve-proxy",
                "--port",
                "0",
                "--prefiller-host",
                host,
                "--prefiller-port",
                port,
                "--decoder-host",
                host,
                "--decoder-port",
                port,
            ]),
            ready: Ready::Stdout("listening on http://"),
            ends: Ends::Shutdown,
        }),
        "topo" | "layout" | "plan" | "report" | "completions" => {
            Err("computes from its flags and bounded input files (64 MiB at most), and prints")
        }
        "gate" => Err("compares two bounded summary files"),
        "doctor" => Err("runs a fixed list of checks of this host, each bounded"),
        "worker" => Err("kvx's own rank process, started by a bench and stopped with it (covered by bench)"),
        "help" => Err("clap's help"),
        _ => return None,
    })
}

fn subcommands() -> Vec<String> {
    kvx::cli::Cli::command().get_subcommands().map(|c| c.get_name().to_string()).collect()
}

#[test]
fn every_subcommand_is_classified() {
    let dir = tempfile::tempdir().expect("dir");
    let unknown: Vec<String> =
        subcommands().into_iter().filter(|n| classify(n, "127.0.0.1:1", dir.path()).is_none()).collect();
    assert!(
        unknown.is_empty(),
        "subcommands with no signal case (give them a long-running invocation in tests/it/signals.rs, \
         or say why they end within a second): {unknown:?}"
    );
}

/// A loopback listener that accepts connections and never answers (counted, held open; each
/// accept is also sent on `events`).
struct Silent {
    addr: String,
    accepted: Arc<AtomicUsize>,
    events: std::sync::mpsc::Receiver<()>,
}

impl Silent {
    fn start() -> Silent {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
        let addr = listener.local_addr().expect("addr").to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        let (tx, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in listener.incoming().flatten() {
                held.push(s);
                count.fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(());
            }
        });
        Silent { addr, accepted, events }
    }
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes: for `/proc`, where processes
/// that are not our children give no event to wait on.
fn poll_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

fn one(name: &str, to_group: bool, sig: i32) -> Result<(), String> {
    let silent = Silent::start();
    let results = tempfile::tempdir().expect("results dir");
    let tmp = tempfile::tempdir().expect("TMPDIR of the run");
    let Some(Ok(long)) = classify(name, &silent.addr, results.path()) else { return Ok(()) };
    let sig_name = if sig == libc::SIGINT { "SIGINT" } else { "SIGTERM" };
    let case =
        format!("kvx {name}, {sig_name} to the {}", if to_group { "process group" } else { "process" });
    let mut cmd = Command::new(kvx_path());
    cmd.args(&long.args).env("TMPDIR", tmp.path()).env_remove("KVX_LOG");
    // The child starts with the default dispositions, whatever this process inherited (a suite
    // started in the background by a non-interactive shell ignores SIGINT).
    default_signals(&mut cmd);
    let mut run = Spawned::start(&case, cmd);
    let ready = match long.ready {
        Ready::StderrLine(prefix) => run.wait_line(HARD, |l| l.starts_with(prefix)).is_some(),
        Ready::Stdout(needle) => run.wait_stdout(HARD, |t| t.contains(needle)).is_some(),
        Ready::Connections(n) => {
            let deadline = Instant::now() + HARD;
            while silent.accepted.load(Ordering::SeqCst) < n {
                let left = deadline.saturating_duration_since(Instant::now());
                if silent.events.recv_timeout(left).is_err() {
                    break;
                }
            }
            silent.accepted.load(Ordering::SeqCst) >= n
        }
        Ready::Descendant(a, b) => poll_until(HARD, || {
            descendants_of(run.pid).iter().any(|p| p.argv.windows(2).any(|w| w[0] == a && w[1] == b))
        }),
    };
    if !ready {
        run.kill_group();
        for p in descendants_of(run.pid) {
            signal(p.pid as i32, libc::SIGKILL);
        }
        return Err(format!("{case}: never got going:\n{}", run.stderr()));
    }
    let family: Vec<u32> = descendants_of(run.pid).into_iter().map(|p| p.pid).collect();
    let target = if to_group { -(run.pid as i32) } else { run.pid as i32 };
    assert!(signal(target, sig), "{case}: send the signal");
    let sent = Instant::now();
    let status = run.wait_exit(HARD);
    let took = sent.elapsed();
    let left = wait_gone(&family, Duration::from_millis(500));
    for &p in &left {
        signal(p as i32, libc::SIGKILL);
    }
    let Some(status) = status else {
        run.kill_group();
        return Err(format!("{case}: still running {HARD:?} after the signal:\n{}", run.stderr()));
    };
    eprintln!("{case}: {status} {took:?} after the signal");
    let mut wrong = Vec::new();
    let code = if sig == libc::SIGINT { 130 } else { 143 };
    use std::os::unix::process::ExitStatusExt as _;
    let ok_status = match long.ends {
        Ends::Interrupted { dies_ok } => {
            status.code() == Some(code) || (dies_ok && status.signal() == Some(sig))
        }
        Ends::Shutdown => status.code() == Some(0),
    };
    if !ok_status {
        wrong.push(format!("ended {status}, expected {:?} ({code} for a run)", long.ends));
    }
    if took > PROMPT_EXIT {
        wrong.push(format!("took {took:?} to end"));
    }
    if !left.is_empty() {
        wrong.push(format!("processes it started outlived it: {left:?}"));
    }
    let stray: Vec<_> =
        std::fs::read_dir(tmp.path()).expect("tmp").flatten().map(|e| e.file_name()).collect();
    if !stray.is_empty() {
        wrong.push(format!("temp files left behind: {stray:?}"));
    }
    if run.stderr().contains("panicked") {
        wrong.push("panicked".into());
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(format!("{case}: {}; stderr:\n{}", wrong.join("; "), run.stderr()))
    }
}

/// Every long-running subcommand, SIGINT and SIGTERM, to the process and to its group.
#[test]
fn every_long_running_subcommand_ends_within_2_s_of_sigint_or_sigterm() {
    let _turn = exclusive();
    let dir = tempfile::tempdir().expect("dir");
    let mut failures = BTreeMap::new();
    let mut ran = 0;
    for name in subcommands() {
        if !matches!(classify(&name, "127.0.0.1:1", dir.path()), Some(Ok(_))) {
            continue;
        }
        for to_group in [false, true] {
            for sig in [libc::SIGINT, libc::SIGTERM] {
                ran += 1;
                if let Err(e) = one(&name, to_group, sig) {
                    failures.insert(format!("{name} {to_group} {sig}"), e);
                }
            }
        }
    }
    assert!(ran >= 28, "seven long-running subcommands, four cases each: ran {ran}");
    assert!(
        failures.is_empty(),
        "{} of {ran} cases failed:\n{}",
        failures.len(),
        failures.into_values().collect::<Vec<_>>().join("\n\n")
    );
}
