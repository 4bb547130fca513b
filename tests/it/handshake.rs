//! Side channel over real ZMQ sockets on loopback and ipc:// in temp dirs: handshake
//! round trips in both framings, every failure path, notifications, and `kvx probe`
//! against the frames captured from vLLM. Every socket test runs under a hard timeout.

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kvx::transfer::handshake::{
    AgentMetadata, CompatFactors, FetchOptions, Framing, HandshakeClient, HandshakeError, HandshakeServer,
    KVX_METADATA_FORMAT, KvxFactors, KvxMetadata, KvxRegion, Payload, PayloadTable, zmq_context,
};

/// Runs `f` on its own thread and fails the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("test step exceeded its {limit:?} hard timeout"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("test step panicked"),
    }
}

const LIMIT: Duration = Duration::from_secs(60);

fn factors(dtype: &str, heads: u64) -> CompatFactors {
    CompatFactors::kvx(&KvxFactors {
        kvx_format_version: KVX_METADATA_FORMAT,
        model: "toy/model".into(),
        dtype: dtype.into(),
        num_kv_heads: heads,
        head_size: 128,
        num_hidden_layers: 2,
        cache_dtype: "auto".into(),
        layout_family: "v0.33".into(),
        transfer_mode: "pull".into(),
    })
}

fn metadata(pp: u32, tp: u32, f: &CompatFactors) -> KvxMetadata {
    let regions = (0..3u64)
        .map(|i| KvxRegion {
            name: format!("model.layers.{i}"),
            mem_type: "host".into(),
            device_id: 0,
            base_addr: 0x7000_0000 + u64::from(tp) * 0x100_0000 + i * 0x10_0000,
            rkey: vec![tp as u8; 64],
            block_len_bytes: 8192,
            block_stride_bytes: 8192,
            num_blocks: 32,
        })
        .collect();
    KvxMetadata::new(
        "P-engine",
        vec![0x5a; 100],
        (2, tp, pp, 0),
        "LBHNC",
        16,
        regions,
        Some(format!("tcp://127.0.0.1:{}", 7000 + tp)),
        f,
    )
}

fn table(f: &CompatFactors) -> PayloadTable {
    let t = PayloadTable::new();
    for tp in 0..2 {
        t.publish(0, tp, metadata(0, tp, f).to_payload().expect("payload").encode());
    }
    t
}

fn fast(framing: Framing) -> FetchOptions {
    FetchOptions {
        // Generous: the machine may be loaded; only failure tests wait this long.
        attempt_timeout: Duration::from_secs(5),
        deadline: Duration::from_secs(10),
        framing,
        ..FetchOptions::default()
    }
}

fn no_rules(_: &KvxMetadata) -> Result<(), String> {
    Ok(())
}

#[test]
fn round_trip_v0_33_two_ranks_one_connection() {
    within(LIMIT, || {
        let f = factors("bfloat16", 8);
        let server = HandshakeServer::start("tcp://127.0.0.1:0", table(&f)).expect("server");
        let client = HandshakeClient::new(fast(Framing::V0_33));
        let peers = client
            .fetch_metadata_many(server.endpoint(), &[(0, 0), (0, 1)], Some(&f), no_rules)
            .expect("fetch");
        assert_eq!(peers.len(), 2);
        for (tp, p) in peers.iter().enumerate() {
            assert_eq!(p.metadata, metadata(0, tp as u32, &f));
            assert_eq!(p.compat_hash, f.hash_hex());
            assert_eq!(p.factors, f);
            assert_eq!(p.framing, Framing::V0_33);
            assert!(p.peer_clock_s.is_some_and(|c| c > 1.0e9), "Unix seconds expected: {:?}", p.peer_clock_s);
            assert_eq!(p.attempts, 1);
        }
        assert_eq!(server.stop().served, 2);
    });
}

