//! `kvx serve-engine`: a vLLM-shaped OpenAI-compatible engine (prefill or decode role) with
//! no model behind it. Prefill time comes from a cost model, tokens are synthetic and emitted
//! at a fixed inter-token latency, and the KV side is whatever [`KvBackend`] it is given.
//!
//! Owns the engine's HTTP surface (`router`), request lifecycle (admission, prefill/load,
//! generation, abort on disconnect or by X-Request-Id), its `/metrics` (vLLM's families with vLLM's names, types,
//! labels and buckets, plus kvx's own `kvx:*`) and the `Server-Timing` stages of every answer
//! (`serve::timing`). Must not know how KV moves: all of that is behind the backend. Wire
//! shapes come from `serve::openai`.
//!
//! # Token pacing
//! A decode step of a real engine takes 10-30 ms (an 8B model on one H100 at moderate batch
//! sizes is near the low end, 70B at TP 4-8 near the high end), so `kvx serve-engine`
//! emits tokens [`DEFAULT_ITL`] apart by default: clients such as `vllm bench serve` or
//! aiperf then report an inter-token latency and TPOT of that size rather than the zero of a
//! response written in one piece. The first token of a decode engine that loaded its KV from
//! a prefill engine also takes one step (vLLM recomputes the last prompt token on D to get
//! its logits); after a local prefill it follows the prefill directly. `--itl-ms 0` turns
//! pacing off, and the engine says so in its `Server-Timing` (`itl;dur=0`).

use std::collections::HashMap;
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
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::conn;
use super::kv::{KvBackend, KvIntent, KvTransferParams, LoadJob, PrefillJob};
use super::metrics::{
    Counter, Exposition, Gauge, Histogram, PROMETHEUS_CONTENT_TYPE, VLLM_ITL_BUCKETS_S,
    VLLM_REQUEST_LATENCY_BUCKETS_S, VLLM_TTFT_BUCKETS_S,
};
use super::openai::{self, ApiError, FinishReason, GenRequest, ResponseCtx, SSE_CONTENT_TYPE, Usage};
use super::timing::{self, ServerTiming};
use crate::config::serve::ConnLimits;
use crate::vocab::kinds::Endpoint;

use crate::config::serve::{DEFAULT_BODY_LIMIT, HttpEngineConfig};
use crate::vocab::kinds::Role;

