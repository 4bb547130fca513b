//! The model `--model` or `--model-config` names, read: a preset (by name, alias or Hugging
//! Face id), a Hugging Face `config.json` (the file, or the folder that holds it), or a kvx
//! model TOML (a layer pattern). Configs and presets are read by `layouts::model_config`, as
//! vLLM reads them; `--hma` says whether vLLM's hybrid KV cache manager lays the model out.
//! Errors name the flag and, for a config, the field.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::ConfigError;
use crate::layouts::hybrid::HybridModel;
use crate::layouts::model_config::{self, ArchModel, MAX_LAYERS, PlanModel};

pub use super::flags::Hma;
pub use crate::vocab::model::{Dtype, Mla, ModelShape};

/// The model used when no model flag is given.
pub const DEFAULT_MODEL: &str = "llama-3.1-70b";

/// The largest config file kvx reads (a real `config.json` is a few KiB).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Where a model came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Preset(&'static str),
    File(PathBuf),
}

/// A model read from its source, before `--hma` lays it out.
#[derive(Debug, Clone)]
pub enum ReadModel {
    /// A preset or a `config.json`, read by its architecture.
    Config(Box<ArchModel>),
    /// A kvx model TOML: a hybrid layer pattern.
    Pattern(HybridModel),
}

/// A model laid out: the model and how kvx plans it.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    pub source: ModelSource,
    pub plan: PlanModel,
    /// The architecture, for a config or preset.
    pub architecture: Option<String>,
    /// Config fields left out, with the architecture's default taken for each.
    pub defaults: Vec<(String, String)>,
    /// vLLM's names of the layers that keep attention, in order: NIXL region names.
    pub attention_names: Vec<String>,
}

fn config_error(flag: &str, what: &str, e: model_config::ConfigFieldError) -> ConfigError {
    ConfigError::new(flag, format!("{what}: {e}"))
}

/// Whether `s` reads as a filesystem path rather than a preset name or Hugging Face id.
fn looks_like_path(s: &str) -> bool {
    let lower = s.to_ascii_lowercase();
    s.starts_with('/')
        || s.starts_with("./")
        || s.starts_with("../")
        || s.starts_with('~')
        || s.starts_with('.')
        || lower.ends_with(".json")
        || lower.ends_with(".toml")
        || s.matches('/').count() > 1
}

/// Reads a config file (or the `config.json` in a folder): JSON, or TOML in the same terms.
fn read_config_file(flag: &str, path: &Path) -> Result<ReadModel, ConfigError> {
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    let meta = std::fs::metadata(&file)
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", file.display())))?;
    if !meta.is_file() {
        return Err(ConfigError::new(flag, format!("{} is not a file", file.display())));
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(ConfigError::new(
            flag,
            format!(
                "{} is {} bytes: a model config is at most {MAX_CONFIG_BYTES}",
                file.display(),
                meta.len()
            ),
        ));
    }
    let text = std::fs::read_to_string(&file)
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", file.display())))?;
    let shown = file.display().to_string();
    let is_toml = file.extension().is_some_and(|x| x.eq_ignore_ascii_case("toml"));
    let value: Value = if is_toml {
        toml::from_str(&text)
            .map_err(|e| ConfigError::new(flag, format!("{shown} is not valid TOML: {e}")))?
    } else {
        serde_json::from_str(&text)
            .map_err(|e| ConfigError::new(flag, format!("{shown} is not valid JSON: {e}")))?
    };
    // A kvx model TOML lists its layers as strings ("full", "swa:128", "mamba2", ...).
    if is_toml && value.get("layers").is_some_and(Value::is_array) {
        if value["layers"].as_array().is_some_and(|l| l.len() > MAX_LAYERS as usize) {
            return Err(ConfigError::new(
                flag,
                format!("{shown}: `layers` lists more than {MAX_LAYERS} layers"),
            ));
        }
        let model: HybridModel = toml::from_str(&text)
            .map_err(|e| ConfigError::new(flag, format!("{shown} is not a hybrid model TOML: {e}")))?;
        model.validate().map_err(|e| ConfigError::new(flag, format!("{shown}: {e}")))?;
        return Ok(ReadModel::Pattern(model));
    }
    let fallback = file
        .parent()
        .and_then(|p| p.file_name())
        .map(|s| s.to_string_lossy().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "custom".to_string());
    let arch = model_config::read(&value, &fallback).map_err(|e| config_error(flag, &shown, e))?;
    Ok(ReadModel::Config(Box::new(arch)))
}

/// A preset by name, alias or Hugging Face id; an alias names the model.
pub fn read_preset(name: &str) -> Result<(&'static str, ArchModel), ConfigError> {
    let p = model_config::find_preset(name).ok_or_else(|| {
        ConfigError::new(
            "--model",
            format!(
                "unknown model '{name}'; presets: {} (or a config.json: --model PATH or --model-config PATH)",
                model_config::preset_names()
            ),
        )
    })?;
    let mut arch = p.read().map_err(|e| config_error("--model", &format!("preset {}", p.name), e))?;
    let want = name.trim().to_ascii_lowercase();
    let is_alias = p.config().ok().and_then(|c| c.get("aliases").cloned()).is_some_and(|a| {
        a.as_array()
            .is_some_and(|a| a.iter().filter_map(Value::as_str).any(|x| x.to_ascii_lowercase() == want))
    });
    if is_alias {
        arch.model.name = want;
    }
    Ok((p.name, arch))
}

