//! `kvx serve-proxy`: the flags of vLLM's `toy_proxy_server.py` (so its scripts work
//! unchanged) plus policy, timeouts, health checks and API keys; runs `serve::proxy`.
//!
//! Prints `listening on http://HOST:PORT` as the first stdout line once bound.

use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::serve_engine::{announce, bind, runtime, shutdown_signal};
use crate::Outcome;
use crate::error::ConfigError;
use crate::serve::proxy::{self, BackendAddr, Policy, ProxyConfig, ProxyState};

#[derive(Debug, Args)]
pub struct ServeProxyArgs {
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
    /// How an engine is chosen within each pool.
    #[arg(long, value_enum, default_value = "round-robin")]
    pub policy: Policy,
    /// TCP connect timeout per attempt, in seconds.
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    pub connect_timeout: f64,
    /// Prefill: whole response; decode: until response headers. Seconds.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub request_timeout: f64,
    /// Require `Authorization: Bearer <KEY>` from clients on /v1/*.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Bearer token sent to the engines (default: --api-key).
    #[arg(long, env = crate::settings::env::OPENAI_API_KEY, hide_env_values = true)]
    pub backend_api_key: Option<String>,
    /// Seconds between background `GET /health` probes of every engine (0 = off).
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    pub health_interval: f64,
    /// Timeout of one health probe, in seconds.
    #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
    pub health_timeout: f64,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
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
    Ok(hosts.iter().zip(ports).map(|(h, &p)| BackendAddr { host: h.clone(), port: p }).collect())
}

/// Checks the flags and builds the proxy settings.
pub fn resolve(a: &ServeProxyArgs) -> Result<ProxyConfig, ConfigError> {
    let prefill =
        pair(&a.prefiller_hosts, &a.prefiller_ports, "prefiller", "--prefiller-hosts/--prefiller-ports")?;
    let decode = pair(&a.decoder_hosts, &a.decoder_ports, "decoder", "--decoder-hosts/--decoder-ports")?;
    Ok(ProxyConfig {
        prefill,
        decode,
        policy: a.policy,
        connect_timeout: seconds("--connect-timeout", a.connect_timeout, false)?,
        request_timeout: seconds("--request-timeout", a.request_timeout, false)?,
        api_key: a.api_key.clone(),
        backend_api_key: a.backend_api_key.clone().or_else(|| a.api_key.clone()),
        health_interval: seconds("--health-interval", a.health_interval, true)?,
        health_timeout: seconds("--health-timeout", a.health_timeout, false)?,
    })
}

pub fn run(args: &ServeProxyArgs) -> anyhow::Result<Outcome> {
    let cfg = resolve(args)?;
    let state = ProxyState::new(cfg.clone())
        .map_err(|e| ConfigError::new("--prefiller-hosts/--decoder-hosts", e.message))?;
    let rt = runtime(args.threads)?;
    rt.block_on(async move {
        let listener = bind(&args.host, args.port).await?;
        announce(&listener)?;
        let list = |v: &[BackendAddr]| {
            v.iter().map(|b| format!("{}:{}", b.host, b.port)).collect::<Vec<_>>().join(",")
        };
        tracing::info!(
            prefill = %list(&cfg.prefill),
            decode = %list(&cfg.decode),
            policy = ?cfg.policy,
            "kvx serve-proxy ready"
        );
        proxy::serve(listener, state, shutdown_signal()).await.context("serving HTTP")
    })?;
    Ok(Outcome::Ok)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn parse(args: &[&str]) -> ServeProxyArgs {
        let mut v = vec!["kvx", "serve-proxy"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).expect("parses").command {
            Command::ServeProxy(a) => a,
            _ => panic!("wrong subcommand"),
        }
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
    fn mismatched_counts_name_the_flags() {
        let a = parse(&["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"]);
        let e = resolve(&a).expect_err("mismatch");
        assert_eq!(e.flag, "--prefiller-hosts/--prefiller-ports");
        assert!(e.reason.contains("Number of prefiller hosts must match number of prefiller ports"));
    }
}
