//! Models from their Hugging Face `config.json`, read as vLLM 0.33 reads them: which layers
//! keep full attention, a sliding window, Mamba1/Mamba2/GDN state, both (Falcon-H1) or
//! nothing (an MLP-only layer), with the attention shape and the state parameters, for the
//! architectures kvx knows. `settings` reads the file; this module reads its text.
//!
//! Rules (vLLM 0.33.0 with transformers 5.x, whose configuration classes vLLM loads these
//! configs through):
//! - A field the file leaves out takes the configuration class's default (the published
//!   model's value), as transformers fills it for vLLM; [`ArchModel::defaults`] lists each one
//!   taken. A field with no default, a value of the wrong type, a zero or negative size, an
//!   architecture kvx does not know: [`ConfigFieldError`] naming the field.
//! - Layer kinds per architecture, from the fields its vLLM model reads: `layer_types`
//!   (Qwen3-Next, Granite-4.0-H, Gemma-3, Llama-family), `hybrid_override_pattern` /
//!   `layers_block_type` (Nemotron-H), `attn_layer_period` / `attn_layer_offset` (Jamba), every
//!   layer both (Falcon-H1), even layers windowed (gpt-oss: vLLM ignores its `layer_types`).
//!   Legacy names (`mamba`, `attention`) mean what transformers remaps them to.
//! - The KV cache element type is the model's `dtype` (`torch_dtype`); float32 and a missing
//!   dtype run as bfloat16 (vLLM's `auto` on CUDA). The SSM state takes the model's type,
//!   except Nemotron-H's, float32 unless the config names `mamba_ssm_cache_dtype`.
//! - Layer names are the ones vLLM's model registers (`model.layers.{i}.linear_attn`,
//!   Falcon-H1's `model.{L+i}.mixer`, Gemma-3 multimodal's `language_model.model.layers...`):
//!   they order the NIXL regions.

use serde_json::{Map, Value};

use super::hybrid::error::HybridError;
pub use super::hybrid::model::PRESETS as HYBRID_PRESETS;
use super::hybrid::model::{
    AttentionShape, AttnKind, Dtype, GdnSpec, HybridModel, Layer, LayerNames, Mamba1Spec, Mamba2Spec,
    StateKind, StateSpec,
};
use crate::vocab::model::{Mla, ModelShape};

/// The most layers a model may have (the layers knob stops there too): bounds the work a config
/// can ask for.
pub const MAX_LAYERS: u32 = 4096;

/// A config field that is missing, of the wrong type, or out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {reason}")]
pub struct ConfigFieldError {
    pub field: String,
    pub reason: String,
}

fn err(field: &str, reason: impl Into<String>) -> ConfigFieldError {
    ConfigFieldError { field: field.to_string(), reason: reason.into() }
}

/// The architectures kvx reads, by the name in `architectures`.
pub const ARCHITECTURES: [&str; 17] = [
    "Qwen3NextForCausalLM",
    "NemotronHForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "JambaForCausalLM",
    "FalconH1ForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekForCausalLM",
];

/// A model kvx ships: a config in the terms above (TOML), with its names.
pub struct Preset {
    pub name: &'static str,
    pub toml: &'static str,
}

macro_rules! preset {
    ($name:literal) => {
        Preset { name: $name, toml: include_str!(concat!("../../bench-configs/models/", $name, ".toml")) }
    };
}

/// Every preset (the files under `bench-configs/models/`, embedded).
pub const PRESETS: &[Preset] = &[
    preset!("llama-3.1-8b"),
    preset!("llama-3.1-70b"),
    preset!("llama-3.1-405b"),
    preset!("qwen3-0.6b"),
    preset!("qwen3-8b"),
    preset!("qwen3-32b"),
    preset!("qwen3-235b-a22b"),
    preset!("mistral-7b"),
    preset!("deepseek-v3"),
    preset!("gpt-oss-120b"),
    preset!("qwen3-next-80b-a3b"),
    preset!("nemotron-h-8b"),
    preset!("granite-4.0-h-tiny"),
    preset!("jamba-v0.1"),
    preset!("falcon-h1-7b"),
    preset!("gemma-3-4b"),
];

fn normalize(name: &str) -> String {
    name.trim().to_ascii_lowercase().replace(['_', ' '], "-")
}

impl Preset {
    /// The preset's config as a JSON value.
    pub fn config(&self) -> Result<Value, ConfigFieldError> {
        toml::from_str(self.toml).map_err(|e| err("preset", format!("{} is malformed: {e}", self.name)))
    }

    /// Whether `name` names this preset: its name, an alias, or its Hugging Face id
    /// (case-insensitive).
    fn answers_to(&self, want: &str, config: &Value) -> bool {
        let s = |k: &str| config.get(k).and_then(Value::as_str).map(normalize);
        normalize(self.name) == want
            || s("hf_id").as_deref() == Some(want)
            || config
                .get("aliases")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().filter_map(Value::as_str).any(|a| normalize(a) == want))
    }

    /// The preset read as its architecture's config.
    pub fn read(&self) -> Result<ArchModel, ConfigFieldError> {
        read(&self.config()?, self.name)
    }
}

/// The preset `name` names (by name, alias or Hugging Face id), or `None`.
pub fn find_preset(name: &str) -> Option<&'static Preset> {
    let want = normalize(name);
    PRESETS.iter().find(|p| p.config().is_ok_and(|c| p.answers_to(&want, &c)))
}

