//! Model shapes from a preset, a Hugging Face `config.json`, or flags: resolution into
//! [`ModelShape`] (the type itself is ground-floor vocabulary, `vocab::model`). Only the fields
//! that size the KV cache matter here.

use std::path::Path;

use serde::Deserialize;

use crate::error::ConfigError;

pub use crate::vocab::model::{Dtype, Mla, ModelShape};

/// Fields of a Hugging Face `config.json` (and of kvx's preset files, which use the same
/// names) that size the KV cache.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub aliases: Vec<String>,
    #[serde(default)]
    pub hf_id: Option<String>,
    #[serde(default, alias = "_name_or_path")]
    pub name_or_path: Option<String>,
    #[serde(default)]
    pub num_hidden_layers: Option<u32>,
    #[serde(default)]
    pub num_attention_heads: Option<u32>,
    #[serde(default)]
    pub num_key_value_heads: Option<u32>,
    #[serde(default)]
    pub head_dim: Option<u32>,
    #[serde(default)]
    pub hidden_size: Option<u32>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Newer transformers write `dtype` instead of `torch_dtype`.
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(default)]
    pub kv_lora_rank: Option<u32>,
    #[serde(default)]
    pub qk_rope_head_dim: Option<u32>,
    /// Multimodal configs nest the language model here.
    #[serde(default)]
    pub text_config: Option<Box<HfConfig>>,
}

impl HfConfig {
    /// Turns the config into a shape, naming the field that is missing or wrong.
    pub fn to_shape(&self, fallback_name: &str, source: &str) -> Result<ModelShape, ConfigError> {
        if self.num_hidden_layers.is_none()
            && let Some(text) = &self.text_config
        {
            return text.to_shape(fallback_name, source);
        }
        let missing = |field: &str| {
            ConfigError::new(
                source,
                format!(
                    "{source} has no '{field}'; pass it with the matching flag (--layers, --num-kv-heads, --head-dim)"
                ),
            )
        };
        let num_layers = self.num_hidden_layers.ok_or_else(|| missing("num_hidden_layers"))?;
        let mla = self
            .kv_lora_rank
            .map(|r| Mla { kv_lora_rank: r, qk_rope_head_dim: self.qk_rope_head_dim.unwrap_or(0) });
        let num_kv_heads = match (self.num_key_value_heads, self.num_attention_heads) {
            (Some(h), _) | (None, Some(h)) => h,
            (None, None) => return Err(missing("num_key_value_heads")),
        };
        let head_dim = match (self.head_dim, self.hidden_size, self.num_attention_heads) {
            (Some(d), _, _) => d,
            (None, Some(hs), Some(nh)) if nh > 0 => hs / nh,
            _ if mla.is_some() => mla.map_or(0, |m| m.qk_rope_head_dim),
            _ => return Err(missing("head_dim")),
        };
        let dtype = match self.torch_dtype.as_deref().or(self.dtype.as_deref()) {
            Some(s) => s.parse::<Dtype>().map_err(|e| ConfigError::new(source, e))?,
            None => Dtype::Bf16,
        };
        let name = self
            .name
            .clone()
            .or_else(|| self.hf_id.clone())
            .or_else(|| self.name_or_path.clone())
            .unwrap_or_else(|| fallback_name.to_string());
        Ok(ModelShape { name, num_layers, num_kv_heads, head_dim, dtype, mla })
    }
}

/// A preset shipped with kvx (the files under `bench-configs/models/`, embedded).
pub struct Preset {
    pub name: &'static str,
    pub toml: &'static str,
}

macro_rules! preset {
    ($name:literal) => {
        Preset { name: $name, toml: include_str!(concat!("../../bench-configs/models/", $name, ".toml")) }
    };
}

/// Every embedded preset.
pub const PRESETS: &[Preset] = &[
    preset!("llama-3.1-8b"),
    preset!("llama-3.1-70b"),
    preset!("llama-3.1-405b"),
    preset!("qwen3-0.6b"),
    preset!("qwen3-8b"),
    preset!("qwen3-32b"),
    preset!("qwen3-235b-a22b"),
    preset!("mistral-7b"),
    preset!("gpt-oss-120b"),
    preset!("deepseek-v3"),
];

fn normalize(name: &str) -> String {
    name.trim().to_ascii_lowercase().replace(['_', ' '], "-")
}

/// Parses one preset file.
pub fn parse_preset(p: &Preset) -> Result<(HfConfig, ModelShape), ConfigError> {
    let cfg: HfConfig = toml::from_str(p.toml)
        .map_err(|e| ConfigError::new("--model", format!("preset {} is malformed: {e}", p.name)))?;
    let shape = cfg.to_shape(p.name, "--model")?;
    Ok((cfg, shape))
}

