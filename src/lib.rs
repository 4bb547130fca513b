//! kvx: a toolkit and benchmarking harness for KV-cache transfer in disaggregated
//! prefill/decode (P/D) LLM serving, following vLLM's NixlConnector semantics.
//!
//! # Layout
//!
//! Floors: a file imports its own folder and the floors below, never above, and no two files
//! import each other (`tests/it/layering.rs` checks both). Highest first:
//!
//! ```text
//! bin/kvx.rs     parse args, call `kvx::cli::run`, map the outcome to an exit code
//! cli/           one file per subcommand: its examples, the parsed flags handed to settings,
//!                the resolved run started and printed
//! settings/      one clap definition per setting (shared groups in flags.rs) + config-file
//!                keys; flags + config files + the environment (env.rs: KVX_*, a launcher's
//!                rank) + defaults -> config/'s typed values; imports nothing that runs
//!                the flag of each knob the core names (knobs.rs), clap for its enums (choices.rs)
//! serve/         reference engine (http_engine), proxy and load generator (HTTP), bench --serve
//! diagnose/      commands that probe a host or a link: `kvx xfer` (control, target, buffers,
//!                measure), `kvx doctor`, `kvx probe`
//! pipeline/      by process: engine/ (an engine of ranks, its pool), worker/ (the worker
//!                process, its role loops, cuda-batch, plumbing), bench/ (driver, workload,
//!                sweep, compare); wire (engine-worker messages), params
//! report/        summaries, tables (bench, topo, plan, xfer), JSON/CSV/SVG export, the
//!                run's verdict, comparison and gate
//! config/        the resolved run configuration (worker, engine, bench, serve, load, xfer,
//!                probe, sweep, layout): typed, no clap, no environment
//! transfer/      moving bytes: memory, UCX (the only FFI), CUDA (cuda, cuda_batch), ZMQ
//!                handshake, notifications, shared storage
//! layouts/       KV layouts, regions, descriptor plans, hybrid groups, byte patterns   (pure,
//!                no flag names: typed knobs, vocab::knob)
//! topology/      TP rank maps, P->D pairing, side-channel ports                       (pure)
//! ground floor   vocab/ (model shapes, dtypes, kinds of role/verify/transport/memory,
//!                knobs a core rule asks the user to change, KVX_* names), error.rs (typed errors, Outcome, exit codes), output.rs
//!                (stdout; a closed stdout ends the run quietly), interrupt.rs (Ctrl-C),
//!                clock.rs (CLOCK_MONOTONIC stamps every process of a host shares), host.rs
//!                (the machine a run ran on, read from /proc), input.rs (files a user names,
//!                read with a bound)
//! ```
//!
//! `report` never measures, never runs transfers and reads nothing from the system. `unsafe`
//! lives only in `transfer::ucx`, `transfer::nixl` and the transfer layer's memory and CUDA modules (`cuda`,
//! `cuda_batch`); every other module is declared (or declares itself) `forbid(unsafe_code)`,
//! and `tests/it/edge.rs` checks the sources.

#![deny(clippy::print_stdout, clippy::print_stderr)]

// Only `transfer` (its UCX and NIXL bindings and memory modules) may hold `unsafe`; every other module
// forbids it in its own root file (`#![forbid(unsafe_code)]`), which no inner `allow` can undo.
pub mod cli;
pub mod clock;
pub mod config;
pub mod diagnose;
pub mod error;
pub mod host;
pub mod input;
pub mod interrupt;
pub mod layouts;
pub mod output;
pub mod pipeline;
pub mod report;
pub mod serve;
pub mod settings;
pub mod topology;
pub mod transfer;
pub mod vocab;

pub use error::{Outcome, Signal};