/// A hybrid preset (one of [`HYBRID_PRESETS`]) by name, alias or Hugging Face id
/// (case-insensitive), as vLLM lays it out with its hybrid KV cache manager.
pub fn hybrid_preset(name: &str) -> Result<HybridModel, HybridError> {
    let unknown = || HybridError::Preset {
        reason: format!("unknown hybrid model '{name}'; presets: {}", HYBRID_PRESETS.join(", ")),
    };
    let p = find_preset(name).ok_or_else(unknown)?;
    let arch = p.read().map_err(|e| HybridError::Preset { reason: format!("preset {}: {e}", p.name) })?;
    match arch.plan_model(true) {
        Ok(PlanModel::Hybrid(m)) => Ok(m),
        _ => Err(unknown()),
    }
}

/// The preset names, for messages.
pub fn preset_names() -> String {
    PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}

/// A model as its config describes it: every layer's caches (vLLM's view with the hybrid KV
/// cache manager on), MLA where the attention is latent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchModel {
    /// The architecture read (`architectures[0]`).
    pub architecture: String,
    pub model: HybridModel,
    pub mla: Option<Mla>,
    /// Fields the config left out, with the architecture's default taken for each.
    pub defaults: Vec<(String, String)>,
}

/// How a model's KV cache is planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanModel {
    /// One KV cache group of full attention (or latent) layers: `layouts::read_plan`.
    Uniform(ModelShape),
    /// Several groups, a window, or state: `layouts::hybrid`.
    Hybrid(HybridModel),
}

impl ArchModel {
    /// The model as vLLM's KV cache manager lays it out. With the hybrid KV cache manager
    /// (`hma`, vLLM's default with the NixlConnector), sliding windows and state keep their
    /// own groups; without it, windowed layers beside full attention are allocated as full
    /// attention (one window at most), windowed layers alone stay windowed, and state is
    /// refused (vLLM: hybrid SSM models require HMA).
    pub fn plan_model(&self, hma: bool) -> Result<PlanModel, ConfigFieldError> {
        let m = &self.model;
        if m.has_state() && !hma {
            return Err(err(
                "architectures",
                format!(
                    "{} keeps {} state, which needs vLLM's hybrid KV cache manager: it cannot run with HMA off",
                    self.architecture,
                    m.state.map_or("mamba", |s| s.kind().name())
                ),
            ));
        }
        let windows: std::collections::BTreeSet<u32> = m
            .layers
            .iter()
            .filter_map(|l| match l.attention {
                Some(AttnKind::SlidingWindow { window_tokens }) => Some(window_tokens),
                _ => None,
            })
            .collect();
        let full = m.layers.iter().any(|l| l.attention == Some(AttnKind::Full));
        // Without HMA, vLLM makes every layer one kind of spec (`unify_hybrid_kv_cache_specs`):
        // windowed layers beside full attention become full attention, windowed layers alone
        // stay windowed; several windows cannot become one kind either way.
        if !hma && windows.len() > 1 {
            return Err(err(
                "sliding_window",
                format!(
                    "windows of {windows:?} tokens: with HMA off vLLM cannot make them one kind of KV cache \
                     (\"Failed to promote local KV cache specs to one unified type.\", or several windows in one \
                     full-attention group); run with HMA on"
                ),
            ));
        }
        let promoted = !hma && full;
        if self.mla.is_some() || (!m.has_state() && (windows.is_empty() || promoted)) {
            let attention_layers = m.layers.iter().filter(|l| l.attention.is_some()).count();
            return Ok(PlanModel::Uniform(ModelShape {
                name: m.name.clone(),
                num_layers: u32::try_from(attention_layers).unwrap_or(u32::MAX),
                num_kv_heads: m.attention.num_kv_heads,
                head_dim: m.attention.head_dim,
                dtype: m.attention.dtype,
                mla: self.mla,
            }));
        }
        Ok(PlanModel::Hybrid(m.clone()))
    }
}

/// One config object's fields, with the defaults of its architecture's configuration class.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    /// `text_config.` inside a multimodal config.
    prefix: &'static str,
    defaults: Vec<(String, String)>,
}

