//! kvx's integration tests: one binary, one module per area.

mod bench;
mod cli_errors;
mod common;
mod edge;
mod gate;
mod golden;
mod gpu;
mod handshake;
mod hostile;
mod interrupt;
mod kv_buffer;
mod layering;
mod netns;
mod oracle;
mod procs;
mod props;
mod push_plan;
mod report;
mod serve;
mod serve_metrics;
mod serve_workers;
mod storage;
mod ucx;
mod ucx_am;
mod ucx_common;
mod ucx_layout;
