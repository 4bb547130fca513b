//! `kvx bench`'s job and `kvx plan`'s request ("plan" means descriptor planning only: the
//! `kvx plan` command and `layouts::read_plan::Planner`; what `kvx bench` runs is a job):
//!
//! - [`BenchJob`]: what `kvx bench` was asked to run (one bench, `--serve`,
//!   `--compare-transports` or `--sweep`), with every bench of it resolved before the first
//!   starts, so a bad flag or a bad point fails before any worker process exists;
//! - [`PlanFlags`]: `kvx plan`'s flags, resolved once ([`resolve_plan`]) into the one request
//!   it plans (`layouts::request::PlanRequest`: a uniform or a hybrid pair, pulled or pushed,
//!   with the posting rates of a pull plan); [`plan_error`] names the flag a planning error is
//!   about.

use std::path::{Path, PathBuf};

use clap::Args;

use super::bench::{BenchFlags, resolve};
use super::env::ProcessEnv;
use super::flags::{Format, ModelFlags, PairFlags};
use super::hybrid_case::{self, HYBRID_VLLM, HybridCase, RequestSource};
use super::scenario::{self, PlanScenario};
use super::sweep;
use crate::config::bench::BenchSettings;
use crate::config::bench::MAX_PROMPT;
use crate::config::bench::ServeOptions;
use crate::config::sweep::SweepJob;
use crate::error::ConfigError;
use crate::layouts::alloc::allocate;
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::HostStatePage;
use crate::layouts::hybrid::geometry::Side;
use crate::layouts::read_plan::{RequestBlocks, RequestIds};
use crate::layouts::request::{
    HybridPlanRequest, HybridSource, PlanCase, PlanError, PlanRequest, UniformRequest,
};
use crate::topology::TransferMode;
use crate::vocab::kinds::TransportKind;
use crate::vocab::knob::Knob;

/// What `kvx bench` was asked to do, with every run resolved before any starts.
#[derive(Debug, Clone)]
pub enum BenchJob {
    /// One bench.
    Single(Box<BenchSettings>),
    /// `--serve`: the bench's workload through HTTP engines and the proxy.
    Serve(Box<BenchSettings>, ServeOptions),
    /// `--compare-transports`: the same workload on each transport, in the order given.
    CompareTransports(Vec<BenchSettings>),
    /// `--compare-modes`: the same workload in each transfer mode (pull, push), in order.
    CompareModes(Vec<BenchSettings>),
    /// `--compare-kv-buffer-device`: the same workload with each KV buffer (the pool, a host
    /// buffer), in order.
    CompareKvBuffer(Vec<BenchSettings>),
    /// `--sweep`: one bench per point of the file's axes.
    Sweep(SweepJob),
}

impl BenchJob {
    /// Directory the run is written under.
    pub fn results_root(&self) -> &Path {
        match self {
            BenchJob::Single(s) | BenchJob::Serve(s, _) => &s.results_root,
            BenchJob::CompareTransports(runs)
            | BenchJob::CompareModes(runs)
            | BenchJob::CompareKvBuffer(runs) => runs.first().map_or(Path::new(""), |s| &s.results_root),
            BenchJob::Sweep(plan) => &plan.results_root,
        }
    }
}

/// The names of a list of choices, as its flag spells them.
fn names<T: clap::ValueEnum>(list: &[T]) -> Vec<String> {
    list.iter().filter_map(|c| c.to_possible_value().map(|v| v.get_name().to_string())).collect()
}

