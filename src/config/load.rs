//! The resolved settings of `kvx load`: where requests go, how they arrive, what they ask
//! for, and the latency objectives goodput counts against.

use std::time::Duration;

use http::Uri;

use super::arrival::Arrival;
use crate::vocab::kinds::Endpoint;

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Name in the report (`url`, `baseline`).
    pub name: String,
    /// Base URL (`http://host:port`) or a full endpoint URL.
    pub url: Uri,
    /// If set, the generator does the prefill leg against this base URL first and sends
    /// `url` the decode leg (a client-side P/D pair, no proxy).
    pub prefill_url: Option<Uri>,
}

/// Validated load settings.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    pub targets: Vec<Target>,
    pub arrival: Arrival,
    /// Measured requests per target (after warmup); `None` = until `duration`.
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
    /// Requests per target sent first and left out of every statistic.
    pub warmup: u64,
    /// Prompt length in tokens (words of kvx's synthetic tokenizer), uniform in `min..=max`.
    pub prompt_len: (u64, u64),
    pub max_tokens: u64,
    pub stream: bool,
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub ignore_eos: bool,
    pub api_key: Option<String>,
    /// Per-request limit (whole response).
    pub timeout: Duration,
    pub seed: u64,
    /// Objectives for goodput (`--slo`).
    pub slo: Option<Slo>,
}

/// Latency limits a request must meet; unset ones are not checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Slo {
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Time per output token after the first: `(e2el - ttft) / (tokens - 1)`.
    pub tpot: Option<Duration>,
    /// Inter-token latency: every gap between streamed tokens.
    pub itl: Option<Duration>,
    /// End-to-end latency.
    pub e2el: Option<Duration>,
}

/// Resolves `base` + endpoint path: a bare `http://host:port[/]` gets the endpoint's path,
/// a URL with a path is used as given.
pub fn endpoint_uri(base: &Uri, path: &str) -> Result<Uri, String> {
    if base.scheme_str() != Some("http") {
        return Err("only http:// URLs are supported".into());
    }
    let authority = base.authority().ok_or("missing host:port")?.clone();
    let p = base.path();
    let path = if p.is_empty() || p == "/" { path } else { p };
    Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(path.to_string())
        .build()
        .map_err(|e| e.to_string())
}
