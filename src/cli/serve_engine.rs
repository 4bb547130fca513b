//! `kvx serve-engine`: flags, validation, and the process around `serve::engine`.
//!
//! Prints `listening on http://HOST:PORT` as the first line on stdout once the socket is
//! bound (with `--port 0` this is how tests and orchestrators learn the port), then starts
//! the KV workers (one `kvx worker` process per TP rank, `--kv-backend workers`), and only
//! then accepts requests. Logs to stderr; on Ctrl-C / SIGTERM drains in-flight requests and
//! stops the workers (a prefill engine waits at most one lease for blocks still held).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::common::ModelArgs;
use crate::Outcome;
use crate::error::ConfigError;
use crate::serve::engine::{self, EngineState, Role};
use crate::serve::kv::{KvBackend, NullKv};
use crate::serve::workers::WorkerKv;
pub use crate::settings::engine::{KvBackendKind, KvSettings, ServeEngineSettings};
use crate::settings::engine::{ServeEngineFlags, resolve_serve_engine};
use crate::settings::env::ProcessEnv;
use crate::settings::parse::parse_duration;

/// `--itl-ms` default: [`crate::serve::engine::DEFAULT_ITL`] in milliseconds.
pub const DEFAULT_ITL_MS: f64 = 15.0;

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    kvx serve-engine --role prefill --port 8100 --tp 2 --model llama-3.1-8b --side-channel-port 5600\n  \
    kvx serve-engine --role decode --port 8200 --tp 2 --model llama-3.1-8b --itl-ms 10\n  \
    kvx serve-engine --role decode --port 8200 --kv-backend null   # HTTP only, no KV moves")]
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
    /// Model id served on /v1/models and checked against requests' `model` [default: the
    /// --model preset's name, else kvx-synthetic].
    #[arg(long, visible_alias = "served-model-name")]
    pub model_name: Option<String>,
    /// Tensor-parallel size: worker processes started, and `tp_size` in kv_transfer_params.
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
    /// Inter-token latency in milliseconds: one decode step of a real engine (10-30 ms for
    /// 8B-70B models on current GPUs). 0 sends all tokens at once: clients then report an
    /// ITL and TPOT of zero, and the engine's Server-Timing says pacing is off.
    #[arg(long, default_value_t = DEFAULT_ITL_MS)]
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
    /// Side-channel host: the prefill engine binds its side channel (and its ranks their
    /// notification listeners) there and advertises it as `remote_host`
    /// (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST).
    #[arg(long, default_value = "localhost")]
    pub side_channel_host: String,
    /// Side-channel port of a prefill engine; 0 binds an ephemeral one, and `remote_port`
    /// in kv_transfer_params carries the real port (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT).
    #[arg(long, default_value_t = 5600)]
    pub side_channel_port: u16,
    /// KV backend: real worker processes and UCX reads, or none (HTTP-only measurements).
    #[arg(long, value_enum, default_value = "workers")]
    pub kv_backend: KvBackendKind,
    /// Runtime worker threads (default: one per CPU).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Which vLLM release's rules to follow: 0.33 or 0.19 [default: 0.33].
    #[arg(long, value_name = "VERSION", help_heading = "KV workers")]
    pub vllm: Option<String>,
    /// KV cache layout of this engine (0.33: LBHNC=HND, LBNHC=NHD, ...; 0.19: HND, NHD, ...).
    /// A decode engine learns the prefill engine's layout at handshake time.
    #[arg(long, value_name = "LAYOUT", help_heading = "KV workers")]
    pub layout: Option<String>,
    /// Blocks in the KV pool of each rank [default: 4 prompts of --max-model-len within 512
    /// MiB per rank, and never less than one prompt; pages are touched only as blocks are used].
    #[arg(long, value_name = "N", help_heading = "KV workers")]
    pub pool_blocks: Option<u32>,
    /// Block allocation pattern: contiguous, fragmented, random.
    #[arg(long, default_value = "contiguous", help_heading = "KV workers")]
    pub alloc: String,
    /// Lease the prefill ranks hold blocks under (vLLM kv_lease_duration).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, default_value = "30s", help_heading = "KV workers")]
    pub lease: Duration,
    /// Deadline of every KV wait: handshake, reads, notifications.
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, default_value = "5s", help_heading = "KV workers")]
    pub timeout: Duration,
    /// Check the bytes a decode engine read: full, sample, off.
    #[arg(long, default_value = "sample", help_heading = "KV workers")]
    pub verify: String,
    /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
    #[arg(long, help_heading = "KV workers")]
    pub ucx_lib: Option<PathBuf>,
    /// UCX_TLS for the workers, e.g. posix,cma,self or tcp.
    #[arg(long, help_heading = "KV workers")]
    pub ucx_tls: Option<String>,
    /// UCX error-handling mode: none or peer.
    #[arg(long, default_value = "none", help_heading = "KV workers")]
    pub err_mode: String,
    /// UCX progress: busy, wait, hybrid.
    #[arg(long, default_value = "hybrid", help_heading = "KV workers")]
    pub progress: String,
    /// GETs in flight per source rank.
    #[arg(long, default_value_t = 64, help_heading = "KV workers")]
    pub inflight: u32,
    /// Post coalesced descriptors instead of vLLM's one per block and region.
    #[arg(long, help_heading = "KV workers")]
    pub coalesce: bool,
    /// Back the KV pools with huge pages.
    #[arg(long, help_heading = "KV workers")]
    pub huge_pages: bool,
    /// Memory of the KV pools: host or cuda.
    #[arg(long, default_value = "host", help_heading = "KV workers")]
    pub mem: String,
    /// GPUs of --mem cuda, e.g. 0,1: this engine's ranks round-robin [default: 0].
    #[arg(long, value_delimiter = ',', help_heading = "KV workers")]
    pub devices: Option<Vec<u32>>,
    /// One GPU for every rank of --mem cuda (--devices N).
    #[arg(long, value_name = "N", conflicts_with = "devices", help_heading = "KV workers")]
    pub device: Option<u32>,
    /// Who moves the KV: pull (decode reads, vLLM's NixlConnector) or push (prefill writes into
    /// the blocks decode registers, NixlPushConnector); both engines must use the same [default: pull].
    #[arg(long, value_name = "pull|push", help_heading = "KV workers")]
    pub mode: Option<String>,
}