impl<'a> Fields<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value of `key`, `None` when absent or JSON null.
    fn raw(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A positive count (below 2^32), or `None` when absent.
    fn opt_u32(&self, key: &str) -> Result<Option<u32>, ConfigFieldError> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        let n = match v {
            Value::Number(n) => {
                n.as_u64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0).map(|f| f as u64))
            }
            _ => None,
        };
        match n {
            Some(0) => Err(err(&self.name(key), "is 0: it must be positive")),
            Some(n) => {
                u32::try_from(n).map(Some).map_err(|_| err(&self.name(key), format!("is {n}: too large")))
            }
            None => Err(err(&self.name(key), format!("is {v}: expected a positive whole number"))),
        }
    }

    /// A positive count, or the architecture's default (recorded) when absent.
    fn u32_or(&mut self, key: &str, default: u32) -> Result<u32, ConfigFieldError> {
        match self.opt_u32(key)? {
            Some(n) => Ok(n),
            None => {
                self.defaults.push((self.name(key), default.to_string()));
                Ok(default)
            }
        }
    }

    /// A positive count the config must give.
    fn u32_req(&self, key: &str) -> Result<u32, ConfigFieldError> {
        self.opt_u32(key)?.ok_or_else(|| err(&self.name(key), "is missing"))
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>, ConfigFieldError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(err(&self.name(key), format!("is {v}: expected a string"))),
        }
    }

    /// A list of strings, or `None` when absent.
    fn opt_strs(&self, key: &str) -> Result<Option<Vec<&'a str>>, ConfigFieldError> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        let list = v
            .as_array()
            .ok_or_else(|| err(&self.name(key), format!("is {v}: expected a list of strings")))?;
        if list.len() > MAX_LAYERS as usize {
            return Err(err(
                &self.name(key),
                format!("lists {} layers: kvx plans at most {MAX_LAYERS}", list.len()),
            ));
        }
        list.iter()
            .map(|s| s.as_str().ok_or_else(|| err(&self.name(key), format!("holds {s}: expected a string"))))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ConfigFieldError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(err(&self.name(key), format!("is {v}: expected true or false"))),
        }
    }

    /// The layer count: `num_hidden_layers` (or its default), bounded.
    fn layers_or(&mut self, default: u32) -> Result<u32, ConfigFieldError> {
        let n = self.u32_or("num_hidden_layers", default)?;
        if n > MAX_LAYERS {
            return Err(err(
                &self.name("num_hidden_layers"),
                format!("is {n}: kvx plans at most {MAX_LAYERS} layers"),
            ));
        }
        Ok(n)
    }

    /// `num_key_value_heads`: the class's default when the key is missing; an explicit null
    /// (or a class default of `None`) means one KV head per attention head.
    fn kv_heads(&mut self, heads: u32, default: Option<u32>) -> Result<u32, ConfigFieldError> {
        let key = "num_key_value_heads";
        match (self.obj.get(key), default) {
            (Some(Value::Null), _) | (None, None) => Ok(heads),
            (None, Some(d)) => {
                self.defaults.push((self.name(key), d.to_string()));
                Ok(d)
            }
            (Some(_), _) => self.u32_req(key),
        }
    }
}

/// How an architecture's vLLM model sizes its attention heads.
#[derive(Clone, Copy)]
enum HeadDim {
    /// `head_dim`, or the class's default when the key is missing; `hidden_size /
    /// num_attention_heads` when null.
    Class(u32),
    /// `head_dim`, else `hidden_size / num_attention_heads`.
    Derived,
    /// `hidden_size / num_attention_heads`, whatever `head_dim` says (the model ignores it).
    Hidden,
}

/// An architecture's attention defaults: heads, KV heads (`None`: as many as heads), head
/// dim, hidden size.
#[derive(Clone, Copy)]
struct AttnDefaults {
    heads: u32,
    kv: Option<u32>,
    head_dim: HeadDim,
    hidden: u32,
}

/// The architectures whose configuration class refuses a hidden size that the attention
/// heads do not divide (transformers' `validate_architecture`).
const CHECKS_HIDDEN: [&str; 5] = [
    "LlamaForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "DeepseekV2ForCausalLM",
    "DeepseekForCausalLM",
];

/// Transformers' check of `hidden_size` against `num_attention_heads` for `arch`.
fn check_hidden(f: &mut Fields<'_>, arch: &str, hidden_default: u32) -> Result<(), ConfigFieldError> {
    if !CHECKS_HIDDEN.contains(&arch) {
        return Ok(());
    }
    let heads = f.opt_u32("num_attention_heads")?.unwrap_or(32);
    let hidden = f.opt_u32("hidden_size")?.unwrap_or(hidden_default);
    if !hidden.is_multiple_of(heads) {
        return Err(err(
            &f.name("hidden_size"),
            format!(
                "is {hidden}: not a multiple of num_attention_heads ({heads}), which {arch}'s config refuses"
            ),
        ));
    }
    Ok(())
}

/// A dtype name as configs write it (`bfloat16`, `torch.float16`, `float32`).
fn parse_dtype(field: &str, s: &str) -> Result<Dtype, ConfigFieldError> {
    match s.trim().trim_start_matches("torch.").to_ascii_lowercase().as_str() {
        "bfloat16" | "bf16" => Ok(Dtype::Bf16),
        "float16" | "fp16" | "half" => Ok(Dtype::Fp16),
        "float32" | "fp32" | "float" => Ok(Dtype::Fp32),
        other => Err(err(field, format!("is {other:?}: expected bfloat16, float16 or float32"))),
    }
}

