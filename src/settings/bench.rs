//! `kvx bench`: flags, the bench-config file (TOML), the environment and defaults resolved into
//! one `pipeline::bench::BenchSettings` per run, validated once.
//!
//! Precedence: defaults < config file < environment < flags. Every error names what to change:
//! the flag (`--inflight`), or the config key and file (`inflight in bench.toml`) when the
//! value came from the file. Every choice of a run is resolved here into its type (transport,
//! transfer mode, memory, UCX error and progress modes, verification, failure policy,
//! notifications); workers receive them as such, never as strings to parse again. Must not run
//! anything.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::engine::{
    check_inflight, check_mem_transport, parse_err_mode, parse_mode, parse_progress, parse_transport,
    parse_verify, resolve_mem,
};
use super::env::ProcessEnv;
use super::flags::{ModelFlags, PairFlags};
use super::parse::{choice, parse_duration};
use super::scenario;
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::pipeline::bench::{BenchSettings, FailurePolicy, FaultPlan};
use crate::pipeline::engine::split_endpoint;
use crate::pipeline::proto::{
    Dispatch, Fault, Overlap, PrefillSim, Role, TransferMode, TransportConfig, TransportKind, VerifyMode,
};
use crate::pipeline::setup::{KvMemory, WorkerSettings};
use crate::pipeline::workload::{Arrival, PromptLens};
use crate::report::files::results_root;
use crate::transfer::cuda_batch::BatchCopy;
use crate::transfer::notify::NotifyTransport;

/// `kvx bench`'s flags as plain data (what `cli` parsed; `None`/`false` when not given).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BenchFlags {
    pub model: ModelFlags,
    pub pair: PairFlags,
    pub config: Option<PathBuf>,
    pub sweep: Option<PathBuf>,
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
    pub rate: Option<f64>,
    pub concurrency: Option<u32>,
    pub prompt_len: Option<String>,
    pub prompt_lens: Option<PathBuf>,
    pub warmup: Option<u64>,
    pub prefix_hit: Option<f64>,
    pub alloc: Option<String>,
    pub pool_blocks: Option<u32>,
    pub seed: Option<u64>,
    pub repeat: Option<u32>,
    pub verify: Option<String>,
    pub on_load_failure: Option<String>,
    pub lease: Option<Duration>,
    pub timeout: Option<Duration>,
    pub transport: Option<String>,
    pub transports: Option<Vec<String>>,
    pub storage_dir: Option<PathBuf>,
    pub storage_direct_io: bool,
    pub storage_fsync: bool,
    pub compare_transports: Option<Vec<String>>,
    pub compare_modes: Option<Vec<String>>,
    pub fault: Option<String>,
    pub mode: Option<String>,
    pub mem: Option<String>,
    /// `--devices 0,1` (or `--device N`, a list of one).
    pub devices: Option<Vec<u32>>,
    pub ucx_lib: Option<PathBuf>,
    pub ucx_tls: Option<String>,
    pub err_mode: Option<String>,
    pub progress: Option<String>,
    pub huge_pages: bool,
    pub inflight: Option<u32>,
    pub coalesce: bool,
    pub slowdown: Option<f64>,
    pub notify: Option<NotifyTransport>,
    pub batch_copy: Option<BatchCopy>,
    pub listen: Option<String>,
    pub advertise_host: Option<String>,
    pub results_dir: Option<PathBuf>,
    pub name: Option<String>,
    pub no_calibrate: bool,
    pub serve: bool,
    /// `--prefill-time-per-layer`
    pub prefill_time_per_layer: Option<Duration>,
    /// `--overlap none|layers`
    pub overlap: Option<String>,
    /// `--dispatch sequential|concurrent`
    pub dispatch: Option<String>,
    /// Set by `--compare-modes` on each of its runs (not a flag): the pull run takes the push
    /// choices (`--overlap`, `--dispatch`) as not applying to it, where a pull run alone
    /// refuses them.
    pub in_mode_comparison: bool,
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
    pub mode: Option<String>,
    pub mem: Option<String>,
    pub devices: Option<Vec<u32>>,
    pub ucx_tls: Option<String>,
    pub err_mode: Option<String>,
    pub progress: Option<String>,
    pub huge_pages: Option<bool>,
    pub inflight: Option<u32>,
    pub coalesce: Option<bool>,
    pub notify: Option<NotifyTransport>,
    pub batch_copy: Option<BatchCopy>,
    pub prefill_time_per_layer: Option<String>,
    pub overlap: Option<String>,
    pub dispatch: Option<String>,
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

