//! One case of vLLM's hybrid oracle (`hybrid_v033.json`) as `kvx plan --scenario` input: the
//! case's inputs only (`vllm_version`, `model`, `p`, `d`, and `scheduler.prompt_tokens`,
//! `p_raw_block_ids`, `d_raw_unhashed_block_ids`), everything else ignored. The model is
//! rebuilt from `model` and prefill's KV cache groups (`p.groups`: each group's spec and layer
//! names), as vLLM built it. Errors name `--scenario` and the field that is missing or wrong.

use serde_json::Value;

use crate::error::ConfigError;
use crate::layouts::hybrid::geometry::{
    AttentionBackend, ConvPart, DEFAULT_BLOCK_TOKENS, EngineGeometry, GdnPrefillBackend, GroupKind,
    HybridEngineSpec, KvBufferDevice, Side, StateLayout, StatePart, StateShapes, StatedEngine, StatedGroup,
    StatedState,
};
use crate::layouts::hybrid::model::{
    AttentionShape, AttnKind, Dtype, GdnSpec, HybridModel, Layer, LayerNames, Mamba1Spec, Mamba2Spec,
    StateKind, StateSpec,
};
use crate::layouts::hybrid::{HybridPairSpec, HybridRequest, StatedPair};

/// Layers a case may name (kvx's bound on models: `--layers` stops there too).
const MAX_CASE_LAYERS: usize = 4096;

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
    pub pair: HybridPairSpec,
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

/// A count that must be 1 or more (a TP size, a pool, a block size, heads, a page).
fn positive(v: &Value, key: &str, at: &str) -> Result<u32, ConfigError> {
    match num(v, key, at)? {
        0 => Err(bad(format!("`{at}{key}` is 0: it must be 1 or more"))),
        n => Ok(n),
    }
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

/// The state kind of a case: a group's `mamba_type`, the `model` section's key (`gdn`,
/// `mamba1`, `mamba2`, or `mamba` with `num_heads` for Mamba2), or the shapes (a 2-D SSM
/// state is Mamba1's) and the layer names (GDN layers are `linear_attn`).
fn state_kind(case: &Value, shapes: &Value, names: &[String]) -> Result<StateKind, ConfigError> {
    let named = |s: &str| match s.to_ascii_lowercase().replace(['_', '-'], "").as_str() {
        "mamba1" | "mamba" => Some(StateKind::Mamba1),
        "mamba2" => Some(StateKind::Mamba2),
        "gdn" | "gdnattn" | "gateddeltanet" | "linearattention" => Some(StateKind::Gdn),
        _ => None,
    };
    let groups = case.get("p").and_then(|p| p.get("groups")).and_then(Value::as_array);
    if let Some(k) = groups
        .into_iter()
        .flatten()
        .filter_map(|g| g.get("mamba_type").and_then(Value::as_str))
        .find_map(|t| named(t.rsplit('.').next().unwrap_or(t).trim_end_matches("AttentionBackend")))
    {
        return Ok(k);
    }
    let m = case.get("model");
    let has = |k: &str| m.and_then(|m| m.get(k)).is_some();
    if has("gdn") || has("linear_attention") {
        return Ok(StateKind::Gdn);
    }
    if has("mamba1") {
        return Ok(StateKind::Mamba1);
    }
    if has("mamba2") {
        return Ok(StateKind::Mamba2);
    }
    if let Some(t) =
        m.and_then(|m| m.get("mamba_type").or_else(|| m.get("state_kind"))).and_then(Value::as_str)
    {
        return named(t).ok_or_else(|| bad(format!("`model.mamba_type` {t} is not mamba1, mamba2 or gdn")));
    }
    let ssm_dims = shapes.get(1).and_then(Value::as_array).map_or(0, Vec::len);
    if ssm_dims == 2 {
        return Ok(StateKind::Mamba1);
    }
    if let Some(mm) = m.and_then(|m| m.get("mamba")) {
        return Ok(if mm.get("num_heads").is_some() { StateKind::Mamba2 } else { StateKind::Mamba1 });
    }
    Ok(if names.iter().any(|n| n.contains("linear_attn")) { StateKind::Gdn } else { StateKind::Mamba2 })
}

fn shapes_of(e: &Value, side: &str, kind: StateKind) -> Result<StateShapes, ConfigError> {
    let at = format!("{side}.");
    let sh = field(e, "mamba_state_shapes_local", &at)?;
    let dims = |i: usize| -> Result<Vec<u64>, ConfigError> {
        sh.get(i)
            .and_then(Value::as_array)
            .ok_or_else(|| bad(format!("`{side}.mamba_state_shapes_local[{i}]` is not a shape")))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad(format!("`{side}.mamba_state_shapes_local[{i}]` holds a non-number")))
            })
            .collect()
    };
    let conv = dims(0)?;
    let conv: [u64; 2] = conv.try_into().map_err(|_| {
        bad(format!("`{side}.mamba_state_shapes_local[0]` is not a 2-D conv shape (channels, kernel - 1)"))
    })?;
    let dt = field(e, "mamba_state_dtypes", &at)?
        .as_array()
        .ok_or_else(|| bad(format!("`{side}.mamba_state_dtypes` is not a list")))?;
    let dtype_at = |i: usize| {
        dt.get(i)
            .ok_or_else(|| bad(format!("`{side}.mamba_state_dtypes` needs the conv and the SSM dtype")))
            .and_then(|d| dtype(d, &format!("{side}.mamba_state_dtypes[{i}]")))
    };
    Ok(StateShapes { kind, conv, ssm: dims(1)?, dtypes: (dtype_at(0)?, dtype_at(1)?) })
}