/// The KV cache element type vLLM runs a model of config dtype `d` with (`auto` on CUDA:
/// float32 and no dtype become bfloat16).
fn kv_dtype(fields: &[&Fields<'_>]) -> Result<Dtype, ConfigFieldError> {
    for f in fields {
        for key in ["dtype", "torch_dtype"] {
            if let Some(s) = f.opt_str(key)? {
                return Ok(match parse_dtype(&f.name(key), s)? {
                    Dtype::Fp32 => Dtype::Bf16,
                    d => d,
                });
            }
        }
    }
    Ok(Dtype::Bf16)
}

fn names(attention: &str, state: &str) -> LayerNames {
    LayerNames { attention: attention.into(), state: state.into() }
}

/// Reads a config (a `config.json` object, or a kvx preset in the same terms). `fallback`
/// names the model when the config does not (`name`, `_name_or_path`).
pub fn read(config: &Value, fallback: &str) -> Result<ArchModel, ConfigFieldError> {
    let obj = config.as_object().ok_or_else(|| err("config", "is not a JSON object"))?;
    let top = Fields { obj, prefix: "", defaults: Vec::new() };
    let archs = top.opt_strs("architectures")?.ok_or_else(|| {
        err("architectures", format!("is missing: name the model class ({})", ARCHITECTURES.join(", ")))
    })?;
    let arch = archs
        .iter()
        .find(|a| ARCHITECTURES.contains(a))
        .ok_or_else(|| {
            err(
                "architectures",
                format!("{archs:?} is not an architecture kvx reads ({})", ARCHITECTURES.join(", ")),
            )
        })?
        .to_string();
    let name = ["name", "hf_id", "_name_or_path"]
        .iter()
        .find_map(|k| top.opt_str(k).ok().flatten().filter(|s| !s.trim().is_empty()))
        .unwrap_or(fallback)
        .to_string();
    let (model, mla, defaults) = match arch.as_str() {
        "Gemma3ForConditionalGeneration" => {
            let text_obj = obj.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                err(
                    "text_config",
                    "is missing: Gemma3ForConditionalGeneration keeps its language model there",
                )
            })?;
            check_hidden(
                &mut Fields { obj: text_obj, prefix: "text_config.", defaults: Vec::new() },
                &arch,
                2304,
            )?;
            let text = obj.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                err(
                    "text_config",
                    "is missing: Gemma3ForConditionalGeneration keeps its language model there",
                )
            })?;
            let mut f = Fields { obj: text, prefix: "text_config.", defaults: Vec::new() };
            let dtype = kv_dtype(&[&f, &top])?;
            let m = gemma3(&mut f, dtype, "language_model.model.layers.{i}.self_attn.attn")?;
            (m, None, f.defaults)
        }
        _ => {
            let mut f = top;
            let hidden_default = match arch.as_str() {
                "Gemma3ForCausalLM" => 2304,
                _ => 4096,
            };
            check_hidden(&mut f, &arch, hidden_default)?;
            let dtype = kv_dtype(&[&f])?;
            let (m, mla) = match arch.as_str() {
                "Qwen3NextForCausalLM" => (qwen3_next(&mut f, dtype)?, None),
                "NemotronHForCausalLM" => (nemotron_h(&mut f, dtype)?, None),
                "GraniteMoeHybridForCausalLM" => (granite_hybrid(&mut f, dtype)?, None),
                "JambaForCausalLM" => (jamba(&mut f, dtype)?, None),
                "FalconH1ForCausalLM" => (falcon_h1(&mut f, dtype)?, None),
                "GptOssForCausalLM" => (gpt_oss(&mut f, dtype)?, None),
                "Gemma3ForCausalLM" => (gemma3(&mut f, dtype, "model.layers.{i}.self_attn.attn")?, None),
                "DeepseekV2ForCausalLM" | "DeepseekV3ForCausalLM" | "DeepseekForCausalLM" => {
                    deepseek(&mut f, dtype, &arch)?
                }
                _ => (llama_like(&mut f, dtype, &arch)?, None),
            };
            (m, mla, f.defaults)
        }
    };
    let model = HybridModel { name, ..model };
    let mut defaults = defaults;
    let mut seen = std::collections::HashSet::new();
    defaults.retain(|(k, _)| seen.insert(k.clone()));
    if model.layers.is_empty() {
        return Err(err("num_hidden_layers", "gives no layers"));
    }
    if !model.layers.iter().any(|l| l.attention.is_some()) {
        return Err(err(
            "layer_types",
            "lists no attention layer: kvx plans models with attention (beside state), not attention-free ones",
        ));
    }
    Ok(ArchModel { architecture: arch, model, mla, defaults })
}

/// The attention shape as the architecture's vLLM model builds it.
fn attention(f: &mut Fields<'_>, dtype: Dtype, d: AttnDefaults) -> Result<AttentionShape, ConfigFieldError> {
    let heads = f.u32_or("num_attention_heads", d.heads)?;
    let kv = f.kv_heads(heads, d.kv)?;
    let from_hidden = |f: &mut Fields<'_>| -> Result<u32, ConfigFieldError> {
        let hidden = f.u32_or("hidden_size", d.hidden)?;
        match hidden / heads {
            0 => Err(err(
                &f.name("hidden_size"),
                format!("is {hidden}: below num_attention_heads ({heads}), so no head size follows"),
            )),
            h => Ok(h),
        }
    };
    let head_dim = match (d.head_dim, f.obj.get("head_dim")) {
        (HeadDim::Hidden, _) | (_, Some(Value::Null)) | (HeadDim::Derived, None) => from_hidden(f)?,
        (HeadDim::Class(c), None) => {
            f.defaults.push((f.name("head_dim"), c.to_string()));
            c
        }
        (_, Some(_)) => f.u32_req("head_dim")?,
    };
    Ok(AttentionShape { num_kv_heads: kv, head_dim, dtype })
}

/// Transformers' RoPE check (`validate_rope`): a config whose `head_dim` (given, or the
/// class's) is odd and above 4 with the whole head rotated is refused. `class_head_dim`: the
/// value the class keeps when the file gives none (`None`: the class keeps no `head_dim`);
/// `partial`: the class's `partial_rotary_factor` default.
fn check_rope(f: &Fields<'_>, class_head_dim: Option<u32>, partial: f64) -> Result<(), ConfigFieldError> {
    let head_dim = match f.opt_u32("head_dim")? {
        Some(h) => h,
        None => match class_head_dim {
            Some(h) => h,
            None => return Ok(()),
        },
    };
    let factor = f
        .raw("rope_parameters")
        .or_else(|| f.raw("rope_scaling"))
        .and_then(|r| r.get("partial_rotary_factor"))
        .or_else(|| f.raw("partial_rotary_factor"))
        .and_then(Value::as_f64)
        .unwrap_or(partial);
    if head_dim > 4
        && head_dim % 2 == 1
        && (f64::from(head_dim) * factor).floor() as u64 == u64::from(head_dim)
    {
        return Err(err(
            &f.name("head_dim"),
            format!(
                "is {head_dim}: RoPE needs an even rotary dimension, which transformers checks (validate_rope)"
            ),
        ));
    }
    Ok(())
}

