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

pub use error::Signal;

/// What a finished command asks the process to exit with (`error::exit` has the codes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0: every request succeeded and verified, or the gate passed.
    Ok,
    /// Exit 1: the run completed, but some requests failed, were recomputed or did not verify
    /// (or, under `--fault`, the failure policy did not hold). Says how many and why, starting
    /// with the command (`kvx bench: 3 of 20 requests failed ...`); printed on stderr as is.
    Failed(String),
    /// Exit 1: a performance gate found a regression.
    Regression,
    /// Exit 130 (SIGINT) or 143 (SIGTERM): the run was interrupted.
    Interrupted(Signal),
    /// Exit with the status of a kvx process that ran in this one's place (`kvx xfer`
    /// re-runs itself to record UCX's protocols); it printed its own error.
    Exit(u8),
}

impl Outcome {
    /// The outcome of a run from what its summary counted: [`Outcome::Failed`] with the counts
    /// and causes when the run was not clean (`report::verdict` has the rule), else `Ok`.
    pub fn of_run(what: &str, summary: &report::Summary) -> Outcome {
        match report::verdict::problems(summary) {
            None => Outcome::Ok,
            Some(why) => Outcome::Failed(format!("{what}: {why}")),
        }
    }
}

/// Runs one parsed command line.
pub fn run(cli: cli::Cli) -> anyhow::Result<Outcome> {
    init_logging(cli.command.log_default());
    cli::dispatch(cli)
}

/// Warnings and errors of kvx (and of its workers, which the engines forward) on stderr;
/// `KVX_LOG` sets the filter, e.g. `kvx=debug`. Long-running services (`serve-engine`,
/// `serve-proxy`) default to `kvx=info` with timestamps, everything else to `kvx=warn`.
/// The first call wins.
pub fn init_logging(default: LogDefault) {
    let fallback = match default {
        LogDefault::Command => "kvx=warn",
        LogDefault::Service => "kvx=info",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env(settings::env::KVX_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_target(false)
        .with_writer(std::io::stderr);
    let _ = match default {
        LogDefault::Command => builder.without_time().try_init(),
        LogDefault::Service => builder.try_init(),
    };
}

/// Which logging a command starts with when `KVX_LOG` is not set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogDefault {
    /// A command that runs and ends: warnings and errors, no timestamps.
    Command,
    /// A long-running service: info and above, with timestamps.
    Service,
}
