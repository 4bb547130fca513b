//! kvx's integration tests: one binary, one module per area.

mod cli_errors;
mod common;
mod gate;
mod handshake;
mod oracle;
mod props;
mod report;
mod serve;
mod ucx;
mod ucx_am;
mod ucx_common;
mod ucx_layout;
