//! Whether a finished run was clean: the rule behind exit code 1 of `kvx bench`, `bench
//! --serve`, sweeps, comparisons and `kvx load`, read from the summary's counters alone.
//!
//! Without a fault, a run is clean when no request failed, none was recomputed after a failed
//! load (its KV bytes were never read, so never verified), no read failed verification and no
//! block leaked. With `--fault`, failures are expected, but only for requests the fault
//! touched: the pipeline counts, in [`FAILURES_AFTER_FAULT`], the requests that finished after
//! the fault was injected and failed (or were recomputed) with a cause a lost peer produces
//! (`peer_gone`, `transfer`, `timeout`, `handshake`, `notify`). The run is clean when every
//! failure is one of those, no read returned wrong bytes, and no block leaked.

use super::Summary;
use crate::error::Outcome;

/// Counter: 1 when a `--fault` was injected during the run (summed over sweep points).
pub const FAULT_INJECTED: &str = "fault_injected";
/// Counter: failed or recomputed requests the injected fault explains (see the module doc).
pub const FAILURES_AFTER_FAULT: &str = "failures_after_fault";

/// Failure causes a killed or lost peer produces; any other cause is never the fault's doing.
pub const FAULT_CAUSES: &[&str] = &["peer_gone", "transfer", "timeout", "handshake", "notify"];

/// The outcome of a run from what its summary counted: [`Outcome::Failed`] with the counts
/// and causes when the run was not clean ([`problems`] has the rule), else `Ok`.
pub fn outcome(what: &str, summary: &Summary) -> Outcome {
    match problems(summary) {
        None => Outcome::Ok,
        Some(why) => Outcome::Failed(format!("{what}: {why}")),
    }
}

/// What makes the run unclean, in one line (`None`: clean).
pub fn problems(s: &Summary) -> Option<String> {
    let total = s.requests_total();
    let not_ok = s.requests_failed + s.requests_recomputed;
    let faulted = s.counters.get(FAULT_INJECTED).copied().unwrap_or(0) > 0;
    let mut why = Vec::new();
    if faulted {
        let expected = s.counters.get(FAILURES_AFTER_FAULT).copied().unwrap_or(0).min(not_ok);
        let unexplained = not_ok - expected;
        if unexplained > 0 {
            why.push(format!(
                "the failure policy did not hold: {unexplained} of {total} requests failed that the \
                 injected fault does not explain ({expected} after the fault are expected)"
            ));
        }
    } else {
        if s.requests_failed > 0 {
            why.push(format!("{} of {total} requests failed", s.requests_failed));
        }
        if s.requests_recomputed > 0 {
            why.push(format!(
                "{} of {total} requests were recomputed after a failed load (their KV bytes were not read)",
                s.requests_recomputed
            ));
        }
    }
    if s.verify_failures > 0 {
        why.push(format!("{} reads returned wrong bytes (verification failed)", s.verify_failures));
    }
    if s.blocks_leaked > 0 {
        why.push(format!("{} KV blocks leaked", s.blocks_leaked));
    }
    if why.is_empty() {
        return None;
    }
    let mut line = why.join("; ");
    if !s.failures_by_cause.is_empty() {
        let causes: Vec<String> = s.failures_by_cause.iter().map(|(k, v)| format!("{k} {v}")).collect();
        line.push_str(&format!(" (causes: {})", causes.join(", ")));
    }
    Some(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Scenario;

    fn summary() -> Summary {
        let mut s = Summary::new("r", "2025-01-01T00:00:00Z", Scenario::default());
        s.requests_ok = 20;
        s
    }

    #[test]
    fn a_clean_run_has_no_problem() {
        assert_eq!(problems(&summary()), None);
    }

    #[test]
    fn failures_recomputes_wrong_bytes_and_leaks_each_fail_a_run() {
        let mut s = summary();
        s.requests_failed = 3;
        s.failures_by_cause.insert("timeout".into(), 3);
        let why = problems(&s).unwrap_or_default();
        assert!(why.contains("3 of 23 requests failed") && why.contains("timeout 3"), "{why}");
        let mut s = summary();
        s.requests_recomputed = 1;
        assert!(problems(&s).is_some_and(|w| w.contains("recomputed")));
        let mut s = summary();
        s.verify_failures = 1;
        assert!(problems(&s).is_some_and(|w| w.contains("wrong bytes")));
        let mut s = summary();
        s.blocks_leaked = 4;
        assert!(problems(&s).is_some_and(|w| w.contains("4 KV blocks leaked")));
    }

    #[test]
    fn under_a_fault_only_the_failures_it_explains_are_expected() {
        let mut s = summary();
        s.requests_failed = 5;
        s.counters.insert(FAULT_INJECTED.into(), 1);
        s.counters.insert(FAILURES_AFTER_FAULT.into(), 5);
        assert_eq!(problems(&s), None, "every failure came after the fault, with a peer cause");
        s.counters.insert(FAILURES_AFTER_FAULT.into(), 4);
        assert!(problems(&s).is_some_and(|w| w.contains("1 of 25 requests failed that the injected fault")));
        s.counters.insert(FAILURES_AFTER_FAULT.into(), 5);
        s.verify_failures = 1;
        assert!(problems(&s).is_some(), "wrong bytes are never the fault's doing");
        s.verify_failures = 0;
        s.blocks_leaked = 1;
        assert!(problems(&s).is_some(), "a fault never excuses a leak");
    }
}
