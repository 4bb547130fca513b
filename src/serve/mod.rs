//! The serving path: a vLLM-shaped reference engine (`kvx serve-engine`), a P/D proxy with
//! the toy proxy's flags and request rewriting (`kvx serve-proxy`), and a load generator for
//! any OpenAI-compatible endpoint (`kvx load`).
//!
//! # Layout
//! ```text
//! openai.rs    wire shapes: request validation, synthetic tokenizer, byte-exact bodies/SSE
//! kv.rs        KvBackend trait (the engine's KV side), kv_transfer_params intent, NullKv
//! workers.rs   WorkerKv: the KvBackend over a pipeline engine of worker processes (real UCX)
//! metrics.rs   counters/gauges/histograms and the Prometheus text exposition (vLLM's buckets)
//! timing.rs    per-request stage timings in the `Server-Timing` header (the TTFT waterfall)
//! http_engine/  the engine: router(state), serve(listener, state, shutdown)
//! rewrite.rs   the toy proxy's body rewriting on raw, order-preserving JSON
//! client.rs    pooled keep-alive HTTP/1.1 client (proxy legs, load generator)
//! conn.rs      the server loop under both: read timeouts, connection cap, graceful shutdown
//! proxy.rs     the P/D proxy: router(state), serve(listener, state, shutdown)
//! load.rs      the load generator: open/closed loop, TTFT/ITL/TPOT/E2E hdrhistograms
//! load_report.rs  a load run as a report Summary: stages, rows, tables, run directory
//! bench_serve.rs  `kvx bench --serve`: both engines and the proxy in-process, driven by load
//! ```
//!
//! Every service takes a bound listener and a shutdown future; routers are pure
//! `router(state) -> axum::Router`. Only `workers.rs` and `bench_serve.rs` use `pipeline/`
//! (through its public engine API); nothing here touches `transfer/`. The HTTP side sees KV
//! only through [`kv::KvBackend`].

#![forbid(unsafe_code)]

pub mod bench_serve;
pub mod client;
pub mod conn;
pub mod http_engine;
pub mod kv;
pub mod load;
pub mod load_report;
pub mod metrics;
pub mod openai;
pub mod proxy;
pub mod rewrite;
pub mod timing;
pub mod workers;
