//! One clock for the processes of a host: `CLOCK_MONOTONIC`, and the boot it counts from; and
//! the wall-clock time a run's summary is stamped with ([`now_rfc3339`]).
//!
//! `Instant` reads the same clock on Linux but hides its value, so a time taken in one worker
//! process cannot be set beside another's. A request read by several ranks has a wall span
//! (the first rank's start to the last rank's end) that only such a shared clock can give:
//! each rank stamps its transfer with [`ClockSpan`], and [`wall_span_ns`] joins the stamps of
//! ranks on one clock and refuses those of ranks on several (other hosts, other boots).
//!
//! A leaf: it uses nothing of kvx. Reading the clock is a syscall, not I/O on the environment.

#![forbid(unsafe_code)]

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Nanoseconds on this host's `CLOCK_MONOTONIC`.
pub fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec.max(0) as u64)
}

/// The current wall-clock time as RFC 3339 (UTC, seconds), for a run's `started_at`.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Which clock [`now_ns`] reads: a hash of this boot's id (`/proc/sys/kernel/random/boot_id`),
/// the same in every process of the host until it reboots. 0 where it cannot be read: such
/// stamps are never joined with others.
pub fn domain() -> u64 {
    static DOMAIN: OnceLock<u64> = OnceLock::new();
    *DOMAIN.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map_or(0, |id| hash(id.trim()))
    })
}

/// Never 0 (0 marks an unknown clock).
fn hash(id: &str) -> u64 {
    use sha2::Digest as _;
    let d = sha2::Sha256::digest(id.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b) | 1
}

/// When a piece of work ran, on one host's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockSpan {
    /// The clock's [`domain`]; spans of different domains cannot be compared.
    pub domain: u64,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl ClockSpan {
    /// From `start_ns` (taken with [`now_ns`]) to now.
    pub fn since(start_ns: u64) -> ClockSpan {
        ClockSpan { domain: domain(), start_ns, end_ns: now_ns().max(start_ns) }
    }

    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }

    /// The smallest span holding both (a rank that writes in several pieces).
    pub fn cover(a: Option<ClockSpan>, b: ClockSpan) -> Option<ClockSpan> {
        match a {
            None => Some(b),
            Some(a) if a.domain == b.domain => Some(ClockSpan {
                domain: a.domain,
                start_ns: a.start_ns.min(b.start_ns),
                end_ns: a.end_ns.max(b.end_ns),
            }),
            // Not comparable: keep the first (a rank's pieces are all on its own clock).
            Some(a) => Some(a),
        }
    }
}

/// The wall span of work done in parts: the first start to the last end. `None` when there is
/// no part, a part has no stamp, or the parts are on different clocks (ranks on several
/// hosts): then only each part's own time can be reported.
pub fn wall_span_ns(spans: impl IntoIterator<Item = Option<ClockSpan>>) -> Option<u64> {
    let mut joined: Option<ClockSpan> = None;
    for s in spans {
        let s = s?;
        if s.domain == 0 {
            return None;
        }
        joined = match joined {
            None => Some(s),
            Some(j) if j.domain == s.domain => ClockSpan::cover(Some(j), s),
            Some(_) => return None,
        };
    }
    joined.map(|j| j.duration_ns())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(domain: u64, start_ns: u64, end_ns: u64) -> Option<ClockSpan> {
        Some(ClockSpan { domain, start_ns, end_ns })
    }

    #[test]
    fn the_wall_span_runs_from_the_first_start_to_the_last_end() {
        // Overlapping ranks: the span is a little longer than the slowest alone.
        assert_eq!(wall_span_ns([span(7, 100, 300), span(7, 150, 320)]), Some(220));
        // Ranks one after the other: the span is their sum, not the slower one's time.
        assert_eq!(wall_span_ns([span(7, 0, 100), span(7, 100, 200)]), Some(200));
    }

    #[test]
    fn spans_on_several_clocks_or_without_a_stamp_have_no_wall_span() {
        assert_eq!(wall_span_ns([span(7, 0, 100), span(8, 0, 100)]), None);
        assert_eq!(wall_span_ns([span(7, 0, 100), None]), None);
        assert_eq!(wall_span_ns([span(0, 0, 100)]), None);
        assert_eq!(wall_span_ns(std::iter::empty()), None);
    }

    #[test]
    fn the_clock_moves_forward_and_names_this_boot() {
        let a = now_ns();
        let s = ClockSpan::since(a);
        assert!(s.end_ns >= a);
        assert_eq!(s.domain, domain());
        assert_ne!(domain(), 0, "boot_id is readable on Linux");
    }
}