impl HttpEngineConfig {
    /// Defaults suited to tests: instant prefill, no ITL, NullKv-friendly sizes. The CLI's
    /// default ITL is [`DEFAULT_ITL`].
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
            max_body_bytes: DEFAULT_BODY_LIMIT,
            conn: ConnLimits::default(),
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
    /// Admitted requests that ended with an error (`finished_reason="error"`).
    failed: Counter,
    /// Every error answer, validation included (`kvx:request_errors_total`).
    errors: Counter,
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
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
            failed: Counter::default(),
            errors: Counter::default(),
            ttft: Histogram::new(VLLM_TTFT_BUCKETS_S),
            itl: Histogram::new(VLLM_ITL_BUCKETS_S),
            tpot: Histogram::new(VLLM_ITL_BUCKETS_S),
            e2e: Histogram::new(VLLM_REQUEST_LATENCY_BUCKETS_S),
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
    cfg: HttpEngineConfig,
    backend: Arc<dyn KvBackend>,
    /// Prefill role: the internal id of each recent prefill leg by the X-Request-Id it came
    /// with, so `/abort_requests` takes either (a proxy whose client left before the leg's
    /// answer knows only the header). Entries older than [`HANDOFF_IDS_KEPT`] are dropped.
    handoff_ids: std::sync::Mutex<HandoffIds>,
    /// Generation requests in progress by X-Request-Id, so `/abort_requests` ends them too: a
    /// proxy whose client left before this engine answered (a non-streaming answer comes only
    /// at the end of its generation) knows no other id.
    live: std::sync::Mutex<HashMap<String, Live>>,
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
    pub fn new(cfg: HttpEngineConfig, backend: Arc<dyn KvBackend>) -> Arc<Self> {
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
            handoff_ids: std::sync::Mutex::new(HandoffIds::default()),
            live: std::sync::Mutex::new(HashMap::new()),
            metrics: EngineMetrics::new(),
            system_fingerprint,
            started_unix_s: unix_now_s(),
        })
    }

    pub fn config(&self) -> &HttpEngineConfig {
        &self.cfg
    }

    fn handoff_ids(&self) -> std::sync::MutexGuard<'_, HandoffIds> {
        self.handoff_ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers a prefill leg's internal id under its X-Request-Id (and forgets those older
    /// than [`HANDOFF_IDS_KEPT`], oldest first: a few per call, never a scan of the map).
    fn remember_handoff(&self, x_request_id: &str, internal_id: &str) {
        let now = Instant::now();
        let mut ids = self.handoff_ids();
        while let Some((at, _)) = ids.order.front()
            && now.duration_since(*at) >= HANDOFF_IDS_KEPT
        {
            if let Some((at, key)) = ids.order.pop_front()
                && ids.by_x.get(&key).is_some_and(|h| h.at == at)
            {
                ids.by_x.remove(&key);
            }
        }
        ids.order.push_back((now, x_request_id.to_string()));
        ids.by_x.insert(
            x_request_id.to_string(),
            HandoffId { internal_id: internal_id.to_string(), at: now, aborted: false },
        );
    }

    /// Whether an abort named this prefill leg (by either id) since it began.
    fn handoff_aborted(&self, x_request_id: &str) -> bool {
        self.handoff_ids().by_x.get(x_request_id).is_some_and(|h| h.aborted)
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a generation request under its X-Request-Id until the returned guard drops.
    fn register_live(self: &Arc<Self>, x_request_id: &str) -> LiveRequest {
        let mut live = self.live();
        let l = live
            .entry(x_request_id.to_string())
            .or_insert_with(|| Live { count: 0, abort: Arc::new(watch::channel(false).0) });
        l.count += 1;
        LiveRequest {
            st: self.clone(),
            x_request_id: x_request_id.to_string(),
            abort: l.abort.clone(),
            aborted: l.abort.subscribe(),
        }
    }

    /// Aborts the generation requests in progress under `x_request_id` (each at its next
    /// point where stopping is safe); whether there were any. A request that comes later
    /// under the same id is not affected.
    fn abort_live(&self, x_request_id: &str) -> bool {
        let Some(l) = self.live().remove(x_request_id) else { return false };
        l.abort.send_replace(true);
        true
    }

    /// Renders `/metrics`: vLLM's families under vLLM's names and labels (`model_name`,
    /// `engine="0"`), kvx's own under `kvx:`.
    pub fn render_metrics(&self) -> String {
        let mut e = Exposition::new();
        self.render_into(&mut e, None);
        e.finish()
    }

    /// Adds this engine's families to `e`. `engine` labels this engine among several in one
    /// exposition (`kvx bench --serve --metrics-port`: `prefill`, `decode`); `None` is a lone
    /// engine, which vLLM labels `engine="0"`.
    pub fn render_into(&self, e: &mut Exposition, engine: Option<&str>) {
        let m = &self.metrics;
        let name = self.cfg.model_name.as_str();
        let vl = [("model_name", name), ("engine", engine.unwrap_or("0"))];
        let b = self.backend.metrics();
        // kvx's own families keep their labels; with several engines they also name theirs.
        let model: Vec<(&str, &str)> = match engine {
            None => vec![("model_name", name)],
            Some(en) => vec![("model_name", name), ("engine", en)],
        };
        let with = |extra: (&'static str, &'static str)| {
            let mut l = model.clone();
            l.push(extra);
            l
        };
        e.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &vl,
            m.running.get() as f64,
        );
        e.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &vl,
            m.waiting.get() as f64,
        );
        let usage = if b.pool_blocks > 0 { b.blocks_in_use as f64 / b.pool_blocks as f64 } else { 0.0 };
        e.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", &vl, usage);
        e.counter(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            &vl,
            m.prompt_tokens.get(),
        );
        e.counter(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            &vl,
            m.generation_tokens.get(),
        );
        let help = "Count of successfully processed requests.";
        let success = "vllm:request_success_total";
        for (reason, n) in [
            ("stop", m.success_stop.get()),
            ("length", m.success_length.get()),
            ("abort", m.aborted.get()),
            ("error", m.failed.get()),
        ] {
            e.counter(success, help, &[vl[0], vl[1], ("finished_reason", reason)], n);
        }
        e.histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &vl,
            &m.ttft.snapshot(),
        );
        e.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &vl,
            &m.itl.snapshot(),
        );
        e.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &vl,
            &m.tpot.snapshot(),
        );
        e.histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &vl,
            &m.e2e.snapshot(),
        );
        // The NIXL connector's families (vLLM's NixlPromMetrics), from the backend.
        let nx = &b.nixl;
        e.histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            &vl,
            &nx.xfer_time,
        );
        e.histogram(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            &vl,
            &nx.post_time,
        );
        e.histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            &vl,
            &nx.bytes_transferred,
        );
        e.histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            &vl,
            &nx.num_descriptors,
        );
        e.counter(
            "vllm:nixl_num_failed_transfers_total",
            "Number of failed NIXL KV Cache transfers.",
            &vl,
            nx.failed_transfers,
        );
        e.counter(
            "vllm:nixl_num_failed_notifications_total",
            "Number of failed NIXL KV Cache notifications.",
            &vl,
            nx.failed_notifications,
        );
        e.counter(
            "vllm:nixl_num_kv_expired_reqs_total",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            &vl,
            nx.kv_expired_reqs,
        );

        e.counter(
            "kvx:request_errors_total",
            "Requests answered with an error status.",
            &model,
            m.errors.get(),
        );
        let role = self.cfg.role.as_str();
        let bl_own = [("backend", b.backend), ("kv_transfer", b.kv_transfer), ("role", role)];
        let bl: Vec<(&str, &str)> = match engine {
            None => bl_own.to_vec(),
            Some(en) => {
                let mut v = bl_own.to_vec();
                v.push(("engine", en));
                v
            }
        };
        let bl_with = |extra: (&'static str, &'static str)| {
            let mut l = bl.clone();
            l.push(extra);
            l
        };
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
        let help = "Decode requests that loaded KV from a prefill engine.";
        e.counter("kvx:kv_loads_total", help, &with(("result", "ok")), m.kv_loads.get());
        e.counter("kvx:kv_loads_total", help, &with(("result", "error")), m.kv_load_failures.get());
        e.histogram(
            "kvx:kv_load_seconds",
            "Wall time of the backend load per request (handshake, reads, verify).",
            &model,
            &m.kv_load_seconds.snapshot(),
        );
        let help = "Decode requests that arrived without usable kv_transfer_params and were prefilled locally (the silent-fallback trap).";
        let name = "kvx:decode_local_prefill_total";
        e.counter(name, help, &with(("reason", "missing")), m.fallback_missing.get());
        e.counter(name, help, &with(("reason", "incomplete")), m.fallback_incomplete.get());
        e.counter(name, help, &with(("reason", "do_remote_decode")), m.fallback_wrong_direction.get());
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
                &bl_with(("stage", stage)),
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
            &bl_with(("result", "ok")),
            b.loads_ok,
        );
        e.counter(
            "kvx:kv_backend_loads_total",
            "Loads the backend finished.",
            &bl_with(("result", "error")),
            b.loads_failed,
        );
        for (cause, n) in &b.load_failures {
            e.counter(
                "kvx:kv_load_failures_total",
                "Failed loads by cause (handshake, incompatible, transfer, timeout, peer_gone, verify, notify).",
                &bl_with(("cause", cause)),
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
    }
}

