//! `kvx load`: its flags ([`LoadFlags`]) resolved into the load generator's settings
//! (`config::load::LoadConfig`) and where the run is written; and `--slo`, which
//! `kvx bench --serve` takes too. Must not send anything.

use std::path::PathBuf;

use clap::{ArgAction, Args, ValueEnum};

use super::env::ProcessEnv;
use super::env::results_root;
use crate::config::load::Slo;
use crate::error::ConfigError;

use crate::config::arrival::Arrival;
use crate::config::load::{LoadConfig, Target};
use crate::vocab::kinds::Endpoint;

/// The API `kvx load` calls (`--endpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndpointArg {
    /// POST /v1/completions
    Completions,
    /// POST /v1/chat/completions
    Chat,
}

/// Output format of `kvx load`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// `kvx load`'s flags.
#[derive(Debug, Clone, Args)]
pub struct LoadFlags {
    /// Endpoint to load: a base URL (`http://host:port`) or a full endpoint URL.
    #[arg(long)]
    pub url: String,
    /// Second target measured in the same run (e.g. the decode engine directly); the report
    /// gives `--url` minus it.
    #[arg(long)]
    pub baseline_url: Option<String>,
    /// Make the baseline a client-side P/D pair: prefill leg here (rewritten like the proxy
    /// does), decode leg to --baseline-url. Measures the proxy's work at zero proxy cost.
    #[arg(long, requires = "baseline_url")]
    pub baseline_prefill_url: Option<String>,
    #[command(flatten)]
    pub arrival: super::flags::ArrivalFlags,
    #[command(flatten)]
    pub duration: super::flags::DurationFlags,
    #[command(flatten)]
    pub prompt: super::flags::PromptLenFlags,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u64,
    /// Stream the responses (SSE); needed for TTFT/ITL/TPOT.
    #[arg(long)]
    pub stream: bool,
    /// API to call.
    #[arg(long, value_enum, default_value = "completions")]
    pub endpoint: EndpointArg,
    #[command(flatten)]
    pub model_name: super::flags::ModelNameFlags,
    /// Send `ignore_eos` so every request generates exactly --max-tokens.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub api_key: super::flags::ApiKeyFlags,
    #[command(flatten)]
    pub timeout: super::flags::TimeoutFlags,
    #[command(flatten)]
    pub seed: super::flags::SeedFlags,
    #[command(flatten)]
    pub run_name: super::flags::RunNameFlags,
    #[arg(long, value_enum, default_value = "table", help = super::flags::FORMAT_HELP)]
    pub format: Format,
    /// Directory runs are written under [default: results/, or KVX_RESULTS_DIR].
    #[arg(long)]
    pub results_dir: Option<PathBuf>,
    /// Runtime worker threads, 1 to 1024 (default: one per CPU).
    #[arg(long, value_name = "N", value_parser = super::parse::parse_threads)]
    pub threads: Option<usize>,
}

/// What `kvx load` runs with.
#[derive(Debug, Clone)]
pub struct LoadSettings {
    /// The load to send and measure.
    pub load: LoadConfig,
    /// Directory the run is written under (`--results-dir`, else `KVX_RESULTS_DIR`, else `results/`).
    pub results_root: PathBuf,
}

