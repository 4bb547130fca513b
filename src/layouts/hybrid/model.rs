//! What a hybrid model caches: its layer pattern (full attention, sliding window, Mamba1,
//! Mamba2, GDN, or attention and state side by side), the attention KV shape and the state
//! parameters of its Mamba kind, and the presets kvx ships.
//!
//! Plain data that a TOML or JSON file can describe (`Deserialize`): a layer is written as a
//! short string (`"full"`, `"swa:128"`, `"mamba2"`, `"full+mamba2"`, `"mlp"`), the state as a
//! table tagged with its `kind`. Nothing here knows TP, block sizes or vLLM's allocator; that is
//! `geometry`'s job.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::HybridError;
pub use crate::vocab::model::Dtype;

/// The attention cache a layer keeps, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttnKind {
    /// Every token's K and V (vLLM `FullAttentionSpec`).
    Full,
    /// Only the last `window_tokens` tokens matter (vLLM `SlidingWindowSpec`).
    SlidingWindow { window_tokens: u32 },
}

/// The recurrent state a layer keeps, if any (vLLM `MambaSpec` with its `mamba_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StateKind {
    /// Conv state `[x]`, SSM state `(intermediate, d_state)`.
    Mamba1,
    /// Conv state `[x | B | C]`, SSM state `(heads, head_dim, d_state)`.
    Mamba2,
    /// Gated DeltaNet: conv state `[Q | K | V]`, SSM state `(v_heads, v_dim, k_dim)`.
    Gdn,
}

impl StateKind {
    pub fn name(self) -> &'static str {
        match self {
            StateKind::Mamba1 => "mamba1",
            StateKind::Mamba2 => "mamba2",
            StateKind::Gdn => "gdn",
        }
    }
}

/// One decoder layer: which caches it keeps. Falcon-H1 keeps both; an MLP-only layer keeps
/// neither (Nemotron-H's `-`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Layer {
    pub attention: Option<AttnKind>,
    pub state: Option<StateKind>,
}

impl Layer {
    pub const FULL: Layer = Layer { attention: Some(AttnKind::Full), state: None };
    pub const MLP: Layer = Layer { attention: None, state: None };

    pub fn swa(window_tokens: u32) -> Layer {
        Layer { attention: Some(AttnKind::SlidingWindow { window_tokens }), state: None }
    }

    pub fn state(kind: StateKind) -> Layer {
        Layer { attention: None, state: Some(kind) }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let attn = self.attention.map(|a| match a {
            AttnKind::Full => "full".to_string(),
            AttnKind::SlidingWindow { window_tokens } => format!("swa:{window_tokens}"),
        });
        match (attn, self.state) {
            (Some(a), Some(s)) => write!(f, "{a}+{}", s.name()),
            (Some(a), None) => f.write_str(&a),
            (None, Some(s)) => f.write_str(s.name()),
            (None, None) => f.write_str("mlp"),
        }
    }
}

impl FromStr for Layer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut layer = Layer::MLP;
        for part in s.trim().to_ascii_lowercase().split('+') {
            let part = part.trim();
            let (attn, state) = match part {
                "full" | "attention" | "attn" => (Some(AttnKind::Full), None),
                "mamba1" | "mamba" => (None, Some(StateKind::Mamba1)),
                "mamba2" => (None, Some(StateKind::Mamba2)),
                "gdn" | "linear_attention" => (None, Some(StateKind::Gdn)),
                "mlp" | "-" => (None, None),
                _ => match part.strip_prefix("swa:").or_else(|| part.strip_prefix("sliding:")) {
                    Some(w) => {
                        let window_tokens: u32 =
                            w.parse().map_err(|_| format!("sliding window '{w}' is not a token count"))?;
                        if window_tokens == 0 {
                            return Err("a sliding window of 0 tokens keeps nothing".into());
                        }
                        (Some(AttnKind::SlidingWindow { window_tokens }), None)
                    }
                    None => {
                        return Err(format!(
                            "unknown layer kind '{part}' (expected full, swa:<tokens>, mamba1, mamba2, gdn, \
                             mlp, or attention+state such as full+mamba2)"
                        ));
                    }
                },
            };
            if attn.is_some() && layer.attention.replace(attn.unwrap_or(AttnKind::Full)).is_some() {
                return Err(format!("layer '{s}' names two attention caches"));
            }
            if let Some(k) = state
                && layer.state.replace(k).is_some()
            {
                return Err(format!("layer '{s}' names two state caches"));
            }
        }
        Ok(layer)
    }
}

