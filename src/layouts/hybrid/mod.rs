//! Hybrid models in the planning core: attention KV beside Mamba/GDN state, sliding windows
//! and HMA groups, host-buffer regions, as vLLM 0.33's NixlConnector (pull) handles them.
//!
//! Owns: what a hybrid model caches (`model`, with presets), an engine's cache as vLLM builds
//! it (`geometry`: KV cache groups, the hybrid-aligned block size and padded page, the state
//! layout of a TP rank, regions and registrations, device-aliased or per layer in a host
//! buffer), which blocks of a request move (`blocks`), the READs every decode rank posts and
//! where vLLM's rules move the wrong bytes (`descriptors`), vLLM's refusals and kvx's own errors
//! (`error`), a byte-meaning check of a plan (`coverage`), and the host-buffer copies as byte
//! moves (`staging`).
//!
//! Pure arithmetic over plain data: no I/O, no environment, no CLI. Attention-only models with
//! one group stay with `layouts::plan`; this module takes every model with more than one KV
//! cache group or with state, and reproduces `../shared/oracle/hybrid_v033.json`.
//!
//! Use: build a [`PairConfig`] (a [`HybridModel`], e.g. from [`preset`], and an
//! [`HybridEngine`] per side), [`HybridPlanner::new`] it (vLLM's handshake: geometry, TP mapping,
//! descriptor lists, or a [`Refusal`]), then [`HybridPlanner::plan`] each [`HybridRequest`].

pub mod blocks;
pub mod coverage;
pub mod descriptors;
pub mod error;
pub mod geometry;
pub mod model;
pub mod push;
pub mod staging;

pub use crate::layouts::model_config::hybrid_preset as preset;
pub use descriptors::{
    Finding, GeometryDifference, GeometrySource, HybridPlan, HybridPlanner, HybridRequest, PairConfig,
    StateSlices, StatedPair,
};
pub use error::{HybridError, Refusal, RefusalKind};
pub use geometry::{
    AttentionBackend, EngineGeometry, GdnPrefillBackend, HybridEngine, KvBufferDevice, StateShapes,
    StatedEngine,
};
pub use model::HybridModel;
