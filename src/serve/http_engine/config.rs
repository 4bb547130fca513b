//! The simulated prefill's cost model of an engine (its settings, [`HttpEngineConfig`], are
//! resolved into `config::serve`).

use std::time::Duration;

use crate::config::serve::HttpEngineConfig;

impl HttpEngineConfig {
    pub(super) fn prefill_time(&self, tokens: u64) -> Duration {
        if self.prefill_tokens_per_s > 0.0 {
            Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        }
    }
}
