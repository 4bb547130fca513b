//! The serving path: a vLLM-shaped reference engine (`kvx serve-engine`), a P/D proxy with
//! the toy proxy's flags and request rewriting (`kvx serve-proxy`), and a load generator for
//! any OpenAI-compatible endpoint (`kvx load`).
//!
//! # Layout
//! ```text
//! openai.rs    wire shapes: request validation, synthetic tokenizer, byte-exact bodies/SSE
//! kv.rs        KvBackend trait (the engine's KV side), kv_transfer_params, NullKv
//! metrics.rs   counters/gauges/histograms and the Prometheus text exposition
//! engine.rs    the engine: router(state), serve(listener, state, shutdown)
//! rewrite.rs   the toy proxy's body rewriting on raw, order-preserving JSON
//! client.rs    pooled keep-alive HTTP/1.1 client (proxy legs, load generator)
//! proxy.rs     the P/D proxy: router(state), serve(listener, state, shutdown)
//! load.rs      the load generator: open/closed loop, TTFT/ITL/TPOT/E2E hdrhistograms
//! ```
//!
//! Every service takes a bound listener and a shutdown future; routers are pure
//! `router(state) -> axum::Router`. This module must not reach into `pipeline/` or
//! `transfer/`: a real KV backend plugs in through [`kv::KvBackend`].

pub mod client;
pub mod engine;
pub mod kv;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod proxy;
pub mod rewrite;