impl TryFrom<String> for Layer {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Layer> for String {
    fn from(l: Layer) -> String {
        l.to_string()
    }
}

/// The attention KV cache of one layer: `num_kv_heads` heads of `head_dim` elements each for K
/// and for V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionShape {
    /// The model's total KV heads (`num_key_value_heads`).
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
}

/// Mamba1 (Jamba): the conv state holds `x` only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mamba1Spec {
    /// `expand * hidden_size`: conv channels and SSM rows before TP.
    pub intermediate_size: u32,
    pub d_state: u32,
    pub conv_kernel: u32,
    pub conv_dtype: Dtype,
    pub ssm_dtype: Dtype,
}

/// Mamba2 (Nemotron-H, granite-4.0-h, Falcon-H1): conv state `[x | B | C]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mamba2Spec {
    pub num_heads: u32,
    pub head_dim: u32,
    pub d_state: u32,
    /// B and C groups; vLLM replicates them on every rank when TP does not divide them
    /// (only `n_groups == 1` is allowed then).
    pub n_groups: u32,
    pub conv_kernel: u32,
    pub conv_dtype: Dtype,
    pub ssm_dtype: Dtype,
}

impl Mamba2Spec {
    /// `x`'s channels: `num_heads * head_dim`.
    pub fn intermediate_size(&self) -> u64 {
        u64::from(self.num_heads) * u64::from(self.head_dim)
    }
}

/// Gated DeltaNet (Qwen3-Next): conv state `[Q | K | V]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GdnSpec {
    pub num_k_heads: u32,
    pub num_v_heads: u32,
    pub head_k_dim: u32,
    pub head_v_dim: u32,
    pub conv_kernel: u32,
    pub conv_dtype: Dtype,
    pub ssm_dtype: Dtype,
}

/// The state parameters of a model's Mamba kind (one kind per model, as vLLM's connector
/// assumes: it derives the conv split from the first `MambaSpec` it finds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum StateSpec {
    Mamba1(Mamba1Spec),
    Mamba2(Mamba2Spec),
    Gdn(GdnSpec),
}

impl StateSpec {
    pub fn kind(&self) -> StateKind {
        match self {
            StateSpec::Mamba1(_) => StateKind::Mamba1,
            StateSpec::Mamba2(_) => StateKind::Mamba2,
            StateSpec::Gdn(_) => StateKind::Gdn,
        }
    }

    pub fn conv_kernel(&self) -> u32 {
        match self {
            StateSpec::Mamba1(s) => s.conv_kernel,
            StateSpec::Mamba2(s) => s.conv_kernel,
            StateSpec::Gdn(s) => s.conv_kernel,
        }
    }

    /// Element types of the conv and the SSM state.
    pub fn dtypes(&self) -> (Dtype, Dtype) {
        match self {
            StateSpec::Mamba1(s) => (s.conv_dtype, s.ssm_dtype),
            StateSpec::Mamba2(s) => (s.conv_dtype, s.ssm_dtype),
            StateSpec::Gdn(s) => (s.conv_dtype, s.ssm_dtype),
        }
    }
}

/// How vLLM names a layer's caches (the NIXL region names). `{i}` is the layer index and
/// `{L+i}` the layer count plus the index (Falcon-H1 numbers its SSM modules after the
/// attention ones). Only names and their sort order depend on this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerNames {
    pub attention: String,
    pub state: String,
}

