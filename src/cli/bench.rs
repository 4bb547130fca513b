//! `kvx bench`: flags and bench-config files resolved into `BenchSettings`, the run, the report.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use super::common::{Format, ModelArgs, PairArgs};
use super::xfer::parse_duration;
use crate::Outcome;
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::pipeline::bench::{self, BenchSettings, FailurePolicy};
use crate::pipeline::proto::{TransportConfig, TransportKind, VerifyMode};
use crate::pipeline::workload::{Arrival, PromptLens};
use crate::report::files::{RunWriter, results_root};
use crate::report::summary::{new_run_id, now_rfc3339};
use crate::report::table::{Style, render_summary};
use crate::settings::env;
use crate::settings::scenario;

#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  kvx bench --p-tp 8 --d-tp 2\n  \
    kvx bench --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --requests 50 --concurrency 4\n  \
    kvx bench --config bench-configs/p8d2.toml --repeat 5 --format json\n  \
    kvx bench --sweep bench-configs/layout-sweep.toml\n  \
    kvx bench --p-tp 2 --d-tp 2 --rate 20 --duration 30s --prompt-len 1024..32768 --alloc fragmented")]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub pair: PairArgs,
    /// A bench-config file (TOML; keys are the flag names with underscores). Flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Run a matrix: a bench-config file whose [sweep] table lists values per axis (tp = ["8:2", "4:4"],
    /// layout, prompt_len, alloc, block_size, model, concurrency, inflight, prefix_hit); one row per point.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub sweep: Option<PathBuf>,
    /// Measured requests per repeat [default: 20 unless --duration].
    #[arg(long, help_heading = "Workload")]
    pub requests: Option<u64>,
    /// Measure for this long per repeat instead of a request count (e.g. 30s).
    #[arg(long, value_parser = parse_duration, help_heading = "Workload")]
    pub duration: Option<Duration>,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency", allow_negative_numbers = true, help_heading = "Workload")]
    pub rate: Option<f64>,
    /// Closed loop: requests kept in flight [default: 2].
    #[arg(long, help_heading = "Workload")]
    pub concurrency: Option<u32>,
    /// Prompt length in tokens, fixed (8192) or uniform over a range (1024..32768) [default: 2048].
    #[arg(long, help_heading = "Workload")]
    pub prompt_len: Option<String>,
    /// File of prompt lengths, one per line, cycled.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_len", help_heading = "Workload")]
    pub prompt_lens: Option<PathBuf>,
    /// Unmeasured requests before measuring [default: 2].
    #[arg(long, help_heading = "Workload")]
    pub warmup: Option<u64>,
    /// Fraction of each prompt already cached on decode; only the rest is read.
    #[arg(long, allow_negative_numbers = true, help_heading = "Workload")]
    pub prefix_hit: Option<f64>,
    /// Block allocation pattern: contiguous, fragmented, random [default: contiguous].
    #[arg(long, help_heading = "Workload")]
    pub alloc: Option<String>,
    /// Blocks in each engine's pool [default: enough for the concurrency].
    #[arg(long, help_heading = "Workload")]
    pub pool_blocks: Option<u32>,
    /// Seed of prompt lengths, allocations and byte patterns [default: 0].
    #[arg(long, help_heading = "Workload")]
    pub seed: Option<u64>,
    /// Run the measured part this many times (for noise-aware gates) [default: 1].
    #[arg(long, help_heading = "Workload")]
    pub repeat: Option<u32>,
    /// Check received bytes: full, sample, off [default: full for runs under 2 GiB, else sample].
    #[arg(long, help_heading = "Checks")]
    pub verify: Option<String>,
    /// When a load fails: fail, or recompute (vLLM's kv_load_failure_policy) [default: fail].
    #[arg(long, help_heading = "Checks")]
    pub on_load_failure: Option<String>,
    /// Lease prefill ranks hold blocks under (vLLM kv_lease_duration) [default: 30s].
    #[arg(long, value_parser = parse_duration, help_heading = "Checks")]
    pub lease: Option<Duration>,
    /// Deadline of every wait: handshake, reads, notifications [default: 5s].
    #[arg(long, value_parser = parse_duration, help_heading = "Checks")]
    pub timeout: Option<Duration>,
    /// Transport: ucx, storage, multi [default: ucx].
    #[arg(long, help_heading = "Transport")]
    pub transport: Option<String>,
    /// For --transport multi: the order to try, e.g. ucx,storage.
    #[arg(long, value_delimiter = ',', help_heading = "Transport")]
    pub transports: Option<Vec<String>>,
    /// Shared directory of the storage transport [default: kvx-storage in the temp dir].
    #[arg(long, help_heading = "Transport")]
    pub storage_dir: Option<PathBuf>,
    /// Storage transport: bypass the page cache (O_DIRECT).
    #[arg(long, help_heading = "Transport")]
    pub storage_direct_io: bool,
    /// Storage transport: fdatasync every file before it becomes visible.
    #[arg(long, help_heading = "Transport")]
    pub storage_fsync: bool,
    /// Run the same workload on each transport and print one comparison table, e.g. ucx,storage,multi.
    #[arg(long, value_delimiter = ',', help_heading = "Transport")]
    pub compare_transports: Option<Vec<String>>,
    /// Inject a fault to test resilience: kill-ucx:pR@N (tear down prefill rank R's UCX side after N
    /// measured requests) or exit:pR@N / exit:dR@N (the worker exits).
    #[arg(long, value_name = "FAULT", help_heading = "Checks")]
    pub fault: Option<String>,
    /// Memory of the KV pools: host or cuda [default: host].
    #[arg(long, help_heading = "Transport")]
    pub mem: Option<String>,
    /// GPU of --mem cuda.
    #[arg(long, help_heading = "Transport")]
    pub device: Option<u32>,
    /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
    #[arg(long, help_heading = "Transport")]
    pub ucx_lib: Option<PathBuf>,
    /// UCX_TLS for the workers, e.g. posix,cma,self or tcp.
    #[arg(long, help_heading = "Transport")]
    pub ucx_tls: Option<String>,
    /// UCX error-handling mode: none or peer (peer excludes shared-memory transports) [default: none].
    #[arg(long, help_heading = "Transport")]
    pub err_mode: Option<String>,
    /// UCX progress: busy, wait, hybrid [default: hybrid].
    #[arg(long, help_heading = "Transport")]
    pub progress: Option<String>,
    /// Back the KV pools with huge pages.
    #[arg(long, help_heading = "Transport")]
    pub huge_pages: bool,
    /// GETs in flight per source rank [default: 64].
    #[arg(long, help_heading = "Transport")]
    pub inflight: Option<u32>,
    /// Post coalesced descriptors instead of vLLM's one per block and region.
    #[arg(long, help_heading = "Transport")]
    pub coalesce: bool,
    /// Stage a regression to test a gate: every read waits F times its own duration after it
    /// completes (0.15 makes transfers 15% slower). Recorded in the scenario.
    #[arg(long, value_name = "F", help_heading = "Testing")]
    pub slowdown: Option<f64>,
    /// How decode ranks notify prefill ranks with the UCX transport: ucx (active messages
    /// on the read endpoint, as NIXL does) or zmq [default: ucx].
    #[arg(long, value_enum, help_heading = "Transport")]
    pub notify: Option<crate::transfer::notify::NotifyTransport>,
    /// Wait for external `kvx worker --connect` processes: prefill on this endpoint's port, decode on port + 1.
    #[arg(long, value_name = "tcp://HOST:PORT", help_heading = "Across hosts")]
    pub listen: Option<String>,
    /// Host other hosts reach this one at [default: 127.0.0.1, or the --listen host].
    #[arg(long, help_heading = "Across hosts")]
    pub advertise_host: Option<String>,
    /// Directory runs are written under [default: results/, or KVX_RESULTS_DIR].
    #[arg(long, help_heading = "Output")]
    pub results_dir: Option<PathBuf>,
    /// Name of the run (the scenario name in reports) [default: the config file's name or "bench"].
    #[arg(long, help_heading = "Output")]
    pub name: Option<String>,
    /// Skip the same-run calibration (memcpy and UCX loopback read).
    #[arg(long, help_heading = "Output")]
    pub no_calibrate: bool,
    /// Output format; json prints the summary to stdout as well.
    #[arg(long, value_enum, default_value_t = Format::Table, help_heading = "Output")]
    pub format: Format,
    /// Serve the workload over HTTP: a prefill engine, a decode engine and the P/D proxy,
    /// driven through the proxy by `kvx load`'s generator (TTFT, ITL, TPOT, e2el, the KV stages
    /// and the TTFT waterfall).
    #[arg(long, help_heading = "Workload")]
    pub serve: bool,
    /// With --serve: objectives for goodput, e.g. ttft=200ms,tpot=50ms (also itl, e2el).
    #[arg(long, requires = "serve", value_name = "NAME=LIMIT,...", help_heading = "Workload")]
    pub slo: Option<String>,
    /// With --serve: serve the engines' and proxy's Prometheus metrics (vLLM's families) on this
    /// port while the run goes; 0 picks a free one (its address is printed on stderr).
    #[arg(long, requires = "serve", value_name = "PORT", help_heading = "Output")]
    pub metrics_port: Option<u16>,
}

