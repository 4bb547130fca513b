//! The error type shared by kvx's library code and the mapping of errors to exit codes.
//!
//! Exit codes are API: 0 ok, 1 performance regression (only `kvx gate`), 2 for usage,
//! configuration and runtime errors. A broken pipe on stdout exits quietly with 0.

use std::process::ExitCode;

/// A configuration the user asked for that kvx refuses, with the flag to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (change {flag})")]
pub struct ConfigError {
    /// The flag or config field the user should change, e.g. `--p-tp`.
    pub flag: String,
    /// What is wrong and why.
    pub reason: String,
}

impl ConfigError {
    pub fn new(flag: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { flag: flag.into(), reason: reason.into() }
    }
}

/// Library-wide error type. Subsystems with richer errors convert into `Other`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Prints the error chain once on stderr and returns the exit code for it.
pub fn report_and_exit_code(err: &anyhow::Error) -> ExitCode {
    if is_broken_pipe(err) {
        return ExitCode::SUCCESS;
    }
    let mut msg = format!("error: {err}");
    for cause in err.chain().skip(1) {
        msg.push_str(&format!("\n  caused by: {cause}"));
    }
    eprintln!("{msg}");
    ExitCode::from(2)
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
