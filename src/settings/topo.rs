//! `kvx topo`: its flags ([`TopoFlags`]) resolved once into the pair it maps
//! (`layouts::rank_maps::TopoRequest`: a uniform pair in pull or push mode with its ports, or a
//! hybrid preset's pair). Must not print anything.

use clap::Args;

use super::flags::{Format, ModelFlags, PairFlags, PortFlags};
use super::hybrid_flags::{hybrid_engines, hybrid_preset_of};
use super::scenario;
use crate::error::ConfigError;
use crate::layouts::hybrid::HybridPairSpec;
use crate::layouts::rank_maps::TopoRequest;
use crate::topology::TransferMode;

/// `kvx topo`'s flags.
#[derive(Debug, Clone, Args)]
pub struct TopoFlags {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub pair: PairFlags,
    #[command(flatten)]
    pub ports: PortFlags,
    #[command(flatten)]
    pub mode: super::flags::ModeFlags,
    #[command(flatten)]
    pub push_attention: super::flags::PushAttentionFlags,
    #[arg(long, value_enum, default_value_t = Format::Table, help = super::flags::FORMAT_HELP)]
    pub format: Format,
}

/// Resolves `kvx topo`'s flags into the pair it maps: a hybrid preset's (vLLM 0.33's rules),
/// else a uniform pair with its ports.
pub fn resolve_topo(args: &TopoFlags) -> Result<TopoRequest, ConfigError> {
    let hybrid = hybrid_preset_of(&args.model, args.pair.engine.vllm, &[])?;
    if args.push_attention.push_attention.is_some()
        && (hybrid.is_none() || args.mode.mode() != TransferMode::Push)
    {
        let why = "applies to hybrid models in push mode (which decode ranks prefill writes attention into): add \
                   --mode push with a hybrid --model, or drop it";
        return Err(ConfigError::new("--push-attention", why));
    }
    if let Some(model) = hybrid {
        // The rank map does not depend on the pool: a small one serves.
        let (p, d) = hybrid_engines(&args.pair, 64, None, None)?;
        let pair = HybridPairSpec {
            model,
            p,
            d,
            permute_local_kv: args.pair.permute,
            state_slices: Default::default(),
            host_copy: Default::default(),
            push_attention: args.push_attention.push_attention.unwrap_or_default(),
            stated: Default::default(),
        };
        return Ok(TopoRequest::Hybrid { pair, push: args.mode.mode() == TransferMode::Push });
    }
    let pair = scenario::resolve_pair(&args.model, &args.pair, 1, 1)?;
    let ports = scenario::resolve_ports(&args.ports)?;
    Ok(match args.mode.mode() {
        TransferMode::Pull => TopoRequest::UniformPull { pair, ports },
        TransferMode::Push => TopoRequest::UniformPush { pair, ports },
    })
}
