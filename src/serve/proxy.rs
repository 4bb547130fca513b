//! `kvx serve-proxy`: the P/D proxy. Same flags and request rewriting as vLLM's
//! `toy_proxy_server.py` (prefill leg, then the decode leg with P's `kv_transfer_params`),
//! with what the toy lacks: the decode stream keeps its content type, a prefill failure fails
//! fast and never reaches decode, down backends give a JSON 502/503/504 within the timeouts,
//! retries go to another backend only before anything was sent to the client, background
//! health checks, client disconnect cancels both legs, and `/metrics`.
//!
//! # Routing by health
//! A request is sent only when both pools have a backend believed healthy: with no healthy
//! decode engine it is answered with vLLM's JSON 503 at once, without loading a prefill
//! engine whose blocks would then wait for a reader that never comes (and the other way
//! round). A backend is believed down after a failed health probe or a refused connection,
//! and up again after a passing probe (so within one `--health-interval` of its restart);
//! with health checks off, a down backend is tried again after [`RETRY_DOWN_AFTER`]. Both
//! transitions are logged. When the decode leg fails after a prefill handed its KV off, the
//! proxy tells that prefill engine (`POST /abort_requests` with P's `remote_request_id`) so
//! its blocks are freed at once rather than at lease expiry.
//!
//! The proxy passes on the engines' `Server-Timing` entries with its own (`serve::timing`),
//! which is how a client splits its TTFT into stages.
//!
//! Owns routing, retries, health and the HTTP surface of the proxy. Body rewriting lives in
//! `serve::rewrite`; the upstream client in `serve::client`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;

use super::client::{HttpClient, http_client};
use super::conn;
use super::http_engine::{
    OpenAiServer, TokenizerRoute, api_router, authorized, check_json_content_type, error_response,
    unauthorized,
};
use super::metrics::{Counter, Exposition, Gauge, Histogram};
use super::openai::ApiError;
use super::rewrite::{self, RawObject};
use super::timing::{self, ServerTiming};
use crate::config::serve::{BackendAddr, Policy, ProxyConfig};
use crate::config::worker::Dispatch;
use crate::vocab::kinds::Endpoint;

/// With health checks off, how long a backend that refused a connection is left alone before
/// a request tries it again.
pub const RETRY_DOWN_AFTER: Duration = Duration::from_secs(1);

/// Which leg a backend serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegRole {
    Prefill,
    Decode,
}

impl LegRole {
    fn as_str(self) -> &'static str {
        match self {
            LegRole::Prefill => "prefill",
            LegRole::Decode => "decode",
        }
    }
}

/// Why a leg failed, as the `cause` label of `kvx:proxy_backend_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    Connect,
    Timeout,
    Status,
    Protocol,
    Cancelled,
}

const CAUSES: [Cause; 5] = [Cause::Connect, Cause::Timeout, Cause::Status, Cause::Protocol, Cause::Cancelled];

impl Cause {
    fn as_str(self) -> &'static str {
        match self {
            Cause::Connect => "connect",
            Cause::Timeout => "timeout",
            Cause::Status => "http_status",
            Cause::Protocol => "protocol",
            Cause::Cancelled => "client_disconnect",
        }
    }
}

/// One engine behind the proxy, with its health and counters.
#[derive(Debug)]
struct Backend {
    role: LegRole,
    label: String,
    authority: http::uri::Authority,
    healthy: AtomicBool,
    /// When it was marked down (for the retry without health checks).
    down_since: std::sync::Mutex<Option<Instant>>,
    in_flight: Gauge,
    requests: Counter,
    latency: Histogram,
    errors: [Counter; CAUSES.len()],
    /// Prefill backends in push mode: the identity a decode leg needs, from its last answer
    /// (`--dispatch concurrent` sends both legs at once once it is known).
    identity: std::sync::Mutex<Option<String>>,
}

impl Backend {
    fn new(role: LegRole, addr: &BackendAddr) -> Result<Self, ApiError> {
        let label = if addr.host.contains(':') {
            format!("[{}]:{}", addr.host, addr.port)
        } else {
            format!("{}:{}", addr.host, addr.port)
        };
        let authority = label
            .parse()
            .map_err(|e| ApiError::new(500, format!("invalid {} address {label}: {e}", role.as_str())))?;
        Ok(Self {
            role,
            label,
            authority,
            healthy: AtomicBool::new(true),
            down_since: std::sync::Mutex::new(None),
            in_flight: Gauge::default(),
            requests: Counter::default(),
            latency: Histogram::latency(),
            errors: Default::default(),
            identity: std::sync::Mutex::new(None),
        })
    }

    fn error(&self, c: Cause) {
        self.errors[c as usize].inc();
    }

    /// The push identity this prefill engine's last push answer gave (`rewrite::push_identity`).
    fn identity(&self) -> Option<String> {
        self.identity.lock().ok().and_then(|g| g.clone())
    }

    /// Keeps (or, for a pull answer, drops) the identity of a prefill answer.
    fn learn_identity(&self, id: Option<String>) {
        if let Ok(mut g) = self.identity.lock() {
            *g = id;
        }
    }

    fn uri(&self, path: &'static str) -> Uri {
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .unwrap_or_default()
    }