/// Flags over file over defaults: one bench run.
pub fn resolve(flags: &BenchFlags, env: &ProcessEnv) -> Result<BenchSettings, ConfigError> {
    let file = match &flags.config {
        Some(p) => BenchFile::load(p)?,
        None => BenchFile::default(),
    };
    let layers = Layers { flags, file: &file, path: flags.config.as_deref() };
    layers.resolve(env).map_err(|e| layers.attribute(e))
}

/// The flag layer over the file layer of one resolution.
struct Layers<'a> {
    flags: &'a BenchFlags,
    file: &'a BenchFile,
    path: Option<&'a Path>,
}

/// Parses a duration from the config file (the error names the flag; `attribute` renames it).
fn dur(flag: &str, v: Option<&str>) -> Result<Option<Duration>, ConfigError> {
    v.map(|s| parse_duration(s).map_err(|e| ConfigError::new(flag, e))).transpose()
}

impl Layers<'_> {
    /// Renames an error's flag to the config key (and file) when the file, not a flag, gave
    /// the value the error is about.
    fn attribute(&self, e: ConfigError) -> ConfigError {
        match (self.path, self.set_by_file(&e.flag)) {
            (Some(path), true) => {
                let key = e.flag.trim_start_matches("--").replace('-', "_");
                ConfigError { flag: format!("{key} in {}", path.display()), reason: e.reason }
            }
            _ => e,
        }
    }

    /// Whether the value behind `flag` came from the config file.
    fn set_by_file(&self, flag: &str) -> bool {
        let (f, m, p, fi) = (self.flags, &self.flags.model, &self.flags.pair, self.file);
        let (by_flag, by_file) = match flag {
            "--model" => (m.model.is_some(), fi.model.is_some()),
            "--model-config" => (m.model_config.is_some(), fi.model_config.is_some()),
            "--num-kv-heads" => (m.num_kv_heads.is_some(), fi.num_kv_heads.is_some()),
            "--head-dim" => (m.head_dim.is_some(), fi.head_dim.is_some()),
            "--layers" => (m.layers.is_some(), fi.layers.is_some()),
            "--dtype" => (m.dtype.is_some(), fi.dtype.is_some()),
            "--p-tp" => (p.p_tp.is_some(), fi.p_tp.is_some()),
            "--d-tp" => (p.d_tp.is_some(), fi.d_tp.is_some()),
            "--vllm" => (p.vllm.is_some(), fi.vllm.is_some()),
            "--layout" => (p.layout.is_some(), fi.layout.is_some()),
            "--p-layout" => (p.p_layout.is_some(), fi.p_layout.is_some()),
            "--d-layout" => (p.d_layout.is_some(), fi.d_layout.is_some()),
            "--block-size" => (p.block_size.is_some(), fi.block_size.is_some()),
            "--p-block-size" => (p.p_block_size.is_some(), fi.p_block_size.is_some()),
            "--d-block-size" => (p.d_block_size.is_some(), fi.d_block_size.is_some()),
            "--requests" => (f.requests.is_some(), fi.requests.is_some()),
            "--duration" => (f.duration.is_some(), fi.duration.is_some()),
            "--rate" => (f.rate.is_some(), fi.rate.is_some()),
            "--concurrency" => (f.concurrency.is_some(), fi.concurrency.is_some()),
            "--prompt-len" => (f.prompt_len.is_some() || f.prompt_lens.is_some(), fi.prompt_len.is_some()),
            "--prompt-lens" => (f.prompt_len.is_some() || f.prompt_lens.is_some(), fi.prompt_lens.is_some()),
            "--warmup" => (f.warmup.is_some(), fi.warmup.is_some()),
            "--prefix-hit" => (f.prefix_hit.is_some(), fi.prefix_hit.is_some()),
            "--alloc" => (f.alloc.is_some(), fi.alloc.is_some()),
            "--pool-blocks" => (f.pool_blocks.is_some(), fi.pool_blocks.is_some()),
            "--repeat" => (f.repeat.is_some(), fi.repeat.is_some()),
            "--verify" => (f.verify.is_some(), fi.verify.is_some()),
            "--on-load-failure" => (f.on_load_failure.is_some(), fi.on_load_failure.is_some()),
            "--lease" => (f.lease.is_some(), fi.lease.is_some()),
            "--timeout" => (f.timeout.is_some(), fi.timeout.is_some()),
            "--transport" => (f.transport.is_some(), fi.transport.is_some()),
            "--transports" => (f.transports.is_some(), fi.transports.is_some()),
            "--mode" => (f.mode.is_some(), fi.mode.is_some()),
            "--mem" => (f.mem.is_some(), fi.mem.is_some()),
            "--devices" => (f.devices.is_some(), fi.devices.is_some()),
            "--err-mode" => (f.err_mode.is_some(), fi.err_mode.is_some()),
            "--progress" => (f.progress.is_some(), fi.progress.is_some()),
            "--inflight" => (f.inflight.is_some(), fi.inflight.is_some()),
            "--prefill-time-per-layer" => {
                (f.prefill_time_per_layer.is_some(), fi.prefill_time_per_layer.is_some())
            }
            "--overlap" => (f.overlap.is_some(), fi.overlap.is_some()),
            "--dispatch" => (f.dispatch.is_some(), fi.dispatch.is_some()),
            "--batch-copy" => (f.batch_copy.is_some(), fi.batch_copy.is_some()),
            _ => return false,
        };
        !by_flag && by_file
    }

    fn model(&self) -> ModelFlags {
        let (m, fi) = (&self.flags.model, self.file);
        ModelFlags {
            model: m.model.clone().or(fi.model.clone()),
            model_config: m.model_config.clone().or(fi.model_config.clone()),
            num_kv_heads: m.num_kv_heads.or(fi.num_kv_heads),
            head_dim: m.head_dim.or(fi.head_dim),
            layers: m.layers.or(fi.layers),
            dtype: m.dtype.clone().or(fi.dtype.clone()),
            mla: m.mla || fi.mla.unwrap_or(false),
            mla_dim: m.mla_dim,
        }
    }

    fn pair(&self) -> PairFlags {
        let (p, fi) = (&self.flags.pair, self.file);
        PairFlags {
            p_tp: p.p_tp.or(fi.p_tp),
            d_tp: p.d_tp.or(fi.d_tp),
            vllm: p.vllm.clone().or(fi.vllm.clone()),
            layout: p.layout.clone().or(fi.layout.clone()),
            p_layout: p.p_layout.clone().or(fi.p_layout.clone()),
            d_layout: p.d_layout.clone().or(fi.d_layout.clone()),
            block_size: p.block_size.or(fi.block_size),
            p_block_size: p.p_block_size.or(fi.p_block_size),
            d_block_size: p.d_block_size.or(fi.d_block_size),
            permute: p.permute || fi.permute.unwrap_or(false),
        }
    }

    fn prompt_lens(&self) -> Result<PromptLens, ConfigError> {
        let (f, fi) = (self.flags, self.file);
        Ok(match (&f.prompt_len, &f.prompt_lens, &fi.prompt_len, &fi.prompt_lens) {
            (Some(s), _, _, _) => s.parse::<PromptLens>().map_err(|e| ConfigError::new("--prompt-len", e))?,
            (None, Some(p), _, _) => PromptLens::from_file(p)?,
            (None, None, Some(v), _) => {
                let s = match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                s.parse::<PromptLens>().map_err(|e| ConfigError::new("--prompt-len", e))?
            }
            (None, None, None, Some(p)) => PromptLens::from_file(p)?,
            _ => PromptLens::Fixed(2048),
        })
    }

    /// `--mem` and `--devices`: where the run's KV pools live.
    fn mem(&self) -> Result<KvMemory, ConfigError> {
        let (f, fi) = (self.flags, self.file);
        let devices = f.devices.clone().or(fi.devices.clone());
        let kind = f.mem.clone().or(fi.mem.clone()).unwrap_or_else(|| "host".into());
        resolve_mem(&kind, devices)
    }

    fn transport(&self, slowdown: f64) -> Result<TransportConfig, ConfigError> {
        let (f, fi) = (self.flags, self.file);
        let kind = match f.transport.clone().or(fi.transport.clone()) {
            Some(t) => parse_transport(&t).map_err(|e| ConfigError::new("--transport", e))?,
            None => TransportKind::Ucx,
        };
        let chain: Vec<TransportKind> = match f.transports.clone().or(fi.transports.clone()) {
            Some(list) => list
                .iter()
                .map(|t| {
                    choice(t, &[("ucx", TransportKind::Ucx), ("storage", TransportKind::Storage)])
                        .map_err(|e| ConfigError::new("--transports", e))
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
        let mode = match f.mode.clone().or(fi.mode.clone()) {
            Some(m) => parse_mode(&m).map_err(|e| ConfigError::new("--mode", e))?,
            None => Default::default(),
        };
        let err_mode = match f.err_mode.clone().or(fi.err_mode.clone()) {
            Some(m) => parse_err_mode(&m).map_err(|e| ConfigError::new("--err-mode", e))?,
            None => Default::default(),
        };
        let progress = match f.progress.clone().or(fi.progress.clone()) {
            Some(m) => parse_progress(&m).map_err(|e| ConfigError::new("--progress", e))?,
            None => Default::default(),
        };
        // `--batch-copy` says how cuda-batch issues its batches: refused where it is not used
        // (`--compare-transports` passes it to its cuda-batch run only).
        let batch_copy = f.batch_copy.or(fi.batch_copy);
        if batch_copy.is_some() && kind != TransportKind::CudaBatch {
            return Err(ConfigError::new(
                "--batch-copy",
                "applies to --transport cuda-batch (or --compare-transports with cuda-batch)",
            ));
        }
        let batch_copy = batch_copy.unwrap_or_default();
        Ok(TransportConfig {
            kind,
            chain: if kind == TransportKind::Multi { chain } else { vec![] },
            mode,
            ucx_lib: f.ucx_lib.clone(),
            err_mode,
            progress,
            ucx_alloc: false,
            huge_pages: f.huge_pages || fi.huge_pages.unwrap_or(false),
            inflight: check_inflight(f.inflight.or(fi.inflight).unwrap_or(64))?,
            coalesce: f.coalesce || fi.coalesce.unwrap_or(false),
            notify: f.notify.or(fi.notify).unwrap_or_default(),
            storage_dir: f.storage_dir.clone().or(fi.storage_dir.clone()),
            storage_direct_io: f.storage_direct_io,
            storage_fsync: f.storage_fsync,
            batch_copy,
            slowdown,
        })
    }

    /// `--prefill-time-per-layer`, `--overlap` and `--dispatch`: the simulated prefill and how
    /// push mode overlaps and dispatches. Overlap and concurrent dispatch are push's; a layer
    /// overlap needs a layout whose regions are per layer, and decode registered before
    /// prefill computes (concurrent dispatch, its default).
    fn prefill_sim(
        &self,
        mode: TransferMode,
        pair: &crate::layouts::compat::PairSpec,
    ) -> Result<(PrefillSim, Dispatch), ConfigError> {
        let (f, fi) = (self.flags, self.file);
        let per_layer = match f.prefill_time_per_layer {
            Some(d) => d,
            None => {
                dur("--prefill-time-per-layer", fi.prefill_time_per_layer.as_deref())?.unwrap_or_default()
            }
        };
        // A request's compute is layers x this: cap it so the product cannot overflow or hang.
        if per_layer > Duration::from_secs(1) {
            return Err(ConfigError::new(
                "--prefill-time-per-layer",
                format!("must be at most 1s per layer, got {per_layer:?}"),
            ));
        }
        let overlap = match f.overlap.clone().or(fi.overlap.clone()) {
            Some(o) => choice(&o, &[("none", Overlap::None), ("layers", Overlap::Layers)])
                .map_err(|e| ConfigError::new("--overlap", e))?,
            None => Overlap::None,
        };
        let explicit_dispatch = match f.dispatch.clone().or(fi.dispatch.clone()) {
            Some(d) => Some(
                choice(&d, &[("sequential", Dispatch::Sequential), ("concurrent", Dispatch::Concurrent)])
                    .map_err(|e| ConfigError::new("--dispatch", e))?,
            ),
            None => None,
        };
        if mode == TransferMode::Pull {
            // A comparison's pull run: the push choices do not apply to it.
            if self.flags.in_mode_comparison {
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
            if explicit_dispatch == Some(Dispatch::Concurrent) {
                return Err(ConfigError::new(
                    "--dispatch",
                    "concurrent dispatch needs --mode push: in pull mode decode reads the blocks prefill \
                     names in its answer, so it cannot start before prefill answered",
                ));
            }
        }
        let dispatch = match (explicit_dispatch, overlap) {
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
    fn hosts(&self) -> Result<(Option<String>, String, String), ConfigError> {
        let f = self.flags;
        if let Some(ep) = &f.listen {
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
        let (bind_host, advertise_default) = match &f.listen {
            Some(ep) => {
                let (h, _) = split_endpoint(ep);
                ("0.0.0.0".to_string(), if h == "0.0.0.0" || h == "*" { "127.0.0.1".to_string() } else { h })
            }
            None => ("127.0.0.1".to_string(), "127.0.0.1".to_string()),
        };
        Ok((f.listen.clone(), bind_host, f.advertise_host.clone().unwrap_or(advertise_default)))
    }

    fn resolve(&self, env: &ProcessEnv) -> Result<BenchSettings, ConfigError> {
        let (f, fi) = (self.flags, self.file);
        let model = self.model();
        let pair_flags = self.pair();
        let lens = self.prompt_lens()?;
        let concurrency = f.concurrency.or(fi.concurrency).unwrap_or(2);
        if concurrency == 0 || concurrency > 4096 {
            return Err(ConfigError::new("--concurrency", format!("must be 1..4096, got {concurrency}")));
        }
        let arrival = match f.rate.or(fi.rate) {
            Some(r) if r.is_finite() && r > 0.0 && r <= 1e6 => Arrival::Poisson { rate: r },
            Some(r) => {
                return Err(ConfigError::new(
                    "--rate",
                    format!("must be a positive rate up to 1e6 per second, got {r}"),
                ));
            }
            None => Arrival::Closed { concurrency },
        };
        let duration = match f.duration {
            Some(d) => Some(d),
            None => dur("--duration", fi.duration.as_deref())?,
        };
        if duration.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::new("--duration", "must be longer than 0"));
        }
        let requests = f.requests.or(fi.requests).or(if duration.is_none() { Some(20) } else { None });
        if requests == Some(0) {
            return Err(ConfigError::new("--requests", "at least 1 request is needed"));
        }
        let prefix_hit = f.prefix_hit.or(fi.prefix_hit).unwrap_or(0.0);
        if !(0.0..1.0).contains(&prefix_hit) {
            return Err(ConfigError::new("--prefix-hit", format!("must be in [0, 1), got {prefix_hit}")));
        }
        let alloc: AllocPattern = f
            .alloc
            .clone()
            .or(fi.alloc.clone())
            .unwrap_or_else(|| "contiguous".into())
            .parse()
            .map_err(|e| ConfigError::new("--alloc", e))?;
        let p_bs = pair_flags.p_block_size.unwrap_or(pair_flags.block_size()).max(1);
        let d_bs = pair_flags.d_block_size.unwrap_or(pair_flags.block_size()).max(1);
        let in_flight = match arrival {
            Arrival::Closed { concurrency } => concurrency,
            Arrival::Poisson { rate } => (rate.ceil() as u32).clamp(2, 64),
        };
        let max_tokens = lens.max();
        let default_pool = |bs: u32| max_tokens.div_ceil(bs).saturating_mul(in_flight + 2).max(16);
        let pool_p = f.pool_blocks.or(fi.pool_blocks).unwrap_or_else(|| default_pool(p_bs));
        let pool_d = f.pool_blocks.or(fi.pool_blocks).unwrap_or_else(|| default_pool(d_bs));
        let slowdown = f.slowdown.unwrap_or(0.0);
        if !(0.0..=10.0).contains(&slowdown) {
            return Err(ConfigError::new(
                "--slowdown",
                format!("must be a fraction in 0..=10, got {slowdown}"),
            ));
        }
        let transport = self.transport(slowdown)?;
        let pair = scenario::resolve_pair(&model, &pair_flags, pool_p, pool_d)?;
        match transport.mode {
            TransferMode::Pull => pair.validate().map(|_| ())?,
            // Push's own refusals (vLLM's push connector), each naming its flag.
            TransferMode::Push => {
                pair.validate_push()?;
                if transport.kind != TransportKind::Ucx {
                    return Err(ConfigError::new(
                        "--transport",
                        format!(
                            "push mode WRITEs over UCX; '{}' is a pull-mode transport (use --mode pull)",
                            transport.kind.as_str()
                        ),
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
        let bytes_per_request = pair.d_geometry(0).block_bytes_all_layers()
            * u64::from(max_tokens.div_ceil(d_bs))
            * u64::from(pair.d.tp);
        let total_bytes = bytes_per_request.saturating_mul(requests.unwrap_or(1000));
        let verify = match f.verify.clone().or(fi.verify.clone()) {
            Some(v) => parse_verify(&v).map_err(|e| ConfigError::new("--verify", e))?,
            None if total_bytes <= 2 << 30 => VerifyMode::Full,
            None => VerifyMode::Sample,
        };
        let on_failure = match f.on_load_failure.clone().or(fi.on_load_failure.clone()) {
            Some(p) => choice(&p, &[("fail", FailurePolicy::Fail), ("recompute", FailurePolicy::Recompute)])
                .map_err(|e| ConfigError::new("--on-load-failure", e))?,
            None => FailurePolicy::Fail,
        };
        let (prefill, dispatch) = self.prefill_sim(transport.mode, &pair)?;
        let fault = f.fault.as_deref().map(parse_fault).transpose()?;
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
        let mem = self.mem()?;
        check_mem_transport(&mem, transport.kind)?;
        let lease = match f.lease {
            Some(d) => d,
            None => dur("--lease", fi.lease.as_deref())?.unwrap_or(Duration::from_secs(30)),
        };
        let timeout = match f.timeout {
            Some(d) => d,
            None => dur("--timeout", fi.timeout.as_deref())?.unwrap_or(Duration::from_secs(5)),
        };
        if lease.is_zero() {
            return Err(ConfigError::new("--lease", "must be longer than 0"));
        }
        if timeout.is_zero() {
            return Err(ConfigError::new("--timeout", "must be longer than 0"));
        }
        let repeat = f.repeat.or(fi.repeat).unwrap_or(1);
        if repeat == 0 || repeat > 1000 {
            return Err(ConfigError::new("--repeat", format!("must be 1..1000, got {repeat}")));
        }
        let exe = env
            .exe
            .clone()
            .map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
        let worker_env: Vec<(String, String)> = f
            .ucx_tls
            .clone()
            .or(fi.ucx_tls.clone())
            .map(|tls| ("UCX_TLS".to_string(), tls))
            .into_iter()
            .collect();
        let (listen, bind_host, advertise_host) = self.hosts()?;
        super::engine::check_one_machine(transport.kind, listen.as_deref(), &advertise_host)?;
        let name = f
            .name
            .clone()
            .or(fi.name.clone())
            .or_else(|| self.path.and_then(Path::file_stem).map(|s| s.to_string_lossy().to_string()))
            .unwrap_or_else(|| "bench".into());
        Ok(BenchSettings {
            name,
            workers: WorkerSettings {
                pair,
                transport,
                verify,
                mem,
                lease,
                timeout,
                alloc,
                seed: f.seed.or(fi.seed).unwrap_or(0),
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
            warmup: f.warmup.or(fi.warmup).unwrap_or(2),
            prefix_hit,
            on_failure,
            fault,
            repeat,
            calibrate: !f.no_calibrate,
            progress_bar: env.stderr_is_terminal,
            results_root: results_root(f.results_dir.as_deref(), env.results_dir.clone()),
        })
    }
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

    use super::*;
    use crate::pipeline::proto::{self, ToWorker, TransferMode};
    use crate::transfer::memory::MemPlace;
    use crate::transfer::ucx::{ErrMode, ProgressMode};

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
            progress: Some("busy".into()),
            err_mode: Some("none".into()),
            verify: Some("full".into()),
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
            (BenchFlags { progress: Some("spin".into()), ..Default::default() }, "--progress"),
            (BenchFlags { err_mode: Some("x".into()), ..Default::default() }, "--err-mode"),
            (BenchFlags { verify: Some("maybe".into()), ..Default::default() }, "--verify"),
            (BenchFlags { transport: Some("bogus".into()), ..Default::default() }, "--transport"),
            (BenchFlags { on_load_failure: Some("retry".into()), ..Default::default() }, "--on-load-failure"),
            (BenchFlags { mode: Some("poll".into()), ..Default::default() }, "--mode"),
            (BenchFlags { mem: Some("disk".into()), ..Default::default() }, "--mem"),
            (BenchFlags { devices: Some(vec![0]), ..Default::default() }, "--devices"),
            (
                BenchFlags { mem: Some("cuda".into()), devices: Some(vec![1, 1]), ..Default::default() },
                "--devices",
            ),
            (BenchFlags { concurrency: Some(0), ..Default::default() }, "--concurrency"),
            (BenchFlags { rate: Some(-1.0), ..Default::default() }, "--rate"),
            (BenchFlags { requests: Some(0), ..Default::default() }, "--requests"),
            (BenchFlags { duration: Some(Duration::ZERO), ..Default::default() }, "--duration"),
            (BenchFlags { prefix_hit: Some(1.0), ..Default::default() }, "--prefix-hit"),
            (BenchFlags { alloc: Some("weird".into()), ..Default::default() }, "--alloc"),
            (BenchFlags { lease: Some(Duration::ZERO), ..Default::default() }, "--lease"),
            (BenchFlags { timeout: Some(Duration::ZERO), ..Default::default() }, "--timeout"),
            (BenchFlags { repeat: Some(0), ..Default::default() }, "--repeat"),
            (BenchFlags { slowdown: Some(f64::NAN), ..Default::default() }, "--slowdown"),
            (BenchFlags { fault: Some("kill-ucx:d0@1".into()), ..Default::default() }, "--fault"),
            (BenchFlags { listen: Some("bogus".into()), ..Default::default() }, "--listen"),
            (
                BenchFlags {
                    transport: Some("multi".into()),
                    transports: Some(vec!["storage".into()]),
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
        let push =
            resolve(&BenchFlags { mode: Some("push".into()), ..Default::default() }, &env()).expect("push");
        assert_eq!(push.workers.transport.mode, TransferMode::Push);
        let e = resolve(
            &BenchFlags {
                mode: Some("push".into()),
                pair: PairFlags { p_block_size: Some(16), d_block_size: Some(32), ..Default::default() },
                ..Default::default()
            },
            &env(),
        )
        .expect_err("push needs equal block sizes");
        assert_eq!(e.flag, "--d-block-size", "{e}");
        let e = resolve(
            &BenchFlags { mode: Some("push".into()), transport: Some("multi".into()), ..Default::default() },
            &env(),
        )
        .expect_err("push writes over UCX");
        assert_eq!(e.flag, "--transport", "{e}");
        let e = resolve(
            &BenchFlags { mem: Some("cuda".into()), transport: Some("storage".into()), ..Default::default() },
            &env(),
        )
        .expect_err("cuda pools over storage");
        assert_eq!(e.flag, "--transport", "{e}");
    }

    #[test]
    fn cuda_batch_resolves_with_device_pools_and_refuses_what_it_cannot_do() {
        let batch = |more: BenchFlags| BenchFlags { transport: Some("cuda-batch".into()), ..more };
        let cuda = || BenchFlags { mem: Some("cuda".into()), ..Default::default() };
        if cfg!(feature = "cuda") {
            let s = resolve(&batch(cuda()), &env()).expect("cuda-batch on device pools");
            assert_eq!(s.workers.transport.kind, TransportKind::CudaBatch);
            assert_eq!(resolve(&batch(BenchFlags::default()), &env()).expect_err("host pools").flag, "--mem");
        } else {
            let e = resolve(&batch(cuda()), &env()).expect_err("no cuda feature");
            assert_eq!(e.flag, "--transport", "{e}");
        }
        let cases = [
            (BenchFlags { mode: Some("push".into()), ..cuda() }, "--transport"),
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
    fn batch_copy_is_cuda_batch_s_and_refused_elsewhere() {
        let cuda = || BenchFlags { mem: Some("cuda".into()), ..Default::default() };
        let kernel = |more: BenchFlags| BenchFlags { batch_copy: Some(BatchCopy::Kernel), ..more };
        // Anywhere no cuda-batch run happens, by name (the flag, or its key in a file).
        let e = resolve(&kernel(BenchFlags::default()), &env()).expect_err("ucx");
        assert_eq!(e.flag, "--batch-copy", "{e}");
        assert!(e.to_string().contains("--transport cuda-batch"), "{e}");
        let file = config("batch_copy = \"kernel\"");
        let e = resolve(&with_config(&file), &env()).expect_err("ucx from a file");
        assert!(e.to_string().contains("batch_copy"), "names the key: {e}");
        if cfg!(feature = "cuda") {
            let batch = kernel(BenchFlags { transport: Some("cuda-batch".into()), ..cuda() });
            let s = resolve(&batch, &env()).expect("cuda-batch with the kernel");
            assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel);
            let plain = BenchFlags { transport: Some("cuda-batch".into()), ..cuda() };
            let s = resolve(&plain, &env()).expect("cuda-batch");
            assert_eq!(s.workers.transport.batch_copy, BatchCopy::Kernel, "the default");
        }
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
    fn memory_and_devices() {
        let one = BenchFlags { mem: Some("cuda".into()), devices: Some(vec![3]), ..Default::default() };
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
            progress: Some("wait".into()),
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
            transport: Some("multi".into()),
            err_mode: Some("peer".into()),
            progress: Some("busy".into()),
            verify: Some("sample".into()),
            notify: Some(NotifyTransport::Zmq),
            ..BenchFlags::default()
        };
        let s = resolve(&flags, &env()).expect("valid");
        let mut cfg = s.engine(Role::Decode).worker;
        cfg.rank = 1;
        cfg.mem = MemPlace::Cuda { device: 3 };
        let msg = ToWorker::Init(Box::new(cfg.clone()));
        let back: ToWorker = proto::decode(&proto::encode(&msg)).expect("decodes");
        assert_eq!(back, msg);
        let ToWorker::Init(got) = back else { panic!("an Init") };
        assert_eq!(got.transport.err_mode, ErrMode::Peer);
        assert_eq!(got.transport.progress, ProgressMode::Busy);
        assert_eq!(got.transport.kind, TransportKind::Multi);
        assert_eq!(got.transport.chain, [TransportKind::Ucx, TransportKind::Storage]);
        assert_eq!(got.transport.mode, TransferMode::Pull);
        assert_eq!(got.mem, MemPlace::Cuda { device: 3 });
        // Enums travel as names, not as strings kvx parses again: a wrong name does not decode.
        let text = String::from_utf8_lossy(&proto::encode(&msg)).into_owned();
        assert!(text.contains("busy") && text.contains("peer") && text.contains("cuda"), "{text}");
    }

    #[test]
    fn scenario_records_the_choices_by_name() {
        let s =
            resolve(&BenchFlags { on_load_failure: Some("recompute".into()), ..Default::default() }, &env())
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
        use crate::pipeline::proto::{Dispatch, Overlap};
        let push = |f: BenchFlags| BenchFlags { mode: Some("push".into()), ..f };
        // Defaults: no simulated prefill, no overlap, sequential.
        let s = resolve(&push(BenchFlags::default()), &env()).expect("push");
        assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (0, Overlap::None));
        assert_eq!(s.dispatch, Dispatch::Sequential);
        // Layer overlap dispatches both legs at once unless told otherwise.
        let layers = push(BenchFlags {
            overlap: Some("layers".into()),
            prefill_time_per_layer: Some(Duration::from_micros(500)),
            ..Default::default()
        });
        let s = resolve(&layers, &env()).expect("overlap");
        assert_eq!((s.workers.prefill.per_layer_ns, s.workers.prefill.overlap), (500_000, Overlap::Layers));
        assert_eq!(s.dispatch, Dispatch::Concurrent);
        assert_eq!(s.scenario().extra["overlap"], "layers");
        let refused = |f: BenchFlags| resolve(&f, &env()).expect_err("refused").flag;
        assert_eq!(
            refused(BenchFlags { dispatch: Some("sequential".into()), ..layers.clone() }),
            "--dispatch"
        );
        assert_eq!(refused(BenchFlags { overlap: Some("blocks".into()), ..layers.clone() }), "--overlap");
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
        let pull = BenchFlags { mode: Some("pull".into()), ..layers.clone() };
        assert_eq!(refused(pull.clone()), "--overlap");
        assert_eq!(
            refused(BenchFlags { mode: None, dispatch: Some("concurrent".into()), ..BenchFlags::default() }),
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
