//! The `kvx` binary: parse, run, map the outcome to an exit code.
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = kvx::cli::Cli::parse();
    match kvx::run(cli) {
        Ok(outcome) => outcome.into(),
        Err(err) => kvx::error::report_and_exit_code(&err),
    }
}