impl ServeEngineArgs {
    /// The flags as plain data, for `settings::engine` (host, port and threads are this
    /// process's own: they stay here).
    pub fn flags(&self) -> ServeEngineFlags {
        ServeEngineFlags {
            role: self.role,
            model_name: self.model_name.clone(),
            tp: self.tp,
            block_size: self.block_size,
            max_model_len: self.max_model_len,
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            itl_ms: self.itl_ms,
            api_key: self.api_key.clone(),
            max_num_seqs: self.max_num_seqs,
            eos_at: self.eos_at,
            engine_id: self.engine_id.clone(),
            side_channel_host: self.side_channel_host.clone(),
            side_channel_port: self.side_channel_port,
            kv_backend: self.kv_backend,
            model: self.model.flags(),
            vllm: self.vllm.clone(),
            layout: self.layout.clone(),
            pool_blocks: self.pool_blocks,
            alloc: self.alloc.clone(),
            lease: self.lease,
            timeout: self.timeout,
            verify: self.verify.clone(),
            ucx_lib: self.ucx_lib.clone(),
            ucx_tls: self.ucx_tls.clone(),
            err_mode: self.err_mode.clone(),
            progress: self.progress.clone(),
            inflight: self.inflight,
            coalesce: self.coalesce,
            huge_pages: self.huge_pages,
            mem: self.mem.clone(),
            devices: self.devices.clone().or(self.device.map(|d| vec![d])),
            mode: self.mode.clone(),
        }
    }
}

