//! kvx's integration tests: one binary, one module per area.

mod common;
mod oracle;
mod props;
