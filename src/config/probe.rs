//! The resolved settings of `kvx probe`.

use std::time::Duration;

use crate::transfer::handshake::Framing;

/// Which framing to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProbeFraming {
    /// 0.33 first; fall back to 0.19 framing if the peer answers the 0.19 way.
    #[default]
    Auto,
    Fixed(Framing),
}

#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub pp_rank: u32,
    pub tp_rank: u32,
    pub framing: ProbeFraming,
    /// Total time allowed for the probe (connect, request, reply).
    pub timeout: Duration,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions { pp_rank: 0, tp_rank: 0, framing: ProbeFraming::Auto, timeout: Duration::from_secs(5) }
    }
}
