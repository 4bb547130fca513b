//! A resolved `kvx layout` (and `kvx topo`) request: the engine to show and where its model
//! came from.

use crate::layouts::RankGeometry;
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::{EngineGeometry, HybridModel};

/// The engine `kvx layout` shows, resolved.
#[derive(Debug, Clone)]
#[expect(clippy::large_enum_variant, reason = "one value per command run, moved, never collected")]
pub enum EngineLayout {
    /// One rank of a uniform engine (a homogeneous pair's prefill side), with vLLM's names of
    /// its attention layers and the request the per-request figures are for.
    Uniform {
        pair: PairSpec,
        rank: u32,
        geom: RankGeometry,
        layer_names: Vec<String>,
        request_tokens: u32,
        origin: ModelOrigin,
    },
    /// A hybrid model's engine as vLLM 0.33 builds it, seen from one rank.
    Hybrid {
        model: HybridModel,
        tp: u32,
        rank: u32,
        num_blocks: u32,
        geom: EngineGeometry,
        origin: ModelOrigin,
    },
}

/// What a model was read as: its architecture (a config or preset) and the config fields it
/// left out, each with the architecture's default taken.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ModelOrigin {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    /// `[field, default]` pairs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub defaults: Vec<(String, String)>,
}
