//! The one place kvx writes a command's output: results on stdout, notes on stderr.
//!
//! Owns: how a write to stdout or stderr fails. A closed stdout (the reader of a pipe went
//! away, as in `kvx plan ... | head -c 100`) is the end of the run, not an error: stdout writes
//! return [`OutputError::Closed`], callers propagate it with `?` and stop working, and the binary
//! exits 0 without a message (see `error::exit_code`). A command whose exit code carries a
//! verdict (`kvx gate`; a run that may exit 1 for failed requests) passes its write through
//! [`keep_verdict`] instead, so the verdict survives a closed stdout. Any other write failure
//! (a full disk behind a redirect) is an error, exit 2.
//!
//! stderr writes never fail and never panic: a note nobody can read is dropped. `println!`,
//! `print!` and `eprintln!` are denied crate-wide (clippy `print_stdout`/`print_stderr`),
//! because std's macros panic when the stream is closed.
//!
//! Must not know about commands or formats: callers render into a string first, then write
//! it here in one call.
#![forbid(unsafe_code)]

use std::fmt;
use std::io::{self, Write as _};

/// Writing to stdout failed.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The reader went away (EPIPE): the run ends quietly with exit 0.
    #[error("stdout was closed by its reader")]
    Closed,
    /// Any other failure, e.g. a full disk behind `> file`.
    #[error("cannot write to stdout: {0}")]
    Write(#[source] io::Error),
}

impl OutputError {
    fn from_io(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::BrokenPipe { OutputError::Closed } else { OutputError::Write(e) }
    }
}

/// Writes `bytes` to stdout and flushes.
pub fn stdout(bytes: impl AsRef<[u8]>) -> Result<(), OutputError> {
    let mut out = io::stdout().lock();
    out.write_all(bytes.as_ref()).and_then(|()| out.flush()).map_err(OutputError::from_io)
}

/// For a command whose exit code is a verdict (a run's failed requests, the gate's
/// regression): a closed stdout is not an error, so the verdict still reaches the exit code.
pub fn keep_verdict(r: Result<(), OutputError>) -> Result<(), OutputError> {
    match r {
        Err(OutputError::Closed) => Ok(()),
        other => other,
    }
}

/// Writes `text` and a newline to stdout and flushes.
pub fn stdout_line(text: impl fmt::Display) -> Result<(), OutputError> {
    stdout(format!("{text}\n"))
}

/// Writes `value` as pretty JSON and a newline to stdout.
pub fn stdout_json(value: &impl serde::Serialize) -> Result<(), OutputError> {
    let mut text =
        serde_json::to_string_pretty(value).map_err(|e| OutputError::Write(io::Error::other(e)))?;
    text.push('\n');
    stdout(text)
}

/// Writes one line to stderr; never fails, never panics.
pub fn stderr_line(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// Writes `bytes` as they are to stderr (a child's forwarded lines); never fails, never panics.
pub fn stderr_bytes(bytes: &[u8]) {
    let _ = io::stderr().lock().write_all(bytes);
}

/// `note!("...", args)`: one line on stderr that never panics (use instead of `eprintln!`).
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::output::stderr_line(format_args!($($arg)*))
    };
}
pub(crate) use note;

/// Whether `err` (an error chain) says that stdout was closed by its reader.
pub fn is_closed(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if matches!(e.downcast_ref::<OutputError>(), Some(OutputError::Closed)) {
            return true;
        }
        if e.downcast_ref::<io::Error>().is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe) {
            return true;
        }
        cur = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broken_pipe_is_closed_and_other_errors_are_not() {
        assert!(matches!(
            OutputError::from_io(io::Error::from(io::ErrorKind::BrokenPipe)),
            OutputError::Closed
        ));
        assert!(matches!(OutputError::from_io(io::Error::other("disk full")), OutputError::Write(_)));
    }

    #[test]
    fn closed_is_found_anywhere_in_a_chain() {
        let e = anyhow::Error::from(OutputError::Closed).context("printing the plan");
        assert!(is_closed(e.as_ref()));
        let e = anyhow::Error::from(io::Error::from(io::ErrorKind::BrokenPipe)).context("x");
        assert!(is_closed(e.as_ref()));
        let e = anyhow::anyhow!("something else");
        assert!(!is_closed(e.as_ref()));
    }
}