/// A `layer_types` entry as transformers reads it (legacy `mamba`/`attention` remapped).
fn layer_type(s: &str) -> &str {
    match s {
        "mamba" => "linear_attention",
        "attention" => "full_attention",
        other => other,
    }
}

/// The layer kinds `layer_types` lists, `n` of them, each through `kind`.
fn from_layer_types(
    f: &Fields<'_>,
    types: &[&str],
    n: u32,
    kind: impl Fn(&str) -> Option<Layer>,
    expected: &str,
) -> Result<Vec<Layer>, ConfigFieldError> {
    if types.len() != n as usize {
        return Err(err(
            &f.name("layer_types"),
            format!("lists {} layers, but num_hidden_layers is {n}", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| {
            kind(layer_type(t))
                .ok_or_else(|| err(&f.name("layer_types"), format!("holds {t:?}: expected {expected}")))
        })
        .collect()
}

fn qwen3_next(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(48)?;
    let attention = attention(
        f,
        dtype,
        AttnDefaults { heads: 16, kv: Some(2), head_dim: HeadDim::Class(256), hidden: 2048 },
    )?;
    check_rope(f, Some(256), 0.25)?;
    let layers = match f.opt_strs("layer_types")? {
        Some(types) => from_layer_types(
            f,
            &types,
            n,
            |t| match t {
                "full_attention" => Some(Layer::FULL),
                "linear_attention" => Some(Layer::state(StateKind::Gdn)),
                _ => None,
            },
            "full_attention or linear_attention",
        )?,
        None => {
            let interval = f.u32_or("full_attention_interval", 4)?;
            (0..n)
                .map(|i| if (i + 1) % interval == 0 { Layer::FULL } else { Layer::state(StateKind::Gdn) })
                .collect()
        }
    };
    let state = StateSpec::Gdn(GdnSpec {
        num_k_heads: f.u32_or("linear_num_key_heads", 16)?,
        num_v_heads: f.u32_or("linear_num_value_heads", 32)?,
        head_k_dim: f.u32_or("linear_key_head_dim", 128)?,
        head_v_dim: f.u32_or("linear_value_head_dim", 128)?,
        conv_kernel: f.u32_or("linear_conv_kernel_dim", 4)?,
        conv_dtype: dtype,
        ssm_dtype: dtype,
    });
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention,
        state: Some(state),
        names: names("model.layers.{i}.self_attn.attn", "model.layers.{i}.linear_attn"),
    })
}

fn nemotron_h(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    // Transformers keeps the pattern as `layers_block_type` (alias `layer_types`), from the
    // legacy `hybrid_override_pattern` string when the list is absent; `num_hidden_layers` is
    // the pattern's length, whatever the file says.
    let list = match f.opt_strs("layers_block_type")? {
        Some(l) => Some(("layers_block_type", l)),
        None => f.opt_strs("layer_types")?.map(|l| ("layer_types", l)),
    };
    let kinds: Vec<(String, char)> = match list {
        Some((key, l)) => l
            .iter()
            .map(|t| {
                let c = match layer_type(t) {
                    "linear_attention" => 'M',
                    "full_attention" => '*',
                    "mlp" => '-',
                    "moe" => 'E',
                    _ => {
                        return Err(err(
                            &f.name(key),
                            format!("holds {t:?}: expected full_attention, linear_attention, mlp or moe"),
                        ));
                    }
                };
                Ok((key.to_string(), c))
            })
            .collect::<Result<_, _>>()?,
        None => {
            let key = "hybrid_override_pattern";
            let p = match f.opt_str(key)? {
                Some(p) => p.to_string(),
                None => {
                    f.defaults.push((f.name(key), "ME*-".into()));
                    "ME*-".into()
                }
            };
            if p.len() > MAX_LAYERS as usize {
                return Err(err(
                    &f.name(key),
                    format!("has {} layers: kvx plans at most {MAX_LAYERS}", p.len()),
                ));
            }
            p.chars()
                .map(|c| match c {
                    'M' | '*' | '-' | 'E' => Ok((key.to_string(), c)),
                    _ => Err(err(
                        &f.name(key),
                        format!("holds {c:?}: expected M (Mamba2), * (attention), - (MLP) or E (MoE)"),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
    };
    let layers: Vec<Layer> = kinds
        .iter()
        .map(|(_, c)| match c {
            'M' => Layer::state(StateKind::Mamba2),
            '*' => Layer::FULL,
            _ => Layer::MLP,
        })
        .collect();
    let attention = attention(
        f,
        dtype,
        AttnDefaults { heads: 32, kv: Some(8), head_dim: HeadDim::Class(128), hidden: 4096 },
    )?;
    let ssm_dtype = match f.opt_str("mamba_ssm_cache_dtype")? {
        Some(s) => parse_dtype(&f.name("mamba_ssm_cache_dtype"), s)?,
        None => Dtype::Fp32,
    };
    let state = StateSpec::Mamba2(Mamba2Spec {
        num_heads: f.u32_or("mamba_num_heads", 128)?,
        head_dim: f.u32_or("mamba_head_dim", 64)?,
        d_state: f.u32_or("ssm_state_size", 128)?,
        n_groups: f.u32_or("n_groups", 8)?,
        conv_kernel: f.u32_or("conv_kernel", 4)?,
        conv_dtype: dtype,
        ssm_dtype,
    });
    // A window on Nemotron-H's attention layers, where the config gives one.
    let layers = match f.opt_u32("sliding_window")? {
        Some(w) => layers.into_iter().map(|l| if l == Layer::FULL { Layer::swa(w) } else { l }).collect(),
        None => layers,
    };
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention,
        state: Some(state),
        names: names("model.layers.{i}.mixer.attn", "model.layers.{i}.mixer"),
    })
}

/// Mamba2's intermediate size, heads and head dim as Granite-4.0-H and Falcon-H1 configs give
/// them (`mamba_d_head` may be `"auto"`: intermediate / heads), checked as transformers
/// checks them.
fn mamba2_heads(
    f: &mut Fields<'_>,
    intermediate: u32,
    heads_default: u32,
) -> Result<(u32, u32), ConfigFieldError> {
    let heads = f.u32_or("mamba_n_heads", heads_default)?;
    if !intermediate.is_multiple_of(heads) {
        return Err(err(
            &f.name("mamba_n_heads"),
            format!("is {heads}: it must divide the Mamba intermediate size {intermediate}"),
        ));
    }
    let head = match f.raw("mamba_d_head") {
        // The configuration class's default, "auto": intermediate / heads.
        None => intermediate / heads,
        Some(Value::String(s)) if s == "auto" => intermediate / heads,
        Some(_) => f.u32_req("mamba_d_head")?,
    };
    if head * heads != intermediate {
        return Err(err(
            &f.name("mamba_d_head"),
            format!("is {head}: {heads} heads of it do not make the Mamba intermediate size {intermediate}"),
        ));
    }
    Ok((heads, head))
}

/// The Mamba2 state of Granite-4.0-H and Falcon-H1 configs (`mamba_n_heads`, `mamba_d_head`,
/// `mamba_d_state`, `mamba_n_groups`, `mamba_d_conv`), with their classes' defaults.
fn mamba2_state(f: &mut Fields<'_>, intermediate: u32, dtype: Dtype) -> Result<StateSpec, ConfigFieldError> {
    let (num_heads, head) = mamba2_heads(f, intermediate, 128)?;
    Ok(StateSpec::Mamba2(Mamba2Spec {
        num_heads,
        head_dim: head,
        d_state: f.u32_or("mamba_d_state", 256)?,
        n_groups: f.u32_or("mamba_n_groups", 1)?,
        conv_kernel: f.u32_or("mamba_d_conv", 4)?,
        conv_dtype: dtype,
        ssm_dtype: dtype,
    }))
}

fn granite_hybrid(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(32)?;
    let heads = f.u32_or("num_attention_heads", 32)?;
    let kv = f.kv_heads(heads, None)?;
    let hidden = f.u32_or("hidden_size", 4096)?;
    // vLLM's Granite attention: hidden_size / num_attention_heads, whatever head_dim says.
    let head_dim = hidden / heads;
    if head_dim == 0 {
        return Err(err(&f.name("hidden_size"), format!("is {hidden}: below num_attention_heads ({heads})")));
    }
    let layers = match f.opt_strs("layer_types")? {
        Some(types) => from_layer_types(
            f,
            &types,
            n,
            |t| match t {
                "full_attention" => Some(Layer::FULL),
                "linear_attention" => Some(Layer::state(StateKind::Mamba2)),
                _ => None,
            },
            "mamba or attention",
        )?,
        None => {
            f.defaults.push((f.name("layer_types"), "every layer mamba".into()));
            vec![Layer::state(StateKind::Mamba2); n as usize]
        }
    };
    let expand = f.u32_or("mamba_expand", 2)?;
    let intermediate = expand
        .checked_mul(hidden)
        .ok_or_else(|| err(&f.name("mamba_expand"), "overflows with hidden_size"))?;
    let state = mamba2_state(f, intermediate, dtype)?;
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention: AttentionShape { num_kv_heads: kv, head_dim, dtype },
        state: Some(state),
        names: names("model.layers.{i}.self_attn.attn", "model.layers.{i}.mixer"),
    })
}

fn jamba(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(32)?;
    let heads = f.u32_or("num_attention_heads", 32)?;
    let kv = f.kv_heads(heads, Some(8))?;
    let hidden = f.u32_or("hidden_size", 4096)?;
    let head_dim = hidden / heads;
    if head_dim == 0 {
        return Err(err(&f.name("hidden_size"), format!("is {hidden}: below num_attention_heads ({heads})")));
    }
    let period = f.u32_or("attn_layer_period", 8)?;
    let offset = match f.raw("attn_layer_offset") {
        Some(Value::Number(x)) if x.as_u64() == Some(0) => 0,
        _ => f.u32_or("attn_layer_offset", 4)?,
    };
    if offset >= period {
        return Err(err(
            &f.name("attn_layer_offset"),
            format!("is {offset}: it must be below attn_layer_period ({period})"),
        ));
    }
    let layers = (0..n)
        .map(|i| if i % period == offset { Layer::FULL } else { Layer::state(StateKind::Mamba1) })
        .collect();
    let expand = f.u32_or("mamba_expand", 2)?;
    let state = StateSpec::Mamba1(Mamba1Spec {
        intermediate_size: expand
            .checked_mul(hidden)
            .ok_or_else(|| err(&f.name("mamba_expand"), "overflows with hidden_size"))?,
        d_state: f.u32_or("mamba_d_state", 16)?,
        conv_kernel: f.u32_or("mamba_d_conv", 4)?,
        conv_dtype: dtype,
        ssm_dtype: dtype,
    });
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention: AttentionShape { num_kv_heads: kv, head_dim, dtype },
        state: Some(state),
        names: names("model.layers.{i}.attn", "model.layers.{i}.mixer"),
    })
}