/// The window of a sliding-window group: its own `sliding_window`, or the model's.
fn window_of(group: &Value, model: &Value) -> Result<u32, ConfigError> {
    let w = group
        .get("sliding_window")
        .or_else(|| group.get("window"))
        .or_else(|| model.get("sliding_window"))
        .ok_or_else(|| {
            bad("a SlidingWindowSpec group needs `model.sliding_window` (or the group's `sliding_window`)")
        })?;
    w.as_u64()
        .and_then(|w| u32::try_from(w).ok())
        .filter(|&w| w > 0)
        .ok_or_else(|| bad("`model.sliding_window` is not a positive token count"))
}

/// An engine as the case states it (`p` or `d`).
fn stated(e: &Value, side: &str, case: &Value, kind: Option<StateKind>) -> Result<StatedEngine, ConfigError> {
    let at = format!("{side}.");
    let m = field(case, "model", "")?;
    let groups =
        field(e, "groups", &at)?.as_array().ok_or_else(|| bad(format!("`{side}.groups` is not a list")))?;
    let mut out = Vec::with_capacity(groups.len());
    for g in groups {
        let spec = field(g, "spec", &format!("{side}.groups[]."))?.as_str().unwrap_or_default();
        let kind = match spec {
            "FullAttentionSpec" => GroupKind::Full,
            "SlidingWindowSpec" => GroupKind::SlidingWindow { window_tokens: window_of(g, m)? },
            "MambaSpec" => {
                GroupKind::State(kind.ok_or_else(|| bad("a MambaSpec group in a model without state"))?)
            }
            other => {
                return Err(bad(format!(
                    "group spec `{other}` is not one kvx knows (FullAttentionSpec, SlidingWindowSpec, MambaSpec)"
                )));
            }
        };
        let layers = field(g, "layers", &format!("{side}.groups[]."))?
            .as_array()
            .ok_or_else(|| bad(format!("`{side}.groups[].layers` is not a list")))?
            .iter()
            .map(|l| l.as_str().map(str::to_string).ok_or_else(|| bad("a layer name is not a string")))
            .collect::<Result<_, _>>()?;
        out.push(StatedGroup { kind, layers });
    }
    let page_bytes = field(e, "page_bytes", &at)?
        .as_u64()
        .ok_or_else(|| bad(format!("`{side}.page_bytes` is not a number")))?;
    if page_bytes == 0 {
        return Err(bad(format!("`{side}.page_bytes` is 0: it must be 1 or more")));
    }
    let state = match kind {
        Some(k) => {
            let shapes = shapes_of(e, side, k)?;
            let real =
                e.get("mamba_real_page_bytes").and_then(Value::as_u64).unwrap_or_else(|| shapes.page_bytes());
            let padded = e.get("mamba_page_size_padded").and_then(Value::as_u64).unwrap_or(page_bytes);
            Some(StatedState { shapes, real_page_bytes: real, padded_page_bytes: padded })
        }
        None => None,
    };
    Ok(StatedEngine {
        block_tokens: positive(e, "block_size_tokens", &at)?,
        page_bytes,
        local_kv_heads: positive(e, "local_kv_heads", &at)?,
        groups: out,
        state,
    })
}