/// Resolves `kvx bench`'s flags into what to run.
pub fn resolve_bench_job(flags: &BenchFlags, env: &ProcessEnv) -> Result<BenchJob, ConfigError> {
    // The compare lists are config keys too: the job's kind comes from flags over the file.
    let flags = &match &flags.config {
        Some(_) => {
            let merged = super::bench::layers(flags)?.values;
            BenchFlags {
                compare_transports: merged.compare_transports,
                compare_modes: merged.compare_modes,
                compare_kv_buffer_device: merged.compare_kv_buffer_device,
                ..flags.clone()
            }
        }
        None => flags.clone(),
    };
    // One kind of job per run: a flag of another kind is refused, never ignored.
    let kinds = [
        (flags.serve, "--serve"),
        (flags.compare_transports.is_some(), "--compare-transports"),
        (flags.compare_modes.is_some(), "--compare-modes"),
        (flags.compare_kv_buffer_device.is_some(), "--compare-kv-buffer-device"),
        (flags.sweep.is_some(), "--sweep"),
    ];
    let given: Vec<&str> = kinds.iter().filter(|(on, _)| *on).map(|(_, f)| *f).collect();
    if let [first, second, ..] = given.as_slice() {
        return Err(ConfigError::new(
            *second,
            format!("{first} and {second} are different kinds of run: give one of them"),
        ));
    }
    if let Some(n) = flags.rounds {
        let comparison = given.first().is_some_and(|f| f.starts_with("--compare"));
        if !comparison {
            return Err(ConfigError::new(
                "--rounds",
                format!(
                    "rounds interleave a comparison's runs: add --compare-transports, --compare-modes or \
                     --compare-kv-buffer-device, or drop --rounds {n} (--repeat repeats one run)"
                ),
            ));
        }
    }
    // A compare list runs each entry once. It sets --transport or --mode for each of its runs,
    // over a value a config file gives (flags override files; clap refuses both as flags).
    for (list, flag) in [
        (flags.compare_transports.as_deref().map(names), "--compare-transports"),
        (flags.compare_modes.as_deref().map(names), "--compare-modes"),
        (flags.compare_kv_buffer_device.as_deref().map(names), "--compare-kv-buffer-device"),
    ] {
        let Some(list) = list else { continue };
        if let Some(twice) = list.iter().enumerate().find_map(|(i, n)| list[..i].contains(n).then_some(n)) {
            return Err(ConfigError::new(flag, format!("lists {twice} twice: give each once")));
        }
    }
    if flags.serve {
        let opts = ServeOptions {
            slo: super::load::parse_slo(flags.run_name.slo.as_deref())?,
            metrics_port: flags.metrics_port,
        };
        return Ok(BenchJob::Serve(Box::new(resolve(flags, env)?), opts));
    }
    if let Some(kinds) = &flags.compare_transports {
        let mut runs = Vec::new();
        for (given, flag) in [
            (flags.batch_copy.is_some(), "--batch-copy"),
            (flags.batch_launch.is_some(), "--batch-launch"),
            (flags.batch_descriptors.is_some(), "--batch-descriptors"),
        ] {
            if given && !kinds.contains(&TransportKind::CudaBatch) {
                return Err(ConfigError::new(
                    flag,
                    format!(
                        "applies to --transport cuda-batch: add cuda-batch to --compare-transports, or drop {flag}"
                    ),
                ));
            }
        }
        for &kind in kinds {
            let one = BenchFlags {
                compare_transports: None,
                transport: Some(kind),
                // How cuda-batch copies is its run's alone.
                batch_copy: flags.batch_copy.filter(|_| kind == TransportKind::CudaBatch),
                batch_launch: flags.batch_launch.filter(|_| kind == TransportKind::CudaBatch),
                batch_descriptors: flags.batch_descriptors.filter(|_| kind == TransportKind::CudaBatch),
                ..flags.clone()
            };
            runs.push(resolve(&one, env)?);
        }
        if runs.is_empty() {
            return Err(ConfigError::new(
                "--compare-transports",
                "needs at least one of ucx, storage, multi, cuda-batch",
            ));
        }
        return Ok(BenchJob::CompareTransports(runs));
    }
    if let Some(modes) = &flags.compare_modes {
        let mut runs = Vec::new();
        for &mode in modes {
            let one = BenchFlags {
                compare_modes: None,
                mode: super::flags::ModeFlags { mode: Some(mode) },
                in_mode_comparison: true,
                ..flags.clone()
            };
            runs.push(resolve(&one, env)?);
        }
        if runs.is_empty() {
            return Err(ConfigError::new("--compare-modes", "needs at least one of pull, push"));
        }
        return Ok(BenchJob::CompareModes(runs));
    }
    if let Some(buffers) = &flags.compare_kv_buffer_device {
        let cpu = crate::vocab::kinds::KvBufferDevice::Cpu;
        for (given, flag) in [
            (flags.hybrid_rules.host_copy.is_some(), "--host-copy"),
            (flags.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
            (flags.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
        ] {
            if given && !buffers.contains(&cpu) {
                return Err(ConfigError::new(
                    flag,
                    format!(
                        "applies to the host buffer's copies: add cpu to --compare-kv-buffer-device, or drop {flag}"
                    ),
                ));
            }
        }
        let mut runs = Vec::new();
        for &buffer in buffers {
            let one = BenchFlags {
                compare_kv_buffer_device: None,
                kv_buffer: super::flags::KvBufferFlags { kv_buffer_device: Some(buffer) },
                // How the host buffer copies is its run's alone.
                hybrid_rules: super::flags::HybridRuleFlags {
                    host_copy: flags.hybrid_rules.host_copy.filter(|_| buffer == cpu),
                    host_state_page: flags.hybrid_rules.host_state_page.filter(|_| buffer == cpu),
                    host_descriptors: flags.hybrid_rules.host_descriptors.filter(|_| buffer == cpu),
                    ..flags.hybrid_rules
                },
                ..flags.clone()
            };
            runs.push(resolve(&one, env)?);
        }
        if runs.is_empty() {
            return Err(ConfigError::new("--compare-kv-buffer-device", "needs at least one of cuda, cpu"));
        }
        return Ok(BenchJob::CompareKvBuffer(runs));
    }
    if let Some(path) = &flags.sweep {
        return Ok(BenchJob::Sweep(sweep::resolve_job(flags, path, env)?));
    }
    Ok(BenchJob::Single(Box::new(resolve(flags, env)?)))
}

/// `kvx plan`'s flags.
#[derive(Debug, Clone, Args)]
pub struct PlanFlags {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub pair: PairFlags,
    /// Read the model and request from a JSON scenario ({"vllm_version", "model", "request"},
    /// the objects of a case in vLLM oracle descriptors.json, or a hybrid case of
    /// hybrid_v033.json): the scenario states the model and both engines, so no model or
    /// engine flag goes with it.
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with_all = [
            "local_blocks", "prompt_len", "model", "model_config", "num_kv_heads", "head_dim", "layers",
            "dtype", "mla", "mla_dim", "hma", "p_tp", "d_tp", "vllm", "layout", "p_layout", "d_layout",
            "block_size", "p_block_size", "d_block_size", "kernel_block_size", "no_prefix_caching",
            "gdn_prefill", "attention_backend", "permute", "p_num_blocks", "d_num_blocks",
        ]
    )]
    pub scenario: Option<PathBuf>,
    /// Decode block ids of the request (comma-separated).
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        requires = "remote_blocks",
        help_heading = "Request"
    )]
    pub local_blocks: Option<Vec<u32>>,
    /// Prefill block ids of the request (comma-separated).
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        requires = "local_blocks",
        help_heading = "Request"
    )]
    pub remote_blocks: Option<Vec<u32>>,
    #[command(flatten, next_help_heading = "Request")]
    pub prompt: super::flags::PromptLenFlags,
    #[command(flatten, next_help_heading = "Request")]
    pub alloc: super::flags::AllocFlags,
    #[command(flatten, next_help_heading = "Request")]
    pub seed: super::flags::SeedFlags,
    #[command(flatten, next_help_heading = "Request")]
    pub prefix_hit: super::flags::PrefixHitFlags,
    #[command(flatten)]
    pub kv_buffer: super::flags::KvBufferFlags,
    #[command(flatten)]
    pub hybrid_rules: super::flags::HybridRuleFlags,
    #[command(flatten)]
    pub push_attention: super::flags::PushAttentionFlags,
    /// Prefill pool size in blocks (default: enough for the request, at least 2x).
    #[arg(long, value_name = "N", help_heading = "Request")]
    pub p_num_blocks: Option<u32>,
    /// Decode pool size in blocks (default: enough for the request, at least 2x).
    #[arg(long, value_name = "N", help_heading = "Request")]
    pub d_num_blocks: Option<u32>,
    /// The prefill request id used in notifications.
    #[arg(long, default_value = "req-P", help_heading = "Request")]
    pub p_request_id: String,
    /// Only this decode rank (default: all); in push mode, only the WRITEs into it.
    #[arg(long, value_name = "RANK")]
    pub d_rank: Option<u32>,
    #[command(flatten)]
    pub mode: super::flags::ModeFlags,
    /// Pairs to print per read in the table view.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub show_pairs: usize,
    #[arg(long, value_name = "FILE", help_heading = "Posting cost", help = super::posting::RATES_HELP)]
    pub rates: Option<PathBuf>,
    /// Measured posting costs replacing the defaults, in ns per descriptor: ucx, cuda-ipc,
    /// cuda-batch, and cuda-batch-call (ns per batched call), e.g. ucx=76,cuda-batch=150.
    #[arg(long, value_name = "KEY=NS", value_delimiter = ',', help_heading = "Posting cost")]
    pub post_ns: Vec<String>,
    /// Bandwidth ceilings replacing the defaults, in GB/s: ucx, cuda-ipc, cuda-batch.
    #[arg(long, value_name = "KEY=GBPS", value_delimiter = ',', help_heading = "Posting cost")]
    pub ceiling_gbps: Vec<String>,
    /// Write the request's predicted transfer as a simulator's profile instead of the plan
    /// (needs --rates FILE of kvx calibrate): llm-d-sim (llm-d-inference-sim's YAML config
    /// keys kv-cache-transfer-latency, kv-cache-transfer-time-per-token) or dynamo-mocker
    /// (Dynamo mocker's --kv-transfer-bandwidth, --kv-bytes-per-token)
    #[arg(long, value_enum, value_name = "SIMULATOR", help_heading = "Posting cost")]
    pub export: Option<ExportArg>,
    // json prints every uncoalesced pair (the command's long help says so).
    #[arg(long, value_enum, default_value_t = Format::Table, help = super::flags::FORMAT_HELP)]
    pub format: Format,
}