/// A bench-config file: the flags, by name with underscores.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchFile {
    pub name: Option<String>,
    pub model: Option<String>,
    pub model_config: Option<PathBuf>,
    pub num_kv_heads: Option<u32>,
    pub head_dim: Option<u32>,
    pub layers: Option<u32>,
    pub dtype: Option<String>,
    pub mla: Option<bool>,
    pub p_tp: Option<u32>,
    pub d_tp: Option<u32>,
    pub vllm: Option<String>,
    pub layout: Option<String>,
    pub p_layout: Option<String>,
    pub d_layout: Option<String>,
    pub block_size: Option<u32>,
    pub p_block_size: Option<u32>,
    pub d_block_size: Option<u32>,
    pub permute: Option<bool>,
    pub requests: Option<u64>,
    pub duration: Option<String>,
    pub rate: Option<f64>,
    pub concurrency: Option<u32>,
    pub prompt_len: Option<toml::Value>,
    pub prompt_lens: Option<PathBuf>,
    pub warmup: Option<u64>,
    pub prefix_hit: Option<f64>,
    pub alloc: Option<String>,
    pub pool_blocks: Option<u32>,
    pub seed: Option<u64>,
    pub repeat: Option<u32>,
    pub verify: Option<String>,
    pub on_load_failure: Option<String>,
    pub lease: Option<String>,
    pub timeout: Option<String>,
    pub transport: Option<String>,
    pub transports: Option<Vec<String>>,
    pub storage_dir: Option<PathBuf>,
    pub mem: Option<String>,
    pub ucx_tls: Option<String>,
    pub err_mode: Option<String>,
    pub progress: Option<String>,
    pub huge_pages: Option<bool>,
    pub inflight: Option<u32>,
    pub coalesce: Option<bool>,
    pub notify: Option<crate::transfer::notify::NotifyTransport>,
    /// Sweep files: the axes to vary (read by `--sweep`).
    pub sweep: Option<toml::Table>,
}

