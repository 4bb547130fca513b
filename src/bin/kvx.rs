//! The `kvx` binary: parse, run, map the result to an exit code (`kvx::error::finish`).
#![forbid(unsafe_code)]
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = kvx::cli::Cli::parse();
    kvx::error::finish(kvx::cli::run(cli))
}
