//! Resolution of model and engine flags into a validated `PairSpec`.
//!
//! Precedence: preset or config file, then shape flags. Every error names the flag.

use super::flags::{ModelFlags, PairFlags, PortFlags};
use crate::error::ConfigError;
use crate::layouts::compat::PairSpec;
use crate::layouts::model_config::PlanModel;
pub use crate::layouts::rank_maps::Ports;
use crate::layouts::{EngineSpec, Layout};
use crate::settings::model::{Dtype, Mla, ModelShape};
use crate::topology::VllmVersion;

pub use super::model::DEFAULT_MODEL;

/// Resolves the model shape of a uniform model: preset or config file, then shape flags.
pub fn resolve_model(args: &ModelFlags) -> Result<ModelShape, ConfigError> {
    let resolved = crate::settings::model::resolve_flags(args)?;
    let mut shape = match resolved.plan {
        PlanModel::Uniform(shape) => shape,
        // A hybrid model where only uniform attention models run: say so, not "unknown".
        PlanModel::Hybrid(h) => {
            return Err(ConfigError::new(
                "--model",
                format!(
                    "{} is a hybrid model: kvx plan, topo and layout plan it by vLLM 0.33's rules and \
                     kvx bench and serve-engine move it, but this command takes uniform attention models only so far",
                    h.name
                ),
            ));
        }
    };
    let mut overridden = Vec::new();
    if let Some(h) = args.num_kv_heads {
        shape.num_kv_heads = h;
        overridden.push(format!("num_kv_heads={h}"));
    }
    if let Some(d) = args.head_dim {
        shape.head_dim = d;
        overridden.push(format!("head_dim={d}"));
    }
    if let Some(l) = args.layers {
        shape.num_layers = l;
        overridden.push(format!("layers={l}"));
    }
    if let Some(t) = args.dtype {
        shape.dtype = t;
        overridden.push(format!("dtype={}", shape.dtype));
    }
    if let Some(n) = args.mla_dim {
        if n == 0 || n > 65_536 {
            return Err(ConfigError::new("--mla-dim", format!("must be 1..=65536 elements, got {n}")));
        }
        shape.mla = Some(Mla { kv_lora_rank: n, qk_rope_head_dim: 0 });
        overridden.push(format!("mla={n}"));
    } else if args.mla && shape.mla.is_none() {
        shape.mla = Some(Mla::DEEPSEEK);
        overridden.push("mla=576".into());
    }
    if shape.num_kv_heads == 0 {
        return Err(ConfigError::new("--num-kv-heads", "a model needs at least 1 KV head"));
    }
    if shape.head_dim == 0 && !shape.is_mla() {
        return Err(ConfigError::new("--head-dim", "head dimension must be at least 1"));
    }
    if !overridden.is_empty() {
        shape.name = format!("{} ({})", shape.name, overridden.join(", "));
    }
    Ok(shape)
}

fn layout(
    flag: &str,
    value: Option<&str>,
    fallback: Layout,
    version: VllmVersion,
) -> Result<Layout, ConfigError> {
    match value {
        Some(v) => Layout::parse_for(v, version).map_err(|e| ConfigError::new(flag, e)),
        None => Ok(fallback),
    }
}

