//! `--transport nixl` with the real NIXL wheel (scripts/setup-nixl.sh) and real peers: kvx
//! engines and vLLM 0.33.0's own NIXL workers (`../shared/vllm-peer`, vLLM's code from the
//! wheel unpacked by scripts/setup-peers.sh) or kvx's NIXL Python peer (scripts/peers) read
//! from each other, both ways and across TP sizes, every byte checked against the peer
//! pattern (`--fill peer`) and every prefill block given back by notification. NIXL, the
//! peers' Python and vLLM's sources are parts these tests need: missing, they fail. vLLM's
//! wrapped workers live outside the repository (`../shared/vllm-peer`): see [`vllm_peer`].

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use axum::http::StatusCode;
use wait_timeout::ChildExt as _;

use crate::serve::{metric, post, send};
use crate::serve_workers::{Proc, engine_of, wait_metric, within};
use crate::ucx_common::{Part, skip};

const PEER_TIMEOUT: Duration = Duration::from_secs(60);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python with nixl-cu12, numpy, msgspec and pyzmq (scripts/setup-peers.sh).
fn python() -> PathBuf {
    let p = root().join(".venv-peers/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/setup-peers.sh (CI runs it through scripts/setup.sh)",
        p.display()
    );
    p
}

/// vLLM 0.33.0's Python sources (scripts/setup-peers.sh).
fn vllm_src() -> PathBuf {
    let p = root().join(".vllm-033/vllm");
    assert!(p.join("__init__.py").exists(), "{} is missing: run scripts/setup-peers.sh", p.display());
    p
}

/// vLLM's own workers wrapped to run here (`../shared/vllm-peer` beside the project, or
/// `KVX_SHARED_DIR`). They are not part of this repository (nor copied into it): where they are
/// absent, the two tests that run them say so ([`skip`]: counted, and a failure where required); kvx's own NIXL peer
/// (scripts/peers, installed by scripts/setup-peers.sh) runs everywhere.
fn vllm_peer(script: &str) -> Option<PathBuf> {
    let shared = std::env::var_os("KVX_SHARED_DIR").map_or_else(|| root().join("../shared"), PathBuf::from);
    let p = shared.join("vllm-peer").join(script);
    if !p.exists() {
        skip(
            Part::VllmPeer,
            &format!("{} is absent (vLLM's own NIXL workers; set KVX_SHARED_DIR)", p.display()),
        );
    }
    p.exists().then_some(p)
}

fn kvx_peer() -> PathBuf {
    root().join("scripts/peers/nixl_pd_peer.py")
}

/// The model the peers default to (`toy/model`: 4 layers of 4 KV heads of 128, bf16), in
/// 16-token blocks, 16 of them: the same compatibility hash and pool on both sides.
const TOY: &[&str] = &[
    "--model",
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/nixl/toy-model"),
    "--block-size",
    "16",
    "--pool-blocks",
    "16",
    "--transport",
    "nixl",
    "--fill",
    "peer",
];

const P_HELD: &str = "kvx:kv_blocks_held{backend=\"workers\",kv_transfer=\"nixl\",role=\"prefill\"}";
const P_EXPIRED: &str =
    "kvx:kv_leases_expired_total{backend=\"workers\",kv_transfer=\"nixl\",role=\"prefill\"}";
const D_READ: &str = "kvx:kv_bytes_read_total{backend=\"workers\",kv_transfer=\"nixl\",role=\"decode\"}";
const D_VERIFIED: &str =
    "kvx:kv_bytes_verified_total{backend=\"workers\",kv_transfer=\"nixl\",role=\"decode\"}";
const D_FAILURES: &str =
    "kvx:kv_verify_failures_total{backend=\"workers\",kv_transfer=\"nixl\",role=\"decode\"}";

