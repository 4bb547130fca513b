//! Ctrl-C and SIGTERM for runs. The first SIGINT or SIGTERM asks the run to stop: it starts
//! no new work, lets what is in flight finish or gives up on it within a bounded time, tears
//! its workers down, writes and prints its partial results (marked partial) and exits 130 or
//! 143. A second signal ends the process at once with the same code.
//!
//! Owns the process's SIGINT and SIGTERM handlers (through signal-hook, which keeps the
//! handlers async-signal-safe: they only store to atomics). Runs poll [`requested`] at their
//! loop heads; nothing here does I/O. Processes that never [`arm`] keep the default actions
//! (the services install their own, through tokio).
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::error::Signal;

/// The signal that arrived first (0: none), and whether one did (what the handler that
/// ends the process on the second one checks).
struct State {
    signal: Arc<AtomicUsize>,
    pending: Arc<AtomicBool>,
}

/// The parent this process stops with ([`follow_parent`]; 0: none).
static PARENT: AtomicU32 = AtomicU32::new(0);

static STATE: OnceLock<State> = OnceLock::new();

/// Installs the handlers (once per process; later calls do nothing). Fails only when the OS
/// refuses a handler, which leaves the default action (the process ends at once).
pub fn arm() {
    STATE.get_or_init(|| {
        let state =
            State { signal: Arc::new(AtomicUsize::new(0)), pending: Arc::new(AtomicBool::new(false)) };
        for (sig, code) in [(SIGINT, 130), (SIGTERM, 143)] {
            // Registered before the flag is set, so it sees the flag as the previous signal
            // left it: the first signal passes, the second ends the process.
            let registered =
                signal_hook::flag::register_conditional_shutdown(sig, code, Arc::clone(&state.pending))
                    .and_then(|_| {
                        signal_hook::flag::register_usize(sig, Arc::clone(&state.signal), sig as usize)
                    })
                    .and_then(|_| signal_hook::flag::register(sig, Arc::clone(&state.pending)));
            if let Err(e) = registered {
                tracing::warn!("cannot handle signal {sig}: {e} (it will end kvx at once)");
            }
        }
        state
    });
}

/// Makes the run stop as if by SIGTERM when the process that started it ends. For a process
/// that a kvx process runs in a process group of its own (so that a terminal's signals reach
/// only the parent, which passes the first one on): should the parent be killed outright, its
/// child does not run on for the rest of its measurement.
pub fn follow_parent() {
    PARENT.store(std::os::unix::process::parent_id(), Ordering::SeqCst);
}

/// Makes a write past the file-size limit (`ulimit -f`) fail with EFBIG, as a write to a
/// full disk fails with ENOSPC, instead of ending kvx with SIGXFSZ: what a run measured is
/// then kept and said (see `report::files::RunWriter`). The handler only stores to an atomic.
pub fn survive_file_size_limit() {
    static EXCEEDED: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    let flag = Arc::clone(EXCEEDED.get_or_init(|| Arc::new(AtomicBool::new(false))));
    if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGXFSZ, flag) {
        tracing::debug!("cannot handle SIGXFSZ: {e}");
    }
}

/// The signal that asked the run to stop, if one did (a followed parent that ended reads as
/// SIGTERM).
pub fn requested() -> Option<Signal> {
    let sig = STATE.get()?.signal.load(Ordering::SeqCst);
    match sig {
        s if s == SIGINT as usize => Some(Signal::Interrupt),
        s if s == SIGTERM as usize => Some(Signal::Terminate),
        _ => match PARENT.load(Ordering::Relaxed) {
            0 => None,
            parent if parent != std::os::unix::process::parent_id() => Some(Signal::Terminate),
            _ => None,
        },
    }
}
