//! `kvx serve-engine`: flags, validation, and the process around `serve::engine`.
//!
//! Prints `listening on http://HOST:PORT` as the first line on stdout once the socket is
//! bound (with `--port 0` this is how tests and orchestrators learn the port), logs to
//! stderr, and drains in-flight requests on Ctrl-C / SIGTERM.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use crate::Outcome;
use crate::error::ConfigError;
use crate::serve::engine::{self, EngineConfig, EngineState, Role};
use crate::serve::kv::{EngineIdentity, KvBackend, NullKv};

/// Which KV backend the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvBackendKind {
    /// No KV transfer at all: block ids are computed, nothing is held or read. For measuring
    /// the HTTP/proxy path alone; `/metrics` labels it `kv_transfer="none"`.
    Null,
}

#[derive(Debug, Args)]
pub struct ServeEngineArgs {
    /// Role in the P/D pair: `prefill` answers with kv_transfer_params, `decode` loads them.
    #[arg(long, value_enum)]
    pub role: Role,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind; 0 picks a free one (read it from the first stdout line).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model id served on /v1/models and checked against requests' `model`.
    #[arg(long, visible_alias = "served-model-name", default_value = "kvx-synthetic")]
    pub model_name: String,
    /// Tensor-parallel size advertised in kv_transfer_params (`tp_size`).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// KV block size in tokens (blocks per prompt = ceil(tokens / block size)).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Context length: prompt + max_tokens must fit; also the default max_tokens bound.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// Simulated prefill throughput in tokens/s (0 = instant prefill).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_tokens_per_s: f64,
    /// Inter-token latency in milliseconds for generated tokens (0 = as fast as possible).
    #[arg(long, default_value_t = 0.0)]
    pub itl_ms: f64,
    /// Require `Authorization: Bearer <KEY>` on /v1/* (as vLLM's --api-key).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests generating at once; more wait (vllm:num_requests_waiting).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// The synthetic model samples EOS as its N-th token (unless ignore_eos); default never.
    #[arg(long, value_name = "N")]
    pub eos_at: Option<u64>,
    /// Engine id advertised as `remote_engine_id` (default: a random uuid4).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Side-channel host advertised as `remote_host` (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST).
    #[arg(long, default_value = "localhost")]
    pub side_channel_host: String,
    /// Side-channel port advertised as `remote_port` (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT).
    #[arg(long, default_value_t = 5600)]
    pub side_channel_port: u16,
    /// KV backend. Only `null` exists so far; the worker-backed backend plugs in here.
    #[arg(long, value_enum, default_value = "null")]
    pub kv_backend: KvBackendKind,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

/// Checks the flags and builds the engine settings.
pub fn resolve(a: &ServeEngineArgs) -> Result<EngineConfig, ConfigError> {
    if a.tp == 0 {
        return Err(ConfigError::new("--tp", "tensor-parallel size must be at least 1"));
    }
    if a.block_size == 0 {
        return Err(ConfigError::new("--block-size", "block size must be at least 1 token"));
    }
    if a.max_model_len < 2 {
        return Err(ConfigError::new("--max-model-len", "context must hold a prompt and one token (>= 2)"));
    }
    if !(a.prefill_tokens_per_s.is_finite() && a.prefill_tokens_per_s >= 0.0) {
        return Err(ConfigError::new("--prefill-tokens-per-s", "must be a finite number >= 0 (0 = instant)"));
    }
    if !(a.itl_ms.is_finite() && (0.0..=60_000.0).contains(&a.itl_ms)) {
        return Err(ConfigError::new("--itl-ms", "must be between 0 and 60000 milliseconds"));
    }
    if a.max_num_seqs == 0 {
        return Err(ConfigError::new("--max-num-seqs", "must be at least 1"));
    }
    if a.eos_at == Some(0) {
        return Err(ConfigError::new("--eos-at", "EOS position counts from 1"));
    }
    Ok(EngineConfig {
        role: a.role,
        model_name: a.model_name.clone(),
        max_model_len: a.max_model_len,
        block_size_tokens: a.block_size,
        tp_size: a.tp,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        itl: Duration::from_secs_f64(a.itl_ms / 1000.0),
        api_key: a.api_key.clone(),
        max_num_seqs: a.max_num_seqs,
        eos_at: a.eos_at,
    })
}

pub fn run(args: &ServeEngineArgs) -> anyhow::Result<Outcome> {
    let cfg = resolve(args)?;
    init_tracing();
    let identity = EngineIdentity {
        engine_id: args.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
        side_channel_host: args.side_channel_host.clone(),
        side_channel_port: args.side_channel_port,
        tp_size: args.tp,
    };
    let backend: Arc<dyn KvBackend> = match args.kv_backend {
        KvBackendKind::Null => Arc::new(NullKv::new(identity.clone())),
    };
    let rt = runtime(args.threads)?;
    rt.block_on(async move {
        let listener = bind(&args.host, args.port).await?;
        announce(&listener)?;
        tracing::info!(
            role = cfg.role.as_str(),
            model = %cfg.model_name,
            engine_id = %identity.engine_id,
            kv_backend = "null (NullKv: no KV transfer)",
            "kvx serve-engine ready"
        );
        let state = EngineState::new(cfg, backend);
        engine::serve(listener, state, shutdown_signal()).await.context("serving HTTP")
    })?;
    Ok(Outcome::Ok)
}

/// A multi-threaded tokio runtime with `threads` workers (default: one per CPU).
pub(crate) fn runtime(threads: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        if n == 0 {
            return Err(ConfigError::new("--threads", "must be at least 1").into());
        }
        b.worker_threads(n);
    }
    b.enable_all().build().context("starting tokio")
}

/// Binds `host:port` (host may be a name such as `localhost`).
pub(crate) async fn bind(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| ConfigError::new("--host/--port", format!("cannot bind {host}:{port}: {e}")).into())
}

/// Prints the bound address as the first stdout line and flushes it.
pub(crate) fn announce(listener: &tokio::net::TcpListener) -> anyhow::Result<SocketAddr> {
    use std::io::Write as _;
    let addr = listener.local_addr().context("reading the bound address")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on http://{addr}")?;
    out.flush()?;
    Ok(addr)
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Logs to stderr, filtered by `KVX_LOG` (default `kvx=info`). Safe to call twice.
pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(crate::settings::env::KVX_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("kvx=info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .try_init();
}
