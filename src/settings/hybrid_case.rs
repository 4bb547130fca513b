//! One case of vLLM's hybrid oracle (`hybrid_v033.json`) as `kvx plan --scenario` input: the
//! case's inputs only (`vllm_version`, `model`, `p`, `d`, and `scheduler.prompt_tokens`,
//! `p_raw_block_ids`, `d_raw_unhashed_block_ids`), everything else ignored. The model is
//! rebuilt from `model` and prefill's KV cache groups (`p.groups`: each group's spec and layer
//! names), as vLLM built it. Errors name `--scenario` and the field that is missing or wrong.

use serde_json::Value;

use crate::error::ConfigError;
use crate::layouts::hybrid::geometry::{
    DEFAULT_BLOCK_TOKENS, GdnPrefillBackend, HybridEngine, KvBufferDevice,
};
use crate::layouts::hybrid::model::{
    AttentionShape, AttnKind, Dtype, GdnSpec, HybridModel, Layer, LayerNames, Mamba2Spec, StateSpec,
};
use crate::layouts::hybrid::{HybridRequest, PairConfig};

/// The vLLM version whose rules the hybrid planner follows.
pub const HYBRID_VLLM: &str = "0.33.0";

/// Whether a scenario document is a hybrid case (prefill's groups and a scheduler section)
/// rather than a uniform one (`request`).
pub fn is_hybrid_case(doc: &Value) -> bool {
    doc.get("scheduler").is_some() && doc.get("p").and_then(|p| p.get("groups")).is_some()
}

/// A hybrid case's pair and request.
#[derive(Debug, Clone)]
pub struct HybridCase {
    pub name: String,
    pub pair: PairConfig,
    pub request: RequestSource,
}

/// Where a hybrid request's block lists come from.
#[derive(Debug, Clone)]
pub enum RequestSource {
    /// An oracle case's own lists.
    Case(HybridRequest),
    /// `--prompt-len` (and `--prefix-hit`): lists allocated as vLLM's allocator leaves them,
    /// once the pair's aligned block sizes are known.
    Prompt { tokens: u32, prefix_hit: f64 },
}

impl RequestSource {
    /// The request, for the planner of this case's pair.
    pub fn for_planner(&self, planner: &crate::layouts::hybrid::HybridPlanner) -> HybridRequest {
        match self {
            RequestSource::Case(r) => r.clone(),
            RequestSource::Prompt { tokens, prefix_hit } => {
                let d_blocks = tokens.div_ceil(planner.d.sizing.block_tokens.max(1));
                let hit = (f64::from(d_blocks) * prefix_hit).floor() as u32;
                HybridRequest::simulated(planner, *tokens, hit)
            }
        }
    }
}

fn bad(what: impl std::fmt::Display) -> ConfigError {
    ConfigError::new("--scenario", format!("hybrid case: {what}"))
}

fn field<'v>(v: &'v Value, key: &str, at: &str) -> Result<&'v Value, ConfigError> {
    v.get(key).ok_or_else(|| bad(format!("`{at}{key}` is missing")))
}

fn num(v: &Value, key: &str, at: &str) -> Result<u32, ConfigError> {
    field(v, key, at)?
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| bad(format!("`{at}{key}` is not a whole number below 2^32")))
}

fn dtype(v: &Value, at: &str) -> Result<Dtype, ConfigError> {
    v.as_str()
        .ok_or_else(|| bad(format!("`{at}` is not a dtype name")))?
        .parse()
        .map_err(|e| bad(format!("`{at}`: {e}")))
}

fn lists(v: &Value, at: &str) -> Result<Vec<Vec<u32>>, ConfigError> {
    let not = || bad(format!("`{at}` is not a list of lists of block ids"));
    v.as_array()
        .ok_or_else(not)?
        .iter()
        .map(|g| {
            g.as_array()
                .ok_or_else(not)?
                .iter()
                .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()).ok_or_else(not))
                .collect()
        })
        .collect()
}

