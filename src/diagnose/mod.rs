//! Commands that probe a host or a link: `kvx xfer` (the transport microbenchmark between two
//! processes), `kvx calibrate` (the transfer-time model fitted from `kvx xfer` sweeps), `kvx
//! doctor` (what kvx sees on this host, with a verdict per item) and `kvx probe` (what a
//! peer's side channel advertises).
//!
//! A layer above the transports, like `pipeline` and `serve`: it may use `transfer`,
//! `layouts`, `topology`, `report` and the leaves, holds no `unsafe` (what needs it stays
//! behind a safe type in `transfer`), and nothing but `cli` imports it
//! (`tests/it/layering.rs`). Must not print: `cli` prints what these return.

#![forbid(unsafe_code)]

pub mod calibrate;
pub mod doctor;
pub mod probe;
pub mod xfer;