fn falcon_h1(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(32)?;
    let attention = attention(
        f,
        dtype,
        AttnDefaults { heads: 32, kv: Some(8), head_dim: HeadDim::Derived, hidden: 4096 },
    )?;
    check_rope(f, None, 1.0)?;
    let hidden = f.u32_or("hidden_size", 4096)?;
    let expand = f.u32_or("mamba_expand", 2)?;
    let intermediate = match f.raw("mamba_d_ssm") {
        // Transformers' default is 1024; an explicit null means expand x hidden.
        None if !f.obj.contains_key("mamba_d_ssm") => f.u32_or("mamba_d_ssm", 1024)?,
        None => expand
            .checked_mul(hidden)
            .ok_or_else(|| err(&f.name("mamba_expand"), "overflows with hidden_size"))?,
        Some(_) => f.u32_req("mamba_d_ssm")?,
    };
    let state = mamba2_state(f, intermediate, dtype)?;
    Ok(HybridModel {
        name: String::new(),
        layers: vec![Layer { attention: Some(AttnKind::Full), state: Some(StateKind::Mamba2) }; n as usize],
        attention,
        state: Some(state),
        names: names("model.layers.{i}.attn", "model.{L+i}.mixer"),
    })
}

fn gpt_oss(f: &mut Fields<'_>, dtype: Dtype) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(36)?;
    let attention = attention(
        f,
        dtype,
        AttnDefaults { heads: 64, kv: Some(8), head_dim: HeadDim::Class(64), hidden: 2880 },
    )?;
    check_rope(f, Some(64), 1.0)?;
    let window = f.u32_or("sliding_window", 128)?;
    // vLLM's gpt_oss.py windows the even layers, whatever `layer_types` says.
    let layers = (0..n).map(|i| if i % 2 == 0 { Layer::swa(window) } else { Layer::FULL }).collect();
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention,
        state: None,
        names: names("model.layers.{i}.attn.attn", "model.layers.{i}.mixer"),
    })
}