/// The simulators `kvx plan --export` writes a profile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportArg {
    /// llm-d's inference simulator: a YAML config (kv-cache-transfer-latency,
    /// kv-cache-transfer-time-per-token)
    #[value(name = "llm-d-sim")]
    LlmdSim,
    /// Dynamo's mocker: arguments (--kv-transfer-bandwidth GB/s, --kv-bytes-per-token)
    DynamoMocker,
}

impl PlanFlags {
    /// `--prefix-hit`, or 0.
    pub fn prefix_hit(&self) -> f64 {
        self.prefix_hit.prefix_hit()
    }

    /// `--prompt-len` as the one length `kvx plan` plans (a range is refused: one request).
    pub fn prompt_len(&self) -> Result<Option<u32>, ConfigError> {
        let Some(text) = &self.prompt.prompt_len else { return Ok(None) };
        text.trim().parse().map(Some).map_err(|_| {
            ConfigError::new(
                "--prompt-len",
                format!("kvx plan plans one request: give one length in tokens, e.g. 8192, not {text:?}"),
            )
        })
    }
}

/// Resolves `kvx plan`'s flags into the one request it plans: a hybrid model's (a case of
/// vLLM's hybrid oracle, or a hybrid preset with a prompt), else a uniform pair's; pulled or
/// pushed. A pull plan carries the posting rates (`--rates`, `--post-ns`, `--ceiling-gbps`);
/// a hybrid push resolves them too, so a bad one is refused in either mode.
pub fn resolve_plan(args: &PlanFlags) -> Result<PlanRequest, ConfigError> {
    let rates = || super::posting::resolve_rates(args.rates.as_deref(), &args.post_ns, &args.ceiling_gbps);
    let case = match resolve_hybrid(args)? {
        Some(case) => {
            let rates = rates()?;
            let request = HybridPlanRequest {
                name: case.name,
                pair: case.pair,
                source: match case.request {
                    RequestSource::Case(r) => HybridSource::Case(r),
                    RequestSource::Prompt { tokens, prefix_hit } => {
                        HybridSource::Prompt { tokens, prefix_hit }
                    }
                },
                p_request_id: args.p_request_id.clone(),
                vllm_version: HYBRID_VLLM,
            };
            match args.mode.mode() {
                TransferMode::Pull => PlanCase::HybridPull { request, rates },
                TransferMode::Push => PlanCase::HybridPush { request, rates },
            }
        }
        None => {
            let request = resolve_uniform(args)?;
            match args.mode.mode() {
                TransferMode::Pull => PlanCase::UniformPull { rates: rates()?, request },
                TransferMode::Push => PlanCase::UniformPush { rates: rates()?, request },
            }
        }
    };
    Ok(PlanRequest { case, d_rank: args.d_rank })
}

