//! Hybrid models in the planning core: attention KV beside Mamba/GDN state, sliding windows
//! and HMA groups, host-buffer regions, as vLLM 0.33's NixlConnector (pull) handles them.
//!
//! Owns: what a hybrid model caches (`model`, with presets), an engine's cache as vLLM builds
//! it (`geometry`: KV cache groups, the hybrid-aligned block size and padded page, the state
//! layout of a TP rank, regions and registrations, device-aliased or per layer in a host
//! buffer), which blocks of a request move (`blocks`), a pair of engines and vLLM's refusals of
//! it (`pair`), which prefill ranks each decode rank reads (`tp_map`), the descriptor lists a
//! rank registers (`desc_lists`), a READ's pairs and the runs that make them fast (`runs`), the
//! READs every decode rank posts for a request (`planner`), where vLLM's rules move the wrong
//! bytes (`findings`), vLLM's refusals and kvx's own errors (`error`), a byte-meaning check of
//! a plan (`coverage`), push mode's WRITEs (`push`), and the host-buffer copies as byte moves
//! (`staging`).
//!
//! Pure arithmetic over plain data: no I/O, no environment, no CLI. Attention-only models with
//! one group stay with `layouts::read_plan`; this module takes every model with more than one KV
//! cache group or with state, and reproduces `../shared/oracle/hybrid_v033.json`.
//!
//! Use: build a [`HybridPairSpec`] (a [`HybridModel`], e.g. from [`preset`], and a
//! [`HybridEngineSpec`] per side: the hybrid counterparts of `layouts`' `PairSpec` and
//! `EngineSpec`), [`HybridPlanner::new`] it (vLLM's handshake: geometry, TP mapping, descriptor
//! lists, or a [`Refusal`]), then [`HybridPlanner::plan`] each [`HybridRequest`].

pub mod blocks;
pub mod coverage;
pub mod desc_lists;
pub mod error;
pub mod findings;
pub mod geometry;
pub mod model;
pub mod pair;
pub mod planner;
pub mod runs;
pub mod staging;
pub mod tp_map;
pub mod write_plan;

pub use crate::layouts::model_config::hybrid_preset as preset;
pub use desc_lists::{DescList, DescRow, RowKind, RowLabel};
pub use error::{HybridError, Refusal, RefusalKind};
pub use findings::Finding;
pub use geometry::{
    AttentionBackend, EngineGeometry, GdnPrefillBackend, HybridEngineSpec, KvBufferDevice, StateShapes,
    StatedEngine,
};
pub use model::HybridModel;
pub use pair::{
    GeometryDifference, GeometrySource, HostCopyRule, HostDescriptors, HostStatePage, HybridPairSpec,
    PushAttention, StateSlices, StatedPair, compare_stated,
};
pub use planner::{DRankPlan, DRankSetup, GroupClipping, HostCopy, HybridPlan, HybridPlanner, HybridRequest};
pub use runs::{HybridRead, LabeledPair, PairRun};
pub use tp_map::{TpMapping, handshake_ranks, tp_mapping, tp_ratio};