/// Reads what `--model` (a preset, a config file or folder, a model TOML) or
/// `--model-config` (a config file or folder) names; the default preset when neither.
pub fn read_model(
    model: Option<&str>,
    model_config: Option<&Path>,
    default: &str,
) -> Result<(ModelSource, ReadModel), ConfigError> {
    if let Some(path) = model_config {
        return Ok((ModelSource::File(path.to_path_buf()), read_config_file("--model-config", path)?));
    }
    let name = model.unwrap_or(default);
    if let Some(base) = name.strip_suffix(":hma") {
        return Err(ConfigError::new(
            "--model",
            format!(
                "'{name}': the :hma suffix is gone; {base} runs with vLLM's hybrid KV cache manager by default (--hma on), and --hma off lays out every layer's full blocks"
            ),
        ));
    }
    let path = Path::new(name);
    if path.exists() {
        return Ok((ModelSource::File(path.to_path_buf()), read_config_file("--model", path)?));
    }
    if looks_like_path(name) {
        return Err(ConfigError::new(
            "--model",
            format!(
                "{name} does not exist (a path is read as a config.json, a folder holding one, or a model TOML)"
            ),
        ));
    }
    let (preset, arch) = read_preset(name)?;
    Ok((ModelSource::Preset(preset), ReadModel::Config(Box::new(arch))))
}

/// The model `--model`/`--model-config` name, laid out under `--hma`.
pub fn resolve(
    model: Option<&str>,
    model_config: Option<&Path>,
    hma: Hma,
    default: &str,
) -> Result<ResolvedModel, ConfigError> {
    let (source, read) = read_model(model, model_config, default)?;
    let flag = if model_config.is_some() { "--model-config" } else { "--model" };
    let arch = match read {
        ReadModel::Pattern(model) => {
            ArchModel { architecture: "kvx model TOML".into(), model, mla: None, defaults: Vec::new() }
        }
        ReadModel::Config(arch) => *arch,
    };
    let plan = arch.plan_model(hma == Hma::On).map_err(|e| {
        ConfigError::new(if hma == Hma::Off { "--hma" } else { flag }, format!("{}: {e}", arch.model.name))
    })?;
    Ok(ResolvedModel {
        source,
        plan,
        architecture: Some(arch.architecture.clone()),
        attention_names: arch
            .model
            .cache_layers()
            .into_iter()
            .filter(|l| matches!(l.kind, crate::layouts::hybrid::model::CacheKind::Attention(_)))
            .map(|l| l.name)
            .collect(),
        defaults: arch.defaults,
    })
}

/// The model a command's model flags name (`--model`, `--model-config`, `--hma`), laid out.
pub fn resolve_flags(m: &super::flags::ModelFlags) -> Result<ResolvedModel, ConfigError> {
    resolve(m.model.as_deref(), m.model_config.as_deref(), m.hma.unwrap_or_default(), DEFAULT_MODEL)
}

/// A uniform preset's shape (tests, benches): what `--model NAME` plans for a model of one
/// full-attention group.
pub fn preset(name: &str) -> Result<ModelShape, ConfigError> {
    match resolve(Some(name), None, Hma::On, name)?.plan {
        PlanModel::Uniform(s) => Ok(s),
        PlanModel::Hybrid(m) => Err(ConfigError::new("--model", format!("{} is a hybrid model", m.name))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_reads() {
        for p in model_config::PRESETS {
            let arch = p.read().unwrap_or_else(|e| panic!("{}: {e}", p.name));
            assert!(
                arch.defaults.iter().all(|(k, _)| k != "num_hidden_layers"),
                "{}: {:?}",
                p.name,
                arch.defaults
            );
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
    fn a_path_is_never_a_preset() {
        let e = resolve(Some("/no/such/dir/jamba"), None, Hma::On, "x").expect_err("missing path");
        assert!(e.to_string().contains("does not exist"), "{e}");
        let e = resolve(Some("gpt-oss-120b:hma"), None, Hma::On, "x").expect_err("suffix");
        assert!(e.to_string().contains("--hma"), "{e}");
    }

    #[test]
    fn gpt_oss_follows_hma() {
        assert!(matches!(
            resolve(Some("gpt-oss-120b"), None, Hma::On, "x").expect("on").plan,
            PlanModel::Hybrid(_)
        ));
        match resolve(Some("gpt-oss-120b"), None, Hma::Off, "x").expect("off").plan {
            PlanModel::Uniform(s) => assert_eq!(s.num_layers, 36),
            other => panic!("{other:?}"),
        }
        let e = resolve(Some("jamba-v0.1"), None, Hma::Off, "x").expect_err("state needs HMA");
        assert_eq!(e.flag, "--hma");
    }

    #[test]
    fn unknown_preset_names_the_flag() {
        let e = preset("gpt-5").expect_err("unknown");
        assert_eq!(e.flag, "--model");
    }
}
