//! The serving path over real loopback HTTP: engines and proxy in-process (bound to port 0,
//! listeners passed in) and as real `kvx` processes; byte-level checks against vLLM 0.32's
//! wire samples; the proxy's rewriting seen by recording backends; every failure answer
//! within its timeout. Every test runs under a hard timeout.

use std::future::Future;
use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt as _, Full};
use kvx::config::serve::EngineIdentity;
use kvx::config::serve::HttpEngineConfig;
use kvx::config::serve::{BackendAddr, ProxyConfig};
use kvx::serve::client::http_client;
use kvx::serve::http_engine::{self, EngineState};
use kvx::serve::kv::NullKv;
use kvx::serve::proxy::{self, ProxyState};
use kvx::vocab::kinds::Role;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use wait_timeout::ChildExt as _;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/serve");
const HARD_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs a test body under the hard timeout.
async fn within<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(HARD_TIMEOUT, f).await.expect("test exceeded its hard timeout");
}

pub(crate) fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}")).expect("fixture")
}

/// A vLLM 0.32 non-streaming sample as 0.33 writes it: every choice ends with
/// `"weight_versions":null`.
pub(crate) fn fixture_033(name: &str) -> String {
    fixture(name).replace(r#""routed_experts":null}"#, r#""routed_experts":null,"weight_versions":null}"#)
}

/// A server task bound to port 0 that stops when dropped.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start<F, Fut>(run: F) -> Self
    where
        F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
        Fut: Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel();
        let fut = run(listener, rx);
        let task = tokio::spawn(async move {
            fut.await.expect("server");
        });
        Self { addr, stop: Some(tx), task }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn backend(&self) -> BackendAddr {
        BackendAddr { host: "127.0.0.1".into(), port: self.addr.port() }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.abort();
    }
}

async fn shutdown(rx: oneshot::Receiver<()>) {
    let _ = rx.await;
}

fn null_kv(engine_id: &str) -> Arc<NullKv> {
    Arc::new(NullKv::new(EngineIdentity {
        engine_id: engine_id.into(),
        side_channel_host: "127.0.0.1".into(),
        side_channel_port: 5600,
        tp_size: 1,
    }))
}

async fn start_engine(cfg: HttpEngineConfig) -> (Server, Arc<EngineState>) {
    let id = format!("{}-engine", cfg.role.as_str());
    let state = EngineState::new(cfg, null_kv(&id));
    let st = state.clone();
    let server = Server::start(move |l, rx| http_engine::serve(l, st, shutdown(rx))).await;
    (server, state)
}

fn engine_cfg(role: Role) -> HttpEngineConfig {
    HttpEngineConfig::new(role, "stub-model")
}

fn proxy_cfg(p: Vec<BackendAddr>, d: Vec<BackendAddr>) -> ProxyConfig {
    let mut cfg = ProxyConfig::new(p, d);
    cfg.connect_timeout = Duration::from_millis(500);
    cfg.request_timeout = Duration::from_secs(5);
    cfg.health_interval = Duration::ZERO;
    cfg
}

async fn start_proxy(cfg: ProxyConfig) -> (Server, Arc<ProxyState>) {
    let state = ProxyState::new(cfg).expect("proxy state");
    let st = state.clone();
    let server = Server::start(move |l, rx| proxy::serve(l, st, shutdown(rx))).await;
    (server, state)
}

/// One HTTP exchange over the pooled client; the body is collected whole. A body goes out
/// as `application/json` unless `headers` name another content type (as every JSON client
/// sends it; vLLM refuses anything else).
pub(crate) async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, HeaderMap, String) {
    let client = http_client(Some(Duration::from_secs(2)));
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() && !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        req = req.header("content-type", "application/json");
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).expect("request");
    let resp = client.request(req).await.expect("response");
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).expect("utf8 body"))
}

pub(crate) async fn post(url: &str, headers: &[(&str, &str)], body: &str) -> (StatusCode, HeaderMap, String) {
    send("POST", url, headers, body).await
}

/// Replaces the value after every `key` up to `end` with `with`.
fn replace_values(s: &str, key: &str, end: char, with: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(key) {
        out.push_str(&rest[..i + key.len()]);
        rest = &rest[i + key.len()..];
        let j = rest.find(end).unwrap_or(rest.len());
        out.push_str(with);
        rest = &rest[j..];
    }
    out.push_str(rest);
    out
}

/// Maps kvx's per-run values onto the sample's: timestamps, fingerprint, token texts.
pub(crate) fn normalise(s: &str) -> String {
    let s = replace_values(s, "\"created\":", ',', "1795300000");
    let s = replace_values(&s, "\"system_fingerprint\":\"", '"', "vllm-0.32.0-abcd1234");
    s.replace(" t0 t1", " Hello world").replace("\" t0\"", "\" Hello\"").replace("\" t1\"", "\" world\"")
}

/// The proxy in front of a real P and D engine (NullKv, zero delays).
pub(crate) struct Stack {
    pub(crate) proxy: Server,
    proxy_state: Arc<ProxyState>,
    _p: Server,
    p_state: Arc<EngineState>,
    _d: Server,
    d_state: Arc<EngineState>,
}

async fn stack_with(p_cfg: HttpEngineConfig, d_cfg: HttpEngineConfig) -> Stack {
    let (p, p_state) = start_engine(p_cfg).await;
    let (d, d_state) = start_engine(d_cfg).await;
    let (proxy, proxy_state) = start_proxy(proxy_cfg(vec![p.backend()], vec![d.backend()])).await;
    Stack { proxy, proxy_state, _p: p, p_state, _d: d, d_state }
}

async fn stack() -> Stack {
    stack_with(engine_cfg(Role::Prefill), engine_cfg(Role::Decode)).await
}

/// The stack with a decode engine of `d_cfg`.
pub(crate) async fn stack_with_cfg(d_cfg: HttpEngineConfig) -> Stack {
    stack_with(engine_cfg(Role::Prefill), d_cfg).await
}

pub(crate) fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix).map(str::trim))
        .unwrap_or_else(|| panic!("metric {line_prefix} missing in:\n{text}"))
        .parse()
        .expect("number")
}

