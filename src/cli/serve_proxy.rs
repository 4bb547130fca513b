//! `kvx serve-proxy`: the flags of vLLM's `toy_proxy_server.py` and the P/D flags of vLLM's
//! Rust router (`settings::proxy`, which checks them), so launch scripts for either work
//! unchanged, plus timeouts, health checks and API keys; runs `serve::proxy`.
//!
//! Prints `listening on http://HOST:PORT` as the first stdout line once bound.

use anyhow::Context as _;
use clap::Args;

use super::serve_engine::{announce, bind, fit_open_files, runtime, shutdown_signal};
use crate::config::serve::BackendAddr;
use crate::error::ConfigError;
use crate::error::Outcome;
use crate::serve::proxy::{self, ProxyState};
use crate::settings::proxy::{ServeProxyFlags, resolve};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    kvx serve-proxy --port 8192 --prefiller-hosts localhost --prefiller-ports 8100 --decoder-hosts localhost --decoder-ports 8200\n  \
    kvx serve-proxy --vllm-pd-disaggregation --prefill http://localhost:8100 --decode http://localhost:8200 --policy round_robin")]
#[command(allow_negative_numbers = true)]
pub struct ServeProxyArgs {
    #[command(flatten)]
    pub settings: ServeProxyFlags,
}

pub fn run(args: &ServeProxyArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    let cfg = resolve(args)?;
    fit_open_files(cfg.conn.max_connections);
    let state = ProxyState::new(cfg.clone())
        .map_err(|e| ConfigError::new("--prefiller-hosts/--decoder-hosts", e.message))?;
    let rt = runtime(args.threads)?;
    rt.block_on(async move {
        let listener = bind(&args.host, args.port).await?;
        // Handlers first, then the address: a signal once it is announced is a clean shutdown.
        let stop = shutdown_signal();
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
        proxy::serve(listener, state, stop).await.context("serving HTTP")
    })?;
    Ok(Outcome::Ok)
}