/// The state parameters of the model, recovered from prefill's shapes at prefill's TP as
/// vLLM's connector recovers them (`derive_mamba_conv_split`), with Mamba2's `n_groups` from
/// the `model` section, or from how the conv width differs between the two sides.
fn state_spec(
    case: &Value,
    p: &StateShapes,
    p_tp: u32,
    d: Option<(&StateShapes, u32)>,
) -> Result<StateSpec, ConfigError> {
    let t = u64::from(p_tp.max(1));
    let small = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| bad(format!("the state's {what} ({v}) is too large")))
    };
    let kernel = small(p.conv[1] + 1, "conv kernel")?;
    let layout = StateLayout::from_shapes(p, p_tp, None)
        .map_err(|e| bad(format!("`p.mamba_state_shapes_local`: {e}")))?;
    let (conv_dtype, ssm_dtype) = p.dtypes;
    Ok(match p.kind {
        StateKind::Mamba1 => StateSpec::Mamba1(Mamba1Spec {
            intermediate_size: small(p.conv[0] * t, "intermediate size")?,
            d_state: small(p.ssm[1], "state size")?,
            conv_kernel: kernel,
            conv_dtype,
            ssm_dtype,
        }),
        StateKind::Mamba2 => {
            let d_state = p.ssm[2];
            let bc_global = layout.part(StatePart::Conv(ConvPart::B)).map_or(0, |b| b.global_units);
            let extended = bc_global.checked_div(d_state).unwrap_or(0);
            let stated_groups = case
                .get("model")
                .and_then(|m| m.get("mamba").or_else(|| m.get("mamba2")))
                .and_then(|mm| mm.get("n_groups").or_else(|| mm.get("ngroups")))
                .and_then(Value::as_u64);
            // vLLM grows n_groups to TP when TP does not divide it (n_groups must then be 1):
            // the two sides' widths tell which, when the case does not say.
            let n_groups = match (stated_groups, d) {
                (Some(g), _) => g,
                (None, Some((ds, d_tp))) if d_tp != p_tp => {
                    let dl = StateLayout::from_shapes(ds, d_tp, None).ok();
                    let d_ext = dl
                        .and_then(|l| l.part(StatePart::Conv(ConvPart::B)).map(|b| b.global_units))
                        .map_or(extended, |g| g.checked_div(d_state).unwrap_or(0));
                    if d_ext != extended { 1 } else { extended }
                }
                _ => extended,
            };
            StateSpec::Mamba2(Mamba2Spec {
                num_heads: small(p.ssm[0] * t, "Mamba2 heads")?,
                head_dim: small(p.ssm[1], "Mamba2 head dim")?,
                d_state: small(d_state, "state size")?,
                n_groups: small(n_groups.max(1), "n_groups")?,
                conv_kernel: kernel,
                conv_dtype,
                ssm_dtype,
            })
        }
        StateKind::Gdn => {
            let key_global = layout.part(StatePart::Conv(ConvPart::Q)).map_or(0, |q| q.global_units);
            let k_dim = p.ssm[2];
            StateSpec::Gdn(GdnSpec {
                num_k_heads: small(key_global.checked_div(k_dim).unwrap_or(0), "GDN key heads")?,
                num_v_heads: small(p.ssm[0] * t, "GDN value heads")?,
                head_k_dim: small(k_dim, "GDN key dim")?,
                head_v_dim: small(p.ssm[1], "GDN value dim")?,
                conv_kernel: kernel,
                conv_dtype,
                ssm_dtype,
            })
        }
    })
}