fn gemma3(f: &mut Fields<'_>, dtype: Dtype, attention_name: &str) -> Result<HybridModel, ConfigFieldError> {
    let n = f.layers_or(26)?;
    let attention = attention(
        f,
        dtype,
        AttnDefaults { heads: 8, kv: Some(4), head_dim: HeadDim::Class(256), hidden: 2304 },
    )?;
    check_rope(f, Some(256), 1.0)?;
    let mut window = f.u32_or("sliding_window", 4096)?;
    if f.opt_bool("use_bidirectional_attention")? == Some(true) {
        window = window / 2 + 1;
    }
    let layers = match f.opt_strs("layer_types")? {
        Some(types) => from_layer_types(
            f,
            &types,
            n,
            |t| match t {
                "full_attention" => Some(Layer::FULL),
                "sliding_attention" => Some(Layer::swa(window)),
                _ => None,
            },
            "sliding_attention or full_attention",
        )?,
        None => {
            let pattern = f.u32_or("sliding_window_pattern", 6)?;
            (0..n).map(|i| if (i + 1) % pattern == 0 { Layer::FULL } else { Layer::swa(window) }).collect()
        }
    };
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention,
        state: None,
        names: names(attention_name, "model.layers.{i}.mixer"),
    })
}

fn deepseek(
    f: &mut Fields<'_>,
    dtype: Dtype,
    arch: &str,
) -> Result<(HybridModel, Option<Mla>), ConfigFieldError> {
    let v3 = arch == "DeepseekV3ForCausalLM";
    let n = f.layers_or(if v3 { 61 } else { 32 })?;
    let heads = f.u32_or("num_attention_heads", if v3 { 128 } else { 32 })?;
    let kv = f.kv_heads(heads, if v3 { Some(128) } else { None })?;
    let mla = if arch == "DeepseekForCausalLM" {
        None
    } else {
        match f.obj.get("kv_lora_rank") {
            // DeepSeek-V2-Lite style configs with a null latent rank run plain attention.
            Some(Value::Null) => None,
            _ => Some(Mla {
                kv_lora_rank: f.u32_or("kv_lora_rank", 512)?,
                qk_rope_head_dim: f.u32_or("qk_rope_head_dim", 64)?,
            }),
        }
    };
    let head_dim = match mla {
        Some(m) => m.qk_rope_head_dim,
        None => {
            attention(
                f,
                dtype,
                AttnDefaults { heads, kv: Some(kv), head_dim: HeadDim::Derived, hidden: 4096 },
            )?
            .head_dim
        }
    };
    let model = HybridModel {
        name: String::new(),
        layers: vec![Layer::FULL; n as usize],
        attention: AttentionShape { num_kv_heads: kv, head_dim, dtype },
        state: None,
        names: names("model.layers.{i}.self_attn.attn", "model.layers.{i}.mixer"),
    };
    Ok((model, mla))
}