impl BenchFile {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("--config", format!("cannot read {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| ConfigError::new("--config", format!("{}: {e}", path.display())))
    }
}

fn dur(flag: &str, v: Option<&str>) -> Result<Option<Duration>, ConfigError> {
    v.map(|s| parse_duration(s).map_err(|e| ConfigError::new(flag, e))).transpose()
}

/// Flags over file over defaults.
pub fn resolve(args: &BenchArgs) -> Result<BenchSettings, ConfigError> {
    let file = match &args.config {
        Some(p) => BenchFile::load(p)?,
        None => BenchFile::default(),
    };
    let model = ModelArgs {
        model: args.model.model.clone().or(file.model.clone()),
        model_config: args.model.model_config.clone().or(file.model_config.clone()),
        num_kv_heads: args.model.num_kv_heads.or(file.num_kv_heads),
        head_dim: args.model.head_dim.or(file.head_dim),
        layers: args.model.layers.or(file.layers),
        dtype: args.model.dtype.clone().or(file.dtype.clone()),
        mla: args.model.mla || file.mla.unwrap_or(false),
        mla_dim: args.model.mla_dim,
    };
    let pair_args = PairArgs {
        p_tp: args.pair.p_tp.or(file.p_tp),
        d_tp: args.pair.d_tp.or(file.d_tp),
        vllm: args.pair.vllm.clone().or(file.vllm.clone()),
        layout: args.pair.layout.clone().or(file.layout.clone()),
        p_layout: args.pair.p_layout.clone().or(file.p_layout.clone()),
        d_layout: args.pair.d_layout.clone().or(file.d_layout.clone()),
        block_size: args.pair.block_size.or(file.block_size),
        p_block_size: args.pair.p_block_size.or(file.p_block_size),
        d_block_size: args.pair.d_block_size.or(file.d_block_size),
        permute: args.pair.permute || file.permute.unwrap_or(false),
    };
    let lens = match (&args.prompt_len, &args.prompt_lens, &file.prompt_len, &file.prompt_lens) {
        (Some(s), _, _, _) => s.parse::<PromptLens>().map_err(|e| ConfigError::new("--prompt-len", e))?,
        (None, Some(p), _, _) => PromptLens::from_file(p)?,
        (None, None, Some(v), _) => {
            let s = match v {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            s.parse::<PromptLens>().map_err(|e| ConfigError::new("prompt_len (config)", e))?
        }
        (None, None, None, Some(p)) => PromptLens::from_file(p)?,
        _ => PromptLens::Fixed(2048),
    };
    let concurrency = args.concurrency.or(file.concurrency).unwrap_or(2);
    if concurrency == 0 || concurrency > 4096 {
        return Err(ConfigError::new("--concurrency", format!("must be 1..4096, got {concurrency}")));
    }
    let arrival = match args.rate.or(file.rate) {
        Some(r) if r.is_finite() && r > 0.0 && r <= 1e6 => Arrival::Poisson { rate: r },
        Some(r) => {
            return Err(ConfigError::new(
                "--rate",
                format!("must be a positive rate up to 1e6 per second, got {r}"),
            ));
        }
        None => Arrival::Closed { concurrency },
    };
    let duration = match args.duration {
        Some(d) => Some(d),
        None => dur("duration (config)", file.duration.as_deref())?,
    };
    if duration.is_some_and(|d| d.is_zero()) {
        return Err(ConfigError::new("--duration", "must be longer than 0"));
    }
    let requests = args.requests.or(file.requests).or(if duration.is_none() { Some(20) } else { None });
    if requests == Some(0) {
        return Err(ConfigError::new("--requests", "at least 1 request is needed"));
    }
    let prefix_hit = args.prefix_hit.or(file.prefix_hit).unwrap_or(0.0);
    if !(0.0..1.0).contains(&prefix_hit) {
        return Err(ConfigError::new("--prefix-hit", format!("must be in [0, 1), got {prefix_hit}")));
    }
    let alloc: AllocPattern = args
        .alloc
        .clone()
        .or(file.alloc.clone())
        .unwrap_or_else(|| "contiguous".into())
        .parse()
        .map_err(|e| ConfigError::new("--alloc", e))?;
    let p_bs = pair_args.p_block_size.unwrap_or(pair_args.block_size()).max(1);
    let d_bs = pair_args.d_block_size.unwrap_or(pair_args.block_size()).max(1);
    let in_flight = match arrival {
        Arrival::Closed { concurrency } => concurrency,
        Arrival::Poisson { rate } => (rate.ceil() as u32).clamp(2, 64),
    };
    let max_tokens = lens.max();
    let default_pool = |bs: u32| max_tokens.div_ceil(bs).saturating_mul(in_flight + 2).max(16);
    let pool_p = args.pool_blocks.or(file.pool_blocks).unwrap_or_else(|| default_pool(p_bs));
    let pool_d = args.pool_blocks.or(file.pool_blocks).unwrap_or_else(|| default_pool(d_bs));
    let pair = scenario::resolve_pair(&model, &pair_args, pool_p, pool_d)?;
    pair.validate()?;
    if max_tokens.div_ceil(p_bs) > pool_p {
        return Err(ConfigError::new(
            "--pool-blocks",
            format!(
                "a {max_tokens}-token prompt needs {} blocks but the pool has {pool_p}",
                max_tokens.div_ceil(p_bs)
            ),
        ));
    }
    let bytes_per_request = pair.d_geometry(0).block_bytes_all_layers()
        * u64::from(max_tokens.div_ceil(d_bs))
        * u64::from(pair.d.tp);
    let total_bytes = bytes_per_request.saturating_mul(requests.unwrap_or(1000));
    let verify = match args.verify.clone().or(file.verify.clone()).as_deref() {
        None => {
            if total_bytes <= 2 << 30 {
                VerifyMode::Full
            } else {
                VerifyMode::Sample
            }
        }
        Some("full") => VerifyMode::Full,
        Some("sample") => VerifyMode::Sample,
        Some("off") => VerifyMode::Off,
        Some(other) => {
            return Err(ConfigError::new("--verify", format!("'{other}' is not full, sample or off")));
        }
    };
    let on_failure = match args.on_load_failure.clone().or(file.on_load_failure.clone()).as_deref() {
        None | Some("fail") => FailurePolicy::Fail,
        Some("recompute") => FailurePolicy::Recompute,
        Some(other) => {
            return Err(ConfigError::new("--on-load-failure", format!("'{other}' is not fail or recompute")));
        }
    };
    let kind = match args.transport.clone().or(file.transport.clone()).as_deref() {
        None | Some("ucx") => TransportKind::Ucx,
        Some("storage") => TransportKind::Storage,
        Some("multi") => TransportKind::Multi,
        Some(other) => {
            return Err(ConfigError::new("--transport", format!("'{other}' is not ucx, storage or multi")));
        }
    };
    let chain: Vec<TransportKind> = match args.transports.clone().or(file.transports.clone()) {
        Some(list) => list
            .iter()
            .map(|t| match t.trim() {
                "ucx" => Ok(TransportKind::Ucx),
                "storage" => Ok(TransportKind::Storage),
                other => Err(ConfigError::new("--transports", format!("'{other}' is not ucx or storage"))),
            })
            .collect::<Result<_, _>>()?,
        None => vec![TransportKind::Ucx, TransportKind::Storage],
    };
    if kind == TransportKind::Multi && chain != [TransportKind::Ucx, TransportKind::Storage] {
        return Err(ConfigError::new(
            "--transports",
            "kvx's multi transport tries ucx, then storage: --transports ucx,storage",
        ));
    }
    let fault = args.fault.as_deref().map(parse_fault).transpose()?;
    let mem = args.mem.clone().or(file.mem.clone()).unwrap_or_else(|| "host".into());
    if mem != "host" {
        return Err(ConfigError::new(
            "--mem",
            format!(
                "'{mem}': kvx bench registers host memory; CUDA pools need `kvx xfer --mem cuda` (feature cuda) for now"
            ),
        ));
    }
    let err_mode = args.err_mode.clone().or(file.err_mode.clone()).unwrap_or_else(|| "none".into());
    if !matches!(err_mode.as_str(), "none" | "peer") {
        return Err(ConfigError::new("--err-mode", format!("'{err_mode}' is not none or peer")));
    }
    let progress = args.progress.clone().or(file.progress.clone()).unwrap_or_else(|| "hybrid".into());
    if !matches!(progress.as_str(), "busy" | "wait" | "hybrid") {
        return Err(ConfigError::new("--progress", format!("'{progress}' is not busy, wait or hybrid")));
    }
    let slowdown = args.slowdown.unwrap_or(0.0);
    if !(0.0..=10.0).contains(&slowdown) {
        return Err(ConfigError::new("--slowdown", format!("must be a fraction in 0..=10, got {slowdown}")));
    }
    let inflight = args.inflight.or(file.inflight).unwrap_or(64);
    if inflight == 0 || inflight > 1 << 16 {
        return Err(ConfigError::new("--inflight", format!("must be 1..65536, got {inflight}")));
    }
    let lease = match args.lease {
        Some(d) => d,
        None => dur("lease (config)", file.lease.as_deref())?.unwrap_or(Duration::from_secs(30)),
    };
    let timeout = match args.timeout {
        Some(d) => d,
        None => dur("timeout (config)", file.timeout.as_deref())?.unwrap_or(Duration::from_secs(5)),
    };
    if lease.is_zero() {
        return Err(ConfigError::new("--lease", "must be longer than 0"));
    }
    if timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be longer than 0"));
    }
    let repeat = args.repeat.or(file.repeat).unwrap_or(1);
    if repeat == 0 || repeat > 1000 {
        return Err(ConfigError::new("--repeat", format!("must be 1..1000, got {repeat}")));
    }
    let exe = std::env::current_exe()
        .map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    let mut worker_env = Vec::new();
    if let Some(tls) = args.ucx_tls.clone().or(file.ucx_tls.clone()) {
        worker_env.push(("UCX_TLS".to_string(), tls));
    }
    if let Some(ep) = &args.listen {
        let bad = || {
            ConfigError::new(
                "--listen",
                format!("'{ep}' is not tcp://HOST:PORT (the decode engine takes PORT + 1)"),
            )
        };
        let (host, port) = ep.strip_prefix("tcp://").and_then(|r| r.rsplit_once(':')).ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == u16::MAX) {
            return Err(bad());
        }
    }
    let (bind_host, advertise_default) = match &args.listen {
        Some(ep) => {
            let (h, _) = crate::pipeline::engine::split_endpoint(ep);
            ("0.0.0.0".to_string(), if h == "0.0.0.0" || h == "*" { "127.0.0.1".to_string() } else { h })
        }
        None => ("127.0.0.1".to_string(), "127.0.0.1".to_string()),
    };
    let name = args
        .name
        .clone()
        .or(file.name.clone())
        .or_else(|| args.config.as_ref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().to_string()))
        .unwrap_or_else(|| "bench".into());
    Ok(BenchSettings {
        name,
        pair,
        lens,
        arrival,
        requests,
        duration,
        warmup: args.warmup.or(file.warmup).unwrap_or(2),
        prefix_hit,
        alloc,
        verify,
        on_failure,
        fault,
        transport: TransportConfig {
            kind,
            chain: if kind == TransportKind::Multi { chain } else { vec![] },
            ucx_lib: args.ucx_lib.clone(),
            err_mode,
            progress,
            ucx_alloc: false,
            huge_pages: args.huge_pages || file.huge_pages.unwrap_or(false),
            mem,
            device: args.device.unwrap_or(0),
            inflight,
            coalesce: args.coalesce || file.coalesce.unwrap_or(false),
            notify: args.notify.or(file.notify).unwrap_or_default(),
            storage_dir: args.storage_dir.clone().or(file.storage_dir.clone()),
            storage_direct_io: args.storage_direct_io,
            storage_fsync: args.storage_fsync,
            slowdown,
        },
        lease,
        timeout,
        repeat,
        seed: args.seed.or(file.seed).unwrap_or(0),
        exe,
        worker_env,
        listen: args.listen.clone(),
        bind_host,
        advertise_host: args.advertise_host.clone().unwrap_or(advertise_default),
        calibrate: !args.no_calibrate,
        progress_bar: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    })
}

