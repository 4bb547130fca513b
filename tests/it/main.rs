//! kvx's integration tests: one binary, one module per area.

mod cli_errors;
mod common;
mod oracle;
mod props;