/// A Python peer in its own process group (killed whole on drop), its stdout as JSON lines.
struct PyPeer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl PyPeer {
    fn spawn(script: &std::path::Path, args: &[&str]) -> PyPeer {
        let mut child = Command::new(python())
            .arg(script)
            .args(args)
            .env("VLLM_033_SRC", vllm_src())
            .env("NIXL_LOG_LEVEL", "WARN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .expect("spawn a Python peer");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        PyPeer { child, lines: rx }
    }

    /// The next JSON line within `limit`.
    fn json(&self, limit: Duration) -> serde_json::Value {
        loop {
            let line = self.lines.recv_timeout(limit).expect("a JSON line from the peer in time");
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                return v;
            }
        }
    }

    /// `(host, port)` of a prefill peer's side channel, from its ready line.
    fn side_channel(ready: &serde_json::Value) -> u16 {
        let sc = ready["side_channel"].as_str().expect("side_channel");
        sc.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port")
    }
}

impl Drop for PyPeer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}

/// Runs a decode peer to its end; its last JSON line.
fn run_decode(script: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut child = Command::new(python())
        .arg(script)
        .args(args)
        .env("VLLM_033_SRC", vllm_src())
        .env("NIXL_LOG_LEVEL", "WARN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .expect("spawn a decode peer");
    let Some(_) = child.wait_timeout(PEER_TIMEOUT).expect("wait") else {
        let _ = child.kill();
        panic!("{} did not end within {PEER_TIMEOUT:?}", script.display());
    };
    let out = child.wait_with_output().expect("output");
    let text = String::from_utf8_lossy(&out.stdout);
    // vLLM's wrapped scripts end in NIXL's exit-time crash (exit 139): judged by their JSON.
    text.lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON from {}: {text}", script.display()))
}

/// A prefill engine's answer to the proxy's first leg: the request's `kv_transfer_params`.
fn words(n: usize) -> String {
    (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

async fn prefill_leg(p: &Proc) -> serde_json::Value {
    let prompt = words(40);
    let body = format!(
        r#"{{"prompt":"{prompt}","max_tokens":1,"kv_transfer_params":{{"do_remote_decode":true,"do_remote_prefill":false}}}}"#
    );
    let (status, _, text) = post(&p.url("/v1/completions"), &[], &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v["kv_transfer_params"].clone()
}

/// The decode peer's flags for the request `kv` names.
fn decode_args(kv: &serde_json::Value) -> Vec<String> {
    let blocks: Vec<String> =
        kv["remote_block_ids"][0].as_array().expect("block ids").iter().map(|b| b.to_string()).collect();
    vec![
        "--port".into(),
        kv["remote_port"].to_string(),
        "--engine-id".into(),
        kv["remote_engine_id"].as_str().expect("engine id").into(),
        "--request-id".into(),
        kv["remote_request_id"].as_str().expect("request id").into(),
        "--blocks".into(),
        blocks.join(","),
        "--check-pattern".into(),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Every block a prefill engine held came back by notification: none held, none expired.
async fn all_blocks_back(p: &Proc) {
    wait_metric(&p.url("/metrics"), P_HELD, Duration::from_secs(10), |v| v == 0.0).await;
    let (_, _, m) = send("GET", &p.url("/metrics"), &[], "").await;
    assert_eq!(metric(&m, P_EXPIRED), 0.0, "freed by notification, not by lease expiry: {m}");
}

fn assert_read_ok(v: &serde_json::Value) {
    assert_eq!(v["finished"], true, "{v}");
    assert_eq!(v["failed"], false, "{v}");
    assert_eq!(v["pattern_ok"], true, "every byte the peer pattern: {v}");
}

/// vLLM 0.33.0's own decode worker (its handshake, msgspec decoding, hash check,
/// `add_remote_agent`, prepared lists, READ and notification) reads a kvx prefill engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_decode_worker_reads_a_kvx_prefill_engine() {
    let Some(real_decode) = vllm_peer("real_decode.py") else { return };
    within(async {
        let p = engine_of(TOY, "prefill", "1", &[]).await;
        let kv = prefill_leg(&p).await;
        assert_eq!(kv["tp_size"], 1);
        let args = decode_args(&kv);
        let out =
            tokio::task::spawn_blocking(move || run_decode(&real_decode, &strs(&args))).await.expect("join");
        assert_read_ok(&out);
        all_blocks_back(&p).await;
    })
    .await;
}

/// A kvx decode engine reads vLLM 0.33.0's own prefill worker (one rank; kvx decode at TP 1
/// and at TP 2, both ranks reading halves of its heads), every byte checked, and vLLM's worker
/// frees the request on kvx's notifications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvx_decode_engine_reads_vllms_own_prefill_worker() {
    let Some(real_prefill) = vllm_peer("real_prefill.py") else { return };
    within(async {
        for d_tp in ["1", "2"] {
            let peer = PyPeer::spawn(&real_prefill, &["--request-id", "req-P"]);
            let ready = peer.json(PEER_TIMEOUT);
            let port = PyPeer::side_channel(&ready);
            let d = engine_of(TOY, "decode", d_tp, &["--itl-ms", "1"]).await;
            // 41 tokens: 3 blocks, all of the prefill's list read.
            let prompt = words(40);
            let body = format!(
                r#"{{"prompt":"{prompt}","max_tokens":2,"kv_transfer_params":{{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[0,7,15]],"remote_engine_id":"P-real-vllm","remote_request_id":"req-P","remote_host":"127.0.0.1","remote_port":{port},"tp_size":1}}}}"#
            );
            let (status, _, text) = post(&d.url("/v1/completions"), &[], &body).await;
            assert_eq!(status, StatusCode::OK, "decode tp {d_tp}: {text}");
            let (_, _, m) = send("GET", &d.url("/metrics"), &[], "").await;
            // 3 blocks x 4 layers x 32 KiB, read once over the decode engine's ranks.
            assert_eq!(metric(&m, D_READ), 393_216.0, "decode tp {d_tp}: {m}");
            assert_eq!(metric(&m, D_VERIFIED), 393_216.0, "every byte checked: {m}");
            assert_eq!(metric(&m, D_FAILURES), 0.0);
            let done = tokio::task::spawn_blocking(move || peer.json(PEER_TIMEOUT)).await.expect("join");
            assert_eq!(done["finished_sending"], serde_json::json!(["req-P"]), "decode tp {d_tp}: {done}");
        }
    })
    .await;
}

/// kvx's own NIXL peer (scripts/peers, the Python API doing what vLLM's worker does, every
/// TP rank served) against kvx engines across TP sizes both ways: prefill 2 -> decode 1 and
/// prefill 1 -> decode 2, with kvx on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp_mismatch_both_ways_with_kvxs_nixl_peer() {
    within(async {
        // kvx prefill TP 2 -> the peer's decode TP 1 (it reads both ranks).
        let p = engine_of(TOY, "prefill", "2", &[]).await;
        let kv = prefill_leg(&p).await;
        assert_eq!(kv["tp_size"], 2);
        let mut args = decode_args(&kv);
        args.extend(["--remote-tp", "2", "--tp", "1"].map(String::from));
        let out = tokio::task::spawn_blocking(move || run_decode(&kvx_peer(), &["decode"].iter().copied().chain(strs(&args)).collect::<Vec<_>>()))
            .await
            .expect("join");
        assert_read_ok(&out);
        assert_eq!(out["read_ranks"], serde_json::json!([0, 1]), "{out}");
        all_blocks_back(&p).await;
        drop(p);

        // kvx prefill TP 1 -> the peer's decode TP 2 (two ranks, each half the heads).
        let p = engine_of(TOY, "prefill", "1", &[]).await;
        let kv = prefill_leg(&p).await;
        let reads: Vec<_> = ["0", "1"]
            .iter()
            .map(|rank| {
                let mut args = decode_args(&kv);
                args.extend(["--remote-tp", "1", "--tp", "2", "--tp-rank", rank].map(String::from));
                tokio::task::spawn_blocking(move || {
                    run_decode(&kvx_peer(), &["decode"].iter().copied().chain(strs(&args)).collect::<Vec<_>>())
                })
            })
            .collect();
        for r in reads {
            assert_read_ok(&r.await.expect("join"));
        }
        all_blocks_back(&p).await;
        drop(p);

        // The peer's prefill at TP 2 and TP 1 -> a kvx decode engine at TP 1 and TP 2.
        for (p_tp, d_tp) in [("2", "1"), ("1", "2")] {
            let peer = PyPeer::spawn(&kvx_peer(), &["prefill", "--request-id", "req-P", "--tp", p_tp]);
            let ready = peer.json(PEER_TIMEOUT);
            let port = PyPeer::side_channel(&ready);
            let engine = ready["engine_id"].as_str().expect("engine id").to_owned();
            let d = engine_of(TOY, "decode", d_tp, &["--itl-ms", "1"]).await;
            // 56 tokens: 4 blocks, all of the prefill's list read.
            let prompt = words(55);
            let body = format!(
                r#"{{"prompt":"{prompt}","max_tokens":2,"kv_transfer_params":{{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4]],"remote_engine_id":"{engine}","remote_request_id":"req-P","remote_host":"127.0.0.1","remote_port":{port},"tp_size":{p_tp}}}}}"#
            );
            let (status, _, text) = post(&d.url("/v1/completions"), &[], &body).await;
            assert_eq!(status, StatusCode::OK, "P{p_tp} -> D{d_tp}: {text}");
            let (_, _, m) = send("GET", &d.url("/metrics"), &[], "").await;
            // 4 blocks x 4 layers x 32 KiB of the model's KV, whatever the TP sizes.
            assert_eq!(metric(&m, D_READ), 524_288.0, "P{p_tp} -> D{d_tp}: {m}");
            assert_eq!(metric(&m, D_VERIFIED), 524_288.0, "every byte checked: {m}");
            assert_eq!(metric(&m, D_FAILURES), 0.0);
            let done = tokio::task::spawn_blocking(move || peer.json(PEER_TIMEOUT)).await.expect("join");
            assert_eq!(done["finished_sending"], serde_json::json!(["req-P"]), "P{p_tp} -> D{d_tp}: {done}");
        }
    })
    .await;
}

/// A notification for a request no prefill rank holds (a stale or mistyped id, as vLLM's
/// "Potentially invalid KV blocks for unrecognized request"): counted, nothing freed, and the
/// request that is held is still read and freed by its own notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_for_an_unknown_request_is_counted_and_frees_nothing() {
    within(async {
        let p = engine_of(TOY, "prefill", "1", &[]).await;
        let kv = prefill_leg(&p).await;
        let held = wait_metric(&p.url("/metrics"), P_HELD, Duration::from_secs(5), |v| v > 0.0).await;
        // A full prefix hit's notification-only message, for an id nobody holds.
        let mut stray = decode_args(&kv);
        let id = stray.iter().position(|a| a == "--request-id").expect("request id flag") + 1;
        stray[id] = "no-such-request".into();
        let blocks = stray.iter().position(|a| a == "--blocks").expect("blocks flag") + 1;
        stray[blocks] = String::new();
        let out = tokio::task::spawn_blocking(move || {
            run_decode(&kvx_peer(), &["decode"].iter().copied().chain(strs(&stray)).collect::<Vec<_>>())
        })
        .await
        .expect("join");
        assert_eq!(out["notify_only"], true, "{out}");
        let unknown = "kvx:kv_notifications_unrecognized_total{backend=\"workers\",kv_transfer=\"nixl\",role=\"prefill\"}";
        wait_metric(&p.url("/metrics"), unknown, Duration::from_secs(5), |v| v == 1.0).await;
        let (_, _, m) = send("GET", &p.url("/metrics"), &[], "").await;
        assert_eq!(metric(&m, P_HELD), held, "the stray notification freed nothing: {m}");
        // The held request is still there to read, and its own notification frees it.
        let args = decode_args(&kv);
        let out = tokio::task::spawn_blocking(move || {
            run_decode(&kvx_peer(), &["decode"].iter().copied().chain(strs(&args)).collect::<Vec<_>>())
        })
        .await
        .expect("join");
        assert_read_ok(&out);
        all_blocks_back(&p).await;
    })
    .await;
}

/// `kvx bench --transport nixl` between kvx's own engines, across TP sizes both ways: every
/// request verified, every block freed.
///
/// With `--kv-buffer-device cpu` (vLLM's host buffer), NIXL registers the host buffers: the
/// prefill ranks copy each request's blocks into theirs, the decode rank reads them into its
/// own and copies them into its pool, and every byte is checked there.
#[test]
fn bench_through_nixl_verifies_every_request_and_leaks_nothing() {
    for (p_tp, d_tp, buffer) in [("2", "1", "cuda"), ("1", "2", "cuda"), ("2", "1", "cpu")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(["bench", "--transport", "nixl", "--p-tp", p_tp, "--d-tp", d_tp, "--requests", "8"])
            .args(["--model", "llama-3.1-8b", "--layers", "2", "--verify", "full", "--format", "json"])
            .args(["--kv-buffer-device", buffer])
            .env("KVX_RESULTS_DIR", dir.path())
            .env("NIXL_LOG_LEVEL", "WARN")
            .timeout(Duration::from_secs(180))
            .output()
            .expect("run kvx bench");
        assert!(out.status.success(), "P{p_tp} -> D{d_tp}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["requests_ok"], 8, "{v}");
        assert_eq!(v["requests_failed"], 0);
        assert_eq!(v["blocks_leaked"], 0);
        assert_eq!(v["verify_failures"], 0);
        assert_eq!(v["bytes_verified"], v["bytes_read"], "--verify full checks every byte: {v}");
        assert_eq!(v["scenario"]["transport"], "nixl", "{}", v["scenario"]);
        let staged = ["save_to_host", "sync_to_device"].map(|k| v["stages"].get(k).is_some());
        assert_eq!(staged, [buffer == "cpu"; 2], "host buffer {buffer}: {}", v["stages"]);
    }
}

/// Push mode through NIXL (vLLM's `NixlPushConnector`): decode ranks register their blocks
/// with `PUSH_REG:` notifications, prefill ranks handshake with decode's side channel (vLLM's
/// payload), WRITE from prepared lists and notify with the WRITE; across TP sizes both ways,
/// every byte verified, nothing leaked. What push through NIXL does not cover is refused
/// with exit 2, naming the flag.
#[test]
fn push_through_nixl_verifies_every_byte_and_refuses_what_it_does_not_cover() {
    for (p_tp, d_tp) in [("2", "1"), ("1", "2"), ("4", "2")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(["bench", "--transport", "nixl", "--mode", "push", "--p-tp", p_tp, "--d-tp", d_tp])
            .args(["--requests", "8", "--concurrency", "2", "--model", "llama-3.1-8b", "--layers", "2"])
            .args(["--verify", "full", "--format", "json"])
            .env("KVX_RESULTS_DIR", dir.path())
            .env("NIXL_LOG_LEVEL", "WARN")
            .timeout(Duration::from_secs(180))
            .output()
            .expect("run kvx bench");
        let case = format!("push P{p_tp} -> D{d_tp}");
        assert!(out.status.success(), "{case}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["requests_ok"], 8, "{case}: {v}");
        assert_eq!(v["requests_failed"], 0, "{case}");
        assert_eq!(v["blocks_leaked"], 0, "{case}");
        assert_eq!(v["verify_failures"], 0, "{case}");
        assert!(v["bytes_read"].as_u64().is_some_and(|b| b > 0), "{case}: {v}");
        assert_eq!(v["bytes_verified"], v["bytes_read"], "{case}: --verify full checks every byte: {v}");
        assert_eq!(v["scenario"]["transport"], "nixl", "{case}: {}", v["scenario"]);
        assert_eq!(v["scenario"]["mode"], "push", "{case}: {}", v["scenario"]);
    }
    for (args, flag) in [
        (&["--overlap", "layers", "--prefill-time-per-layer", "1ms"][..], "--overlap"),
        (
            &["--model", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid-model-tiny.toml")][..],
            "--transport",
        ),
    ] {
        let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(["bench", "--transport", "nixl", "--mode", "push", "--requests", "1"])
            .args(args)
            .timeout(Duration::from_secs(60))
            .output()
            .expect("run kvx bench");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} names {flag}: {err}");
    }
}

/// `kvx xfer --compare-transports ucx,nixl`: both transports' reads verified in place in one
/// run, NIXL named in its report, and the comparison holds each case's ratio.
#[test]
fn xfer_compares_nixl_with_ucx_in_one_run_every_case_verified() {
    let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(["xfer", "--compare-transports", "ucx,nixl", "--sizes", "64KiB", "--inflight", "1,8"])
        .args(["--iters", "40", "--working-set", "8MiB", "--format", "json", "--rounds", "2"])
        .env("NIXL_LOG_LEVEL", "WARN")
        .timeout(Duration::from_secs(180))
        .output()
        .expect("run kvx xfer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // Two rounds, the second in the reverse order.
    let order: Vec<&str> =
        err.lines().filter_map(|l| l.split_once("--compare-transports: round ").map(|x| x.1)).collect();
    assert_eq!(order, ["1/2: ucx", "1/2: nixl", "2/2: nixl", "2/2: ucx"], "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["rounds"].as_array().map(Vec::len), Some(2), "both rounds' reports: {v}");
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["report"]["transport"], "ucx");
    let nixl = &runs[1]["report"];
    assert_eq!(nixl["transport"], "nixl");
    assert_eq!(nixl["nixl"]["version"], "1.5.1", "{}", nixl["nixl"]);
    assert_eq!(nixl["nixl"]["desc_merge"], false);
    for run in runs {
        for r in run["report"]["results"].as_array().expect("results") {
            assert!(r["verified_batches"].as_u64().is_some_and(|n| n >= 2), "{r}");
            assert!(r["gbps"].as_f64().is_some_and(|g| g > 0.0), "{r}");
        }
    }
    // NIXL's phases per batch: a request made and released per batch (vLLM's way).
    assert_eq!(nixl["nixl"]["requests"], "per-batch");
    for r in nixl["results"].as_array().expect("results") {
        let make = r["nixl_make_us"].as_f64().expect("make");
        let release = r["nixl_release_us"].as_f64().expect("release");
        let post = r["post_us"].as_f64().expect("post");
        assert!(make > 0.0 && release > 0.0 && make <= post, "{r}");
    }
    let rows = v["comparison"].as_array().expect("comparison");
    assert_eq!(rows.len(), 2, "one row per case: {v}");
    for row in rows {
        let ratios = row["ratio_to_first"].as_array().expect("ratios");
        assert_eq!(ratios[0][1], 1.0, "the first transport is the reference: {row}");
        let mid = ratios[1][1].as_f64().expect("nixl's ratio");
        assert_eq!(row["rounds"], 2, "{row}");
        let (lo, hi) = (
            row["ratio_range"][1][1].as_f64().expect("min"),
            row["ratio_range"][1][2].as_f64().expect("max"),
        );
        assert!(0.0 < lo && lo <= mid && mid <= hi, "the median within the rounds' range: {row}");
    }
}

/// `--nixl-requests reuse`: each distinct batch's request made before the timed batches and
/// posted again, so no request is made or released while timed; the reads still verified.
#[test]
fn xfer_reuses_nixl_requests_made_before_timing() {
    let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args([
            "xfer",
            "--transport",
            "nixl",
            "--nixl-requests",
            "reuse",
            "--sizes",
            "64KiB",
            "--inflight",
            "1,8",
        ])
        .args(["--iters", "300", "--working-set", "4MiB", "--format", "json"])
        .env("NIXL_LOG_LEVEL", "WARN")
        .timeout(Duration::from_secs(120))
        .output()
        .expect("run kvx xfer");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["nixl"]["requests"], "reuse", "{v}");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    for r in results {
        // 300 batches over a working set of 64 (x1) or 8 (x8) batches: each posted again.
        assert_eq!(r["nixl_make_us"].as_f64(), Some(0.0), "made before timing: {r}");
        assert_eq!(r["nixl_release_us"].as_f64(), Some(0.0), "released after: {r}");
        assert!(r["verified_batches"].as_u64().is_some_and(|n| n >= 2), "{r}");
        assert!(r["verified_bytes"].as_u64().is_some_and(|n| n > 0), "{r}");
    }
}

/// A host without NIXL: exit 2, naming NIXL and how to install it, before anything runs.
#[test]
fn without_nixl_the_transport_is_refused_with_exit_2() {
    for cmd in [
        &["xfer", "--transport", "nixl", "--sizes", "4KiB", "--iters", "1"][..],
        &["bench", "--transport", "nixl", "--requests", "1"][..],
    ] {
        let out = assert_cmd::Command::new(env!("CARGO_BIN_EXE_kvx"))
            .args(cmd)
            .env("KVX_NIXL_LIB", "/nonexistent/libnixl_capi.so")
            .timeout(Duration::from_secs(60))
            .output()
            .expect("run kvx");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd:?}: {err}");
        assert!(err.contains("NIXL") && err.contains("setup-nixl.sh"), "{cmd:?}: {err}");
    }
}

/// A decode request for blocks held by the prefill engine at `kv`, sent to `d`; its status,
/// body and time taken.
async fn decode_leg(d: &Proc, kv: &serde_json::Value) -> (StatusCode, String, Duration) {
    let body = serde_json::json!({
        "prompt": words(40),
        "max_tokens": 2,
        "kv_transfer_params": {
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": kv["remote_block_ids"],
            "remote_engine_id": kv["remote_engine_id"],
            "remote_request_id": kv["remote_request_id"],
            "remote_host": kv["remote_host"],
            "remote_port": kv["remote_port"],
            "tp_size": kv["tp_size"],
        }
    });
    let at = std::time::Instant::now();
    let (status, _, text) = post(&d.url("/v1/completions"), &[], &body.to_string()).await;
    (status, text, at.elapsed())
}

/// A prefill engine that restarts at the same side-channel address (a pod restarted in place)
/// is a new NIXL agent with a new engine id: the request it held when it died fails at once
/// (not a hang, not a crash), and the next request the new engine prefills is handshaken
/// afresh, read, verified and freed by the decode engine that read the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_restarted_in_place_is_handshaken_afresh() {
    within(async {
        let p = engine_of(TOY, "prefill", "1", &[]).await;
        let d = engine_of(TOY, "decode", "1", &["--itl-ms", "1"]).await;
        let kv = prefill_leg(&p).await;
        let (status, text, _) = decode_leg(&d, &kv).await;
        assert_eq!(status, StatusCode::OK, "before the restart: {text}");
        all_blocks_back(&p).await;
        // Held when the engine dies: its blocks go with it.
        let held = prefill_leg(&p).await;
        let port = kv["remote_port"].to_string();
        drop(p);

        let mut args = vec!["serve-engine", "--role", "prefill", "--port", "0", "--tp", "1"];
        args.extend_from_slice(&["--max-model-len", "1024", "--verify", "full", "--timeout", "10s"]);
        args.extend_from_slice(&["--side-channel-port", &port]);
        args.extend_from_slice(TOY);
        let p = Proc::spawn(&args);
        let kv2 = prefill_leg(&p).await;
        assert_eq!(kv2["remote_port"], kv["remote_port"], "the same address");
        assert_ne!(kv2["remote_engine_id"], kv["remote_engine_id"], "a new engine");

        let (status, text, took) = decode_leg(&d, &held).await;
        assert_ne!(status, StatusCode::OK, "the dead engine's request cannot be read: {text}");
        assert!(took <= Duration::from_secs(5), "it failed in {took:?}: {text}");
        let (status, text, _) = decode_leg(&d, &kv2).await;
        assert_eq!(status, StatusCode::OK, "after the restart: {text}");
        let (_, _, m) = send("GET", &d.url("/metrics"), &[], "").await;
        assert_eq!(metric(&m, D_FAILURES), 0.0, "{m}");
        assert_eq!(metric(&m, D_VERIFIED), metric(&m, D_READ), "every byte read checked: {m}");
        all_blocks_back(&p).await;
    })
    .await;
}