impl Default for LayerNames {
    fn default() -> Self {
        LayerNames {
            attention: "model.layers.{i}.self_attn.attn".into(),
            state: "model.layers.{i}.mixer".into(),
        }
    }
}

impl LayerNames {
    fn render(template: &str, layer: u32, num_layers: u32) -> String {
        template.replace("{L+i}", &(num_layers + layer).to_string()).replace("{i}", &layer.to_string())
    }

    pub fn attention_name(&self, layer: u32, num_layers: u32) -> String {
        Self::render(&self.attention, layer, num_layers)
    }

    pub fn state_name(&self, layer: u32, num_layers: u32) -> String {
        Self::render(&self.state, layer, num_layers)
    }
}

/// A model as the KV cache sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HybridModel {
    pub name: String,
    /// One entry per decoder layer, in order.
    pub layers: Vec<Layer>,
    pub attention: AttentionShape,
    /// Required when any layer keeps state.
    #[serde(default)]
    pub state: Option<StateSpec>,
    #[serde(default)]
    pub names: LayerNames,
}

/// Which cache of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum CacheKind {
    Attention(AttnKind),
    State(StateKind),
}

/// One cache layer (a vLLM "layer" with a KV cache spec): a decoder layer's attention or its
/// state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CacheLayer {
    /// Decoder layer index.
    pub layer: u32,
    pub kind: CacheKind,
    /// vLLM's layer name (`model.layers.3.self_attn.attn`).
    pub name: String,
}

impl HybridModel {
    pub fn num_layers(&self) -> u32 {
        u32::try_from(self.layers.len()).unwrap_or(u32::MAX)
    }

    /// Whether any layer keeps Mamba/GDN state (vLLM `_has_mamba`).
    pub fn has_state(&self) -> bool {
        self.layers.iter().any(|l| l.state.is_some())
    }

    /// Cache layers in registration order: layer by layer, attention before state within a
    /// layer (Falcon-H1 builds its attention branch first).
    pub fn cache_layers(&self) -> Vec<CacheLayer> {
        let n = self.num_layers();
        let mut out = Vec::new();
        for (i, l) in (0u32..).zip(&self.layers) {
            if let Some(a) = l.attention {
                out.push(CacheLayer {
                    layer: i,
                    kind: CacheKind::Attention(a),
                    name: self.names.attention_name(i, n),
                });
            }
            if let Some(s) = l.state {
                out.push(CacheLayer {
                    layer: i,
                    kind: CacheKind::State(s),
                    name: self.names.state_name(i, n),
                });
            }
        }
        out
    }

    /// Checks that the description is complete and consistent.
    pub fn validate(&self) -> Result<(), HybridError> {
        let bad = |field: &str, reason: String| Err(HybridError::model(field, reason));
        if self.layers.is_empty() {
            return bad("layers", "the model has no layers".into());
        }
        if !self.layers.iter().any(|l| l.attention.is_some()) {
            return bad(
                "layers",
                "no attention layer: kvx plans hybrid models (attention beside state), not attention-free ones"
                    .into(),
            );
        }
        let a = &self.attention;
        if a.num_kv_heads == 0 || a.head_dim == 0 {
            return bad("attention", "num_kv_heads and head_dim must be positive".into());
        }
        let kinds: Vec<StateKind> = self.layers.iter().filter_map(|l| l.state).collect();
        match (&self.state, kinds.first()) {
            (None, Some(k)) => {
                return bad(
                    "state",
                    format!("layers keep {} state but the model gives no state parameters", k.name()),
                );
            }
            (Some(s), Some(_)) => {
                if let Some(k) = kinds.iter().find(|&&k| k != s.kind()) {
                    return bad(
                        "layers",
                        format!(
                            "a {} layer in a model whose state is {} (vLLM's connector handles one Mamba kind per model)",
                            k.name(),
                            s.kind().name()
                        ),
                    );
                }
            }
            _ => {}
        }
        if let Some(s) = &self.state {
            let positive = match s {
                StateSpec::Mamba1(m) => [m.intermediate_size, m.d_state, m.conv_kernel, 1, 1],
                StateSpec::Mamba2(m) => [m.num_heads, m.head_dim, m.d_state, m.n_groups, m.conv_kernel],
                StateSpec::Gdn(g) => {
                    [g.num_k_heads, g.num_v_heads, g.head_k_dim, g.head_v_dim, g.conv_kernel]
                }
            };
            if positive.contains(&0) {
                return bad("state", "every state dimension must be positive".into());
            }
            if s.conv_kernel() < 2 {
                return bad("state.conv_kernel", "a conv kernel below 2 keeps no conv state".into());
            }
            if let StateSpec::Mamba2(m) = s
                && m.num_heads % m.n_groups != 0
            {
                return bad(
                    "state.n_groups",
                    format!("{} heads do not split into {} groups", m.num_heads, m.n_groups),
                );
            }
        }
        Ok(())
    }
}