/// A planning error in the words of `kvx plan`'s flags.
pub fn plan_error(e: PlanError) -> ConfigError {
    match e {
        PlanError::Uniform(e) => e,
        PlanError::Hybrid(e) => ConfigError::from(e),
        PlanError::NoDecodeRank { d_rank, d_tp } => {
            ConfigError::new("--d-rank", format!("decode rank {d_rank} does not exist (decode TP is {d_tp})"))
        }
    }
}

/// A uniform pair's request: from a scenario file, from explicit block ids, or from a prompt
/// length whose blocks are allocated with `--alloc`.
fn resolve_uniform(args: &PlanFlags) -> Result<UniformRequest, ConfigError> {
    let plan = request(args)?;
    // Push mode WRITEs into decode ranks: the one to show must exist.
    if args.mode.mode() == TransferMode::Push {
        plan.pair.validate_push()?;
        if let Some(d) = args.d_rank
            && d >= plan.pair.d.tp
        {
            return Err(ConfigError::new(
                "--d-rank",
                format!("decode rank {d} does not exist (decode TP is {})", plan.pair.d.tp),
            ));
        }
    }
    Ok(plan)
}

/// `kvx plan` of a hybrid model: a case of vLLM's hybrid oracle (`--scenario`), or a hybrid
/// preset (`--model qwen3-next-80b-a3b`, not a uniform preset) with `--prompt-len`. `None` for
/// every other request.
fn resolve_hybrid(args: &PlanFlags) -> Result<Option<HybridCase>, ConfigError> {
    let mut case = resolve_hybrid_case(args)?;
    match case.as_mut() {
        Some(c) if args.mode.mode() == TransferMode::Push => {
            // vLLM's push connector writes the KV cache itself, as kvx bench's push does.
            let staged = [c.pair.p.kv_buffer_device, c.pair.d.kv_buffer_device]
                .into_iter()
                .find(|&b| b != crate::layouts::hybrid::KvBufferDevice::Cuda);
            if let Some(b) = staged {
                if args.scenario.is_some() {
                    return Err(ConfigError::new(
                        "--mode",
                        "this --scenario case stages the KV through a host buffer, which push does not (kvx \
                         stages for pull mode only, as vLLM's NixlConnector): use --mode pull",
                    ));
                }
                super::workers::check_kv_buffer(
                    b,
                    TransferMode::Push,
                    crate::vocab::kinds::TransportKind::Ucx,
                )?;
            }
            c.pair.push_attention = args.push_attention.push_attention.unwrap_or_default();
        }
        _ if args.push_attention.push_attention.is_some() => {
            return Err(ConfigError::new(
                "--push-attention",
                "applies to hybrid models in push mode (which decode ranks prefill writes attention into): add \
                 --mode push with a hybrid --model, or drop it",
            ));
        }
        _ => {}
    }
    Ok(case)
}

