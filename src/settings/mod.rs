//! Settings: what the user asked for, resolved once into typed, validated values before any
//! work starts. Flags (as plain data, [`flags`]; `cli` parses them), bench-config files,
//! the environment ([`env`](mod@env): every `KVX_*` variable) and defaults meet here, with the
//! precedence defaults < config file < environment < flags; every cross-flag check lives here
//! and its error names the flag, or the config key and file, to change.
//!
//! - [`model`]: model shapes (presets, Hugging Face configs); a leaf `topology` and `layouts` use.
//! - [`scenario`]: model and engine-pair flags into a `PairSpec`; `kvx plan --scenario` files.
//! - [`bench`](mod@bench): `kvx bench`'s flags and config file into `BenchSettings`; [`sweep`]: the
//!   points of `--sweep`; [`plan`]: which of them a command line asks for, all resolved.
//! - [`engine`]: `WorkerSettings` and the one builder of worker engines (bench, bench --serve,
//!   serve-engine), memory placement, `kvx serve-engine`'s settings.
//! - [`layer`]: one struct per command's settings (flags and file keys), the flags laid over
//!   the file remembering which gave each value.
//! - [`parse`]: value syntaxes flags and files share (durations, named choices).
//! - [`posting`]: `kvx plan`'s measured posting costs and ceilings (`--post-ns`, `--ceiling-gbps`).
//!
//! May use every layer below `cli` to build the values those layers take; must not import
//! `cli` and must not run anything.

pub mod bench;
pub mod engine;
pub mod env;
pub mod flags;
pub mod layer;
pub mod layout;
pub mod load;
pub mod model;
pub mod parse;
pub mod plan;
pub mod posting;
pub mod probe;
pub mod proxy;
pub mod scenario;
pub mod sweep;
pub mod xfer;
