//! Notifications over UCX active messages between real processes, on every UCX build
//! found on this host (the project's `.ucx/` and Debian's system `libucp.so.0`); a build
//! that is missing is reported as SKIPPED with the reason.
//!
//! UCX can be loaded only once per process, so each build runs in a child copy of this
//! test binary (`am_sender_child`), which starts the receiving side as a grandchild
//! (`am_receiver_child`) and talks to it over its stdin/stdout: the receiver prints its
//! worker address, then one line per notification it drained. The receiver sleeps on its
//! worker's event fd between progress rounds, as a prefill rank does; a last message sent
//! to it while it sleeps must wake it long before its sleep would end by itself.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::ucx_common::{Part, skip, ucx_builds};

const LIB_ENV: &str = "KVX_IT_UCX_AM_LIB";
const HARD_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the idle receiver sleeps on its event fd once the scenario is done.
const RECEIVER_IDLE: Duration = Duration::from_secs(15);
/// The receiver's longest sleep while messages stream in (a prefill rank's `MAX_WAIT`).
const STREAM_POLL: Duration = Duration::from_millis(100);
const NOTIFS: usize = 600;
const BIG_HEARTBEAT_IDS: usize = 20_000;

fn child_test(name: &str, lib: &Path) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test exe"));
    c.args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
        .env(LIB_ENV, lib)
        .env_remove("KVX_UCX_LIB")
        .env_remove("KVX_UCX_DIR");
    c
}

#[test]
fn notifications_over_active_messages_on_each_build() {
    for (label, lib) in ucx_builds() {
        let lib = match lib {
            Ok(p) => p,
            Err(why) => {
                skip(Part::of_build(label), &format!("{label} UCX build: {why}"));
                continue;
            }
        };
        let out = run_with_timeout(child_test("ucx_am::am_sender_child", &lib), HARD_TIMEOUT);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{label} ({}): child failed\n{stdout}\n{stderr}", lib.display());
        for marker in [
            "OK local-checks",
            "OK in-order",
            "OK heartbeats",
            "OK malformed-skipped",
            "OK woke-on-efd",
            "OK dead-receiver",
        ] {
            assert!(stdout.contains(marker), "{label}: child did not report {marker:?}\n{stdout}\n{stderr}");
        }
    }
}

/// `Command::output` with a hard deadline: a hung child is killed and fails the test.
fn run_with_timeout(cmd: Command, timeout: Duration) -> std::process::Output {
    assert_cmd::Command::from_std(cmd).timeout(timeout).output().expect("run child (killed at the deadline)")
}

/// Lines a child prints, read on a thread so every wait can have a deadline.
struct Lines {
    rx: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Lines {
    fn new(out: ChildStdout) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines { rx, seen: Vec::new() }
    }

    /// The next line starting with `prefix` (others are kept for the failure message).
    fn expect(&mut self, prefix: &str, deadline: Instant) -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    // The harness may print "test ... " ahead of a child's first line.
                    if let Some(at) = line.find(prefix) {
                        return line[at + prefix.len()..].to_string();
                    }
                    self.seen.push(line);
                }
                Err(e) => panic!(
                    "no {prefix:?} line from the receiver ({e}); it printed:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }
}

/// How the receiver prints one notification.
fn describe(n: &kvx::transfer::notify::Notification) -> String {
    use kvx::transfer::notify::Notification;
    match n {
        Notification::Notif { p_request_id, count } => format!("N {p_request_id}:{count}"),
        Notification::Heartbeat { ids } => format!(
            "HB {} {} {}",
            ids.len(),
            ids.first().map_or("-", String::as_str),
            ids.last().map_or("-", String::as_str)
        ),
        Notification::Fallback { ids } => format!("FB {}", ids.join(",")),
        Notification::PushReg(reg) => format!("PR {}", reg.request_id),
        Notification::PushFailed { d_request_id, count } => format!("PF {d_request_id}:{count}"),
    }
}

