//! `kvx probe`: its flags ([`ProbeFlags`]) resolved into the endpoint to probe and how
//! (`transfer::probe::ProbeOptions`). Must not connect anything.

use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::config::probe::{ProbeFraming, ProbeOptions};
use crate::error::ConfigError;
use crate::transfer::handshake::Framing;

/// Framing to speak (`--vllm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VllmFraming {
    /// Try 0.33 framing, fall back to 0.19 if the peer answers that way.
    Auto,
    /// `[get_meta_msg, pp_rank, tp_rank]`, two reply frames (vLLM ≥ 0.11, kvx).
    #[value(name = "0.33")]
    V033,
    /// `[get_meta_msg, tp_rank]`, one reply frame.
    #[value(name = "0.19")]
    V019,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProbeFormat {
    Table,
    Json,
}

/// `kvx probe`'s flags.
#[derive(Debug, Clone, Args)]
pub struct ProbeFlags {
    /// Side-channel endpoint, e.g. tcp://10.0.0.5:5600 (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST and
    /// VLLM_NIXL_SIDE_CHANNEL_PORT + data-parallel rank); HOST:PORT means tcp://HOST:PORT.
    pub endpoint: String,
    /// Tensor-parallel rank to ask for.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    /// Pipeline-parallel rank to ask for (0.33 framing only).
    #[arg(long, default_value_t = 0)]
    pub pp_rank: u32,
    #[arg(long, value_enum, help = super::flags::VLLM_HELP)]
    pub vllm: Option<VllmFraming>,
    #[command(flatten)]
    pub timeout: super::flags::TimeoutFlags,
    #[arg(long, value_enum, default_value_t = ProbeFormat::Table, help = super::flags::FORMAT_HELP)]
    pub format: ProbeFormat,
    #[command(flatten)]
    pub repeat: super::flags::RepeatFlags,
}

/// Parses `250ms`, `5s`, `2m` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("{text:?} is not a duration like 500ms, 5s or 1m"))?;
    let secs = match unit.trim() {
        "ms" => value / 1e3,
        "" | "s" => value,
        "m" | "min" => value * 60.0,
        other => return Err(format!("unknown unit {other:?} in {text:?}: use ms, s or m")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{text:?}: {e}"))
}

fn normalise_endpoint(endpoint: &str) -> Result<String, ConfigError> {
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint.to_owned());
    }
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        // Checked here, not by a connect that would wait out --timeout for a port that
        // cannot exist.
        return match rest.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
                Ok(endpoint.to_owned())
            }
            Some((_, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                Err(ConfigError::new("ENDPOINT", format!("{endpoint:?}: port {port} is not in 1..=65535")))
            }
            _ => Err(ConfigError::new("ENDPOINT", format!("{endpoint:?} is not tcp://HOST:PORT"))),
        };
    }
    if endpoint.contains("://") {
        return Err(ConfigError::new(
            "ENDPOINT",
            format!("{endpoint:?}: only tcp:// and ipc:// endpoints are supported"),
        ));
    }
    match endpoint.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            normalise_endpoint(&format!("tcp://{endpoint}"))
        }
        _ => Err(ConfigError::new(
            "ENDPOINT",
            format!("{endpoint:?} is not tcp://HOST:PORT, HOST:PORT or ipc://PATH"),
        )),
    }
}

/// What `kvx probe` runs with.
#[derive(Debug, Clone)]
pub struct ProbeSettings {
    /// `tcp://HOST:PORT` or `ipc://PATH`.
    pub endpoint: String,
    pub opts: ProbeOptions,
}

/// Checks `kvx probe`'s flags.
pub fn resolve(args: &ProbeFlags) -> Result<ProbeSettings, ConfigError> {
    let endpoint = normalise_endpoint(&args.endpoint)?;
    let timeout = args.timeout.or(super::flags::DEFAULT_TIMEOUT);
    if timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be above zero"));
    }
    let opts = ProbeOptions {
        pp_rank: args.pp_rank,
        tp_rank: args.tp_rank,
        framing: match args.vllm.unwrap_or(VllmFraming::Auto) {
            VllmFraming::Auto => ProbeFraming::Auto,
            VllmFraming::V033 => ProbeFraming::Fixed(Framing::V0_33),
            VllmFraming::V019 => ProbeFraming::Fixed(Framing::V0_19),
        },
        timeout,
    };
    Ok(ProbeSettings { endpoint, opts })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("0.25s"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn endpoints() {
        assert_eq!(normalise_endpoint("tcp://h:1").as_deref(), Ok("tcp://h:1"));
        assert_eq!(normalise_endpoint("10.0.0.5:5600").as_deref(), Ok("tcp://10.0.0.5:5600"));
        assert_eq!(normalise_endpoint("ipc:///tmp/x").as_deref(), Ok("ipc:///tmp/x"));
        assert!(normalise_endpoint("http://h:1").is_err());
        assert!(normalise_endpoint("h").is_err());
        assert!(normalise_endpoint("h:99999").is_err());
        for bad in ["tcp://127.0.0.1:99999", "tcp://h:0", "tcp://h:", "tcp://:5600", "tcp://h"] {
            let e = normalise_endpoint(bad).expect_err(bad);
            assert_eq!(e.flag, "ENDPOINT", "{bad}: {e}");
        }
        assert!(normalise_endpoint("tcp://127.0.0.1:99999").expect_err("range").reason.contains("1..=65535"));
    }
}
