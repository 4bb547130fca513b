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
use clap::{Args, ValueEnum};

use super::common::{ModelArgs, PairArgs};
use super::xfer::parse_duration;
use crate::Outcome;
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::pipeline::engine::{EngineConfig as WorkerEngineConfig, Launch};
use crate::pipeline::proto::{self, TransportConfig, TransportKind, VerifyMode, WorkerConfig};
use crate::serve::engine::{self, EngineConfig, EngineState, Role};
use crate::serve::kv::{EngineIdentity, KvBackend, NullKv};
use crate::serve::workers::WorkerKv;
use crate::settings::scenario;

/// Which KV backend the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvBackendKind {
    /// One `kvx worker` process per TP rank holding a registered KV pool: the prefill
    /// engine fills and holds blocks and serves its side channel; the decode engine
    /// handshakes, reads them with one-sided UCX GETs, verifies and notifies.
    Workers,
    /// No KV transfer at all: block ids are computed, nothing is held or read. For measuring
    /// the HTTP/proxy path alone; `/metrics` labels it `kv_transfer="none"`.
    Null,
}

/// `--itl-ms` default: [`engine::DEFAULT_ITL`] in milliseconds.
pub const DEFAULT_ITL_MS: f64 = 15.0;

/// Per-rank pool budget used when `--pool-blocks` is not given.
pub const DEFAULT_POOL_BYTES_PER_RANK: u64 = 512 << 20;

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
    #[arg(long, value_parser = parse_duration, default_value = "30s", help_heading = "KV workers")]
    pub lease: Duration,
    /// Deadline of every KV wait: handshake, reads, notifications.
    #[arg(long, value_parser = parse_duration, default_value = "5s", help_heading = "KV workers")]
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
}

/// How the engine's KV side is built.
#[derive(Debug, Clone)]
pub enum KvSettings {
    Null(EngineIdentity),
    Workers(Box<WorkerEngineConfig>),
}

/// Everything `kvx serve-engine` runs with.
#[derive(Debug, Clone)]
pub struct ServeEngineSettings {
    pub http: EngineConfig,
    pub kv: KvSettings,
}

/// A bind address for ZMQ, which does not resolve host names when binding.
fn bind_host(host: &str) -> String {
    if host == "localhost" { "127.0.0.1".to_string() } else { host.to_string() }
}

/// Checks the flags and builds the engine settings.
pub fn resolve(a: &ServeEngineArgs) -> Result<ServeEngineSettings, ConfigError> {
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
    let engine_id = a.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let model_name =
        a.model_name.clone().or_else(|| a.model.model.clone()).unwrap_or_else(|| "kvx-synthetic".to_string());
    let http = EngineConfig {
        role: a.role,
        model_name,
        max_model_len: a.max_model_len,
        block_size_tokens: a.block_size,
        tp_size: a.tp,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        itl: Duration::from_secs_f64(a.itl_ms / 1000.0),
        api_key: a.api_key.clone(),
        max_num_seqs: a.max_num_seqs,
        eos_at: a.eos_at,
    };
    let kv = match a.kv_backend {
        KvBackendKind::Null => KvSettings::Null(EngineIdentity {
            engine_id,
            side_channel_host: a.side_channel_host.clone(),
            side_channel_port: a.side_channel_port,
            tp_size: a.tp,
        }),
        KvBackendKind::Workers => KvSettings::Workers(Box::new(resolve_workers(a, engine_id)?)),
    };
    Ok(ServeEngineSettings { http, kv })
}