/// The engine's routes. Pure: no sockets, testable with `tower::ServiceExt::oneshot`.
pub fn router(state: Arc<EngineState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/abort_requests", post(abort_requests))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::map_response(json_body_limit(limit)))
        .with_state(state)
}

/// Serves `router` on `listener` with the default [`ConnLimits`] until `shutdown` resolves,
/// then drains open requests (`serve::conn`).
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    conn::serve(listener, router, ConnLimits::default(), shutdown).await
}

/// Runs the engine on `listener`, within its configured [`ConnLimits`], until `shutdown`
/// resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<EngineState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.cfg.conn;
    conn::serve(listener, router(state), limits, shutdown).await
}

/// Turns an [`ApiError`] into vLLM's JSON error response.
pub fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], e.body()).into_response()
}

/// Turns axum's plain-text 413 (a body over `--max-body-size`) into a JSON error naming the
/// limit and the flag that raises it; every other response passes unchanged.
pub fn json_body_limit(limit: usize) -> impl Fn(Response) -> std::future::Ready<Response> + Clone {
    move |r: Response| {
        std::future::ready(if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            error_response(&ApiError::http(
                413,
                format!("Request body is larger than {limit} bytes (raise it with --max-body-size)"),
            ))
        } else {
            r
        })
    }
}

/// vLLM's answer to a route that does not exist (its `HTTPException` handler: the status
/// phrase as both message and type).
pub async fn not_found() -> Response {
    error_response(&ApiError::http(404, "Not Found"))
}

/// vLLM's answer to a known route called with the wrong method.
pub async fn method_not_allowed() -> Response {
    error_response(&ApiError::http(405, "Method Not Allowed"))
}

/// vLLM's `validate_json_request` on the generation and tokenizer routes: a body that is not
/// declared `application/json` (whatever it holds) is refused with a 400 before it is read.
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let media = ct.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::http(400, "Unsupported Media Type: Only 'application/json' is allowed"))
    }
}

