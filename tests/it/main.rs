//! kvx's integration tests: one binary, one module per area.

mod bench;
mod cli_errors;
mod common;
mod gate;
mod handshake;
mod netns;
mod oracle;
mod procs;
mod props;
mod report;
mod serve;
mod serve_metrics;
mod serve_workers;
mod storage;
mod ucx;
mod ucx_am;
mod ucx_common;
mod ucx_layout;