    fn set_healthy(&self, up: bool, why: &str) {
        let was = self.healthy.swap(up, Ordering::Relaxed);
        if let Ok(mut d) = self.down_since.lock() {
            *d = if up { None } else { d.or_else(|| Some(Instant::now())) };
        }
        if was != up {
            if up {
                tracing::info!(
                    backend = %self.label,
                    role = self.role.as_str(),
                    "backend healthy again: routing requests to it"
                );
            } else {
                tracing::warn!(
                    backend = %self.label,
                    role = self.role.as_str(),
                    reason = why,
                    "backend marked unhealthy: no requests go to it until it recovers"
                );
            }
        }
    }

    /// Whether a request may go to it: believed healthy, or (health checks off) down for
    /// longer than [`RETRY_DOWN_AFTER`], so a backend that came back is found again.
    fn usable(&self, checks_on: bool) -> bool {
        if self.healthy.load(Ordering::Relaxed) {
            return true;
        }
        !checks_on
            && self.down_since.lock().ok().and_then(|d| *d).is_none_or(|t| t.elapsed() >= RETRY_DOWN_AFTER)
    }
}

/// Decrements a backend's in-flight count when the leg ends (including by cancellation).
struct InFlightGuard(Arc<Backend>);

impl InFlightGuard {
    fn new(b: &Arc<Backend>) -> Self {
        b.in_flight.inc();
        b.requests.inc();
        Self(b.clone())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

#[derive(Debug)]
struct Pool {
    backends: Vec<Arc<Backend>>,
    cursor: AtomicUsize,
}

impl Pool {
    fn new(role: LegRole, addrs: &[BackendAddr]) -> Result<Self, ApiError> {
        let backends = addrs.iter().map(|a| Backend::new(role, a).map(Arc::new)).collect::<Result<_, _>>()?;
        Ok(Self { backends, cursor: AtomicUsize::new(0) })
    }

    /// Next usable backend not in `tried`, by policy; `None` when there is none (the caller
    /// answers 503 rather than send a request to a backend believed down).
    fn pick(&self, policy: Policy, tried: &[usize], checks_on: bool) -> Option<usize> {
        use rand::RngExt as _;
        let n = self.backends.len();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let order = (0..n).map(|k| (start + k) % n);
        let usable = |i: &usize| !tried.contains(i) && self.backends[*i].usable(checks_on);
        let load = |i: &usize| self.backends[*i].in_flight.get();
        match policy {
            Policy::RoundRobin => order.clone().find(usable),
            Policy::LeastLoaded => order.filter(usable).min_by_key(load),
            Policy::Random | Policy::PowerOfTwo => {
                let candidates: Vec<usize> = order.filter(usable).collect();
                if candidates.is_empty() {
                    return None;
                }
                let mut rng = rand::rng();
                let a = candidates[rng.random_range(0..candidates.len())];
                if policy == Policy::Random || candidates.len() == 1 {
                    return Some(a);
                }
                let b = candidates[rng.random_range(0..candidates.len())];
                Some(if load(&b) < load(&a) { b } else { a })
            }
        }
    }

    fn healthy_count(&self) -> usize {
        self.backends.iter().filter(|b| b.healthy.load(Ordering::Relaxed)).count()
    }

    fn any_usable(&self, checks_on: bool) -> bool {
        self.backends.iter().any(|b| b.usable(checks_on))
    }
}

#[derive(Debug)]
struct ProxyMetrics {
    ok: Counter,
    client_errors: Counter,
    server_errors: Counter,
    retries: Counter,
    missing_kv_params: Counter,
    client_disconnects: Counter,
    /// Requests answered 503 at once because a pool had no healthy backend, by pool.
    no_healthy: [Counter; 2],
    /// Prefill handoffs the proxy aborted on the prefill engine (decode leg failed).
    prefill_aborts: Counter,
    /// Decode legs the proxy asked their engine to abort (client gone before the answer).
    decode_aborts: Counter,
    /// Requests whose two legs were sent at once (`--dispatch concurrent`, push mode).
    concurrent_dispatches: Counter,
    /// From the client's request to the decode response headers.
    time_to_headers: Histogram,
}

/// Shared state of one proxy.
#[derive(Debug)]
pub struct ProxyState {
    cfg: ProxyConfig,
    prefill: Pool,
    decode: Pool,
    client: HttpClient,
    backend_auth: Option<HeaderValue>,
    metrics: ProxyMetrics,
}

impl ProxyState {
    pub fn new(cfg: ProxyConfig) -> Result<Arc<Self>, ApiError> {
        let backend_auth = match &cfg.backend_api_key {
            Some(k) => Some(HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                ApiError::new(500, "--backend-api-key contains characters not allowed in a header")
            })?),
            None => None,
        };
        Ok(Arc::new(Self {
            prefill: Pool::new(LegRole::Prefill, &cfg.prefill)?,
            decode: Pool::new(LegRole::Decode, &cfg.decode)?,
            client: http_client(Some(cfg.connect_timeout)),
            backend_auth,
            metrics: ProxyMetrics {
                ok: Counter::default(),
                client_errors: Counter::default(),
                server_errors: Counter::default(),
                retries: Counter::default(),
                missing_kv_params: Counter::default(),
                client_disconnects: Counter::default(),
                no_healthy: Default::default(),
                prefill_aborts: Counter::default(),
                decode_aborts: Counter::default(),
                concurrent_dispatches: Counter::default(),
                time_to_headers: Histogram::latency(),
            },
            cfg,
        }))
    }

