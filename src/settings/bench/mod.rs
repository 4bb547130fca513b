//! `kvx bench`: its settings as the user gives them ([`BenchFlags`]: the flags, and the keys of
//! its bench-config file, one field each), the environment and defaults resolved into one
//! `pipeline::bench::BenchSettings` per run, validated once.
//!
//! Precedence: defaults < config file < environment < flags ([`layers`] lays the flags over
//! the file and remembers which gave each value). Every error names what to change: the flag
//! (`--inflight`), or the config key and file (`inflight in bench.toml`) when the value came
//! from the file. Every choice is a type from parsing on (clap and the file reader take the
//! same spellings); workers receive them as such, never as strings to parse again. Must not
//! run anything.
//!
//! A new setting is one field of [`BenchFlags`] (its flag, its help, whether the file may set
//! it) and its rule in [`settings`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use super::env::ProcessEnv;
use super::env::results_root;
use super::flags::{
    AllocFlags, ArrivalFlags, DevicesFlags, DispatchFlags, DurationFlags, FORMAT_HELP, Format,
    HybridRuleFlags, INFLIGHT_HELP, KvBufferFlags, LeaseFlags, ListenFlags, MemFlags, ModeFlags, ModelFlags,
    PairFlags, PoolBlocksFlags, PrefixHitFlags, PromptLenFlags, PushAttentionFlags, RepeatFlags,
    RunNameFlags, SeedFlags, TRANSPORT_HELP, TimeoutFlags, UcxLibFlags, UcxModeFlags, VerifyFlags,
};
use super::layer::{self, Layered, layered};
use super::parse::parse_duration;
use super::scenario;
use super::workers::{check_inflight, check_kv_buffer, check_mem_transport, resolve_mem};
use crate::config::arrival::Arrival;
use crate::config::bench::PromptLens;
use crate::config::bench::{BenchSettings, DescriptorShare, FailurePolicy, FaultPlan};
use crate::config::engine::TcpEndpoint;
use crate::config::engine::WorkerSettings;
use crate::config::worker::{Dispatch, Fault, Overlap, PrefillSim, TransportConfig};
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::topology::TransferMode;
use crate::transfer::cuda_batch::{BatchCopy, BatchDescriptors, BatchLaunch};
use crate::transfer::notify::NotifyTransport;
use crate::vocab::kinds::{KvBufferDevice, Role, TransportKind};

