//! Hybrid models in the planning core: attention KV beside Mamba/GDN state, sliding windows
//! and HMA groups, host-buffer regions, as vLLM 0.33's NixlConnector (pull) handles them.
//!
//! Owns: the model description (`model`), the cache geometry of an engine (`geometry`: groups,
//! aligned block size, padded page, state layout per TP rank, regions), which blocks move
//! (`blocks`), the READs each decode rank posts (`descriptors`), vLLM's refusals and kvx's own
//! errors (`error`), and a byte-meaning check of plans (`coverage`). Pure arithmetic over plain
//! data; it must not do I/O, read the environment or know the CLI. The uniform (attention-only,
//! one group) planner stays in `layouts::plan`.

pub mod blocks;
pub mod coverage;
pub mod descriptors;
pub mod error;
pub mod geometry;
pub mod model;

pub use descriptors::{HybridPlan, HybridPlanner, HybridRequest, PairConfig};
pub use error::{HybridError, Refusal, RefusalKind};
pub use geometry::{EngineConfig, EngineGeometry, GdnPrefillBackend, KvBufferDevice};
pub use model::{HybridModel, preset};