    fn pool(&self, role: LegRole) -> &Pool {
        match role {
            LegRole::Prefill => &self.prefill,
            LegRole::Decode => &self.decode,
        }
    }

    fn policy(&self, role: LegRole) -> Policy {
        match role {
            LegRole::Prefill => self.cfg.policy,
            LegRole::Decode => self.cfg.decode_policy.unwrap_or(self.cfg.policy),
        }
    }

    fn checks_on(&self) -> bool {
        !self.cfg.health_interval.is_zero()
    }

    fn count_status(&self, s: StatusCode) {
        if s.is_success() {
            self.metrics.ok.inc();
        } else if s.is_client_error() {
            self.metrics.client_errors.inc();
        } else {
            self.metrics.server_errors.inc();
        }
    }

    /// Renders `/metrics`.
    pub fn render_metrics(&self) -> String {
        let mut e = Exposition::new();
        self.render_into(&mut e);
        e.finish()
    }

    /// Adds the proxy's families to `e`.
    pub fn render_into(&self, e: &mut Exposition) {
        let m = &self.metrics;
        let help = "Client requests answered by the proxy, by status class.";
        e.counter("kvx:proxy_requests_total", help, &[("code", "2xx")], m.ok.get());
        e.counter("kvx:proxy_requests_total", help, &[("code", "4xx")], m.client_errors.get());
        e.counter("kvx:proxy_requests_total", help, &[("code", "5xx")], m.server_errors.get());
        e.counter(
            "kvx:proxy_retries_total",
            "Legs retried on another backend before any byte reached the client.",
            &[],
            m.retries.get(),
        );
        e.counter(
            "kvx:proxy_prefill_without_kv_params_total",
            "Prefill answers without kv_transfer_params: decode prefilled locally (silent fallback).",
            &[],
            m.missing_kv_params.get(),
        );
        e.counter(
            "kvx:proxy_concurrent_dispatches_total",
            "Requests whose prefill and decode legs were sent at once (--dispatch concurrent, push mode).",
            &[],
            m.concurrent_dispatches.get(),
        );
        e.counter(
            "kvx:proxy_client_disconnects_total",
            "Requests whose client went away before the end.",
            &[],
            m.client_disconnects.get(),
        );
        for (i, role) in [LegRole::Prefill, LegRole::Decode].into_iter().enumerate() {
            e.counter(
                "kvx:proxy_no_healthy_backend_total",
                "Requests answered 503 at once because no backend of a pool was healthy.",
                &[("role", role.as_str())],
                m.no_healthy[i].get(),
            );
        }
        e.counter(
            "kvx:proxy_prefill_aborts_total",
            "Prefill legs aborted on the prefill engine (POST /abort_requests): the decode leg failed or the client left first.",
            &[],
            m.prefill_aborts.get(),
        );
        e.counter(
            "kvx:proxy_decode_aborts_total",
            "Decode legs the proxy asked their engine to abort (POST /abort_requests with the leg's X-Request-Id): the client left before the decode engine answered.",
            &[],
            m.decode_aborts.get(),
        );
        e.histogram(
            "kvx:proxy_time_to_headers_seconds",
            "From the client's request to the decode engine's response headers (prefill leg included).",
            &[],
            &m.time_to_headers.snapshot(),
        );
        let all: Vec<&Arc<Backend>> = self.prefill.backends.iter().chain(&self.decode.backends).collect();
        for b in &all {
            let l = [("role", b.role.as_str()), ("backend", b.label.as_str())];
            e.gauge(
                "kvx:proxy_backend_healthy",
                "1 if the backend passed its last health check.",
                &l,
                f64::from(u8::from(b.healthy.load(Ordering::Relaxed))),
            );
        }
        for b in &all {
            let l = [("role", b.role.as_str()), ("backend", b.label.as_str())];
            e.gauge(
                "kvx:proxy_backend_in_flight",
                "Legs in flight to the backend.",
                &l,
                b.in_flight.get() as f64,
            );
        }
        for b in &all {
            let l = [("role", b.role.as_str()), ("backend", b.label.as_str())];
            e.counter(
                "kvx:proxy_backend_requests_total",
                "Legs sent to the backend (attempts).",
                &l,
                b.requests.get(),
            );
        }
        for b in &all {
            for c in CAUSES {
                let l = [("role", b.role.as_str()), ("backend", b.label.as_str()), ("cause", c.as_str())];
                e.counter(
                    "kvx:proxy_backend_errors_total",
                    "Failed legs by cause.",
                    &l,
                    b.errors[c as usize].get(),
                );
            }
        }
        for b in &all {
            let l = [("role", b.role.as_str()), ("backend", b.label.as_str())];
            e.histogram(
                "kvx:proxy_backend_latency_seconds",
                "Prefill: full response; decode: until response headers.",
                &l,
                &b.latency.snapshot(),
            );
        }
    }
}

/// The proxy's routes: the ones it shares with the engine ([`api_router`]) and the toy
/// proxy's `/healthcheck`. Pure; health checks run only under [`serve`].
pub fn router(state: Arc<ProxyState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    api_router(state, limit, Router::new().route("/healthcheck", get(healthcheck)))
}

