//! The typed errors of the UCX layer. Every `ucs_status_t` that is not `UCS_OK` becomes
//! [`UcxError::Status`] in [`check`], carrying the operation, the enumerator name and
//! UCX's own description; nothing in this layer panics on a status.

use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong loading or calling UCX.
#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    /// No UCX library could be opened.
    #[error(
        "could not load UCX: {reason}; tried {tried}. Point --ucx-lib (or KVX_UCX_LIB) at a libucp.so.0, \
         run scripts/setup-ucx.sh, or install Debian's libucx0"
    )]
    Load { tried: String, reason: String },
    /// The library opened but is not a usable UCX (a symbol is missing).
    #[error("{path} is not a usable libucp: symbol {symbol} is missing (UCX >= 1.13 is required)")]
    Symbol { path: PathBuf, symbol: &'static str },
    /// A second, different UCX library was requested in a process that already loaded one.
    #[error(
        "this process already loaded UCX from {loaded}; it cannot also load {requested} \
         (run a separate kvx process per UCX build)"
    )]
    AlreadyLoaded { loaded: PathBuf, requested: PathBuf },
    /// A UCX call returned an error status.
    #[error("{op} failed: {name} ({description})")]
    Status { op: &'static str, code: i8, name: &'static str, description: String },
    /// A wait did not finish in time.
    #[error("{op} timed out after {timeout:?} with {outstanding} operation(s) outstanding{hint}")]
    Timeout { op: &'static str, timeout: Duration, outstanding: u64, hint: &'static str },
    /// A caller passed something kvx refuses before it reaches UCX.
    #[error("{0}")]
    Invalid(String),
    /// Packed remote-key bytes that are not a kvx envelope around a UCX rkey.
    #[error("bad remote key bytes: {0}")]
    BadRkey(String),
    /// The local region cannot be used: an earlier read into it never completed.
    #[error("the local region is poisoned: an earlier read into it was abandoned while in flight")]
    Poisoned,
    /// CUDA, which a context for device memory needs, is missing or failed.
    #[error(transparent)]
    Cuda(#[from] crate::transfer::cuda::CudaError),
    /// The loaded UCX cannot register device memory.
    #[error(
        "the UCX at {library} (version {version}) cannot register CUDA memory (its memory types: \
         {memory_types}): it was built without CUDA or its CUDA module did not load. Point --ucx-lib (or \
         KVX_UCX_LIB) at libucx/lib/libucp.so.0 of the PyPI wheel libucx-cu12 or libucx-cu13 \
         (scripts/setup-ucx.sh installs one as .ucx/)"
    )]
    NoCudaSupport { library: String, version: String, memory_types: String },
    /// An OS call around UCX (event fd polling, memstreams) failed.
    #[error("{op}: {source}")]
    Io { op: &'static str, source: std::io::Error },
}

impl UcxError {
    /// The UCS status code behind this error, if it came from UCX.
    pub fn ucs_status(&self) -> Option<i8> {
        match self {
            UcxError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }
}

pub type Result<T, E = UcxError> = std::result::Result<T, E>;
