//! Handshake latency on loopback: what a decode rank pays per prefill rank to learn its
//! metadata (new REQ socket, TCP connect, request, reply, decode and checks), next to a
//! reference measured in the same run: one REQ/REP round trip of the same reply bytes on
//! an already connected socket (the floor set by ZMQ and the kernel).
//!
//! Run: `cargo bench --bench handshake`.

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kvx::transfer::handshake::{
    CompatFactors, FetchOptions, HandshakeClient, HandshakeServer, KVX_METADATA_FORMAT, KvxFactors,
    KvxMetadata, KvxRegion, PayloadTable, zmq_context,
};

/// A rank of a 64-layer model: one region per layer, rkeys of a realistic size.
fn metadata(tp_rank: u32, factors: &CompatFactors) -> KvxMetadata {
    let regions = (0..64u64)
        .map(|i| KvxRegion {
            name: format!("model.layers.{i}.self_attn.attn"),
            mem_type: "host".into(),
            device_id: 0,
            base_addr: 0x7f00_0000_0000 + i * (1 << 30),
            rkey: vec![0x11; 150],
            block_len_bytes: 65536,
            block_stride_bytes: 65536,
            num_blocks: 16384,
        })
        .collect();
    KvxMetadata::new("bench-P", vec![0x22; 300], (8, tp_rank, 0, 0), "LBHNC", 16, regions, None, factors)
}

fn bench(c: &mut Criterion) {
    let factors = CompatFactors::kvx(&KvxFactors {
        kvx_format_version: KVX_METADATA_FORMAT,
        model: "bench/model".into(),
        dtype: "bfloat16".into(),
        num_kv_heads: 8,
        head_size: 128,
        num_hidden_layers: 64,
        cache_dtype: "auto".into(),
        layout_family: "v0.33".into(),
        transfer_mode: "pull".into(),
    });
    let table = PayloadTable::new();
    for tp in 0..8 {
        table.publish(0, tp, metadata(tp, &factors).to_payload().expect("payload").encode());
    }
    let server = HandshakeServer::start("tcp://127.0.0.1:0", table).expect("server");
    let ep = server.endpoint().to_owned();
    let client =
        HandshakeClient::new(FetchOptions { deadline: Duration::from_secs(5), ..FetchOptions::default() });
    let ok = |_: &KvxMetadata| Ok::<(), String>(());

    let mut g = c.benchmark_group("handshake");
    g.bench_function("fetch_metadata_1_rank_new_connection", |b| {
        b.iter(|| client.fetch_metadata(&ep, 0, 3, Some(&factors), ok).expect("fetch"))
    });
    let ranks: Vec<(u32, u32)> = (0..8).map(|tp| (0, tp)).collect();
    g.bench_function("fetch_metadata_8_ranks_one_connection", |b| {
        b.iter(|| client.fetch_metadata_many(&ep, &ranks, Some(&factors), ok).expect("fetch"))
    });

    // Reference: the same reply bytes over an established REQ/REP pair.
    let reply = metadata(3, &factors).to_payload().expect("payload").encode();
    let rep = zmq_context().socket(zmq::REP).expect("socket");
    rep.bind("tcp://127.0.0.1:0").expect("bind");
    let rep_ep = rep.get_last_endpoint().expect("endpoint").expect("utf8");
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let echo = std::thread::spawn(move || {
        while stop_rx.try_recv().is_err() {
            if rep.poll(zmq::POLLIN, 100).expect("poll") > 0 {
                let _ = rep.recv_bytes(0).expect("recv");
                rep.send(&reply, 0).expect("send");
            }
        }
    });
    let req = zmq_context().socket(zmq::REQ).expect("socket");
    req.connect(&rep_ep).expect("connect");
    g.bench_function("reference_req_rep_round_trip_connected", |b| {
        b.iter(|| {
            req.send(&b"\x93\xc4\x0cget_meta_msg\x00\x03"[..], 0).expect("send");
            req.recv_bytes(0).expect("recv")
        })
    });
    g.finish();
    drop(stop_tx);
    let _ = echo.join();
    server.stop();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