/// Checks the flags and builds the engine settings (`settings::engine`).
pub fn resolve(a: &ServeEngineArgs) -> Result<ServeEngineSettings, ConfigError> {
    resolve_serve_engine(&a.flags(), &ProcessEnv::read().exe)
}

pub fn run(args: &ServeEngineArgs) -> anyhow::Result<Outcome> {
    let settings = resolve(args)?;
    if let KvSettings::Workers(w) = &settings.kv {
        // What this host lacks for device pools is said before anything starts.
        crate::pipeline::setup::check_places(w.mem.iter().copied())?;
    }
    let cfg = settings.http;
    let std_listener = std::net::TcpListener::bind((args.host.as_str(), args.port)).map_err(|e| {
        ConfigError::new("--host/--port", format!("cannot bind {}:{}: {e}", args.host, args.port))
    })?;
    std_listener.set_nonblocking(true).context("listener")?;
    announce_addr(std_listener.local_addr().context("reading the bound address")?)?;
    let rt = runtime(args.threads)?;
    let workers = rt.block_on(async move {
        // Registered before the workers start, so a SIGTERM during startup still stops them.
        let mut stop = Box::pin(shutdown_signal());
        let (backend, workers): (Arc<dyn KvBackend>, Option<Arc<WorkerKv>>) = match settings.kv {
            KvSettings::Null(identity) => {
                tracing::info!(
                    role = cfg.role.as_str(),
                    model = %cfg.model_name,
                    engine_id = %identity.engine_id,
                    kv_backend = "null (NullKv: no KV transfer)",
                    "kvx serve-engine ready"
                );
                (Arc::new(NullKv::new(identity)), None)
            }
            KvSettings::Workers(wcfg) => {
                // Workers come up before the first request is accepted (connections wait in
                // the listen backlog meanwhile).
                let mut start = tokio::task::spawn_blocking(move || WorkerKv::start(*wcfg));
                let (started, stopped) = tokio::select! {
                    r = &mut start => (r, false),
                    () = &mut stop => (start.await, true),
                };
                let kv =
                    Arc::new(started.context("starting the KV workers")?.context("starting the KV workers")?);
                if stopped {
                    return Ok::<_, anyhow::Error>(Some(kv));
                }
                let info = kv.info();
                let side_channel = match cfg.role {
                    Role::Prefill => format!("{}:{}", info.side_channel_host, info.side_channel_port),
                    Role::Decode => "none (decode)".to_string(),
                };
                tracing::info!(
                    role = cfg.role.as_str(),
                    model = %cfg.model_name,
                    engine_id = %info.engine_id,
                    tp = info.tp,
                    side_channel = %side_channel,
                    ucx = %format!("{} ({})", info.ucx_version, info.ucx_library),
                    pool_blocks = info.pool_blocks,
                    pool_bytes_per_rank = info.pool_bytes_per_rank,
                    "kvx serve-engine ready (KV backend: workers)"
                );
                (kv.clone(), Some(kv))
            }
        };
        let listener = tokio::net::TcpListener::from_std(std_listener).context("listener")?;
        let state = EngineState::new(cfg, backend);
        engine::serve(listener, state, stop).await.context("serving HTTP")?;
        Ok(workers)
    })?;
    drop(rt);
    if let Some(kv) = workers
        && let Some(fin) = kv.shutdown()
    {
        tracing::info!(
            blocks_leaked = fin.blocks_leaked,
            leases_expired = fin.leases_expired,
            dead_ranks = ?fin.dead_ranks,
            "KV workers stopped"
        );
    }
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
    announce_addr(listener.local_addr().context("reading the bound address")?)
}

/// Prints `listening on http://ADDR` as the first stdout line and flushes it.
pub(crate) fn announce_addr(addr: SocketAddr) -> anyhow::Result<SocketAddr> {
    crate::output::stdout_line(format_args!("listening on http://{addr}"))?;
    Ok(addr)
}

