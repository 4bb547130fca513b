//! `--transport cuda-batch`: KV blocks moved between GPUs of one machine with one batched
//! copy per peer and request, instead of one `cuMemcpyAsync` (plus an event) per descriptor
//! as UCX's cuda_ipc posts them.
//!
//! The prefill rank exports its whole KV pool once with `cuIpcGetMemHandle` ([`export`]);
//! the handle travels in its handshake metadata (`KvxMetadata::cuda_ipc`). A decode rank
//! opens each peer's handle once ([`PeerMapping::open`], closed on drop), packs one request's
//! descriptors from that peer into the `(dst, src, size)` arrays of a batched copy
//! ([`CopyBatch::pack`]: bounds-checked against both buffers, contiguous runs coalesced; with
//! the gather kernel [`pack_descriptors`] writes them straight into the pinned descriptor
//! array in one pass, from [`BatchCopier::enqueue_pairs`]), and
//! [`BatchCopier::copy`] issues them, with [`BatchCopy::Kernel`] (the default), as one launch
//! of kvx's gather-copy kernel (`gather.ptx`, JIT-compiled by the driver) that reads the copies
//! from a descriptor array in device memory; with [`BatchCopy::Api`] as ONE
//! `cuMemcpyBatchAsync_v2` (CUDA 13), else one `cuMemcpyBatchAsync` (CUDA 12.8), else (an older
//! driver) one `cuMemcpyDtoDAsync` per copy on one stream. `api-v2`, `api-v1` and `per-copy`
//! force one of those, and fail on a driver without it. Then it records one event and waits
//! for it with a deadline. Which path ran is [`BatchPath`], reported with every request.
//!
//! Owns: every CUDA call of this transport (IPC export/open/close, the batched copy, its
//! stream and event), and the pure packing of descriptors into a batch. Must not know about
//! requests, notifications or leases (that is `pipeline`), and must not call UCX.
//!
//! CUDA refuses to open an IPC handle in the process that exported it, so both ends are
//! always two processes (`kvx xfer --transport cuda-batch` spawns its target, as for UCX);
//! [`PeerMapping::open`] refuses that case, and a peer on another machine, itself, with a
//! typed error, before CUDA is asked.
//!
//! The kernel is hand-written PTX (checked with `ptxas` for sm_70, sm_80 and sm_90), so
//! building kvx needs no CUDA toolkit. It copies in the widest of 16, 8, 4 and 1 bytes at which
//! a copy's source and destination agree ([`gather_split`]: a byte head, a body of those
//! units, a byte tail), so a descriptor that is not 16-byte aligned costs a few bytes more,
//! not a byte-by-byte copy; batches count such descriptors
//! ([`BatchStats::unaligned_descriptors`]). `scripts/gpu-check.sh` measures every path,
//! aligned and not.
//!
//! # Layout
//! ```text
//! error.rs     CudaBatchError: every failure of the transport, saying what to change
//! path.rs      the --batch-copy/--batch-launch/--batch-descriptors choices, BatchPath, BatchStats
//! pack.rs      CopyBatch: plan pairs packed and coalesced; the gather kernel's pieces;
//!              pack_descriptors: pairs straight into the kernel's descriptors, one pass (pure)
//! grid.rs      GridBatch: --batch-descriptors device, the grid the expand kernel unrolls (pure)
//! peer.rs      machine_id and check_export: the refusals before CUDA is asked (pure)
//! driver.rs    driver helpers: errors as CudaBatchError, version, batch entry points by name
//! ipc.rs       export of a pool and PeerMapping (cuIpcOpenMemHandle, closed on drop)
//! gather.rs    the gather kernel loaded, its descriptor slots, one launch
//! copier.rs    BatchCopier: stream, event, the driver path, posting and waiting
//! stub.rs      the same types without the `cuda` feature, that cannot be constructed
//! ptx_sim.rs   (tests) an interpreter of the PTX gather.ptx uses
//! ptx_tests.rs (tests) gather.ptx run in it, held to pack.rs and grid.rs
//! ```
//!
//! Only `driver.rs`, `ipc.rs`, `gather.rs` and `copier.rs` call CUDA and hold `unsafe` (each
//! allows it with a reason); the rest is plain arithmetic and data, tested without a GPU, but
//! for one call in `pack.rs` (its `wide` module) of the packing loop compiled for the vector
//! instructions the CPU was found to have.

mod error;
mod grid;
mod pack;
mod path;
mod peer;

#[cfg(feature = "cuda")]
mod copier;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod gather;
#[cfg(feature = "cuda")]
mod ipc;
#[cfg(not(feature = "cuda"))]
mod stub;

#[cfg(test)]
mod ptx_sim;
#[cfg(test)]
mod ptx_tests;

pub use error::CudaBatchError;
pub use grid::GridBatch;
pub use pack::{
    CopyBatch, GATHER_PIECE, GatherSplit, PARALLEL_PACK_PAIRS, PARALLEL_PAIRS, PARALLEL_THREADS, PackFailure,
    PackThreads, Packed, Span, gather_descriptors, gather_into, gather_pieces, gather_split,
    pack_descriptors, pack_descriptors_on, pack_parts,
};
pub use path::{BatchCopy, BatchDescriptors, BatchLaunch, BatchPath, BatchStats};
pub use peer::{IPC_HANDLE_BYTES, check_export, machine_id};

#[cfg(feature = "cuda")]
pub use copier::BatchCopier;
#[cfg(feature = "cuda")]
pub use ipc::{PeerMapping, export};
#[cfg(not(feature = "cuda"))]
pub use stub::{BatchCopier, PeerMapping, export};