/// Runs the proxy on `listener` (with background health checks), within its configured
/// [`ConnLimits`], until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<ProxyState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let checker = (!state.cfg.health_interval.is_zero()).then(|| tokio::spawn(health_loop(state.clone())));
    let limits = state.cfg.conn;
    let r = conn::serve(listener, router(state), limits, shutdown).await;
    if let Some(h) = checker {
        h.abort();
    }
    r
}

async fn health_loop(st: Arc<ProxyState>) {
    let mut tick = tokio::time::interval(st.cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let all = st.prefill.backends.iter().chain(&st.decode.backends);
        futures::future::join_all(all.map(|b| probe(&st, b))).await;
    }
}

async fn probe(st: &ProxyState, b: &Arc<Backend>) {
    let req = Request::get(b.uri("/health")).body(Full::new(Bytes::new()));
    let Ok(req) = req else { return };
    match tokio::time::timeout(st.cfg.health_timeout, st.client.request(req)).await {
        Ok(Ok(resp)) if resp.status().is_success() => {
            let _ = resp.into_body().collect().await;
            b.set_healthy(true, "");
        }
        Ok(Ok(resp)) => b.set_healthy(false, &format!("GET /health answered {}", resp.status())),
        Ok(Err(e)) => b.set_healthy(false, &format!("GET /health failed: {e}")),
        Err(_) => b.set_healthy(false, "GET /health timed out"),
    }
}

async fn healthcheck(State(st): State<Arc<ProxyState>>) -> Response {
    #[derive(serde::Serialize)]
    struct Toy {
        status: &'static str,
        prefill_instances: usize,
        decode_instances: usize,
    }
    axum::Json(Toy {
        status: "ok",
        prefill_instances: st.prefill.backends.len(),
        decode_instances: st.decode.backends.len(),
    })
    .into_response()
}

impl OpenAiServer for ProxyState {
    async fn generate(self: Arc<Self>, ep: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        proxy_request(self, ep, headers, body).await
    }

    /// `/tokenize` and `/detokenize` go to a decode engine (`vllm bench serve` aligns prompt
    /// lengths with them through whatever URL it was given).
    async fn tokenizer(self: Arc<Self>, route: TokenizerRoute, headers: HeaderMap, body: Bytes) -> Response {
        forward_json(&self, &headers, route.path(), body).await
    }

    async fn models(self: Arc<Self>, headers: HeaderMap) -> Response {
        if !authorized(self.cfg.api_key.as_deref(), &headers) {
            return unauthorized();
        }
        forward(&self, Method::GET, "/v1/models", Bytes::new()).await
    }

    fn health(&self) -> Response {
        let (p, d) = (self.prefill.healthy_count(), self.decode.healthy_count());
        if p > 0 && d > 0 {
            StatusCode::OK.into_response()
        } else {
            error_response(&ApiError::new(
                503,
                format!("no healthy backend: {p} healthy prefill engine(s), {d} healthy decode engine(s)"),
            ))
        }
    }

    fn metrics_text(&self) -> String {
        self.render_metrics()
    }
}

async fn forward_json(st: &ProxyState, headers: &HeaderMap, path: &'static str, body: Bytes) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), headers) {
        return unauthorized();
    }
    if let Err(e) = check_json_content_type(headers) {
        return error_response(&e);
    }
    forward(st, Method::POST, path, body).await
}

/// Sends one request to a decode engine and passes its answer back whole.
async fn forward(st: &ProxyState, method: Method, path: &'static str, body: Bytes) -> Response {
    let leg = match send_leg(st, LegRole::Decode, method, path, body, Route::default()).await {
        Ok(l) => l,
        Err(e) => return error_response(&e),
    };
    let status = leg.resp.status();
    let ct = leg.resp.headers().get(header::CONTENT_TYPE).cloned();
    match tokio::time::timeout(st.cfg.request_timeout, leg.resp.into_body().collect()).await {
        Ok(Ok(b)) => {
            let mut r = (status, b.to_bytes()).into_response();
            if let Some(ct) = ct {
                r.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            r
        }
        _ => error_response(&ApiError::new(
            502,
            format!("decode engine {} failed to send {path}", leg.backend.label),
        )),
    }
}

/// A leg that got response headers back.
struct Leg {
    backend: Arc<Backend>,
    resp: http::Response<Incoming>,
    guard: InFlightGuard,
    sent_at: Instant,
}

/// Where a leg goes and what it carries besides its body.
#[derive(Default, Clone, Copy)]
struct Route<'a> {
    /// Sent as the leg's X-Request-Id.
    x_request_id: Option<&'a HeaderValue>,
    /// The one backend of the pool to use (no retry elsewhere).
    only: Option<usize>,
    /// Told which backend the leg went to, before it is sent.
    sent_to: Option<&'a BackendSlot>,
}

impl<'a> Route<'a> {
    fn tagged(x_request_id: &'a HeaderValue) -> Self {
        Route { x_request_id: Some(x_request_id), ..Route::default() }
    }
}

