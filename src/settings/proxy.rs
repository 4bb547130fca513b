//! `kvx serve-proxy`: its flags ([`ServeProxyFlags`]: those of vLLM's `toy_proxy_server.py`
//! and the P/D flags of vLLM's Rust router, `vllm-router --vllm-pd-disaggregation --prefill
//! URL [BOOTSTRAP_PORT] --decode URL --policy round_robin|random|power_of_two`), resolved into
//! the proxy's settings (`serve::proxy::ProxyConfig`); and the connection flags it shares with
//! `kvx serve-engine` ([`ServeConnFlags`]). Must not bind or connect anything.

use std::time::Duration;

use clap::{ArgAction, Args};

use super::parse::parse_duration;
use crate::config::serve::{BackendAddr, Policy, ProxyConfig};
use crate::config::serve::{ConnLimits, MAX_CONNECTIONS};
use crate::error::ConfigError;

/// How long `kvx serve-engine` and `kvx serve-proxy` wait on their clients, and how many they
/// hold at once (`serve::conn`): a client that sends nothing, or trickles its request, cannot
/// hold a connection and its buffers for ever.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct ServeConnFlags {
    /// Time a client has to send a request's headers, e.g. 10s, 500ms; a connection that takes
    /// longer (or stays idle that long between requests) is closed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's whole body once its headers are in; a slower one
    /// is answered 408 and its connection closed.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "60s")]
    pub body_read_timeout: Duration,
    /// Connections open at once, 1 to 1048576; past it a new connection is answered 503 and
    /// closed. Each takes a file descriptor (the process raises its open-file limit to fit).
    #[arg(long, value_name = "N", default_value_t = crate::config::serve::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
}

impl Default for ServeConnFlags {
    /// The flags' defaults (as clap gives them).
    fn default() -> Self {
        let d = ConnLimits::default();
        Self {
            header_read_timeout: d.header_read_timeout,
            body_read_timeout: d.body_read_timeout,
            max_connections: d.max_connections,
        }
    }
}

/// Checks the connection flags: both timeouts above zero, the cap within 1..=[`MAX_CONNECTIONS`].
pub fn resolve_conn(a: &ServeConnFlags) -> Result<ConnLimits, ConfigError> {
    for (flag, d) in
        [("--header-read-timeout", a.header_read_timeout), ("--body-read-timeout", a.body_read_timeout)]
    {
        if d.is_zero() {
            return Err(ConfigError::new(
                flag,
                "must be above zero (a client needs some time to send a request)",
            ));
        }
    }
    if !(1..=MAX_CONNECTIONS).contains(&a.max_connections) {
        return Err(ConfigError::new(
            "--max-connections",
            format!("must be 1 to {MAX_CONNECTIONS} (one file descriptor each), got {}", a.max_connections),
        ));
    }
    Ok(ConnLimits {
        header_read_timeout: a.header_read_timeout,
        body_read_timeout: a.body_read_timeout,
        max_connections: a.max_connections,
    })
}