/// The sending side (and the checks that need no peer); does nothing unless started by
/// `notifications_over_active_messages_on_each_build`.
#[test]
#[ignore = "run by notifications_over_active_messages_on_each_build in a child process"]
fn am_sender_child() {
    let Some(lib) = std::env::var_os(LIB_ENV).map(PathBuf::from) else { return };
    sender_body(&lib);
}

fn sender_body(lib: &Path) {
    use kvx::transfer::notify::{
        MAX_NOTIFY_BYTES, NOTIFY_AM_ID, Notification, NotifyError, UcxNotifyReceiver, UcxNotifySender,
    };
    use kvx::transfer::ucx::{
        AmReceiver, Context, ContextOptions, Endpoint, ErrMode, ProgressMode, Ucx, UcxError, Worker,
    };

    let deadline = Instant::now() + Duration::from_secs(90);
    let ucx = Ucx::load(Some(lib)).expect("load UCX");
    println!("UCX {} from {}", ucx.version(), ucx.path().display());
    let ctx = Context::new(
        &ucx,
        &ContextOptions { progress: ProgressMode::Hybrid, active_messages: true, ..Default::default() },
    )
    .expect("context");
    let worker = Worker::new(&ctx).expect("worker");

    // Local checks: one receiver per id and worker; active messages need the context feature.
    {
        let first = AmReceiver::new(&worker, 7, 64).expect("first receiver");
        let second = AmReceiver::new(&worker, 7, 64);
        assert!(matches!(second, Err(UcxError::Invalid(ref m)) if m.contains("already")), "{second:?}");
        drop(first);
        AmReceiver::new(&worker, 7, 64).expect("the id is free again after a drop");
        let plain = Context::new(&ucx, &ContextOptions::default()).expect("context without AM");
        let plain_worker = Worker::new(&plain).expect("worker");
        let r = UcxNotifyReceiver::new(&plain_worker);
        assert!(
            matches!(r, Err(NotifyError::Ucx { source: UcxError::Invalid(ref m), .. }) if m.contains("active messages")),
            "{r:?}"
        );
    }
    println!("OK local-checks");

    let mut receiver = child_test("ucx_am::am_receiver_child", lib)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn receiver");
    let mut lines = Lines::new(receiver.stdout.take().expect("stdout"));
    let addr = hex::decode(lines.expect("ADDR ", deadline)).expect("hex address");
    let ep = Endpoint::connect(&worker, &addr, ErrMode::None).expect("endpoint");
    let tx = UcxNotifySender::new(ep.clone(), "receiver", Duration::from_secs(5));

    // A context without active messages refuses to send before reaching UCX.
    {
        let plain = Context::new(&ucx, &ContextOptions::default()).expect("context without AM");
        let plain_worker = Worker::new(&plain).expect("worker");
        let plain_ep = Endpoint::connect(&plain_worker, &addr, ErrMode::None).expect("endpoint");
        let r = plain_ep.am_send(NOTIFY_AM_ID, b"x:1".to_vec(), Duration::from_secs(1));
        assert!(matches!(r, Err(UcxError::Invalid(_))), "{r:?}");
    }

    // In order: notifications, heartbeats (one of them multi-fragment), and malformed
    // payloads the receiver must count and skip without losing its place.
    let mut expected = Vec::new();
    let mut malformed_sent = 0;
    for i in 0..NOTIFS {
        let n = Notification::Notif { p_request_id: format!("cmpl-{i}-0"), count: (i % 3) as u32 + 1 };
        tx.send(&n).expect("send notification");
        expected.push(describe(&n));
        if i % 100 == 50 {
            let hb = Notification::Heartbeat { ids: (i..i + 5).map(|k| format!("w{k}")).collect() };
            tx.send(&hb).expect("send heartbeat");
            expected.push(describe(&hb));
        }
        if i % 200 == 99 {
            let fb = Notification::Fallback { ids: vec![format!("cmpl-{i}-0")] };
            tx.send(&fb).expect("send fallback request");
            expected.push(describe(&fb));
        }
        if i % 150 == 7 {
            for bad in [&b"\xff\xfe:1"[..], b"no-count", b"r:0", b""] {
                tx.send_raw(bad.to_vec()).expect("send malformed payload");
                malformed_sent += 1;
            }
        }
    }
    let big = Notification::Heartbeat { ids: (0..BIG_HEARTBEAT_IDS).map(|k| format!("req-{k}")).collect() };
    tx.send(&big).expect("send a large heartbeat");
    expected.push(describe(&big));
    // Over the limit: refused by the sender's encoder, and by the receiver if sent raw.
    let huge = Notification::Heartbeat { ids: vec!["x".repeat(MAX_NOTIFY_BYTES)] };
    assert!(matches!(tx.send(&huge), Err(NotifyError::Encode { .. })));
    tx.send_raw(vec![b'a'; MAX_NOTIFY_BYTES + 1]).expect("send an oversized payload");
    malformed_sent += 1;
    let end = Notification::Notif { p_request_id: "END".into(), count: 1 };
    tx.send(&end).expect("send END");
    expected.push(describe(&end));

    let mut got = Vec::new();
    while got.last() != Some(&describe(&end)) {
        got.push(lines.expect("GOT ", deadline));
    }
    assert_eq!(got.len(), expected.len(), "message count");
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "message {i} out of order or altered");
    }
    println!("OK in-order {} notifications", NOTIFS);
    println!("OK heartbeats (largest {} ids)", BIG_HEARTBEAT_IDS);
    let stats = lines.expect("STATS ", deadline);
    let field = |k: &str| -> u64 {
        stats
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {stats:?}"))
    };
    assert_eq!(field("malformed"), malformed_sent, "{stats}");
    assert_eq!(field("oversized"), 1, "{stats}");
    println!("OK malformed-skipped {malformed_sent}");
    assert!(field("wakeups") >= 1, "{stats}");
    // One message to a receiver known to be asleep on its armed event fd must wake it
    // well before its poll would time out on its own.
    lines.expect("ARMED", deadline);
    let sent_at = Instant::now();
    tx.send_done("WAKE", 1).expect("send WAKE");
    let got = lines.expect("GOT ", sent_at + RECEIVER_IDLE / 3);
    assert_eq!(got, "N WAKE:1");
    println!("OK woke-on-efd in {:?} ({stats})", sent_at.elapsed());

    // The receiver dies: sends fail with a typed error within their timeout, never hang.
    receiver.kill().expect("kill receiver");
    receiver.wait().expect("reap receiver");
    let timeout = Duration::from_secs(2);
    let tx = UcxNotifySender::new(ep, "dead receiver", timeout);
    let start = Instant::now();
    let mut sent = 0u64;
    let err = loop {
        match tx.send_done(&format!("after-death-{sent}"), 1) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{sent} sends to a dead receiver all succeeded");
    };
    let elapsed = start.elapsed();
    assert!(
        matches!(err, NotifyError::Ucx { source: UcxError::Timeout { .. } | UcxError::Status { .. }, .. }),
        "{err:?}"
    );
    assert!(elapsed < timeout + Duration::from_secs(5), "the error took {elapsed:?}");
    println!("OK dead-receiver after {sent} sends, {elapsed:?}: {err}");
    let _ = std::io::stdout().flush();
    // Leave without closing the endpoint gracefully (the peer is gone).
    std::process::exit(0);
}

