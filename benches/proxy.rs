//! Serving-path microbenchmarks (sequential requests, one at a time, so each number is a
//! latency): which pooled HTTP client the proxy should use, what the proxy hop costs next to
//! a client doing the two P/D legs itself, and what the toy-proxy body rewriting costs.
//! Engines and proxy run in-process on loopback with NullKv and zero delays.
//!
//! `cargo bench --bench proxy`

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http_body_util::{BodyExt as _, Full};
use kvx::config::serve::EngineIdentity;
use kvx::config::serve::HttpEngineConfig;
use kvx::config::serve::{BackendAddr, ProxyConfig};
use kvx::serve::client::{HttpClient, http_client};
use kvx::serve::http_engine::{self, EngineState};
use kvx::serve::kv::NullKv;
use kvx::serve::proxy::{self, ProxyState};
use kvx::serve::rewrite::{self, RawObject};
use kvx::vocab::kinds::Role;
use tokio::net::TcpListener;

const BODY: &str = r#"{"model":"stub-model","prompt":"w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15","max_tokens":4,"ignore_eos":true}"#;

async fn bind() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

async fn start_engine(role: Role) -> u16 {
    let kv = NullKv::new(EngineIdentity {
        engine_id: format!("{}-bench", role.as_str()),
        side_channel_host: "127.0.0.1".into(),
        side_channel_port: 5600,
        tp_size: 1,
    });
    let st = EngineState::new(HttpEngineConfig::new(role, "stub-model"), Arc::new(kv));
    let (l, port) = bind().await;
    tokio::spawn(http_engine::serve(l, st, std::future::pending()));
    port
}

async fn start_proxy(p: u16, d: u16) -> u16 {
    let addr = |port| BackendAddr { host: "127.0.0.1".into(), port };
    let mut cfg = ProxyConfig::new(vec![addr(p)], vec![addr(d)]);
    cfg.health_interval = Duration::ZERO;
    let st = ProxyState::new(cfg).expect("proxy");
    let (l, port) = bind().await;
    tokio::spawn(proxy::serve(l, st, std::future::pending()));
    port
}

async fn hyper_post(c: &HttpClient, url: &str, body: Bytes) -> Bytes {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("request");
    let resp = c.request(req).await.expect("response");
    assert!(resp.status().is_success());
    resp.into_body().collect().await.expect("body").to_bytes()
}

async fn reqwest_post(c: &reqwest::Client, url: &str, body: Bytes) -> Bytes {
    let resp =
        c.post(url).header("content-type", "application/json").body(body).send().await.expect("response");
    assert!(resp.status().is_success());
    resp.bytes().await.expect("body")
}

/// The proxy's two legs done by the client itself (the proxy's work at zero proxy cost).
async fn client_side_pd(c: &HttpClient, p_url: &str, d_url: &str, body: &Bytes) -> Bytes {
    let obj = RawObject::parse(body).expect("object");
    let p_resp = hyper_post(c, p_url, Bytes::from(rewrite::prefill_body(&obj))).await;
    let p = RawObject::parse(&p_resp).expect("prefill answer");
    let params = p.get("kv_transfer_params").filter(|r| rewrite::is_truthy(r));
    assert!(params.is_some());
    hyper_post(c, d_url, Bytes::from(rewrite::decode_body(&obj, body, params))).await
}

fn serving(c: &mut Criterion) {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let (p, d, x) = rt.block_on(async {
        let p = start_engine(Role::Prefill).await;
        let d = start_engine(Role::Decode).await;
        let x = start_proxy(p, d).await;
        (p, d, x)
    });
    let url = |port: u16| format!("http://127.0.0.1:{port}/v1/completions");
    let (p_url, d_url, x_url) = (url(p), url(d), url(x));
    let body = Bytes::from_static(BODY.as_bytes());
    let hyper = http_client(None);
    let reqw = reqwest::Client::builder().no_proxy().tcp_nodelay(true).build().expect("reqwest");

    let mut g = c.benchmark_group("client_round_trip_to_decode_engine");
    g.bench_function("hyper_util_legacy", |b| {
        b.iter(|| rt.block_on(hyper_post(&hyper, &d_url, body.clone())))
    });
    g.bench_function("reqwest", |b| b.iter(|| rt.block_on(reqwest_post(&reqw, &d_url, body.clone()))));
    g.finish();

    let mut g = c.benchmark_group("request_path");
    g.bench_function("direct_decode", |b| b.iter(|| rt.block_on(hyper_post(&hyper, &d_url, body.clone()))));
    g.bench_function("client_side_pd", |b| {
        b.iter(|| rt.block_on(client_side_pd(&hyper, &p_url, &d_url, &body)))
    });
    g.bench_function("through_proxy", |b| b.iter(|| rt.block_on(hyper_post(&hyper, &x_url, body.clone()))));
    g.finish();

    let p_answer = rt.block_on(hyper_post(
        &hyper,
        &p_url,
        Bytes::from(rewrite::prefill_body(&RawObject::parse(&body).expect("object"))),
    ));
    let mut g = c.benchmark_group("rewrite");
    g.bench_function("prefill_body", |b| {
        b.iter(|| rewrite::prefill_body(&RawObject::parse(std::hint::black_box(&body)).expect("object")))
    });
    g.bench_function("decode_body_with_p_params", |b| {
        b.iter(|| {
            let obj = RawObject::parse(std::hint::black_box(&body)).expect("object");
            let p = RawObject::parse(std::hint::black_box(&p_answer)).expect("object");
            rewrite::decode_body(&obj, &body, p.get("kv_transfer_params"))
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = serving
}
criterion_main!(benches);