/// `kvx serve-proxy`'s flags (host, port and threads are the process's own: `cli` binds and
/// starts the runtime with them).
#[derive(Debug, Clone, Args)]
pub struct ServeProxyFlags {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind; 0 picks a free one (read it from the first stdout line).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill engine hosts (one per port in --prefiller-ports).
    #[arg(long = "prefiller-hosts", visible_alias = "prefiller-host", num_args = 1.., default_values_t = [String::from("localhost")])]
    pub prefiller_hosts: Vec<String>,
    /// Prefill engine ports.
    #[arg(long = "prefiller-ports", visible_alias = "prefiller-port", num_args = 1.., default_values_t = [8100u16])]
    pub prefiller_ports: Vec<u16>,
    /// Decode engine hosts (one per port in --decoder-ports).
    #[arg(long = "decoder-hosts", visible_alias = "decoder-host", num_args = 1.., default_values_t = [String::from("localhost")])]
    pub decoder_hosts: Vec<String>,
    /// Decode engine ports.
    #[arg(long = "decoder-ports", visible_alias = "decoder-port", num_args = 1.., default_values_t = [8200u16])]
    pub decoder_ports: Vec<u16>,
    /// vLLM router: accepted for compatibility (kvx serve-proxy always disaggregates P/D).
    #[arg(long, help_heading = "vLLM router flags")]
    pub vllm_pd_disaggregation: bool,
    /// vLLM router: a prefill engine's URL, optionally followed by its bootstrap port (unused by
    /// NIXL's pull mode; a number or `none`). Repeat for several engines.
    #[arg(long = "prefill", num_args = 1..=2, action = ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"],
          conflicts_with_all = ["prefiller_hosts", "prefiller_ports"], help_heading = "vLLM router flags")]
    pub prefill: Vec<String>,
    /// vLLM router: a decode engine's URL. Repeat for several engines.
    #[arg(long = "decode", value_name = "URL", action = ArgAction::Append,
          conflicts_with_all = ["decoder_hosts", "decoder_ports"], help_heading = "vLLM router flags")]
    pub decode: Vec<String>,
    /// How an engine is chosen within each pool (vLLM router's names round_robin, random,
    /// power_of_two work too).
    #[arg(long, value_enum, default_value = "round-robin")]
    pub policy: Policy,
    #[command(flatten)]
    pub dispatch: super::flags::DispatchFlags,
    /// Policy of the prefill pool [default: --policy].
    #[arg(long, value_enum, help_heading = "vLLM router flags")]
    pub prefill_policy: Option<Policy>,
    /// Policy of the decode pool [default: --policy].
    #[arg(long, value_enum, help_heading = "vLLM router flags")]
    pub decode_policy: Option<Policy>,
    /// TCP connect timeout per attempt, in seconds.
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    pub connect_timeout: f64,
    /// Prefill: whole response; decode: until response headers. Seconds.
    #[arg(long, visible_alias = "request-timeout-secs", default_value_t = 300.0, value_name = "SECONDS")]
    pub request_timeout: f64,
    #[command(flatten)]
    pub api_key: super::flags::ApiKeyFlags,
    /// Bearer token sent to the engines (default: --api-key).
    #[arg(long, env = crate::settings::env::OPENAI_API_KEY, hide_env_values = true)]
    pub backend_api_key: Option<String>,
    /// Seconds between background `GET /health` probes of every engine (0 = off). A down
    /// engine is routed to again within one interval of its recovery.
    #[arg(long, visible_alias = "health-check-interval-secs", default_value_t = 2.0, value_name = "SECONDS")]
    pub health_interval: f64,
    /// Timeout of one health probe, in seconds.
    #[arg(long, visible_alias = "health-check-timeout-secs", default_value_t = 2.0, value_name = "SECONDS")]
    pub health_timeout: f64,
    /// Largest request body taken, e.g. 64MiB, 1GiB; a larger one is answered 413.
    #[arg(long, value_name = "SIZE", value_parser = crate::settings::parse::parse_size, default_value = "64MiB")]
    pub max_body_size: u64,
    /// Runtime worker threads, 1 to 1024 (default: one per CPU).
    #[arg(long, value_name = "N", value_parser = super::parse::parse_threads)]
    pub threads: Option<usize>,
    #[command(flatten, next_help_heading = "Connections")]
    pub conn: ServeConnFlags,
}

fn seconds(flag: &str, v: f64, allow_zero: bool) -> Result<Duration, ConfigError> {
    if v.is_finite() && (v > 0.0 || (allow_zero && v == 0.0)) && v <= 86_400.0 {
        Ok(Duration::from_secs_f64(v))
    } else {
        let min = if allow_zero { ">= 0" } else { "> 0" };
        Err(ConfigError::new(flag, format!("must be a number of seconds {min} and at most 86400, got {v}")))
    }
}

fn pair(hosts: &[String], ports: &[u16], what: &str, flags: &str) -> Result<Vec<BackendAddr>, ConfigError> {
    if hosts.len() != ports.len() {
        return Err(ConfigError::new(
            flags,
            format!(
                "Number of {what} hosts must match number of {what} ports ({} hosts, {} ports)",
                hosts.len(),
                ports.len()
            ),
        ));
    }
    let (host_flag, port_flag) = flags.split_once('/').unwrap_or((flags, flags));
    if let Some(h) = hosts.iter().find(|h| h.trim().is_empty() || h.contains(['/', ' ', '@', '?', '#'])) {
        return Err(ConfigError::new(host_flag, format!("{h:?} is not a {what} host name or address")));
    }
    if ports.contains(&0) {
        return Err(ConfigError::new(port_flag, format!("a {what} port must be 1..=65535, got 0")));
    }
    Ok(hosts.iter().zip(ports).map(|(h, &p)| BackendAddr { host: h.clone(), port: p }).collect())
}

