//! The `kvx` binary: parse, run, map the result to an exit code (`kvx::error::finish_code`).
#![forbid(unsafe_code)]
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = kvx::cli::Cli::parse();
    let code = kvx::error::finish_code(kvx::cli::run(cli));
    // A process that loaded NIXL ends without running the libraries' finalizers (see there).
    kvx::transfer::nixl::leave(code);
    ExitCode::from(code)
}
