//! `kvx serve-engine`: flags, validation, and the process around `serve::http_engine`.
//!
//! Prints `listening on http://HOST:PORT` as the first line on stdout once the socket is
//! bound (with `--port 0` this is how tests and orchestrators learn the port), then starts
//! the KV workers (one `kvx worker` process per TP rank, `--kv-backend workers`), and only
//! then accepts requests. Logs to stderr; on Ctrl-C / SIGTERM drains in-flight requests and
//! stops the workers (a prefill engine waits at most one lease for blocks still held). Raises
//! its open-file limit so that `--max-connections` connections fit (as the proxy does).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;

use crate::error::ConfigError;
use crate::error::Outcome;
use crate::serve::http_engine::{self, EngineState};
use crate::serve::kv::{KvBackend, NullKv};
use crate::serve::workers::WorkerKv;
use crate::settings::env::ProcessEnv;
pub use crate::settings::workers::{KvBackendKind, KvSettings, ServeEngineSettings};
use crate::settings::workers::{ServeEngineFlags, resolve_serve_engine};
use crate::vocab::kinds::Role;

/// `--itl-ms` default: [`crate::config::serve::DEFAULT_ITL`] in milliseconds.
pub use crate::settings::workers::DEFAULT_ITL_MS;

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    kvx serve-engine --role prefill --port 8100 --tp 2 --model llama-3.1-8b --side-channel-port 5600\n  \
    kvx serve-engine --role decode --port 8200 --tp 2 --model llama-3.1-8b --itl-ms 10\n  \
    kvx serve-engine --role decode --port 8200 --kv-backend null   # HTTP only, no KV moves")]
#[command(allow_negative_numbers = true)]
pub struct ServeEngineArgs {
    #[command(flatten)]
    pub settings: ServeEngineFlags,
}

/// Checks the flags and builds the engine settings (`settings::workers`).
pub fn resolve(a: &ServeEngineArgs) -> Result<ServeEngineSettings, ConfigError> {
    resolve_serve_engine(&a.settings, &ProcessEnv::read().exe)
}

pub fn run(args: &ServeEngineArgs) -> anyhow::Result<Outcome> {
    let settings = resolve(args)?;
    let args = &args.settings;
    if let KvSettings::Workers(w) = &settings.kv {
        // What this host lacks for device pools is said before anything starts.
        crate::config::engine::check_places(w.mem.iter().copied())?;
    }
    let cfg = settings.http;
    fit_open_files(cfg.conn.max_connections);
    let std_listener = std::net::TcpListener::bind((args.host.as_str(), args.port)).map_err(|e| {
        ConfigError::new("--host/--port", format!("cannot bind {}:{}: {e}", args.host, args.port))
    })?;
    std_listener.set_nonblocking(true).context("listener")?;
    let addr = std_listener.local_addr().context("reading the bound address")?;
    let rt = runtime(args.threads)?;
    let workers = rt.block_on(async move {
        // Registered before the workers start, so a SIGTERM during startup still stops them,
        // and before the address is announced: a signal sent once the engine said where it
        // listens is a clean shutdown, never the default action.
        let mut stop = Box::pin(shutdown_signal());
        announce_addr(addr)?;
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
                    return Ok::<_, anyhow::Error>((Some(kv), None));
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
        let state = EngineState::new(cfg, backend.clone());
        // A KV worker that dies ends the engine too (exit 2, below): an engine answering 503
        // for ever would never be restarted by its supervisor.
        let died: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let watch = {
            let died = died.clone();
            async move {
                let why = worker_death(backend.as_ref()).await;
                if let Ok(mut d) = died.lock() {
                    *d = Some(why);
                }
            }
        };
        let stop = async move {
            tokio::select! {
                () = stop => {},
                () = watch => {},
            }
        };
        http_engine::serve(listener, state, stop).await.context("serving HTTP")?;
        let died = died.lock().ok().and_then(|mut d| d.take());
        Ok((workers, died))
    })?;
    drop(rt);
    let (workers, died) = workers;
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
    if let Some(why) = died {
        anyhow::bail!(
            "a KV worker died ({why}): kvx serve-engine stopped serving so that its supervisor can restart it"
        );
    }
    Ok(Outcome::Ok)
}

/// Resolves once the backend reports that it cannot serve any more (a worker process died),
/// with why; never for a backend that stays healthy. Checked every [`WORKER_WATCH`].
async fn worker_death(backend: &dyn KvBackend) -> String {
    loop {
        if let Err(why) = backend.health() {
            return why;
        }
        tokio::time::sleep(WORKER_WATCH).await;
    }
}

/// How often the engine checks that its KV workers are alive: a death ends it within this
/// (plus the engine's own detection of the dead process, which is immediate).
const WORKER_WATCH: std::time::Duration = std::time::Duration::from_millis(200);

/// File descriptors kept for what a serving process opens besides its clients' connections:
/// its listener, its connections to the engines (proxy) or its KV workers' sockets (engine),
/// logs and libraries.
const FD_RESERVE: u64 = 256;

/// Raises the soft open-file limit (up to the hard one) so that `max_connections` client
/// connections fit beside [`FD_RESERVE`]; warns when they cannot: past the limit a connection
/// cannot be accepted and waits in the listen backlog instead of getting its 503.
pub(crate) fn fit_open_files(max_connections: usize) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let want = u64::try_from(max_connections).unwrap_or(u64::MAX).saturating_add(FD_RESERVE);
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    if soft >= want {
        return;
    }
    let raised = want.min(hard);
    let limit = if setrlimit(Resource::RLIMIT_NOFILE, raised, hard).is_ok() { raised } else { soft };
    if limit < want {
        tracing::warn!(
            open_file_limit = limit,
            max_connections,
            "the open-file limit leaves room for about {} connections, fewer than --max-connections: \
             raise it (ulimit -n) or lower --max-connections",
            limit.saturating_sub(FD_RESERVE)
        );
    } else {
        tracing::debug!(from = soft, to = limit, "open-file limit raised for --max-connections");
    }
}

/// A multi-threaded tokio runtime with `threads` workers (default: one per CPU; settings
/// refused `--threads 0`).
pub(crate) fn runtime(threads: Option<usize>) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads.filter(|&n| n > 0) {
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
    use std::time::Duration;

    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn try_parse(args: &[&str]) -> Result<ServeEngineArgs, clap::Error> {
        let mut v = vec!["kvx", "serve-engine"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v)?.command {
            Command::ServeEngine(a) => Ok(*a),
            _ => panic!("wrong subcommand"),
        }
    }

    fn parse(args: &[&str]) -> ServeEngineArgs {
        try_parse(args).expect("parses")
    }

    fn workers(s: &ServeEngineSettings) -> &crate::config::engine::EngineConfig {
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
        assert_eq!(w.worker.role, crate::vocab::kinds::Role::Prefill);
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
        assert_eq!(s.http.itl, crate::config::serve::DEFAULT_ITL);
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
            // A bad choice is refused as the flags are parsed; the others as they are resolved.
            let e = match try_parse(&v) {
                Ok(a) => resolve(&a).expect_err("invalid").to_string(),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(flag), "{args:?}: {e}");
        }
    }
}