/// A vLLM router backend URL (`http://host:port[/]`) as an address.
fn router_url(flag: &str, url: &str) -> Result<BackendAddr, ConfigError> {
    let bad = |why: &str| ConfigError::new(flag, format!("{url:?} is not an http://HOST:PORT URL: {why}"));
    let uri: http::Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad("only http:// is supported"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad("give the engine's base URL, without a path"));
    }
    let host = uri.host().filter(|h| !h.is_empty()).ok_or_else(|| bad("no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
    Ok(BackendAddr { host, port: uri.port_u16().unwrap_or(80) })
}

/// The values of every `--prefill URL [BOOTSTRAP_PORT]`, flattened: each URL may be
/// followed by a bootstrap port (a number or `none`, unused by NIXL's pull mode).
fn router_prefills(values: &[String]) -> Result<Vec<BackendAddr>, ConfigError> {
    let mut out = Vec::new();
    let mut last_url: Option<&str> = None;
    for v in values {
        if v.contains("://") {
            out.push(router_url("--prefill", v)?);
            last_url = Some(v);
        } else if let Some(url) = last_url.take()
            && (v.eq_ignore_ascii_case("none") || v.parse::<u16>().is_ok())
        {
            tracing::debug!(url, bootstrap_port = %v, "--prefill bootstrap port ignored (NIXL pull mode)");
        } else {
            return Err(ConfigError::new(
                "--prefill",
                format!(
                    "{v:?} is neither an http://HOST:PORT URL nor a bootstrap port (a number or `none`) after one"
                ),
            ));
        }
    }
    Ok(out)
}

/// Checks the flags and builds the proxy settings.
pub fn resolve(a: &ServeProxyFlags) -> Result<ProxyConfig, ConfigError> {
    let (prefill, decode) = if a.prefill.is_empty() && a.decode.is_empty() {
        if a.vllm_pd_disaggregation {
            return Err(ConfigError::new(
                "--prefill/--decode",
                "--vllm-pd-disaggregation needs the engines: --prefill URL and --decode URL",
            ));
        }
        (
            pair(&a.prefiller_hosts, &a.prefiller_ports, "prefiller", "--prefiller-hosts/--prefiller-ports")?,
            pair(&a.decoder_hosts, &a.decoder_ports, "decoder", "--decoder-hosts/--decoder-ports")?,
        )
    } else {
        if a.prefill.is_empty() || a.decode.is_empty() {
            return Err(ConfigError::new(
                "--prefill/--decode",
                "P/D routing needs both: at least one --prefill URL and one --decode URL",
            ));
        }
        let prefill = router_prefills(&a.prefill)?;
        let decode = a.decode.iter().map(|u| router_url("--decode", u)).collect::<Result<Vec<_>, _>>()?;
        (prefill, decode)
    };
    if a.threads == Some(0) {
        return Err(ConfigError::new("--threads", "must be at least 1"));
    }
    Ok(ProxyConfig {
        prefill,
        decode,
        policy: a.prefill_policy.unwrap_or(a.policy),
        decode_policy: Some(a.decode_policy.unwrap_or(a.policy)),
        connect_timeout: seconds("--connect-timeout", a.connect_timeout, false)?,
        request_timeout: seconds("--request-timeout", a.request_timeout, false)?,
        api_key: a.api_key.api_key.clone(),
        backend_api_key: a.backend_api_key.clone().or_else(|| a.api_key.api_key.clone()),
        health_interval: seconds("--health-interval", a.health_interval, true)?,
        health_timeout: seconds("--health-timeout", a.health_timeout, false)?,
        dispatch: a.dispatch.dispatch.unwrap_or_default(),
        max_body_bytes: crate::settings::parse::body_limit("--max-body-size", a.max_body_size)?,
        conn: resolve_conn(&a.conn)?,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::serve::Policy;

    /// The flags alone, parsed as `kvx serve-proxy` parses them (it flattens them too).
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        settings: ServeProxyFlags,
    }

    fn parse(args: &[&str]) -> ServeProxyFlags {
        let mut v = vec!["serve-proxy"];
        v.extend_from_slice(args);
        Flags::try_parse_from(v).expect("parses").settings
    }

    #[test]
    fn toy_proxy_flags_parse_with_both_spellings() {
        let a = parse(&[
            "--prefiller-host",
            "h1",
            "h2",
            "--prefiller-port",
            "8100",
            "8101",
            "--decoder-hosts",
            "d1",
            "--decoder-ports",
            "8200",
            "--port",
            "8192",
        ]);
        let cfg = resolve(&a).expect("valid");
        assert_eq!(cfg.prefill.len(), 2);
        assert_eq!(cfg.decode[0], BackendAddr { host: "d1".into(), port: 8200 });
        let d = parse(&[]);
        let cfg = resolve(&d).expect("defaults");
        assert_eq!(cfg.prefill[0], BackendAddr { host: "localhost".into(), port: 8100 });
        assert_eq!((d.host.as_str(), d.port), ("127.0.0.1", 8000));
    }

    #[test]
    fn vllm_router_flags_parse() {
        let a = parse(&[
            "--vllm-pd-disaggregation",
            "--prefill",
            "http://p1:8100",
            "8998",
            "--prefill",
            "http://[::1]:8101/",
            "--decode",
            "http://d1:8200",
            "--policy",
            "power_of_two",
            "--decode-policy",
            "round_robin",
            "--request-timeout-secs",
            "30",
        ]);
        let cfg = resolve(&a).expect("valid");
        assert_eq!(
            cfg.prefill,
            vec![
                BackendAddr { host: "p1".into(), port: 8100 },
                BackendAddr { host: "::1".into(), port: 8101 }
            ]
        );
        assert_eq!(cfg.decode, vec![BackendAddr { host: "d1".into(), port: 8200 }]);
        assert_eq!((cfg.policy, cfg.decode_policy), (Policy::PowerOfTwo, Some(Policy::RoundRobin)));
        assert_eq!(cfg.request_timeout, Duration::from_secs(30));
        for policy in ["random", "round_robin", "round-robin", "least-loaded", "power-of-two"] {
            let a = parse(&["--prefill", "http://p:1", "none", "--decode", "http://d:2", "--policy", policy]);
            assert!(resolve(&a).is_ok(), "{policy}");
        }
    }

    #[test]
    fn bad_vllm_router_flags_name_the_flag() {
        for (args, flag) in [
            (&["--prefill", "http://p:1"][..], "--prefill/--decode"),
            (&["--vllm-pd-disaggregation"][..], "--prefill/--decode"),
            (&["--prefill", "https://p:1", "--decode", "http://d:2"][..], "--prefill"),
            (&["--prefill", "http://p:1", "x", "--decode", "http://d:2"][..], "--prefill"),
            (&["--prefill", "http://p:1", "--decode", "http://d:2/v1"][..], "--decode"),
        ] {
            let e = resolve(&parse(args)).expect_err("invalid");
            assert_eq!(e.flag, flag, "{args:?}: {e}");
        }
        // The toy proxy's flags and the router's name the same engines: not both.
        let v =
            ["serve-proxy", "--prefill", "http://p:1", "--prefiller-hosts", "h", "--decode", "http://d:2"];
        assert!(Flags::try_parse_from(v).is_err());
        let v = ["serve-proxy", "--policy", "cache_aware"];
        assert!(Flags::try_parse_from(v).is_err(), "only kvx's policies are accepted");
    }

    #[test]
    fn connection_flags_resolve_to_typed_limits_and_bad_ones_name_the_flag() {
        assert_eq!(parse(&[]).conn, ServeConnFlags::default(), "clap's defaults are the constants");
        let cfg = resolve(&parse(&[])).expect("defaults");
        assert_eq!(cfg.conn, ConnLimits::default());
        assert_eq!(
            (cfg.conn.header_read_timeout, cfg.conn.body_read_timeout, cfg.conn.max_connections),
            (Duration::from_secs(10), Duration::from_secs(60), 4096)
        );
        let a =
            parse(&["--header-read-timeout", "500ms", "--body-read-timeout", "2m", "--max-connections", "8"]);
        let cfg = resolve(&a).expect("valid");
        assert_eq!(cfg.conn.header_read_timeout, Duration::from_millis(500));
        assert_eq!(cfg.conn.body_read_timeout, Duration::from_secs(120));
        assert_eq!(cfg.conn.max_connections, 8);
        for (args, flag) in [
            (&["--header-read-timeout", "0s"][..], "--header-read-timeout"),
            (&["--body-read-timeout", "0"][..], "--body-read-timeout"),
            (&["--max-connections", "0"][..], "--max-connections"),
            (&["--max-connections", "1048577"][..], "--max-connections"),
        ] {
            let e = resolve(&parse(args)).expect_err("invalid");
            assert_eq!(e.flag, flag, "{args:?}: {e}");
        }
        let v = ["serve-proxy", "--header-read-timeout", "soon"];
        assert!(Flags::try_parse_from(v).is_err(), "a duration, as --timeout takes it");
    }

    #[test]
    fn mismatched_counts_name_the_flags() {
        let a = parse(&["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"]);
        let e = resolve(&a).expect_err("mismatch");
        assert_eq!(e.flag, "--prefiller-hosts/--prefiller-ports");
        assert!(e.reason.contains("Number of prefiller hosts must match number of prefiller ports"));
    }
}