/// [`resolve_hybrid`]'s case, before the transfer mode's own rules.
fn resolve_hybrid_case(args: &PlanFlags) -> Result<Option<HybridCase>, ConfigError> {
    if args.scenario.is_some() {
        if args.kv_buffer.kv_buffer_device.is_some() {
            return Err(ConfigError::new(
                "--kv-buffer-device",
                "a --scenario case names its own engines' buffers",
            ));
        }
        return match resolve_hybrid_scenario(args)? {
            Some(mut case) => {
                case.pair.state_slices = args.hybrid_rules.state_slices.unwrap_or_default();
                case.pair.host_copy = args.hybrid_rules.host_copy.unwrap_or_default();
                if args.hybrid_rules.host_state_page == Some(HostStatePage::Padded) {
                    (case.pair.p.host_state_page_padded, case.pair.d.host_state_page_padded) = (true, true);
                }
                if args.hybrid_rules.host_descriptors
                    == Some(crate::layouts::hybrid::HostDescriptors::PerGroup)
                {
                    (case.pair.p.host_descriptors_per_group, case.pair.d.host_descriptors_per_group) =
                        (true, true);
                }
                Ok(Some(case))
            }
            None => match [
                (args.hybrid_rules.state_slices.is_some(), "--state-slices"),
                (args.hybrid_rules.host_copy.is_some(), "--host-copy"),
                (args.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
                (args.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
            ]
            .into_iter()
            .find(|(given, _)| *given)
            {
                Some((_, flag)) => {
                    Err(ConfigError::new(flag, "applies to hybrid models; this --scenario is a uniform one"))
                }
                None => Ok(None),
            },
        };
    }
    let Some(model) = super::hybrid_flags::hybrid_preset_of(
        &args.model,
        args.pair.engine.vllm,
        &[(args.local_blocks.is_some(), "--local-blocks")],
    )?
    else {
        for (given, flag) in [
            (args.kv_buffer.kv_buffer_device.is_some(), "--kv-buffer-device"),
            (args.hybrid_rules.state_slices.is_some(), "--state-slices"),
            (args.hybrid_rules.host_copy.is_some(), "--host-copy"),
            (args.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
            (args.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
        ] {
            if given {
                return Err(ConfigError::new(
                    flag,
                    "applies to hybrid models (a hybrid preset or model TOML with --model, e.g. nemotron-h-8b)",
                ));
            }
        }
        return Ok(None);
    };
    let name = &model.name;
    let tokens = args.prompt_len()?.ok_or_else(|| {
        ConfigError::new(
            "--prompt-len",
            format!("give {name}'s request as --prompt-len TOKENS (or --scenario CASE)"),
        )
    })?;
    if tokens == 0 || tokens > MAX_PROMPT {
        return Err(ConfigError::new(
            "--prompt-len",
            format!("must be 1..={MAX_PROMPT} tokens, got {tokens}"),
        ));
    }
    if !(0.0..1.0).contains(&args.prefix_hit()) {
        return Err(ConfigError::new(
            "--prefix-hit",
            format!("must be in [0, 1), got {}", args.prefix_hit()),
        ));
    }
    let (mut p, mut d) =
        super::hybrid_flags::hybrid_engines(&args.pair, 1, args.p_num_blocks, args.d_num_blocks)?;
    // A pool not given is sized from what the request needs on that side (its block size,
    // every KV cache group), as `kvx bench` sizes its pools.
    for (e, side, given) in
        [(&mut p, Side::Prefill, args.p_num_blocks), (&mut d, Side::Decode, args.d_num_blocks)]
    {
        if given.is_none() {
            e.num_blocks = super::hybrid_flags::request_pool(&model, e, side, tokens, 2)?;
        }
    }
    if let Some(device) = args.kv_buffer.kv_buffer_device {
        (p.kv_buffer_device, d.kv_buffer_device) = (device, device);
    }
    for (given, flag) in [
        (args.hybrid_rules.host_copy.is_some(), "--host-copy"),
        (args.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
        (args.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
    ] {
        if given && d.kv_buffer_device != crate::layouts::hybrid::KvBufferDevice::Cpu {
            return Err(ConfigError::new(
                flag,
                format!("applies to the host buffer: add --kv-buffer-device cpu, or drop {flag}"),
            ));
        }
    }
    let padded = args.hybrid_rules.host_state_page == Some(HostStatePage::Padded);
    (p.host_state_page_padded, d.host_state_page_padded) = (padded, padded);
    let own = args.hybrid_rules.host_descriptors == Some(crate::layouts::hybrid::HostDescriptors::PerGroup);
    (p.host_descriptors_per_group, d.host_descriptors_per_group) = (own, own);
    Ok(Some(HybridCase {
        name: model.name.clone(),
        pair: crate::layouts::hybrid::HybridPairSpec {
            model,
            p,
            d,
            permute_local_kv: args.pair.permute,
            state_slices: args.hybrid_rules.state_slices.unwrap_or_default(),
            host_copy: args.hybrid_rules.host_copy.unwrap_or_default(),
            push_attention: Default::default(),
            stated: Default::default(),
        },
        request: RequestSource::Prompt { tokens, prefix_hit: args.prefix_hit() },
    }))
}

/// `kvx plan --scenario FILE` when FILE is one case of vLLM's hybrid oracle
/// (`hybrid_v033.json`): its pair and request, planned by `layouts::hybrid` (pull only). `None`
/// when there is no scenario or it is a uniform one.
pub fn resolve_hybrid_scenario(args: &PlanFlags) -> Result<Option<HybridCase>, ConfigError> {
    let Some(path) = &args.scenario else { return Ok(None) };
    let text = crate::input::read_text(path)
        .map_err(|e| ConfigError::new("--scenario", format!("cannot read {}: {e}", path.display())))?;
    let doc = match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(doc) => doc,
        // JSON that stops short (a file cut off): say where it ends, not what a reader of a
        // shorter document would miss.
        Err(e) if e.is_eof() => {
            return Err(ConfigError::new(
                "--scenario",
                format!("{}: the file ends early, inside its JSON ({e}): it is cut off", path.display()),
            ));
        }
        // Not JSON at all: the uniform scenario reader says what is wrong with it.
        Err(_) => return Ok(None),
    };
    if !hybrid_case::is_hybrid_case(&doc) {
        return Ok(None);
    }
    hybrid_case::parse(&doc).map(Some)
}

fn request(args: &PlanFlags) -> Result<UniformRequest, ConfigError> {
    if let Some(path) = &args.scenario {
        let text = crate::input::read_text(path)
            .map_err(|e| ConfigError::new("--scenario", format!("cannot read {}: {e}", path.display())))?;
        let sc = PlanScenario::parse(&text, &path.display().to_string())?;
        return Ok(UniformRequest { pair: sc.pair()?, blocks: sc.blocks()?, ids: sc.ids() });
    }
    if !(0.0..1.0).contains(&args.prefix_hit()) || args.prefix_hit().is_nan() {
        return Err(ConfigError::new(
            "--prefix-hit",
            format!("must be in [0, 1), got {}", args.prefix_hit()),
        ));
    }
    let ids = RequestIds { p_request_id: args.p_request_id.clone(), d_request_id: "req-D".into() };
    let p_bs = args.pair.p_block_size.unwrap_or(args.pair.block_size()).max(1);
    let d_bs = args.pair.d_block_size.unwrap_or(args.pair.block_size()).max(1);
    match (&args.local_blocks, &args.remote_blocks, args.prompt_len()?) {
        (Some(local), Some(remote), _) => {
            let p_pool = args.p_num_blocks.unwrap_or_else(|| remote.iter().max().map_or(1, |m| m + 1));
            let d_pool = args.d_num_blocks.unwrap_or_else(|| local.iter().max().map_or(1, |m| m + 1));
            let pair = scenario::resolve_pair(&args.model, &args.pair, p_pool, d_pool)?;
            Ok(UniformRequest {
                pair,
                blocks: RequestBlocks { local: local.clone(), remote: remote.clone() },
                ids,
            })
        }
        (_, _, Some(tokens)) => {
            if tokens == 0 || tokens > MAX_PROMPT {
                return Err(ConfigError::new(
                    "--prompt-len",
                    format!("a prompt is 1..={MAX_PROMPT} tokens, got {tokens}"),
                ));
            }
            let n_p = tokens.div_ceil(p_bs);
            let n_d = tokens.div_ceil(d_bs);
            let p_pool = args.p_num_blocks.unwrap_or(n_p.saturating_mul(2));
            let d_pool = args.d_num_blocks.unwrap_or(n_d.saturating_mul(2));
            let pair = scenario::resolve_pair(&args.model, &args.pair, p_pool, d_pool)?;
            // Before the pools' block lists are built (`--alloc random` lists every block).
            pair.check_pool_blocks()?;
            let remote = allocate(args.alloc.alloc(), n_p, p_pool, args.seed.seed(), Knob::PNumBlocks)?;
            let hit = (f64::from(n_d) * args.prefix_hit()).floor() as u32;
            let local =
                allocate(args.alloc.alloc(), n_d - hit, d_pool, args.seed.seed() ^ 0x5eed, Knob::DNumBlocks)?;
            check_listable(&pair, args.mode.mode(), remote.len(), tokens)?;
            Ok(UniformRequest { pair, blocks: RequestBlocks { local, remote }, ids })
        }
        _ => Err(ConfigError::new(
            "--prompt-len",
            "give the request as --prompt-len TOKENS, as --local-blocks and --remote-blocks, or as --scenario FILE",
        )),
    }
}

/// Most descriptors `kvx plan` lists for one request (its JSON alone is about 30 bytes each).
const MAX_LISTED_DESCRIPTORS: u64 = 1 << 25;

/// Refuses a request whose plan is too large to list, before any of it is built (an upper
/// bound: every block of every region, read from every rank of the larger engine).
fn check_listable(
    pair: &PairSpec,
    mode: TransferMode,
    blocks: usize,
    tokens: u32,
) -> Result<(), ConfigError> {
    // Geometry needs a valid pair (a TP of 0 has none): its own errors come first.
    match mode {
        TransferMode::Pull => pair.validate().map(|_| ())?,
        TransferMode::Push => pair.validate_push().map(|_| ())?,
    }
    let regions = pair.p_geometry(0).regions().len().max(pair.d_geometry(0).regions().len()) as u64;
    let ranks = u64::from(pair.p.tp.max(pair.d.tp));
    let bound = (blocks as u64).saturating_mul(regions).saturating_mul(ranks);
    if bound > MAX_LISTED_DESCRIPTORS {
        return Err(ConfigError::new(
            "--prompt-len",
            format!(
                "a request of {tokens} tokens can take up to {bound} descriptors, more than the \
                 {MAX_LISTED_DESCRIPTORS} kvx plan lists; give a shorter prompt (descriptor counts grow \
                 linearly with it)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::transfer::cuda_batch::BatchCopy;

    fn env() -> ProcessEnv {
        ProcessEnv {
            results_dir: None,
            stderr_is_terminal: false,
            launcher: Ok(None),
            exe: Ok(PathBuf::from("/usr/bin/kvx")),
        }
    }

    #[test]
    fn two_kinds_of_run_are_refused_not_ignored() {
        let serve_compare = BenchFlags {
            serve: true,
            compare_transports: Some(vec![TransportKind::Ucx, TransportKind::Storage]),
            ..BenchFlags::default()
        };
        let e = resolve_bench_job(&serve_compare, &env()).expect_err("serve and compare");
        assert_eq!(e.flag, "--compare-transports", "{e}");
        let sweep_modes = BenchFlags {
            sweep: Some(PathBuf::from("bench-configs/layout-sweep.toml")),
            compare_modes: Some(vec![TransferMode::Pull, TransferMode::Push]),
            ..BenchFlags::default()
        };
        let e = resolve_bench_job(&sweep_modes, &env()).expect_err("sweep and compare");
        assert!(e.to_string().contains("--compare-modes and --sweep"), "{e}");
    }

    #[test]
    fn compare_lists_are_config_keys_and_name_each_choice_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("modes.toml");
        std::fs::write(&file, "compare_modes = [\"pull\", \"push\"]\nmode = \"pull\"\n").expect("write");
        let flags = BenchFlags { config: Some(file), ..BenchFlags::default() };
        match resolve_bench_job(&flags, &env()).expect("compare from the file") {
            BenchJob::CompareModes(runs) => {
                assert_eq!(
                    runs.iter().map(|r| r.workers.transport.mode).collect::<Vec<_>>(),
                    [TransferMode::Pull, TransferMode::Push]
                );
            }
            other => panic!("one run, not a comparison: {other:?}"),
        }
        let twice = BenchFlags {
            compare_modes: Some(vec![TransferMode::Pull, TransferMode::Pull]),
            ..BenchFlags::default()
        };
        let e = resolve_bench_job(&twice, &env()).expect_err("pull twice");
        assert_eq!(e.flag, "--compare-modes", "{e}");
    }

    #[test]
    fn plans_resolve_every_run_first() {
        let flags = BenchFlags {
            compare_transports: Some(vec![TransportKind::Ucx, TransportKind::Storage]),
            ..Default::default()
        };
        let BenchJob::CompareTransports(runs) = resolve_bench_job(&flags, &env()).expect("valid") else {
            panic!("a comparison")
        };
        let kinds: Vec<_> = runs.iter().map(|r| r.workers.transport.kind).collect();
        assert_eq!(kinds, [TransportKind::Ucx, TransportKind::Storage]);
        // cuda-batch is a valid value, resolved (and refused) as --transport cuda-batch is.
        let gpu = BenchFlags {
            compare_transports: Some(vec![TransportKind::Ucx, TransportKind::CudaBatch]),
            mem: crate::settings::flags::MemFlags {
                mem: Some(crate::transfer::memory::MemKind::Cuda),
                ..Default::default()
            },
            ..Default::default()
        };
        match resolve_bench_job(&gpu, &env()) {
            Ok(BenchJob::CompareTransports(runs)) => {
                let kinds: Vec<_> = runs.iter().map(|r| r.workers.transport.kind).collect();
                assert_eq!(kinds, [TransportKind::Ucx, TransportKind::CudaBatch]);
            }
            Ok(_) => panic!("a comparison"),
            Err(e) => assert!(!cfg!(feature = "cuda") && e.flag == "--transport", "{e:?}"),
        }
        // --batch-copy goes to the cuda-batch run only, and needs one.
        // (The UCX run keeps the default, the kernel.)
        let api = BenchFlags { batch_copy: Some(BatchCopy::Api), ..gpu.clone() };
        match resolve_bench_job(&api, &env()) {
            Ok(BenchJob::CompareTransports(runs)) => {
                let copies: Vec<_> = runs.iter().map(|r| r.workers.transport.batch_copy).collect();
                assert_eq!(copies, [BatchCopy::Kernel, BatchCopy::Api]);
            }
            Ok(_) => panic!("a comparison"),
            Err(e) => assert!(!cfg!(feature = "cuda") && e.flag == "--transport", "{e:?}"),
        }
        let no_batch = BenchFlags {
            compare_transports: Some(vec![TransportKind::Ucx, TransportKind::Storage]),
            batch_copy: Some(BatchCopy::Kernel),
            ..Default::default()
        };
        assert_eq!(resolve_bench_job(&no_batch, &env()).expect_err("no cuda-batch run").flag, "--batch-copy");
        let host =
            BenchFlags { mem: crate::settings::flags::MemFlags { mem: None, ..Default::default() }, ..gpu };
        assert_eq!(
            resolve_bench_job(&host, &env()).expect_err("host pools").flag,
            if cfg!(feature = "cuda") { "--mem" } else { "--transport" }
        );
        let serve = BenchFlags { serve: true, ..Default::default() };
        assert!(matches!(resolve_bench_job(&serve, &env()), Ok(BenchJob::Serve(..))));
        assert!(matches!(resolve_bench_job(&BenchFlags::default(), &env()), Ok(BenchJob::Single(_))));
    }
}