/// 200 with an empty body while the engine can serve; 503 (empty body, as vLLM answers when
/// its engine core is dead) once the KV backend cannot.
async fn health(State(st): State<Arc<EngineState>>) -> StatusCode {
    match st.backend.health() {
        Ok(()) => StatusCode::OK,
        Err(why) => {
            tracing::debug!(%why, "health check: unhealthy");
            StatusCode::SERVICE_UNAVAILABLE
        }
    }
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

fn json_response(body: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response()
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

/// The checks every POST route with a JSON body shares (API key, content type): the answer
/// to a request that fails them.
fn rejected(st: &EngineState, headers: &HeaderMap) -> Option<Response> {
    if !authorized(st.cfg.api_key.as_deref(), headers) {
        return Some(unauthorized());
    }
    check_json_content_type(headers).err().map(|e| {
        st.metrics.errors.inc();
        error_response(&e)
    })
}

fn check_model(st: &EngineState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.cfg.model_name => {
            Err(ApiError::new(404, format!("The model `{m}` does not exist.")).with_param("model"))
        }
        _ => Ok(()),
    }
}

/// `POST /tokenize` with vLLM's request and response fields (kvx's synthetic tokenizer: one
/// token per whitespace-separated word).
async fn tokenize(State(st): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(r) = rejected(&st, &headers) {
        return r;
    }
    let out = openai::tokenize(&body, st.cfg.max_model_len)
        .and_then(|(model, out)| check_model(&st, model.as_deref()).map(|()| out));
    match out {
        Ok(b) => json_response(b),
        Err(e) => {
            st.metrics.errors.inc();
            error_response(&e)
        }
    }
}

/// `POST /detokenize`: token ids back to text that tokenizes to the same count.
async fn detokenize(State(st): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(r) = rejected(&st, &headers) {
        return r;
    }
    let out =
        openai::detokenize(&body).and_then(|(model, out)| check_model(&st, model.as_deref()).map(|()| out));
    match out {
        Ok(b) => json_response(b),
        Err(e) => {
            st.metrics.errors.inc();
            error_response(&e)
        }
    }
}

/// How long a prefill leg's X-Request-Id still aborts it: far longer than a proxy takes to
/// notice its client left, and it bounds the map.
const HANDOFF_IDS_KEPT: Duration = Duration::from_secs(60);

/// The generation requests in progress under one X-Request-Id (a client may send several
/// under one): how many, and the switch that aborts them all.
#[derive(Debug)]
struct Live {
    count: usize,
    abort: Arc<watch::Sender<bool>>,
}

/// A generation request registered under its X-Request-Id while it runs (unregistered on
/// drop). Its handler waits on [`aborted`](Self::aborted) where stopping is safe: while it
/// waits for admission, after its KV phase (a KV load is never cut short: the prefill engine's
/// blocks are freed by its notifications, never pulled from under its reads) and between a
/// non-streaming answer's tokens.
struct LiveRequest {
    st: Arc<EngineState>,
    x_request_id: String,
    abort: Arc<watch::Sender<bool>>,
    aborted: watch::Receiver<bool>,
}

impl LiveRequest {
    fn is_aborted(&self) -> bool {
        *self.aborted.borrow()
    }

    /// Resolves once `/abort_requests` names this request.
    async fn aborted(&mut self) {
        if self.aborted.wait_for(|a| *a).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for LiveRequest {
    fn drop(&mut self) {
        let mut live = self.st.live();
        // An abort took the entry out; a later request under the id may have put a new one.
        if let Some(l) = live.get_mut(&self.x_request_id)
            && Arc::ptr_eq(&l.abort, &self.abort)
        {
            l.count -= 1;
            if l.count == 0 {
                live.remove(&self.x_request_id);
            }
        }
    }
}

/// The answer to a generation request `/abort_requests` named (its client, a proxy, left).
fn aborted_by_id() -> ApiError {
    ApiError::new(499, "the request was aborted (POST /abort_requests)")
}

/// Recent prefill legs by X-Request-Id, and the order they came in (to forget old ones).
#[derive(Debug, Default)]
struct HandoffIds {
    by_x: HashMap<String, HandoffId>,
    order: std::collections::VecDeque<(Instant, String)>,
}

/// A prefill leg's internal id, when it began, and whether an abort named it (a leg aborted
/// before its blocks were held does not hold them).
#[derive(Debug)]
struct HandoffId {
    internal_id: String,
    at: Instant,
    aborted: bool,
}

/// `POST /abort_requests` `{"request_ids": [...]}` as vLLM's disaggregated setups use it: the
/// ids are engine-internal ids (a prefill handoff's `remote_request_id`). A prefill engine
/// frees their held KV blocks now rather than at lease expiry; the proxy sends this when a
/// request's decode leg failed, or its client left. kvx also takes the X-Request-Id a prefill
/// leg came with (a proxy whose client left before prefill answered knows no other), and that
/// of any generation request in progress, which then ends where stopping is safe
/// ([`LiveRequest`]): a proxy whose client left before the decode leg answered sends it.
/// Answers 200 with an empty body; unknown ids are ignored.
async fn abort_requests(State(st): State<Arc<EngineState>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), &headers) {
        return unauthorized();
    }
    #[derive(serde::Deserialize)]
    struct Abort {
        request_ids: Option<Vec<String>>,
    }
    match serde_json::from_slice::<Abort>(&body) {
        Ok(Abort { request_ids: Some(ids) }) => {
            for id in &ids {
                let was_live = st.abort_live(id);
                // An X-Request-Id names its leg's internal id; one already aborted (its
                // handler ended when the proxy left) has nothing left to free.
                let internal = match st.handoff_ids().by_x.get_mut(id) {
                    Some(h) if h.aborted => continue,
                    Some(h) => {
                        h.aborted = true;
                        h.internal_id.clone()
                    }
                    // A request in progress tells the backend itself as it ends.
                    None if was_live => continue,
                    None => id.clone(),
                };
                st.backend.abort(&internal);
            }
            tracing::debug!(count = ids.len(), "requests aborted by id");
            StatusCode::OK.into_response()
        }
        Ok(Abort { request_ids: None }) => {
            error_response(&ApiError::http(400, "Missing 'request_ids' in request body"))
        }
        Err(e) => error_response(&ApiError::http(400, format!("JSON decode error: {e}"))),
    }
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
    x_request_id: String,
    _permit: OwnedSemaphorePermit,
    started: Instant,
    finished: bool,
}

impl InFlight {
    /// Ends the request normally: `n` tokens, the first `ttft` after arrival.
    fn finish(mut self, finish: FinishReason, n: u64, ttft: Duration) {
        self.finished = true;
        let m = &self.st.metrics;
        match finish {
            FinishReason::Length => m.success_length.inc(),
            FinishReason::Stop => m.success_stop.inc(),
        }
        let e2e = self.started.elapsed();
        m.e2e.observe(e2e);
        if n > 1 {
            m.tpot.observe(e2e.saturating_sub(ttft) / u32::try_from(n - 1).unwrap_or(u32::MAX));
        }
    }

    /// Ends the request with an error already reported to the client.
    fn fail(mut self) {
        self.finished = true;
        self.st.metrics.errors.inc();
        self.st.metrics.failed.inc();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.st.metrics.running.dec();
        if !self.finished {
            self.st.metrics.aborted.inc();
            // One abort per request, whichever comes first: this one, or a proxy's by
            // X-Request-Id (which then finds nothing left to free).
            let already = match self.st.handoff_ids().by_x.get_mut(&self.x_request_id) {
                Some(h) if h.internal_id == self.internal_id => std::mem::replace(&mut h.aborted, true),
                _ => false,
            };
            if !already {
                self.st.backend.abort(&self.internal_id);
            }
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
    let arrived = Instant::now();
    if let Some(r) = rejected(&st, &headers) {
        return r;
    }
    let req = match openai::parse_request(ep, &body, st.cfg.max_model_len) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.errors.inc();
            return error_response(&e);
        }
    };
    if let Err(e) = check_model(&st, req.model.as_deref()) {
        st.metrics.errors.inc();
        return error_response(&e);
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

    let mut live = st.register_live(&x_request_id);
    let permit = {
        let _waiting = GaugeGuard::new(&st.metrics.waiting);
        tokio::select! {
            p = st.seqs.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return error_response(&ApiError::new(503, "engine is shutting down")),
            },
            () = live.aborted() => {
                st.metrics.aborted.inc();
                return error_response(&aborted_by_id());
            }
        }
    };
    let admitted = Instant::now();
    st.metrics.running.inc();
    let inflight = InFlight {
        st: st.clone(),
        internal_id,
        x_request_id: x_request_id.clone(),
        _permit: permit,
        started: arrived,
        finished: false,
    };
    st.metrics.prompt_tokens.add(req.prompt_tokens);

    let (kv_out, mut timing) = match kv_phase(&st, &req, &x_request_id, &inflight.internal_id).await {
        Ok(p) => p,
        Err(e) => {
            inflight.fail();
            return error_response(&e);
        }
    };
    if live.is_aborted() {
        // Dropping `inflight` counts the abort (and releases a prefill handoff, if any).
        drop(inflight);
        return error_response(&aborted_by_id());
    }
    let kv_done = Instant::now();
    let (queue_name, total_name) = match timing.kind {
        PhaseKind::Prefill => (timing::PREFILL_QUEUE, timing::PREFILL_TOTAL),
        PhaseKind::Load => (timing::DECODE_ADMISSION, timing::DECODE_TOTAL),
        PhaseKind::Local => (timing::LOCAL_QUEUE, timing::LOCAL_TOTAL),
    };
    timing.st.push(queue_name, admitted - arrived);
    // After a KV load the first token takes one decode step (the last prompt token is
    // recomputed for its logits); after a prefill it comes with the prefill.
    let first_token_at = match timing.kind {
        PhaseKind::Load => kv_done + st.cfg.itl,
        _ => kv_done,
    };
    if timing.kind != PhaseKind::Prefill {
        timing.st.push(timing::ITL, st.cfg.itl);
    }
    let ttft = first_token_at - arrived;
    st.metrics.ttft.observe(ttft);

    let (n, finish) = openai::plan_generation(&req, st.cfg.eos_at);
    let created = unix_now_s();
    if !req.stream {
        let last = first_token_at + st.cfg.itl * u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX);
        tokio::select! {
            () = sleep_until(last) => {}
            () = live.aborted() => {
                drop(inflight);
                return error_response(&aborted_by_id());
            }
        }
        if n > 1 {
            let step = first_token_at.elapsed() / u32::try_from(n - 1).unwrap_or(u32::MAX);
            for _ in 1..n {
                st.metrics.itl.observe(step);
            }
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
        inflight.finish(finish, n, ttft);
        timing.st.push(total_name, arrived.elapsed());
        let mut resp = json_response(body);
        if let Some(h) = timing.st.header() {
            resp.headers_mut().insert(timing::SERVER_TIMING, h);
        }
        return resp;
    }

    timing.st.push(total_name, arrived.elapsed());
    let stream = TokenStream {
        st: st.clone(),
        req,
        id,
        created,
        n,
        finish,
        next: 0,
        next_due: first_token_at,
        last_emit: None,
        ttft,
        ended: false,
        inflight: Some(inflight),
    };
    let body = Body::from_stream(futures::stream::unfold(stream, TokenStream::step));
    let mut resp =
        ([(header::CONTENT_TYPE, HeaderValue::from_static(SSE_CONTENT_TYPE))], body).into_response();
    if let Some(h) = timing.st.header() {
        resp.headers_mut().insert(timing::SERVER_TIMING, h);
    }
    resp
}

/// What the phase before the first token was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PhaseKind {
    /// Prefill engine handing its KV off to a decode engine.
    Prefill,
    /// Decode engine loading the KV from a prefill engine.
    Load,
    /// An engine prefilling on its own (no P/D, or the decode side's fallback).
    Local,
}