fn parse_prompt_len(s: &str) -> Result<(u64, u64), ConfigError> {
    let bad = || ConfigError::new("--prompt-len", format!("expected N or A..B with 1 <= A <= B, got {s:?}"));
    let (a, b) = match s.split_once("..") {
        Some((a, b)) => (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?),
        None => {
            let n = s.trim().parse().map_err(|_| bad())?;
            (n, n)
        }
    };
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

fn parse_url(flag: &str, s: &str) -> Result<http::Uri, ConfigError> {
    let u: http::Uri = s.parse().map_err(|e| ConfigError::new(flag, format!("invalid URL {s:?}: {e}")))?;
    crate::config::load::endpoint_uri(&u, "/")
        .map_err(|reason| ConfigError::new(flag, format!("{s}: {reason}")))?;
    Ok(u)
}

/// Checks the flags and builds the load settings.
/// `--timeout` of `kvx load` when not given: one whole response.
pub const DEFAULT_LOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// `--prompt-len` of `kvx load` when not given, in tokens.
pub const DEFAULT_LOAD_PROMPT_LEN: &str = "16";

/// A duration flag that must not be zero (no wait at all, which no flag means).
fn nonzero(flag: &str, d: std::time::Duration) -> Result<std::time::Duration, ConfigError> {
    if d.is_zero() {
        return Err(ConfigError::new(flag, "must be > 0"));
    }
    Ok(d)
}

pub fn resolve(a: &LoadFlags, env: &ProcessEnv) -> Result<LoadSettings, ConfigError> {
    let mut targets =
        vec![Target { name: "url".into(), url: parse_url("--url", &a.url)?, prefill_url: None }];
    if let Some(b) = &a.baseline_url {
        let prefill_url = match &a.baseline_prefill_url {
            Some(p) => Some(parse_url("--baseline-prefill-url", p)?),
            None => None,
        };
        let name = if prefill_url.is_some() { "baseline-pd" } else { "baseline" };
        targets.push(Target { name: name.into(), url: parse_url("--baseline-url", b)?, prefill_url });
    }
    let arrival = match (a.arrival.rate, a.arrival.concurrency) {
        (Some(r), _) => Arrival::Poisson { rate: super::parse::rate("--rate", r)? },
        (None, Some(c)) if c > 0 => Arrival::Closed { concurrency: c },
        (None, Some(_)) => {
            return Err(ConfigError::new("--concurrency", "must be at least 1 (or use --rate)"));
        }
        (None, None) => {
            return Err(ConfigError::new(
                "--rate or --concurrency",
                "give --rate R (open loop: R requests per second) or --concurrency C (closed loop: C in flight)",
            ));
        }
    };
    let duration = a.duration.duration.map(|d| nonzero("--duration", d)).transpose()?;
    let requests = match (a.arrival.requests, duration) {
        (Some(0), _) => return Err(ConfigError::new("--requests", "must be at least 1")),
        (Some(n), _) => Some(n),
        (None, Some(_)) => None,
        (None, None) => Some(100),
    };
    if a.max_tokens == 0 {
        return Err(ConfigError::new("--max-tokens", "must be at least 1"));
    }
    let timeout = nonzero("--timeout", a.timeout.or(DEFAULT_LOAD_TIMEOUT))?;
    let load = LoadConfig {
        targets,
        arrival,
        requests,
        duration,
        warmup: a.arrival.warmup.unwrap_or(0),
        prompt_len: parse_prompt_len(a.prompt.prompt_len.as_deref().unwrap_or(DEFAULT_LOAD_PROMPT_LEN))?,
        max_tokens: a.max_tokens,
        stream: a.stream,
        endpoint: match a.endpoint {
            EndpointArg::Completions => Endpoint::Completions,
            EndpointArg::Chat => Endpoint::Chat,
        },
        model: a.model_name.model_name.clone(),
        ignore_eos: a.ignore_eos,
        api_key: a.api_key.api_key.clone(),
        timeout,
        seed: a.seed.seed(),
        slo: parse_slo(a.run_name.slo.as_deref())?,
    };
    if a.threads == Some(0) {
        return Err(ConfigError::new("--threads", "must be at least 1"));
    }
    Ok(LoadSettings { load, results_root: results_root(a.results_dir.as_deref(), env.results_dir.clone()) })
}

/// `--slo`, as `kvx load` and `kvx bench --serve` take it.
pub fn parse_slo(s: Option<&str>) -> Result<Option<Slo>, ConfigError> {
    s.map(|s| Slo::parse(s).map_err(|e| ConfigError::new("--slo", e))).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_flag_names_itself() {
        assert_eq!(parse_slo(None).expect("none"), None);
        assert!(parse_slo(Some("ttft=200ms,tpot=50ms")).expect("valid").is_some());
        let e = parse_slo(Some("ttft=soon")).expect_err("invalid");
        assert_eq!(e.flag, "--slo");
    }

    #[test]
    fn prompt_len_forms() {
        assert_eq!(parse_prompt_len("16").expect("n"), (16, 16));
        assert_eq!(parse_prompt_len("8..32").expect("range"), (8, 32));
        assert!(parse_prompt_len("0").is_err());
        assert!(parse_prompt_len("9..3").is_err());
        assert!(parse_prompt_len("x").is_err());
    }
}