/// Resolves on Ctrl-C or SIGTERM. The handlers are installed when this is called (inside a
/// runtime), not when the future is first polled.
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                () = wait(term) => {},
                () = wait(int) => {},
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn parse(args: &[&str]) -> ServeEngineArgs {
        let mut v = vec!["kvx", "serve-engine"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v).expect("parses").command {
            Command::ServeEngine(a) => *a,
            _ => panic!("wrong subcommand"),
        }
    }

    fn workers(s: &ServeEngineSettings) -> &crate::pipeline::engine::EngineConfig {
        match &s.kv {
            KvSettings::Workers(w) => w,
            KvSettings::Null(_) => panic!("expected the workers backend"),
        }
    }

    #[test]
    fn workers_is_the_default_and_the_engine_spec_comes_from_tp_and_block_size() {
        let a = parse(&["--role", "prefill", "--tp", "2", "--block-size", "32", "--model", "llama-3.1-8b"]);
        let s = resolve(&a).expect("valid");
        assert_eq!(s.http.model_name, "llama-3.1-8b", "served under the preset's name");
        let w = workers(&s);
        assert_eq!((w.tp, w.block_tokens, w.worker.pair.p.tp, w.worker.pair.p.block_tokens), (2, 32, 2, 32));
        assert_eq!(w.worker.role, crate::pipeline::proto::Role::Prefill);
        assert_eq!(w.side_channel_bind.as_deref(), Some("tcp://127.0.0.1:5600"), "localhost binds loopback");
        // 8192 tokens / 32 = 256 blocks per prompt; 4 prompts of 4 MiB blocks exceed 512 MiB.
        let block = w.worker.pair.p_geometry(0).block_bytes_all_layers();
        assert_eq!(block, 32 * 2 * 4 * 128 * 2 * 32);
        assert_eq!(w.pool_blocks, 256, "never less than one --max-model-len prompt");
        let d = parse(&[
            "--role",
            "decode",
            "--max-model-len",
            "256",
            "--block-size",
            "16",
            "--kv-backend",
            "workers",
        ]);
        let w = workers(&resolve(&d).expect("valid")).clone();
        assert_eq!(w.pool_blocks, 64, "4 prompts of 16 blocks fit the budget");
        assert_eq!(w.side_channel_bind, None, "decode engines serve no side channel");
        let n = parse(&["--role", "decode", "--kv-backend", "null"]);
        assert!(matches!(resolve(&n).expect("valid").kv, KvSettings::Null(_)));
    }

    #[test]
    fn default_pacing_is_a_real_decode_step() {
        let s = resolve(&parse(&["--role", "decode", "--kv-backend", "null"])).expect("valid");
        assert_eq!(s.http.itl, engine::DEFAULT_ITL);
        assert!(s.http.itl >= Duration::from_millis(10) && s.http.itl <= Duration::from_millis(30));
        let s =
            resolve(&parse(&["--role", "decode", "--kv-backend", "null", "--itl-ms", "0"])).expect("valid");
        assert_eq!(s.http.itl, Duration::ZERO);
    }

    #[test]
    fn bad_workers_flags_name_the_flag() {
        for (args, flag) in [
            (&["--layout", "XYZ"][..], "--layout"),
            (&["--verify", "most"][..], "--verify"),
            (&["--alloc", "spread"][..], "--alloc"),
            (&["--pool-blocks", "0"][..], "--pool-blocks"),
            (&["--progress", "spin"][..], "--progress"),
            (&["--tp", "3", "--model", "llama-3.1-8b"][..], "--tp"),
        ] {
            let mut v = vec!["--role", "decode"];
            v.extend_from_slice(args);
            let e = resolve(&parse(&v)).expect_err("invalid");
            assert!(e.flag.contains(flag), "{args:?}: {e}");
        }
    }
}