pub fn run(args: &BenchArgs) -> anyhow::Result<Outcome> {
    if args.serve {
        let settings = resolve(args)?;
        let opts = crate::serve::bench_serve::ServeOptions {
            slo: super::load::parse_slo(args.slo.as_deref())?,
            metrics_port: args.metrics_port,
        };
        return Ok(crate::serve::bench_serve::run(
            &settings,
            args.results_dir.as_deref(),
            args.format == Format::Json,
            &opts,
        )?);
    }
    let root = results_root(args.results_dir.as_deref(), std::env::var_os(env::KVX_RESULTS_DIR));
    let run_id = new_run_id(&now_rfc3339());
    if args.compare_transports.is_some() {
        let mut writer = RunWriter::create(&root, &run_id)?;
        let (summary, table) = super::compare::run(args, &mut writer, &run_id)?;
        let files = writer.finish(&summary)?;
        print_summary(args.format, &summary, &files)?;
        if args.format == Format::Table {
            print!("{table}");
        }
        return Ok(Outcome::Ok);
    }
    if args.sweep.is_some() {
        // Every point is resolved before anything runs, so a bad file fails fast.
        super::sweep::points(args.sweep.as_deref().unwrap_or(Path::new("")))?;
        let mut writer = RunWriter::create(&root, &run_id)?;
        let summary = super::sweep::run(args, &mut writer, &run_id)?;
        let files = writer.finish(&summary)?;
        print_summary(args.format, &summary, &files)?;
        return Ok(Outcome::Ok);
    }
    let settings = resolve(args)?;
    let mut writer = RunWriter::create(&root, &run_id)?;
    eprintln!(
        "kvx bench: P tp {} -> D tp {} | {} | {} requests of {} tokens | writing {}",
        settings.pair.p.tp,
        settings.pair.d.tp,
        settings.pair.model.name,
        settings.requests.map_or_else(|| "timed".to_string(), |r| r.to_string()),
        settings.lens,
        writer.dir().display()
    );
    let summary = bench::run(&settings, &mut writer, &run_id)?;
    let files = writer.finish(&summary)?;
    print_summary(args.format, &summary, &files)?;
    if summary.requests_failed > 0 || summary.verify_failures > 0 {
        eprintln!(
            "kvx bench: {} failed requests, {} verification failures (see results)",
            summary.requests_failed, summary.verify_failures
        );
    }
    Ok(Outcome::Ok)
}