/// The model of a case: prefill's groups (which layers keep what, and their names), the
/// attention shape from the `model` section or prefill's page, and the state from prefill's
/// shapes.
fn model(
    case: &Value,
    name: &str,
    kind: Option<StateKind>,
    p: &StatedEngine,
    d: &StatedEngine,
) -> Result<HybridModel, ConfigError> {
    let m = field(case, "model", "")?;
    let pv = field(case, "p", "")?;
    let p_tp = positive(pv, "tp", "p.")?;
    let d_tp = positive(field(case, "d", "")?, "tp", "d.")?;
    let att_dtype = match m.get("dtype").or_else(|| m.get("attn_dtype")) {
        Some(d) => dtype(d, "model.dtype")?,
        None => Dtype::Bf16,
    };
    let mut layers: Vec<Layer> = Vec::new();
    let mut names = LayerNames::default();
    for g in &p.groups {
        for layer in &g.layers {
            let (i, template) = split_name(layer)?;
            if i as usize >= MAX_CASE_LAYERS {
                return Err(bad(format!(
                    "layer name `{layer}`: layer {i} is past kvx's {MAX_CASE_LAYERS}-layer bound"
                )));
            }
            if layers.len() <= i as usize {
                layers.resize(i as usize + 1, Layer::MLP);
            }
            let l = &mut layers[i as usize];
            match g.kind {
                GroupKind::Full => {
                    *l = Layer { attention: Some(AttnKind::Full), state: l.state };
                    names.attention = template;
                }
                GroupKind::SlidingWindow { window_tokens } => {
                    *l = Layer { state: l.state, ..Layer::swa(window_tokens) };
                    names.attention = template;
                }
                GroupKind::State(k) => {
                    l.state = Some(k);
                    names.state = template;
                }
            }
        }
    }
    let kv_heads =
        match m.get("kv_heads").or_else(|| m.get("attn_kv_heads")).or_else(|| m.get("num_kv_heads")) {
            Some(v) => {
                v.as_u64().and_then(|h| u32::try_from(h).ok()).ok_or_else(|| bad("`model.kv_heads`"))?
            }
            // Heads split over TP, or replicated once TP passes them: the smaller count is the
            // model's when one side has a single head per rank.
            None => (p.local_kv_heads * p_tp).min(d.local_kv_heads * d_tp),
        };
    let head_dim = match m.get("head_dim").or_else(|| m.get("attn_head_dim")) {
        Some(v) => v.as_u64().and_then(|h| u32::try_from(h).ok()).ok_or_else(|| bad("`model.head_dim`"))?,
        None => {
            let per_token = p.page_bytes / u64::from(p.block_tokens.max(1));
            let per_head = 2 * u64::from(p.local_kv_heads.max(1)) * u64::from(att_dtype.bytes());
            u32::try_from(per_token / per_head).map_err(|_| bad("the head size from `p.page_bytes`"))?
        }
    };
    let state = match (kind, &p.state) {
        (Some(_), Some(ps)) => {
            Some(state_spec(case, &ps.shapes, p_tp, d.state.as_ref().map(|s| (&s.shapes, d_tp)))?)
        }
        _ => None,
    };
    Ok(HybridModel {
        name: name.to_string(),
        layers,
        attention: AttentionShape { num_kv_heads: kv_heads, head_dim, dtype: att_dtype },
        state,
        names,
    })
}