#[test]
fn round_trip_v0_19_framing_over_ipc() {
    within(LIMIT, || {
        let dir = tempfile::tempdir().expect("tempdir");
        let ep = format!("ipc://{}/side", dir.path().display());
        let f = factors("bfloat16", 8);
        let server = HandshakeServer::start(&ep, table(&f)).expect("server");
        let client = HandshakeClient::new(fast(Framing::V0_19));
        let p = client.fetch_metadata(server.endpoint(), 0, 1, Some(&f), no_rules).expect("fetch");
        assert_eq!(p.framing, Framing::V0_19);
        assert_eq!(p.peer_clock_s, None, "0.19 replies carry no clock frame");
        assert_eq!(p.metadata.tp_rank, 1);
    });
}

#[test]
fn hash_mismatch_names_the_differing_factors() {
    within(LIMIT, || {
        let remote = factors("bfloat16", 8);
        let local = factors("float16", 4);
        let server = HandshakeServer::start("tcp://127.0.0.1:0", table(&remote)).expect("server");
        let err = HandshakeClient::new(fast(Framing::V0_33))
            .fetch_metadata(server.endpoint(), 0, 0, Some(&local), no_rules)
            .expect_err("mismatch");
        let HandshakeError::HashMismatch { diffs: Some(ref diffs), ref local, ref remote, .. } = err else {
            panic!("expected a hash mismatch with diffs, got {err}")
        };
        assert_ne!(local, remote);
        let names: Vec<&str> = diffs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["dtype", "num_kv_heads"]);
        let msg = err.to_string();
        assert!(msg.contains(r#"dtype (local "float16", remote "bfloat16")"#), "{msg}");
        assert!(msg.contains("num_kv_heads (local 4, remote 8)"), "{msg}");
    });
}

#[test]
fn validate_hook_message_is_surfaced_and_unknown_ranks_are_refused() {
    within(LIMIT, || {
        let f = factors("bfloat16", 8);
        let server = HandshakeServer::start("tcp://127.0.0.1:0", table(&f)).expect("server");
        let client = HandshakeClient::new(fast(Framing::V0_33));
        let err = client
            .fetch_metadata(server.endpoint(), 0, 0, Some(&f), |m: &KvxMetadata| {
                Err(format!("block size {} != local 32 (change --block-size)", m.block_size_tokens))
            })
            .expect_err("rejected");
        assert!(matches!(err, HandshakeError::Rejected { tp_rank: 0, .. }), "{err}");
        assert!(err.to_string().contains("block size 16 != local 32 (change --block-size)"), "{err}");

        let err =
            client.fetch_metadata(server.endpoint(), 0, 7, Some(&f), no_rules).expect_err("unknown rank");
        assert!(matches!(err, HandshakeError::PeerError { .. }), "{err}");
        assert!(err.to_string().contains("(pp_rank 0, tp_rank 7)"), "{err}");
        assert_eq!(server.stats().refused, 1);
    });
}

#[test]
fn peer_not_up_then_up_succeeds_on_retry() {
    within(LIMIT, || {
        let dir = tempfile::tempdir().expect("tempdir");
        let ep = format!("ipc://{}/late", dir.path().display());
        let f = factors("bfloat16", 8);
        let (retry_tx, retry_rx) = mpsc::channel();
        let retry_tx = std::sync::Mutex::new(retry_tx);
        let opts = FetchOptions {
            attempt_timeout: Duration::from_millis(200),
            deadline: Duration::from_secs(10),
            on_retry: Some(Arc::new(move |e| {
                let _ = retry_tx.lock().map(|tx| tx.send(e.clone()));
            })),
            ..FetchOptions::default()
        };
        let fetch = {
            let (ep, f) = (ep.clone(), f.clone());
            std::thread::spawn(move || {
                HandshakeClient::new(opts).fetch_metadata(&ep, 0, 1, Some(&f), no_rules)
            })
        };
        // Bind only once the client has failed at least once.
        let first = retry_rx.recv_timeout(Duration::from_secs(10)).expect("a retry before the peer is up");
        assert_eq!(first.reason, "not connected");
        let server = HandshakeServer::start(&ep, table(&f)).expect("server");
        let peer = fetch.join().expect("client thread").expect("fetch succeeds once the peer is up");
        assert!(peer.attempts >= 2, "attempts {}", peer.attempts);
        assert_eq!(peer.metadata.tp_rank, 1);
        drop(server);
    });
}

#[test]
fn peer_never_up_times_out_within_the_deadline() {
    within(LIMIT, || {
        // A port that was free a moment ago: nothing listens on it.
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let ep = format!("tcp://127.0.0.1:{port}");
        let deadline = Duration::from_millis(700);
        let opts =
            FetchOptions { attempt_timeout: Duration::from_millis(200), deadline, ..FetchOptions::default() };
        let t0 = Instant::now();
        let err = HandshakeClient::new(opts).fetch_raw(&ep, 0, 0).expect_err("nobody listens");
        let took = t0.elapsed();
        let HandshakeError::NotConnected { attempts, .. } = err else {
            panic!("expected NotConnected, got {err}")
        };
        assert!(attempts >= 2, "retried: {attempts}");
        assert!(
            took <= deadline + Duration::from_millis(500),
            "gave up after {took:?}, deadline {deadline:?}"
        );
        assert!(err.to_string().contains("is the prefill engine up"), "{err}");
    });
}

/// A ROUTER that answers one request with `frames` (after the REQ envelope). The socket
/// stays open until the returned guard is dropped, so closing it cannot race the reply.
fn rogue_server(frames: Vec<Vec<u8>>) -> (String, RogueGuard) {
    let router = zmq_context().socket(zmq::ROUTER).expect("socket");
    router.set_linger(0).expect("linger");
    router.bind("tcp://127.0.0.1:0").expect("bind");
    router.set_rcvtimeo(15_000).expect("rcvtimeo");
    let ep = router.get_last_endpoint().expect("endpoint").expect("utf8");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        if let Ok(mut msg) = router.recv_multipart(0) {
            msg.truncate(2); // identity, empty delimiter
            msg.extend(frames);
            let _ = router.send_multipart(msg, 0);
        }
        let _ = done_rx.recv_timeout(Duration::from_secs(30));
    });
    (ep, RogueGuard(Some((done_tx, t))))
}

