//! Flags shared by several subcommands: the model shape, the P/D engine pair, the ports and
//! the output format (defined with their settings, `settings::flags`).

pub use crate::settings::flags::{Format, ModelFlags, PairFlags, PortFlags};