/// `model.layers.7.mixer.attn` -> (7, `model.layers.{i}.mixer.attn`).
fn split_name(name: &str) -> Result<(u32, String), ConfigError> {
    let mut parts: Vec<String> = name.split('.').map(str::to_string).collect();
    let pos = parts
        .iter()
        .position(|p| p.parse::<u32>().is_ok())
        .ok_or_else(|| bad(format!("layer name `{name}` has no layer index")))?;
    let index = parts[pos].parse().map_err(|_| bad(format!("layer name `{name}`")))?;
    parts[pos] = "{i}".into();
    Ok((index, parts.join(".")))
}

/// The model of a case: its `model` section and prefill's groups.
fn model(case: &Value, name: &str) -> Result<HybridModel, ConfigError> {
    let m = field(case, "model", "")?;
    let p = field(case, "p", "")?;
    let att_dtype = m.get("dtype").map_or(Ok(Dtype::Bf16), |d| dtype(d, "model.dtype"))?;
    let state_dtypes: Vec<Dtype> =
        match m.get("mamba_dtypes").or_else(|| m.get("dtypes")).or_else(|| p.get("mamba_state_dtypes")) {
            Some(v) => v
                .as_array()
                .ok_or_else(|| bad("`model.mamba_dtypes` is not a list"))?
                .iter()
                .map(|d| dtype(d, "model.mamba_dtypes[]"))
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
    let state_dtype = |i: usize| {
        state_dtypes
            .get(i)
            .copied()
            .ok_or_else(|| bad("the state's dtypes (`model.mamba_dtypes`: conv, SSM) are missing"))
    };
    let state = if let Some(mm) = m.get("mamba") {
        Some(StateSpec::Mamba2(Mamba2Spec {
            num_heads: num(mm, "num_heads", "model.mamba.")?,
            head_dim: num(mm, "head_dim", "model.mamba.")?,
            d_state: num(mm, "state_size", "model.mamba.")?,
            n_groups: num(mm, "n_groups", "model.mamba.")?,
            conv_kernel: num(mm, "conv_kernel", "model.mamba.")?,
            conv_dtype: state_dtype(0)?,
            ssm_dtype: state_dtype(1)?,
        }))
    } else if let Some(g) = m.get("gdn") {
        Some(StateSpec::Gdn(GdnSpec {
            num_k_heads: num(g, "num_k_heads", "model.gdn.")?,
            num_v_heads: num(g, "num_v_heads", "model.gdn.")?,
            head_k_dim: num(g, "head_k_dim", "model.gdn.")?,
            head_v_dim: num(g, "head_v_dim", "model.gdn.")?,
            conv_kernel: num(g, "conv_kernel", "model.gdn.")?,
            conv_dtype: state_dtype(0)?,
            ssm_dtype: state_dtype(1)?,
        }))
    } else {
        None
    };
    let state_kind = state.map(|s| s.kind());
    let mut layers: Vec<Layer> = Vec::new();
    let mut names = LayerNames::default();
    let groups = field(p, "groups", "p.")?.as_array().ok_or_else(|| bad("`p.groups` is not a list"))?;
    for g in groups {
        let spec = field(g, "spec", "p.groups[].")?.as_str().unwrap_or_default();
        let group_layers = field(g, "layers", "p.groups[].")?
            .as_array()
            .ok_or_else(|| bad("`p.groups[].layers` is not a list"))?;
        for layer in group_layers {
            let (i, template) =
                split_name(layer.as_str().ok_or_else(|| bad("a layer name is not a string"))?)?;
            if layers.len() <= i as usize {
                layers.resize(i as usize + 1, Layer::MLP);
            }
            let l = &mut layers[i as usize];
            match spec {
                "FullAttentionSpec" => {
                    *l = Layer { attention: Some(AttnKind::Full), state: l.state };
                    names.attention = template;
                }
                "SlidingWindowSpec" => {
                    *l = Layer { state: l.state, ..Layer::swa(num(m, "sliding_window", "model.")?) };
                    names.attention = template;
                }
                "MambaSpec" => {
                    l.state = state_kind;
                    names.state = template;
                }
                other => {
                    return Err(bad(format!(
                        "group spec `{other}` is not one kvx knows (FullAttentionSpec, SlidingWindowSpec, MambaSpec)"
                    )));
                }
            }
        }
    }
    // The attention shape; a case may name only the state (the host-buffer Nemotron case), so
    // the head size can come from prefill's page and heads.
    let kv_heads = match m.get("kv_heads").or_else(|| m.get("attn_kv_heads")) {
        Some(v) => v.as_u64().and_then(|h| u32::try_from(h).ok()).ok_or_else(|| bad("`model.kv_heads`"))?,
        None => num(p, "local_kv_heads", "p.")? * num(p, "tp", "p.")?,
    };
    let head_dim = match m.get("head_dim").or_else(|| m.get("attn_head_dim")) {
        Some(v) => v.as_u64().and_then(|h| u32::try_from(h).ok()).ok_or_else(|| bad("`model.head_dim`"))?,
        None => {
            let per_token =
                u64::from(num(p, "page_bytes", "p.")?) / u64::from(num(p, "block_size_tokens", "p.")?.max(1));
            let per_head =
                2 * u64::from(num(p, "local_kv_heads", "p.")?.max(1)) * u64::from(att_dtype.bytes());
            u32::try_from(per_token / per_head).map_err(|_| bad("the head size from `p.page_bytes`"))?
        }
    };
    Ok(HybridModel {
        name: name.to_string(),
        layers,
        attention: AttentionShape { num_kv_heads: kv_heads, head_dim, dtype: att_dtype },
        state,
        names,
    })
}

fn engine(e: &Value, side: &str) -> Result<HybridEngine, ConfigError> {
    let at = format!("{side}.");
    Ok(HybridEngine {
        kv_buffer_device: match e.get("kv_buffer_device").and_then(Value::as_str) {
            Some("cpu") => KvBufferDevice::Cpu,
            _ => KvBufferDevice::Cuda,
        },
        // The oracle aligned GDN blocks as triton does (its README).
        gdn_prefill: GdnPrefillBackend::Triton,
        block_tokens: DEFAULT_BLOCK_TOKENS,
        ..HybridEngine::new(num(e, "tp", &at)?, num(e, "num_blocks", &at)?)
    })
}

/// Reads one hybrid case (see the module docs).
pub fn parse(case: &Value) -> Result<HybridCase, ConfigError> {
    let name = case.get("name").and_then(Value::as_str).unwrap_or("hybrid case").to_string();
    match case.get("vllm_version").and_then(Value::as_str) {
        Some(HYBRID_VLLM) => {}
        Some(v) => {
            return Err(bad(format!(
                "vllm_version {v}: kvx follows vLLM {HYBRID_VLLM}'s rules for hybrid models"
            )));
        }
        None => return Err(bad("`vllm_version` is missing")),
    }
    let model = model(case, &name)?;
    let pair = PairConfig {
        model,
        p: engine(field(case, "p", "")?, "p")?,
        d: engine(field(case, "d", "")?, "d")?,
        permute_local_kv: false,
        state_slices: Default::default(),
        host_copy: Default::default(),
        push_attention: Default::default(),
    };
    let s = field(case, "scheduler", "")?;
    let request = HybridRequest {
        prompt_tokens: num(s, "prompt_tokens", "scheduler.")?,
        p_raw_block_ids: lists(field(s, "p_raw_block_ids", "scheduler.")?, "scheduler.p_raw_block_ids")?,
        d_raw_unhashed_block_ids: lists(
            field(s, "d_raw_unhashed_block_ids", "scheduler.")?,
            "scheduler.d_raw_unhashed_block_ids",
        )?,
        d_hit_tokens: 0,
    };
    Ok(HybridCase { name, pair, request: RequestSource::Case(request) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_case_missing_a_field_names_it() {
        let e = parse(&serde_json::json!({"vllm_version": "0.33.0", "model": {}})).expect_err("no p");
        assert!(e.to_string().contains("`p` is missing"), "{e}");
        let e = parse(&serde_json::json!({"vllm_version": "0.19.0"})).expect_err("old rules");
        assert!(e.to_string().contains("0.33.0"), "{e}");
        assert!(!is_hybrid_case(&serde_json::json!({"request": {}})));
    }
}