struct RogueGuard(Option<(mpsc::Sender<()>, std::thread::JoinHandle<()>)>);

impl Drop for RogueGuard {
    fn drop(&mut self) {
        if let Some((tx, t)) = self.0.take() {
            let _ = tx.send(());
            let _ = t.join();
        }
    }
}

/// One attempt only: the rogue server answers once, so a retry could only mislead.
fn once() -> FetchOptions {
    FetchOptions {
        attempt_timeout: Duration::from_secs(10),
        deadline: Duration::from_secs(10),
        ..fast(Framing::V0_33)
    }
}

#[test]
fn garbage_truncated_and_oversized_replies_are_typed_errors() {
    within(LIMIT, || {
        let good =
            Payload::Meta { compatibility_hash: "a".repeat(64), agent_metadata_bytes: vec![0; 64] }.encode();
        let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
            ("garbage", vec![b"\xc1\xc1hello".to_vec()]),
            ("truncated", vec![good[..good.len() - 10].to_vec()]),
            ("oversized", vec![vec![0xc0; kvx::transfer::handshake::wire::MAX_REPLY_FRAME_BYTES + 1]]),
            ("three frames", vec![good.clone(), good.clone(), good.clone()]),
            ("bad clock", vec![good.clone(), b"\xa3abc".to_vec()]),
        ];
        for (name, frames) in cases {
            let (ep, _rogue) = rogue_server(frames);
            let err = HandshakeClient::new(once()).fetch_raw(&ep, 0, 0).expect_err(name);
            assert!(matches!(err, HandshakeError::Wire { .. }), "{name}: {err}");
        }
        // Valid frames that are not kvx metadata.
        let vllmish =
            Payload::Meta { compatibility_hash: "a".repeat(64), agent_metadata_bytes: b"\x90".to_vec() };
        let (ep, _rogue) = rogue_server(vec![vllmish.encode()]);
        let err =
            HandshakeClient::new(once()).fetch_metadata(&ep, 0, 0, None, no_rules).expect_err("not kvx");
        assert!(matches!(err, HandshakeError::NotKvx { .. }), "{err}");
    });
}

