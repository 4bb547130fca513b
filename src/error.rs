//! Errors shared by kvx's layers and the one mapping of a command's result to an exit code.
//!
//! Owns: [`ConfigError`] (a refused setting, with the flag or key to change), [`KnobError`]
//! (the core's refusal, with the [`Knob`] to change, which settings spells), the exit codes
//! ([`exit`]) and how an error is printed ([`render`]). Each layer has its own typed error
//! (`diagnose::xfer::XferError`, `pipeline::worker::WorkerError`, `report::ReportError`, ...);
//! the CLI joins them with `anyhow` and the binary calls [`finish`] once.
//!
//! Exit codes are API (also in `kvx --help` and the README):
//!
//! | code | meaning |
//! |---|---|
//! | 0 | ok: every request succeeded and verified; the gate passed; stdout closed by its reader (runs and the gate keep their verdict) |
//! | 1 | the run completed with failed, recomputed or unverified requests (or, under `--fault`, the failure policy did not hold); a gate regression |
//! | 2 | bad input, configuration or runtime error |
//! | 130, 143 | a run (bench, load, xfer) interrupted by SIGINT, SIGTERM |
//!
//! Servers (`serve-engine`, `serve-proxy`) exit 0 after a clean shutdown on SIGTERM or SIGINT
//! (what systemd and Kubernetes count as a normal stop), and 2 when they cannot go on (an
//! engine whose KV worker died exits at once, so a supervisor restarts it).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use crate::vocab::knob::Knob;

/// What a finished command asks the process to exit with ([`exit`] has the codes).
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

/// The exit codes of `kvx`.
pub mod exit {
    /// Everything succeeded (or stdout was closed by its reader).
    pub const OK: u8 = 0;
    /// A run completed with failures, or the gate found a regression.
    pub const FAILED: u8 = 1;
    /// Bad input, configuration or runtime error.
    pub const ERROR: u8 = 2;
    /// Interrupted by SIGINT (128 + 2).
    pub const INTERRUPTED: u8 = 130;
    /// Terminated by SIGTERM (128 + 15).
    pub const TERMINATED: u8 = 143;
}

/// The text of the exit codes for `--help`.
pub const EXIT_CODES_HELP: &str = "Exit status: 0 ok (every request succeeded and verified; gate passed); \
1 the run completed with failed or unverified requests, or the gate found a regression; \
2 bad input, configuration or runtime error; 130/143 a run interrupted (SIGINT/SIGTERM). \
Servers (serve-engine, serve-proxy) exit 0 after a clean shutdown on SIGTERM/SIGINT, and 2 when \
they cannot go on (an engine that lost one of its KV rank processes). \
A closed stdout (kvx ... | head) ends a command quietly: exit 0, or the run's or the gate's verdict.";

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

/// A value the core (`topology`, `layouts`) refuses, with the setting to change as a typed
/// [`Knob`]: the core never spells a flag. The message names the knob as settings spells it
/// (`Knob`'s `Display` is `settings::knobs`'), the same text a [`ConfigError`] for its flag has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (change {knob})")]
pub struct KnobError {
    /// The setting the user should change.
    pub knob: Knob,
    /// What is wrong and why (knobs in it written as `{knob}`, so spelled by settings too).
    pub reason: String,
}

impl KnobError {
    pub fn new(knob: Knob, reason: impl Into<String>) -> Self {
        Self { knob, reason: reason.into() }
    }
}

impl From<KnobError> for ConfigError {
    fn from(e: KnobError) -> Self {
        ConfigError::new(e.knob.to_string(), e.reason)
    }
}

/// An error whose message was already printed (by a child process on the shared stderr, or
/// to the peer that asked): exit 2 without printing it again.
#[derive(Debug, thiserror::Error)]
#[error("{0} (already reported)")]
pub struct AlreadyReported(pub String);

/// The signal that interrupted a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGINT (Ctrl-C): exit 130.
    Interrupt,
    /// SIGTERM: exit 143.
    Terminate,
}

impl Signal {
    /// `SIGINT` or `SIGTERM`.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Interrupt => "SIGINT",
            Signal::Terminate => "SIGTERM",
        }
    }
}

impl Outcome {
    /// The exit code this outcome asks for.
    pub fn exit_code(&self) -> u8 {
        match self {
            Outcome::Ok => exit::OK,
            Outcome::Failed(_) | Outcome::Regression => exit::FAILED,
            Outcome::Interrupted(Signal::Interrupt) => exit::INTERRUPTED,
            Outcome::Interrupted(Signal::Terminate) => exit::TERMINATED,
            Outcome::Exit(code) => *code,
        }
    }
}

impl From<Outcome> for ExitCode {
    fn from(o: Outcome) -> Self {
        ExitCode::from(o.exit_code())
    }
}

