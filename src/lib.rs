//! kvx: a toolkit and benchmarking harness for KV-cache transfer in disaggregated
//! prefill/decode (P/D) LLM serving, following vLLM's NixlConnector semantics.
//!
//! # Layout
//!
//! Dependencies point down only:
//!
//! ```text
//! bin/kvx.rs     parse args, call `kvx::run`, map the error to an exit code
//! cli/           clap types and help text, one file per subcommand
//! settings/      env names (KVX_*), model presets, resolve(cli, file, env) -> validated settings
//! topology/      TP rank maps, P->D pairing, side-channel ports              (pure)
//! layouts/       KV layouts, regions, descriptor plans, byte patterns        (pure)
//! transfer/      memory, UCX (the only FFI), ZMQ handshake, xfer/probe/doctor
//! pipeline/      P and D workers, request lifecycle, `kvx bench`
//! serve/         reference engine, proxy and load generator (HTTP)
//! report/        summaries, tables, JSON/CSV/SVG export, comparison and gate
//! ```
//!
//! `topology` and `layouts` use nothing of kvx but each other and `settings::model`;
//! `report` never measures and never runs transfers.

pub mod cli;
pub mod error;
pub mod layouts;
pub mod pipeline;
pub mod report;
pub mod serve;
pub mod settings;
pub mod topology;
pub mod transfer;

pub use error::{Error, Result};

use std::process::ExitCode;

/// What a finished command asks the process to exit with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0.
    Ok,
    /// Exit 1: a performance gate found a regression.
    Regression,
}

impl From<Outcome> for ExitCode {
    fn from(o: Outcome) -> Self {
        match o {
            Outcome::Ok => ExitCode::SUCCESS,
            Outcome::Regression => ExitCode::from(1),
        }
    }
}

/// Runs one parsed command line.
pub fn run(cli: cli::Cli) -> anyhow::Result<Outcome> {
    // Long-running services log their state changes (a backend down or back, workers up).
    let serving = matches!(cli.command, cli::Command::ServeEngine(_) | cli::Command::ServeProxy(_));
    init_logging_with(if serving { "kvx=info" } else { "kvx=warn" });
    cli::dispatch(cli)
}

/// Warnings and errors of kvx (and of its workers, which the engines forward) on stderr;
/// `KVX_LOG` sets the filter, e.g. `kvx=debug`.
pub fn init_logging() {
    init_logging_with("kvx=warn");
}

/// [`init_logging`] with another default filter (used when `KVX_LOG` is unset).
pub fn init_logging_with(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env(settings::env::KVX_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_target(false)
        .without_time()
        .with_writer(std::io::stderr)
        .try_init();
}