#[test]
fn server_survives_bad_requests_and_keeps_serving() {
    within(LIMIT, || {
        let f = factors("bfloat16", 8);
        let server = HandshakeServer::start("tcp://127.0.0.1:0", table(&f)).expect("server");
        let ep = server.endpoint().to_owned();
        let ctx = zmq_context();
        let ask = |frame: &[u8]| -> Payload {
            let req = ctx.socket(zmq::REQ).expect("socket");
            req.set_linger(0).expect("linger");
            req.set_rcvtimeo(5000).expect("rcvtimeo");
            req.connect(&ep).expect("connect");
            req.send(frame, 0).expect("send");
            let frames = req.recv_multipart(0).expect("a reply, not silence");
            kvx::transfer::handshake::Reply::decode(&frames).expect("decodable reply").payload
        };
        for bad in
            [&b"garbage"[..], &[0x93, 0xc4, 0x01, b'x', 0, 0], &[0xdd, 0xff, 0xff, 0xff, 0xff], &[0u8; 2048]]
        {
            let Payload::Error(msg) = ask(bad) else { panic!("bad request {bad:02x?} was served") };
            assert!(!msg.is_empty());
        }
        // No envelope (DEALER without the empty delimiter) and a frame over the socket's
        // size limit: both dropped without a reply.
        let dealer = ctx.socket(zmq::DEALER).expect("socket");
        dealer.set_linger(0).expect("linger");
        dealer.connect(&ep).expect("connect");
        dealer.send("no envelope", 0).expect("send");
        let huge = ctx.socket(zmq::REQ).expect("socket");
        huge.set_linger(0).expect("linger");
        huge.connect(&ep).expect("connect");
        huge.send(vec![0u8; 1 << 20], 0).expect("send");

        let p = HandshakeClient::new(fast(Framing::V0_33))
            .fetch_metadata(&ep, 0, 1, Some(&f), no_rules)
            .expect("still serving");
        assert_eq!(p.metadata.tp_rank, 1);
        let stats = server.stats();
        assert_eq!(stats.refused, 4, "{stats:?}");
        assert_eq!(stats.served, 1, "{stats:?}");
    });
}

#[test]
fn stop_is_prompt() {
    within(LIMIT, || {
        let server = HandshakeServer::start("tcp://127.0.0.1:0", PayloadTable::new()).expect("server");
        let t0 = Instant::now();
        server.stop();
        // vLLM's loop needs up to its 1 s RCVTIMEO; the control socket makes it immediate.
        assert!(t0.elapsed() < Duration::from_millis(900), "stop took {:?}", t0.elapsed());
    });
}

#[test]
fn vllm_payload_is_not_mistaken_for_kvx() {
    within(LIMIT, || {
        let oracle = oracle();
        let hs = &oracle["handshake_and_lifecycle"]["vllm_0.33.0"]["handshake"];
        let payload =
            hex::decode(hs["reply_frames"]["frame0_payload_hex"].as_str().expect("hex")).expect("hex");
        let t = PayloadTable::new();
        t.publish(0, 1, payload.clone());
        let server = HandshakeServer::start("tcp://127.0.0.1:0", t).expect("server");
        let client = HandshakeClient::new(fast(Framing::V0_33));
        let f = factors("bfloat16", 8);
        let err = client.fetch_metadata(server.endpoint(), 0, 1, Some(&f), no_rules).expect_err("mismatch");
        assert!(matches!(err, HandshakeError::HashMismatch { diffs: None, .. }), "{err}");
        let err = client.fetch_metadata(server.endpoint(), 0, 1, None, no_rules).expect_err("not kvx");
        assert!(matches!(err, HandshakeError::NotKvx { kind: "vLLM NixlAgentMetadata", .. }), "{err}");
        let raw = client.fetch_raw(server.endpoint(), 0, 1).expect("raw");
        let Payload::Meta { agent_metadata_bytes, .. } = raw.reply.payload else { panic!("not metadata") };
        assert!(matches!(AgentMetadata::decode(&agent_metadata_bytes), Ok(AgentMetadata::Vllm(_))));
    });
}

