//! NIXL, loaded at run time from the C API its PyPI wheel ships (`libnixl_capi.so`).
//!
//! kvx moves the same plans through NIXL that it moves through its own UCX binding, so kvx
//! engines and vLLM engines can read from each other and NIXL's cost over raw UCX is a
//! measured figure. Nothing about NIXL enters the build: the library is found and opened
//! when `--transport nixl` (or `kvx doctor`, or `kvx probe` of a NIXL agent blob) needs it.

#![allow(
    unsafe_code,
    reason = "kvx's NIXL binding: every unsafe block calls into libnixl_capi with a SAFETY note"
)]

pub mod agent;
pub mod blob;
pub mod library;
mod sys;

use std::path::PathBuf;

pub use self::agent::{
    Agent, AgentOptions, BackendInfo, Desc, Op, Peer, Prepped, Region, Telemetry, Xfer, XferState,
};
pub use self::library::{Nixl, NixlInfo, TESTED_VERSION, exit, leave, loaded};

/// Errors of the NIXL binding.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    /// No NIXL C API library could be opened.
    #[error(
        "could not load NIXL: {reason}; tried {tried}. Run scripts/setup-nixl.sh (it unpacks the \
         nixl-cu12 wheel into .nixl/), or point KVX_NIXL_LIB at a libnixl_capi.so"
    )]
    Load { tried: String, reason: String },
    /// The library opened but lacks a function kvx calls.
    #[error(
        "{path} is not a usable NIXL C API: symbol {symbol} is missing (kvx is tested with NIXL {})",
        library::TESTED_VERSION
    )]
    Symbol { path: PathBuf, symbol: &'static str },
    /// A backend could not be created.
    #[error("NIXL could not create the {backend} backend: {reason}")]
    Backend { backend: String, reason: String },
    /// A NIXL call returned an error status.
    #[error("{op} failed: {name} ({code})")]
    Status { op: &'static str, code: i32, name: &'static str },
    /// A caller passed something kvx refuses before it reaches NIXL.
    #[error("{0}")]
    Invalid(String),
}
