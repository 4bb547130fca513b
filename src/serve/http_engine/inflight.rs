//! A generation request's hold on the engine while it runs: its admission permit and the
//! running count ([`InFlight`]: dropped unfinished, the request is aborted and the backend
//! told), a gauge counted for as long as a guard lives, and the sleep that paces tokens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use super::state::EngineState;
use crate::serve::metrics::Gauge;
use crate::serve::openai::FinishReason;

/// Counts a gauge up for as long as it lives.
pub(super) struct GaugeGuard<'a>(&'a Gauge);

impl<'a> GaugeGuard<'a> {
    pub(super) fn new(g: &'a Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Holds one running sequence: the admission permit and the `num_requests_running` count.
/// If it is dropped before [`finish`](Self::finish) (client gone: the handler future or the
/// response stream was dropped), the request is aborted and the backend told.
pub(super) struct InFlight {
    pub(super) st: Arc<EngineState>,
    pub(super) internal_id: String,
    pub(super) x_request_id: String,
    pub(super) _permit: OwnedSemaphorePermit,
    pub(super) started: Instant,
    pub(super) finished: bool,
}

impl InFlight {
    /// Ends the request normally: `n` tokens, the first `ttft` after arrival.
    pub(super) fn finish(mut self, finish: FinishReason, n: u64, ttft: Duration) {
        self.finished = true;
        let m = &self.st.metrics;
        match finish {
            FinishReason::Length => m.success_length.inc(),
            FinishReason::Stop => m.success_stop.inc(),
        }
        let e2e = self.started.elapsed();
        m.e2e.observe(e2e);
        if n > 1 {
            m.tpot.observe(e2e.saturating_sub(ttft) / u32::try_from(n - 1).unwrap_or(u32::MAX));
        }
    }

    /// Ends the request with an error already reported to the client.
    pub(super) fn fail(mut self) {
        self.finished = true;
        self.st.metrics.errors.inc();
        self.st.metrics.failed.inc();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.st.metrics.running.dec();
        if !self.finished {
            self.st.metrics.aborted.inc();
            // One abort per request, whichever comes first: this one, or a proxy's by
            // X-Request-Id (which then finds nothing left to free).
            let already = match self.st.handoff_ids().by_x.get_mut(&self.x_request_id) {
                Some(h) if h.internal_id == self.internal_id => std::mem::replace(&mut h.aborted, true),
                _ => false,
            };
            if !already {
                self.st.backend.abort(&self.internal_id);
            }
            tracing::debug!(request_id = %self.internal_id, "client went away; request aborted");
        }
    }
}

/// Sleeps until `t` (no-op if it has passed).
pub(super) async fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        tokio::time::sleep(t - now).await;
    }
}