/// The receiving side; does nothing unless started by `am_sender_child`.
#[test]
#[ignore = "run by notifications_over_active_messages_on_each_build in a grandchild process"]
fn am_receiver_child() {
    let Some(lib) = std::env::var_os(LIB_ENV).map(PathBuf::from) else { return };
    receiver_body(&lib);
}

fn receiver_body(lib: &Path) {
    use kvx::transfer::notify::UcxNotifyReceiver;
    use kvx::transfer::ucx::{Context, ContextOptions, ProgressMode, Ucx, Worker, wait_readable};

    // Stdin closes when the sender exits, however it exits: leave with it.
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        std::process::exit(0);
    });

    let ucx = Ucx::load(Some(lib)).expect("load UCX");
    let ctx = Context::new(
        &ucx,
        &ContextOptions { progress: ProgressMode::Wait, active_messages: true, ..Default::default() },
    )
    .expect("context");
    let worker = Worker::new(&ctx).expect("worker");
    let mut rx = UcxNotifyReceiver::new(&worker).expect("receiver");
    let efd = worker.event_fd().expect("wait mode has an event fd");
    println!("ADDR {}", hex::encode(worker.address().expect("address")));
    let (mut wakeups, mut missed) = (0u64, 0u64);
    let mut done = false;
    loop {
        while worker.progress() > 0 {}
        for n in rx.drain() {
            println!("GOT {}", describe(&n));
            if matches!(&n, kvx::transfer::notify::Notification::Notif { p_request_id, .. } if p_request_id == "END")
            {
                let s = rx.am_stats();
                println!(
                    "STATS malformed={} oversized={} received={} wakeups={wakeups} missed_wakeups={missed}",
                    rx.malformed(),
                    s.oversized,
                    s.received
                );
                done = true;
            }
        }
        if !worker.arm().expect("arm") {
            continue;
        }
        if done {
            println!("ARMED");
        }
        // While messages stream in, sleep at most as long as a prefill rank does: UCX 1.13
        // can leave a message in a full FIFO without signalling the event fd, and a bounded
        // sleep is how a rank recovers. Once the scenario is done, sleep long: the WAKE
        // message must come through the event fd.
        let cap = if done { RECEIVER_IDLE } else { STREAM_POLL };
        if wait_readable(efd, cap).expect("poll the event fd") {
            wakeups += 1;
        } else if !done && worker.progress() > 0 {
            missed += 1;
        }
    }
}