/// The engine settings of a side: its TP, pool, buffer device and attention backend, and
/// the GDN prefill backend under which kvx's derivation reproduces the stated block size
/// (FlashInfer, vLLM's choice on H100-class GPUs, when neither does).
fn engine(
    e: &Value,
    side: &str,
    model: &HybridModel,
    stated: &StatedEngine,
    backend: Option<&str>,
) -> Result<HybridEngineSpec, ConfigError> {
    let at = format!("{side}.");
    let mut engine = HybridEngineSpec {
        kv_buffer_device: match e.get("kv_buffer_device").and_then(Value::as_str) {
            Some(name) => super::parse::named::<KvBufferDevice>(name)
                .map_err(|why| bad(format!("`{side}.kv_buffer_device`: {why}")))?,
            None => KvBufferDevice::default(),
        },
        block_tokens: DEFAULT_BLOCK_TOKENS,
        ..HybridEngineSpec::new(positive(e, "tp", &at)?, positive(e, "num_blocks", &at)?)
    };
    if let Some(b) =
        e.get("attn_backend").or_else(|| e.get("attention_backend")).and_then(Value::as_str).or(backend)
    {
        engine.attention_backend = match b.to_ascii_uppercase().as_str() {
            "FLASH_ATTN" => AttentionBackend::FlashAttn,
            "FLASHINFER" => AttentionBackend::FlashInfer,
            "TRITON_ATTN" => AttentionBackend::Triton,
            other => {
                return Err(bad(format!(
                    "`{side}.attn_backend` {other} is not FLASH_ATTN, FLASHINFER or TRITON_ATTN"
                )));
            }
        };
    }
    if let Some(k) = e.get("kernel_block_size_tokens").or_else(|| e.get("kernel_block_size")) {
        engine.kernel_block_tokens = Some(
            k.as_u64()
                .and_then(|k| u32::try_from(k).ok())
                .ok_or_else(|| bad(format!("`{side}.kernel_block_size`")))?,
        );
    }
    if let Some(pc) = e.get("enable_prefix_caching").and_then(Value::as_bool) {
        engine.prefix_caching = pc;
    }
    let side_of = if side == "p" { Side::Prefill } else { Side::Decode };
    let derives = |block_tokens: u32, backend: GdnPrefillBackend| {
        let cfg = HybridEngineSpec { block_tokens, gdn_prefill: backend, ..engine };
        EngineGeometry::new(model, &cfg, side_of).is_ok_and(|g| g.sizing.block_tokens == stated.block_tokens)
    };
    // The block size the engine started from: vLLM's default, raised by the hybrid alignment
    // where the model has state; where that does not give the stated size, the engine was
    // started with it (vLLM's --block-size, or its attention backend's preferred size, e.g.
    // 64 tokens), so kvx's derivation starts from it too.
    let backends = [GdnPrefillBackend::FlashInfer, GdnPrefillBackend::Triton];
    let found = [DEFAULT_BLOCK_TOKENS, stated.block_tokens]
        .into_iter()
        .flat_map(|block| backends.into_iter().map(move |b| (block, b)))
        .find(|&(block, b)| derives(block, b));
    if let Some((block, backend)) = found {
        (engine.block_tokens, engine.gdn_prefill) = (block, backend);
    }
    Ok(engine)
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
    let (pv, dv) = (field(case, "p", "")?, field(case, "d", "")?);
    let layer_names: Vec<String> = pv
        .get("groups")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|g| g.get("spec").and_then(Value::as_str) == Some("MambaSpec"))
        .filter_map(|g| g.get("layers").and_then(Value::as_array))
        .flatten()
        .filter_map(|l| l.as_str().map(str::to_string))
        .collect();
    let kind = if layer_names.is_empty() {
        None
    } else {
        Some(state_kind(case, field(pv, "mamba_state_shapes_local", "p.")?, &layer_names)?)
    };
    // The attention backend the engines ran, where the case says (its prefill ranks' agent
    // metadata): it decides the kernel block NIXL reads.
    let backend = case
        .get("p_ranks")
        .and_then(|r| r.get(0))
        .and_then(|r| r.get("agent_metadata"))
        .and_then(|m| m.get("attn_backend_name"))
        .and_then(Value::as_str);
    let p_stated = stated(pv, "p", case, kind)?;
    let d_stated = stated(dv, "d", case, kind)?;
    let model = model(case, &name, kind, &p_stated, &d_stated)?;
    let pair = HybridPairSpec {
        p: engine(pv, "p", &model, &p_stated, backend)?,
        d: engine(dv, "d", &model, &d_stated, backend)?,
        model,
        permute_local_kv: false,
        state_slices: Default::default(),
        host_copy: Default::default(),
        push_attention: Default::default(),
        stated: StatedPair { p: Some(p_stated), d: Some(d_stated) },
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

    #[test]
    fn a_zero_count_names_its_field_and_the_scenario() {
        let text = include_str!("../../tests/fixtures/hybrid-case-nemotronh-p1-d2.json");
        let case: Value = serde_json::from_str(text).expect("case");
        for (side, key) in
            [("p", "tp"), ("d", "tp"), ("p", "block_size_tokens"), ("d", "num_blocks"), ("p", "page_bytes")]
        {
            let mut c = case.clone();
            c[side][key] = 0.into();
            let e = parse(&c).expect_err("a zero count");
            assert!(e.to_string().contains(&format!("`{side}.{key}` is 0")), "{e}");
            assert_eq!(e.flag, "--scenario", "{e}");
        }
    }
}
