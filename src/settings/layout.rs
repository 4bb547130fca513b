//! `kvx layout`: its flags ([`LayoutFlags`]) resolved once ([`resolve_layout`]) into one
//! engine and the geometry of one of its ranks (`report::layout::EngineLayout`). Must not
//! print anything.

use clap::Args;

use super::flags::{Format, ModelFlags};
use super::knobs;
use super::scenario;
use crate::config::layout::EngineLayout;
use crate::config::layout::ModelOrigin;
use crate::error::ConfigError;
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::HybridModel;
use crate::layouts::hybrid::geometry::{EngineGeometry, HybridEngineSpec, Side};
use crate::layouts::{EngineSpec, Layout, RankGeometry};
use crate::topology::VllmVersion;

/// `kvx layout`'s flags.
#[derive(Debug, Clone, Args)]
pub struct LayoutFlags {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub tp: super::flags::TpFlags,
    #[command(flatten)]
    pub rank: super::flags::RankFlags,
    #[command(flatten)]
    pub engine: super::flags::EngineFlags,
    /// Blocks in the rank's pool.
    #[arg(long, default_value_t = 1024)]
    pub num_blocks: u32,
    /// Request size for the per-request figures.
    #[arg(long, default_value_t = 8192)]
    pub tokens: u32,
    /// Regions to list in the table view (the rest are summarised).
    #[arg(long, default_value_t = 6)]
    pub show_regions: usize,
    #[command(flatten)]
    pub kv_buffer: super::flags::KvBufferFlags,
    #[arg(long, value_enum, default_value_t = Format::Table, help = super::flags::FORMAT_HELP)]
    pub format: Format,
}

impl LayoutFlags {
    /// `--rank`, or 0.
    pub fn rank(&self) -> u32 {
        self.rank.rank.unwrap_or(0)
    }
}

/// Resolves `kvx layout`'s flags into the engine it shows: a hybrid preset's, else one rank of
/// a uniform engine.
pub fn resolve_layout(args: &LayoutFlags) -> Result<EngineLayout, ConfigError> {
    if let Some((model, geom, origin)) = resolve_hybrid(args)? {
        let (tp, rank, num_blocks) = (args.tp.tp, args.rank(), args.num_blocks);
        return Ok(EngineLayout::Hybrid { model, tp, rank, num_blocks, geom, origin });
    }
    let (pair, geom, layer_names, origin) = resolve(args)?;
    Ok(EngineLayout::Uniform {
        pair,
        rank: args.rank(),
        geom,
        layer_names,
        request_tokens: args.tokens,
        origin,
    })
}

/// `kvx layout --model` of a hybrid preset (Mamba/GDN state or sliding windows beside
/// attention, not a uniform preset): the model and its engine's geometry as vLLM 0.33 builds
/// it. `None` for every other model.
pub fn resolve_hybrid(
    args: &LayoutFlags,
) -> Result<Option<(HybridModel, EngineGeometry, ModelOrigin)>, ConfigError> {
    let m = &args.model;
    let resolved = crate::settings::model::resolve_flags(m)?;
    let origin =
        ModelOrigin { architecture: resolved.architecture.clone(), defaults: resolved.defaults.clone() };
    let crate::layouts::model_config::PlanModel::Hybrid(model) = resolved.plan else { return Ok(None) };
    let name = &model.name;
    let shape_flag = [
        (m.num_kv_heads.is_some(), "--num-kv-heads"),
        (m.head_dim.is_some(), "--head-dim"),
        (m.layers.is_some(), "--layers"),
        (m.dtype.is_some(), "--dtype"),
        (m.mla || m.mla_dim.is_some(), "--mla"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag));
    if let Some(flag) = shape_flag {
        return Err(ConfigError::new(flag, format!("{name} is a hybrid preset: its shape is the preset's")));
    }
    if args.engine.vllm() != VllmVersion::V0_33 {
        return Err(ConfigError::new("--vllm", "hybrid models follow vLLM 0.33's rules"));
    }
    if args.rank() >= args.tp.tp {
        return Err(ConfigError::new(
            "--rank",
            format!("rank {} does not exist with --tp {}", args.rank(), args.tp.tp),
        ));
    }
    let mut engine = HybridEngineSpec::new(args.tp.tp, args.num_blocks);
    engine.block_tokens = args.engine.block_size();
    engine.kv_buffer_device = args.kv_buffer.device();
    engine.gdn_prefill = args.engine.gdn_prefill.unwrap_or_default();
    engine.attention_backend = args.engine.attention_backend.unwrap_or_default();
    engine.prefix_caching = !args.engine.no_prefix_caching;
    engine.kernel_block_tokens = args.engine.kernel_block_size;
    if let Some(l) = &args.engine.layout {
        engine.layout =
            Layout::parse_for(l, args.engine.vllm()).map_err(|e| ConfigError::new("--layout", e))?;
    }
    let g = EngineGeometry::new(&model, &engine, Side::Prefill).map_err(knobs::for_one_engine)?;
    Ok(Some((model, g, origin)))
}

/// Checks `kvx layout`'s flags: the engine (a homogeneous pair), the geometry of its rank, and
/// vLLM's names of its attention layers.
pub fn resolve(
    args: &LayoutFlags,
) -> Result<(PairSpec, RankGeometry, Vec<String>, ModelOrigin), ConfigError> {
    for (given, flag) in [
        (args.kv_buffer.kv_buffer_device.is_some(), "--kv-buffer-device"),
        (args.engine.gdn_prefill.is_some(), "--gdn-prefill"),
        (args.engine.attention_backend.is_some(), "--attention-backend"),
        (args.engine.no_prefix_caching, "--no-prefix-caching"),
        (args.engine.kernel_block_size.is_some(), "--kernel-block-size"),
    ] {
        if given {
            return Err(ConfigError::new(
                flag,
                "applies to hybrid models (state or sliding windows: --model nemotron-h-8b, a config.json of one)",
            ));
        }
    }
    let version = args.engine.vllm();
    let model = scenario::resolve_model(&args.model)?;
    let layout = match &args.engine.layout {
        Some(l) => Layout::parse_for(l, version).map_err(|e| ConfigError::new("--layout", e))?,
        None => Layout::default_for(version),
    };
    if args.tokens == 0 {
        return Err(ConfigError::new("--tokens", "a request needs at least 1 token"));
    }
    let engine = EngineSpec {
        tp: args.tp.tp,
        block_tokens: args.engine.block_size(),
        num_blocks: args.num_blocks,
        layout,
    };
    let pair = PairSpec { version, model, p: engine, d: engine, permute: false };
    // Same checks as a homogeneous pair: TP vs heads, block size, layout version.
    pair.validate().map_err(knobs::for_one_engine)?;
    if args.rank() >= args.tp.tp {
        return Err(ConfigError::new(
            "--rank",
            format!("rank {} does not exist with --tp {}", args.rank(), args.tp.tp),
        ));
    }
    let geom = pair.p_geometry(args.rank());
    let m = &args.model;
    let resolved = crate::settings::model::resolve_flags(m)?;
    let origin = ModelOrigin { architecture: resolved.architecture, defaults: resolved.defaults };
    Ok((pair, geom, resolved.attention_names, origin))
}