/// Sends one leg, trying other healthy backends of the pool only while nothing could have
/// reached the engine (connect failures) or the engine refused with 503.
async fn send_leg(
    st: &ProxyState,
    role: LegRole,
    method: Method,
    path: &'static str,
    body: Bytes,
    route: Route<'_>,
) -> Result<Leg, ApiError> {
    let Route { x_request_id, only, sent_to } = route;
    let pool = st.pool(role);
    let mut tried: Vec<usize> = Vec::new();
    let mut last_err: Option<ApiError> = None;
    loop {
        // `only`: the one backend a concurrent dispatch named to the other leg; no retry
        // elsewhere (the other leg waits on this engine).
        let pick = match only {
            Some(i) if tried.is_empty() && i < pool.backends.len() => Some(i),
            Some(_) => None,
            None => pool.pick(st.policy(role), &tried, st.checks_on()),
        };
        let Some(i) = pick else {
            return Err(last_err.unwrap_or_else(|| no_healthy(st, role)));
        };
        if !tried.is_empty() {
            st.metrics.retries.inc();
        }
        tried.push(i);
        let b = &pool.backends[i];
        let mut req = Request::builder().method(method.clone()).uri(b.uri(path));
        if !body.is_empty() {
            req = req.header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        if let Some(id) = x_request_id {
            req = req.header("x-request-id", id.clone());
        }
        if let Some(auth) = &st.backend_auth {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        let req = req
            .body(Full::new(body.clone()))
            .map_err(|e| ApiError::new(500, format!("building the {} request: {e}", role.as_str())))?;
        let guard = InFlightGuard::new(b);
        if let Some(slot) = sent_to {
            slot.set(b);
        }
        let sent_at = Instant::now();
        match tokio::time::timeout(st.cfg.request_timeout, st.client.request(req)).await {
            Ok(Ok(resp))
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE && tried.len() < pool.backends.len() =>
            {
                b.error(Cause::Status);
                last_err =
                    Some(ApiError::new(503, format!("{} engine {} answered 503", role.as_str(), b.label)));
            }
            Ok(Ok(resp)) => return Ok(Leg { backend: b.clone(), resp, guard, sent_at }),
            Ok(Err(e)) if e.is_connect() => {
                b.error(Cause::Connect);
                b.set_healthy(false, "connect failed");
                last_err = Some(ApiError::new(
                    503,
                    format!("cannot reach {} engine {}: {}", role.as_str(), b.label, error_chain(&e)),
                ));
            }
            Ok(Err(e)) => {
                b.error(Cause::Protocol);
                return Err(ApiError::new(
                    502,
                    format!("{} engine {} failed: {}", role.as_str(), b.label, error_chain(&e)),
                ));
            }
            Err(_) => {
                b.error(Cause::Timeout);
                return Err(ApiError::new(
                    504,
                    format!(
                        "{} engine {} sent no response within {:.1} s (--request-timeout)",
                        role.as_str(),
                        b.label,
                        st.cfg.request_timeout.as_secs_f64()
                    ),
                ));
            }
        }
    }
}

/// vLLM's JSON 503 for a pool with no healthy backend.
fn no_healthy(st: &ProxyState, role: LegRole) -> ApiError {
    let pool = st.pool(role);
    ApiError::new(
        503,
        format!(
            "no healthy {} engine: all {} configured are down or failing their health checks",
            role.as_str(),
            pool.backends.len()
        ),
    )
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The prefill backend a leg went to, shared with the guard that cleans up after a client
/// that left.
#[derive(Default)]
struct BackendSlot(std::sync::Mutex<Option<Arc<Backend>>>);

impl BackendSlot {
    fn set(&self, b: &Arc<Backend>) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(b.clone());
    }

    fn take(&self) -> Option<Arc<Backend>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    fn get(&self) -> Option<Arc<Backend>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

/// Marks a request as abandoned by its client if dropped before `done`. While the prefill
/// leg is out (or answered, before the decode leg took over), a client that leaves gets its
/// prefill aborted on that engine by the X-Request-Id the leg carried: the engine frees
/// blocks it already held, or refuses to hold them when its fill ends.
struct DisconnectWatch<'a> {
    st: &'a Arc<ProxyState>,
    done: bool,
    x_request_id: HeaderValue,
    prefill: BackendSlot,
}

impl Drop for DisconnectWatch<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.st.metrics.client_disconnects.inc();
        if let (Some(b), Ok(id)) = (self.prefill.take(), self.x_request_id.to_str()) {
            abort_prefill(self.st, &b, id.to_string());
        }
    }
}

async fn proxy_request(st: Arc<ProxyState>, ep: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let resp = proxy_inner(&st, ep, &headers, &body, started).await;
    st.count_status(resp.status());
    resp
}