/// The phase's kind and its `Server-Timing` entries so far.
struct PhaseTiming {
    kind: PhaseKind,
    st: ServerTiming,
}

/// Everything before the first token: prefill (simulated), or the KV load from P.
/// Returns the `kv_transfer_params` to answer with (prefill role handing off to D) and the
/// phase's stage timings.
async fn kv_phase(
    st: &EngineState,
    req: &GenRequest,
    x_request_id: &str,
    internal_id: &str,
) -> Result<(Option<KvTransferParams>, PhaseTiming), ApiError> {
    let m = &st.metrics;
    let cfg = &st.cfg;
    let t0 = Instant::now();
    // A zero sleep is not free: tokio rounds timers up to its 1 ms tick.
    let local_prefill = || sleep_until(Instant::now() + cfg.prefill_time(req.prompt_tokens));
    let local = |t0: Instant| {
        let mut s = ServerTiming::new();
        s.push(timing::LOCAL_PREFILL, t0.elapsed());
        PhaseTiming { kind: PhaseKind::Local, st: s }
    };
    match (cfg.role, &req.kv) {
        (Role::Prefill, KvIntent::RemoteDecode) => {
            st.remember_handoff(x_request_id, internal_id);
            local_prefill().await;
            let job = PrefillJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
            };
            let aborted =
                || ApiError::new(499, "the request was aborted (POST /abort_requests) before its handoff");
            if st.handoff_aborted(x_request_id) {
                return Err(aborted());
            }
            let params = st
                .backend
                .prefill(job)
                .await
                .map_err(|e| ApiError::new(e.http_status(), format!("KV prefill handoff failed: {e}")))?;
            // An abort that came while the blocks were filled finds them held only now.
            if st.handoff_aborted(x_request_id) {
                st.backend.abort(internal_id);
                return Err(aborted());
            }
            m.kv_handoffs.inc();
            let mut s = ServerTiming::new();
            s.push(timing::PREFILL_COMPUTE, t0.elapsed());
            Ok((Some(params), PhaseTiming { kind: PhaseKind::Prefill, st: s }))
        }
        (Role::Prefill, intent) => {
            if !matches!(intent, KvIntent::None) {
                tracing::warn!(
                    ?intent,
                    "prefill engine got decode-side kv_transfer_params; prefilling locally"
                );
            }
            local_prefill().await;
            Ok((None, local(t0)))
        }
        (Role::Decode, KvIntent::RemotePrefill(params)) => {
            let job = LoadJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
                params: (**params).clone(),
            };
            match st.backend.load(job).await {
                Ok(r) => {
                    let elapsed = t0.elapsed();
                    m.kv_load_seconds.observe(elapsed);
                    m.kv_loads.inc();
                    let handshake = r.handshake.unwrap_or_default();
                    let transfer = elapsed.saturating_sub(handshake + r.notify + r.verify);
                    let mut s = ServerTiming::new();
                    s.push(timing::KV_HANDSHAKE, handshake)
                        .push(timing::KV_TRANSFER, transfer)
                        .push(timing::KV_NOTIFY, r.notify)
                        .push(timing::KV_VERIFY, r.verify);
                    Ok((None, PhaseTiming { kind: PhaseKind::Load, st: s }))
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
            Ok((None, local(t0)))
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
    /// When the previous frame went out (for `vllm:inter_token_latency_seconds`).
    last_emit: Option<Instant>,
    ttft: Duration,
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
        let tokens = self.next - start;
        st.metrics.generation_tokens.add(tokens);
        // One gap per token: the frame's first token waited since the previous frame, the
        // others of a coalesced frame (pacing off) came with it.
        if let Some(prev) = self.last_emit {
            st.metrics.itl.observe(emitted_at - prev);
            for _ in 1..tokens {
                st.metrics.itl.observe(Duration::ZERO);
            }
        } else {
            for _ in 1..tokens {
                st.metrics.itl.observe(Duration::ZERO);
            }
        }
        self.last_emit = Some(emitted_at);
        if self.ended
            && let Some(f) = self.inflight.take()
        {
            f.finish(self.finish, self.n, self.ttft);
        }
        Some((Ok(Bytes::from(out)), self))
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::config::serve::EngineIdentity;
    use crate::serve::kv::NullKv;

    fn engine(role: Role) -> Arc<EngineState> {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "P0".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 1,
        });
        EngineState::new(HttpEngineConfig::new(role, "m"), Arc::new(kv))
    }

    async fn call(
        st: &Arc<EngineState>,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, HeaderMap, String) {
        let mut req = axum::http::Request::builder().method(method).uri(path).header("x-request-id", "abc");
        if method == "POST" {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Body::from(body.to_string())).expect("request");
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
        assert!(st.render_metrics().contains("kvx:kv_prefill_handoffs_total{model_name=\"m\"} 1.0"));
    }

    #[tokio::test]
    async fn decode_without_params_counts_the_silent_fallback() {
        let st = engine(Role::Decode);
        let (status, _, _) = call(&st, "POST", "/v1/completions", r#"{"prompt":"x y","max_tokens":3}"#).await;
        assert_eq!(status, StatusCode::OK);
        let m = st.render_metrics();
        assert!(m.contains("kvx:decode_local_prefill_total{model_name=\"m\",reason=\"missing\"} 1.0"), "{m}");
        assert!(m.contains("vllm:generation_tokens_total{model_name=\"m\",engine=\"0\"} 3.0"), "{m}");
        assert!(
            m.contains("kvx:kv_backend_info{backend=\"null\",kv_transfer=\"none\",role=\"decode\"} 1.0"),
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
        // vLLM 0.33's HTTPException handler: the status phrase is the type.
        assert_eq!(body, r#"{"error":{"message":"Not Found","type":"Not Found","param":null,"code":404}}"#);
        let (s, _, body) = call(&st, "GET", "/v1/completions", "").await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            body,
            r#"{"error":{"message":"Method Not Allowed","type":"Method Not Allowed","param":null,"code":405}}"#
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
    async fn json_bodies_must_say_so_like_vllm() {
        let st = engine(Role::Decode);
        for ct in [Some("text/plain"), None, Some("application/x-www-form-urlencoded")] {
            let mut req = axum::http::Request::builder().method("POST").uri("/v1/completions");
            if let Some(ct) = ct {
                req = req.header("content-type", ct);
            }
            let req = req.body(Body::from(r#"{"prompt":"a b"}"#)).expect("request");
            let resp = router(st.clone()).oneshot(req).await.expect("infallible");
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{ct:?}");
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(
                std::str::from_utf8(&body).expect("utf8"),
                r#"{"error":{"message":"Unsupported Media Type: Only 'application/json' is allowed","type":"Bad Request","param":null,"code":400}}"#
            );
        }
        // A parameter after the media type is fine.
        let req = axum::http::Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .header("content-type", "Application/JSON; charset=utf-8")
            .body(Body::from(r#"{"prompt":"a b","max_tokens":1}"#))
            .expect("request");
        assert_eq!(router(st.clone()).oneshot(req).await.expect("infallible").status(), StatusCode::OK);
        assert_eq!(
            st.render_metrics().matches("kvx:request_errors_total{model_name=\"m\"} 3.0").count(),
            1,
            "{}",
            st.render_metrics()
        );
    }

    /// Sends one request under its own X-Request-Id and returns its status.
    async fn call_as(st: &Arc<EngineState>, x_request_id: &str, path: &str, body: &str) -> StatusCode {
        let req = axum::http::Request::post(path)
            .header("x-request-id", x_request_id)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        router(st.clone()).oneshot(req).await.expect("infallible").status()
    }

    /// Polls the engine's metrics (every 5 ms, 5 s at most) until `line` is in them.
    async fn metrics_show(st: &EngineState, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !st.render_metrics().lines().any(|l| l == line) {
            assert!(Instant::now() < deadline, "no {line:?} in:\n{}", st.render_metrics());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abort_by_x_request_id_ends_requests_in_progress() {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "D0".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 1,
        });
        let mut cfg = HttpEngineConfig::new(Role::Decode, "m");
        cfg.itl = Duration::from_millis(50);
        cfg.max_num_seqs = 1;
        let st = EngineState::new(cfg, Arc::new(kv));
        // 1,000 tokens 50 ms apart: 50 s unless aborted.
        let body = r#"{"model":"m","prompt":"a b","max_tokens":1000}"#;
        let start = |xid: &'static str| {
            let st = st.clone();
            tokio::spawn(async move { call_as(&st, xid, "/v1/completions", body).await })
        };
        let generating = start("leg-1");
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 1.0"#).await;
        let queued = start("leg-2");
        metrics_show(&st, r#"vllm:num_requests_waiting{model_name="m",engine="0"} 1.0"#).await;
        let abort = |id: &str| format!(r#"{{"request_ids":["{id}"]}}"#);
        // Waiting for admission: answered at once; the one generating goes on.
        assert_eq!(call_as(&st, "x", "/abort_requests", &abort("leg-2")).await, StatusCode::OK);
        let s =
            tokio::time::timeout(Duration::from_secs(1), queued).await.expect("within 1 s").expect("join");
        assert_eq!(s.as_u16(), 499);
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 1.0"#).await;
        // Generating a non-streaming answer: ended between its tokens, counted as an abort.
        assert_eq!(call_as(&st, "x", "/abort_requests", &abort("leg-1")).await, StatusCode::OK);
        let s = tokio::time::timeout(Duration::from_secs(1), generating)
            .await
            .expect("within 1 s")
            .expect("join");
        assert_eq!(s.as_u16(), 499);
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 0.0"#).await;
        let m = st.render_metrics();
        let aborted = r#"vllm:request_success_total{model_name="m",engine="0",finished_reason="abort"} 2.0"#;
        assert!(m.lines().any(|l| l == aborted), "{m}");
        assert!(st.live().is_empty(), "nothing left registered");
        // A later request under an aborted id runs as any other.
        let s =
            call_as(&st, "leg-1", "/v1/completions", r#"{"model":"m","prompt":"a b","max_tokens":1}"#).await;
        assert_eq!(s, StatusCode::OK);
    }

    #[tokio::test]
    async fn tokenizer_routes_and_abort_requests() {
        let st = engine(Role::Prefill);
        let (s, h, body) = call(&st, "POST", "/tokenize", r#"{"model":"m","prompt":"a b c"}"#).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body,
            r#"{"count":3,"max_model_len":8192,"tokens":[121996,94629,18418],"token_strs":null}"#
        );
        let (s, _, body) = call(&st, "POST", "/detokenize", r#"{"tokens":[1,2]}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, r#"{"prompt":"w1 w2"}"#));
        let (s, _, body) = call(&st, "POST", "/tokenize", r#"{"model":"x","prompt":"a"}"#).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{body}");
        let (s, _, body) =
            call(&st, "POST", "/abort_requests", r#"{"request_ids":["cmpl-a-0-1234abcd"]}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, ""));
        assert!(
            st.render_metrics()
                .contains("kvx:kv_aborts_total{backend=\"null\",kv_transfer=\"none\",role=\"prefill\"} 1.0")
        );
        let (s, _, body) = call(&st, "POST", "/abort_requests", r#"{}"#).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        assert!(body.contains("Missing 'request_ids' in request body"), "{body}");
    }

    #[tokio::test]
    async fn answers_carry_their_stage_timings() {
        let p = engine(Role::Prefill);
        let body = r#"{"prompt":"a b c","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}"#;
        let (s, h, _) = call(&p, "POST", "/v1/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        let names: Vec<String> = crate::serve::timing::from_headers(&h).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["prefill_compute", "prefill_queue", "prefill_total"]);
        let d = engine(Role::Decode);
        let body = r#"{"prompt":"a b c","max_tokens":2,"stream":true,"kv_transfer_params":{"do_remote_prefill":true,
            "remote_block_ids":[[0]],"remote_engine_id":"P0","remote_request_id":"r","remote_host":"h","remote_port":1}}"#;
        let (s, h, _) = call(&d, "POST", "/v1/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        let names: Vec<String> = crate::serve::timing::from_headers(&h).into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "kv_handshake",
                "kv_transfer",
                "kv_notify",
                "kv_verify",
                "decode_admission",
                "itl",
                "decode_total"
            ]
        );
        let m = d.render_metrics();
        for family in [
            "vllm:inter_token_latency_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:request_time_per_output_token_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:nixl_num_failed_transfers_total{model_name=\"m\",engine=\"0\"} 0.0",
            "vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.0",
        ] {
            assert!(m.contains(family), "{family} missing in:\n{m}");
        }
    }

    #[tokio::test]
    async fn api_key_is_enforced_on_v1_only() {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "e".into(),
            side_channel_host: "h".into(),
            side_channel_port: 1,
            tp_size: 1,
        });
        let mut cfg = HttpEngineConfig::new(Role::Decode, "m");
        cfg.api_key = Some("k".into());
        let st = EngineState::new(cfg, Arc::new(kv));
        let (s, _, body) = call(&st, "POST", "/v1/completions", r#"{"prompt":"a"}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::UNAUTHORIZED, r#"{"error":"Unauthorized"}"#));
        let (s, _, _) = call(&st, "GET", "/health", "").await;
        assert_eq!(s, StatusCode::OK);
    }
}
