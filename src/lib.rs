//! kvx: a toolkit and benchmarking harness for KV-cache transfer in disaggregated
//! prefill/decode (P/D) LLM serving, following vLLM's NixlConnector semantics.
//!
//! # Layout
//!
//! Dependencies point down only, and no two files import each other (`tests/it/layering.rs`):
//!
//! ```text
//! bin/kvx.rs     parse args, call `kvx::run`, map the result to an exit code (`error::finish`)
//! clock.rs       CLOCK_MONOTONIC stamps every process of a host shares (wall spans); a run's
//!                wall-clock start
//! error.rs       ConfigError, exit codes (0 ok, 1 failed run or regression, 2 error, 130/143)
//! host.rs        the machine a run ran on (host, CPU, memory, OS), read from /proc
//! output.rs      the one place stdout and stderr are written; a closed stdout ends the run
//! cli/           one file per subcommand: its examples, the parsed flags handed to settings,
//!                the resolved run started and printed
//! settings/      one struct per command = clap flags + config-file keys; flags + config files
//!                + env (KVX_*) + defaults -> typed, validated settings (BenchSettings,
//!                ServeEngineSettings, XferRun, ...); model presets
//! diagnose/      commands that probe a host or a link: `kvx xfer` (control, target, buffers,
//!                measure), `kvx doctor`, `kvx probe`
//! serve/         reference engine, proxy and load generator (HTTP), `kvx bench --serve`
//! pipeline/      engines of worker processes, the worker process and its role loops, the
//!                control protocol (typed worker settings), the engine builder, `kvx bench`
//! report/        summaries, tables (bench, topo, plan, xfer), JSON/CSV/SVG export,
//!                comparison and gate
//! transfer/      moving bytes: memory, UCX (the only FFI), CUDA (cuda, cuda_batch), ZMQ
//!                handshake, notifications, shared storage
//! layouts/       KV layouts, regions, descriptor plans, byte patterns        (pure)
//! topology/      TP rank maps, P->D pairing, side-channel ports              (pure)
//! ```
//!
//! Nothing below `cli` imports `cli`; `settings` builds the values the layers below take and
//! none of them imports its resolution. `diagnose`, `serve` and `pipeline` are rooms above the
//! transports: `diagnose` may use `transfer`, `layouts`, `topology`, `report` and the leaves,
//! and nothing but `cli` and `settings` import it (what `pipeline` shares with `kvx xfer` lives below both, in
//! `report::xfer` and `transfer`). `settings::model`, `settings::env`, `clock`, `host`, `error`
//! and `output` are leaves every layer may use. `topology` and `layouts` use nothing of kvx but
//! each other and those leaves; `report` never measures, never runs transfers and reads nothing
//! from the system. `unsafe` lives only in `transfer::ucx` and the transfer layer's memory and
//! CUDA modules (`cuda`, `cuda_batch`); every other module is declared (or declares itself)
//! `forbid(unsafe_code)`, and `tests/it/edge.rs` checks the sources.

#![deny(clippy::print_stdout, clippy::print_stderr)]

// Only `transfer` (its UCX binding and memory modules) may hold `unsafe`; every other module
// forbids it, which no inner `allow` can undo.
#[forbid(unsafe_code)]
pub mod cli;
#[forbid(unsafe_code)]
pub mod clock;
#[forbid(unsafe_code)]
pub mod diagnose;
pub mod error;
#[forbid(unsafe_code)]
pub mod host;
pub mod interrupt;
#[forbid(unsafe_code)]
pub mod layouts;
pub mod output;
#[forbid(unsafe_code)]
pub mod pipeline;
#[forbid(unsafe_code)]
pub mod report;
#[forbid(unsafe_code)]
pub mod serve;
#[forbid(unsafe_code)]
pub mod settings;
#[forbid(unsafe_code)]
pub mod topology;
pub mod transfer;
#[forbid(unsafe_code)]
pub mod vocab;

pub use error::{Outcome, Signal};