pub(crate) fn oracle() -> serde_json::Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/oracle");
    let dir = std::env::var_os(kvx::settings::env::KVX_ORACLE_DIR).map_or_else(
        || if shared.join("descriptors.json").exists() { shared } else { root.join("tests/fixtures/oracle") },
        std::path::PathBuf::from,
    );
    let path = dir.join("descriptors.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("oracle {} is required for these tests: {e}", path.display()));
    serde_json::from_str(&text).expect("oracle is JSON")
}

mod notifications {
    use std::time::{Duration, Instant};

    use kvx::transfer::handshake::zmq_context;
    use kvx::transfer::notify::{LeaseTable, Notification, NotifyError, NotifyListener, NotifySender};

    use super::{LIMIT, within};

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn notifications_and_heartbeats_drive_the_lease_table() {
        within(LIMIT, || {
            let listener = NotifyListener::bind("tcp://127.0.0.1:0").expect("bind");
            // Two D ranks read request `req-1` from this P rank; each notifies once.
            let d0 = NotifySender::connect(listener.endpoint(), WAIT).expect("connect");
            let d1 = NotifySender::connect(listener.endpoint(), WAIT).expect("connect");
            let t0 = Instant::now();
            let mut table = LeaseTable::new(Duration::from_secs(30));
            table.register("req-1", None, t0).expect("new");
            table.register("req-2", None, t0).expect("new");

            d0.send_heartbeat(&["req-2".to_owned()]).expect("heartbeat");
            d0.send_done("req-1", 2).expect("notif");
            d1.send_done("req-1", 2).expect("notif");
            d1.send_done("unknown-req", 1).expect("notif");

            let mut got = Vec::new();
            while got.len() < 4 {
                let n = listener.recv(WAIT).expect("recv").expect("a message within the wait");
                got.push(n);
            }
            assert!(got.contains(&Notification::Heartbeat { ids: vec!["req-2".into()] }));
            let mut freed = Vec::new();
            // Simulated time: each message is processed 1 s later than the previous.
            for (i, n) in got.iter().enumerate() {
                freed.extend(table.apply(n, t0 + Duration::from_secs(25 + i as u64)));
            }
            assert_eq!(freed, vec!["req-1".to_owned()]);
            // req-2 was extended to at least 25 + 20 s, so it survives the 30 s mark.
            assert!(table.expire(t0 + Duration::from_secs(30)).is_empty());
            assert_eq!(table.expire(t0 + Duration::from_secs(60)), vec!["req-2".to_owned()]);
            let st = table.stats();
            assert_eq!((st.freed_complete, st.freed_expired, st.unrecognized), (1, 1, 1));
        });
    }

    #[test]
    fn malformed_messages_do_not_stop_the_listener() {
        within(LIMIT, || {
            let listener = NotifyListener::bind("tcp://127.0.0.1:0").expect("bind");
            let raw = zmq_context().socket(zmq::PUSH).expect("socket");
            raw.set_linger(1000).expect("linger");
            raw.connect(listener.endpoint()).expect("connect");
            raw.send("no count here", 0).expect("send");
            raw.send_multipart(["a:1", "b:1"], 0).expect("send");
            raw.send(&b"\xff\xfe:1"[..], 0).expect("send");
            raw.send("ok:1", 0).expect("send");
            for _ in 0..3 {
                let err = listener.recv(WAIT).expect_err("malformed");
                assert!(matches!(err, NotifyError::Malformed { .. }), "{err}");
            }
            assert_eq!(
                listener.recv(WAIT).expect("recv"),
                Some(Notification::Notif { p_request_id: "ok".into(), count: 1 })
            );
            assert_eq!(listener.recv(Duration::from_millis(10)).expect("recv"), None);
        });
    }