layered! {
    /// `kvx bench`'s settings as given: each field is a flag (clap) and, unless `serde(skip)`,
    /// the config-file key of the same name (`--prompt-len` is `prompt_len`). `None` (or
    /// `false`) when not given; defaults belong to [`settings`].
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    #[serde(deny_unknown_fields)]
    // --slo is shared with `kvx load`, where it needs no --serve.
    #[command(mut_arg("slo", |a| a.requires("serve")))]
    pub struct BenchFlags {
        #[command(flatten)]
        #[serde(flatten)]
        pub model: ModelFlags,
        #[command(flatten)]
        #[serde(flatten)]
        pub pair: PairFlags,
        /// A bench-config file (TOML; keys are the flag names with underscores). Flags override it.
        #[arg(long, value_name = "FILE")]
        #[serde(skip)]
        pub config: Option<PathBuf>,
        /// Run a matrix: a bench-config file whose [sweep] table lists values per axis (tp = ["8:2",
        /// "4:4"], layout, prompt_len, alloc, block_size, model, concurrency, inflight, prefix_hit); one
        /// row per point.
        #[arg(long, value_name = "FILE", conflicts_with = "config")]
        #[serde(skip)]
        pub sweep: Option<PathBuf>,
        /// A sweep file's `[sweep]` table: the axes to vary (read by `--sweep`).
        #[arg(skip)]
        #[serde(rename = "sweep")]
        pub sweep_axes: Option<toml::Table>,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub arrival: ArrivalFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub duration: DurationFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub prompt: PromptLenFlags,
        /// File of prompt lengths, one per line, cycled.
        #[arg(long, value_name = "FILE", conflicts_with = "prompt_len", help_heading = "Workload")]
        pub prompt_lens: Option<PathBuf>,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub prefix_hit: PrefixHitFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub alloc: AllocFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub pool_blocks: PoolBlocksFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub seed: SeedFlags,
        #[command(flatten, next_help_heading = "Workload")]
        #[serde(flatten)]
        pub repeat: RepeatFlags,
        #[command(flatten, next_help_heading = "Checks")]
        #[serde(flatten)]
        pub verify: VerifyFlags,
        /// When a load fails: fail, or recompute (vLLM's kv_load_failure_policy) [default: fail].
        #[arg(long, value_enum, help_heading = "Checks")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub on_load_failure: Option<FailurePolicy>,
        #[command(flatten, next_help_heading = "Checks")]
        #[serde(flatten)]
        pub lease: LeaseFlags,
        #[command(flatten, next_help_heading = "Checks")]
        #[serde(flatten)]
        pub timeout: TimeoutFlags,
        // Transports (value docs list them): ucx, storage, multi, cuda-batch (GPUs of one machine, --mem cuda) [default: ucx].
        #[arg(long, value_enum, help_heading = "Transport", help = TRANSPORT_HELP)]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub transport: Option<TransportKind>,
        /// For --transport multi: the order to try, e.g. ucx,storage.
        #[arg(long, value_enum, value_delimiter = ',', help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choices")]
        pub transports: Option<Vec<TransportKind>>,
        /// Shared directory of the storage transport [default: kvx-storage in the temp dir].
        #[arg(long, help_heading = "Transport")]
        pub storage_dir: Option<PathBuf>,
        /// Storage transport: bypass the page cache (O_DIRECT).
        #[arg(long, help_heading = "Transport")]
        #[serde(skip)]
        pub storage_direct_io: bool,
        /// Storage transport: fdatasync every file before it becomes visible.
        #[arg(long, help_heading = "Transport")]
        #[serde(skip)]
        pub storage_fsync: bool,
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            help_heading = "Transport",
            conflicts_with = "compare_modes",
            help = super::flags::COMPARE_TRANSPORTS_HELP
        )]
        #[serde(default, deserialize_with = "super::parse::opt_choices")]
        pub compare_transports: Option<Vec<TransportKind>>,
        /// Run the same workload in each transfer mode and print one comparison table: pull,push.
        #[arg(long, value_enum, value_delimiter = ',', help_heading = "Transport", conflicts_with = "mode")]
        #[serde(default, deserialize_with = "super::parse::opt_choices")]
        pub compare_modes: Option<Vec<TransferMode>>,
        /// Run the same workload with each KV buffer and print one comparison table of what the
        /// host buffer's two copies cost against reading the pool directly: cuda,cpu.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            help_heading = "Transport",
            conflicts_with = "kv_buffer_device"
        )]
        #[serde(default, deserialize_with = "super::parse::opt_choices")]
        pub compare_kv_buffer_device: Option<Vec<KvBufferDevice>>,
        #[arg(
            long,
            value_name = "N",
            help_heading = "Transport",
            value_parser = clap::value_parser!(u32).range(1..=100),
            help = super::flags::ROUNDS_HELP
        )]
        #[serde(default)]
        pub rounds: Option<u32>,
        /// Inject a fault to test resilience: kill-ucx:pR@N (tear down prefill rank R's UCX side after N
        /// measured requests) or exit:pR@N / exit:dR@N (the worker exits). The run exits 0 when the
        /// failure policy held: only requests after the fault failed, as a lost peer fails; no wrong
        /// bytes, no leaked block.
        #[arg(long, value_name = "FAULT", help_heading = "Checks")]
        #[serde(skip)]
        pub fault: Option<String>,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub mode: ModeFlags,
        /// Simulated prefill compute per model layer on each prefill rank, e.g. 200us (wall time a
        /// GPU would take; the rank's CPU stays free to move bytes) [default: 0].
        #[arg(
            long,
            value_parser = parse_duration,
            allow_hyphen_values = true,
            value_name = "DURATION",
            help_heading = "Transport"
        )]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub prefill_time_per_layer: Option<Duration>,
        /// Push mode: WRITE each layer as soon as it is computed (layers) or after the whole
        /// prefill (none); the report shows the transfer time hidden behind prefill [default: none].
        #[arg(long, value_enum, value_name = "none|layers", help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub overlap: Option<Overlap>,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub dispatch: DispatchFlags,
        /// When a decode engine's ranks start a request: together (in one step once each has
        /// finished the request before it, as vLLM's TP workers run each step together) or free
        /// (each rank as soon as it is free; a request's ranks can start apart by up to a
        /// transfer) [default: together].
        #[arg(long, value_enum, value_name = "together|free", help_heading = "Workload")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub rank_start: Option<crate::config::worker::RankStart>,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub mem: MemFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub devices: DevicesFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub ucx_lib: UcxLibFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub ucx_mode: UcxModeFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub nixl: super::flags::NixlFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub fill: super::flags::FillFlags,
        #[arg(long, help_heading = "Transport", help = INFLIGHT_HELP)]
        pub inflight: Option<u32>,
        /// Post coalesced descriptors instead of vLLM's one per block and region.
        #[arg(long, help_heading = "Transport")]
        #[serde(default)]
        pub coalesce: bool,
        /// Stage a regression to test a gate: every read waits F times its own duration after it
        /// completes (0.15 makes transfers 15% slower). Recorded in the scenario.
        #[arg(long, value_name = "F", help_heading = "Testing")]
        #[serde(skip)]
        pub slowdown: Option<f64>,
        /// How decode ranks notify prefill ranks with the UCX transport: ucx (active messages
        /// on the read endpoint, as NIXL does) or zmq [default: ucx].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub notify: Option<NotifyTransport>,
        // The help names the default from `BatchCopy::default()` (the setting stays an Option so
        // that giving it where no cuda-batch run uses it can be refused).
        #[arg(long, value_enum, help_heading = "Transport", help = BatchCopy::help())]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub batch_copy: Option<BatchCopy>,

        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub kv_buffer: KvBufferFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub hybrid_rules: HybridRuleFlags,
        #[command(flatten, next_help_heading = "Transport")]
        #[serde(flatten)]
        pub push_attention: PushAttentionFlags,
        /// How many batches --transport cuda-batch posts per request on a decode rank: rank
        /// (one over all its prefill peers: one kernel launch) or peer (one per prefill peer)
        /// [default: rank].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub batch_launch: Option<BatchLaunch>,
        /// Where --transport cuda-batch makes the gather kernel's descriptors: host (each of the
        /// plan's pairs packed and uploaded) or device (the plan's region table and the request's
        /// block ids uploaded, a kernel writes the descriptors; uniform models, --batch-copy
        /// kernel, without --coalesce) [default: host].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub batch_descriptors: Option<BatchDescriptors>,
        #[command(flatten, next_help_heading = "Across hosts")]
        #[serde(flatten)]
        pub listen: ListenFlags,
        /// Host other hosts reach this one at [default: 127.0.0.1, or the --listen host].
        #[arg(long, help_heading = "Across hosts")]
        #[serde(skip)]
        pub advertise_host: Option<String>,
        /// Directory runs are written under [default: results/, or KVX_RESULTS_DIR].
        #[arg(long, help_heading = "Output")]
        #[serde(skip)]
        pub results_dir: Option<PathBuf>,
        #[command(flatten, next_help_heading = "Output")]
        #[serde(flatten)]
        pub run_name: RunNameFlags,
        /// Skip the same-run calibration (memcpy and UCX loopback read).
        #[arg(long, help_heading = "Output")]
        #[serde(skip)]
        pub no_calibrate: bool,
        #[arg(long, value_name = "FILE", help_heading = "Output", help = crate::settings::posting::RATES_HELP)]
        #[serde(skip)]
        pub rates: Option<PathBuf>,
        // json prints the summary to stdout as well (the command's long help says so).
        #[arg(long, value_enum, default_value = "table", help_heading = "Output", help = FORMAT_HELP)]
        #[serde(skip)]
        pub format: Option<Format>,
        /// Serve the workload over HTTP: a prefill engine, a decode engine and the P/D proxy,
        /// driven through the proxy by `kvx load`'s generator (TTFT, ITL, TPOT, e2el, the KV stages
        /// and the TTFT waterfall).
        #[arg(long, help_heading = "Workload")]
        #[serde(skip)]
        pub serve: bool,
        /// With --serve: serve the engines' and proxy's Prometheus metrics (vLLM's families) on this
        /// port while the run goes; 0 picks a free one (its address is printed on stderr).
        #[arg(long, requires = "serve", value_name = "PORT", help_heading = "Output")]
        #[serde(skip)]
        pub metrics_port: Option<u16>,
        /// Set by `--compare-modes` on each of its runs (not a flag): the pull run takes the push
        /// choices (`--overlap`, `--dispatch`) as not applying to it, where a pull run alone
        /// refuses them.
        #[arg(skip)]
        #[serde(skip)]
        pub in_mode_comparison: bool,
    }
}

