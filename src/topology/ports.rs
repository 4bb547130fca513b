//! Side-channel (ZMQ handshake) ports, under the two schemes vLLM has used.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::KnobError;
use crate::vocab::knob::Knob;

/// How side-channel ports are assigned ([`Knob::PortScheme`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum PortScheme {
    /// One ROUTER per engine at `base + dp_rank`, serving every (pp, tp) rank (vLLM >= 0.11).
    #[default]
    Engine,
    /// One listener per worker at `base + dp_rank * tp + tp_rank` (vLLM 0.9-0.10).
    Worker,
}

impl FromStr for PortScheme {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "engine" => Ok(PortScheme::Engine),
            "worker" => Ok(PortScheme::Worker),
            other => Err(format!("unknown port scheme '{other}' (expected engine or worker)")),
        }
    }
}

impl fmt::Display for PortScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PortScheme::Engine => "engine",
            PortScheme::Worker => "worker",
        })
    }
}

/// The side-channel port of one rank.
pub fn side_channel_port(
    scheme: PortScheme,
    base: u16,
    dp_rank: u32,
    tp: u32,
    tp_rank: u32,
) -> Result<u16, KnobError> {
    let offset = match scheme {
        PortScheme::Engine => u64::from(dp_rank),
        PortScheme::Worker => u64::from(dp_rank) * u64::from(tp) + u64::from(tp_rank),
    };
    let port = u64::from(base) + offset;
    u16::try_from(port).map_err(|_| {
        KnobError::new(
            Knob::SideChannelPort,
            format!("base port {base} + offset {offset} exceeds 65535; pick a lower base port"),
        )
    })
}

/// Ports of every rank of a `dp x tp` engine group, indexed `[dp_rank][tp_rank]`.
pub fn engine_ports(scheme: PortScheme, base: u16, dp: u32, tp: u32) -> Result<Vec<Vec<u16>>, KnobError> {
    (0..dp)
        .map(|dp_rank| (0..tp).map(|r| side_channel_port(scheme, base, dp_rank, tp, r)).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_schemes() {
        assert_eq!(side_channel_port(PortScheme::Engine, 5600, 1, 8, 3), Ok(5601));
        assert_eq!(side_channel_port(PortScheme::Worker, 5600, 1, 8, 3), Ok(5611));
        assert!(side_channel_port(PortScheme::Worker, 65_530, 1, 8, 3).is_err());
    }
}