/// Polls a condition (every 5 ms, up to 5 s): the observable end of an asynchronous effect.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_stream_through_proxy_is_byte_exact() {
    within(async {
        let s = stack().await;
        let body = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#;
        let (status, h, text) =
            post(&s.proxy.url("/v1/completions"), &[("x-request-id", "0123456789abcdef")], body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(h["content-type"], "text/event-stream; charset=utf-8");
        assert!(h.get("content-length").is_none(), "SSE is chunked");
        assert_eq!(normalise(&text), fixture("vllm-0.32-completions-stream.sse"));
        // D loaded (NullKv) rather than silently prefilling.
        let m = s.d_state.render_metrics();
        assert_eq!(metric(&m, "kvx:kv_loads_total{model_name=\"stub-model\",result=\"ok\"}"), 1.0);
        assert_eq!(metric(&m, "kvx:decode_local_prefill_total{model_name=\"stub-model\",reason=\"missing\"}"), 0.0);
        let pm = s.p_state.render_metrics();
        assert_eq!(metric(&pm, "kvx:kv_prefill_handoffs_total{model_name=\"stub-model\"}"), 1.0);

        // Without a usage chunk the terminal text chunk carries the fingerprint.
        let body = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":2,"stream":true}"#;
        let (_, _, text) =
            post(&s.proxy.url("/v1/completions"), &[("x-request-id", "0123456789abcdef")], body).await;
        let last = text.split_inclusive("\n\n").nth(1).expect("second event");
        assert_eq!(normalise(last), fixture("vllm-0.32-completions-stream-final-chunk.sse"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_and_json_through_proxy_are_byte_exact() {
    within(async {
        let s = stack().await;
        let msgs = r#"[{"role":"system","content":"you are a stub"},{"role":"user","content":"say hello world to me"}]"#;
        let body = format!(
            r#"{{"model":"stub-model","messages":{msgs},"max_completion_tokens":2,"stream":true,"stream_options":{{"include_usage":true}}}}"#
        );
        let (status, h, text) =
            post(&s.proxy.url("/v1/chat/completions"), &[("x-request-id", "0123456789abcdef")], &body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(h["content-type"], "text/event-stream; charset=utf-8");
        assert_eq!(normalise(&text), fixture("vllm-0.32-chat-stream.sse"));

        let body = format!(r#"{{"model":"stub-model","messages":{msgs},"max_tokens":2}}"#);
        let (status, h, text) =
            post(&s.proxy.url("/v1/chat/completions"), &[("x-request-id", "0123456789abcdef")], &body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["x-request-id"], "0123456789abcdef");
        assert_eq!(h["content-length"].to_str().expect("len").parse::<usize>().expect("n"), text.len());
        assert_eq!(normalise(&text), fixture_033("vllm-0.32-chat-response.json"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_engine_answer_is_byte_exact_with_033_params() {
    within(async {
        let (p, _) = start_engine(engine_cfg(Role::Prefill)).await;
        let prompt = (0..17).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
        let body = format!(
            r#"{{"model":"stub-model","prompt":"{prompt}","max_tokens":1,"stream":false,"kv_transfer_params":{{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}}}"#
        );
        let (status, _, text) = post(&p.url("/v1/completions"), &[("x-request-id", "0123456789abcdef")], &body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        let rid = v["kv_transfer_params"]["remote_request_id"].as_str().expect("remote_request_id").to_string();
        assert!(rid.starts_with("cmpl-0123456789abcdef-0-"), "{rid}");
        // The 0.32 sample, with 0.33's full kv_transfer_params in place of 0.32's.
        let want = fixture_033("vllm-0.32-prefill-response.json").replace(
            r#""remote_request_id":"cmpl-0123456789abcdef-0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"remote_num_tokens":17}"#,
            &format!(
                r#""remote_request_id":"{rid}","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":17,"remote_blocks_expiry_time":null,"remote_registration_generation":0,"transfer_mode":"pull"}}"#
            ),
        );
        let got = normalise(&text.replace("\"prefill-engine\"", "\"e1\""));
        assert_eq!(got, want);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors_match_vllm_bytes() {
    within(async {
        let (d, _) = start_engine(engine_cfg(Role::Decode)).await;
        let (status, h, text) =
            post(&d.url("/v1/completions"), &[], r#"{"prompt":"a","stream_options":{"include_usage":true}}"#)
                .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(text, fixture("vllm-0.32-error-body.json"));
    })
    .await;
}

/// What a recording backend saw.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    headers: HeaderMap,
    body: String,
}

#[derive(Clone)]
enum Act {
    Json(u16, String),
    /// Never answers (the request is held until the client gives up).
    Hang,
    /// SSE chunks, then the connection breaks mid-body once the test says so.
    SseThenBreak(Vec<String>, Arc<tokio::sync::Notify>),
}

#[derive(Clone)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
    act: Act,
}

impl Recorder {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }
}

async fn start_recorder(act: Act) -> (Server, Recorder) {
    let rec = Recorder { seen: Arc::new(Mutex::new(Vec::new())), act };
    let r = rec.clone();
    let handler = move |uri: http::Uri, headers: HeaderMap, body: Bytes| {
        let r = r.clone();
        async move {
            r.seen.lock().expect("lock").push(Seen {
                path: uri.path().to_string(),
                headers,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
            match r.act {
                Act::Json(status, body) => (
                    StatusCode::from_u16(status).expect("status"),
                    [("content-type", "application/json")],
                    body,
                )
                    .into_response(),
                Act::Hang => std::future::pending::<Response>().await,
                Act::SseThenBreak(chunks, crash) => {
                    use futures::StreamExt as _;
                    let head = futures::stream::iter(
                        chunks.into_iter().map(|c| Ok::<Bytes, std::io::Error>(Bytes::from(c))),
                    );
                    let crash = futures::stream::once(async move {
                        crash.notified().await;
                        Err(std::io::Error::other("engine crashed"))
                    });
                    (
                        [("content-type", "text/event-stream; charset=utf-8")],
                        Body::from_stream(head.chain(crash)),
                    )
                        .into_response()
                }
            }
        }
    };
    let router = Router::new().fallback(handler);
    let server = Server::start(move |l, rx| http_engine::serve_router(l, router, shutdown(rx))).await;
    (server, rec)
}

const P_ANSWER: &str = r#"{"id":"cmpl-x","object":"text_completion","choices":[{"index":0,"text":" a","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3, 4]],"remote_engine_id":"P-engine","remote_request_id":"cmpl-x-0-abcd1234","remote_host":"10.0.0.1","remote_port":5601,"tp_size":2,"future_field":1.50}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_rewrites_exactly_like_the_toy_proxy() {
    within(async {
        let (p, p_rec) = start_recorder(Act::Json(200, P_ANSWER.into())).await;
        let (d, d_rec) = start_recorder(Act::Json(200, r#"{"ok":true}"#.into())).await;
        let mut cfg = proxy_cfg(vec![p.backend()], vec![d.backend()]);
        cfg.backend_api_key = Some("sk-test".into());
        let (proxy, _) = start_proxy(cfg).await;

        let client_body = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":4,"stream":true,
 "stream_options":{"include_usage":true},"min_tokens":2}"#;
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[("x-request-id", "req-42")], client_body).await;
        assert_eq!((status, text.as_str()), (StatusCode::OK, r#"{"ok":true}"#));

        let p_seen = p_rec.seen();
        let d_seen = d_rec.seen();
        assert_eq!((p_seen.len(), d_seen.len()), (1, 1));
        assert_eq!(p_seen[0].path, "/v1/completions");
        assert_eq!(d_seen[0].path, "/v1/completions");
        assert_eq!(
            p_seen[0].body,
            r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#
        );
        assert_eq!(
            d_seen[0].body,
            r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"min_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[3, 4]],"remote_engine_id":"P-engine","remote_request_id":"cmpl-x-0-abcd1234","remote_host":"10.0.0.1","remote_port":5601,"tp_size":2,"future_field":1.50}}"#
        );
        for s in [&p_seen[0], &d_seen[0]] {
            assert_eq!(s.headers["x-request-id"], "req-42");
            assert_eq!(s.headers["authorization"], "Bearer sk-test");
            assert_eq!(s.headers["content-type"], "application/json");
        }

        // Without a client id both legs share one fresh uuid4.
        let (status, _, _) = post(&proxy.url("/v1/chat/completions"), &[], r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":5}"#).await;
        assert_eq!(status, StatusCode::OK);
        let (p_seen, d_seen) = (p_rec.seen(), d_rec.seen());
        let (pid, did) = (&p_seen[1].headers["x-request-id"], &d_seen[1].headers["x-request-id"]);
        assert_eq!(pid, did);
        let id = uuid::Uuid::parse_str(pid.to_str().expect("ascii")).expect("uuid");
        assert_eq!(id.get_version_num(), 4);
        assert_eq!(pid.len(), 36, "hyphenated like str(uuid4())");
        assert_eq!(p_seen[1].path, "/v1/chat/completions");
        assert_eq!(
            p_seen[1].body,
            r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false,"max_tokens":1}"#
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_failure_fails_fast_and_never_calls_decode() {
    within(async {
        let err = r#"{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}"#;
        let (p, p_rec) = start_recorder(Act::Json(500, err.into())).await;
        let (d, d_rec) = start_recorder(Act::Json(200, "{}".into())).await;
        let (proxy, pst) = start_proxy(proxy_cfg(vec![p.backend()], vec![d.backend()])).await;
        let t0 = Instant::now();
        let (status, h, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(text, err);
        assert_eq!(p_rec.seen().len(), 1);
        assert!(d_rec.seen().is_empty(), "decode must not be called after a prefill failure");

        // A prefill engine answering something that is not an error object: 502 naming it.
        drop(proxy);
        let (p2, _) = start_recorder(Act::Json(200, "not json".into())).await;
        let (proxy, _) = start_proxy(proxy_cfg(vec![p2.backend()], vec![d.backend()])).await;
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json error");
        assert_eq!(v["error"]["code"], 502);
        assert!(v["error"]["message"].as_str().expect("msg").contains(&p2.backend().port.to_string()));
        assert!(d_rec.seen().is_empty());
        assert!(pst.render_metrics().contains("kvx:proxy_requests_total{code=\"5xx\"} 1"));
    })
    .await;
}

pub(crate) fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_down_gives_json_503_and_retries_elsewhere() {
    within(async {
        let dead = BackendAddr { host: "127.0.0.1".into(), port: closed_port() };
        let s = stack().await;
        let p_live = BackendAddr { host: "127.0.0.1".into(), port: s.p_state_port() };
        let d_live = BackendAddr { host: "127.0.0.1".into(), port: s.d_state_port() };

        // Only a dead prefill engine: 503 with a JSON body, fast.
        let (proxy, _) = start_proxy(proxy_cfg(vec![dead.clone()], vec![d_live.clone()])).await;
        let t0 = Instant::now();
        let (status, h, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert!(t0.elapsed() < Duration::from_secs(2), "answered within the connect timeout");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
        assert_eq!(h["content-type"], "application/json");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert!(
            v["error"]["message"].as_str().expect("msg").contains("cannot reach prefill engine"),
            "{text}"
        );
        // Now marked unhealthy: with no healthy prefill engine left, requests are answered
        // 503 at once, without another attempt on it (health checks are off here, so it is
        // tried again only after RETRY_DOWN_AFTER), and /health says 503.
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.contains("no healthy prefill engine"), "{text}");
        let (_, _, m) = send("GET", &proxy.url("/metrics"), &[], "").await;
        let requests = format!(
            "kvx:proxy_backend_requests_total{{role=\"prefill\",backend=\"127.0.0.1:{}\"}}",
            dead.port
        );
        assert_eq!(metric(&m, &requests), 1.0, "one connect attempt, then none: {m}");
        assert_eq!(metric(&m, "kvx:proxy_no_healthy_backend_total{role=\"prefill\"}"), 1.0);
        let (status, _, _) = send("GET", &proxy.url("/health"), &[], "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

        // A dead decode engine: prefill ran, then 503.
        let (proxy, _) = start_proxy(proxy_cfg(vec![p_live.clone()], vec![dead.clone()])).await;
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
        assert!(text.contains("cannot reach decode engine"), "{text}");

        // A dead engine next to a live one: the request is retried on the live one.
        let (proxy, pst) = start_proxy(proxy_cfg(vec![dead.clone(), p_live], vec![dead, d_live])).await;
        for _ in 0..3 {
            let (status, _, text) =
                post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b","max_tokens":2}"#).await;
            assert_eq!(status, StatusCode::OK, "{text}");
        }
        let m = pst.render_metrics();
        let dead_label = format!("127.0.0.1:{}", proxy_dead_port(&m));
        assert_eq!(
            metric(
                &m,
                &format!("kvx:proxy_backend_requests_total{{role=\"prefill\",backend=\"{dead_label}\"}}")
            ),
            1.0,
            "{m}"
        );
        assert_eq!(
            metric(&m, &format!("kvx:proxy_backend_healthy{{role=\"prefill\",backend=\"{dead_label}\"}}")),
            0.0
        );
        assert!(metric(&m, "kvx:proxy_retries_total") >= 1.0);
    })
    .await;
}

/// Port of the backend whose connect errors are non-zero in a proxy's metrics.
fn proxy_dead_port(metrics: &str) -> u16 {
    metrics
        .lines()
        .find(|l| {
            l.starts_with("kvx:proxy_backend_errors_total{role=\"prefill\"")
                && l.contains("cause=\"connect\"")
                && !l.ends_with(" 0.0")
        })
        .and_then(|l| l.split("backend=\"127.0.0.1:").nth(1))
        .and_then(|r| r.split('"').next())
        .and_then(|p| p.parse().ok())
        .expect("a prefill backend with connect errors")
}

impl Stack {
    fn p_state_port(&self) -> u16 {
        self._p.addr.port()
    }
    fn d_state_port(&self) -> u16 {
        self._d.addr.port()
    }
    pub(crate) fn p_url(&self, path: &str) -> String {
        self._p.url(path)
    }
    pub(crate) fn d_url(&self, path: &str) -> String {
        self._d.url(path)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_prefill_times_out_with_504() {
    within(async {
        let (p, _) = start_recorder(Act::Hang).await;
        let (d, d_rec) = start_recorder(Act::Json(200, "{}".into())).await;
        let mut cfg = proxy_cfg(vec![p.backend()], vec![d.backend()]);
        cfg.request_timeout = Duration::from_millis(300);
        let (proxy, _) = start_proxy(cfg).await;
        let t0 = Instant::now();
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a"}"#).await;
        let took = t0.elapsed();
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT, "{text}");
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
        assert!(text.contains("--request-timeout"), "{text}");
        assert!(d_rec.seen().is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_decode_stream_ends_with_an_error_event() {
    within(async {
        let (p, _) = start_recorder(Act::Json(200, P_ANSWER.into())).await;
        let first = r#"data: {"id":"cmpl-x","choices":[{"index":0,"text":" a"}]}"#.to_string() + "\n\n";
        let crash = Arc::new(tokio::sync::Notify::new());
        let (d, _) = start_recorder(Act::SseThenBreak(vec![first.clone()], crash.clone())).await;
        let (proxy, _) = start_proxy(proxy_cfg(vec![p.backend()], vec![d.backend()])).await;
        let client = http_client(Some(Duration::from_secs(2)));
        let req = http::Request::post(proxy.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"prompt":"a","stream":true}"#)))
            .expect("request");
        let resp = client.request(req).await.expect("response");
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["content-type"], "text/event-stream; charset=utf-8");
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while got.len() < first.len() {
            let frame = body.frame().await.expect("a frame").expect("no error");
            got.extend_from_slice(&frame.into_data().expect("data"));
        }
        crash.notify_one();
        got.extend_from_slice(&body.collect().await.expect("rest").to_bytes());
        let text = String::from_utf8(got).expect("utf8");
        assert!(text.starts_with(&first), "{text}");
        let tail = &text[first.len()..];
        assert!(tail.starts_with("\n\ndata: {\"error\": {\"message\": \"decode engine"), "{tail}");
        assert!(
            tail.ends_with(
                "\"type\": \"BadGatewayError\", \"param\": null, \"code\": 502}}\n\ndata: [DONE]\n\n"
            ),
            "{tail}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_and_unknown_routes() {
    within(async {
        let s = stack().await;
        for url in [s.proxy.url("/v1/completions"), s.proxy.url("/v1/chat/completions")] {
            let (status, h, text) = post(&url, &[], "{\"prompt\": ").await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            assert_eq!(h["content-type"], "application/json");
            let v: serde_json::Value = serde_json::from_str(&text).expect("json");
            assert_eq!(v["error"]["type"], "BadRequestError");
            assert_eq!(v["error"]["code"], 400);
            assert!(v["error"]["message"].as_str().expect("msg").starts_with("Invalid JSON body"));
        }
        let (status, _, text) = post(&s.proxy.url("/v1/completions"), &[], "[1,2]").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        for url in [
            s.proxy.url("/v2/nothing"),
            s.proxy.url("/v1/completion"),
            format!("http://127.0.0.1:{}/nope", s.p_state_port()),
        ] {
            let (status, _, text) = send("GET", &url, &[], "").await;
            assert_eq!(status, StatusCode::NOT_FOUND);
            // vLLM 0.33's HTTPException handler: the status phrase is the type.
            assert_eq!(text, r#"{"error":{"message":"Not Found","type":"Not Found","param":null,"code":404}}"#);
        }
        // A JSON body not declared as JSON: 400 like vLLM, at the proxy and at an engine.
        for url in [s.proxy.url("/v1/completions"), format!("http://127.0.0.1:{}/v1/completions", s.d_state_port())]
        {
            let (status, _, text) =
                post(&url, &[("content-type", "text/plain")], r#"{"prompt":"a b","max_tokens":1}"#).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{url}: {text}");
            assert_eq!(
                text,
                r#"{"error":{"message":"Unsupported Media Type: Only 'application/json' is allowed","type":"Bad Request","param":null,"code":400}}"#
            );
        }
        // Engine-side validation errors pass through the proxy with their status.
        let (status, _, text) =
            post(&s.proxy.url("/v1/completions"), &[], r#"{"prompt":"a","model":"other"}"#).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
        assert!(text.contains("The model `other` does not exist."));
        let (status, _, text) = send("GET", &s.proxy.url("/healthcheck"), &[], "").await;
        assert_eq!(
            (status, text.as_str()),
            (StatusCode::OK, r#"{"status":"ok","prefill_instances":1,"decode_instances":1}"#)
        );
        let (status, _, text) = send("GET", &s.proxy.url("/v1/models"), &[], "").await;
        assert_eq!(status, StatusCode::OK);
        assert!(text.contains(r#""id":"stub-model""#));
        let (status, _, text) = send("GET", &s.proxy.url("/health"), &[], "").await;
        assert_eq!((status, text.as_str()), (StatusCode::OK, ""));
        let _ = &s.proxy_state;
    })
    .await;
}

/// Bodies that parse but mean nothing: each is a 400 naming the field (`param`), at the
/// engine and through the proxy, never a 500, a 200 or a silent local prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_fields_are_refused_naming_the_field() {
    within(async {
        let s = stack().await;
        let kv = |field: &str, value: &str| {
            let mut p = serde_json::json!({"do_remote_prefill": true, "remote_block_ids": [[0]],
                "remote_engine_id": "P0", "remote_request_id": "r", "remote_host": "127.0.0.1",
                "remote_port": 5600, "tp_size": 1});
            p[field] = serde_json::from_str(value).expect("value");
            format!(r#"{{"prompt":"a b","max_tokens":1,"kv_transfer_params":{p}}}"#)
        };
        let cases = [
            (
                "/v1/chat/completions",
                r#"{"messages":[{"role":"user","content":5}],"max_tokens":1}"#.to_string(),
                "messages.0.content",
            ),
            (
                "/v1/chat/completions",
                r#"{"messages":[{"role":"wizard","content":"hi"}],"max_tokens":1}"#.to_string(),
                "messages.0.role",
            ),
            ("/v1/completions", kv("tp_size", "0"), "kv_transfer_params.tp_size"),
            ("/v1/completions", kv("remote_block_ids", r#""x""#), "kv_transfer_params.remote_block_ids"),
            ("/v1/completions", kv("remote_port", "70000"), "kv_transfer_params.remote_port"),
        ];
        for (path, body, param) in &cases {
            // The proxy writes kv_transfer_params itself (the client's are replaced).
            let urls = if param.starts_with("kv_") {
                vec![s.d_url(path)]
            } else {
                vec![s.d_url(path), s.proxy.url(path)]
            };
            for url in urls {
                let (status, _, text) = post(&url, &[], body).await;
                assert_eq!(status, StatusCode::BAD_REQUEST, "{url} {body}: {text}");
                let v: serde_json::Value = serde_json::from_str(&text).expect("json");
                assert_eq!(v["error"]["param"], *param, "{url} {body}: {text}");
            }
        }
    })
    .await;
}

/// Request bodies are capped (`--max-body-size`): one over the cap is a JSON 413 naming the
/// flag, at an engine and at the proxy; one under it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_cap_are_refused_with_413() {
    within(async {
        let mut d_cfg = engine_cfg(Role::Decode);
        d_cfg.max_body_bytes = 1024;
        let (d, _d_state) = start_engine(d_cfg).await;
        let (p, _p_state) = start_engine(engine_cfg(Role::Prefill)).await;
        let mut x_cfg = proxy_cfg(vec![p.backend()], vec![d.backend()]);
        x_cfg.max_body_bytes = 1024;
        let (x, _x_state) = start_proxy(x_cfg).await;
        let body = |words: usize| format!(r#"{{"prompt":"{}","max_tokens":1}}"#, "w1 ".repeat(words));
        for url in [d.url("/v1/completions"), x.url("/v1/completions")] {
            let (status, h, text) = post(&url, &[], &body(1000)).await;
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{url}: {text}");
            assert_eq!(h["content-type"], "application/json");
            assert!(text.contains("--max-body-size") && text.contains("1024 bytes"), "{text}");
            let (status, _, text) = post(&url, &[], &body(10)).await;
            assert_eq!(status, StatusCode::OK, "{url}: {text}");
        }
    })
    .await;
}

/// Sends a request on a raw socket and returns it (and what was read) once `read_until`
/// appears in the response; dropping the socket is the client disconnect.
pub(crate) async fn raw_request(
    addr: SocketAddr,
    path: &str,
    body: &str,
    read_until: Option<&str>,
) -> tokio::net::TcpStream {
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("write");
    if let Some(marker) = read_until {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains(marker) {
            let n = sock.read(&mut buf).await.expect("read");
            assert!(n > 0, "connection closed before {marker:?}");
            got.extend_from_slice(&buf[..n]);
        }
    }
    sock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_both_legs() {
    within(async {
        // Prefill takes 100 s: the client leaves during the prefill leg.
        let mut p_cfg = engine_cfg(Role::Prefill);
        p_cfg.prefill_tokens_per_s = 0.02;
        let mut d_cfg = engine_cfg(Role::Decode);
        d_cfg.itl = Duration::from_millis(50);
        let s = stack_with(p_cfg, d_cfg).await;
        let running = "vllm:num_requests_running{model_name=\"stub-model\",engine=\"0\"}";
        let aborted =
            "vllm:request_success_total{model_name=\"stub-model\",engine=\"0\",finished_reason=\"abort\"}";
        let sock =
            raw_request(s.proxy.addr, "/v1/completions", r#"{"prompt":"a b","max_tokens":100}"#, None).await;
        eventually("prefill engine running the request", || {
            metric(&s.p_state.render_metrics(), running) == 1.0
        })
        .await;
        drop(sock);
        eventually("prefill engine aborting it", || metric(&s.p_state.render_metrics(), aborted) == 1.0)
            .await;
        assert_eq!(metric(&s.p_state.render_metrics(), running), 0.0);
        assert_eq!(
            metric(
                &s.p_state.render_metrics(),
                "kvx:kv_aborts_total{backend=\"null\",kv_transfer=\"none\",role=\"prefill\"}"
            ),
            1.0
        );
        assert_eq!(
            metric(
                &s.d_state.render_metrics(),
                "vllm:prompt_tokens_total{model_name=\"stub-model\",engine=\"0\"}"
            ),
            0.0,
            "decode never reached"
        );
        eventually("proxy counting the disconnect", || {
            metric(&s.proxy_state.render_metrics(), "kvx:proxy_client_disconnects_total") == 1.0
        })
        .await;
    })
    .await;

    within(async {
        // Decode streams 100 tokens 50 ms apart: the client leaves after the first one.
        let mut d_cfg = engine_cfg(Role::Decode);
        d_cfg.itl = Duration::from_millis(50);
        let s = stack_with(engine_cfg(Role::Prefill), d_cfg).await;
        let running = "vllm:num_requests_running{model_name=\"stub-model\",engine=\"0\"}";
        let aborted =
            "vllm:request_success_total{model_name=\"stub-model\",engine=\"0\",finished_reason=\"abort\"}";
        let sock = raw_request(
            s.proxy.addr,
            "/v1/completions",
            r#"{"prompt":"a b","max_tokens":100,"stream":true}"#,
            Some("\" t0\""),
        )
        .await;
        assert_eq!(metric(&s.d_state.render_metrics(), running), 1.0);
        drop(sock);
        eventually("decode engine aborting the stream", || {
            metric(&s.d_state.render_metrics(), aborted) == 1.0
        })
        .await;
        let m = s.d_state.render_metrics();
        assert_eq!(metric(&m, running), 0.0);
        assert!(metric(&m, "vllm:generation_tokens_total{model_name=\"stub-model\",engine=\"0\"}") < 100.0);
        assert_eq!(
            metric(&m, "kvx:kv_aborts_total{backend=\"null\",kv_transfer=\"none\",role=\"decode\"}"),
            1.0
        );
        eventually("proxy counting the disconnect", || {
            metric(&s.proxy_state.render_metrics(), "kvx:proxy_client_disconnects_total") == 1.0
        })
        .await;
    })
    .await;
}

/// A `kvx` child process killed on drop.
struct Proc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvx <args>` and reads the bound address from its first stdout line (5 s limit).
fn spawn_kvx(args: &[&str]) -> Proc {
    spawn_kvx_stderr(args, Stdio::null())
}

/// [`spawn_kvx`] with its stderr piped (`child.stderr`).
fn spawn_kvx_with_stderr(args: &[&str]) -> Proc {
    spawn_kvx_stderr(args, Stdio::piped())
}

fn spawn_kvx_stderr(args: &[&str], stderr: Stdio) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(args)
        .env_remove("KVX_LOG")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawn kvx");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let mut proc = Proc { child, addr: SocketAddr::from(([0, 0, 0, 0], 0)) };
    let line = rx.recv_timeout(Duration::from_secs(5)).expect("first stdout line within 5 s");
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    proc.addr = addr.parse().expect("socket address");
    proc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_processes_serve_streaming_completions_through_the_proxy() {
    within(async {
        let p = spawn_kvx(&["serve-engine", "--role", "prefill", "--port", "0", "--model-name", "stub-model", "--engine-id", "P0", "--kv-backend", "null"]);
        let d = spawn_kvx(&["serve-engine", "--role", "decode", "--port", "0", "--model-name", "stub-model", "--itl-ms", "1", "--kv-backend", "null"]);
        let (pp, dp) = (p.addr.port().to_string(), d.addr.port().to_string());
        let x = spawn_kvx(&[
            "serve-proxy", "--port", "0", "--prefiller-host", "127.0.0.1", "--prefiller-port", &pp,
            "--decoder-host", "127.0.0.1", "--decoder-port", &dp, "--policy", "least-loaded",
        ]);
        let body = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#;
        let (status, h, text) = post(&format!("http://{}/v1/completions", x.addr), &[("x-request-id", "0123456789abcdef")], body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(h["content-type"], "text/event-stream; charset=utf-8");
        assert_eq!(normalise(&text), fixture("vllm-0.32-completions-stream.sse"));
        let (_, _, m) = send("GET", &format!("http://{}/metrics", d.addr), &[], "").await;
        assert_eq!(metric(&m, "kvx:kv_loads_total{model_name=\"stub-model\",result=\"ok\"}"), 1.0);
    })
    .await;
}

#[test]
fn proxy_flag_count_mismatch_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvx"))
        .args(["serve-proxy", "--prefiller-hosts", "a", "b", "--prefiller-ports", "8100", "--port", "0"])
        .output()
        .expect("run kvx");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Number of prefiller hosts must match number of prefiller ports"), "{err}");
    assert!(err.contains("--prefiller-hosts/--prefiller-ports"), "{err}");
}

/// Runs `kvx <args>` to completion (hard limit 20 s) and returns (exit code, stdout, stderr).
async fn run_kvx(args: &[String]) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvx")).args(args).kill_on_drop(true).output(),
    )
    .await
    .expect("kvx finished within 20 s")
    .expect("run kvx");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_measures_proxy_and_client_side_pd_baseline_in_one_run() {
    within(async {
        let mut d_cfg = engine_cfg(Role::Decode);
        d_cfg.itl = Duration::from_millis(1);
        let s = stack_with(engine_cfg(Role::Prefill), d_cfg).await;
        let results = tempfile::tempdir().expect("tmp");
        let args: Vec<String> = [
            "load",
            "--url",
            &format!("http://{}", s.proxy.addr),
            "--baseline-url",
            &format!("http://127.0.0.1:{}", s.d_state_port()),
            "--baseline-prefill-url",
            &format!("http://127.0.0.1:{}", s.p_state_port()),
            "--rate",
            "200",
            "--requests",
            "40",
            "--warmup",
            "5",
            "--stream",
            "--max-tokens",
            "4",
            "--endpoint",
            "chat",
            "--prompt-len",
            "8..24",
            "--slo",
            "ttft=10s,tpot=5s,itl=5s",
            "--format",
            "json",
            "--results-dir",
            &results.path().display().to_string(),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        let (code, out, err) = run_kvx(&args).await;
        assert_eq!(code, Some(0), "stderr: {err}");
        assert!(!err.contains("ttft p50"), "no progress bar when stderr is not a terminal: {err}");
        // stdout: the run's summary, as `kvx bench --format json` prints it.
        let sum: serde_json::Value = serde_json::from_str(&out).expect("json summary");
        assert_eq!(sum["schema_version"], 1);
        assert_eq!(sum["scenario"]["model"], "stub-model", "discovered from /v1/models");
        assert_eq!(sum["scenario"]["rate_rps"], 200.0);
        assert_eq!((sum["requests_ok"].as_u64(), sum["requests_failed"].as_u64()), (Some(40), Some(0)));
        for stage in ["ttft", "itl", "tpot", "e2el", "send_lag", "baseline-pd.ttft", "baseline-pd.e2el"] {
            assert!(sum["stages"][stage]["count"].as_u64().is_some_and(|c| c > 0), "{stage}: {sum}");
        }
        assert_eq!(sum["stages"]["itl"]["count"], 120, "3 gaps per 4-token stream");
        let dir = results.path().join(sum["run_id"].as_str().expect("run id"));
        for f in [
            "summary.json",
            "requests.csv",
            "stages.csv",
            "latency.svg",
            "load.json",
            "http_requests.csv",
            "ttft_waterfall.csv",
            "ttft-waterfall.svg",
        ] {
            assert!(dir.join(f).is_file(), "{f} missing");
        }
        // Goodput against generous objectives, and the proxy target's TTFT waterfall.
        assert_eq!(
            (sum["goodput"]["good"].as_u64(), sum["goodput"]["share"].as_f64()),
            (Some(40), Some(1.0)),
            "{sum}"
        );
        assert_eq!(sum["goodput"]["slo_ms"]["itl"], 5000.0);
        assert_eq!(sum["waterfall"]["requests"], 40);
        let stage_p50 = |name: &str| {
            sum["waterfall"]["stages"]
                .as_array()
                .expect("stages")
                .iter()
                .find(|s| s["name"] == name)
                .expect(name)["p50_us"]
                .as_f64()
                .expect("p50")
        };
        assert!(stage_p50("proxy") > 0.0 && stage_p50("first_decode_step") >= 1000.0, "{sum}");
        // A load run moved no KV: `kvx report` leaves the KV figures out.
        let (code, report, err) = run_kvx(&["report".to_string(), dir.display().to_string()]).await;
        assert_eq!(code, Some(0), "{err}");
        for section in ["Latency by stage", "TTFT waterfall", "Goodput", "Outcomes and verification"] {
            assert!(report.contains(section), "{section} missing:\n{report}");
        }
        for unmeasured in ["Throughput, bytes, descriptors", "KV Transfer metrics", "GB/s"] {
            assert!(!report.contains(unmeasured), "{unmeasured} shown for a load run:\n{report}");
        }
        let csv = std::fs::read_to_string(dir.join("http_requests.csv")).expect("csv");
        assert_eq!(csv.lines().count(), 1 + 80, "a line per measured request of both targets");
        // load.json: every target and the overhead.
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("load.json")).expect("load.json")).expect("json");
        assert_eq!(v["schema"], "kvx.load/v1");
        assert_eq!(v["model"], "stub-model");
        let targets = v["targets"].as_array().expect("targets");
        assert_eq!(targets.len(), 2);
        for t in targets {
            assert_eq!((t["requests"].as_u64(), t["ok"].as_u64()), (Some(40), Some(40)), "{t}");
            assert_eq!(t["errors"], serde_json::json!({}));
            assert_eq!(t["output_tokens"], 160);
            assert_eq!(t["itl_ms"]["count"], 120, "3 gaps per 4-token stream");
            assert!(t["ttft_ms"]["p50"].as_f64().expect("ttft") > 0.0);
            // Gaps can bunch on the way (proxy, loaded CPU); their mean cannot shrink much.
            assert!(t["itl_ms"]["mean"].as_f64().expect("itl") >= 0.5, "1 ms ITL engine: {t}");
        }
        assert_eq!(targets[1]["name"], "baseline-pd");
        assert_eq!(v["overhead"][0]["baseline"], "baseline-pd");
        // The engines report their pacing; the client-side pair is split into stages as well.
        assert_eq!(targets[0]["engine_itl_ms"], 1.0);
        assert_eq!(targets[1]["waterfall"]["requests"], 40, "{}", targets[1]);
        assert_eq!(targets[1]["goodput"]["good"], 40);
        // Both paths really loaded KV; nothing fell back to local prefill.
        let m = s.d_state.render_metrics();
        assert_eq!(metric(&m, "kvx:kv_loads_total{model_name=\"stub-model\",result=\"ok\"}"), 90.0);
        assert_eq!(
            metric(&m, "kvx:decode_local_prefill_total{model_name=\"stub-model\",reason=\"missing\"}"),
            0.0
        );

        // A dead target: errors by cause; the run completed with every request failed: exit 1.
        let args: Vec<String> = [
            "load",
            "--url",
            &format!("http://127.0.0.1:{}", closed_port()),
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--model-name",
            "m",
            "--results-dir",
            &results.path().display().to_string(),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        let (code, out, err) = run_kvx(&args).await;
        assert_eq!(code, Some(1), "{out}");
        assert!(out.contains("connect: 4"), "{out}");
        assert!(err.contains("no request to target `url`"), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_without_params_falls_back_like_the_toy_and_is_counted() {
    within(async {
        let (p, _) =
            start_recorder(Act::Json(200, r#"{"id":"cmpl-x","kv_transfer_params":null}"#.into())).await;
        let (d, d_rec) = start_recorder(Act::Json(200, r#"{"ok":true}"#.into())).await;
        let (proxy, pst) = start_proxy(proxy_cfg(vec![p.backend()], vec![d.backend()])).await;
        let client_body = r#"{"prompt": "a b",  "max_tokens": 3, "min_tokens": 1}"#;
        let (status, _, _) = post(&proxy.url("/v1/completions"), &[], client_body).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(d_rec.seen()[0].body, client_body, "decode gets the client's bytes unchanged");
        assert_eq!(metric(&pst.render_metrics(), "kvx:proxy_prefill_without_kv_params_total"), 1.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_api_key_guards_v1_only() {
    within(async {
        let (p, _) = start_recorder(Act::Json(200, P_ANSWER.into())).await;
        let (d, d_rec) = start_recorder(Act::Json(200, "{}".into())).await;
        let mut cfg = proxy_cfg(vec![p.backend()], vec![d.backend()]);
        cfg.api_key = Some("k1".into());
        cfg.backend_api_key = Some("k2".into());
        let (proxy, _) = start_proxy(cfg).await;
        let url = proxy.url("/v1/completions");
        let (status, _, text) = post(&url, &[], r#"{"prompt":"a"}"#).await;
        assert_eq!((status, text.as_str()), (StatusCode::UNAUTHORIZED, r#"{"error":"Unauthorized"}"#));
        let (status, _, _) = post(&url, &[("authorization", "Bearer k2")], r#"{"prompt":"a"}"#).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(d_rec.seen().is_empty());
        let (status, _, _) = post(&url, &[("authorization", "Bearer k1")], r#"{"prompt":"a"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(d_rec.seen()[0].headers["authorization"], "Bearer k2");
        let (status, _, _) = send("GET", &proxy.url("/healthcheck"), &[], "").await;
        assert_eq!(status, StatusCode::OK);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_mark_backends_down_and_up_again() {
    within(async {
        let port = closed_port();
        let (d, _) = start_engine(engine_cfg(Role::Decode)).await;
        let mut cfg = proxy_cfg(vec![BackendAddr { host: "127.0.0.1".into(), port }], vec![d.backend()]);
        cfg.health_interval = Duration::from_millis(20);
        cfg.health_timeout = Duration::from_millis(500);
        let (_proxy, pst) = start_proxy(cfg).await;
        let healthy = format!("kvx:proxy_backend_healthy{{role=\"prefill\",backend=\"127.0.0.1:{port}\"}}");
        eventually("the dead prefill engine marked unhealthy", || {
            metric(&pst.render_metrics(), &healthy) == 0.0
        })
        .await;
        // An engine comes up on that port: the next probes bring it back.
        let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("rebind the freed port");
        let st = EngineState::new(engine_cfg(Role::Prefill), null_kv("late"));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(http_engine::serve(listener, st, shutdown(rx)));
        eventually("the engine marked healthy again", || metric(&pst.render_metrics(), &healthy) == 1.0)
            .await;
        let _ = tx.send(());
        let _ = task.await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_down_answers_503_at_once_without_loading_prefill_and_recovers() {
    within(async {
        let port = closed_port();
        let (p, p_state) = start_engine(engine_cfg(Role::Prefill)).await;
        let mut cfg = proxy_cfg(vec![p.backend()], vec![BackendAddr { host: "127.0.0.1".into(), port }]);
        cfg.health_interval = Duration::from_millis(50);
        cfg.health_timeout = Duration::from_millis(500);
        let (proxy, pst) = start_proxy(cfg).await;
        let healthy = format!("kvx:proxy_backend_healthy{{role=\"decode\",backend=\"127.0.0.1:{port}\"}}");
        eventually("the dead decode engine marked unhealthy", || {
            metric(&pst.render_metrics(), &healthy) == 0.0
        })
        .await;
        // Every request: vLLM's JSON 503 at once; the prefill engine never sees one.
        let prompt_tokens = "vllm:prompt_tokens_total{model_name=\"stub-model\",engine=\"0\"}";
        let mut slowest = Duration::ZERO;
        for _ in 0..50 {
            let t0 = Instant::now();
            let (status, h, text) =
                post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b","max_tokens":2}"#).await;
            slowest = slowest.max(t0.elapsed());
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
            assert_eq!(h["content-type"], "application/json");
            let v: serde_json::Value = serde_json::from_str(&text).expect("json");
            assert_eq!(
                (v["error"]["type"].as_str(), v["error"]["code"].as_u64()),
                (Some("ServiceUnavailableError"), Some(503))
            );
            assert!(
                v["error"]["message"].as_str().expect("msg").contains("no healthy decode engine"),
                "{text}"
            );
        }
        // Generous for a loaded machine; the point is milliseconds, not a lease.
        assert!(slowest < Duration::from_secs(1), "slowest 503 took {slowest:?}");
        assert_eq!(metric(&p_state.render_metrics(), prompt_tokens), 0.0, "prefill never loaded");
        assert_eq!(
            metric(&pst.render_metrics(), "kvx:proxy_no_healthy_backend_total{role=\"decode\"}"),
            50.0
        );

        // A decode engine comes up on that port: within a health interval requests go through.
        let listener = TcpListener::bind(("127.0.0.1", port)).await.expect("rebind the freed port");
        let st = EngineState::new(engine_cfg(Role::Decode), null_kv("late-decode"));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(http_engine::serve(listener, st, shutdown(rx)));
        eventually("the decode engine marked healthy again", || {
            metric(&pst.render_metrics(), &healthy) == 1.0
        })
        .await;
        let (status, _, text) =
            post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b","max_tokens":2}"#).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(metric(&p_state.render_metrics(), prompt_tokens), 2.0);
        let _ = tx.send(());
        let _ = task.await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_leg_aborts_the_prefill_handoff() {
    within(async {
        let (p, p_rec) = start_recorder(Act::Json(200, P_ANSWER.into())).await;
        let err = r#"{"error":{"message":"KV load failed","type":"ServiceUnavailableError","param":null,"code":503}}"#;
        let (d, d_rec) = start_recorder(Act::Json(503, err.into())).await;
        let mut cfg = proxy_cfg(vec![p.backend()], vec![d.backend()]);
        cfg.backend_api_key = Some("sk-test".into());
        let (proxy, pst) = start_proxy(cfg).await;
        let (status, _, text) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert_eq!((status, text.as_str()), (StatusCode::SERVICE_UNAVAILABLE, err));
        assert_eq!(d_rec.seen().len(), 1);
        eventually("the prefill engine told to free the handoff", || p_rec.seen().len() == 2).await;
        let abort = &p_rec.seen()[1];
        assert_eq!(abort.path, "/abort_requests");
        assert_eq!(abort.body, r#"{"request_ids":["cmpl-x-0-abcd1234"]}"#, "P's remote_request_id");
        assert_eq!(abort.headers["authorization"], "Bearer sk-test");
        assert_eq!(abort.headers["content-type"], "application/json");
        assert_eq!(metric(&pst.render_metrics(), "kvx:proxy_prefill_aborts_total"), 1.0);

        // A decode leg that succeeds leaves the handoff alone.
        let (d_ok, _) = start_recorder(Act::Json(200, "{}".into())).await;
        let (proxy, pst) = start_proxy(proxy_cfg(vec![p.backend()], vec![d_ok.backend()])).await;
        let (status, _, _) = post(&proxy.url("/v1/completions"), &[], r#"{"prompt":"a b"}"#).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(metric(&pst.render_metrics(), "kvx:proxy_prefill_aborts_total"), 0.0);
        assert!(p_rec.seen().iter().filter(|s| s.path == "/abort_requests").count() == 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_routes_work_through_the_proxy() {
    within(async {
        let s = stack().await;
        let (status, _, text) =
            post(&s.proxy.url("/tokenize"), &[], r#"{"model":"stub-model","prompt":"w3 w1 w4 w1 w5"}"#).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(text, r#"{"count":5,"max_model_len":8192,"tokens":[3,1,4,1,5],"token_strs":null}"#);
        let (status, _, text) = post(&s.proxy.url("/detokenize"), &[], r#"{"tokens":[3,1,4]}"#).await;
        assert_eq!((status, text.as_str()), (StatusCode::OK, r#"{"prompt":"w3 w1 w4"}"#));
        // The detokenized prompt is as many tokens as ids, as `vllm bench serve` relies on.
        let body = r#"{"messages":[{"role":"user","content":"w3 w1 w4"}],"return_token_strs":true}"#;
        let (status, _, text) = post(&s.proxy.url("/tokenize"), &[], body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(
            text.starts_with(r#"{"count":3,"#) && text.ends_with(r#""token_strs":["w3","w1","w4"]}"#),
            "{text}"
        );
        let (status, _, _) = post(&s.proxy.url("/tokenize"), &[("content-type", "text/plain")], "{}").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    })
    .await;
}

/// Reads a child's stderr lines into a channel.
fn stderr_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (5 s limit) for a stderr line containing `what`, blocking this worker thread (the
/// runtime's other worker keeps serving) on the channel the line arrives on.
fn wait_line(rx: &std::sync::mpsc::Receiver<String>, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    tokio::task::block_in_place(|| {
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains(what) => return line,
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("no stderr line with {what:?} within 5 s")
                }
                Err(e) => panic!("stderr closed before {what:?}: {e}"),
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_router_flags_run_the_same_proxy_and_it_logs_backend_transitions() {
    within(async {
        let p = spawn_kvx(&["serve-engine", "--role", "prefill", "--port", "0", "--model-name", "stub-model", "--kv-backend", "null"]);
        let d = spawn_kvx(&["serve-engine", "--role", "decode", "--port", "0", "--model-name", "stub-model", "--itl-ms", "0", "--kv-backend", "null"]);
        let down = closed_port();
        let (pu, du, downu) = (
            format!("http://127.0.0.1:{}", p.addr.port()),
            format!("http://127.0.0.1:{}", d.addr.port()),
            format!("http://127.0.0.1:{down}"),
        );
        let mut x = spawn_kvx_with_stderr(&[
            "serve-proxy", "--port", "0", "--vllm-pd-disaggregation", "--prefill", &pu, "8998", "--decode", &du,
            "--decode", &downu, "--policy", "round_robin", "--health-check-interval-secs", "0.05",
        ]);
        let log = stderr_lines(&mut x.child);
        let line = wait_line(&log, "backend marked unhealthy");
        assert!(line.contains(&format!("127.0.0.1:{down}")) && line.contains("decode"), "{line}");
        // Every request now goes to the live decode engine, byte-exact.
        for _ in 0..3 {
            let body = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}"#;
            let (status, _, text) =
                post(&format!("http://{}/v1/completions", x.addr), &[("x-request-id", "0123456789abcdef")], body).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            assert_eq!(normalise(&text), fixture("vllm-0.32-completions-stream.sse"));
        }
        // The missing engine comes up: the proxy says so.
        let listener = TcpListener::bind(("127.0.0.1", down)).await.expect("rebind the freed port");
        let st = EngineState::new(engine_cfg(Role::Decode), null_kv("late"));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(http_engine::serve(listener, st, shutdown(rx)));
        let line = wait_line(&log, "backend healthy again");
        assert!(line.contains(&format!("127.0.0.1:{down}")), "{line}");
        let _ = tx.send(());
        let _ = task.await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_says_when_pacing_is_off_and_shows_progress_on_a_terminal() {
    within(async {
        // Engines with --itl-ms 0: every token in one write.
        let s = stack().await;
        let results = tempfile::tempdir().expect("tmp");
        let url = format!("http://{}", s.proxy.addr);
        let dir = results.path().display().to_string();
        let base = [
            "load",
            "--url",
            &url,
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--stream",
            "--results-dir",
            &dir,
        ];
        let args: Vec<String> = base.iter().map(ToString::to_string).collect();
        let (code, out, err) = run_kvx(&args).await;
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("pacing off: the engine sent all tokens at once (--itl-ms 0)"), "{out}");

        // On a terminal (a pty from `script`), a progress bar with the live TTFT p50 is drawn
        // on stderr and cleared at the end. Paced engines make the run last a few redraws.
        let mut d_cfg = engine_cfg(Role::Decode);
        d_cfg.itl = Duration::from_millis(20);
        let s = stack_with(engine_cfg(Role::Prefill), d_cfg).await;
        let url = format!("http://{}", s.proxy.addr);
        let base = [
            "load",
            "--url",
            &url,
            "--concurrency",
            "2",
            "--requests",
            "6",
            "--stream",
            "--results-dir",
            &dir,
        ];
        let kvx = env!("CARGO_BIN_EXE_kvx");
        let cmd = format!("{kvx} {} --format json", base.join(" "));
        let out = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::process::Command::new("script")
                .args(["-qec", &cmd, "/dev/null"])
                .env("COLUMNS", "200")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("finished within 20 s")
        .expect("run kvx load under script (util-linux)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let tty = String::from_utf8_lossy(&out.stdout);
        assert!(tty.contains("requests ok "), "no progress bar on a terminal:\n{tty}");
        assert!(tty.contains("| ttft p50 "), "{tty}");
    })
    .await;
}

/// Polls a metric of a server in another process until `cond` holds (every 20 ms, up to
/// `limit`) and returns how long that took: a value behind an HTTP scrape has no change
/// notification to wait on.
async fn wait_remote_metric(url: &str, name: &str, limit: Duration, cond: impl Fn(f64) -> bool) -> Duration {
    let t0 = Instant::now();
    loop {
        let (_, _, m) = send("GET", url, &[], "").await;
        let v = metric(&m, name);
        if cond(v) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < limit, "{name} is still {v} after {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads until the peer closes (or resets) the connection, for at most `limit`: what was
/// read, or `None` when the connection was still open at the limit.
async fn read_until_closed(sock: &mut tokio::net::TcpStream, limit: Duration) -> Option<String> {
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok()?;
    Some(String::from_utf8_lossy(&got).into_owned())
}

/// `GET path` on a new connection that asks to be closed after the answer; the whole answer
/// (empty when the server closed without one). Fails if the connection is still open after 5 s.
async fn get_closing(addr: SocketAddr, path: &str) -> String {
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    // A server refusing the connection may close it before the request is written.
    let _ = sock.write_all(req.as_bytes()).await;
    read_until_closed(&mut sock, Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("GET {path} on {addr}: connection still open after 5 s"))
}

/// Starts a null-KV decode engine and a proxy in front of it (health checks off, so the proxy
/// opens no connection of its own), both with `extra` flags.
fn engine_and_proxy(extra: &[&str]) -> (Proc, Proc) {
    let d = spawn_kvx(
        &[
            &[
                "serve-engine",
                "--role",
                "decode",
                "--port",
                "0",
                "--model-name",
                "stub-model",
                "--kv-backend",
                "null",
            ],
            extra,
        ]
        .concat(),
    );
    let dp = d.addr.port().to_string();
    let x = spawn_kvx(
        &[
            &["serve-proxy", "--port", "0", "--prefiller-host", "127.0.0.1", "--prefiller-port", &dp][..],
            &["--decoder-host", "127.0.0.1", "--decoder-port", &dp, "--health-interval", "0"],
            extra,
        ]
        .concat(),
    );
    (d, x)
}

/// Issue 47 item 7: a non-streaming client that leaves through the proxy ends the decode
/// engine's generation. A non-streaming decode engine answers only when its generation ends,
/// so the proxy is still waiting for the decode leg's response headers when the client goes:
/// the leg must not outlive the client's connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_disconnect_through_the_proxy_stops_decode() {
    within(async {
        let p = spawn_kvx(&[
            "serve-engine",
            "--role",
            "prefill",
            "--port",
            "0",
            "--model-name",
            "stub-model",
            "--kv-backend",
            "null",
        ]);
        // 1,000 tokens 20 ms apart: 20 s of generation, far past every deadline below.
        let d = spawn_kvx(&[
            "serve-engine",
            "--role",
            "decode",
            "--port",
            "0",
            "--model-name",
            "stub-model",
            "--itl-ms",
            "20",
            "--kv-backend",
            "null",
        ]);
        let (pp, dp) = (p.addr.port().to_string(), d.addr.port().to_string());
        let x = spawn_kvx(&[
            "serve-proxy",
            "--port",
            "0",
            "--prefiller-host",
            "127.0.0.1",
            "--prefiller-port",
            &pp,
            "--decoder-host",
            "127.0.0.1",
            "--decoder-port",
            &dp,
            "--health-interval",
            "0",
        ]);
        let d_metrics = format!("http://{}/metrics", d.addr);
        let running = "vllm:num_requests_running{model_name=\"stub-model\",engine=\"0\"}";
        let aborted =
            "vllm:request_success_total{model_name=\"stub-model\",engine=\"0\",finished_reason=\"abort\"}";
        let body = r#"{"model":"stub-model","prompt":"a b","max_tokens":1000}"#;
        let sock = raw_request(x.addr, "/v1/completions", body, None).await;
        wait_remote_metric(&d_metrics, running, Duration::from_secs(5), |v| v == 1.0).await;
        drop(sock);
        let took = wait_remote_metric(&d_metrics, running, Duration::from_secs(1), |v| v == 0.0).await;
        eprintln!("decode's num_requests_running back to 0 {took:?} after the client left");
        wait_remote_metric(&d_metrics, aborted, Duration::from_secs(1), |v| v == 1.0).await;
        let x_metrics = format!("http://{}/metrics", x.addr);
        wait_remote_metric(&x_metrics, "kvx:proxy_client_disconnects_total", Duration::from_secs(1), |v| {
            v == 1.0
        })
        .await;
    })
    .await;
}

/// Issue 47 item 7: a client that sends part of a request and then nothing is cut off, by the
/// proxy and by an engine: a partial header line within --header-read-timeout, a partial body
/// within --body-read-timeout (answered 408, naming the flag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_partial_requests_are_closed_within_the_read_timeouts() {
    within(async {
        let (d, x) = engine_and_proxy(&["--header-read-timeout", "1s", "--body-read-timeout", "1s"]);
        for (what, addr) in [("proxy", x.addr), ("engine", d.addr)] {
            let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
            sock.write_all(b"GET /health HTTP/1.1\r\nhost: kvx\r\nx-slow: ").await.expect("write");
            let t0 = Instant::now();
            let got = read_until_closed(&mut sock, Duration::from_secs(4))
                .await
                .unwrap_or_else(|| panic!("{what}: a partial header line still open after 4 s"));
            assert!(!got.starts_with("HTTP/1.1 2"), "{what}: {got}");
            eprintln!("{what}: partial header closed after {:?}", t0.elapsed());

            let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let head = "POST /v1/completions HTTP/1.1\r\nhost: kvx\r\ncontent-type: application/json\r\n\
                        content-length: 100\r\n\r\n{\"prompt\":";
            sock.write_all(head.as_bytes()).await.expect("write");
            let t0 = Instant::now();
            let got = read_until_closed(&mut sock, Duration::from_secs(4))
                .await
                .unwrap_or_else(|| panic!("{what}: a partial body still open after 4 s"));
            assert!(got.starts_with("HTTP/1.1 408"), "{what}: {got}");
            assert!(got.contains("--body-read-timeout"), "{what}: {got}");
            eprintln!("{what}: partial body answered 408 and closed after {:?}", t0.elapsed());
        }
    })
    .await;
}

/// Issue 47 item 7: past --max-connections a new connection is answered 503 (or closed) at
/// once, by the proxy and by an engine, and once the held connections go the server answers
/// again. A graceful stop (SIGTERM, exit 0 within 2 s) is not held up by a client stuck in
/// its request headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_refused_until_the_held_ones_go() {
    within(async {
        let (d, x) = engine_and_proxy(&["--max-connections", "8", "--header-read-timeout", "30s"]);
        for (what, addr) in [("proxy", x.addr), ("engine", d.addr)] {
            // Accepted in the order they connected: these 8 fill the cap.
            let mut held = Vec::new();
            for _ in 0..8 {
                held.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
            }
            let answer = get_closing(addr, "/health").await;
            assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 503"), "{what}: {answer}");
            assert!(answer.is_empty() || answer.contains("--max-connections"), "{what}: {answer}");
            drop(held);
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let answer = get_closing(addr, "/health").await;
                if answer.starts_with("HTTP/1.1 200") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{what}: still refused after the held connections went: {answer}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        for (what, mut proc) in [("proxy", x), ("engine", d)] {
            let mut stuck = tokio::net::TcpStream::connect(proc.addr).await.expect("connect");
            stuck.write_all(b"GET /health HTTP/1.1\r\nhost: kvx\r\nx-slow: ").await.expect("write");
            let _ = Command::new("kill").args(["-s", "TERM", &proc.child.id().to_string()]).status();
            let status = tokio::task::block_in_place(|| proc.child.wait_timeout(Duration::from_secs(2)))
                .expect("wait")
                .unwrap_or_else(|| panic!("{what} still running 2 s after SIGTERM"));
            assert!(status.success(), "{what}: {status}");
            drop(stuck);
        }
    })
    .await;
}