/// Llama, Mistral, Mixtral, Qwen2/3: full attention in every layer; Llama-family models
/// window the layers `layer_types` marks `sliding_attention` (vLLM's llama.py), Qwen models
/// none (vLLM's qwen2.py passes no window).
fn llama_like(f: &mut Fields<'_>, dtype: Dtype, arch: &str) -> Result<HybridModel, ConfigFieldError> {
    // The configuration classes' defaults, and how each vLLM model sizes its heads.
    let d = |kv, head_dim, hidden| AttnDefaults { heads: 32, kv, head_dim, hidden };
    let (layers, defaults) = match arch {
        "Qwen2ForCausalLM" => (32, d(Some(32), HeadDim::Hidden, 4096)),
        "Qwen3ForCausalLM" => (32, d(Some(32), HeadDim::Class(128), 4096)),
        "Qwen3MoeForCausalLM" => (24, d(Some(4), HeadDim::Derived, 2048)),
        "MistralForCausalLM" | "MixtralForCausalLM" => (32, d(Some(8), HeadDim::Derived, 4096)),
        _ => (32, d(None, HeadDim::Derived, 4096)),
    };
    let n = f.layers_or(layers)?;
    let attention = attention(f, dtype, defaults)?;
    // The head_dim the configuration class keeps: derived (Llama, Mistral), its default
    // (Qwen3), or none unless the file gives one.
    let class_head_dim = match arch {
        "LlamaForCausalLM" | "MistralForCausalLM" => Some(attention.head_dim),
        "Qwen3ForCausalLM" => Some(128),
        _ => None,
    };
    check_rope(f, class_head_dim, 1.0)?;
    let windows = matches!(arch, "LlamaForCausalLM" | "MistralForCausalLM");
    let layers = match f.opt_strs("layer_types")? {
        Some(types) if windows => {
            let window = f.opt_u32("sliding_window")?;
            from_layer_types(
                f,
                &types,
                n,
                |t| match (t, window) {
                    ("full_attention", _) => Some(Layer::FULL),
                    ("sliding_attention", Some(w)) => Some(Layer::swa(w)),
                    ("sliding_attention", None) => Some(Layer::FULL),
                    _ => None,
                },
                "full_attention or sliding_attention",
            )?
        }
        _ => vec![Layer::FULL; n as usize],
    };
    Ok(HybridModel {
        name: String::new(),
        layers,
        attention,
        state: None,
        names: names("model.layers.{i}.self_attn.attn", "model.layers.{i}.mixer"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen3_next_from_its_interval() {
        let m = read(
            &json!({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8, "dtype": "bfloat16"}),
            "q",
        )
        .expect("reads");
        let full: Vec<usize> =
            m.model.layers.iter().enumerate().filter(|(_, l)| **l == Layer::FULL).map(|(i, _)| i).collect();
        assert_eq!(full, vec![3, 7]);
        assert!(m.defaults.iter().any(|(k, v)| k == "head_dim" && v == "256"), "{:?}", m.defaults);
    }

    #[test]
    fn bad_fields_are_named() {
        let e = read(&json!({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": -3}), "q")
            .expect_err("neg");
        assert_eq!(e.field, "num_hidden_layers");
        let e =
            read(&json!({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 1_000_000}), "q")
                .expect_err("huge");
        assert!(e.reason.contains("4096"), "{e}");
        let e = read(&json!({"architectures": ["BertModel"]}), "q").expect_err("unknown");
        assert_eq!(e.field, "architectures");
        let e = read(&json!({"num_hidden_layers": 2}), "q").expect_err("no arch");
        assert_eq!(e.field, "architectures");
        let e = read(&json!({"architectures": ["JambaForCausalLM"], "mamba_d_state": "x"}), "q")
            .expect_err("type");
        assert_eq!(e.field, "mamba_d_state");
        let e = read(&json!({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 0}), "q")
            .expect_err("zero");
        assert_eq!(e.field, "num_attention_heads");
        let e = read(&json!({"architectures": "LlamaForCausalLM"}), "q").expect_err("not a list");
        assert_eq!(e.field, "architectures");
    }

    #[test]
    fn hma_off_promotes_windows_and_refuses_state() {
        let g = read(&json!({"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4}), "g")
            .expect("reads");
        assert!(matches!(g.plan_model(true), Ok(PlanModel::Hybrid(_))));
        match g.plan_model(false) {
            Ok(PlanModel::Uniform(s)) => assert_eq!(s.num_layers, 4),
            other => panic!("{other:?}"),
        }
        let j = read(&json!({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8}), "j")
            .expect("reads");
        assert!(j.plan_model(false).is_err());
        let l = read(
            &json!({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 1024}),
            "l",
        )
        .expect("reads");
        assert!(matches!(l.plan_model(true), Ok(PlanModel::Uniform(_))));
    }

    #[test]
    fn nemotron_pattern_and_falcon_names() {
        let n = read(
            &json!({"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-E"}),
            "n",
        )
        .expect("reads");
        assert_eq!(n.model.layers.len(), 6);
        assert_eq!(n.model.state.expect("state").dtypes().1, Dtype::Fp32);
        let f = read(&json!({"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 4}), "f")
            .expect("reads");
        assert_eq!(f.model.cache_layers()[1].name, "model.4.mixer");
    }
}
