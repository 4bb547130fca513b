//! The resolved run configuration: what `settings` produces from flags, config files and the
//! environment, and what `pipeline`, `serve`, `diagnose` and `report` read. Typed values only:
//! no clap, no environment, no parsing of user text. `settings` imports this and nothing that
//! runs, so a command's settings can be resolved (and tested) without starting anything.
//!
//! - [`worker`]: what every worker process of an engine starts with (transport, simulated
//!   prefill, verification), the part an engine sends its ranks.
//! - [`engine`]: what the worker engines of a run share, where each rank's KV pool lives, and
//!   the one builder of an engine's configuration.
//! - [`bench`]: a `kvx bench` run (workload, failure policy, fault, calibration, `--serve`).
//! - [`serve`]: the reference HTTP engine and proxy, and the connection limits both take.
//! - [`load`]: `kvx load` (targets, arrivals, objectives).
//! - [`xfer`] and [`probe`]: the link diagnostics.

#![forbid(unsafe_code)]

pub mod arrival;
pub mod bench;
pub mod calibrate;
pub mod engine;
pub mod layout;
pub mod load;
pub mod probe;
pub mod serve;
pub mod sweep;
pub mod worker;
pub mod xfer;