/// Looks a preset up by name, alias or Hugging Face id (case-insensitive).
pub fn preset(name: &str) -> Result<ModelShape, ConfigError> {
    let want = normalize(name);
    for p in PRESETS {
        let (cfg, shape) = parse_preset(p)?;
        let hf = cfg.hf_id.as_deref().map(normalize);
        let hf_tail = hf.as_deref().and_then(|h| h.rsplit('/').next().map(str::to_string));
        if normalize(p.name) == want
            || cfg.aliases.iter().any(|a| normalize(a) == want)
            || hf.as_deref() == Some(want.as_str())
            || hf_tail.as_deref() == Some(want.as_str())
        {
            let mut shape = shape;
            if cfg.aliases.iter().any(|a| normalize(a) == want) {
                shape.name = want;
            }
            return Ok(shape);
        }
    }
    let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
    Err(ConfigError::new(
        "--model",
        format!(
            "unknown model '{name}'; presets: {} (or pass --model-config PATH to a config.json)",
            names.join(", ")
        ),
    ))
}

/// Reads a Hugging Face `config.json`.
pub fn from_config_file(path: &Path) -> Result<ModelShape, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("--model-config", format!("cannot read {}: {e}", path.display())))?;
    let cfg: HfConfig = serde_json::from_str(&text).map_err(|e| {
        ConfigError::new("--model-config", format!("{} is not a valid config.json: {e}", path.display()))
    })?;
    let stem = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "custom".to_string());
    cfg.to_shape(&stem, "--model-config")
}

/// The hybrid model `--model` names: a model TOML (a path ending in `.toml`, read by
/// `layouts::hybrid::model`: its layer pattern, attention shape and state), or a hybrid preset
/// (a name no uniform preset has). `None` for a uniform model.
pub fn hybrid_model(name: &str) -> Result<Option<crate::layouts::hybrid::HybridModel>, ConfigError> {
    if name.to_ascii_lowercase().ends_with(".toml") {
        let text = std::fs::read_to_string(name)
            .map_err(|e| ConfigError::new("--model", format!("cannot read the model file {name}: {e}")))?;
        let model: crate::layouts::hybrid::HybridModel = toml::from_str(&text)
            .map_err(|e| ConfigError::new("--model", format!("{name} is not a hybrid model TOML: {e}")))?;
        model.validate().map_err(|e| ConfigError::new("--model", format!("{name}: {e}")))?;
        return Ok(Some(model));
    }
    // `NAME:hma`: the hybrid preset of a model that also has a uniform one (gpt-oss-120b: its
    // window groups under vLLM's hybrid KV cache manager, not every layer's full blocks).
    if let Some(base) = name.strip_suffix(":hma") {
        return crate::layouts::hybrid::preset(base).map(Some).map_err(|_| {
            ConfigError::new(
                "--model",
                format!("{base} has no hybrid preset (see kvx plan --help for the list)"),
            )
        });
    }
    if preset(name).is_ok() {
        return Ok(None);
    }
    Ok(crate::layouts::hybrid::preset(name).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses() {
        for p in PRESETS {
            let (_, shape) = parse_preset(p).expect("preset parses");
            assert!(shape.num_layers > 0 && shape.num_kv_heads > 0, "{}", p.name);
        }
    }

    #[test]
    fn deepseek_is_mla_576() {
        let s = preset("deepseek-r1").expect("alias resolves");
        assert_eq!(s.mla.map(Mla::head_size), Some(576));
        assert_eq!(s.cell_bytes(), 1152);
        assert_eq!(s.name, "deepseek-r1");
    }

    #[test]
    fn llama70b_bytes_per_token() {
        let s = preset("Llama-3.1-70B").expect("preset");
        // 80 layers x 8 heads x (128 K + 128 V) x 2 bytes
        assert_eq!(s.bytes_per_token(), 80 * 8 * 256 * 2);
        assert_eq!(preset("meta-llama/Llama-3.1-70B-Instruct").expect("hf id").num_layers, 80);
    }

    #[test]
    fn hf_config_head_dim_from_hidden_size() {
        let cfg: HfConfig = serde_json::from_str(
            r#"{"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 1024, "dtype": "float16"}"#,
        )
        .expect("json");
        let s = cfg.to_shape("x", "--model-config").expect("shape");
        assert_eq!((s.num_kv_heads, s.head_dim, s.dtype), (8, 128, Dtype::Fp16));
    }

    #[test]
    fn unknown_preset_names_the_flag() {
        let e = preset("gpt-5").expect_err("unknown");
        assert_eq!(e.flag, "--model");
    }
}
