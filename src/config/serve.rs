//! The resolved settings of the reference serving path: an HTTP engine
//! (`kvx serve-engine`), the proxy (`kvx serve-proxy`), and the connection limits both take.

use std::time::Duration;

use super::worker::Dispatch;
use crate::vocab::kinds::Role;

/// Default time between generated tokens: a realistic decode step (see the module docs).
pub const DEFAULT_ITL: Duration = Duration::from_millis(15);

/// Validated engine settings.
#[derive(Debug, Clone)]
pub struct HttpEngineConfig {
    pub role: Role,
    /// Served model id (`--model-name`); requests naming another model get a 404.
    pub model_name: String,
    pub max_model_len: u64,
    pub block_size_tokens: u32,
    pub tp_size: u32,
    /// Simulated prefill throughput; `0` means prefill is instant.
    pub prefill_tokens_per_s: f64,
    /// Time between generated tokens (one decode step); zero turns pacing off.
    pub itl: Duration,
    /// When set, `/v1/*` requires `Authorization: Bearer <key>` (vLLM's `--api-key`).
    pub api_key: Option<String>,
    /// Requests generating at once (vLLM's `--max-num-seqs`); the rest wait.
    pub max_num_seqs: usize,
    /// The synthetic model samples EOS as this token (see `openai::plan_generation`).
    pub eos_at: Option<u64>,
    /// Largest request body taken (`--max-body-size`); a larger one is answered 413.
    pub max_body_bytes: usize,
    /// Read timeouts and the connection cap (`--header-read-timeout`, `--body-read-timeout`,
    /// `--max-connections`).
    pub conn: ConnLimits,
}

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
}

/// The default request body limit of `serve-engine` and `serve-proxy` (`--max-body-size`,
/// 64MiB: token-id prompts of long contexts exceed axum's 2 MiB default).
pub const DEFAULT_BODY_LIMIT: usize = 64 << 20;

/// Identity of the engine that a backend advertises in `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineIdentity {
    pub engine_id: String,
    pub side_channel_host: String,
    pub side_channel_port: u16,
    pub tp_size: u32,
}

/// How a backend is chosen from its pool (P and D pools are chosen independently). The
/// names of vLLM's router (`round_robin`, `random`, `power_of_two`) are accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Next healthy backend in turn (the toy proxy's `itertools.cycle`, minus the unhealthy).
    RoundRobin,
    /// Healthy backend with the fewest requests in flight from this proxy.
    LeastLoaded,
    /// A healthy backend at random.
    Random,
    /// The less loaded (fewer requests in flight) of two healthy backends drawn at random.
    PowerOfTwo,
}

/// One engine address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendAddr {
    pub host: String,
    pub port: u16,
}

/// Validated proxy settings.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub prefill: Vec<BackendAddr>,
    pub decode: Vec<BackendAddr>,
    /// Policy of the prefill pool.
    pub policy: Policy,
    /// Policy of the decode pool (vLLM router's `--decode-policy`); `None`: `policy`.
    pub decode_policy: Option<Policy>,
    /// TCP connect timeout per attempt.
    pub connect_timeout: Duration,
    /// Prefill leg: whole response. Decode leg: until its response headers.
    pub request_timeout: Duration,
    /// Clients must send `Authorization: Bearer <key>` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Bearer token sent to the engines on both legs (the toy proxy's `$OPENAI_API_KEY`).
    pub backend_api_key: Option<String>,
    /// Period of the background `GET /health` probes; zero disables them.
    pub health_interval: Duration,
    pub health_timeout: Duration,
    /// Sequential (prefill, then decode with its answer) or concurrent (push mode: both legs
    /// at once, once a prefill engine's identity is known from an earlier answer).
    pub dispatch: Dispatch,
    /// Largest request body taken (`--max-body-size`); a larger one is answered 413.
    pub max_body_bytes: usize,
    /// Read timeouts and the connection cap of the proxy's own clients
    /// (`--header-read-timeout`, `--body-read-timeout`, `--max-connections`).
    pub conn: ConnLimits,
}

impl ProxyConfig {
    pub fn new(prefill: Vec<BackendAddr>, decode: Vec<BackendAddr>) -> Self {
        Self {
            prefill,
            decode,
            policy: Policy::RoundRobin,
            decode_policy: None,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(300),
            api_key: None,
            backend_api_key: None,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(2),
            dispatch: Dispatch::Sequential,
            max_body_bytes: DEFAULT_BODY_LIMIT,
            conn: ConnLimits::default(),
        }
    }
}

/// `--max-connections` default: far above what a load generator opens (one connection per
/// request in flight), well below the file descriptors a process may raise its limit to.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Largest `--max-connections`: Linux's default ceiling on open files per process
/// (`fs.nr_open`), each connection being one.
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// How long a server waits on its clients, and how many it holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Time to send a request's headers, from the connection's start or the previous answer.
    pub header_read_timeout: Duration,
    /// Time to send a request's whole body, from the end of its headers.
    pub body_read_timeout: Duration,
    /// Connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// `--header-read-timeout` default: far longer than any client on a working network takes to
/// send its headers (a few hundred bytes), short enough that a silent connection is gone
/// before many more pile up. Also how long an idle kept-alive connection is kept.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// `--body-read-timeout` default: a 64 MiB body (the default `--max-body-size`) at about
/// 10 Mbit/s; prompts are a few KiB to a few MiB.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);