/// The presets that are hybrid models under vLLM's hybrid KV cache manager (state, or
/// sliding windows beside full attention): data under `bench-configs/models/`, read as their
/// architecture's config (`layouts::model_config`).
pub const PRESETS: [&str; 7] = [
    "qwen3-next-80b-a3b",
    "nemotron-h-8b",
    "granite-4.0-h-tiny",
    "jamba-v0.1",
    "falcon-h1-7b",
    "gpt-oss-120b",
    "gemma-3-4b",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::hybrid::preset;

    #[test]
    fn layer_strings_round_trip() {
        for s in ["full", "swa:128", "mamba1", "mamba2", "gdn", "mlp", "full+mamba2", "swa:4096+gdn"] {
            let l: Layer = s.parse().expect("parses");
            assert_eq!(l.to_string(), s);
        }
        assert!("full+swa:12".parse::<Layer>().is_err());
        assert!("swa:0".parse::<Layer>().is_err());
        assert!("conv".parse::<Layer>().is_err());
    }

    #[test]
    fn presets_validate_and_count_layers() {
        let count = |m: &HybridModel, f: fn(&Layer) -> bool| m.layers.iter().filter(|l| f(l)).count();
        for name in PRESETS {
            let m = preset(name).expect("preset");
            m.validate().expect("valid");
        }
        let q = preset("Qwen/Qwen3-Next-80B-A3B-Instruct").expect("qwen");
        assert_eq!((count(&q, |l| l.state.is_some()), count(&q, |l| l.attention.is_some())), (36, 12));
        let n = preset("nemotron-h-8b").expect("nemotron");
        assert_eq!(
            (n.layers.len(), count(&n, |l| l.state.is_some()), count(&n, |l| l.attention.is_some())),
            (52, 24, 4)
        );
        let g = preset("gemma-3-4b").expect("gemma");
        assert_eq!(count(&g, |l| l.attention == Some(AttnKind::Full)), 5);
        let f = preset("falcon-h1-7b").expect("falcon");
        assert_eq!(f.cache_layers().len(), 88);
        assert_eq!(f.cache_layers()[1].name, "model.44.mixer");
    }

    #[test]
    fn model_round_trips_through_json() {
        let m = preset("nemotron-h-8b").expect("preset");
        let text = serde_json::to_string(&m).expect("serialize");
        let back: HybridModel = serde_json::from_str(&text).expect("deserialize");
        assert_eq!(back, m);
    }

    #[test]
    fn inconsistent_models_are_refused() {
        let mut m = preset("jamba-v0.1").expect("preset");
        m.layers[0] = Layer::state(StateKind::Gdn);
        assert!(m.validate().is_err());
        m.state = None;
        assert!(m.validate().is_err());
        assert!(preset("llama-3").is_err());
    }
}