    #[test]
    fn sending_to_a_missing_listener_fails_within_the_timeout() {
        within(LIMIT, || {
            let dir = tempfile::tempdir().expect("tempdir");
            let ep = format!("ipc://{}/nobody", dir.path().display());
            let timeout = Duration::from_millis(300);
            let sender = NotifySender::connect(&ep, timeout).expect("connect is lazy");
            let t0 = Instant::now();
            let err = sender.send_done("r", 1).expect_err("nobody listens");
            assert!(matches!(err, NotifyError::NotDelivered { .. }), "{err}");
            assert!(t0.elapsed() < timeout + Duration::from_secs(2), "took {:?}", t0.elapsed());
        });
    }
}

mod probe_cli {
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::{Duration, Instant};

    use kvx::transfer::handshake::{HandshakeServer, PayloadTable, zmq_context};
    use serde_json::Value;

    use super::{LIMIT, factors, metadata, oracle, within};

    const CMD_TIMEOUT: Duration = Duration::from_secs(30);

    /// An in-process ROUTER that answers every request with `frames`, as the captured
    /// vLLM engine did, and records the request frames it received.
    struct Replay {
        endpoint: String,
        requests: Arc<Mutex<Vec<Vec<u8>>>>,
        stop: Option<mpsc::Sender<()>>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Replay {
        fn start(frames: Vec<Vec<u8>>) -> Self {
            let router = zmq_context().socket(zmq::ROUTER).expect("socket");
            router.set_linger(0).expect("linger");
            router.bind("tcp://127.0.0.1:0").expect("bind");
            let endpoint = router.get_last_endpoint().expect("endpoint").expect("utf8");
            let requests = Arc::new(Mutex::new(Vec::new()));
            let (stop, stopped) = mpsc::channel::<()>();
            let thread = {
                let requests = requests.clone();
                std::thread::spawn(move || {
                    while stopped.try_recv() == Err(mpsc::TryRecvError::Empty) {
                        if router.poll(zmq::POLLIN, 50).expect("poll") == 0 {
                            continue;
                        }
                        let mut msg = router.recv_multipart(0).expect("recv");
                        requests.lock().expect("lock").push(msg.last().cloned().unwrap_or_default());
                        msg.truncate(2); // identity, empty delimiter
                        msg.extend(frames.iter().cloned());
                        router.send_multipart(msg, 0).expect("send");
                    }
                })
            };
            Replay { endpoint, requests, stop: Some(stop), thread: Some(thread) }
        }

        fn requests_hex(&self) -> Vec<String> {
            self.requests.lock().expect("lock").iter().map(hex::encode).collect()
        }
    }