async fn proxy_inner(
    st: &Arc<ProxyState>,
    ep: Endpoint,
    headers: &HeaderMap,
    body: &Bytes,
    started: Instant,
) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), headers) {
        return unauthorized();
    }
    if let Err(e) = check_json_content_type(headers) {
        return error_response(&e);
    }
    let client = match RawObject::parse(body) {
        Ok(o) => o,
        Err(e) => return error_response(&ApiError::bad_request(e.0, None)),
    };
    // Neither leg is sent unless both pools can take it: a prefill whose decode leg cannot
    // happen would only hold KV blocks for nobody.
    let checks_on = st.checks_on();
    for (i, role) in [LegRole::Prefill, LegRole::Decode].into_iter().enumerate() {
        if !st.pool(role).any_usable(checks_on) {
            st.metrics.no_healthy[i].inc();
            return error_response(&no_healthy(st, role));
        }
    }
    let x_request_id = headers.get("x-request-id").filter(|v| !v.is_empty()).cloned().unwrap_or_else(|| {
        HeaderValue::from_str(&uuid::Uuid::new_v4().to_string()).unwrap_or(HeaderValue::from_static("kvx"))
    });
    let mut watch = DisconnectWatch {
        st,
        done: false,
        x_request_id: x_request_id.clone(),
        prefill: BackendSlot::default(),
    };

    // Concurrent dispatch (push): both legs at once, to a prefill engine whose identity an
    // earlier push answer gave; decode registers its blocks while prefill computes.
    let concurrent = (st.cfg.dispatch == Dispatch::Concurrent)
        .then(|| st.pool(LegRole::Prefill).pick(st.policy(LegRole::Prefill), &[], checks_on))
        .flatten()
        .and_then(|i| st.pool(LegRole::Prefill).backends[i].identity().map(|id| (i, id)));
    let (p, d) = match concurrent {
        Some((i, identity)) => {
            st.metrics.concurrent_dispatches.inc();
            let d_body = Bytes::from(rewrite::decode_body(&client, body, Some(&identity)));
            let p_fut = prefill_leg(st, ep, &client, &x_request_id, Some(i), &watch.prefill);
            let d_fut =
                send_leg(st, LegRole::Decode, Method::POST, ep.path(), d_body, Route::tagged(&x_request_id));
            tokio::pin!(p_fut, d_fut);
            let mut early_d = None;
            let p = loop {
                tokio::select! {
                    p = &mut p_fut => break p,
                    d = &mut d_fut, if early_d.is_none() => early_d = Some(d),
                }
            };
            match p {
                Ok(p) => {
                    let d = match early_d {
                        Some(d) => d,
                        None => d_fut.await,
                    };
                    watch.prefill.take();
                    let handoff = p.params.as_deref().and_then(remote_request_id);
                    settle_decode(st, &d, &p.backend, handoff, false);
                    (p, d)
                }
                // The decode leg is dropped with its future: its engine sees the client go.
                Err(resp) => {
                    watch.done = true;
                    return resp;
                }
            }
        }
        None => {
            let p = match prefill_leg(st, ep, &client, &x_request_id, None, &watch.prefill).await {
                Ok(p) => p,
                Err(resp) => {
                    watch.done = true;
                    return resp;
                }
            };
            // Decode leg: original body plus P's params verbatim, streamed back as it arrives.
            // P now holds blocks for the decode engine. The leg runs on its own task, so a
            // client that leaves cannot strand them: a decode engine that answers has loaded
            // the KV (and its notifications freed P's blocks; the answer is then dropped,
            // which ends its stream), and one that fails or refuses gets P told to free them
            // now. (Aborting P while the decode engine reads would pull blocks from under
            // its reads, and dropping the leg before the engine took it would leave them to
            // P's lease.) A client that leaves before the answer gets the leg aborted on its
            // engine instead (`AbandonedDecode`): a non-streaming answer comes only at the end
            // of the generation, which must not run on for nobody.
            let d_body = Bytes::from(rewrite::decode_body(&client, body, p.params.as_deref()));
            let handoff = p.params.as_deref().and_then(remote_request_id);
            let leg = Arc::new(DecodeLeg::default());
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (task_st, task_leg, p_backend, xid) =
                (st.clone(), leg.clone(), p.backend.clone(), x_request_id.clone());
            tokio::spawn(async move {
                let route = Route { sent_to: Some(&task_leg.sent_to), ..Route::tagged(&xid) };
                let d = send_leg(&task_st, LegRole::Decode, Method::POST, ep.path(), d_body, route).await;
                task_leg.answered.store(true, Ordering::Release);
                settle_decode(&task_st, &d, &p_backend, handoff, tx.is_closed());
                let _ = tx.send(d);
            });
            watch.prefill.take();
            let abandoned = AbandonedDecode { st, leg, x_request_id: x_request_id.clone() };
            let d = rx
                .await
                .unwrap_or_else(|_| Err(ApiError::new(500, "the decode leg's task ended without an answer")));
            drop(abandoned);
            (p, d)
        }
    };
    let mut server_timing = p.server_timing;
    let d = match d {
        Ok(l) => l,
        Err(e) => {
            watch.done = true;
            return error_response(&e);
        }
    };
    st.metrics.time_to_headers.observe(started.elapsed());
    watch.done = true;
    let (parts, incoming) = d.resp.into_parts();
    server_timing.extend_from(&parts.headers);
    server_timing.push(timing::PROXY_TOTAL, started.elapsed());
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));
    let body = PassBody {
        inner: incoming,
        _guard: d.guard,
        backend: d.backend,
        st: st.clone(),
        sse,
        state: PassState::Streaming,
    };
    let mut resp = Response::new(Body::new(body));
    *resp.status_mut() = parts.status;
    let ct = parts
        .headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    resp.headers_mut().insert("x-request-id", x_request_id);
    if let Some(h) = server_timing.header() {
        resp.headers_mut().insert(timing::SERVER_TIMING, h);
    }
    resp
}