/// The exit code of a command's result, and what to print on stderr for it (`None`: nothing).
pub fn exit_code(result: &anyhow::Result<Outcome>) -> (u8, Option<String>) {
    match result {
        // The message starts with the command ("kvx bench: 3 of 20 requests failed ...").
        Ok(Outcome::Failed(why)) => (exit::FAILED, Some(why.clone())),
        Ok(Outcome::Interrupted(sig)) => {
            (Outcome::Interrupted(*sig).exit_code(), Some(format!("kvx: interrupted by {}", sig.name())))
        }
        Ok(o) => (o.exit_code(), None),
        Err(e) if crate::output::is_closed(e.as_ref()) => (exit::OK, None),
        Err(e) if e.chain().any(|c| c.is::<AlreadyReported>()) => (exit::ERROR, None),
        Err(e) => (exit::ERROR, Some(render(e))),
    }
}

/// Prints what a command's result calls for on stderr (once) and returns its exit code: the
/// one place where results become exit codes.
pub fn finish(result: anyhow::Result<Outcome>) -> ExitCode {
    ExitCode::from(finish_code(result))
}

/// [`finish`]'s exit code as a number (the binary hands it to `transfer::nixl::leave`).
pub fn finish_code(result: anyhow::Result<Outcome>) -> u8 {
    let (code, message) = exit_code(&result);
    if let Some(m) = message {
        crate::output::note!("{m}");
    }
    code
}

/// An error for a person: the cause first (the innermost kvx error, which names the flag or
/// file to change), then each outer context on its own line. A message that already embeds
/// its source is not repeated; a bare OS or parser error (which names nothing) is shown after
/// the message that says what it happened to.
pub fn render(err: &anyhow::Error) -> String {
    let chain: Vec<&(dyn std::error::Error + 'static)> = err.chain().collect();
    // Keep each message unless the one outside it already contains it.
    let mut kept: Vec<(String, bool)> = Vec::new();
    for (i, e) in chain.iter().enumerate() {
        let m = e.to_string();
        let embedded = i > 0 && chain[i - 1].to_string().contains(m.as_str());
        if !embedded && !m.is_empty() {
            kept.push((m, is_bare(*e)));
        }
    }
    // A bare leaf joins the message outside it: "cannot read x.json: No such file or directory".
    if kept.len() >= 2 && kept.last().is_some_and(|(_, bare)| *bare) {
        let (leaf, _) = kept.pop().unwrap_or_default();
        if let Some((outer, _)) = kept.last_mut() {
            *outer = format!("{outer}: {leaf}");
        }
    }
    let mut lines = kept.iter().rev().map(|(m, _)| m);
    let mut out = format!("error: {}", lines.next().map_or("unknown error", String::as_str));
    for context in lines {
        out.push_str(&format!("\n  while: {context}"));
    }
    out
}

/// Errors from std and parsers that say what went wrong but not with what.
fn is_bare(e: &(dyn std::error::Error + 'static)) -> bool {
    e.is::<std::io::Error>()
        || e.is::<serde_json::Error>()
        || e.is::<std::num::ParseIntError>()
        || e.is::<std::num::ParseFloatError>()
        || e.is::<zmq::Error>()
}

#[cfg(test)]
mod tests {
    use anyhow::Context as _;

    use super::*;

    #[test]
    fn the_cause_comes_first_and_context_follows() {
        let e: anyhow::Error = ConfigError::new("--p-tp", "must be at least 1").into();
        let e = e.context("resolving the bench settings");
        assert_eq!(
            render(&e),
            "error: must be at least 1 (change --p-tp)\n  while: resolving the bench settings"
        );
    }

    #[test]
    fn a_source_already_in_the_message_is_not_repeated() {
        #[derive(Debug, thiserror::Error)]
        #[error("control connection (read): {source}")]
        struct Outer {
            source: std::io::Error,
        }
        let e = anyhow::Error::from(Outer { source: std::io::Error::other("failed to fill whole buffer") });
        assert_eq!(render(&e), "error: control connection (read): failed to fill whole buffer");
    }

    #[test]
    fn a_bare_os_error_follows_the_message_that_names_the_file() {
        let e = anyhow::Error::from(crate::report::ReportError::Read {
            path: "x/summary.json".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })
        .context("cannot load run x");
        let text = render(&e);
        assert!(text.starts_with("error: cannot read x/summary.json: "), "{text}");
        assert!(text.ends_with("\n  while: cannot load run x"), "{text}");
    }

    #[test]
    fn exit_codes_are_api() {
        assert_eq!(exit_code(&Ok(Outcome::Ok)).0, 0);
        assert_eq!(exit_code(&Ok(Outcome::Regression)), (1, None));
        assert_eq!(exit_code(&Ok(Outcome::Failed("3 of 20 requests failed".into()))).0, 1);
        assert_eq!(exit_code(&Ok(Outcome::Interrupted(Signal::Interrupt))).0, 130);
        assert_eq!(exit_code(&Ok(Outcome::Interrupted(Signal::Terminate))).0, 143);
        assert_eq!(exit_code(&Err(anyhow::anyhow!("bad"))).0, 2);
        let closed: anyhow::Result<Outcome> =
            Err(crate::output::OutputError::Closed).context("printing the table");
        assert_eq!(exit_code(&closed), (0, None));
        let reported: anyhow::Result<Outcome> = Err(AlreadyReported("target failed".into()).into());
        assert_eq!(exit_code(&reported), (2, None));
    }
}