    impl Drop for Replay {
        fn drop(&mut self) {
            drop(self.stop.take());
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn hex_of(v: &Value) -> Vec<u8> {
        hex::decode(v.as_str().expect("hex string")).expect("hex")
    }

    fn v033_frames() -> (Vec<Vec<u8>>, Value) {
        let o = oracle();
        let hs = o["handshake_and_lifecycle"]["vllm_0.33.0"]["handshake"].clone();
        let mut clock = Vec::new();
        rmp::encode::write_f64(
            &mut clock,
            hs["reply_frames"]["frame1_perf_counter_float"].as_f64().expect("float"),
        )
        .expect("encode");
        (vec![hex_of(&hs["reply_frames"]["frame0_payload_hex"]), clock], hs)
    }

    fn v019_frames() -> (Vec<Vec<u8>>, Value) {
        let o = oracle();
        let v = o["handshake_and_lifecycle"]["vllm_0.19.1"].clone();
        (vec![hex_of(&v["frame0_payload_hex"])], v)
    }

    fn kvx_probe(args: &[&str]) -> assert_cmd::assert::Assert {
        assert_cmd::cargo::cargo_bin_cmd!("kvx").arg("probe").args(args).timeout(CMD_TIMEOUT).assert()
    }

    fn json_out(a: &assert_cmd::assert::Assert) -> Value {
        serde_json::from_slice(&a.get_output().stdout).expect("probe prints JSON")
    }

    #[test]
    fn probe_decodes_the_captured_v0_33_reply() {
        within(LIMIT, || {
            let (frames, hs) = v033_frames();
            let replay = Replay::start(frames);
            let a = kvx_probe(&[&replay.endpoint, "--tp-rank", "1", "--format", "json", "--timeout", "10s"])
                .success();
            let j = json_out(&a);
            let want = &hs["reply_frames"]["frame0_agent_metadata_decoded"];
            assert_eq!(j["framing"], "0.33");
            assert_eq!(j["reply_frames"], 2);
            assert_eq!(j["peer_clock_s"], hs["reply_frames"]["frame1_perf_counter_float"]);
            assert_eq!(j["compatibility_hash"], hs["compat_hash"]["sha256_hex_manual"]);
            assert_eq!(j["advertised"]["kind"], "vllm");
            let m = &j["advertised"]["metadata"];
            assert_eq!(m["engine_id"], "P-engine");
            assert_eq!(m["kv_cache_layout"], "LBHNC");
            for k in [
                "block_lens",
                "block_strides",
                "num_blocks",
                "kv_caches_base_addr",
                "block_size",
                "region_names",
            ] {
                assert_eq!(m[k], want[k], "{k}");
            }
            assert_eq!(m["kv_caches_base_addr"], serde_json::json!([8589934592u64, 8589950976u64]));
            let opaque = &j["advertised"]["opaque"][0];
            assert_eq!(
                (opaque["field"].as_str(), opaque["bytes"].as_u64()),
                (Some("agent_metadata"), Some(45))
            );
            // kvx asked exactly as vLLM 0.33 does.
            assert_eq!(
                replay.requests_hex(),
                vec![hs["request_frame_hex"].as_str().expect("hex").to_owned()]
            );
        });
    }

    #[test]
    fn probe_table_shows_decoded_and_opaque_parts() {
        within(LIMIT, || {
            let (frames, _) = v033_frames();
            let replay = Replay::start(frames);
            let a = kvx_probe(&[&replay.endpoint, "--tp-rank", "1", "--timeout", "10s"]).success();
            let out = String::from_utf8(a.get_output().stdout.clone()).expect("utf8");
            let port = replay.endpoint.rsplit(':').next().expect("port");
            // Same width as the port, so the table layout is unchanged.
            let redacted = redact_latency(&out).replace(port, &"P".repeat(port.len()));
            insta::with_settings!({ snapshot_path => "../fixtures/handshake/snapshots", prepend_module_to_snapshot => false }, {
                insta::assert_snapshot!("probe_v0_33_table", redacted);
            });
            for needle in [
                "P-engine",
                "LBHNC",
                "4096, 4096",
                "0x200000000",
                "0x200004000",
                "1fe9766e614ae6e5",
                "opaque: agent_metadata",
            ] {
                assert!(out.contains(needle), "{needle} missing from\n{out}");
            }
        });
    }

    #[test]
    fn probe_with_a_closed_stdout_exits_0() {
        within(LIMIT, || {
            let (frames, _) = v033_frames();
            let replay = Replay::start(frames);
            for format in ["table", "json"] {
                let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin!("kvx"));
                cmd.args([
                    "probe",
                    &replay.endpoint,
                    "--tp-rank",
                    "1",
                    "--timeout",
                    "10s",
                    "--format",
                    format,
                ]);
                let out = crate::edge::run_with_closed_stdout(cmd, crate::edge::Reader::ClosedAtStart);
                assert_eq!(out.status.code(), Some(0), "probe --format {format}: {}", out.stderr);
                assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
            }
        });
    }