/// The worker engine behind `--kv-backend workers`: this engine's TP, layout, block size
/// and pool make its side of the pair; the other side is learned at handshake time.
fn resolve_workers(a: &ServeEngineArgs, engine_id: String) -> Result<WorkerEngineConfig, ConfigError> {
    let pair_args = PairArgs {
        p_tp: Some(a.tp),
        d_tp: Some(a.tp),
        vllm: a.vllm.clone(),
        layout: a.layout.clone(),
        block_size: Some(a.block_size),
        ..PairArgs::default()
    };
    // The pair's checks speak of P and D; this engine is one side with its own flags.
    let own_flag = |e: ConfigError| {
        let flag = match e.flag.as_str() {
            "--p-tp" | "--d-tp" => "--tp".to_string(),
            "--p-layout" | "--d-layout" => "--layout".to_string(),
            "--p-block-size" | "--d-block-size" => "--block-size".to_string(),
            other => other.to_string(),
        };
        ConfigError { flag, reason: e.reason }
    };
    // Pool size needs the block size in bytes, which needs the shape: resolve once to size.
    let probe = scenario::resolve_pair(&a.model, &pair_args, 1, 1).map_err(own_flag)?;
    let blocks_per_prompt = u32::try_from(a.max_model_len.div_ceil(u64::from(a.block_size)))
        .map_err(|_| ConfigError::new("--max-model-len", "too many blocks per prompt"))?;
    let block_bytes = probe.p_geometry(0).block_bytes_all_layers().max(1);
    let pool = match a.pool_blocks {
        Some(0) => return Err(ConfigError::new("--pool-blocks", "the pool needs at least 1 block")),
        Some(n) => n,
        None => {
            let budget = u32::try_from(DEFAULT_POOL_BYTES_PER_RANK / block_bytes).unwrap_or(u32::MAX);
            blocks_per_prompt.saturating_mul(4).min(budget).max(blocks_per_prompt).max(1)
        }
    };
    let pair = scenario::resolve_pair(&a.model, &pair_args, pool, pool).map_err(own_flag)?;
    pair.validate().map_err(own_flag)?;
    let alloc: AllocPattern = a.alloc.parse().map_err(|e| ConfigError::new("--alloc", e))?;
    let verify = match a.verify.as_str() {
        "full" => VerifyMode::Full,
        "sample" => VerifyMode::Sample,
        "off" => VerifyMode::Off,
        other => return Err(ConfigError::new("--verify", format!("'{other}' is not full, sample or off"))),
    };
    if !matches!(a.err_mode.as_str(), "none" | "peer") {
        return Err(ConfigError::new("--err-mode", format!("'{}' is not none or peer", a.err_mode)));
    }
    if !matches!(a.progress.as_str(), "busy" | "wait" | "hybrid") {
        return Err(ConfigError::new("--progress", format!("'{}' is not busy, wait or hybrid", a.progress)));
    }
    if a.inflight == 0 || a.inflight > 1 << 16 {
        return Err(ConfigError::new("--inflight", format!("must be 1..65536, got {}", a.inflight)));
    }
    if a.lease.is_zero() || a.timeout.is_zero() {
        return Err(ConfigError::new("--lease", "--lease and --timeout must be longer than 0"));
    }
    let exe = std::env::current_exe()
        .map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    let env: Vec<(String, String)> = a.ucx_tls.iter().map(|t| ("UCX_TLS".to_string(), t.clone())).collect();
    let host = bind_host(&a.side_channel_host);
    let role = match a.role {
        Role::Prefill => proto::Role::Prefill,
        Role::Decode => proto::Role::Decode,
    };
    Ok(WorkerEngineConfig {
        worker: WorkerConfig {
            role,
            rank: 0,
            engine_id,
            pair,
            transport: TransportConfig {
                kind: TransportKind::Ucx,
                chain: vec![],
                ucx_lib: a.ucx_lib.clone(),
                err_mode: a.err_mode.clone(),
                progress: a.progress.clone(),
                ucx_alloc: false,
                huge_pages: a.huge_pages,
                mem: "host".into(),
                device: 0,
                inflight: a.inflight,
                coalesce: a.coalesce,
                notify: Default::default(),
                storage_dir: None,
                storage_direct_io: false,
                storage_fsync: false,
                slowdown: 0.0,
            },
            verify,
            lease_ms: a.lease.as_millis() as u64,
            timeout_ms: a.timeout.as_millis() as u64,
            bind_host: host.clone(),
            advertise_host: if host == "0.0.0.0" { "127.0.0.1".into() } else { host.clone() },
        },
        tp: a.tp,
        pool_blocks: pool,
        block_tokens: a.block_size,
        alloc,
        seed: 0,
        launch: Launch::Spawn { exe, env },
        side_channel_bind: (a.role == Role::Prefill).then(|| format!("tcp://{host}:{}", a.side_channel_port)),
        timeout: a.timeout * 4,
    })
}

pub fn run(args: &ServeEngineArgs) -> anyhow::Result<Outcome> {
    let settings = resolve(args)?;
    let cfg = settings.http;
    init_tracing();
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
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on http://{addr}")?;
    out.flush()?;
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

    fn workers(s: &ServeEngineSettings) -> &WorkerEngineConfig {
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
        assert_eq!(w.worker.role, proto::Role::Prefill);
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