/// Books the decode leg's answer on its backend and, when it failed or refused (no decode
/// engine will read the handoff), tells the prefill engine to free its blocks now. A leg
/// whose client left (`client_left`) and that failed was most likely aborted for it: it is
/// booked as a cancellation, not as the engine's error.
fn settle_decode(
    st: &Arc<ProxyState>,
    d: &Result<Leg, ApiError>,
    p_backend: &Arc<Backend>,
    handoff: Option<String>,
    client_left: bool,
) {
    let failed = match d {
        Ok(l) => {
            l.backend.latency.observe(l.sent_at.elapsed());
            let ok = l.resp.status().is_success();
            if !ok {
                l.backend.error(if client_left { Cause::Cancelled } else { Cause::Status });
            }
            !ok
        }
        Err(_) => true,
    };
    if failed && let Some(rid) = handoff {
        abort_prefill(st, p_backend, rid);
    }
}

/// What the prefill leg answered: its backend, its `kv_transfer_params` (raw JSON, if any)
/// and its Server-Timing stages.
struct PrefillAnswer {
    backend: Arc<Backend>,
    params: Option<String>,
    server_timing: ServerTiming,
}

/// The prefill leg (to backend `only` when given): fails fast on anything but a 2xx, with the
/// response the client gets. A push answer's identity is kept on its backend for concurrent
/// dispatch.
async fn prefill_leg(
    st: &Arc<ProxyState>,
    ep: Endpoint,
    client: &RawObject<'_>,
    x_request_id: &HeaderValue,
    only: Option<usize>,
    sent_to: &BackendSlot,
) -> Result<PrefillAnswer, Response> {
    let p_body = Bytes::from(rewrite::prefill_body(client));
    let route = Route { only, sent_to: Some(sent_to), ..Route::tagged(x_request_id) };
    let p = send_leg(st, LegRole::Prefill, Method::POST, ep.path(), p_body, route)
        .await
        .map_err(|e| error_response(&e))?;
    let p_status = p.resp.status();
    let mut server_timing = ServerTiming::new();
    server_timing.extend_from(p.resp.headers());
    let left = st.cfg.request_timeout.saturating_sub(p.sent_at.elapsed());
    let p_bytes = match tokio::time::timeout(left, p.resp.into_body().collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            p.backend.error(Cause::Protocol);
            return Err(error_response(&ApiError::new(
                502,
                format!("prefill engine {} broke off its response: {}", p.backend.label, error_chain(&e)),
            )));
        }
        Err(_) => {
            p.backend.error(Cause::Timeout);
            return Err(error_response(&ApiError::new(
                504,
                format!("prefill engine {} did not finish within --request-timeout", p.backend.label),
            )));
        }
    };
    p.backend.latency.observe(p.sent_at.elapsed());
    drop(p.guard);
    if !p_status.is_success() {
        p.backend.error(Cause::Status);
        return Err(prefill_failure(&p.backend.label, p_status, &p_bytes));
    }
    let p_obj = match RawObject::parse(&p_bytes) {
        Ok(o) => o,
        Err(e) => {
            p.backend.error(Cause::Protocol);
            return Err(error_response(&ApiError::new(
                502,
                format!(
                    "prefill engine {} answered {p_status} with a body that is not a JSON object: {}",
                    p.backend.label, e.0
                ),
            )));
        }
    };
    let params = p_obj.get("kv_transfer_params").filter(|raw| rewrite::is_truthy(raw)).map(str::to_string);
    match &params {
        None => {
            st.metrics.missing_kv_params.inc();
            tracing::warn!(
                backend = %p.backend.label,
                "prefill answered without kv_transfer_params; the decode engine will prefill locally"
            );
        }
        Some(raw) => p.backend.learn_identity(rewrite::push_identity(raw)),
    }
    Ok(PrefillAnswer { backend: p.backend, params, server_timing })
}

/// P's request id in its `kv_transfer_params` (raw JSON), the id its blocks are held under.
fn remote_request_id(raw: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct P {
        remote_request_id: Option<String>,
    }
    serde_json::from_str::<P>(raw).ok()?.remote_request_id.filter(|s| !s.is_empty())
}

/// Tells a prefill engine that no decode engine will read the blocks it holds for `rid`
/// (`POST /abort_requests`), in the background: the client's answer does not wait for it.
fn abort_prefill(st: &Arc<ProxyState>, backend: &Arc<Backend>, rid: String) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
    let (st, backend) = (st.clone(), backend.clone());
    st.metrics.prefill_aborts.inc();
    rt.spawn(async move {
        match post_abort(&st, &backend, &rid).await {
            Ok(()) => tracing::debug!(backend = %backend.label, request_id = %rid, "prefill handoff aborted"),
            Err(why) => tracing::warn!(
                backend = %backend.label,
                request_id = %rid,
                "cannot abort a prefill handoff ({why}); its blocks go at lease expiry"
            ),
        }
    });
}