/// Flags over file over defaults: one bench run.
pub fn resolve(flags: &BenchFlags, env: &ProcessEnv) -> Result<BenchSettings, ConfigError> {
    let layers = layers(flags)?;
    settings(&layers.values, env).map_err(|e| layers.attribute(e))
}

/// The flags over the config file (`--config`), each value knowing which gave it.
pub fn layers(flags: &BenchFlags) -> Result<Layered<BenchFlags>, ConfigError> {
    let mut flags = flags.clone();
    // `--device N` is `--devices N`.
    if flags.devices.devices.is_none() {
        flags.devices.devices = flags.mem.device.map(|d| vec![d]);
    }
    let file = match &flags.config {
        Some(path) => {
            let mut file: BenchFlags = layer::load(path, "--config")?;
            // `--prompt-len` and `--prompt-lens` are one setting: either flag replaces both keys.
            if flags.prompt.prompt_len.is_some() || flags.prompt_lens.is_some() {
                (file.prompt.prompt_len, file.prompt_lens) = (None, None);
            }
            Some((path.clone(), file))
        }
        None => None,
    };
    Ok(Layered::merge(flags, file))
}

/// The rules: each setting's default and checks, and the checks across settings, on the
/// values the flags and the file gave (`s`).
fn settings(s: &BenchFlags, env: &ProcessEnv) -> Result<BenchSettings, ConfigError> {
    let lens = prompt_lens(s)?;
    let concurrency = s.arrival.concurrency.unwrap_or(2);
    if concurrency == 0 || concurrency > 4096 {
        return Err(ConfigError::new("--concurrency", format!("must be 1..4096, got {concurrency}")));
    }
    let arrival = match s.arrival.rate {
        Some(r) => Arrival::Poisson { rate: super::parse::rate("--rate", r)? },
        None => Arrival::Closed { concurrency },
    };
    let duration = s.duration;
    if duration.duration.is_some_and(|d| d.is_zero()) {
        return Err(ConfigError::new("--duration", "must be longer than 0"));
    }
    let requests = s.arrival.requests.or(if duration.duration.is_none() { Some(20) } else { None });
    if requests == Some(0) {
        return Err(ConfigError::new("--requests", "at least 1 request is needed"));
    }
    let prefix_hit = s.prefix_hit.prefix_hit.unwrap_or(0.0);
    if !(0.0..1.0).contains(&prefix_hit) {
        return Err(ConfigError::new("--prefix-hit", format!("must be in [0, 1), got {prefix_hit}")));
    }
    let alloc = s.alloc.alloc.unwrap_or_default();
    let p_bs = s.pair.p_block_size.unwrap_or(s.pair.block_size()).max(1);
    let d_bs = s.pair.d_block_size.unwrap_or(s.pair.block_size()).max(1);
    let in_flight = match arrival {
        Arrival::Closed { concurrency } => concurrency,
        Arrival::Poisson { rate } => (rate.ceil() as u32).clamp(2, 64),
    };
    let max_tokens = lens.max();
    if let Some(n) = s.pool_blocks.pool_blocks
        && !(1..=crate::layouts::compat::MAX_POOL_BLOCKS).contains(&n)
    {
        return Err(ConfigError::new(
            "--pool-blocks",
            format!("must be 1..={} blocks per rank, got {n}", crate::layouts::compat::MAX_POOL_BLOCKS),
        ));
    }
    let default_pool = |bs: u32| max_tokens.div_ceil(bs).saturating_mul(in_flight + 2).max(16);
    let pool_p = s.pool_blocks.pool_blocks.unwrap_or_else(|| default_pool(p_bs));
    let pool_d = s.pool_blocks.pool_blocks.unwrap_or_else(|| default_pool(d_bs));
    let slowdown = s.slowdown.unwrap_or(0.0);
    if !(0.0..=10.0).contains(&slowdown) {
        return Err(ConfigError::new("--slowdown", format!("must be a fraction in 0..=10, got {slowdown}")));
    }
    let transport = transport(s, slowdown)?;
    let hybrid_model = super::hybrid_flags::hybrid_preset_of(&s.model, s.pair.engine.vllm, &[])?;
    super::hybrid_flags::check_host_switches(
        hybrid_model.is_some(),
        transport.kv_buffer == KvBufferDevice::Cpu,
        &[
            (s.hybrid_rules.state_slices.is_some(), "--state-slices"),
            (s.push_attention.push_attention.is_some(), "--push-attention"),
        ],
        &[
            (s.hybrid_rules.host_copy.is_some(), "--host-copy"),
            (s.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
            (s.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
        ],
        "--kv-buffer-device cpu (or --compare-kv-buffer-device cuda,cpu)",
    )?;
    if let Some(model) = hybrid_model {
        let (pair, hybrid, sizing) = hybrid_pair(s, model, max_tokens, in_flight, &transport)?;
        return finish(
            s,
            env,
            lens,
            arrival,
            requests,
            duration.duration,
            prefix_hit,
            alloc,
            transport,
            pair,
            Some((hybrid, sizing)),
        );
    }
    let pair = scenario::resolve_pair(&s.model, &s.pair, pool_p, pool_d)?;
    match transport.mode {
        TransferMode::Pull => pair.validate().map(|_| ())?,
        // Push's own refusals (vLLM's push connector), each naming its flag.
        TransferMode::Push => {
            pair.validate_push()?;
            if transport.kind != TransportKind::Nixl {
                push_over_ucx(&transport)?;
            } else if s.overlap == Some(Overlap::Layers) {
                return Err(ConfigError::new(
                    "--overlap",
                    "through NIXL a request is written whole once its prefill is done, as vLLM's push \
                     connector writes it: drop --overlap layers, or use --transport ucx",
                ));
            }
        }
    }
    if max_tokens.div_ceil(p_bs) > pool_p {
        return Err(ConfigError::new(
            "--pool-blocks",
            format!(
                "a {max_tokens}-token prompt needs {} blocks but the pool has {pool_p}",
                max_tokens.div_ceil(p_bs)
            ),
        ));
    }
    finish(s, env, lens, arrival, requests, duration.duration, prefix_hit, alloc, transport, pair, None)
}

/// Push mode WRITEs over UCX (or NIXL, for uniform models): another transport is refused,
/// naming `--transport`.
fn push_over_ucx(transport: &TransportConfig) -> Result<(), ConfigError> {
    if transport.kind == TransportKind::Ucx {
        return Ok(());
    }
    Err(ConfigError::new(
        "--transport",
        format!(
            "push mode WRITEs over UCX (or NIXL, for models with one KV cache group); '{}' is a \
             pull-mode transport (use --mode pull)",
            transport.kind.as_str()
        ),
    ))
}

/// A hybrid model's bench pair: its engines from the pair flags, block sizes aligned as vLLM
/// aligns them, pools sized for the workload (one block per group and position, plus vLLM's
/// null block), vLLM's refusals; with the pair the engines share with uniform models and the
/// bytes a request of `max_tokens` moves. What the hybrid pipeline does not do yet is refused
/// here, naming the flag.
fn hybrid_pair(
    s: &BenchFlags,
    model: crate::layouts::hybrid::HybridModel,
    max_tokens: u32,
    in_flight: u32,
    transport: &TransportConfig,
) -> Result<
    (crate::layouts::compat::PairSpec, crate::layouts::hybrid::HybridPairSpec, HybridSizing),
    ConfigError,
> {
    use crate::layouts::hybrid::blocks::RequestShape;
    use crate::layouts::hybrid::geometry::{EngineGeometry, Side};
    use crate::layouts::hybrid::{HybridPairSpec, HybridRequest};
    let name = model.name.clone();
    if transport.mode == TransferMode::Push {
        // Push WRITEs over UCX from the request's whole plan, once its prefill is done.
        if transport.kind == TransportKind::Nixl {
            return Err(ConfigError::new(
                "--transport",
                format!(
                    "{name} is a hybrid model: kvx writes hybrid requests over UCX (NIXL push covers models \
                     with one KV cache group): use --transport ucx"
                ),
            ));
        }
        push_over_ucx(transport)?;
        if s.overlap == Some(Overlap::Layers) {
            return Err(ConfigError::new(
                "--overlap",
                format!(
                    "{name} is a hybrid model: kvx writes a hybrid request after its whole prefill (its \
                     WRITEs mix groups and state parts, not layers in order); drop --overlap layers"
                ),
            ));
        }
    } else if s.push_attention.push_attention.is_some() {
        return Err(ConfigError::new(
            "--push-attention",
            "applies to push mode (which decode ranks prefill writes attention into): add --mode push or drop it",
        ));
    }
    if transport.batch_descriptors == BatchDescriptors::Device {
        return Err(ConfigError::new(
            "--batch-descriptors",
            format!(
                "{name} is a hybrid model: descriptors are made on the device from a uniform plan's region \
                 table only (use --batch-descriptors host)"
            ),
        ));
    }
    // UCX, or cuda-batch between device pools (its own checks: --mem cuda, no host buffer).
    if !matches!(transport.kind, TransportKind::Ucx | TransportKind::CudaBatch) {
        return Err(ConfigError::new(
            "--transport",
            format!(
                "{name} is a hybrid model: kvx moves hybrid models over UCX or cuda-batch (use --transport \
                 ucx, not {})",
                transport.kind.as_str()
            ),
        ));
    }
    let (mut p, mut d) = super::hybrid_flags::hybrid_engines(&s.pair, 16, None, None)?;
    if transport.kv_buffer == KvBufferDevice::Cpu {
        for e in [&mut p, &mut d] {
            e.kv_buffer_device = KvBufferDevice::Cpu;
            e.host_state_page_padded =
                s.hybrid_rules.host_state_page == Some(crate::layouts::hybrid::HostStatePage::Padded);
            e.host_descriptors_per_group =
                s.hybrid_rules.host_descriptors == Some(crate::layouts::hybrid::HostDescriptors::PerGroup);
        }
    }
    let pool = |e: &crate::layouts::hybrid::HybridEngineSpec, side: Side| -> Result<u32, ConfigError> {
        let shape = RequestShape::of(&EngineGeometry::new(&model, e, side)?);
        let per_request = shape.blocks(max_tokens, 0);
        match s.pool_blocks.pool_blocks {
            Some(n) if n <= per_request => Err(ConfigError::new(
                "--pool-blocks",
                format!(
                    "a {max_tokens}-token prompt of {name} needs {per_request} blocks ({} per KV cache \
                     group) plus vLLM's null block, but the pool has {n}",
                    per_request / shape.groups.len().max(1) as u32
                ),
            )),
            Some(n) => Ok(n),
            None => super::hybrid_flags::request_pool(&model, e, side, max_tokens, in_flight + 2),
        }
    };
    (p.num_blocks, d.num_blocks) = (pool(&p, Side::Prefill)?, pool(&d, Side::Decode)?);
    let config = HybridPairSpec {
        model,
        p,
        d,
        permute_local_kv: s.pair.permute,
        state_slices: s.hybrid_rules.state_slices.unwrap_or_default(),
        host_copy: s.hybrid_rules.host_copy.unwrap_or_default(),
        push_attention: s.push_attention.push_attention.unwrap_or_default(),
        stated: Default::default(),
    };
    let (pair, planner) = super::hybrid_flags::hybrid_pair_spec(&config)?;
    if transport.mode == TransferMode::Push {
        crate::layouts::hybrid::write_plan::check_push(&planner)?;
    }
    let plan = planner.plan(&HybridRequest::simulated(&planner, max_tokens, 0), "sizing")?;
    let bytes_per_request = plan.d_ranks.iter().map(|d| d.bytes()).sum();
    let mut by_size = std::collections::BTreeMap::<u64, u64>::new();
    for pair in plan.d_ranks.iter().flat_map(|d| &d.reads).flat_map(|r| &r.pairs) {
        *by_size.entry(pair.len).or_default() += pair.len;
    }
    let mut descriptor_mix: Vec<DescriptorShare> = by_size
        .into_iter()
        .map(|(descriptor_bytes, bytes)| DescriptorShare { descriptor_bytes, bytes })
        .collect();
    descriptor_mix.sort_by_key(|d| std::cmp::Reverse(d.bytes));
    Ok((pair, config, HybridSizing { bytes_per_request, descriptor_mix }))
}

/// What a request of the longest prompt moves in a hybrid run: its bytes (every decode rank)
/// and how they split by descriptor size.
struct HybridSizing {
    bytes_per_request: u64,
    descriptor_mix: Vec<DescriptorShare>,
}

/// The settings past the pair: verification, prefill simulation, faults, memory, deadlines,
/// hosts. `hybrid`: a hybrid model's pair and the bytes a request of the longest prompt moves.
#[expect(clippy::too_many_arguments, reason = "the settings resolved before the pair")]
fn finish(
    s: &BenchFlags,
    env: &ProcessEnv,
    lens: PromptLens,
    arrival: Arrival,
    requests: Option<u64>,
    duration: Option<Duration>,
    prefix_hit: f64,
    alloc: AllocPattern,
    transport: TransportConfig,
    pair: crate::layouts::compat::PairSpec,
    hybrid: Option<(crate::layouts::hybrid::HybridPairSpec, HybridSizing)>,
) -> Result<BenchSettings, ConfigError> {
    let max_tokens = lens.max();
    // A hybrid model's pair and what its requests move, taken apart once.
    let (hybrid, hybrid_bytes, descriptor_mix) = match hybrid {
        Some((h, sizing)) => (Some(h), Some(sizing.bytes_per_request), sizing.descriptor_mix),
        None => (None, None, Vec::new()),
    };
    let bytes_per_request = hybrid_bytes.unwrap_or_else(|| {
        pair.d_geometry(0).block_bytes_all_layers()
            * u64::from(max_tokens.div_ceil(pair.d.block_tokens.max(1)))
            * u64::from(pair.d.tp)
    });
    let total_bytes = bytes_per_request.saturating_mul(requests.unwrap_or(1000));
    let verify = s.verify.resolve(Some(total_bytes));
    let (prefill, dispatch) = prefill_sim(s, transport.mode, &pair)?;
    let fault = s.fault.as_deref().map(parse_fault).transpose()?;
    if let Some(plan) = fault {
        check_fault(plan, &pair, requests)?;
        if plan.fault == Fault::KillUcx && transport.kind == TransportKind::CudaBatch {
            return Err(ConfigError::new(
                "--fault",
                "kill-ucx tears down a rank's UCX side, and --transport cuda-batch has none: inject \
                 exit:pR@N or exit:dR@N",
            ));
        }
    }
    let mem = resolve_mem(s.mem.mem.unwrap_or_default(), s.devices.clone().devices)?;
    check_mem_transport(mem.kind(), transport.kind)?;
    let lease = s.lease.lease();
    let timeout = s.timeout.or(super::flags::DEFAULT_TIMEOUT);
    if lease.is_zero() {
        return Err(ConfigError::new("--lease", "must be longer than 0"));
    }
    if timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be longer than 0"));
    }
    let repeat = s.repeat.repeat.unwrap_or(1);
    if repeat == 0 || repeat > 1000 {
        return Err(ConfigError::new("--repeat", format!("must be 1..1000, got {repeat}")));
    }
    let exe = env
        .exe
        .clone()
        .map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    let worker_env: Vec<(String, String)> =
        s.ucx_mode.ucx_tls.clone().map(|tls| ("UCX_TLS".to_string(), tls)).into_iter().collect();
    let (listen, bind_host, advertise_host) = hosts(s)?;
    super::workers::check_one_machine(transport.kind, listen.as_ref(), &advertise_host)?;
    let name = s
        .run_name
        .name
        .clone()
        .or_else(|| s.config.as_deref().and_then(Path::file_stem).map(|s| s.to_string_lossy().to_string()))
        .unwrap_or_else(|| "bench".into());
    let launcher = env.launcher.clone()?;
    let prediction = prediction_model(s.rates.as_deref(), mem.kind(), transport.kind)?;
    Ok(BenchSettings {
        name,
        launcher,
        workers: WorkerSettings {
            pair,
            hybrid,
            transport,
            verify,
            fill: s.fill.fill.unwrap_or_default(),
            mem,
            lease,
            timeout,
            alloc,
            seed: s.seed.seed.unwrap_or(0),
            exe,
            worker_env,
            listen,
            bind_host,
            advertise_host,
            prefill,
            rank_start: s.rank_start.unwrap_or_default(),
        },
        dispatch,
        lens,
        arrival,
        requests,
        duration,
        warmup: s.arrival.warmup.unwrap_or(2),
        prefix_hit,
        on_failure: s.on_load_failure.unwrap_or(FailurePolicy::Fail),
        fault,
        repeat,
        rounds: s.rounds.unwrap_or(1),
        calibrate: !s.no_calibrate,
        prediction,
        descriptor_mix,
        progress_bar: env.stderr_is_terminal,
        results_root: results_root(s.results_dir.as_deref(), env.results_dir.clone()),
    })
}

/// `--rates`: the fitted model of the path this run takes (UCX on host memory: `ucx`; on
/// device memory: `cuda-ipc`; `--transport cuda-batch`: `cuda-batch`).
fn prediction_model(
    file: Option<&Path>,
    mem: crate::vocab::kinds::MemKind,
    kind: TransportKind,
) -> Result<Option<crate::config::bench::PredictionModel>, ConfigError> {
    use crate::layouts::posting::PostPath;
    let Some(file) = file else { return Ok(None) };
    let path = match (kind, mem) {
        (TransportKind::Ucx, crate::vocab::kinds::MemKind::Host) => PostPath::Ucx,
        (TransportKind::Ucx, _) => PostPath::CudaIpc,
        (TransportKind::CudaBatch, _) => PostPath::CudaBatch,
        (other, _) => {
            return Err(ConfigError::new(
                "--rates",
                format!("predicts ucx and cuda-batch runs, not --transport {}", other.as_str()),
            ));
        }
    };
    let rates = super::posting::resolve_rates(Some(file), &[], &[])?;
    let key = path.key();
    let model = rates.of(path).model.clone().ok_or_else(|| {
        ConfigError::new(
            "--rates",
            format!(
                "{} has no fitted model for {key} (`paths.{key}.model`): run kvx calibrate --path {key} --out FILE",
                file.display()
            ),
        )
    })?;
    let note = match &rates.of(path).post_source {
        crate::layouts::posting::RateSource::File { path, .. } => path.clone(),
        crate::layouts::posting::RateSource::User => file.display().to_string(),
    };
    Ok(Some(crate::config::bench::PredictionModel { path, model, rates: note }))
}

/// `--prompt-len` or `--prompt-lens` [default: 2048 tokens].
fn prompt_lens(s: &BenchFlags) -> Result<PromptLens, ConfigError> {
    Ok(match (&s.prompt.prompt_len, &s.prompt_lens) {
        (Some(text), _) => text.parse::<PromptLens>().map_err(|e| ConfigError::new("--prompt-len", e))?,
        (None, Some(path)) => super::parse::prompt_lens_file(path)?,
        (None, None) => PromptLens::Fixed(2048),
    })
}

/// `--transport` and what each transport takes.
fn transport(s: &BenchFlags, slowdown: f64) -> Result<TransportConfig, ConfigError> {
    let kind = s.transport.unwrap_or_default();
    let chain = s.transports.clone().unwrap_or_else(|| vec![TransportKind::Ucx, TransportKind::Storage]);
    if let Some(other) = chain.iter().find(|k| !matches!(k, TransportKind::Ucx | TransportKind::Storage)) {
        return Err(ConfigError::new("--transports", format!("'{}' is not ucx or storage", other.as_str())));
    }
    if kind == TransportKind::Multi && chain != [TransportKind::Ucx, TransportKind::Storage] {
        return Err(ConfigError::new(
            "--transports",
            "kvx's multi transport tries ucx, then storage: --transports ucx,storage",
        ));
    }
    // `--batch-copy` says how cuda-batch issues its batches: refused where it is not used
    // (`--compare-transports` passes it to its cuda-batch run only).
    if s.batch_copy.is_some() && kind != TransportKind::CudaBatch {
        return Err(ConfigError::new(
            "--batch-copy",
            "applies to --transport cuda-batch (or --compare-transports with cuda-batch)",
        ));
    }
    if s.batch_launch.is_some() && kind != TransportKind::CudaBatch {
        return Err(ConfigError::new(
            "--batch-launch",
            "applies to --transport cuda-batch (or --compare-transports with cuda-batch)",
        ));
    }
    let batch_descriptors = s.batch_descriptors.unwrap_or_default();
    if s.batch_descriptors.is_some() && kind != TransportKind::CudaBatch {
        return Err(ConfigError::new(
            "--batch-descriptors",
            "applies to --transport cuda-batch (or --compare-transports with cuda-batch)",
        ));
    }
    if batch_descriptors == BatchDescriptors::Device {
        if s.batch_copy.unwrap_or_default() != BatchCopy::Kernel {
            return Err(ConfigError::new(
                "--batch-descriptors",
                "device descriptors are written for kvx's gather kernel: drop --batch-copy, or give \
                 --batch-copy kernel, or --batch-descriptors host",
            ));
        }
        if s.coalesce {
            return Err(ConfigError::new(
                "--batch-descriptors",
                "device descriptors are the plan's as they stand, one per region and block: drop --coalesce, \
                 or give --batch-descriptors host",
            ));
        }
    }
    let mode = s.mode.mode.unwrap_or_default();
    let kv_buffer = s.kv_buffer.device();
    check_kv_buffer(kv_buffer, mode, kind)?;
    Ok(TransportConfig {
        kind,
        chain: if kind == TransportKind::Multi { chain } else { vec![] },
        mode,
        ucx_lib: s.ucx_lib.clone().ucx_lib,
        err_mode: s.ucx_mode.err_mode(kind == TransportKind::Nixl),
        progress: s.ucx_mode.progress(),
        ucx_alloc: false,
        huge_pages: s.mem.huge_pages,
        inflight: check_inflight(s.inflight.unwrap_or(super::flags::DEFAULT_INFLIGHT))?,
        coalesce: s.coalesce,
        notify: s.notify.unwrap_or_default(),
        storage_dir: s.storage_dir.clone(),
        storage_direct_io: s.storage_direct_io,
        storage_fsync: s.storage_fsync,
        batch_copy: s.batch_copy.unwrap_or_default(),
        batch_launch: s.batch_launch.unwrap_or_default(),
        batch_descriptors,
        slowdown,
        kv_buffer,
        nixl: crate::config::xfer::NixlOptions {
            progress_thread: s.nixl.nixl_progress_thread,
            ..Default::default()
        },
    })
}

/// `--prefill-time-per-layer`, `--overlap` and `--dispatch`: the simulated prefill and how
/// push mode overlaps and dispatches. Overlap and concurrent dispatch are push's; a layer
/// overlap needs a layout whose regions are per layer, and decode registered before
/// prefill computes (concurrent dispatch, its default).
fn prefill_sim(
    s: &BenchFlags,
    mode: TransferMode,
    pair: &crate::layouts::compat::PairSpec,
) -> Result<(PrefillSim, Dispatch), ConfigError> {
    let per_layer = s.prefill_time_per_layer.unwrap_or_default();
    // A request's compute is layers x this: cap it so the product cannot overflow or hang.
    if per_layer > Duration::from_secs(1) {
        return Err(ConfigError::new(
            "--prefill-time-per-layer",
            format!("must be at most 1s per layer, got {per_layer:?}"),
        ));
    }
    let overlap = s.overlap.unwrap_or_default();
    if mode == TransferMode::Pull {
        // A comparison's pull run: the push choices do not apply to it.
        if s.in_mode_comparison {
            return Ok((
                PrefillSim { per_layer_ns: per_layer.as_nanos() as u64, overlap: Overlap::None },
                Dispatch::Sequential,
            ));
        }
        if overlap == Overlap::Layers {
            return Err(ConfigError::new(
                "--overlap",
                "layer overlap is push mode's (prefill WRITEs each layer as it is computed); in pull \
                 mode decode reads after prefill: add --mode push or drop --overlap",
            ));
        }
        if s.dispatch.dispatch == Some(Dispatch::Concurrent) {
            return Err(ConfigError::new(
                "--dispatch",
                "concurrent dispatch needs --mode push: in pull mode decode reads the blocks prefill \
                 names in its answer, so it cannot start before prefill answered",
            ));
        }
    }
    let dispatch = match (s.dispatch.dispatch, overlap) {
        (Some(Dispatch::Sequential), Overlap::Layers) => {
            return Err(ConfigError::new(
                "--dispatch",
                "--overlap layers WRITEs while prefill computes, so decode must register first: \
                 use --dispatch concurrent (the default with --overlap layers)",
            ));
        }
        (Some(d), _) => d,
        (None, Overlap::Layers) => Dispatch::Concurrent,
        (None, Overlap::None) => Dispatch::Sequential,
    };
    if overlap == Overlap::Layers {
        let regions = pair.p_geometry(0).regions();
        if regions.iter().any(|r| r.content.layer.is_none()) {
            return Err(ConfigError::new(
                "--layout",
                format!(
                    "--overlap layers WRITEs one layer's slice of each block at a time, but layout {} keeps \
                     all layers of a block together (block-outer or cross-layer): use a layer-outer layout \
                     such as LBHNC, or --overlap none",
                    pair.p.layout
                ),
            ));
        }
    }
    Ok((PrefillSim { per_layer_ns: per_layer.as_nanos() as u64, overlap }, dispatch))
}

/// `--listen` and `--advertise-host`: (listen, bind host, advertise host).
fn hosts(s: &BenchFlags) -> Result<(Option<TcpEndpoint>, String, String), ConfigError> {
    let listen = match &s.listen.listen {
        Some(ep) => {
            let bad = || {
                ConfigError::new(
                    "--listen",
                    format!("'{ep}' is not tcp://HOST:PORT (the decode engine takes PORT + 1)"),
                )
            };
            let (host, port) = ep.strip_prefix("tcp://").and_then(|r| r.rsplit_once(':')).ok_or_else(bad)?;
            let port = port.parse::<u16>().ok().filter(|&p| p != u16::MAX).ok_or_else(bad)?;
            if host.is_empty() {
                return Err(bad());
            }
            Some(TcpEndpoint { host: host.trim_matches(['[', ']']).to_string(), port })
        }
        None => None,
    };
    let (bind_host, advertise_default) = match &listen {
        Some(ep) if ep.host == "0.0.0.0" || ep.host == "*" => {
            ("0.0.0.0".to_string(), "127.0.0.1".to_string())
        }
        Some(ep) => ("0.0.0.0".to_string(), ep.host.clone()),
        None => ("127.0.0.1".to_string(), "127.0.0.1".to_string()),
    };
    Ok((listen, bind_host, s.advertise_host.clone().unwrap_or(advertise_default)))
}

/// Parses `--fault kill-ucx:p0@5`.
pub fn parse_fault(s: &str) -> Result<FaultPlan, ConfigError> {
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
    Ok(FaultPlan {
        fault,
        role,
        rank: rank.parse().map_err(|_| bad())?,
        after: after.parse().map_err(|_| bad())?,
    })
}

/// A fault must hit a rank that exists and a request that will run: a fault that can never be
/// injected would let a run pass as resilient without testing anything.
fn check_fault(
    plan: FaultPlan,
    pair: &crate::layouts::compat::PairSpec,
    requests: Option<u64>,
) -> Result<(), ConfigError> {
    let (tp, side, flag) = match plan.role {
        Role::Prefill => (pair.p.tp, "prefill", "--p-tp"),
        Role::Decode => (pair.d.tp, "decode", "--d-tp"),
    };
    if plan.rank >= tp {
        return Err(ConfigError::new(
            "--fault",
            format!(
                "{side} rank {} does not exist: the {side} engine has ranks 0..{} ({flag} {tp})",
                plan.rank,
                tp - 1
            ),
        ));
    }
    if plan.after == 0 || requests.is_some_and(|n| plan.after > n) {
        let most = requests.map_or_else(|| "the run's".to_string(), |n| n.to_string());
        return Err(ConfigError::new(
            "--fault",
            format!("@{} is not a measured request of this run: give @1 to @{most}", plan.after),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
