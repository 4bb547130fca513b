//! The engine's validated settings ([`HttpEngineConfig`]) and their defaults: the role it
//! plays, the token pacing ([`DEFAULT_ITL`]), the body limit ([`DEFAULT_BODY_LIMIT`]) and the
//! simulated prefill's cost model.

use std::time::Duration;

use crate::serve::conn::ConnLimits;

/// Which half of a P/D pair this engine plays (the pipeline's role of its workers).
pub use crate::pipeline::wire::Role;

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

    pub(super) fn prefill_time(&self, tokens: u64) -> Duration {
        if self.prefill_tokens_per_s > 0.0 {
            Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        }
    }
}

/// The default request body limit of `serve-engine` and `serve-proxy` (`--max-body-size`,
/// 64MiB: token-id prompts of long contexts exceed axum's 2 MiB default).
pub const DEFAULT_BODY_LIMIT: usize = 64 << 20;