    /// Replaces the latency row (its number changes every run) with a marker.
    fn redact_latency(text: &str) -> String {
        text.lines()
            .map(|line| if line.starts_with("| latency ") { "| latency [redacted]" } else { line })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn probe_auto_detects_v0_19_and_asks_again_in_its_framing() {
        within(LIMIT, || {
            let (frames, v) = v019_frames();
            let replay = Replay::start(frames);
            let a = kvx_probe(&[&replay.endpoint, "--tp-rank", "1", "--format", "json", "--timeout", "10s"])
                .success();
            let j = json_out(&a);
            assert_eq!(j["framing"], "0.19");
            assert_eq!(j["peer_clock_s"], Value::Null);
            assert_eq!(j["compatibility_hash"], v["compat_hash"]["executed"]);
            let m = &j["advertised"]["metadata"];
            assert_eq!(m["engine_id"], "P-engine");
            assert_eq!(m["kv_cache_layout"], "HND");
            assert_eq!(m["kv_caches_base_addr"], v["agent_metadata_decoded"]["kv_caches_base_addr"]);
            assert_eq!(m["block_lens"], v["agent_metadata_decoded"]["block_lens"]);
            assert_eq!(m["num_blocks"], 4);
            let reqs = replay.requests_hex();
            assert_eq!(reqs.len(), 2, "{reqs:?}");
            assert_eq!(
                reqs[1],
                v["request_frame_hex"].as_str().expect("hex"),
                "second request in 0.19 framing"
            );

            let replay = Replay::start(v019_frames().0);
            kvx_probe(&[&replay.endpoint, "--tp-rank", "1", "--vllm", "0.19", "--timeout", "10s"]).success();
            assert_eq!(replay.requests_hex(), vec![v["request_frame_hex"].as_str().expect("hex").to_owned()]);
        });
    }

    #[test]
    fn probe_a_kvx_engine_and_measure_repeats() {
        within(LIMIT, || {
            let f = factors("bfloat16", 8);
            let t = PayloadTable::new();
            t.publish(0, 1, metadata(0, 1, &f).to_payload().expect("payload").encode());
            let server = HandshakeServer::start("tcp://127.0.0.1:0", t).expect("server");
            let a = kvx_probe(&[server.endpoint(), "--tp-rank", "1", "--format", "json", "--repeat", "5"])
                .success();
            let j = json_out(&a);
            assert_eq!(j["advertised"]["kind"], "kvx");
            let m = &j["advertised"]["metadata"];
            assert_eq!(
                (m["engine_id"].as_str(), m["tp_size"].as_u64(), m["tp_rank"].as_u64()),
                (Some("P-engine"), Some(2), Some(1))
            );
            assert_eq!(m["factors_match_hash"], true);
            assert_eq!(m["factors"]["dtype"], "bfloat16");
            assert_eq!(m["regions"].as_array().map(Vec::len), Some(3));
            assert_eq!(j["compatibility_hash"].as_str(), Some(f.hash_hex().as_str()));
            assert_eq!(j["latency_summary"]["count"], 5);
            // A rank the engine does not serve: the refusal is shown and the exit code is 2.
            let a = kvx_probe(&[server.endpoint(), "--tp-rank", "6"]).code(2);
            assert!(
                String::from_utf8_lossy(&a.get_output().stdout)
                    .contains("error: no metadata for (pp_rank 0, tp_rank 6)")
            );
            assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("answered with an error"));
            let stats = server.stop();
            assert_eq!((stats.served, stats.refused), (5, 1));
        });
    }

    #[test]
    fn unreachable_endpoint_fails_within_the_timeout_with_exit_2() {
        within(LIMIT, || {
            let port =
                std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
            let t0 = Instant::now();
            let a = kvx_probe(&[&format!("127.0.0.1:{port}"), "--timeout", "500ms"]).code(2);
            assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
            let err = String::from_utf8_lossy(&a.get_output().stderr).into_owned();
            assert!(err.contains("no connection to tcp://127.0.0.1:"), "{err}");
            let a = kvx_probe(&["http://example:1"]).code(2);
            assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("ENDPOINT"));
            kvx_probe(&["127.0.0.1:1", "--timeout", "soon"]).code(2);
        });
    }
}
