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
use super::flags::{Format, ModelFlags, PairFlags};
use super::layer::{self, Layered, layered};
use super::parse::parse_duration;
use super::scenario;
use super::workers::{check_inflight, check_kv_buffer, check_mem_transport, resolve_mem};
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::pipeline::bench::{BenchSettings, DescriptorShare, FailurePolicy, FaultPlan};
use crate::pipeline::engine::split_endpoint;
use crate::pipeline::setup::WorkerSettings;
use crate::pipeline::wire::{
    Dispatch, Fault, KvBufferDevice, Overlap, PrefillSim, Role, TransferMode, TransportConfig, TransportKind,
    VerifyMode,
};
use crate::pipeline::workload::{Arrival, PromptLens};
use crate::report::files::results_root;
use crate::transfer::cuda_batch::{BatchCopy, BatchDescriptors, BatchLaunch};
use crate::transfer::memory::MemKind;
use crate::transfer::notify::NotifyTransport;
use crate::transfer::ucx::{ErrMode, ProgressMode};

layered! {
    /// `kvx bench`'s settings as given: each field is a flag (clap) and, unless `serde(skip)`,
    /// the config-file key of the same name (`--prompt-len` is `prompt_len`). `None` (or
    /// `false`) when not given; defaults belong to [`settings`].
    #[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
    #[serde(deny_unknown_fields)]
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
        /// Measured requests per repeat [default: 20 unless --duration].
        #[arg(long, help_heading = "Workload")]
        pub requests: Option<u64>,
        /// Measure for this long per repeat instead of a request count (e.g. 30s).
        #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Workload")]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub duration: Option<Duration>,
        /// Open loop: Poisson arrivals at this many requests per second.
        #[arg(long, conflicts_with = "concurrency", allow_negative_numbers = true, help_heading = "Workload")]
        pub rate: Option<f64>,
        /// Closed loop: requests kept in flight [default: 2].
        #[arg(long, help_heading = "Workload")]
        pub concurrency: Option<u32>,
        /// Prompt length in tokens, fixed (8192) or uniform over a range (1024..32768) [default: 2048].
        #[arg(long, help_heading = "Workload")]
        #[serde(default, deserialize_with = "super::parse::opt_text")]
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
        #[arg(long, value_enum, help_heading = "Workload")]
        #[serde(default, deserialize_with = "super::parse::opt_parsed")]
        pub alloc: Option<AllocPattern>,
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
        #[arg(long, value_enum, help_heading = "Checks")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub verify: Option<VerifyMode>,
        /// When a load fails: fail, or recompute (vLLM's kv_load_failure_policy) [default: fail].
        #[arg(long, value_enum, help_heading = "Checks")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub on_load_failure: Option<FailurePolicy>,
        /// Lease prefill ranks hold blocks under (vLLM kv_lease_duration) [default: 30s].
        #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Checks")]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub lease: Option<Duration>,
        /// Deadline of every wait: handshake, reads, notifications [default: 5s].
        #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Checks")]
        #[serde(default, deserialize_with = "super::parse::opt_duration")]
        pub timeout: Option<Duration>,
        /// Transport: ucx, storage, multi, cuda-batch (GPUs of one machine, --mem cuda) [default: ucx].
        #[arg(long, value_enum, help_heading = "Transport")]
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
        /// Run the same workload on each transport and print one comparison table, e.g. ucx,storage,multi
        /// (or ucx,cuda-batch with --mem cuda).
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            help_heading = "Transport",
            conflicts_with = "compare_modes"
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
        /// Inject a fault to test resilience: kill-ucx:pR@N (tear down prefill rank R's UCX side after N
        /// measured requests) or exit:pR@N / exit:dR@N (the worker exits). The run exits 0 when the
        /// failure policy held: only requests after the fault failed, as a lost peer fails; no wrong
        /// bytes, no leaked block.
        #[arg(long, value_name = "FAULT", help_heading = "Checks")]
        #[serde(skip)]
        pub fault: Option<String>,
        /// Who moves the bytes: pull (the decode side reads, as vLLM's NixlConnector) or push (the
        /// prefill side writes, as vLLM's NixlPushConnector) [default: pull].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub mode: Option<TransferMode>,
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
        /// How a request's legs are sent: sequential (prefill, then decode) or concurrent (both at
        /// once; push mode, where decode registers while prefill computes) [default: sequential,
        /// concurrent with --overlap layers].
        #[arg(long, value_enum, value_name = "sequential|concurrent", help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub dispatch: Option<Dispatch>,
        /// Memory of the KV pools: host or cuda [default: host].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub mem: Option<MemKind>,
        /// GPUs of --mem cuda, e.g. 0,1,2,3: prefill ranks then decode ranks, round-robin [default: 0].
        #[arg(long, value_delimiter = ',', help_heading = "Transport")]
        pub devices: Option<Vec<u32>>,
        /// One GPU for every rank of --mem cuda (--devices N).
        #[arg(long, value_name = "N", conflicts_with = "devices", help_heading = "Transport")]
        #[serde(skip)]
        pub device: Option<u32>,
        /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
        #[arg(long, help_heading = "Transport")]
        #[serde(skip)]
        pub ucx_lib: Option<PathBuf>,
        /// UCX_TLS for the workers, e.g. posix,cma,self or tcp.
        #[arg(long, help_heading = "Transport")]
        pub ucx_tls: Option<String>,
        /// UCX error-handling mode: none or peer (peer excludes shared-memory transports) [default: none].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub err_mode: Option<ErrMode>,
        /// UCX progress: busy, wait, hybrid [default: hybrid].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub progress: Option<ProgressMode>,
        /// Back the KV pools with huge pages.
        #[arg(long, help_heading = "Transport")]
        #[serde(default)]
        pub huge_pages: bool,
        /// GETs in flight per source rank [default: 64].
        #[arg(long, help_heading = "Transport")]
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
        /// Where transfers read the KV (vLLM's kv_buffer_device): cuda (the pool itself) or cpu
        /// (a host buffer: prefill copies a request's blocks into it, decode reads into its own
        /// and copies them into its pool; both copies are timed stages) [default: cuda].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub kv_buffer_device: Option<KvBufferDevice>,
        /// Hybrid models: where decode reads its slice of each state part: vllm (vLLM 0.33's
        /// remote_conv_offsets, which assume every conv part is sharded like x) or exact (each
        /// part as the model splits it: replicated Mamba2 B and C read where each prefill rank
        /// holds decode's slice of them) [default: vllm].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub state_slices: Option<crate::layouts::hybrid::StateSlices>,
        /// Hybrid models with --kv-buffer-device cpu: which blocks decode's host-to-device copy
        /// passes through each layer: vllm (every group's through every layer, as vLLM 0.33) or
        /// per-group (each layer its own group's) [default: vllm].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_copy: Option<crate::layouts::hybrid::HostCopyRule>,
        /// Hybrid models in push mode, decode TP above prefill TP and above the KV heads: which
        /// decode ranks prefill writes attention into: vllm (the first of each head only, as
        /// vLLM 0.33's push connector reads; the others get state but no attention) or
        /// every-rank (each its head, as pull reads them) [default: vllm].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub push_attention: Option<crate::layouts::hybrid::push::PushAttention>,
        /// Hybrid models with --kv-buffer-device cpu: the host tensors' state pages: vllm
        /// (unpadded, as vLLM 0.33 allocates them, while the regions assume padded ones) or
        /// padded [default: vllm].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_state_page: Option<super::hybrid_flags::HostStatePage>,
        /// Hybrid models with --kv-buffer-device cpu: which host tensors each group's
        /// descriptors read: vllm (with state in the model, every layer's tensor, as vLLM 0.33)
        /// or per-group (each group's own layers'; prefill copies only those into the buffer)
        /// [default: vllm].
        #[arg(long, value_enum, help_heading = "Transport")]
        #[serde(default, deserialize_with = "super::parse::opt_choice")]
        pub host_descriptors: Option<super::hybrid_flags::HostDescriptors>,
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
        /// Wait for external `kvx worker --connect` processes: prefill on this endpoint's port, decode on
        /// port + 1.
        #[arg(long, value_name = "tcp://HOST:PORT", help_heading = "Across hosts")]
        #[serde(skip)]
        pub listen: Option<String>,
        /// Host other hosts reach this one at [default: 127.0.0.1, or the --listen host].
        #[arg(long, help_heading = "Across hosts")]
        #[serde(skip)]
        pub advertise_host: Option<String>,
        /// Directory runs are written under [default: results/, or KVX_RESULTS_DIR].
        #[arg(long, help_heading = "Output")]
        #[serde(skip)]
        pub results_dir: Option<PathBuf>,
        /// Name of the run (the scenario name in reports) [default: the config file's name or "bench"].
        #[arg(long, help_heading = "Output")]
        pub name: Option<String>,
        /// Skip the same-run calibration (memcpy and UCX loopback read).
        #[arg(long, help_heading = "Output")]
        #[serde(skip)]
        pub no_calibrate: bool,
        /// Output format; json prints the summary to stdout as well.
        #[arg(long, value_enum, default_value = "table", help_heading = "Output")]
        #[serde(skip)]
        pub format: Option<Format>,
        /// Serve the workload over HTTP: a prefill engine, a decode engine and the P/D proxy,
        /// driven through the proxy by `kvx load`'s generator (TTFT, ITL, TPOT, e2el, the KV stages
        /// and the TTFT waterfall).
        #[arg(long, help_heading = "Workload")]
        #[serde(skip)]
        pub serve: bool,
        /// With --serve: objectives for goodput, e.g. ttft=200ms,tpot=50ms (also itl, e2el).
        #[arg(long, requires = "serve", value_name = "NAME=LIMIT,...", help_heading = "Workload")]
        #[serde(skip)]
        pub slo: Option<String>,
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
    if flags.devices.is_none() {
        flags.devices = flags.device.map(|d| vec![d]);
    }
    let file = match &flags.config {
        Some(path) => {
            let mut file: BenchFlags = layer::load(path, "--config")?;
            // `--prompt-len` and `--prompt-lens` are one setting: either flag replaces both keys.
            if flags.prompt_len.is_some() || flags.prompt_lens.is_some() {
                (file.prompt_len, file.prompt_lens) = (None, None);
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
    let concurrency = s.concurrency.unwrap_or(2);
    if concurrency == 0 || concurrency > 4096 {
        return Err(ConfigError::new("--concurrency", format!("must be 1..4096, got {concurrency}")));
    }
    let arrival = match s.rate {
        Some(r) => Arrival::Poisson { rate: super::parse::rate("--rate", r)? },
        None => Arrival::Closed { concurrency },
    };
    let duration = s.duration;
    if duration.is_some_and(|d| d.is_zero()) {
        return Err(ConfigError::new("--duration", "must be longer than 0"));
    }
    let requests = s.requests.or(if duration.is_none() { Some(20) } else { None });
    if requests == Some(0) {
        return Err(ConfigError::new("--requests", "at least 1 request is needed"));
    }
    let prefix_hit = s.prefix_hit.unwrap_or(0.0);
    if !(0.0..1.0).contains(&prefix_hit) {
        return Err(ConfigError::new("--prefix-hit", format!("must be in [0, 1), got {prefix_hit}")));
    }
    let alloc = s.alloc.unwrap_or_default();
    let p_bs = s.pair.p_block_size.unwrap_or(s.pair.block_size()).max(1);
    let d_bs = s.pair.d_block_size.unwrap_or(s.pair.block_size()).max(1);
    let in_flight = match arrival {
        Arrival::Closed { concurrency } => concurrency,
        Arrival::Poisson { rate } => (rate.ceil() as u32).clamp(2, 64),
    };
    let max_tokens = lens.max();
    if let Some(n) = s.pool_blocks
        && !(1..=crate::layouts::compat::MAX_POOL_BLOCKS).contains(&n)
    {
        return Err(ConfigError::new(
            "--pool-blocks",
            format!("must be 1..={} blocks per rank, got {n}", crate::layouts::compat::MAX_POOL_BLOCKS),
        ));
    }
    let default_pool = |bs: u32| max_tokens.div_ceil(bs).saturating_mul(in_flight + 2).max(16);
    let pool_p = s.pool_blocks.unwrap_or_else(|| default_pool(p_bs));
    let pool_d = s.pool_blocks.unwrap_or_else(|| default_pool(d_bs));
    let slowdown = s.slowdown.unwrap_or(0.0);
    if !(0.0..=10.0).contains(&slowdown) {
        return Err(ConfigError::new("--slowdown", format!("must be a fraction in 0..=10, got {slowdown}")));
    }
    let transport = transport(s, slowdown)?;
    let hybrid_model = super::hybrid_flags::hybrid_preset_of(&s.model, s.pair.vllm, &[])?;
    super::hybrid_flags::check_host_switches(
        hybrid_model.is_some(),
        transport.kv_buffer == KvBufferDevice::Cpu,
        &[(s.state_slices.is_some(), "--state-slices"), (s.push_attention.is_some(), "--push-attention")],
        &[
            (s.host_copy.is_some(), "--host-copy"),
            (s.host_state_page.is_some(), "--host-state-page"),
            (s.host_descriptors.is_some(), "--host-descriptors"),
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
            duration,
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
            push_over_ucx(&transport)?;
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
    finish(s, env, lens, arrival, requests, duration, prefix_hit, alloc, transport, pair, None)
}

/// Push mode WRITEs over UCX: another transport is refused, naming `--transport`.
fn push_over_ucx(transport: &TransportConfig) -> Result<(), ConfigError> {
    if transport.kind == TransportKind::Ucx {
        return Ok(());
    }
    Err(ConfigError::new(
        "--transport",
        format!(
            "push mode WRITEs over UCX; '{}' is a pull-mode transport (use --mode pull)",
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
    } else if s.push_attention.is_some() {
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
            e.host_state_page_padded = s.host_state_page == Some(super::hybrid_flags::HostStatePage::Padded);
            e.host_descriptors_per_group =
                s.host_descriptors == Some(super::hybrid_flags::HostDescriptors::PerGroup);
        }
    }
    let pool = |e: &crate::layouts::hybrid::HybridEngineSpec, side: Side| -> Result<u32, ConfigError> {
        let shape = RequestShape::of(&EngineGeometry::new(&model, e, side)?);
        let per_request = shape.blocks(max_tokens, 0);
        match s.pool_blocks {
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
        state_slices: s.state_slices.unwrap_or_default(),
        host_copy: s.host_copy.unwrap_or_default(),
        push_attention: s.push_attention.unwrap_or_default(),
        stated: Default::default(),
    };
    let (pair, planner) = super::hybrid_flags::hybrid_pair_spec(&config)?;
    if transport.mode == TransferMode::Push {
        crate::layouts::hybrid::push::check_push(&planner)?;
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
    let verify = match s.verify {
        Some(v) => v,
        None if total_bytes <= 2 << 30 => VerifyMode::Full,
        None => VerifyMode::Sample,
    };
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
    let mem = resolve_mem(s.mem.unwrap_or_default(), s.devices.clone())?;
    check_mem_transport(mem.kind(), transport.kind)?;
    let lease = s.lease.unwrap_or(Duration::from_secs(30));
    let timeout = s.timeout.unwrap_or(Duration::from_secs(5));
    if lease.is_zero() {
        return Err(ConfigError::new("--lease", "must be longer than 0"));
    }
    if timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be longer than 0"));
    }
    let repeat = s.repeat.unwrap_or(1);
    if repeat == 0 || repeat > 1000 {
        return Err(ConfigError::new("--repeat", format!("must be 1..1000, got {repeat}")));
    }
    let exe = env
        .exe
        .clone()
        .map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    let worker_env: Vec<(String, String)> =
        s.ucx_tls.clone().map(|tls| ("UCX_TLS".to_string(), tls)).into_iter().collect();
    let (listen, bind_host, advertise_host) = hosts(s)?;
    super::workers::check_one_machine(transport.kind, listen.as_deref(), &advertise_host)?;
    let name = s
        .name
        .clone()
        .or_else(|| s.config.as_deref().and_then(Path::file_stem).map(|s| s.to_string_lossy().to_string()))
        .unwrap_or_else(|| "bench".into());
    Ok(BenchSettings {
        name,
        workers: WorkerSettings {
            pair,
            hybrid,
            transport,
            verify,
            mem,
            lease,
            timeout,
            alloc,
            seed: s.seed.unwrap_or(0),
            exe,
            worker_env,
            listen,
            bind_host,
            advertise_host,
            prefill,
        },
        dispatch,
        lens,
        arrival,
        requests,
        duration,
        warmup: s.warmup.unwrap_or(2),
        prefix_hit,
        on_failure: s.on_load_failure.unwrap_or(FailurePolicy::Fail),
        fault,
        repeat,
        calibrate: !s.no_calibrate,
        descriptor_mix,
        progress_bar: env.stderr_is_terminal,
        results_root: results_root(s.results_dir.as_deref(), env.results_dir.clone()),
    })
}

/// `--prompt-len` or `--prompt-lens` [default: 2048 tokens].
fn prompt_lens(s: &BenchFlags) -> Result<PromptLens, ConfigError> {
    Ok(match (&s.prompt_len, &s.prompt_lens) {
        (Some(text), _) => text.parse::<PromptLens>().map_err(|e| ConfigError::new("--prompt-len", e))?,
        (None, Some(path)) => PromptLens::from_file(path)?,
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
    let mode = s.mode.unwrap_or_default();
    let kv_buffer = s.kv_buffer_device.unwrap_or_default();
    check_kv_buffer(kv_buffer, mode, kind)?;
    Ok(TransportConfig {
        kind,
        chain: if kind == TransportKind::Multi { chain } else { vec![] },
        mode,
        ucx_lib: s.ucx_lib.clone(),
        err_mode: s.err_mode.unwrap_or_default(),
        progress: s.progress.unwrap_or_default(),
        ucx_alloc: false,
        huge_pages: s.huge_pages,
        inflight: check_inflight(s.inflight.unwrap_or(64))?,
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
        if s.dispatch == Some(Dispatch::Concurrent) {
            return Err(ConfigError::new(
                "--dispatch",
                "concurrent dispatch needs --mode push: in pull mode decode reads the blocks prefill \
                 names in its answer, so it cannot start before prefill answered",
            ));
        }
    }
    let dispatch = match (s.dispatch, overlap) {
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
fn hosts(s: &BenchFlags) -> Result<(Option<String>, String, String), ConfigError> {
    if let Some(ep) = &s.listen {
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
    let (bind_host, advertise_default) = match &s.listen {
        Some(ep) => {
            let (h, _) = split_endpoint(ep);
            ("0.0.0.0".to_string(), if h == "0.0.0.0" || h == "*" { "127.0.0.1".to_string() } else { h })
        }
        None => ("127.0.0.1".to_string(), "127.0.0.1".to_string()),
    };
    Ok((s.listen.clone(), bind_host, s.advertise_host.clone().unwrap_or(advertise_default)))
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
mod tests {
    use std::io::Write as _;

    use clap::{Args as _, FromArgMatches as _};

    use super::*;
    use crate::pipeline::setup::KvMemory;
    use crate::pipeline::wire::{self, ToWorker};
    use crate::settings::layer::Layer as _;
    use crate::transfer::memory::MemPlace;

    fn env() -> ProcessEnv {
        ProcessEnv { results_dir: None, stderr_is_terminal: false, exe: Ok(PathBuf::from("/usr/bin/kvx")) }
    }

    fn config(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp file");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    fn with_config(file: &tempfile::NamedTempFile) -> BenchFlags {
        BenchFlags { config: Some(file.path().to_path_buf()), ..BenchFlags::default() }
    }

    /// `kvx bench`'s flags as clap parses them.
    fn parse(args: &[&str]) -> Result<BenchFlags, clap::Error> {
        let cmd = BenchFlags::augment_args(clap::Command::new("bench").allow_negative_numbers(true));
        let matches = cmd.try_get_matches_from(std::iter::once("bench").chain(args.iter().copied()))?;
        BenchFlags::from_arg_matches(&matches)
    }

    #[test]
    fn defaults_fill_what_neither_flag_nor_file_sets() {
        let s = resolve(&BenchFlags::default(), &env()).expect("defaults are valid");
        let w = &s.workers;
        assert_eq!((w.pair.p.tp, w.pair.d.tp), (1, 1));
        assert_eq!(w.pair.model.name, "llama-3.1-70b");
        assert_eq!(s.lens, PromptLens::Fixed(2048));
        assert_eq!(s.arrival, Arrival::Closed { concurrency: 2 });
        assert_eq!((s.requests, s.warmup, s.repeat), (Some(20), 2, 1));
        assert_eq!((w.lease, w.timeout), (Duration::from_secs(30), Duration::from_secs(5)));
        assert_eq!(w.transport.kind, TransportKind::Ucx);
        assert_eq!(w.transport.mode, TransferMode::Pull);
        assert_eq!(w.transport.err_mode, ErrMode::None);
        assert_eq!(w.transport.progress, ProgressMode::Hybrid);
        assert_eq!(w.transport.inflight, 64);
        assert_eq!(w.transport.notify, NotifyTransport::Ucx);
        assert_eq!(w.mem, KvMemory::Host);
        assert_eq!(s.on_failure, FailurePolicy::Fail);
        assert_eq!(s.name, "bench");
        assert_eq!(s.results_root, PathBuf::from("results"));
        assert_eq!((w.bind_host.as_str(), w.advertise_host.as_str()), ("127.0.0.1", "127.0.0.1"));
    }

    #[test]
    fn flag_beats_file_beats_default() {
        let file = config(
            "name = \"tiny\"\nmodel = \"llama-3.1-8b\"\np_tp = 2\nd_tp = 1\ninflight = 8\nprogress = \"wait\"\n\
             err_mode = \"peer\"\nverify = \"off\"\nlease = \"10s\"\nprompt_len = 512\nconcurrency = 3\n",
        );
        let s = resolve(&with_config(&file), &env()).expect("valid");
        let w = &s.workers;
        assert_eq!(s.name, "tiny", "the file names the run");
        assert_eq!((w.pair.p.tp, w.pair.d.tp), (2, 1));
        assert_eq!(w.transport.inflight, 8);
        assert_eq!(w.transport.progress, ProgressMode::Wait);
        assert_eq!(w.transport.err_mode, ErrMode::Peer);
        assert_eq!(w.verify, VerifyMode::Off);
        assert_eq!(w.lease, Duration::from_secs(10));
        assert_eq!(s.lens, PromptLens::Fixed(512));
        assert_eq!(s.arrival, Arrival::Closed { concurrency: 3 });
        assert_eq!(w.timeout, Duration::from_secs(5), "the default where neither sets it");

        let flags = BenchFlags {
            name: Some("mine".into()),
            pair: PairFlags { d_tp: Some(2), ..PairFlags::default() },
            inflight: Some(16),
            progress: Some(ProgressMode::Busy),
            err_mode: Some(ErrMode::None),
            verify: Some(VerifyMode::Full),
            lease: Some(Duration::from_secs(3)),
            prompt_len: Some("1024".into()),
            concurrency: Some(1),
            ..with_config(&file)
        };
        let s = resolve(&flags, &env()).expect("valid");
        let w = &s.workers;
        assert_eq!(s.name, "mine");
        assert_eq!((w.pair.p.tp, w.pair.d.tp), (2, 2), "--d-tp over d_tp, p_tp from the file");
        assert_eq!(w.transport.inflight, 16);
        assert_eq!(w.transport.progress, ProgressMode::Busy);
        assert_eq!(w.transport.err_mode, ErrMode::None);
        assert_eq!(w.verify, VerifyMode::Full);
        assert_eq!(w.lease, Duration::from_secs(3));
        assert_eq!(s.lens, PromptLens::Fixed(1024));
        assert_eq!(s.arrival, Arrival::Closed { concurrency: 1 });
    }

    #[test]
    fn environment_sits_between_defaults_and_flags() {
        let mut e = env();
        e.results_dir = Some("/tmp/from-env".into());
        e.stderr_is_terminal = true;
        let s = resolve(&BenchFlags::default(), &e).expect("valid");
        assert_eq!(s.results_root, PathBuf::from("/tmp/from-env"));
        assert!(s.progress_bar, "a bar only on a terminal");
        let flags = BenchFlags { results_dir: Some("/tmp/from-flag".into()), ..BenchFlags::default() };
        assert_eq!(resolve(&flags, &e).expect("valid").results_root, PathBuf::from("/tmp/from-flag"));
        e.exe = Err("deleted".into());
        assert_eq!(resolve(&BenchFlags::default(), &e).expect_err("no binary").flag, "(system)");
    }

    #[test]
    fn each_bad_flag_is_named() {
        let cases: Vec<(BenchFlags, &str)> = vec![
            (BenchFlags { inflight: Some(0), ..Default::default() }, "--inflight"),
            (BenchFlags { devices: Some(vec![0]), ..Default::default() }, "--devices"),
            (
                BenchFlags { mem: Some(MemKind::Cuda), devices: Some(vec![1, 1]), ..Default::default() },
                "--devices",
            ),
            (BenchFlags { concurrency: Some(0), ..Default::default() }, "--concurrency"),
            (BenchFlags { rate: Some(-1.0), ..Default::default() }, "--rate"),
            (BenchFlags { requests: Some(0), ..Default::default() }, "--requests"),
            (BenchFlags { duration: Some(Duration::ZERO), ..Default::default() }, "--duration"),
            (BenchFlags { prefix_hit: Some(1.0), ..Default::default() }, "--prefix-hit"),
            (BenchFlags { lease: Some(Duration::ZERO), ..Default::default() }, "--lease"),
            (BenchFlags { timeout: Some(Duration::ZERO), ..Default::default() }, "--timeout"),
            (BenchFlags { repeat: Some(0), ..Default::default() }, "--repeat"),
            (BenchFlags { slowdown: Some(f64::NAN), ..Default::default() }, "--slowdown"),
            (BenchFlags { fault: Some("kill-ucx:d0@1".into()), ..Default::default() }, "--fault"),
            (BenchFlags { listen: Some("bogus".into()), ..Default::default() }, "--listen"),
            (
                BenchFlags {
                    transport: Some(TransportKind::Multi),
                    transports: Some(vec![TransportKind::Storage]),
                    ..Default::default()
                },
                "--transports",
            ),
            (
                BenchFlags { pool_blocks: Some(1), prompt_len: Some("1024".into()), ..Default::default() },
                "--pool-blocks",
            ),
            (
                BenchFlags {
                    pair: PairFlags { p_tp: Some(8), d_tp: Some(2), ..Default::default() },
                    model: ModelFlags { num_kv_heads: Some(4), ..Default::default() },
                    ..Default::default()
                },
                "--p-tp",
            ),
        ];
        for (flags, flag) in cases {
            let e = resolve(&flags, &env()).expect_err(flag);
            assert_eq!(e.flag, flag, "{flags:?}: {e}");
        }
        // Push mode resolves, and refuses what vLLM's push connector refuses, naming the flag.
        let push = resolve(&BenchFlags { mode: Some(TransferMode::Push), ..Default::default() }, &env())
            .expect("push");
        assert_eq!(push.workers.transport.mode, TransferMode::Push);
        let e = resolve(
            &BenchFlags {
                mode: Some(TransferMode::Push),
                pair: PairFlags { p_block_size: Some(16), d_block_size: Some(32), ..Default::default() },
                ..Default::default()
            },
            &env(),
        )
        .expect_err("push needs equal block sizes");
        assert_eq!(e.flag, "--d-block-size", "{e}");
        let e = resolve(
            &BenchFlags {
                mode: Some(TransferMode::Push),
                transport: Some(TransportKind::Multi),
                ..Default::default()
            },
            &env(),
        )
        .expect_err("push writes over UCX");
        assert_eq!(e.flag, "--transport", "{e}");
        let e = resolve(
            &BenchFlags {
                mem: Some(MemKind::Cuda),
                transport: Some(TransportKind::Storage),
                ..Default::default()
            },
            &env(),
        )
        .expect_err("cuda pools over storage");
        assert_eq!(e.flag, "--transport", "{e}");
    }

    #[test]
    fn cuda_batch_resolves_with_device_pools_and_refuses_what_it_cannot_do() {
        let batch = |more: BenchFlags| BenchFlags { transport: Some(TransportKind::CudaBatch), ..more };
        let cuda = || BenchFlags { mem: Some(MemKind::Cuda), ..Default::default() };
        if cfg!(feature = "cuda") {
            let s = resolve(&batch(cuda()), &env()).expect("cuda-batch on device pools");
            assert_eq!(s.workers.transport.kind, TransportKind::CudaBatch);
            assert_eq!(resolve(&batch(BenchFlags::default()), &env()).expect_err("host pools").flag, "--mem");
        } else {
            let e = resolve(&batch(cuda()), &env()).expect_err("no cuda feature");
            assert_eq!(e.flag, "--transport", "{e}");
        }
        let cases = [
            (BenchFlags { mode: Some(TransferMode::Push), ..cuda() }, "--transport"),
            (BenchFlags { listen: Some("tcp://0.0.0.0:5700".into()), ..cuda() }, "--listen"),
            (BenchFlags { advertise_host: Some("10.1.2.3".into()), ..cuda() }, "--advertise-host"),
            (BenchFlags { fault: Some("kill-ucx:p0@1".into()), ..cuda() }, "--fault"),
        ];
        for (flags, flag) in cases {
            let e = resolve(&batch(flags), &env()).expect_err(flag);
            // Without the cuda feature the transport itself is refused first (or push's check).
            if cfg!(feature = "cuda") || flag == "--transport" {
                assert_eq!(e.flag, flag, "{e}");
            }
        }
        // In a bench config file, as the other transports.
        let file = config("transport = \"cuda-batch\"\nmem = \"cuda\"\nbatch_copy = \"kernel\"");
        let got = resolve(&with_config(&file), &env());
        if cfg!(feature = "cuda") {
            let w = got.expect("config").workers;
            assert_eq!(w.transport.kind, TransportKind::CudaBatch);
            assert_eq!(w.transport.batch_copy, BatchCopy::Kernel);
        }
    }

    #[test]
    fn device_descriptors_need_cuda_batch_the_kernel_and_the_plans_own_pairs() {
        let cuda = || BenchFlags {
            mem: Some(MemKind::Cuda),
            transport: Some(TransportKind::CudaBatch),
            batch_descriptors: Some(BatchDescriptors::Device),
            ..Default::default()
        };
        let e = resolve(
            &BenchFlags { batch_descriptors: Some(BatchDescriptors::Device), ..Default::default() },
            &env(),
        )
        .expect_err("ucx");
        assert_eq!(e.flag, "--batch-descriptors", "{e}");
        if !cfg!(feature = "cuda") {
            return;
        }
        let s = resolve(&cuda(), &env()).expect("device descriptors with the default kernel");
        assert_eq!(s.workers.transport.batch_descriptors, BatchDescriptors::Device);
        let api = BenchFlags { batch_copy: Some(BatchCopy::Api), ..cuda() };
        let e = resolve(&api, &env()).expect_err("the batch API takes no device descriptors");
        assert_eq!(e.flag, "--batch-descriptors", "{e}");
        assert!(e.to_string().contains("--batch-copy kernel"), "{e}");
        let e = resolve(&BenchFlags { coalesce: true, ..cuda() }, &env()).expect_err("coalesced");
        assert!(e.to_string().contains("--coalesce"), "{e}");
        let hybrid = BenchFlags {
            model: ModelFlags { model: Some("nemotron-h-8b".into()), ..ModelFlags::default() },
            prompt_len: Some("512".into()),
            ..cuda()
        };
        let e = resolve(&hybrid, &env()).expect_err("a hybrid plan has no one region table");
        assert_eq!(e.flag, "--batch-descriptors", "{e}");
        assert!(e.to_string().contains("hybrid"), "{e}");
        let host = BenchFlags { batch_descriptors: None, ..cuda() };
        assert_eq!(
            resolve(&host, &env()).expect("default").workers.transport.batch_descriptors,
            BatchDescriptors::Host
        );
    }

    #[test]
    fn batch_copy_is_cuda_batch_s_and_refused_elsewhere() {
        let cuda = || BenchFlags { mem: Some(MemKind::Cuda), ..Default::default() };
        let kernel = |more: BenchFlags| BenchFlags { batch_copy: Some(BatchCopy::Kernel), ..more };
        // Anywhere no cuda-batch run happens, by name (the flag, or its key in a file).
        let e = resolve(&kernel(BenchFlags::default()), &env()).expect_err("ucx");
        assert_eq!(e.flag, "--batch-copy", "{e}");
        assert!(e.to_string().contains("--transport cuda-batch"), "{e}");
        let file = config("batch_copy = \"kernel\"");
        let e = resolve(&with_config(&file), &env()).expect_err("ucx from a file");
        assert!(e.to_string().contains("batch_copy"), "names the key: {e}");
        if cfg!(feature = "cuda") {
            let batch = kernel(BenchFlags { transport: Some(TransportKind::CudaBatch), ..cuda() });
            let s = resolve(&batch, &env()).expect("cuda-batch with the kernel");
            assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel);
            let plain = BenchFlags { transport: Some(TransportKind::CudaBatch), ..cuda() };
            let s = resolve(&plain, &env()).expect("cuda-batch");
            assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel, "the default");
        }
    }

    #[test]
    fn a_bad_choice_is_refused_by_the_parser_naming_its_flag() {
        for (args, flag) in [
            (&["--progress", "spin"][..], "--progress"),
            (&["--err-mode", "x"], "--err-mode"),
            (&["--verify", "maybe"], "--verify"),
            (&["--transport", "bogus"], "--transport"),
            (&["--on-load-failure", "retry"], "--on-load-failure"),
            (&["--mode", "poll"], "--mode"),
            (&["--mem", "disk"], "--mem"),
            (&["--alloc", "weird"], "--alloc"),
            (&["--overlap", "blocks"], "--overlap"),
            (&["--dispatch", "later"], "--dispatch"),
            (&["--compare-transports", "ucx,nccl"], "--compare-transports"),
            (&["--compare-modes", "pull,sideways"], "--compare-modes"),
            (&["--dtype", "fp7"], "--dtype"),
            (&["--vllm", "0.25"], "--vllm"),
        ] {
            let e = parse(args).expect_err(flag);
            use clap::error::ErrorKind::{InvalidValue, ValueValidation};
            assert!(matches!(e.kind(), InvalidValue | ValueValidation), "{args:?}: {e}");
            assert!(e.to_string().contains(flag), "{args:?}: {e}");
        }
        // The spellings users type today.
        let f = parse(&[
            "--mem",
            "cuda",
            "--transport",
            "cuda-batch",
            "--verify",
            "sample",
            "--err-mode",
            "peer",
            "--progress",
            "busy",
            "--alloc",
            "fragmented",
            "--on-load-failure",
            "recompute",
            "--overlap",
            "layers",
            "--dispatch",
            "concurrent",
            "--mode",
            "push",
            "--transports",
            "ucx,storage",
            "--vllm",
            "0.19",
            "--dtype",
            "bfloat16",
        ])
        .expect("valid");
        assert_eq!((f.mem, f.transport), (Some(MemKind::Cuda), Some(TransportKind::CudaBatch)));
        assert_eq!(
            (f.verify, f.err_mode, f.progress),
            (Some(VerifyMode::Sample), Some(ErrMode::Peer), Some(ProgressMode::Busy))
        );
        assert_eq!(
            (f.alloc, f.on_load_failure),
            (Some(AllocPattern::Fragmented), Some(FailurePolicy::Recompute))
        );
        assert_eq!(
            (f.overlap, f.dispatch, f.mode),
            (Some(Overlap::Layers), Some(Dispatch::Concurrent), Some(TransferMode::Push))
        );
        assert_eq!(f.transports, Some(vec![TransportKind::Ucx, TransportKind::Storage]));
        assert_eq!(f.pair.vllm, Some(crate::topology::VllmVersion::V0_19));
        assert_eq!(f.model.dtype, Some(crate::settings::model::Dtype::Bf16));
        // --transports takes the members of multi's chain only.
        let e = resolve(&parse(&["--transports", "ucx,multi"]).expect("parses"), &env()).expect_err("multi");
        assert_eq!(e.to_string(), "'multi' is not ucx or storage (change --transports)");
    }

    #[test]
    fn each_bad_config_value_names_its_key_and_file() {
        for (text, key) in [
            ("inflight = 0", "inflight"),
            ("progress = \"spin\"", "progress"),
            ("err_mode = \"x\"", "err_mode"),
            ("verify = \"maybe\"", "verify"),
            ("transport = \"bogus\"", "transport"),
            ("mode = \"sideways\"", "mode"),
            ("mem = \"gpu\"", "mem"),
            ("lease = \"0s\"", "lease"),
            ("timeout = \"forever\"", "timeout"),
            ("duration = \"0s\"", "duration"),
            ("prompt_len = 0", "prompt_len"),
            ("concurrency = 0", "concurrency"),
            ("repeat = 0", "repeat"),
            ("alloc = \"weird\"", "alloc"),
            ("p_tp = 8\nd_tp = 2\nnum_kv_heads = 4", "p_tp"),
            ("layout = \"XYZ\"", "layout"),
            ("dtype = \"fp7\"", "dtype"),
            ("vllm = \"0.25\"", "vllm"),
            ("on_load_failure = \"retry\"", "on_load_failure"),
            ("transports = [\"nccl\"]", "transports"),
            ("overlap = \"blocks\"", "overlap"),
            ("inflight = \"x\"", "inflight"),
        ] {
            let file = config(text);
            let e = resolve(&with_config(&file), &env()).expect_err(text);
            assert_eq!(e.flag, format!("{key} in {}", file.path().display()), "{text}: {e}");
        }
        // The same key given as a flag too: the flag's value is the one at fault.
        let file = config("inflight = 8");
        let flags = BenchFlags { inflight: Some(0), ..with_config(&file) };
        assert_eq!(resolve(&flags, &env()).expect_err("flag").flag, "--inflight");
        // An unknown key is refused as a whole file.
        let file = config("inflite = 8");
        assert_eq!(resolve(&with_config(&file), &env()).expect_err("typo").flag, "--config");
    }

    #[test]
    fn the_shipped_bench_configs_parse_unchanged() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-configs");
        for name in ["ci", "p8d2", "mla-deepseek", "block-size-sweep", "frag-sweep", "layout-sweep"] {
            let path = dir.join(format!("{name}.toml"));
            let file: BenchFlags = layer::load(&path, "--config").unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(file.gives("p_tp").is_some(), "{name}");
        }
        // The hybrid ones resolve to a hybrid pair (vLLM's planner accepts them).
        for name in ["hybrid-qwen3-next", "hybrid-nemotron-h", "sliding-gpt-oss"] {
            let flags = BenchFlags { config: Some(dir.join(format!("{name}.toml"))), ..Default::default() };
            let s = resolve(&flags, &env()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let h = s.workers.hybrid.as_ref().unwrap_or_else(|| panic!("{name}: a hybrid pair"));
            assert_eq!(s.workers.pair.model.name, h.model.name, "{name}");
            assert!(h.p.num_blocks > 1 && h.d.num_blocks > 1, "{name}");
        }
    }

    /// What kvx bench does not move for hybrid models yet is refused, naming the flag; a flag
    /// that applies only to hybrid models is refused for a uniform one.
    #[test]
    fn hybrid_bench_refusals_name_their_flags() {
        let hybrid = |extra: BenchFlags| BenchFlags {
            model: ModelFlags { model: Some("nemotron-h-8b".into()), ..ModelFlags::default() },
            prompt_len: Some("512".into()),
            ..extra
        };
        let refused = |flags: BenchFlags| resolve(&flags, &env()).expect_err("refused").flag;
        // Push: accepted over UCX, written after the whole prefill, its own refusals.
        let push = |more: BenchFlags| BenchFlags { mode: Some(TransferMode::Push), ..more };
        let s = resolve(&hybrid(push(BenchFlags::default())), &env()).expect("hybrid push");
        assert_eq!(s.workers.transport.mode, TransferMode::Push);
        let layers = BenchFlags { overlap: Some(Overlap::Layers), ..Default::default() };
        assert_eq!(refused(hybrid(push(layers))), "--overlap");
        let rule = || BenchFlags {
            push_attention: Some(crate::layouts::hybrid::push::PushAttention::EveryRank),
            ..Default::default()
        };
        assert_eq!(refused(hybrid(rule())), "--push-attention");
        let gemma = BenchFlags {
            model: ModelFlags { model: Some("gemma-3-4b".into()), ..ModelFlags::default() },
            prompt_len: Some("512".into()),
            pair: PairFlags { p_tp: Some(1), d_tp: Some(8), ..PairFlags::default() },
            ..push(BenchFlags::default())
        };
        assert_eq!(refused(gemma), "--d-tp");
        let uniform = BenchFlags { prompt_len: Some("512".into()), ..push(rule()) };
        assert_eq!(refused(uniform), "--push-attention");
        let storage = BenchFlags { transport: Some(TransportKind::Storage), ..Default::default() };
        assert_eq!(refused(hybrid(storage)), "--transport");
        // cuda-batch copies device pools: host pools and host buffers are refused as for a
        // uniform model, device pools are taken.
        let batch = |more: BenchFlags| BenchFlags { transport: Some(TransportKind::CudaBatch), ..more };
        let cuda = || BenchFlags { mem: Some(MemKind::Cuda), ..Default::default() };
        if cfg!(feature = "cuda") {
            assert_eq!(refused(hybrid(batch(BenchFlags::default()))), "--mem");
            let staged = BenchFlags { kv_buffer_device: Some(KvBufferDevice::Cpu), ..cuda() };
            assert_eq!(refused(hybrid(batch(staged))), "--kv-buffer-device");
            let s = resolve(&hybrid(batch(cuda())), &env()).expect("a hybrid model over cuda-batch");
            assert_eq!(s.workers.transport.kind, TransportKind::CudaBatch);
            assert!(s.workers.hybrid.is_some());
        } else {
            assert_eq!(refused(hybrid(batch(cuda()))), "--transport");
        }
        let copy = BenchFlags {
            host_copy: Some(crate::layouts::hybrid::HostCopyRule::PerGroup),
            ..Default::default()
        };
        assert_eq!(refused(hybrid(copy.clone())), "--host-copy");
        assert_eq!(refused(copy), "--host-copy");
        let cpu = BenchFlags {
            kv_buffer_device: Some(KvBufferDevice::Cpu),
            host_state_page: Some(super::super::hybrid_flags::HostStatePage::Padded),
            ..Default::default()
        };
        let staged = resolve(&hybrid(cpu), &env()).expect("a hybrid bench through host buffers");
        let pair = staged.workers.hybrid.as_ref().expect("hybrid");
        assert!(pair.d.host_state_page_padded && pair.d.kv_buffer_device == KvBufferDevice::Cpu);
        // vLLM's own refusal: Nemotron-H's 8 groups do not split over TP 3... nor do its heads.
        let tp3 =
            BenchFlags { pair: PairFlags { d_tp: Some(3), ..PairFlags::default() }, ..Default::default() };
        assert_eq!(refused(hybrid(tp3)), "--d-tp");
        let exact = BenchFlags {
            state_slices: Some(crate::layouts::hybrid::StateSlices::Exact),
            ..Default::default()
        };
        assert_eq!(refused(exact), "--state-slices");
        // A pool too small for one request.
        let small = BenchFlags { pool_blocks: Some(2), ..Default::default() };
        assert_eq!(refused(hybrid(small)), "--pool-blocks");
        let ok = resolve(&hybrid(BenchFlags::default()), &env()).expect("a hybrid bench");
        assert!(ok.workers.hybrid.is_some());
    }

    #[test]
    fn memory_and_devices() {
        let one = BenchFlags { mem: Some(MemKind::Cuda), devices: Some(vec![3]), ..Default::default() };
        let s = resolve(&one, &env()).expect("cuda pools on device 3");
        assert_eq!(s.workers.mem, KvMemory::Cuda { devices: vec![3] });
        let file = config("mem = \"cuda\"\ndevices = [0, 1]");
        let s = resolve(&with_config(&file), &env()).expect("devices from the file");
        assert_eq!(s.workers.mem, KvMemory::Cuda { devices: vec![0, 1] });
        // A flag beats the file.
        let flags = BenchFlags { devices: Some(vec![2]), ..with_config(&file) };
        assert_eq!(
            resolve(&flags, &env()).expect("flag wins").workers.mem,
            KvMemory::Cuda { devices: vec![2] }
        );
        let file = config("mem = \"cuda\"\ntransport = \"storage\"");
        let e = resolve(&with_config(&file), &env()).expect_err("device pools over files");
        assert!(e.flag.contains("transport"), "{e}");
    }

    #[test]
    fn engines_carry_typed_settings_and_placements() {
        let flags = BenchFlags {
            pair: PairFlags { p_tp: Some(2), d_tp: Some(2), ..PairFlags::default() },
            model: ModelFlags { model: Some("llama-3.1-8b".into()), ..ModelFlags::default() },
            progress: Some(ProgressMode::Wait),
            listen: Some("tcp://0.0.0.0:7000".into()),
            ..BenchFlags::default()
        };
        let s = resolve(&flags, &env()).expect("valid");
        let p = s.engine(Role::Prefill);
        let d = s.engine(Role::Decode);
        assert_eq!(p.mem, [MemPlace::Host; 2]);
        assert_eq!(p.worker.transport.progress, ProgressMode::Wait);
        assert!(
            matches!(&p.launch, crate::pipeline::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:7000")
        );
        assert!(
            matches!(&d.launch, crate::pipeline::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:7001")
        );
        assert_eq!(p.side_channel_bind.as_deref(), Some("tcp://0.0.0.0:0"));
        assert_eq!(d.side_channel_bind, None);
        assert_eq!((p.seed, d.seed), (0, 1));
        // Port 0: both engines take a free port (the same for bench and bench --serve).
        let zero = BenchFlags { listen: Some("tcp://0.0.0.0:0".into()), ..flags };
        let d = resolve(&zero, &env()).expect("valid").engine(Role::Decode);
        assert!(
            matches!(&d.launch, crate::pipeline::engine::Launch::External { bind } if bind == "tcp://0.0.0.0:0")
        );
    }

    #[test]
    fn typed_worker_config_round_trips_through_the_control_protocol() {
        let flags = BenchFlags {
            transport: Some(TransportKind::Multi),
            err_mode: Some(ErrMode::Peer),
            progress: Some(ProgressMode::Busy),
            verify: Some(VerifyMode::Sample),
            notify: Some(NotifyTransport::Zmq),
            ..BenchFlags::default()
        };
        let s = resolve(&flags, &env()).expect("valid");
        let mut cfg = s.engine(Role::Decode).worker;
        cfg.rank = 1;
        cfg.mem = MemPlace::Cuda { device: 3 };
        let msg = ToWorker::Init(Box::new(cfg.clone()));
        let back: ToWorker = wire::decode(&wire::encode(&msg)).expect("decodes");
        assert_eq!(back, msg);
        let ToWorker::Init(got) = back else { panic!("an Init") };
        assert_eq!(got.transport.err_mode, ErrMode::Peer);
        assert_eq!(got.transport.progress, ProgressMode::Busy);
        assert_eq!(got.transport.kind, TransportKind::Multi);
        assert_eq!(got.transport.chain, [TransportKind::Ucx, TransportKind::Storage]);
        assert_eq!(got.transport.mode, TransferMode::Pull);
        assert_eq!(got.mem, MemPlace::Cuda { device: 3 });
        // Enums travel as names, not as strings kvx parses again: a wrong name does not decode.
        let text = String::from_utf8_lossy(&wire::encode(&msg)).into_owned();
        assert!(text.contains("busy") && text.contains("peer") && text.contains("cuda"), "{text}");
    }

    #[test]
    fn scenario_records_the_choices_by_name() {
        let s = resolve(
            &BenchFlags { on_load_failure: Some(FailurePolicy::Recompute), ..Default::default() },
            &env(),
        )
        .expect("valid");
        let sc = s.scenario();
        assert_eq!(sc.verify.as_deref(), Some("sample"), "20 requests of 640 MiB: more than 2 GiB");
        assert_eq!(sc.transport.as_deref(), Some("ucx"));
        assert_eq!(sc.mem.as_deref(), Some("host"));
        assert_eq!(sc.on_load_failure.as_deref(), Some("recompute"));
        assert_eq!(sc.extra["progress"], "hybrid");
    }

    #[test]
    fn prefill_simulation_overlap_and_dispatch_resolve_and_refuse_by_flag() {
        let push = |f: BenchFlags| BenchFlags { mode: Some(TransferMode::Push), ..f };
        // Defaults: no simulated prefill, no overlap, sequential.
        let s = resolve(&push(BenchFlags::default()), &env()).expect("push");
        assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (0, Overlap::None));
        assert_eq!(s.dispatch, Dispatch::Sequential);
        // Layer overlap dispatches both legs at once unless told otherwise.
        let layers = push(BenchFlags {
            overlap: Some(Overlap::Layers),
            prefill_time_per_layer: Some(Duration::from_micros(500)),
            ..Default::default()
        });
        let s = resolve(&layers, &env()).expect("overlap");
        assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (500_000, Overlap::Layers));
        assert_eq!(s.dispatch, Dispatch::Concurrent);
        assert_eq!(s.scenario().extra["overlap"], "layers");
        let refused = |f: BenchFlags| resolve(&f, &env()).expect_err("refused").flag;
        assert_eq!(
            refused(BenchFlags { dispatch: Some(Dispatch::Sequential), ..layers.clone() }),
            "--dispatch"
        );
        assert_eq!(
            refused(BenchFlags { prefill_time_per_layer: Some(Duration::from_secs(2)), ..layers.clone() }),
            "--prefill-time-per-layer"
        );
        // BHLNC with several heads per rank keeps a block's layers inside each head: nothing to
        // cut per layer. BLHNC registers one strided region per layer, so it can.
        let layout = |l: &str| BenchFlags {
            pair: PairFlags { layout: Some(l.into()), ..PairFlags::default() },
            ..layers.clone()
        };
        assert_eq!(refused(layout("BHLNC")), "--layout");
        assert!(resolve(&layout("BLHNC"), &env()).is_ok());
        // Pull refuses push's choices, except as the pull run of a mode comparison.
        let pull = BenchFlags { mode: Some(TransferMode::Pull), ..layers.clone() };
        assert_eq!(refused(pull.clone()), "--overlap");
        assert_eq!(
            refused(BenchFlags { mode: None, dispatch: Some(Dispatch::Concurrent), ..BenchFlags::default() }),
            "--dispatch"
        );
        let leg = resolve(&BenchFlags { in_mode_comparison: true, ..pull }, &env()).expect("comparison leg");
        assert_eq!((leg.workers.prefill.overlap, leg.dispatch), (Overlap::None, Dispatch::Sequential));
        assert_eq!(leg.workers.prefill.per_layer_ns, 500_000, "both modes compute the same prefill");
        // From the file, the error names the key.
        let file = config("mode = \"pull\"\noverlap = \"layers\"\nprefill_time_per_layer = \"1ms\"\n");
        let e = resolve(&with_config(&file), &env()).expect_err("pull with overlap");
        assert!(e.flag.starts_with("overlap in "), "{}", e.flag);
    }

    #[test]
    fn faults_parse() {
        assert_eq!(
            parse_fault("kill-ucx:p0@5"),
            Ok(FaultPlan { fault: Fault::KillUcx, role: Role::Prefill, rank: 0, after: 5 })
        );
        assert_eq!(parse_fault("exit:d1@2").map(|f| f.role), Ok(Role::Decode));
        assert!(parse_fault("exit:x1@2").is_err());
    }
}
