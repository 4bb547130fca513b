//! UCX, bound by kvx and loaded at run time: the only FFI in kvx.
//!
//! Owns: loading `libucp` ([`Ucx`]), the raw declarations (`sys`), and safe RAII owners
//! for every UCX handle kvx uses — [`Context`], [`Worker`], [`Endpoint`], [`MemRegion`],
//! [`PackedRkey`], [`RemoteRegion`] — plus the batches of one-sided GETs the pipeline
//! posts ([`RemoteRegion::read_batch`], or [`rma_batch`] of GETs or PUTs over several peers
//! at once), and active messages on the same workers and endpoints ([`AmReceiver`],
//! [`Endpoint::am_send`]), and the protocols UCX selected ([`Context::protocols`]). Must not know about KV layouts, handshakes or requests:
//! callers pass worker addresses and packed rkeys around as opaque bytes.
//!
//! Teardown order is in the types: a worker holds its context, an endpoint its worker, a
//! remote region (unpacked rkey) its endpoint, and a registered region owns its memory;
//! a batch read borrows the local region mutably until every GET has landed.
//!
//! Typical use (initiator side):
//! ```no_run
//! # fn main() -> Result<(), kvx::transfer::ucx::UcxError> {
//! use kvx::transfer::ucx::*;
//! # let (peer_address, peer_rkey, peer_base, peer_len): (Vec<u8>, Vec<u8>, u64, u64) = todo!();
//! # let local_memory: kvx::transfer::memory::HostBuffer = todo!();
//! let ucx = Ucx::load(None)?;
//! let ctx = Context::new(&ucx, &ContextOptions::default())?;
//! let worker = Worker::new(&ctx)?;
//! let mut local = MemRegion::register(&ctx, local_memory)?;
//! let ep = Endpoint::connect(&worker, &peer_address, ErrMode::None)?;
//! let remote = ep.unpack_rkey(&PackedRkey::from_bytes(&peer_rkey)?, peer_base, peer_len)?;
//! let descs = [ReadDesc { local_off: 0, remote_off: 4096, len: 4096 }];
//! let stats = remote.read_batch(&mut local, descs, &ReadOptions::default())?;
//! # Ok(()) }
//! ```
#![allow(unsafe_code, reason = "kvx's UCX binding: every unsafe block calls into libucp with a SAFETY note")]

mod am;
mod context;
mod endpoint;
mod error;
mod library;
mod protocols;
mod region;
pub mod sys;

pub use am::{AmReceiver, AmStats};
pub use context::{
    CUDA_IPC_GET_ZCOPY_ENV, Context, ContextOptions, HYBRID_SPIN, ProgressMode, ServeEnd, Worker,
    defer_wakeups, ignore_sigint, wait_readable,
};
pub use endpoint::{
    Endpoint, ErrMode, ReadDesc, ReadOptions, ReadStats, RemoteRegion, parse_transports, rma_batch,
};
pub use error::{Result, UcxError};
pub use library::{LibInfo, LibSearch, LibSource, SYSTEM_SONAME, Ucx};
pub use protocols::{
    LOG_FILE_ENV, PROTO_INFO_DIR_ENV, PROTO_INFO_ENV, ProtoChoice, ProtoReport, ProtoSelection, ProtoUse,
    Rma, capture_dir as proto_capture_dir, capture_env as proto_capture_env,
    log_messages as ucx_log_messages, memory_kind, parse_dot, parse_log, read_dir as read_proto_dir,
    summarize as summarize_protocols,
};
pub use region::{MemRegion, MemType, PackedRkey, Registrable, UcxAllocated};