/// Sends `POST /abort_requests {"request_ids": [id]}` to `backend`; why it failed, if it did.
async fn post_abort(st: &ProxyState, backend: &Backend, id: &str) -> Result<(), String> {
    let body = serde_json::json!({ "request_ids": [id] }).to_string();
    let mut req = Request::post(backend.uri("/abort_requests"))
        .header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(auth) = &st.backend_auth {
        req = req.header(header::AUTHORIZATION, auth.clone());
    }
    let req = req.body(Full::new(Bytes::from(body))).map_err(|e| e.to_string())?;
    match tokio::time::timeout(st.cfg.health_timeout, st.client.request(req)).await {
        Ok(Ok(resp)) if resp.status().is_success() => {
            let _ = resp.into_body().collect().await;
            Ok(())
        }
        Ok(Ok(resp)) => Err(format!("it answered {}", resp.status())),
        Ok(Err(e)) => Err(error_chain(&e)),
        Err(_) => Err("no answer within --health-timeout".into()),
    }
}

/// How often the proxy tells a decode engine again to abort a leg whose client left, while
/// the leg's answer has not come: the abort can overtake the leg on its way to the engine
/// (which then does not know the id yet). It stops as soon as the leg answers.
const DECODE_ABORT_RETRY: Duration = Duration::from_millis(100);

/// How many times at most (one second's worth): an engine that knows the id by then has had
/// it, and one that ignores aborts by X-Request-Id is not asked for ever.
const DECODE_ABORT_TRIES: u32 = 10;

/// A decode leg running on its own task: which backend it went to, and whether it answered.
#[derive(Default)]
struct DecodeLeg {
    sent_to: BackendSlot,
    answered: AtomicBool,
}

/// Dropped with the request's handler: if the client left before the decode leg answered,
/// asks the leg's engine to abort it by the X-Request-Id it carries (kvx's engines end it where
/// that is safe, after a KV load in progress; one still waiting for admission answers at once,
/// and its failure gets P told to free the handoff). The leg's task waits for that answer.
struct AbandonedDecode<'a> {
    st: &'a Arc<ProxyState>,
    leg: Arc<DecodeLeg>,
    x_request_id: HeaderValue,
}

impl Drop for AbandonedDecode<'_> {
    fn drop(&mut self) {
        if self.leg.answered.load(Ordering::Acquire) {
            return;
        }
        let (Ok(rt), Ok(id)) = (tokio::runtime::Handle::try_current(), self.x_request_id.to_str()) else {
            return;
        };
        let (st, leg, id) = (self.st.clone(), self.leg.clone(), id.to_string());
        st.metrics.decode_aborts.inc();
        rt.spawn(async move {
            for _ in 0..DECODE_ABORT_TRIES {
                if leg.answered.load(Ordering::Acquire) {
                    return;
                }
                // None: the leg's task has not picked its engine yet.
                if let Some(backend) = leg.sent_to.get()
                    && let Err(why) = post_abort(&st, &backend, &id).await
                {
                    tracing::debug!(backend = %backend.label, request_id = %id, "cannot abort a decode leg: {why}");
                }
                tokio::time::sleep(DECODE_ABORT_RETRY).await;
            }
        });
    }
}

/// Answers a failed prefill: the engine's own JSON error (status kept) when it sent one,
/// else a 502 naming the engine.
fn prefill_failure(label: &str, status: StatusCode, body: &[u8]) -> Response {
    let is_error_json = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .is_some_and(|v| v.get("error").is_some() || v.get("message").is_some());
    if is_error_json {
        let mut r = (status, Bytes::copy_from_slice(body)).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        return r;
    }
    let snippet: String = String::from_utf8_lossy(body).chars().take(200).collect();
    error_response(&ApiError::new(502, format!("prefill engine {label} answered {status}: {snippet}")))
}

enum PassState {
    Streaming,
    Done,
}

/// The decode engine's body on its way to the client. Dropping it (client gone) drops the
/// upstream body, which closes that connection, so the decode engine sees the disconnect and
/// aborts. A stream that breaks mid-way ends with vLLM's in-stream error event and `[DONE]`.
struct PassBody {
    inner: Incoming,
    _guard: InFlightGuard,
    backend: Arc<Backend>,
    st: Arc<ProxyState>,
    sse: bool,
    state: PassState,
}

impl http_body::Body for PassBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        match std::mem::replace(&mut this.state, PassState::Done) {
            PassState::Done => Poll::Ready(None),
            PassState::Streaming => match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => {
                    this.state = PassState::Streaming;
                    Poll::Pending
                }
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Ready(Some(Ok(f))) => {
                    this.state = PassState::Streaming;
                    Poll::Ready(Some(Ok(f)))
                }
                Poll::Ready(Some(Err(e))) => {
                    this.backend.error(Cause::Protocol);
                    if this.sse {
                        let err = ApiError::new(
                            502,
                            format!(
                                "decode engine {} broke off the stream: {}",
                                this.backend.label,
                                error_chain(&e)
                            ),
                        );
                        // A partial event may be pending on the client side: end it first.
                        let mut tail = b"\n\n".to_vec();
                        tail.extend_from_slice(&err.sse_event());
                        Poll::Ready(Some(Ok(Frame::data(Bytes::from(tail)))))
                    } else {
                        Poll::Ready(Some(Err(e)))
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self.state {
            PassState::Streaming => self.inner.is_end_stream(),
            PassState::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            PassState::Streaming => self.inner.size_hint(),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for PassBody {
    fn drop(&mut self) {
        if matches!(self.state, PassState::Streaming) && !self.inner.is_end_stream() {
            self.backend.error(Cause::Cancelled);
            self.st.metrics.client_disconnects.inc();
        }
    }
}
