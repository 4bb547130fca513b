//! How a run's requests arrive, for `kvx bench` and `kvx load` alike.

use serde::Serialize;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Arrival {
    /// Keep `n` requests in flight.
    Closed { concurrency: u32 },
    /// Open loop, Poisson arrivals at `rate` requests per second.
    Poisson { rate: f64 },
}