fn print_summary(format: Format, summary: &crate::report::Summary, files: &[PathBuf]) -> anyhow::Result<()> {
    match format {
        Format::Json => {
            println!("{}", String::from_utf8_lossy(&crate::report::export::summary_json(summary)?))
        }
        Format::Table => {
            print!("{}", render_summary(summary, Style::Terminal));
            let dir = files.first().and_then(|f| f.parent());
            println!("results: {}", dir.map_or_else(String::new, |d| d.display().to_string()));
        }
    }
    Ok(())
}

/// Parses `--fault kill-ucx:p0@5`.
pub fn parse_fault(s: &str) -> Result<crate::pipeline::bench::FaultPlan, ConfigError> {
    use crate::pipeline::proto::{Fault, Role};
    let bad = || ConfigError::new("--fault", format!("'{s}' is not kill-ucx:pR@N, exit:pR@N or exit:dR@N"));
    let (what, rest) = s.split_once(':').ok_or_else(bad)?;
    let (target, after) = rest.split_once('@').ok_or_else(bad)?;
    let fault = match what {
        "kill-ucx" => Fault::KillUcx,
        "exit" => Fault::Exit,
        _ => return Err(bad()),
    };
    let (role, rank) = match target.split_at_checked(1) {
        Some(("p", r)) => (Role::Prefill, r),
        Some(("d", r)) if fault == Fault::Exit => (Role::Decode, r),
        _ => return Err(bad()),
    };
    Ok(crate::pipeline::bench::FaultPlan {
        fault,
        role,
        rank: rank.parse().map_err(|_| bad())?,
        after: after.parse().map_err(|_| bad())?,
    })
}