/// `kvx bench` end to end on each build, notifications over UCX active messages (the
/// default): every request's blocks are freed by its notifications, none by lease
/// expiry and none left held. One decode rank reading several prefill ranks, and
/// several decode ranks notifying one prefill rank (which frees after all of them).
#[test]
fn bench_frees_every_block_through_active_message_notifications_on_each_build() {
    for (label, lib) in ucx_builds() {
        let lib = match lib {
            Ok(p) => p,
            Err(why) => {
                skip(Part::of_build(label), &format!("{label} UCX build: {why}"));
                continue;
            }
        };
        for (p_tp, d_tp) in [("4", "1"), ("1", "2")] {
            let results = tempfile::tempdir().expect("tempdir");
            let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
                .env_remove("KVX_UCX_LIB")
                .env_remove("KVX_UCX_DIR")
                .args(["bench", "--model", "qwen3-0.6b", "--prompt-len", "64", "--requests", "6"])
                .args(["--warmup", "1", "--no-calibrate", "--lease", "20s", "--timeout", "10s"])
                .args(["--p-tp", p_tp, "--d-tp", d_tp, "--format", "json", "--ucx-lib"])
                .arg(&lib)
                .arg("--results-dir")
                .arg(results.path())
                .timeout(HARD_TIMEOUT)
                .output()
                .expect("run kvx bench");
            let what = format!("{label} P tp {p_tp} -> D tp {d_tp}");
            assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json summary");
            assert_eq!(v["requests_ok"], 6, "{what}: {v}");
            assert_eq!(v["requests_failed"], 0, "{what}");
            assert_eq!(
                v["blocks_expired"], 0,
                "{what}: blocks were freed by lease expiry, not notifications"
            );
            assert_eq!(v["blocks_leaked"], 0, "{what}: blocks were never freed");
            assert_eq!(v["verify_failures"], 0, "{what}");
        }
    }
}
