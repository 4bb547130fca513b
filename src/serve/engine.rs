//! `kvx serve-engine`: a vLLM-shaped OpenAI-compatible engine (prefill or decode role) with
//! no model behind it. Prefill time comes from a cost model, tokens are synthetic and emitted
//! at a fixed inter-token latency, and the KV side is whatever [`KvBackend`] it is given.
//!
//! Owns the engine's HTTP surface (`router`), request lifecycle (admission, prefill/load,
//! generation, abort on disconnect) and its `/metrics`. Must not know how KV moves: all of
//! that is behind the backend. Wire shapes come from `serve::openai`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::kv::{KvBackend, KvIntent, KvTransferParams, LoadJob, PrefillJob};
use super::metrics::{Counter, Exposition, Gauge, Histogram, PROMETHEUS_CONTENT_TYPE};
use super::openai::{
    self, ApiError, Endpoint, FinishReason, GenRequest, ResponseCtx, SSE_CONTENT_TYPE, Usage,
};

/// Which half of a P/D pair this engine plays (the pipeline's role of its workers).
pub use crate::pipeline::proto::Role;

/// Validated engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub role: Role,
    /// Served model id (`--model-name`); requests naming another model get a 404.
    pub model_name: String,
    pub max_model_len: u64,
    pub block_size_tokens: u32,
    pub tp_size: u32,
    /// Simulated prefill throughput; `0` means prefill is instant.
    pub prefill_tokens_per_s: f64,
    /// Time between generated tokens; the first token follows prefill/load directly.
    pub itl: Duration,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>` (vLLM's `--api-key`).
    pub api_key: Option<String>,
    /// Requests generating at once (vLLM's `--max-num-seqs`); the rest wait.
    pub max_num_seqs: usize,
    /// The synthetic model samples EOS as this token (see `openai::plan_generation`).
    pub eos_at: Option<u64>,
}

impl EngineConfig {
    /// Defaults suited to tests: instant prefill, no ITL, NullKv-friendly sizes.
    pub fn new(role: Role, model_name: impl Into<String>) -> Self {
        Self {
            role,
            model_name: model_name.into(),
            max_model_len: 8192,
            block_size_tokens: 16,
            tp_size: 1,
            prefill_tokens_per_s: 0.0,
            itl: Duration::ZERO,
            api_key: None,
            max_num_seqs: 256,
            eos_at: None,
        }
    }

    fn prefill_time(&self, tokens: u64) -> Duration {
        if self.prefill_tokens_per_s > 0.0 {
            Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        }
    }
}

/// Engine counters behind `/metrics`.
#[derive(Debug)]
struct EngineMetrics {
    running: Gauge,
    waiting: Gauge,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    success_length: Counter,
    success_stop: Counter,
    aborted: Counter,
    errors: Counter,
    ttft: Histogram,
    e2e: Histogram,
    kv_handoffs: Counter,
    kv_loads: Counter,
    kv_load_failures: Counter,
    kv_load_seconds: Histogram,
    fallback_missing: Counter,
    fallback_incomplete: Counter,
    fallback_wrong_direction: Counter,
}

impl EngineMetrics {
    fn new() -> Self {
        Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            success_length: Counter::default(),
            success_stop: Counter::default(),
            aborted: Counter::default(),
            errors: Counter::default(),
            ttft: Histogram::latency(),
            e2e: Histogram::latency(),
            kv_handoffs: Counter::default(),
            kv_loads: Counter::default(),
            kv_load_failures: Counter::default(),
            kv_load_seconds: Histogram::latency(),
            fallback_missing: Counter::default(),
            fallback_incomplete: Counter::default(),
            fallback_wrong_direction: Counter::default(),
        }
    }
}

/// Shared state of one engine.
pub struct EngineState {
    cfg: EngineConfig,
    backend: Arc<dyn KvBackend>,
    seqs: Arc<Semaphore>,
    metrics: EngineMetrics,
    system_fingerprint: String,
    started_unix_s: u64,
}

impl std::fmt::Debug for EngineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineState").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

fn unix_now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl EngineState {
    pub fn new(cfg: EngineConfig, backend: Arc<dyn KvBackend>) -> Arc<Self> {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(
            format!("{}|{}|{}|{}", cfg.model_name, cfg.tp_size, cfg.block_size_tokens, cfg.max_model_len)
                .as_bytes(),
        );
        let system_fingerprint =
            format!("kvx-{}-tp{}-{}", env!("CARGO_PKG_VERSION"), cfg.tp_size, &hex::encode(digest)[..8]);
        Arc::new(Self {
            seqs: Arc::new(Semaphore::new(cfg.max_num_seqs.max(1))),
            cfg,
            backend,
            metrics: EngineMetrics::new(),
            system_fingerprint,
            started_unix_s: unix_now_s(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Renders `/metrics`: vLLM's names for request-level metrics, `kvx:` for KV transfer.
    pub fn render_metrics(&self) -> String {
        let m = &self.metrics;
        let model = [("model_name", self.cfg.model_name.as_str())];
        let mut e = Exposition::new();
        e.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &model,
            m.running.get() as f64,
        );
        e.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &model,
            m.waiting.get() as f64,
        );
        e.counter(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            &model,
            m.prompt_tokens.get(),
        );
        e.counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            &model,
            m.generation_tokens.get(),
        );
        let help = "Count of successfully processed requests.";
        let name = "vllm:request_success_total";
        e.counter(name, help, &[model[0], ("finished_reason", "length")], m.success_length.get());
        e.counter(name, help, &[model[0], ("finished_reason", "stop")], m.success_stop.get());
        e.counter(name, help, &[model[0], ("finished_reason", "abort")], m.aborted.get());
        e.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &model,
            &m.ttft.snapshot(),
        );
        e.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &model,
            &m.e2e.snapshot(),
        );
        e.counter(
            "kvx:request_errors_total",
            "Requests answered with an error status.",
            &model,
            m.errors.get(),
        );

        let b = self.backend.metrics();
        let role = self.cfg.role.as_str();
        let bl = [("backend", b.backend), ("kv_transfer", b.kv_transfer), ("role", role)];
        e.gauge(
            "kvx:kv_backend_info",
            "KV backend of this engine; kv_transfer=\"none\" means no KV moves (NullKv).",
            &bl,
            1.0,
        );
        e.counter(
            "kvx:kv_prefill_handoffs_total",
            "Prefill requests whose KV was held for a decode engine.",
            &model,
            m.kv_handoffs.get(),
        );
        e.counter(
            "kvx:kv_loads_total",
            "Decode requests that loaded KV from a prefill engine.",
            &[model[0], ("result", "ok")],
            m.kv_loads.get(),
        );
        e.counter(
            "kvx:kv_loads_total",
            "Decode requests that loaded KV from a prefill engine.",
            &[model[0], ("result", "error")],
            m.kv_load_failures.get(),
        );
        e.histogram(
            "kvx:kv_load_seconds",
            "Wall time of the backend load per request (handshake, reads, verify).",
            &model,
            &m.kv_load_seconds.snapshot(),
        );
        let help = "Decode requests that arrived without usable kv_transfer_params and were prefilled locally (the silent-fallback trap).";
        let name = "kvx:decode_local_prefill_total";
        e.counter(name, help, &[model[0], ("reason", "missing")], m.fallback_missing.get());
        e.counter(name, help, &[model[0], ("reason", "incomplete")], m.fallback_incomplete.get());
        e.counter(name, help, &[model[0], ("reason", "do_remote_decode")], m.fallback_wrong_direction.get());
        e.histogram(
            "kvx:kv_transfer_seconds",
            "Wall time of each successful backend load (queue, handshake, reads, notify, verify).",
            &bl,
            &b.load_seconds,
        );
        for (stage, h) in &b.stage_seconds {
            e.histogram(
                "kvx:kv_stage_seconds",
                "Per-request time of one KV stage, slowest rank (decode: queue..verify; prefill: fill).",
                &[bl[0], bl[1], bl[2], ("stage", stage)],
                h,
            );
        }
        e.counter(
            "kvx:kv_prefills_total",
            "Prefills whose blocks the backend filled and held.",
            &bl,
            b.prefills,
        );
        e.counter(
            "kvx:kv_prefill_failures_total",
            "Prefills the backend could not fill and hold.",
            &bl,
            b.prefill_failures,
        );
        e.counter(
            "kvx:kv_backend_loads_total",
            "Loads the backend finished.",
            &[bl[0], bl[1], bl[2], ("result", "ok")],
            b.loads_ok,
        );
        e.counter(
            "kvx:kv_backend_loads_total",
            "Loads the backend finished.",
            &[bl[0], bl[1], bl[2], ("result", "error")],
            b.loads_failed,
        );
        for (cause, n) in &b.load_failures {
            e.counter(
                "kvx:kv_load_failures_total",
                "Failed loads by cause (handshake, incompatible, transfer, timeout, peer_gone, verify, notify).",
                &[bl[0], bl[1], bl[2], ("cause", cause)],
                *n,
            );
        }
        e.counter("kvx:kv_blocks_read_total", "KV blocks read by this engine.", &bl, b.blocks_read);
        e.counter("kvx:kv_bytes_read_total", "KV bytes read by this engine.", &bl, b.bytes_read);
        e.counter(
            "kvx:kv_bytes_verified_total",
            "KV bytes read and checked against the pattern the prefill engine wrote.",
            &bl,
            b.bytes_verified,
        );
        e.counter(
            "kvx:kv_verify_failures_total",
            "Decode ranks whose read bytes differed from what the prefill engine wrote.",
            &bl,
            b.verify_failures,
        );
        e.counter(
            "kvx:kv_handshakes_total",
            "Side-channel handshakes with prefill engines (per decode rank).",
            &bl,
            b.handshakes,
        );
        e.gauge(
            "kvx:kv_blocks_held",
            "KV blocks held for decode engines to read (prefill role).",
            &bl,
            b.blocks_held as f64,
        );
        e.gauge(
            "kvx:kv_blocks_in_use",
            "KV blocks allocated from this engine's pool.",
            &bl,
            b.blocks_in_use as f64,
        );
        e.gauge("kvx:kv_backlog", "Requests waiting for free KV blocks.", &bl, b.backlog as f64);
        e.counter(
            "kvx:kv_leases_expired_total",
            "Held blocks released because no decode engine read them in time (per rank).",
            &bl,
            b.leases_expired,
        );
        e.counter("kvx:kv_aborts_total", "Requests the backend was told to abort.", &bl, b.aborts);
        e.finish()
    }
}

/// The engine's routes. Pure: no sockets, testable with `tower::ServiceExt::oneshot`.
pub fn router(state: Arc<EngineState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Token-id prompts of long contexts exceed axum's 2 MiB default.
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains open requests.
/// Sets `TCP_NODELAY` on every connection: SSE chunks must not wait for Nagle.
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}

/// Runs the engine on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<EngineState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_router(listener, router(state), shutdown).await
}

/// Turns an [`ApiError`] into vLLM's JSON error response.
pub fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], e.body()).into_response()
}

async fn not_found() -> Response {
    error_response(&ApiError::new(404, "Not Found"))
}

async fn method_not_allowed() -> Response {
    error_response(&ApiError::new(405, "Method Not Allowed"))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn metrics(State(st): State<Arc<EngineState>>) -> Response {
    ([(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)], st.render_metrics()).into_response()
}

/// Whether `Authorization: Bearer <key>` matches, as vLLM's auth middleware checks it.
pub fn authorized(expected: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(key) = expected else { return true };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|v| v == key)
}

/// vLLM's answer to a missing or wrong API key.
pub fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        r#"{"error":"Unauthorized"}"#,
    )
        .into_response()
}

async fn models(State(st): State<Arc<EngineState>>, headers: HeaderMap) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), &headers) {
        return unauthorized();
    }
    let m = st.cfg.model_name.as_str();
    let t = st.started_unix_s;
    let perm_id = format!("modelperm-{}", uuid::Uuid::new_v4().simple());
    let list = ModelList {
        object: "list",
        data: [ModelCard {
            id: m,
            object: "model",
            created: t,
            owned_by: "kvx",
            root: m,
            parent: (),
            max_model_len: st.cfg.max_model_len,
            permission: [ModelPermission {
                id: &perm_id,
                object: "model_permission",
                created: t,
                allow_create_engine: false,
                allow_sampling: true,
                allow_logprobs: true,
                allow_search_indices: false,
                allow_view: true,
                allow_fine_tuning: false,
                organization: "*",
                group: (),
                is_blocking: false,
            }],
        }],
    };
    axum::Json(list).into_response()
}

/// `/v1/models` in vLLM's field order.
#[derive(serde::Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: [ModelCard<'a>; 1],
}

#[derive(serde::Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: (),
    max_model_len: u64,
    permission: [ModelPermission<'a>; 1],
}

#[derive(serde::Serialize)]
struct ModelPermission<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    allow_create_engine: bool,
    allow_sampling: bool,
    allow_logprobs: bool,
    allow_search_indices: bool,
    allow_view: bool,
    allow_fine_tuning: bool,
    organization: &'static str,
    group: (),
    is_blocking: bool,
}

async fn completions(State(st): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(st, Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(st): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(st, Endpoint::Chat, headers, body).await
}

/// Counts a gauge up for as long as it lives.
struct GaugeGuard<'a>(&'a Gauge);

impl<'a> GaugeGuard<'a> {
    fn new(g: &'a Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Holds one running sequence: the admission permit and the `num_requests_running` count.
/// If it is dropped before [`finish`](Self::finish) (client gone: the handler future or the
/// response stream was dropped), the request is aborted and the backend told.
struct InFlight {
    st: Arc<EngineState>,
    internal_id: String,
    _permit: OwnedSemaphorePermit,
    started: Instant,
    finished: bool,
}

impl InFlight {
    fn finish(mut self, finish: FinishReason) {
        self.finished = true;
        let m = &self.st.metrics;
        match finish {
            FinishReason::Length => m.success_length.inc(),
            FinishReason::Stop => m.success_stop.inc(),
        }
        m.e2e.observe(self.started.elapsed());
    }

    /// Ends the request with an error already reported to the client.
    fn fail(mut self) {
        self.finished = true;
        self.st.metrics.errors.inc();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.st.metrics.running.dec();
        if !self.finished {
            self.st.metrics.aborted.inc();
            self.st.backend.abort(&self.internal_id);
            tracing::debug!(request_id = %self.internal_id, "client went away; request aborted");
        }
    }
}

/// Sleeps until `t` (no-op if it has passed).
async fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        tokio::time::sleep(t - now).await;
    }
}

async fn generate(st: Arc<EngineState>, ep: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), &headers) {
        return unauthorized();
    }
    let req = match openai::parse_request(ep, &body, st.cfg.max_model_len) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.errors.inc();
            return error_response(&e);
        }
    };
    if let Some(m) = &req.model
        && m != &st.cfg.model_name
    {
        st.metrics.errors.inc();
        return error_response(
            &ApiError::new(404, format!("The model `{m}` does not exist.")).with_param("model"),
        );
    }
    let x_request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.body_request_id.clone())
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let id = format!("{}{}", ep.id_prefix(), x_request_id);
    // vLLM 0.32+ makes the engine-internal id unique with 8 random hex chars, so D cannot
    // derive P's id from the shared header: P's `remote_request_id` must be forwarded.
    let rand8 = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let internal_id = match ep {
        Endpoint::Completions => format!("{id}-0-{rand8}"),
        Endpoint::Chat => format!("{id}-{rand8}"),
    };

    let started = Instant::now();
    let permit = {
        let _waiting = GaugeGuard::new(&st.metrics.waiting);
        match st.seqs.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) => return error_response(&ApiError::new(503, "engine is shutting down")),
        }
    };
    st.metrics.running.inc();
    let inflight = InFlight { st: st.clone(), internal_id, _permit: permit, started, finished: false };
    st.metrics.prompt_tokens.add(req.prompt_tokens);

    let kv_out = match kv_phase(&st, &req, &x_request_id, &inflight.internal_id).await {
        Ok(p) => p,
        Err(e) => {
            inflight.fail();
            return error_response(&e);
        }
    };
    let first_token_at = Instant::now();
    st.metrics.ttft.observe(first_token_at - started);

    let (n, finish) = openai::plan_generation(&req, st.cfg.eos_at);
    let created = unix_now_s();
    if !req.stream {
        if n > 1 && !st.cfg.itl.is_zero() {
            sleep_until(first_token_at + st.cfg.itl * u32::try_from(n - 1).unwrap_or(u32::MAX)).await;
        }
        let mut text = String::with_capacity(n as usize * 6);
        for k in 0..n {
            openai::token_text(k, n, finish, &mut text);
        }
        let ctx = ResponseCtx {
            id: &id,
            created,
            model: &st.cfg.model_name,
            system_fingerprint: &st.system_fingerprint,
        };
        let usage = Usage::new(req.prompt_tokens, n);
        let body = match ep {
            Endpoint::Completions => openai::completion_body(&ctx, &text, finish, usage, kv_out.as_ref()),
            Endpoint::Chat => openai::chat_body(&ctx, &text, finish, usage, kv_out.as_ref()),
        };
        st.metrics.generation_tokens.add(n);
        inflight.finish(finish);
        return ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body)
            .into_response();
    }

    let stream = TokenStream {
        st: st.clone(),
        req,
        id,
        created,
        n,
        finish,
        next: 0,
        next_due: first_token_at,
        ended: false,
        inflight: Some(inflight),
    };
    let body = Body::from_stream(futures::stream::unfold(stream, TokenStream::step));
    ([(header::CONTENT_TYPE, HeaderValue::from_static(SSE_CONTENT_TYPE))], body).into_response()
}

/// Everything before the first token: prefill (simulated), or the KV load from P.
/// Returns the `kv_transfer_params` to answer with (prefill role handing off to D).
async fn kv_phase(
    st: &EngineState,
    req: &GenRequest,
    x_request_id: &str,
    internal_id: &str,
) -> Result<Option<KvTransferParams>, ApiError> {
    let m = &st.metrics;
    let cfg = &st.cfg;
    // A zero sleep is not free: tokio rounds timers up to its 1 ms tick.
    let local_prefill = || sleep_until(Instant::now() + cfg.prefill_time(req.prompt_tokens));
    match (cfg.role, &req.kv) {
        (Role::Prefill, KvIntent::RemoteDecode) => {
            local_prefill().await;
            let job = PrefillJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
            };
            let params = st
                .backend
                .prefill(job)
                .await
                .map_err(|e| ApiError::new(e.http_status(), format!("KV prefill handoff failed: {e}")))?;
            m.kv_handoffs.inc();
            Ok(Some(params))
        }
        (Role::Prefill, intent) => {
            if !matches!(intent, KvIntent::None) {
                tracing::warn!(
                    ?intent,
                    "prefill engine got decode-side kv_transfer_params; prefilling locally"
                );
            }
            local_prefill().await;
            Ok(None)
        }
        (Role::Decode, KvIntent::RemotePrefill(params)) => {
            let job = LoadJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
                params: (**params).clone(),
            };
            let t0 = Instant::now();
            match st.backend.load(job).await {
                Ok(_) => {
                    m.kv_load_seconds.observe(t0.elapsed());
                    m.kv_loads.inc();
                    Ok(None)
                }
                Err(e) => {
                    m.kv_load_failures.inc();
                    // vLLM's default kv_load_failure_policy is "fail".
                    Err(ApiError::new(e.http_status(), format!("KV load failed: {e}")))
                }
            }
        }
        (Role::Decode, intent) => {
            let counter = match intent {
                KvIntent::Incomplete { reason } => {
                    tracing::warn!(%reason, "decode engine got incomplete kv_transfer_params; prefilling locally");
                    &m.fallback_incomplete
                }
                KvIntent::RemoteDecode => &m.fallback_wrong_direction,
                _ => &m.fallback_missing,
            };
            counter.inc();
            local_prefill().await;
            Ok(None)
        }
    }
}

/// The SSE body of one streaming request, as an `unfold` state machine. Dropping it (the
/// client went away) drops the [`InFlight`] and so aborts the request.
struct TokenStream {
    st: Arc<EngineState>,
    req: GenRequest,
    id: String,
    created: u64,
    n: u64,
    finish: FinishReason,
    next: u64,
    /// When the next token is due. Tokens follow a fixed ITL grid, so timer rounding (tokio
    /// sleeps in 1 ms ticks) does not bias the mean ITL; after a stall longer than one ITL
    /// the grid restarts from now, so late tokens are not bunched to catch up (a slow
    /// decode step delays the ones after it).
    next_due: Instant,
    ended: bool,
    inflight: Option<InFlight>,
}

/// Upper bound of one body frame when several tokens are already due (ITL 0): coalescing
/// them saves syscalls without delaying any token.
const MAX_FRAME_BYTES: usize = 64 << 10;

impl TokenStream {
    async fn step(mut self) -> Option<(Result<Bytes, std::convert::Infallible>, Self)> {
        if self.ended {
            return None;
        }
        let due = self.next_due;
        sleep_until(due).await;
        let emitted_at = Instant::now();
        let mut out = Vec::with_capacity(512);
        let st = self.st.clone();
        let ctx = ResponseCtx {
            id: &self.id,
            created: self.created,
            model: &st.cfg.model_name,
            system_fingerprint: &st.system_fingerprint,
        };
        let mut text = String::new();
        let start = self.next;
        loop {
            let k = self.next;
            let usage = self.req.continuous_usage.then(|| Usage::new(self.req.prompt_tokens, k + 1));
            if k == 0 && self.req.endpoint == Endpoint::Chat {
                let u = self.req.continuous_usage.then(|| Usage::new(self.req.prompt_tokens, 0));
                openai::push_chat_role_chunk(&mut out, &ctx, u);
            }
            text.clear();
            openai::token_text(k, self.n, self.finish, &mut text);
            let last = k + 1 == self.n;
            let finish = last.then_some(self.finish);
            let fingerprint = last && !self.req.include_usage;
            match self.req.endpoint {
                Endpoint::Completions => {
                    openai::push_completion_chunk(&mut out, &ctx, &text, finish, usage, fingerprint)
                }
                Endpoint::Chat => openai::push_chat_chunk(&mut out, &ctx, &text, finish, usage, fingerprint),
            }
            self.next += 1;
            if last {
                if self.req.include_usage {
                    let u = Usage::new(self.req.prompt_tokens, self.n);
                    openai::push_usage_chunk(&mut out, &ctx, self.req.endpoint, u);
                }
                out.extend_from_slice(openai::DONE);
                self.ended = true;
                break;
            }
            let itl = self.st.cfg.itl;
            self.next_due = if emitted_at > due + itl { emitted_at + itl } else { due + itl };
            if out.len() >= MAX_FRAME_BYTES || !self.st.cfg.itl.is_zero() {
                break;
            }
        }
        st.metrics.generation_tokens.add(self.next - start);
        if self.ended
            && let Some(f) = self.inflight.take()
        {
            f.finish(self.finish);
        }
        Some((Ok(Bytes::from(out)), self))
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::serve::kv::{EngineIdentity, NullKv};

    fn engine(role: Role) -> Arc<EngineState> {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "P0".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 1,
        });
        EngineState::new(EngineConfig::new(role, "m"), Arc::new(kv))
    }

    async fn call(
        st: &Arc<EngineState>,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, HeaderMap, String) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("x-request-id", "abc")
            .body(Body::from(body.to_string()))
            .expect("request");
        let resp = router(st.clone()).oneshot(req).await.expect("infallible");
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.expect("body").to_bytes();
        (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).expect("utf8"))
    }

    #[tokio::test]
    async fn prefill_role_hands_off_with_kv_params() {
        let st = engine(Role::Prefill);
        let body = r#"{"model":"m","prompt":"a b c d e f g h i j k l m n o p q","max_tokens":1,"stream":false,
            "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}"#;
        let (status, _, text) = call(&st, "POST", "/v1/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["id"], "cmpl-abc");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let kv = &v["kv_transfer_params"];
        assert_eq!(kv["remote_block_ids"], serde_json::json!([[0, 1]]));
        assert_eq!(kv["remote_num_tokens"], 17);
        let rid = kv["remote_request_id"].as_str().expect("id");
        assert!(rid.starts_with("cmpl-abc-0-") && rid.len() == "cmpl-abc-0-".len() + 8, "{rid}");
        assert!(st.render_metrics().contains("kvx:kv_prefill_handoffs_total{model_name=\"m\"} 1"));
    }

    #[tokio::test]
    async fn decode_without_params_counts_the_silent_fallback() {
        let st = engine(Role::Decode);
        let (status, _, _) = call(&st, "POST", "/v1/completions", r#"{"prompt":"x y","max_tokens":3}"#).await;
        assert_eq!(status, StatusCode::OK);
        let m = st.render_metrics();
        assert!(m.contains("kvx:decode_local_prefill_total{model_name=\"m\",reason=\"missing\"} 1"), "{m}");
        assert!(m.contains("vllm:generation_tokens_total{model_name=\"m\"} 3"), "{m}");
        assert!(
            m.contains("kvx:kv_backend_info{backend=\"null\",kv_transfer=\"none\",role=\"decode\"} 1"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn routes_and_errors() {
        let st = engine(Role::Decode);
        let (s, _, body) = call(&st, "GET", "/health", "").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, ""));
        let (s, _, body) = call(&st, "GET", "/nope", "").await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(
            body,
            r#"{"error":{"message":"Not Found","type":"NotFoundError","param":null,"code":404}}"#
        );
        let (s, _, body) = call(&st, "POST", "/v1/completions", "{not json").await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        let (s, _, body) = call(&st, "POST", "/v1/completions", r#"{"model":"other","prompt":"a"}"#).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(body.contains("The model `other` does not exist."));
        let (s, h, body) = call(&st, "GET", "/v1/models", "").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "application/json");
        assert!(
            body.starts_with(r#"{"object":"list","data":[{"id":"m","object":"model","created":"#),
            "{body}"
        );
    }

    #[tokio::test]
    async fn streaming_chat_with_continuous_usage() {
        let st = engine(Role::Decode);
        let body = r#"{"messages":[{"role":"user","content":"hi you"}],"max_completion_tokens":2,"stream":true,
            "stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#;
        let (s, h, text) = call(&st, "POST", "/v1/chat/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], SSE_CONTENT_TYPE);
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 5, "{text}");
        assert!(events[0].contains(r#""usage":{"prompt_tokens":2,"total_tokens":2,"completion_tokens":0},"prompt_token_ids":null"#), "{}", events[0]);
        assert!(
            events[1].contains(
                r#""token_ids":null}],"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}"#
            ),
            "{}",
            events[1]
        );
        assert!(
            events[3].contains(
                r#""choices":[],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}"#
            )
        );
        assert_eq!(events[4], "data: [DONE]");
    }

    #[tokio::test]
    async fn api_key_is_enforced_on_v1_only() {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "e".into(),
            side_channel_host: "h".into(),
            side_channel_port: 1,
            tp_size: 1,
        });
        let mut cfg = EngineConfig::new(Role::Decode, "m");
        cfg.api_key = Some("k".into());
        let st = EngineState::new(cfg, Arc::new(kv));
        let (s, _, body) = call(&st, "POST", "/v1/completions", r#"{"prompt":"a"}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::UNAUTHORIZED, r#"{"error":"Unauthorized"}"#));
        let (s, _, _) = call(&st, "GET", "/health", "").await;
        assert_eq!(s, StatusCode::OK);
    }
}