/// Resolves the engine pair. `p_blocks`/`d_blocks` are the pool sizes in blocks.
pub fn resolve_pair(
    model_args: &ModelFlags,
    pair: &PairFlags,
    p_blocks: u32,
    d_blocks: u32,
) -> Result<PairSpec, ConfigError> {
    let version = pair.engine.vllm.unwrap_or_default();
    if let Some(flag) = [
        (pair.engine.kernel_block_size.is_some(), "--kernel-block-size"),
        (pair.engine.no_prefix_caching, "--no-prefix-caching"),
        (pair.engine.gdn_prefill.is_some(), "--gdn-prefill"),
        (pair.engine.attention_backend.is_some(), "--attention-backend"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
    {
        return Err(ConfigError::new(
            flag,
            "applies to hybrid models (state or sliding windows: --model nemotron-h-8b, a config.json \
             of one, a model TOML): a uniform model's kernel block is its block (--block-size), and its \
             prefix cache is the request's --prefix-hit",
        ));
    }
    let model = resolve_model(model_args)?;
    let block_size = pair.block_size();
    if block_size == 0 || block_size > crate::layouts::compat::MAX_BLOCK_TOKENS {
        return Err(ConfigError::new(
            "--block-size",
            format!(
                "block size must be between 1 and {} tokens, got {}",
                crate::layouts::compat::MAX_BLOCK_TOKENS,
                block_size
            ),
        ));
    }
    let both = layout("--layout", pair.engine.layout.as_deref(), Layout::default_for(version), version)?;
    let p_layout = layout("--p-layout", pair.p_layout.as_deref(), both, version)?;
    let d_layout = layout("--d-layout", pair.d_layout.as_deref(), both, version)?;
    let spec = PairSpec {
        version,
        model,
        p: EngineSpec {
            tp: pair.p_tp.unwrap_or(1),
            block_tokens: pair.p_block_size.unwrap_or(block_size),
            num_blocks: p_blocks,
            layout: p_layout,
        },
        d: EngineSpec {
            tp: pair.d_tp.unwrap_or(1),
            block_tokens: pair.d_block_size.unwrap_or(block_size),
            num_blocks: d_blocks,
            layout: d_layout,
        },
        permute: pair.permute,
    };
    Ok(spec)
}

/// Resolves `--p-dp`, `--d-dp`, `--side-channel-port`, `--port-scheme`.
pub fn resolve_ports(args: &PortFlags) -> Result<Ports, ConfigError> {
    for (flag, v) in [("--p-dp", args.p_dp), ("--d-dp", args.d_dp)] {
        if v == 0 || v > 1024 {
            return Err(ConfigError::new(flag, format!("data-parallel size must be 1..1024, got {v}")));
        }
    }
    Ok(Ports {
        p_dp: args.p_dp,
        d_dp: args.d_dp,
        base: args.side_channel.side_channel_port,
        scheme: args.port_scheme,
    })
}

/// `kvx plan --scenario FILE`: the `model` and `request` objects of a case in the oracle's
/// `descriptors.json`, plus the vLLM version. Informational keys are ignored.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct PlanScenario {
    #[serde(default)]
    pub vllm_version: Option<String>,
    pub model: ScenarioModel,
    pub request: ScenarioRequest,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct ScenarioModel {
    pub num_layers: u32,
    pub total_kv_heads: u32,
    pub head_dim: u32,
    #[serde(default = "default_dtype")]
    pub dtype: String,
    #[serde(default)]
    pub use_mla: bool,
    /// Elements of the MLA latent vector (default 576).
    #[serde(default)]
    pub mla_head_size: Option<u32>,
    pub p: ScenarioEngine,
    pub d: ScenarioEngine,
}

fn default_dtype() -> String {
    "bfloat16".into()
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct ScenarioEngine {
    pub tp: u32,
    pub block_size: u32,
    pub num_blocks: u32,
    #[serde(default)]
    pub layout: Option<String>,
    /// vLLM 0.19: FLASH_ATTN, FLASHINFER or an MLA backend.
    #[serde(default)]
    pub backend: Option<String>,
    /// vLLM 0.19: `enable_cross_layers_blocks`.
    #[serde(default)]
    pub cross_layers_blocks: bool,
    #[serde(default)]
    pub enable_permute_local_kv: bool,
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct ScenarioRequest {
    #[serde(default = "default_request_name")]
    pub name: String,
    /// Decode block ids per KV cache group.
    pub local: Vec<Vec<u32>>,
    /// Prefill block ids per KV cache group.
    pub remote: Vec<Vec<u32>>,
    #[serde(default)]
    pub p_request_id: Option<String>,
}

fn default_request_name() -> String {
    "req-D".into()
}

impl ScenarioEngine {
    fn layout(&self, version: VllmVersion, side: &str) -> Result<Layout, ConfigError> {
        let field = format!("model.{side}.layout");
        let name = self.layout.as_deref().unwrap_or(match version {
            VllmVersion::V0_33 => "LBHNC",
            VllmVersion::V0_19 => "HND",
        });
        if version == VllmVersion::V0_33 {
            return Layout::parse_for(name, version).map_err(|e| ConfigError::new(field, e));
        }
        let backend = self.backend.as_deref().unwrap_or("FLASH_ATTN").to_ascii_uppercase();
        let nhd = match name.to_ascii_uppercase().as_str() {
            "HND" => false,
            "NHD" => true,
            other => {
                return Layout::parse_for(other, version).map_err(|e| ConfigError::new(field, e));
            }
        };
        Ok(match (backend.as_str(), self.cross_layers_blocks, nhd) {
            ("FLASHINFER", true, _) => Layout::FiCrossLayers,
            (_, true, _) => Layout::FaCrossLayers,
            ("FLASHINFER", false, false) => Layout::FiHnd,
            ("FLASHINFER", false, true) => Layout::FiNhd,
            (_, false, false) => Layout::FaHnd,
            (_, false, true) => Layout::FaNhd,
        })
    }
}

impl PlanScenario {
    /// Parses a scenario file's text.
    pub fn parse(text: &str, source: &str) -> Result<Self, ConfigError> {
        serde_json::from_str(text).map_err(|e| ConfigError::new("--scenario", format!("{source}: {e}")))
    }

    /// The engine pair the scenario describes.
    pub fn pair(&self) -> Result<PairSpec, ConfigError> {
        let version = match &self.vllm_version {
            Some(v) => v.parse().map_err(|e| ConfigError::new("vllm_version", e))?,
            None => VllmVersion::V0_33,
        };
        let m = &self.model;
        let dtype: Dtype = m.dtype.parse().map_err(|e| ConfigError::new("model.dtype", e))?;
        let mla =
            m.use_mla.then(|| Mla { kv_lora_rank: m.mla_head_size.unwrap_or(576), qk_rope_head_dim: 0 });
        let model = ModelShape {
            name: "scenario".into(),
            num_layers: m.num_layers,
            num_kv_heads: m.total_kv_heads,
            head_dim: m.head_dim,
            dtype,
            mla,
        };
        let engine = |e: &ScenarioEngine, side: &str| -> Result<EngineSpec, ConfigError> {
            Ok(EngineSpec {
                tp: e.tp,
                block_tokens: e.block_size,
                num_blocks: e.num_blocks,
                layout: e.layout(version, side)?,
            })
        };
        Ok(PairSpec {
            version,
            model,
            p: engine(&m.p, "p")?,
            d: engine(&m.d, "d")?,
            permute: m.d.enable_permute_local_kv,
        })
    }

    /// The request's block ids (one KV cache group).
    pub fn blocks(&self) -> Result<crate::layouts::read_plan::RequestBlocks, ConfigError> {
        let r = &self.request;
        if r.local.len() > 1 || r.remote.len() > 1 {
            return Err(ConfigError::new(
                "request",
                "kvx models one KV cache group; give local and remote as [[ids...]] with a single list each",
            ));
        }
        Ok(crate::layouts::read_plan::RequestBlocks {
            local: r.local.first().cloned().unwrap_or_default(),
            remote: r.remote.first().cloned().unwrap_or_default(),
        })
    }

    pub fn ids(&self) -> crate::layouts::read_plan::RequestIds {
        crate::layouts::read_plan::RequestIds {
            p_request_id: self.request.p_request_id.clone().unwrap_or_else(|| "req-P".into()),
            d_request_id: self.request.name.clone(),
        }
    }
}
