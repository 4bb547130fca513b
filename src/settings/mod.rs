//! Settings: what the user asked for, resolved once into typed, validated values before any
//! work starts. Each command's settings are one struct that is both its clap arguments and,
//! for `kvx bench`, the shape of its config file ([`layer`]); `cli` parses them and hands them
//! over. Flags, bench-config files, the environment ([`env`](mod@env): every `KVX_*` variable)
//! and defaults meet here, with the precedence defaults < config file < environment < flags.
//! Every choice is an enum from parsing on; every cross-setting check lives here, once, and its
//! error names the flag, or the config key and file, to change.
//!
//! - [`layer`]: one struct per command (flags and file keys), the flags laid over the file
//!   remembering which gave each value; [`flags`]: the groups several commands share (model,
//!   engine pair, ports) and the output format.
//! - [`model`]: model shapes (presets, Hugging Face configs); a leaf `topology` and `layouts` use.
//! - [`scenario`]: model and engine-pair flags into a `PairSpec`; `kvx plan --scenario` files.
//! - [`hybrid_flags`]: the hybrid model the flags name and its engines (`kvx plan`, `topo`,
//!   `bench`); [`hybrid_case`]: `kvx plan --scenario` cases of vLLM's hybrid oracle.
//! - [`bench`](mod@bench): `kvx bench`'s settings into `BenchSettings`; [`sweep`]: the points of
//!   `--sweep`; [`plan`]: which of them a command line asks for, all resolved (and `kvx plan`'s
//!   flags).
//! - [`engine`]: memory placement, the transport rules, `kvx serve-engine`'s settings.
//! - [`xfer`], [`load`], [`proxy`], [`probe`], [`layout`](mod@layout), [`topo`]: the flags of
//!   `kvx xfer`, `kvx load`, `kvx serve-proxy`, `kvx probe`, `kvx layout` and `kvx topo`, checked.
//! - [`parse`]: value syntaxes flags and files share (durations, sizes, named choices).
//! - [`posting`]: `kvx plan`'s measured posting costs and ceilings (`--post-ns`, `--ceiling-gbps`).
//! - [`knobs`]: the flag each of the core's knobs is (the core refuses with a `Knob`, never a
//!   flag); [`choices`]: the core's enums as clap values (the core has no clap).
//!
//! May use every layer below `cli` to build the values those layers take; must not import
//! `cli` and must not run anything.

#![forbid(unsafe_code)]

pub mod bench;
pub mod calibrate;
pub mod choices;
pub mod env;
pub mod flags;
pub mod hybrid_case;
pub mod hybrid_flags;
pub mod knobs;
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
pub mod topo;
pub mod workers;
pub mod xfer;
