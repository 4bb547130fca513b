//! `--transport cuda-batch`: KV blocks moved between GPUs of one machine with one batched
//! copy per peer and request, instead of one `cuMemcpyAsync` (plus an event) per descriptor
//! as UCX's cuda_ipc posts them.
//!
//! The prefill rank exports its whole KV pool once with `cuIpcGetMemHandle` ([`export`]);
//! the handle travels in its handshake metadata (`KvxMetadata::cuda_ipc`). A decode rank
//! opens each peer's handle once ([`PeerMapping::open`], closed on drop), packs one request's
//! descriptors from that peer into the `(dst, src, size)` arrays of a batched copy
//! ([`CopyBatch::pack`]: bounds-checked against both buffers, contiguous runs coalesced), and
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
#![allow(unsafe_code, reason = "CUDA IPC and batched-copy driver calls of the cuda-batch transport")]

use serde::{Deserialize, Serialize};

use super::handshake::meta::CudaIpcExport;
use crate::layouts::plan::Pair;

mod grid;
pub use grid::GridBatch;

/// What can go wrong with the cuda-batch transport, each saying what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaBatchError {
    #[error(transparent)]
    Cuda(#[from] super::cuda::CudaError),
    #[error(
        "descriptor {index}: {side} bytes {offset}..{end} are outside the {len}-byte {side} buffer \
         (the peer's advertised pool does not match the plan)"
    )]
    OutOfBounds { index: usize, side: &'static str, offset: u64, end: u64, len: u64 },
    #[error("a batch packed for other buffers was handed to the copier (local or peer mapping differs)")]
    WrongBuffers,
    #[error(
        "{peer} advertises no CUDA IPC export: it does not run --transport cuda-batch (start both engines \
         with it), or its KV pool is not in device memory (--mem cuda)"
    )]
    NoExport { peer: String },
    #[error(
        "{peer} runs on another machine (boot id {theirs}, here {ours}): --transport cuda-batch maps the \
         peer's GPU memory with CUDA IPC, which works between processes of one machine only; use \
         --transport ucx across machines"
    )]
    OtherMachine { peer: String, theirs: String, ours: String },
    #[error(
        "{peer} is this process: CUDA refuses to open an IPC handle where it was exported, so the \
         cuda-batch transport needs two processes (kvx xfer and kvx bench start them)"
    )]
    SameProcess { peer: String },
    #[error("{peer}'s CUDA IPC handle is {len} bytes, not the 64 of a CUipcMemHandle")]
    BadHandle { peer: String, len: usize },
    #[error(
        "opening {peer}'s CUDA IPC handle failed: {reason}. CUDA IPC needs both processes on one machine, \
         seeing the peer's GPU (check CUDA_VISIBLE_DEVICES and `kvx doctor`'s cuda.ipc line), with peer \
         access between the two devices when they differ, and in containers a shared IPC namespace"
    )]
    Open { peer: String, reason: String },
    #[error("batched copy of {copies} copies did not complete within {timeout:?} (its event never fired)")]
    Timeout { copies: usize, timeout: std::time::Duration },
    #[error("CUDA {op} failed: {reason}")]
    Call { op: &'static str, reason: String },
    /// A path forced with `--batch-copy` that this driver does not have (or refuses).
    #[error(
        "{flag} forces {call} (CUDA drivers {since} and later), which this CUDA driver (version {driver}) \
         does not have or refuses: use --batch-copy api (the best batch API this driver has), per-copy or \
         kernel"
    )]
    PathUnavailable { flag: String, call: &'static str, since: &'static str, driver: i32 },
}

/// How `--transport cuda-batch` issues a batch's copies (`--batch-copy`). Every path but
/// `api` is forced: a driver that lacks it is an error naming the flag, never a fallback, so
/// that each path can be run and tested on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchCopy {
    /// The best batch API the driver has: `cuMemcpyBatchAsync_v2` (CUDA 13), else
    /// `cuMemcpyBatchAsync` (CUDA 12.8), else one `cuMemcpyDtoDAsync` per copy.
    Api,
    /// Forces `cuMemcpyBatchAsync_v2` (CUDA 13 drivers).
    ApiV2,
    /// Forces `cuMemcpyBatchAsync`, the CUDA 12.8 batch API.
    ApiV1,
    /// Forces one `cuMemcpyDtoDAsync` per copy, the path of a driver without a batch API.
    PerCopy,
    /// kvx's gather-copy kernel: the descriptors go to device memory in one copy and one
    /// kernel launch moves them all (any CUDA driver). The default: on an H200 (driver 580,
    /// CUDA 13) it moved 8 KiB descriptors, 10,240 a batch, two orders of magnitude faster
    /// than the batch API, whose driver still works per copy
    /// (results/gpu-nvidia-h200-2026-11-27.json, step 6 of `scripts/gpu-check.sh`).
    #[default]
    Kernel,
}

impl BatchCopy {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchCopy::Api => "api",
            BatchCopy::ApiV2 => "api-v2",
            BatchCopy::ApiV1 => "api-v1",
            BatchCopy::PerCopy => "per-copy",
            BatchCopy::Kernel => "kernel",
        }
    }

    /// The help of `--batch-copy` (kvx xfer and kvx bench), its default taken from
    /// [`BatchCopy::default`] so the two cannot disagree.
    pub fn help() -> String {
        format!(
            "How --transport cuda-batch issues a batch's copies: kernel (kvx's gather-copy kernel, one \
             launch), api (the best batch API the driver has), or one path forced: api-v2 \
             (cuMemcpyBatchAsync_v2), api-v1 (cuMemcpyBatchAsync), per-copy (one cuMemcpyDtoDAsync per \
             copy); a forced path the driver lacks is an error [default: {}]",
            BatchCopy::default().as_str()
        )
    }

    /// The one driver path this choice forces, if it forces one (`api` picks the best there is).
    pub fn forced(self) -> Option<BatchPath> {
        match self {
            BatchCopy::Api => None,
            BatchCopy::ApiV2 => Some(BatchPath::BatchV2),
            BatchCopy::ApiV1 => Some(BatchPath::BatchV1),
            BatchCopy::PerCopy => Some(BatchPath::PerDescriptor),
            BatchCopy::Kernel => Some(BatchPath::Kernel),
        }
    }

    /// The path `new` takes on a driver of `version` (`cuDriverGetVersion`) that has the batch
    /// entry points `has_v2` and `has_v1`: the forced one, or an error naming the flag when
    /// the driver lacks it; for `api`, the best there is.
    pub fn choose(self, version: i32, has_v2: bool, has_v1: bool) -> Result<BatchPath, CudaBatchError> {
        let missing = |call: &'static str, since: &'static str| CudaBatchError::PathUnavailable {
            flag: format!("--batch-copy {}", self.as_str()),
            call,
            since,
            driver: version,
        };
        match self {
            BatchCopy::Api if has_v2 => Ok(BatchPath::BatchV2),
            BatchCopy::Api if has_v1 => Ok(BatchPath::BatchV1),
            BatchCopy::Api | BatchCopy::PerCopy => Ok(BatchPath::PerDescriptor),
            BatchCopy::ApiV2 if has_v2 => Ok(BatchPath::BatchV2),
            BatchCopy::ApiV2 => Err(missing("cuMemcpyBatchAsync_v2", "13.0")),
            BatchCopy::ApiV1 if has_v1 => Ok(BatchPath::BatchV1),
            BatchCopy::ApiV1 => Err(missing("cuMemcpyBatchAsync", "12.8")),
            BatchCopy::Kernel => Ok(BatchPath::Kernel),
        }
    }
}

/// How many batches `--transport cuda-batch` posts per request on a decode rank
/// (`--batch-launch`). Without MPS, two decode ranks on one GPU take turns on it, so every
/// launch of one waits behind the other's: fewer launches, fewer turns (`rank`).
/// Under MPS their kernels run side by side, and posting each peer's batch while the last one
/// copies wins (`peer`): on an H200, P8->D2 70B at 8 KiB, a request's span share was 0.32x
/// (`rank`) against 0.21x (`peer`) without MPS and 0.40x against 0.53x under it
/// (results/gpu-nvidia-h200-2026-11-27-run4.json). `auto`, the default, picks by that rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchLaunch {
    /// `peer` when the device's contexts are shared through MPS (the driver's
    /// CU_DEVICE_ATTRIBUTE_MPS_ENABLED), else `rank`; the summary names the one used.
    #[default]
    Auto,
    /// One batch per request per decode rank, over all its prefill peers (one kernel launch
    /// with `--batch-copy kernel`).
    Rank,
    /// One batch per prefill peer, each posted while the one before it copies (faster under
    /// MPS).
    Peer,
}

impl BatchLaunch {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchLaunch::Auto => "auto",
            BatchLaunch::Rank => "rank",
            BatchLaunch::Peer => "peer",
        }
    }

    /// The launch a decode rank uses: `auto` resolved by whether its device runs under MPS.
    pub fn resolve(self, under_mps: bool) -> BatchLaunch {
        match self {
            BatchLaunch::Auto if under_mps => BatchLaunch::Peer,
            BatchLaunch::Auto => BatchLaunch::Rank,
            chosen => chosen,
        }
    }
}

/// Where `--transport cuda-batch` makes the gather kernel's descriptors
/// (`--batch-descriptors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchDescriptors {
    /// On the host: each of the plan's pairs bounds-checked, contiguous runs coalesced, long
    /// copies split, written as `(dst, src, len)` and uploaded ([`CopyBatch`]).
    #[default]
    Host,
    /// On the device: the plan's region table and the request's block pairs are uploaded (a
    /// few KiB) and a kernel writes the descriptors ([`GridBatch`]); the host checks bounds
    /// per region. Uniform plans with `--batch-copy kernel`, uncoalesced; a request whose
    /// descriptors are longer than [`GATHER_PIECE`] is made on the host.
    Device,
}

impl BatchDescriptors {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchDescriptors::Host => "host",
            BatchDescriptors::Device => "device",
        }
    }
}

/// Which driver entry point moved a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchPath {
    /// `cuMemcpyBatchAsync_v2` (CUDA 13 drivers): one call per batch.
    BatchV2,
    /// `cuMemcpyBatchAsync` (CUDA 12.8 and 12.9 drivers, with `failIdx`): one call per batch.
    BatchV1,
    /// A driver without the batch API: one `cuMemcpyDtoDAsync` per copy on one stream (still
    /// one event per batch, and still coalesced), so posting is per copy again.
    PerDescriptor,
    /// kvx's gather-copy kernel (`--batch-copy kernel`): one copy of the descriptor array to
    /// the device and one launch per batch.
    Kernel,
}

impl BatchPath {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "batch-v2",
            BatchPath::BatchV1 => "batch-v1",
            BatchPath::PerDescriptor => "per-descriptor",
            BatchPath::Kernel => "kernel",
        }
    }

    /// The driver function behind the path, for reports.
    pub fn driver_call(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "cuMemcpyBatchAsync_v2",
            BatchPath::BatchV1 => "cuMemcpyBatchAsync",
            BatchPath::PerDescriptor => "cuMemcpyDtoDAsync per copy (no batch API in this driver)",
            BatchPath::Kernel => {
                "kvx_gather_copy kernel (cuMemcpyHtoDAsync of the descriptors + cuLaunchKernel)"
            }
        }
    }

    /// Driver calls one batch of `copies` copies costs on this path.
    pub fn calls(self, copies: usize) -> u64 {
        match self {
            BatchPath::BatchV2 | BatchPath::BatchV1 => u64::from(copies > 0),
            BatchPath::PerDescriptor => copies as u64,
            BatchPath::Kernel => 2 * u64::from(copies > 0),
        }
    }
}

impl std::fmt::Display for BatchPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A device buffer as the packer sees it: its device address and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub base: u64,
    pub len: u64,
}

/// One request's copies from one peer (or, with `--batch-launch rank`, from every peer of a
/// decode rank), as `(dst, src, size)` triples (the gather kernel's descriptors): absolute device
/// addresses inside `local` (destination) and the peers' mapped sources, each range checked
/// against its buffer when packed, and ranges that continue the previous one on both sides
/// (from the same peer) merged into it. The fields are private, so a batch only exists as
/// [`CopyBatch::pack`] and [`CopyBatch::add`] built it: the copier relies on that to know
/// every address is in bounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyBatch {
    /// `(dst, src, size)` of each copy, three u64 in a row: the gather kernel's descriptor
    /// format, so a batch whose copies need no splitting is uploaded as it stands.
    words: Vec<u64>,
    local: Span,
    /// The peer spans the copies read from, in the order they were added.
    peers: Vec<Span>,
    descriptors: u64,
    bytes: u64,
    unaligned: u64,
    /// The longest copy (after merging).
    longest: u64,
}

impl CopyBatch {
    /// Packs plan pairs (`local` = offset in this rank's pool, `remote` = offset in the peer's)
    /// against the two buffers, replacing what the batch held (its arrays are reused, so a
    /// decode rank allocates them once). Zero-length pairs are dropped. Fails on the first
    /// pair outside either buffer, naming it; the batch is then empty.
    pub fn pack(
        &mut self,
        pairs: impl IntoIterator<Item = Pair>,
        local: Span,
        peer: Span,
    ) -> Result<(), CudaBatchError> {
        self.clear();
        self.add(pairs, local, peer)
    }

    /// Adds one more peer's pairs behind what the batch holds (into the same `local`), so
    /// that one batched call reads from several peers. Copies are never merged across two
    /// peers. Fails on the first pair outside either buffer (its index counts from this
    /// call's first pair), or when `local` is not the batch's; the batch is then empty.
    pub fn add(
        &mut self,
        pairs: impl IntoIterator<Item = Pair>,
        local: Span,
        peer: Span,
    ) -> Result<(), CudaBatchError> {
        if self.peers.is_empty() {
            self.local = local;
        } else if self.local != local {
            self.clear();
            return Err(CudaBatchError::WrongBuffers);
        }
        self.peers.push(peer);
        // Copies of this peer start below (`ends`): none merges into the previous peer's last.
        // One pass, bounds checked against both spans, written as the kernel's descriptors:
        // what a decode rank does per descriptor before its launch (benches/batch.rs).
        let (mut descriptors, mut bytes, mut unaligned, mut longest) = (0u64, 0u64, 0u64, self.longest);
        // A span whose end overflows holds nothing: every pair is then out of bounds.
        let room = |s: Span| if s.base.checked_add(s.len).is_some() { s.len } else { 0 };
        let (l_room, p_room) = (room(local), room(peer));
        // Where the last copy of this peer ends on both sides (none yet: no merge).
        let mut ends: Option<(u64, u64)> = None;
        let pairs = pairs.into_iter();
        self.words.reserve(3 * pairs.size_hint().0);
        let mut result = Ok(());
        for (index, p) in pairs.enumerate() {
            descriptors += 1;
            if p.len == 0 {
                continue;
            }
            let local_ok = p.local <= l_room && p.len <= l_room - p.local;
            if !local_ok || p.remote > p_room || p.len > p_room - p.remote {
                let (side, offset, span) =
                    if local_ok { ("peer", p.remote, peer) } else { ("local", p.local, local) };
                result = Err(CudaBatchError::OutOfBounds {
                    index,
                    side,
                    offset,
                    end: offset.saturating_add(p.len),
                    len: span.len,
                });
                break;
            }
            // In bounds, and the span's end does not overflow: neither does this.
            let (dst, src) = (local.base + p.local, peer.base + p.remote);
            bytes += p.len;
            unaligned += u64::from(!(dst | src | p.len).is_multiple_of(16));
            let (d_end, s_end) = (dst + p.len, src + p.len);
            if ends == Some((dst, src)) {
                let w = self.words.len();
                self.words[w - 1] += p.len;
                longest = longest.max(self.words[w - 1]);
            } else {
                self.words.extend_from_slice(&[dst, src, p.len]);
                longest = longest.max(p.len);
            }
            ends = Some((d_end, s_end));
        }
        if let Err(e) = result {
            self.clear();
            return Err(e);
        }
        self.descriptors += descriptors;
        self.bytes += bytes;
        self.unaligned += unaligned;
        self.longest = longest;
        Ok(())
    }

    fn clear(&mut self) {
        self.peers.clear();
        self.words.clear();
        self.descriptors = 0;
        self.bytes = 0;
        self.unaligned = 0;
        self.longest = 0;
    }

    /// Copies after coalescing: the entries of one batched call.
    pub fn copies(&self) -> usize {
        self.words.len() / 3
    }

    /// Plan descriptors packed (before coalescing, zero-length ones included).
    pub fn descriptors(&self) -> u64 {
        self.descriptors
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Plan descriptors (of non-zero length) whose local or peer address or length is not a
    /// multiple of 16: the gather kernel copies their first and last bytes one by one, and all
    /// of them in narrower units where the two addresses differ modulo 16 ([`gather_split`]).
    pub fn unaligned_descriptors(&self) -> u64 {
        self.unaligned
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// `(dst, src, size)` of each copy.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, usize)> + '_ {
        // kvx builds for 64-bit targets only: a u64 size is a usize.
        self.words.chunks_exact(3).map(|c| (c[0], c[1], c[2] as usize))
    }

    /// Whether every copy is one piece of at most `piece` bytes ([`gather_into`]): the
    /// batch's words are then the kernel's descriptors as they stand.
    fn unsplit(&self, piece: u64) -> bool {
        // A copy's first piece is `piece - dst % 16` long, at least `piece - 15`.
        self.longest <= piece.saturating_sub(15)
    }
}

/// Longest piece of a copy one thread block of the gather kernel moves: longer copies are
/// split, so that one large copy spreads over many blocks (and SMs) instead of one.
pub const GATHER_PIECE: u64 = 32 << 10;

/// The gather kernel's descriptor array for `batch`, replacing what `out` held: three u64
/// `(dst, src, len)` per piece, copies longer than `piece` split into pieces of at most
/// `piece` bytes (a multiple of 16) at offsets where the destination is a multiple of 16, so
/// that every piece keeps its copy's unit ([`gather_split`]) and only a copy's first piece has
/// a byte head and only its last a byte tail. Returns the piece count.
pub fn gather_descriptors(batch: &CopyBatch, piece: u64, out: &mut Vec<u64>) -> usize {
    out.clear();
    out.resize(3 * gather_pieces(batch, piece), 0);
    gather_into(batch, piece, out)
}

/// How many pieces [`gather_descriptors`] makes of `batch`.
pub fn gather_pieces(batch: &CopyBatch, piece: u64) -> usize {
    let piece = (piece & !15).max(16);
    if batch.unsplit(piece) {
        return batch.copies();
    }
    batch.entries().map(|(dst, _, n)| (n as u64 + dst % 16).div_ceil(piece) as usize).sum()
}

/// [`gather_descriptors`] into the front of `out` (pinned memory the launcher uploads from),
/// which holds at least `3 * gather_pieces(batch, piece)` words. Returns the piece count.
pub fn gather_into(batch: &CopyBatch, piece: u64, out: &mut [u64]) -> usize {
    let piece = (piece & !15).max(16);
    if batch.unsplit(piece) {
        out[..batch.words.len()].copy_from_slice(&batch.words);
        return batch.copies();
    }
    let mut w = 0;
    for (dst, src, size) in batch.entries() {
        let size = size as u64;
        // The first piece ends where the destination reaches a multiple of 16.
        let mut off = 0;
        let mut len = piece - dst % 16;
        while off < size {
            len = len.min(size - off);
            out[w..w + 3].copy_from_slice(&[dst + off, src + off, len]);
            w += 3;
            off += len;
            len = piece;
        }
    }
    w / 3
}

/// How the gather kernel copies `len` bytes from `src` to `dst` (the arithmetic of
/// `gather.ptx`, kept here so it is tested): in `granule`-byte units, the widest of 16, 8, 4
/// and 1 at which the two addresses agree, so that every unit is aligned on both sides; the
/// first `head` bytes (until `dst`, and so `src`, reaches a multiple of `granule`) and the last
/// `tail` bytes byte by byte. A copy whose addresses and length are multiples of 16 is all
/// body. Pieces of one copy ([`gather_descriptors`]) start at multiples of 16 into it, so each
/// has the copy's granule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherSplit {
    pub granule: u64,
    pub head: u64,
    pub body: u64,
    pub tail: u64,
}

/// The kernel's split of one copy (see [`GatherSplit`]).
pub fn gather_split(dst: u64, src: u64, len: u64) -> GatherSplit {
    let skew = dst ^ src;
    let granule = [16u64, 8, 4].into_iter().find(|&g| skew.is_multiple_of(g)).unwrap_or(1);
    let mask = granule - 1;
    let head = (dst.wrapping_neg() & mask).min(len);
    let body = (len - head) & !mask;
    GatherSplit { granule, head, body, tail: len - head - body }
}

/// Fewest pairs in one request's parts for [`pack_parts`] to pack them on several threads:
/// below it, handing the parts to rayon's threads costs more than it saves.
pub const PARALLEL_PAIRS: usize = 16_384;

/// Packs each peer's pairs into its own batch (`parts[i]` from `jobs[i] = (pairs, peer)`, all
/// into `local`), the parts on rayon's threads when there are at least [`PARALLEL_PAIRS`]
/// pairs and four threads, else one after the other: a decode rank's packing per request,
/// which bounds a request on a host whose cores are slow (results/gpu-nvidia-h200-2026-11-27-run3.json).
/// `parts` must hold at least `jobs.len()` batches (reused, so nothing is allocated). On the
/// first part that fails, returns its index and error.
pub fn pack_parts(
    parts: &mut [CopyBatch],
    jobs: &[(&[Pair], Span)],
    local: Span,
) -> Result<(), (usize, CudaBatchError)> {
    use rayon::prelude::*;
    let parts = &mut parts[..jobs.len()];
    let pack = |(i, (b, (pairs, peer))): (usize, (&mut CopyBatch, &(&[Pair], Span)))| {
        b.pack(pairs.iter().copied(), local, *peer).map_err(|e| (i, e))
    };
    let pairs: usize = jobs.iter().map(|(p, _)| p.len()).sum();
    if jobs.len() > 1 && pairs >= PARALLEL_PAIRS && rayon::current_num_threads() >= 4 {
        let results: Vec<_> = parts.par_iter_mut().zip(jobs).enumerate().map(pack).collect();
        results.into_iter().collect()
    } else {
        parts.iter_mut().zip(jobs).enumerate().try_for_each(pack)
    }
}

/// What one batch cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchStats {
    /// Time to issue the driver call(s) and record the event.
    pub post_ns: u64,
    /// Of `post_ns`, the host's time writing the gather kernel's descriptors into pinned
    /// memory (0 on the other paths).
    #[serde(default)]
    pub fill_ns: u64,
    /// From the start of posting to the event's completion.
    pub complete_ns: u64,
    /// Driver calls made (1 with the batch API, one per copy without it).
    pub calls: u64,
    /// Copies after coalescing.
    pub copies: u64,
    /// Plan descriptors before coalescing.
    pub descriptors: u64,
    pub bytes: u64,
    /// Plan descriptors whose address (on either side) or length is not a multiple of 16
    /// ([`CopyBatch::unaligned_descriptors`]).
    #[serde(default)]
    pub unaligned_descriptors: u64,
}

/// This machine's identity for "are we on one machine": the kernel's boot id (one per booted
/// kernel, shared by every container on it), else the host name.
pub fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(hostname)
        .unwrap_or_else(|| "unknown".into())
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|s| s.trim().to_string())
}

/// Refuses a peer export this process cannot open, before CUDA is asked: none advertised,
/// another machine, this very process, a handle of the wrong size.
pub fn check_export<'a>(
    peer: &str,
    export: Option<&'a CudaIpcExport>,
) -> Result<&'a CudaIpcExport, CudaBatchError> {
    let e = export.ok_or_else(|| CudaBatchError::NoExport { peer: peer.to_string() })?;
    let ours = machine_id();
    if e.machine_id != ours {
        return Err(CudaBatchError::OtherMachine {
            peer: peer.to_string(),
            theirs: e.machine_id.clone(),
            ours,
        });
    }
    if e.pid == std::process::id() {
        return Err(CudaBatchError::SameProcess { peer: peer.to_string() });
    }
    if e.handle.len() != IPC_HANDLE_BYTES {
        return Err(CudaBatchError::BadHandle { peer: peer.to_string(), len: e.handle.len() });
    }
    Ok(e)
}

/// Size of a `CUipcMemHandle`.
pub const IPC_HANDLE_BYTES: usize = 64;

pub use imp::{BatchCopier, PeerMapping, export};

#[cfg(feature = "cuda")]
mod imp {
    use std::ffi::{c_char, c_void};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use cudarc::driver::{result, sys};

    use super::{
        BatchCopy, BatchPath, BatchStats, CopyBatch, CudaBatchError, CudaIpcExport, GATHER_PIECE, GridBatch,
        IPC_HANDLE_BYTES, Span,
    };
    use crate::transfer::cuda::{CudaBuffer, CudaDevice};
    use crate::transfer::ucx::Registrable as _;

    fn call<T>(op: &'static str, r: Result<T, result::DriverError>) -> Result<T, CudaBatchError> {
        r.map_err(|e| CudaBatchError::Call { op, reason: e.to_string() })
    }

    /// `cuMemcpyBatchAsync_v2` (cuda.h of CUDA 13.0).
    type BatchV2 = unsafe extern "C" fn(
        *mut sys::CUdeviceptr,
        *mut sys::CUdeviceptr,
        *mut usize,
        usize,
        *mut sys::CUmemcpyAttributes,
        *mut usize,
        usize,
        sys::CUstream,
    ) -> sys::CUresult;
    /// `cuMemcpyBatchAsync` (cuda.h of CUDA 12.8: with `failIdx` before the stream).
    type BatchV1 = unsafe extern "C" fn(
        *mut sys::CUdeviceptr,
        *mut sys::CUdeviceptr,
        *mut usize,
        usize,
        *mut sys::CUmemcpyAttributes,
        *mut usize,
        usize,
        *mut usize,
        sys::CUstream,
    ) -> sys::CUresult;

    /// A driver entry point looked up by name, `None` when this libcuda lacks it. cudarc's own
    /// wrappers panic on a missing symbol, so version-specific functions are resolved here.
    fn lookup<F: Copy>(name: &[u8]) -> Option<F> {
        // SAFETY: callers hold an open `CudaDevice`, so libcuda is loaded (culib() does not
        // panic); `F` is the function type of the C declaration of `name` (the aliases above,
        // copied from cuda.h), and the library stays loaded for the life of the process.
        unsafe { sys::culib().get::<F>(name).ok().map(|sym| *sym) }
    }

    fn driver_version() -> Result<i32, CudaBatchError> {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the driver is loaded and initialised (a device was opened); valid out pointer.
        call("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v).result() })?;
        Ok(v)
    }

    /// Exports `buf` (a whole `cuMemAlloc` allocation) for CUDA IPC.
    pub fn export(buf: &CudaBuffer) -> Result<CudaIpcExport, CudaBatchError> {
        let _cur = buf.cuda_device().scoped()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
        // SAFETY: `buf.addr()` is the base of a live cuMemAlloc allocation of the current
        // context (`CudaBuffer` owns it until Drop); `handle` is a valid out pointer.
        call("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut handle, buf.addr()).result() })?;
        Ok(CudaIpcExport {
            handle: handle.reserved.iter().map(|&c| c as u8).collect(),
            base_addr: buf.addr(),
            len: buf.len() as u64,
            device: buf.device(),
            machine_id: super::machine_id(),
            pid: std::process::id(),
        })
    }

    /// A peer's exported pool, mapped into this process with `cuIpcOpenMemHandle` (lazy peer
    /// access, so it works across devices that can reach each other) and closed on drop.
    pub struct PeerMapping {
        ptr: sys::CUdeviceptr,
        len: u64,
        peer: String,
        // Closed while its device is still held.
        dev: Arc<CudaDevice>,
    }

    impl std::fmt::Debug for PeerMapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("PeerMapping")
                .field("peer", &self.peer)
                .field("ptr", &format_args!("{:#x}", self.ptr))
                .field("len", &self.len)
                .finish()
        }
    }

    impl PeerMapping {
        /// Opens `peer`'s export on `dev`, after [`super::check_export`]'s refusals (none
        /// advertised, another machine, this process). The mapping's length is what CUDA
        /// says the allocation spans, never more than advertised: a copy past it would fault
        /// the GPU context, which no error recovers from.
        pub fn open(
            dev: &Arc<CudaDevice>,
            peer: &str,
            export: Option<&CudaIpcExport>,
        ) -> Result<Arc<PeerMapping>, CudaBatchError> {
            let e = super::check_export(peer, export)?;
            let _cur = dev.scoped()?;
            let mut handle = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_BYTES] };
            for (d, &b) in handle.reserved.iter_mut().zip(&e.handle) {
                *d = b as c_char;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
            // SAFETY: `handle` holds 64 bytes of a peer's cuIpcGetMemHandle (length checked);
            // the driver validates it and fails cleanly on a stale or foreign one; `ptr` is a
            // valid out pointer; this device's context is current.
            unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags).result() }
                .map_err(|err| CudaBatchError::Open { peer: peer.to_string(), reason: err.to_string() })?;
            // From here the mapping is owned: closed on every path below by Drop.
            let mut mapping = PeerMapping { ptr, len: 0, peer: peer.to_string(), dev: Arc::clone(dev) };
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: `ptr` was just mapped in the current context; valid out pointers.
            call("cuMemGetAddressRange", unsafe {
                sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result()
            })?;
            let mapped = (base + size as u64).saturating_sub(ptr);
            if mapped < e.len {
                tracing::warn!(
                    "{peer} advertises a {}-byte pool but CUDA maps {mapped} bytes of it; using {mapped}",
                    e.len
                );
            }
            mapping.len = e.len.min(mapped);
            Ok(Arc::new(mapping))
        }

        /// The mapped pool as the packer sees it.
        pub fn span(&self) -> Span {
            Span { base: self.ptr, len: self.len }
        }
    }

    impl Drop for PeerMapping {
        fn drop(&mut self) {
            let cur = self.dev.scoped();
            if let Err(e) = &cur {
                tracing::warn!("closing {}'s CUDA IPC mapping without its context current: {e}", self.peer);
            }
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once; copies that read
            // it hold this mapping (`BatchCopier::in_flight`) until their stream drained.
            if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.ptr).result() } {
                tracing::warn!("cuIpcCloseMemHandle of {}'s pool failed: {e}", self.peer);
            }
            drop(cur);
        }
    }

    /// The gather-copy kernel's PTX, NUL-terminated for `cuModuleLoadData`.
    const GATHER_PTX: &str = concat!(include_str!("gather.ptx"), "\0");
    /// Threads per block of the gather kernel: one block copies one piece (at most
    /// [`GATHER_PIECE`] bytes), each thread four 16-byte units per step, so an 8 KiB piece is
    /// one step with all its loads in flight before its stores. 256 threads doing one unit per
    /// step read P8->D2 8 KiB blocks at 0.27x of an H200's device copy (results/gpu-nvidia-h200-2026-11-27.json).
    const GATHER_THREADS: u32 = 128;
    /// Most blocks one launch starts; the kernel's blocks loop over the pieces beyond.
    const GATHER_MAX_BLOCKS: usize = 1 << 20;
    /// Threads per block of `kvx_grid_expand` (one descriptor each, then the grid's stride).
    const EXPAND_THREADS: u32 = 256;

    /// One launch of `kvx_gather_copy(u64 descs, u64 count)` on `stream`: `count` descriptors
    /// of three u64 from device address `descs`, one thread block per descriptor (the grid
    /// loops beyond [`GATHER_MAX_BLOCKS`]).
    ///
    /// # Safety
    /// `func` is the gather kernel of the current context and `stream` one of its streams;
    /// `descs` holds `count` descriptors by the time the launch runs in stream order, each
    /// inside memory this context may read (source) and write (destination).
    unsafe fn launch_gather(
        func: sys::CUfunction,
        stream: sys::CUstream,
        descs: u64,
        count: usize,
    ) -> Result<(), CudaBatchError> {
        let (mut p_descs, mut p_count) = (descs, count as u64);
        let mut params = [(&raw mut p_descs).cast::<c_void>(), (&raw mut p_count).cast::<c_void>()];
        let blocks = count.clamp(1, GATHER_MAX_BLOCKS) as u32;
        // SAFETY: the kernel takes the two u64 `params` point to (read during the call); the
        // rest is the caller's promise.
        call("cuLaunchKernel", unsafe {
            result::launch_kernel(func, (blocks, 1, 1), (GATHER_THREADS, 1, 1), 0, stream, &mut params)
        })
    }

    /// kvx's gather-copy kernel, loaded into a copier's context, and one descriptor array per
    /// batch that may be in flight at once.
    struct Gather {
        module: sys::CUmodule,
        func: sys::CUfunction,
        /// `kvx_grid_expand`: a grid batch's descriptors made on the device.
        expand: sys::CUfunction,
        /// Slot `i` serves the `i`-th batch posted since the copier last waited, so a batch
        /// never writes descriptors that an earlier one's upload or kernel still reads.
        slots: Vec<Slot>,
    }

    /// One batch's descriptor array: pinned on the host (the upload is truly asynchronous, so
    /// the host posts the next batch while this one copies) and in device memory.
    struct Slot {
        host: crate::transfer::cuda::Pinned,
        descs: CudaBuffer,
    }

    impl Slot {
        /// Room for `words` u64 on both sides; a context must be current.
        fn new(dev: &Arc<CudaDevice>, words: usize) -> Result<Slot, CudaBatchError> {
            let bytes = (words * 8).next_power_of_two().max(4096);
            Ok(Slot {
                host: crate::transfer::cuda::Pinned::alloc(bytes)?,
                descs: CudaBuffer::alloc(dev, bytes)?,
            })
        }

        fn words(&self) -> usize {
            self.descs.len() / 8
        }
    }

    impl Gather {
        /// Slot `i` with room for `words` u64 (made or grown here). Slot `i` is free when the
        /// copier posts its `i`-th batch of a round: the batches before it use lower slots,
        /// and every earlier round has completed.
        fn slot(
            &mut self,
            dev: &Arc<CudaDevice>,
            i: usize,
            words: usize,
        ) -> Result<&mut Slot, CudaBatchError> {
            if self.slots.len() <= i {
                self.slots.push(Slot::new(dev, words)?);
            } else if self.slots[i].words() < words {
                self.slots[i] = Slot::new(dev, words)?;
            }
            Ok(&mut self.slots[i])
        }

        /// JIT-compiles `gather.ptx` for this device (the current context's).
        fn load() -> Result<Gather, CudaBatchError> {
            // SAFETY: a NUL-terminated PTX image that outlives the call; the module belongs to
            // the current context and is unloaded once, in the copier's Drop.
            let module =
                call("cuModuleLoadData", unsafe { result::module::load_data(GATHER_PTX.as_ptr().cast()) })?;
            // SAFETY: `module` was just loaded and is not unloaded before this returns.
            let funcs = unsafe { result::module::get_function(module, c"kvx_gather_copy".to_owned()) }
                .and_then(
                    // SAFETY: as above.
                    |func| {
                        unsafe { result::module::get_function(module, c"kvx_grid_expand".to_owned()) }
                            .map(|e| (func, e))
                    },
                );
            match funcs {
                Ok((func, expand)) => Ok(Gather { module, func, expand, slots: Vec::new() }),
                Err(e) => {
                    // SAFETY: nothing uses the module: a function of it was not found.
                    let _ = unsafe { result::module::unload(module) };
                    Err(CudaBatchError::Call { op: "cuModuleGetFunction", reason: e.to_string() })
                }
            }
        }
    }

    /// One stream and one event on a device, and the driver's best way to issue many copies
    /// at once ([`BatchPath`]).
    pub struct BatchCopier {
        stream: sys::CUstream,
        event: sys::CUevent,
        path: BatchPath,
        v2: Option<BatchV2>,
        v1: Option<BatchV1>,
        /// `--batch-copy kernel`: the gather kernel.
        gather: Option<Gather>,
        /// The path was forced (`--batch-copy` other than `api`): a batch entry point that
        /// refuses is an error, not a fallback to one call per copy.
        forced: bool,
        /// Mappings a batch that has not completed reads from (posted and not waited for, or
        /// one that timed out): kept open until the event fires, or until Drop has
        /// synchronized the stream.
        in_flight: Vec<Arc<PeerMapping>>,
        /// `(dst, src, size)` as the three arrays the batch entry points take, refilled per
        /// batch.
        arrays: (Vec<u64>, Vec<u64>, Vec<usize>),
        /// Batches posted since the last wait, and their copies.
        posted: usize,
        posted_copies: usize,
        // Released after the stream and event (Drop runs first).
        dev: Arc<CudaDevice>,
    }

    impl std::fmt::Debug for BatchCopier {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("BatchCopier")
                .field("device", &self.dev.ordinal())
                .field("path", &self.path)
                .finish()
        }
    }

    impl BatchCopier {
        /// A copier on `dev`: a non-blocking stream, an event without timing, and how `copy`
        /// issues batches ([`BatchCopy::choose`]): the gather kernel, the batch entry point
        /// this driver has (v2 from CUDA 13.0, v1 from 12.8, else one call per copy), or the
        /// one path `copy` forces, failing with the flag's name when the driver lacks it.
        pub fn new(dev: &Arc<CudaDevice>, copy: BatchCopy) -> Result<BatchCopier, CudaBatchError> {
            let _cur = dev.scoped()?;
            let version = driver_version()?;
            let wants = |path: BatchPath| copy == BatchCopy::Api || copy.forced() == Some(path);
            let v2 = if wants(BatchPath::BatchV2) && version >= 13000 {
                lookup::<BatchV2>(b"cuMemcpyBatchAsync_v2\0")
            } else {
                None
            };
            let v1 = if wants(BatchPath::BatchV1) && version >= 12080 {
                lookup::<BatchV1>(b"cuMemcpyBatchAsync\0")
            } else {
                None
            };
            let path = copy.choose(version, v2.is_some(), v1.is_some())?;
            let gather = if path == BatchPath::Kernel { Some(Gather::load()?) } else { None };
            let stream =
                call("cuStreamCreate", result::stream::create(result::stream::StreamKind::NonBlocking))?;
            let event = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
                Ok(e) => e,
                Err(e) => {
                    // SAFETY: the stream was created just above and has no work.
                    let _ = unsafe { result::stream::destroy(stream) };
                    return Err(CudaBatchError::Call { op: "cuEventCreate", reason: e.to_string() });
                }
            };
            if path == BatchPath::PerDescriptor && copy == BatchCopy::Api {
                tracing::info!(
                    "CUDA driver {version} has no cuMemcpyBatchAsync (12.8+): cuda-batch posts one copy per \
                     descriptor (--batch-copy kernel needs no batch API)"
                );
            }
            Ok(BatchCopier {
                stream,
                event,
                path,
                v2,
                v1,
                gather,
                forced: copy.forced().is_some(),
                in_flight: Vec::new(),
                arrays: Default::default(),
                posted: 0,
                posted_copies: 0,
                dev: Arc::clone(dev),
            })
        }

        /// The path batches take on this driver.
        pub fn path(&self) -> BatchPath {
            self.path
        }

        /// Whether the device's contexts are shared through MPS, as the driver reports it
        /// (CU_DEVICE_ATTRIBUTE_MPS_ENABLED); a driver that does not know the attribute says
        /// no.
        pub fn under_mps(&self) -> bool {
            let Ok(dev) = result::device::get(self.dev.ordinal() as std::ffi::c_int) else {
                return false;
            };
            // SAFETY: `dev` was just returned by cuDeviceGet.
            let on = unsafe {
                result::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
            };
            on.is_ok_and(|v| v != 0)
        }

        /// Copies `batch` (packed against `local` and `peer`) with one batched call, records
        /// one event and waits for it until `timeout`. On a timeout the copies may still land
        /// in `local` later (the request has failed; its bytes are not used), and `peer` stays
        /// mapped until they have.
        pub fn copy(
            &mut self,
            local: &mut CudaBuffer,
            peer: &Arc<PeerMapping>,
            batch: &mut CopyBatch,
            timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            let t0 = Instant::now();
            let mut st =
                self.enqueue(local, std::slice::from_ref(peer), std::slice::from_mut(batch), timeout)?;
            self.finish(timeout)?;
            st.complete_ns = t0.elapsed().as_nanos() as u64;
            Ok(st)
        }

        /// Posts one batch made of `parts` (packed against `local` and, in order, `peers`: the
        /// parts' peers one after the other) behind the batches posted since the last
        /// [`finish`](Self::finish), on the one stream, and returns without waiting: the host
        /// packs and posts the next batch while this one copies. One upload and one launch
        /// (or one batch call) for all parts. Its stats have `complete_ns` 0.
        pub fn enqueue(
            &mut self,
            local: &mut CudaBuffer,
            peers: &[Arc<PeerMapping>],
            parts: &mut [CopyBatch],
            timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            let packed = parts.iter().flat_map(|b| b.peers.iter().copied());
            let local_span = Span { base: local.addr(), len: local.len() as u64 };
            if parts.iter().any(|b| b.local != local_span) || !packed.eq(peers.iter().map(|p| p.span())) {
                return Err(CudaBatchError::WrongBuffers);
            }
            let n: usize = parts.iter().map(CopyBatch::copies).sum();
            let mut st = self.submit(local, peers, n, timeout, |c| c.post(parts))?;
            st.calls = self.path.calls(n);
            st.descriptors = parts.iter().map(CopyBatch::descriptors).sum();
            st.bytes = parts.iter().map(CopyBatch::bytes).sum();
            st.unaligned_descriptors = parts.iter().map(CopyBatch::unaligned_descriptors).sum();
            Ok(st)
        }

        /// What both enqueues do around their posting: the pool's device checked, a batch
        /// that timed out before waited for, `post` run when there are `copies`, the event
        /// recorded, the peers kept mapped until it fires. Returns the posting's stats (its
        /// counts are the caller's to fill).
        fn submit(
            &mut self,
            local: &CudaBuffer,
            peers: &[Arc<PeerMapping>],
            copies: usize,
            timeout: Duration,
            post: impl FnOnce(&mut Self) -> Result<u64, CudaBatchError>,
        ) -> Result<BatchStats, CudaBatchError> {
            if local.device() != self.dev.ordinal() {
                return Err(CudaBatchError::Call {
                    op: "cuda-batch copy",
                    reason: format!(
                        "the KV pool is on device {} but the copier on device {}",
                        local.device(),
                        self.dev.ordinal()
                    ),
                });
            }
            let dev = Arc::clone(&self.dev);
            let _cur = dev.scoped()?;
            let t0 = Instant::now();
            // A batch that timed out before must finish before this one can be told apart
            // (and before its descriptor slot is written again).
            if self.posted == 0 && !self.in_flight.is_empty() {
                self.wait(t0 + timeout, timeout, 0)?;
            }
            let fill_ns = if copies > 0 { post(self)? } else { 0 };
            // SAFETY: event and stream belong to this copier and the current context.
            call("cuEventRecord", unsafe { result::event::record(self.event, self.stream) })?;
            let post_ns = t0.elapsed().as_nanos() as u64;
            self.in_flight.extend(peers.iter().cloned());
            self.posted += 1;
            self.posted_copies += copies;
            Ok(BatchStats { post_ns, fill_ns, copies: copies as u64, ..BatchStats::default() })
        }

        /// Waits until `timeout` for every batch posted since the last wait (the event
        /// recorded after the last one: one stream runs them in order). Nanoseconds waited.
        pub fn finish(&mut self, timeout: Duration) -> Result<u64, CudaBatchError> {
            let _cur = self.dev.scoped()?;
            let t0 = Instant::now();
            let copies = self.posted_copies;
            // Whatever the outcome, the next batch starts a new round: after a timeout it
            // first waits for these (`in_flight` is kept until the event fires).
            self.posted = 0;
            self.posted_copies = 0;
            self.wait(t0 + timeout, timeout, copies)?;
            Ok(t0.elapsed().as_nanos() as u64)
        }

        /// Posts one grid batch ([`GridBatch`], packed against `local` and, in order, `peers`)
        /// as [`enqueue`](Self::enqueue) posts a batch: its table uploaded, one launch of
        /// `kvx_grid_expand` writing the descriptors on the device, one of the gather kernel
        /// copying them, then the event. Needs the gather kernel (`--batch-copy kernel`).
        pub fn enqueue_grid(
            &mut self,
            local: &mut CudaBuffer,
            peers: &[Arc<PeerMapping>],
            grid: &GridBatch,
            timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            let local_span = Span { base: local.addr(), len: local.len() as u64 };
            if grid.local() != local_span || !grid.peers().iter().copied().eq(peers.iter().map(|p| p.span()))
            {
                return Err(CudaBatchError::WrongBuffers);
            }
            let n = grid.descriptors() as usize;
            let mut st = self.submit(local, peers, n, timeout, |c| c.post_grid(grid))?;
            // The table's upload and the two launches.
            st.calls = if n > 0 { 3 } else { 0 };
            st.descriptors = grid.descriptors();
            st.bytes = grid.bytes();
            st.unaligned_descriptors = grid.unaligned_descriptors();
            Ok(st)
        }

        /// The grid's upload and two launches (see [`enqueue_grid`](Self::enqueue_grid)), in
        /// slot `posted` as [`post_kernel`](Self::post_kernel) uses it: the descriptors first,
        /// the table behind them.
        fn post_grid(&mut self, grid: &GridBatch) -> Result<u64, CudaBatchError> {
            let Some(g) = self.gather.as_mut().filter(|_| self.path == BatchPath::Kernel) else {
                return Err(CudaBatchError::Call {
                    op: "cuda-batch --batch-descriptors device",
                    reason: "descriptors made on the device need the gather kernel (--batch-copy kernel)"
                        .into(),
                });
            };
            let count = grid.descriptors() as usize;
            let table = grid.words();
            let words = 3 * count + table.len();
            let slot = g.slot(&self.dev, self.posted, words)?;
            let t_fill = Instant::now();
            let host = &mut slot.host.words()[..table.len()];
            host.copy_from_slice(table);
            let fill_ns = t_fill.elapsed().as_nanos() as u64;
            let descs = slot.descs.addr();
            let table_at = descs + 8 * (3 * count) as u64;
            // SAFETY: the slot's device array holds `words` u64, the table's `table.len()` of
            // them from `table_at`; the pinned source is not written again before the copier
            // has waited for this batch (slot discipline, as in `post_kernel`).
            call("cuMemcpyHtoDAsync", unsafe { result::memcpy_htod_async(table_at, &*host, self.stream) })?;
            let (mut p_regions, mut p_blocks) = (table_at, table_at + 8 * grid.table_words() as u64);
            let (mut p_pairs, mut p_count, mut p_descs) = (grid.pairs(), count as u64, descs);
            let mut params = [
                (&raw mut p_regions).cast::<c_void>(),
                (&raw mut p_blocks).cast::<c_void>(),
                (&raw mut p_pairs).cast::<c_void>(),
                (&raw mut p_count).cast::<c_void>(),
                (&raw mut p_descs).cast::<c_void>(),
            ];
            let blocks = count.div_ceil(EXPAND_THREADS as usize).clamp(1, GATHER_MAX_BLOCKS) as u32;
            // SAFETY: `kvx_grid_expand(u64 regions, u64 blocks, u64 nblocks, u64 count, u64
            // descs)` takes the five u64 `params` point to; it reads the table just uploaded
            // (regions x 5 and pairs x 2 u64) and writes `count` descriptors of three u64 from
            // `descs`, all inside the slot, in stream order after the upload.
            call("cuLaunchKernel", unsafe {
                result::launch_kernel(
                    g.expand,
                    (blocks, 1, 1),
                    (EXPAND_THREADS, 1, 1),
                    0,
                    self.stream,
                    &mut params,
                )
            })?;
            // SAFETY: the descriptors the launch before wrote on this stream each lie inside
            // the local pool and the mapped peer pool (`GridBatch::pack` checked every region
            // at its furthest block on both sides).
            unsafe { launch_gather(g.func, self.stream, descs, count) }?;
            Ok(fill_ns)
        }

        /// Issues the batch's copies on the stream, by the copier's path. With `--batch-copy api`
        /// a batch entry point that says it is not supported makes this copier fall back to one
        /// call per copy, for good; a forced path fails instead, naming the flag.
        /// Returns the host's nanoseconds writing kernel descriptors (0 on the other paths).
        fn post(&mut self, parts: &[CopyBatch]) -> Result<u64, CudaBatchError> {
            let n: usize = parts.iter().map(CopyBatch::copies).sum();
            let here = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.dev.ordinal() as std::ffi::c_int,
            };
            let mut attrs = sys::CUmemcpyAttributes {
                // Sources are read in stream order (after what the stream did before), which
                // is what a READ of blocks the prefill rank already wrote needs.
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: here,
                dstLocHint: here,
                flags: 0,
            };
            let mut attr_idx: usize = 0;
            if self.path == BatchPath::Kernel {
                return self.post_kernel(parts);
            }
            // The batch entry points take three arrays (read during the call).
            let (d, s, z) = &mut self.arrays;
            d.clear();
            s.clear();
            z.clear();
            for (dst, src, size) in parts.iter().flat_map(CopyBatch::entries) {
                d.push(dst);
                s.push(src);
                z.push(size);
            }
            let (dsts, srcs, sizes) = (d.as_mut_ptr(), s.as_mut_ptr(), z.as_mut_ptr());
            let rc = match (self.path, self.v2, self.v1) {
                (BatchPath::BatchV2, Some(f), _) => {
                    // SAFETY: the three arrays hold `n` entries each (the copier's, filled from
                    // one CopyBatch just above, not touched during the call); every (dst, src, size) lies inside the local pool
                    // and the mapped peer pool (checked by `pack`, and `copy` checked the batch
                    // was packed against these two); one attribute applies to all copies
                    // (index 0); the stream is this copier's, in the current context.
                    unsafe { f(dsts, srcs, sizes, n, &mut attrs, &mut attr_idx, 1, self.stream) }
                }
                (BatchPath::BatchV1, _, Some(f)) => {
                    let mut fail_idx: usize = usize::MAX;
                    // SAFETY: as for v2; `fail_idx` is a valid out pointer.
                    let rc = unsafe {
                        f(dsts, srcs, sizes, n, &mut attrs, &mut attr_idx, 1, &mut fail_idx, self.stream)
                    };
                    if rc != sys::CUresult::CUDA_SUCCESS && fail_idx != usize::MAX {
                        tracing::debug!("cuMemcpyBatchAsync failed at copy {fail_idx} of {n}");
                    }
                    rc
                }
                _ => return self.post_each(parts).map(|()| 0),
            };
            match rc {
                sys::CUresult::CUDA_SUCCESS => Ok(0),
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED if self.forced => {
                    let (call, since, flag) = match self.path {
                        BatchPath::BatchV2 => ("cuMemcpyBatchAsync_v2", "13.0", "--batch-copy api-v2"),
                        _ => ("cuMemcpyBatchAsync", "12.8", "--batch-copy api-v1"),
                    };
                    Err(CudaBatchError::PathUnavailable {
                        flag: flag.into(),
                        call,
                        since,
                        driver: driver_version().unwrap_or(0),
                    })
                }
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => {
                    tracing::warn!(
                        "{} is not supported here: cuda-batch falls back to one copy per descriptor",
                        self.path.driver_call()
                    );
                    self.path = BatchPath::PerDescriptor;
                    self.post_each(parts).map(|()| 0)
                }
                rc => Err(CudaBatchError::Call {
                    op: if self.path == BatchPath::BatchV2 {
                        "cuMemcpyBatchAsync_v2"
                    } else {
                        "cuMemcpyBatchAsync"
                    },
                    reason: result::DriverError(rc).to_string(),
                }),
            }
        }

        /// The gather kernel: the batch's pieces ([`super::gather_descriptors`]) written to
        /// this batch's pinned slot, uploaded to its device array, then one launch that moves
        /// them all, both on the stream. Slot `posted` is free: the batches before it in this
        /// round use lower slots, and every earlier round has completed (`finish`, or the wait
        /// in `enqueue` after a timeout), so it may be written and grown.
        fn post_kernel(&mut self, parts: &[CopyBatch]) -> Result<u64, CudaBatchError> {
            let Some(g) = self.gather.as_mut() else {
                return Err(CudaBatchError::Call {
                    op: "cuda-batch kernel",
                    reason: "the kernel is not loaded".into(),
                });
            };
            let counts: Vec<usize> = parts.iter().map(|b| super::gather_pieces(b, GATHER_PIECE)).collect();
            let pieces: usize = counts.iter().sum();
            let words = 3 * pieces;
            let slot = g.slot(&self.dev, self.posted, words)?;
            let host = &mut slot.host.words()[..words];
            let t_fill = Instant::now();
            // Each part's pieces into its own stretch of the slot, in order (on rayon's threads
            // when the parts are large, as they were packed: `pack_parts`).
            let n: usize = {
                let mut stretches = Vec::with_capacity(parts.len());
                let mut rest = &mut *host;
                for &c in &counts {
                    let (head, tail) = rest.split_at_mut(3 * c);
                    stretches.push(head);
                    rest = tail;
                }
                let fill = |(b, out): (&CopyBatch, &mut &mut [u64])| super::gather_into(b, GATHER_PIECE, out);
                if parts.len() > 1 && pieces >= super::PARALLEL_PAIRS && rayon::current_num_threads() >= 4 {
                    use rayon::prelude::*;
                    parts.par_iter().zip(stretches.par_iter_mut()).map(fill).sum()
                } else {
                    parts.iter().zip(stretches.iter_mut()).map(fill).sum()
                }
            };
            let fill_ns = t_fill.elapsed().as_nanos() as u64;
            debug_assert_eq!(n, pieces);
            let descs = slot.descs.addr();
            // SAFETY: `descs` holds at least `words` u64 of this context; the source is this
            // slot's pinned memory, which nothing writes again before the copier has waited
            // for this batch (slot discipline above), so the asynchronous upload reads it
            // unchanged.
            call("cuMemcpyHtoDAsync", unsafe { result::memcpy_htod_async(descs, &*host, self.stream) })?;
            // SAFETY: every piece lies inside the local pool and the mapped peer pool (`pack`
            // checked each copy, and pieces split copies without leaving them); the launch
            // follows the descriptor upload on this stream.
            unsafe { launch_gather(g.func, self.stream, descs, pieces) }?;
            Ok(fill_ns)
        }

        /// One `cuMemcpyDtoDAsync` per copy on the stream (a driver without the batch API).
        fn post_each(&self, parts: &[CopyBatch]) -> Result<(), CudaBatchError> {
            for (dst, src, size) in parts.iter().flat_map(CopyBatch::entries) {
                // SAFETY: as in `post`: both ranges lie inside their pools, ordered on this
                // copier's stream in the current context.
                call("cuMemcpyDtoDAsync", unsafe { result::memcpy_dtod_async(dst, src, size, self.stream) })?;
            }
            Ok(())
        }

        /// Waits for the event until `deadline`: spinning first (a batch of small copies ends
        /// within microseconds), then yielding the core between queries.
        fn wait(
            &mut self,
            deadline: Instant,
            timeout: Duration,
            copies: usize,
        ) -> Result<(), CudaBatchError> {
            let start = Instant::now();
            loop {
                // SAFETY: the event belongs to this copier and the current context.
                match unsafe { result::event::query(self.event) } {
                    Ok(()) => {
                        self.in_flight.clear();
                        return Ok(());
                    }
                    Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => {}
                    Err(e) => return Err(CudaBatchError::Call { op: "cuEventQuery", reason: e.to_string() }),
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(CudaBatchError::Timeout { copies, timeout });
                }
                if now - start < Duration::from_micros(50) {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    impl Drop for BatchCopier {
        fn drop(&mut self) {
            let cur = self.dev.scoped();
            if let Err(e) = &cur {
                tracing::warn!("releasing the cuda-batch stream without its context current: {e}");
            }
            // SAFETY: the stream and event were created by this copier in this device's
            // context and are released once; the synchronize first lets every copy finish,
            // so no mapping in `in_flight` (dropped after this) is closed under a copy.
            unsafe {
                if let Err(e) = result::stream::synchronize(self.stream) {
                    tracing::warn!("synchronizing the cuda-batch stream failed: {e}");
                }
                if let Err(e) = result::event::destroy(self.event) {
                    tracing::warn!("cuEventDestroy failed: {e}");
                }
                if let Err(e) = result::stream::destroy(self.stream) {
                    tracing::warn!("cuStreamDestroy failed: {e}");
                }
                if let Some(g) = self.gather.take()
                    && let Err(e) = result::module::unload(g.module)
                {
                    tracing::warn!("cuModuleUnload of the gather kernel failed: {e}");
                }
            }
            self.in_flight.clear();
            drop(cur);
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    //! Built without the `cuda` feature: the types exist (so callers need no `cfg`) but cannot
    //! be constructed; every constructor says how to get CUDA support.
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::time::Duration;

    use super::{BatchPath, BatchStats, CopyBatch, CudaBatchError, CudaIpcExport, GridBatch, Span};
    use crate::transfer::cuda::{CudaBuffer, CudaDevice, CudaError};

    pub fn export(_buf: &CudaBuffer) -> Result<CudaIpcExport, CudaBatchError> {
        Err(CudaError::NotBuilt.into())
    }

    /// Never constructed without the `cuda` feature.
    #[derive(Debug)]
    pub struct PeerMapping {
        never: Infallible,
    }

    impl PeerMapping {
        pub fn open(
            _dev: &Arc<CudaDevice>,
            _peer: &str,
            _export: Option<&CudaIpcExport>,
        ) -> Result<Arc<PeerMapping>, CudaBatchError> {
            Err(CudaError::NotBuilt.into())
        }
        pub fn span(&self) -> Span {
            match self.never {}
        }
    }

    /// Never constructed without the `cuda` feature.
    #[derive(Debug)]
    pub struct BatchCopier {
        never: Infallible,
    }

    impl BatchCopier {
        pub fn new(_dev: &Arc<CudaDevice>, _copy: super::BatchCopy) -> Result<BatchCopier, CudaBatchError> {
            Err(CudaError::NotBuilt.into())
        }
        pub fn path(&self) -> BatchPath {
            match self.never {}
        }
        pub fn under_mps(&self) -> bool {
            match self.never {}
        }
        pub fn copy(
            &mut self,
            _local: &mut CudaBuffer,
            _peer: &Arc<PeerMapping>,
            _batch: &mut CopyBatch,
            _timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            match self.never {}
        }
        pub fn enqueue(
            &mut self,
            _local: &mut CudaBuffer,
            _peers: &[Arc<PeerMapping>],
            _parts: &mut [CopyBatch],
            _timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            match self.never {}
        }
        pub fn enqueue_grid(
            &mut self,
            _local: &mut CudaBuffer,
            _peers: &[Arc<PeerMapping>],
            _grid: &GridBatch,
            _timeout: Duration,
        ) -> Result<BatchStats, CudaBatchError> {
            match self.never {}
        }
        pub fn finish(&mut self, _timeout: Duration) -> Result<u64, CudaBatchError> {
            match self.never {}
        }
    }
}

#[cfg(test)]
mod ptx_sim;

#[cfg(test)]
mod tests {
    use super::*;

    const L: Span = Span { base: 0x7000_0000, len: 1 << 20 };
    const P: Span = Span { base: 0x9000_0000, len: 1 << 20 };

    fn pair(local: u64, remote: u64, len: u64) -> Pair {
        Pair { local, remote, len }
    }

    #[test]
    fn pairs_become_absolute_addresses_on_both_sides() {
        let mut b = CopyBatch::default();
        b.pack([pair(4096, 0, 512), pair(0, 8192, 256)], L, P).expect("in bounds");
        let got: Vec<_> = b.entries().collect();
        assert_eq!(got, vec![(L.base + 4096, P.base, 512), (L.base, P.base + 8192, 256)]);
        assert_eq!((b.copies(), b.descriptors(), b.bytes()), (2, 2, 768));
    }

    #[test]
    fn runs_contiguous_on_both_sides_are_one_copy_and_others_are_not() {
        let mut b = CopyBatch::default();
        let pairs = [
            pair(0, 0, 100),
            pair(100, 100, 100), // continues both: merged
            pair(200, 300, 100), // local continues, remote jumps: new copy
            pair(300, 400, 100), // continues the previous: merged
            pair(1000, 500, 0),  // empty: dropped, counted as a descriptor
            pair(400, 500, 100), // still continues (the empty one is not a gap)
            pair(0, 600, 100),   // local jumps back: new copy
        ];
        b.pack(pairs, L, P).expect("in bounds");
        let got: Vec<_> = b.entries().collect();
        assert_eq!(
            got,
            vec![(L.base, P.base, 200), (L.base + 200, P.base + 300, 300), (L.base, P.base + 600, 100)]
        );
        assert_eq!(b.descriptors(), 7);
        assert_eq!(b.bytes(), 600);
    }

    #[test]
    fn every_byte_of_the_plan_is_copied_once_in_order() {
        // A strided plan (vLLM's per-block descriptors) with some contiguous stretches.
        let pairs: Vec<Pair> =
            (0..64u64).map(|i| pair((i / 4) * 8192 + (i % 4) * 1024, i * 1024, 1024)).collect();
        let mut b = CopyBatch::default();
        b.pack(pairs.iter().copied(), L, P).expect("in bounds");
        assert_eq!(b.copies(), 16, "four blocks per run");
        let mut expanded = Vec::new();
        for (d, s, n) in b.entries() {
            for k in 0..(n as u64 / 1024) {
                expanded.push((d + k * 1024 - L.base, s + k * 1024 - P.base));
            }
        }
        let want: Vec<(u64, u64)> = pairs.iter().map(|p| (p.local, p.remote)).collect();
        assert_eq!(expanded, want);
    }

    #[test]
    fn a_pair_outside_either_buffer_is_refused_by_name_and_leaves_nothing() {
        let mut b = CopyBatch::default();
        let e = b.pack([pair(0, 0, 8), pair(L.len - 4, 0, 8)], L, P).expect_err("local overflow");
        assert_eq!(
            e,
            CudaBatchError::OutOfBounds {
                index: 1,
                side: "local",
                offset: L.len - 4,
                end: L.len + 4,
                len: L.len
            }
        );
        assert!(b.is_empty() && b.descriptors() == 0);
        let e = b.pack([pair(0, P.len, 1)], L, P).expect_err("peer overflow");
        assert!(matches!(e, CudaBatchError::OutOfBounds { side: "peer", index: 0, .. }), "{e}");
        // Offsets near u64::MAX do not wrap around into the buffer.
        let e = b.pack([pair(u64::MAX - 1, 0, 4)], L, P).expect_err("wrap");
        assert!(matches!(e, CudaBatchError::OutOfBounds { side: "local", .. }), "{e}");
        assert!(e.to_string().contains("outside"), "{e}");
        // The last byte of each buffer is fine.
        b.pack([pair(L.len - 1, P.len - 1, 1)], L, P).expect("last byte");
        assert_eq!(b.copies(), 1);
        // A span whose end would overflow the address space holds nothing.
        let top = Span { base: u64::MAX - 8, len: 64 };
        let e = b.pack([pair(0, 0, 1)], top, P).expect_err("span past the address space");
        assert!(matches!(e, CudaBatchError::OutOfBounds { side: "local", .. }), "{e}");
    }

    #[test]
    fn parts_packed_on_several_threads_are_the_parts_packed_one_by_one() {
        // Four peers of 5,000 pairs each (above PARALLEL_PAIRS together), packed on a pool of
        // four threads (where `pack_parts` goes parallel) and one by one.
        let peers: Vec<Span> = (0..4).map(|i| Span { base: P.base + (i << 24), len: 1 << 20 }).collect();
        let lists: Vec<Vec<Pair>> = (0..4u64)
            .map(|i| (0..5_000u64).map(|k| pair((k * 97 + i) % 8000 * 128, k % 4000 * 256, 64 + i)).collect())
            .collect();
        let jobs: Vec<(&[Pair], Span)> = lists.iter().map(Vec::as_slice).zip(peers.iter().copied()).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().expect("pool");
        let mut parallel = vec![CopyBatch::default(); 4];
        pool.install(|| pack_parts(&mut parallel, &jobs, L)).expect("in bounds");
        let mut serial = vec![CopyBatch::default(); 5];
        pack_parts(&mut serial[..1], &jobs[..1], L).expect("one part");
        for (b, (pairs, peer)) in serial.iter_mut().zip(&jobs).skip(1) {
            b.pack(pairs.iter().copied(), L, *peer).expect("in bounds");
        }
        assert_eq!(parallel[..], serial[..4]);
        assert_eq!(parallel.iter().map(CopyBatch::descriptors).sum::<u64>(), 20_000);
        // A pair out of bounds in the third part names that part.
        let mut bad = lists.clone();
        bad[2][10] = pair(L.len, 0, 8);
        let jobs: Vec<(&[Pair], Span)> = bad.iter().map(Vec::as_slice).zip(peers.iter().copied()).collect();
        let e = pool.install(|| pack_parts(&mut parallel, &jobs, L)).expect_err("out of bounds");
        assert!(matches!(e, (2, CudaBatchError::OutOfBounds { index: 10, side: "local", .. })), "{e:?}");
    }

    #[test]
    fn auto_launch_is_peer_under_mps_and_rank_without() {
        assert_eq!(BatchLaunch::default(), BatchLaunch::Auto);
        assert_eq!(BatchLaunch::Auto.resolve(true), BatchLaunch::Peer);
        assert_eq!(BatchLaunch::Auto.resolve(false), BatchLaunch::Rank);
        for chosen in [BatchLaunch::Rank, BatchLaunch::Peer] {
            assert_eq!(chosen.resolve(true), chosen, "an explicit choice stands");
            assert_eq!(chosen.resolve(false), chosen);
        }
    }

    #[test]
    fn copies_that_fit_one_piece_are_the_kernels_descriptors_as_they_stand() {
        // Copies of at most GATHER_PIECE - 15 bytes, at any alignment, are one piece each: the
        // fast path (the batch's words uploaded as they are) must give what splitting gives.
        let max = GATHER_PIECE - 15;
        let pairs = [pair(3, 5, 100), pair(4096, 0, max), pair(1 << 19, 1 << 19, 8192), pair(77, 1 << 18, 1)];
        let mut b = CopyBatch::default();
        b.pack(pairs, L, P).expect("in bounds");
        let mut out = Vec::new();
        assert_eq!(gather_descriptors(&b, GATHER_PIECE, &mut out), 4);
        let want: Vec<u64> = b.entries().flat_map(|(d, s, n)| [d, s, n as u64]).collect();
        assert_eq!(out, want);
        // One byte longer at a destination 15 bytes short of 16: two pieces (the slow path).
        b.pack([pair(15, 15, max + 1)], L, P).expect("in bounds");
        assert_eq!(gather_descriptors(&b, GATHER_PIECE, &mut out), 2);
        assert_eq!(out[2] + out[5], max + 1);
        assert_eq!(out[3], out[0] + out[2], "the second piece starts where the first ends");
    }

    #[test]
    fn adding_peers_makes_one_batch_that_never_merges_across_them() {
        const Q: Span = Span { base: P.base + P.len, len: 1 << 20 };
        let mut b = CopyBatch::default();
        // P's last 8 bytes and Q's first 8 are contiguous in the address space, and so are
        // the two destinations: still two copies, one per peer.
        b.pack([pair(0, P.len - 8, 8)], L, P).expect("first peer");
        b.add([pair(8, 0, 8), pair(16, 8, 8)], L, Q).expect("second peer");
        assert_eq!(
            b.entries().collect::<Vec<_>>(),
            vec![(L.base, P.base + P.len - 8, 8), (L.base + 8, Q.base, 16)],
            "within Q the two pairs merge"
        );
        assert_eq!((b.descriptors(), b.bytes()), (3, 24));
        assert_eq!(b.peers, vec![P, Q]);
        // An out-of-bounds pair names its index within its own peer's pairs, and empties the batch.
        let e = b.add([pair(0, 0, 8), pair(0, Q.len, 1)], L, Q).expect_err("peer overflow");
        assert!(matches!(e, CudaBatchError::OutOfBounds { index: 1, side: "peer", .. }), "{e:?}");
        assert!(b.is_empty() && b.peers.is_empty());
        // Another local buffer cannot join a batch.
        b.pack([pair(0, 0, 8)], L, P).expect("first");
        let other = Span { base: L.base + L.len, len: 4096 };
        assert!(matches!(b.add([pair(0, 0, 8)], other, Q), Err(CudaBatchError::WrongBuffers)));
        assert!(b.is_empty());
    }

    #[test]
    fn packing_again_replaces_the_batch() {
        let mut b = CopyBatch::default();
        b.pack([pair(0, 0, 8), pair(64, 64, 8)], L, P).expect("first");
        b.pack([pair(8, 8, 8)], L, P).expect("second");
        assert_eq!(b.entries().collect::<Vec<_>>(), vec![(L.base + 8, P.base + 8, 8)]);
        assert_eq!((b.descriptors(), b.bytes()), (1, 8));
    }

    #[test]
    fn gather_pieces_cover_every_copy_once_and_keep_16_byte_alignment() {
        let mut b = CopyBatch::default();
        // 100 KiB (split into 32 + 32 + 32 + 4 KiB), then 8 KiB, then an unaligned 7 bytes.
        b.pack([pair(0, 0, 100 << 10), pair(200 << 10, 300 << 10, 8192), pair(1 << 19, 3, 7)], L, P)
            .expect("in bounds");
        assert_eq!(b.unaligned_descriptors(), 1, "only the 7 bytes at peer offset 3");
        let mut out = vec![1, 2, 3];
        let n = gather_descriptors(&b, GATHER_PIECE, &mut out);
        assert_eq!(n, 6);
        assert_eq!(out.len(), 18, "three u64 per piece, nothing of before left");
        let pieces: Vec<(u64, u64, u64)> = out.chunks(3).map(|c| (c[0], c[1], c[2])).collect();
        assert_eq!(pieces[0], (L.base, P.base, 32 << 10));
        assert_eq!(pieces[3], (L.base + (96 << 10), P.base + (96 << 10), 4 << 10));
        assert_eq!(pieces[4], (L.base + (200 << 10), P.base + (300 << 10), 8192));
        assert_eq!(pieces[5], (L.base + (1 << 19), P.base + 3, 7));
        // Every byte of every copy, once, in order.
        let mut expanded = Vec::new();
        for (d, s, n) in b.entries() {
            expanded.extend((0..n as u64).map(|k| (d + k, s + k)));
        }
        let from_pieces: Vec<(u64, u64)> =
            pieces.iter().flat_map(|&(d, s, n)| (0..n).map(move |k| (d + k, s + k))).collect();
        assert_eq!(from_pieces, expanded);
        // Aligned copies stay aligned piece by piece (the kernel's 16-byte path, all body).
        assert!(pieces[..5].iter().all(|&(d, s, n)| (d | s | n) % 16 == 0), "{pieces:?}");
        assert!(pieces[..5].iter().all(
            |&(d, s, n)| gather_split(d, s, n) == GatherSplit { granule: 16, head: 0, body: n, tail: 0 }
        ));
        // dst and src differ by 3 modulo 16: bytes (the 7-byte copy is too short for more).
        assert_eq!(gather_split(L.base + (1 << 19), P.base + 3, 7).granule, 1);
        // A piece size that is not a multiple of 16 is rounded down to one.
        assert_eq!(gather_descriptors(&b, 40, &mut out), (100 << 10) / 32 + 8192 / 32 + 1);
        assert!(out.chunks(3).all(|c| c[2] <= 32));
    }

    #[test]
    fn unaligned_copies_keep_their_unit_in_every_piece() {
        // 100 KiB copies whose two sides agree modulo 16, 8, 4 and 1 (and a 16-aligned
        // length 3 bytes short): each piece gets the copy's unit and only its first piece a
        // head, only its last a tail.
        for (local, remote, len, granule) in [
            (3u64, 3u64, 100u64 << 10, 16u64),
            (5, 13, 100 << 10, 8),
            (1, 9 + 4, 100 << 10, 4),
            (0, 1, 100 << 10, 1),
            (16, 32, (100 << 10) - 3, 16),
        ] {
            let mut b = CopyBatch::default();
            b.pack([pair(local, remote, len)], L, P).expect("in bounds");
            assert_eq!(b.unaligned_descriptors(), 1, "{local} {remote} {len}");
            let mut out = Vec::new();
            let n = gather_descriptors(&b, GATHER_PIECE, &mut out);
            assert_eq!(n, 4);
            let pieces: Vec<(u64, u64, u64)> = out.chunks(3).map(|c| (c[0], c[1], c[2])).collect();
            for (i, &(d, s, n)) in pieces.iter().enumerate() {
                let split = gather_split(d, s, n);
                assert_eq!(split.granule, granule, "piece {i} of {local} {remote} {len}");
                assert!(i == 0 || split.head == 0, "piece {i}: {split:?}");
                assert!(i == pieces.len() - 1 || split.tail == 0, "piece {i}: {split:?}");
            }
        }
    }

    /// What the kernel does with one copy, byte for byte: heads, tails and units as
    /// [`gather_split`] says, each unit aligned on both sides.
    fn simulate(dst: u64, src: u64, len: u64) -> Vec<u64> {
        let sp = gather_split(dst, src, len);
        assert_eq!(sp.head + sp.body + sp.tail, len);
        assert!(sp.head < sp.granule && sp.tail < sp.granule, "{sp:?}");
        assert_eq!(sp.body % sp.granule, 0);
        let mut copied = Vec::new();
        copied.extend(0..sp.head);
        for unit in (sp.head..sp.head + sp.body).step_by(sp.granule as usize) {
            assert_eq!((dst + unit) % sp.granule, 0, "destination unit aligned: {dst} {src} {len} {sp:?}");
            assert_eq!((src + unit) % sp.granule, 0, "source unit aligned: {dst} {src} {len} {sp:?}");
            copied.extend(unit..unit + sp.granule);
        }
        copied.extend(sp.head + sp.body..len);
        copied
    }

    #[test]
    fn the_kernel_split_copies_every_byte_once_in_aligned_units() {
        for dst in 0..32u64 {
            for src in 0..32u64 {
                for len in (0..80u64).chain([4096, 8191, 8192, 8195, 32 << 10]) {
                    let (d, s) = (0x7000_0000 + dst, 0x9000_0000 + src);
                    assert_eq!(simulate(d, s, len), (0..len).collect::<Vec<_>>(), "{dst} {src} {len}");
                    let sp = gather_split(d, s, len);
                    let want = match (d ^ s) % 16 {
                        0 => 16,
                        8 => 8,
                        4 | 12 => 4,
                        _ => 1,
                    };
                    assert_eq!(sp.granule, want, "{dst} {src}");
                    if len >= 32 {
                        assert!(sp.body >= len - 2 * (want - 1), "at most a unit less a byte each end");
                    }
                }
            }
        }
    }

    /// Runs `gather.ptx` in the simulator on the pieces of `pairs` (local = destination
    /// offset, remote = source offset, in 64 KiB regions) and checks every destination byte,
    /// and that nothing else changed.
    fn run_kernel(pairs: &[Pair], blocks: u64, threads: u64) {
        const BASE: u64 = 0x7f00_0000_0000;
        const REGION: u64 = 64 << 10;
        let (src_at, dst_at) = (REGION, 2 * REGION);
        let mut mem = vec![0xee_u8; 3 * REGION as usize];
        for (i, b) in mem[src_at as usize..dst_at as usize].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31) ^ (i >> 8) as u8;
        }
        let mut batch = CopyBatch::default();
        let (dst, src) =
            (Span { base: BASE + dst_at, len: REGION }, Span { base: BASE + src_at, len: REGION });
        batch.pack(pairs.iter().copied(), dst, src).expect("in bounds");
        let mut descs = Vec::new();
        let pieces = gather_descriptors(&batch, GATHER_PIECE, &mut descs);
        assert!(24 * pieces as u64 <= REGION, "descriptors fit before the source");
        for (i, w) in descs.iter().enumerate() {
            mem[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        let before = mem.clone();
        let kernel = ptx_sim::Kernel::parse(
            include_str!("gather.ptx"),
            "kvx_gather_copy",
            &["kvx_gather_copy_descs", "kvx_gather_copy_count"],
        );
        kernel.run(blocks, threads, &[BASE, pieces as u64], &mut mem, BASE);
        let mut want = before;
        for p in pairs {
            let (d, s) = ((dst_at + p.local) as usize, (src_at + p.remote) as usize);
            let from = want[s..s + p.len as usize].to_vec();
            want[d..d + p.len as usize].copy_from_slice(&from);
        }
        let wrong: Vec<usize> = (0..mem.len()).filter(|&i| mem[i] != want[i]).take(5).collect();
        assert!(wrong.is_empty(), "first wrong bytes at {wrong:?} ({blocks}x{threads}, {pairs:?})");
    }

    #[test]
    fn the_gather_kernel_run_in_a_simulator_copies_every_byte_with_aligned_accesses() {
        // Destinations apart, each a different alignment case: aligned, same offset modulo 16
        // (head, 16-byte body, tail), modulo 8, modulo 4, none (bytes), tiny, empty, and one
        // longer than a piece whose two sides differ modulo 16.
        let pairs = [
            pair(0, 0, 4096),
            pair(4096 + 3, 3, 8192 + 5),
            pair(13_000 + 5, 13_000 + 13, 1000),
            pair(15_000 + 1, 15_000 + 13, 999),
            pair(17_000, 17_001, 777),
            pair(18_000 + 7, 18_002, 15),
            pair(18_100 + 9, 18_109, 1),
            pair(18_200 + 11, 18_204, 0),
            pair(20_000 + 1, 20_000 + 6, 40_000),
        ];
        run_kernel(&pairs, 3, 64);
        run_kernel(&pairs, 1, 256);
        // The launcher's block size: 8 KiB is one step of four units per thread.
        run_kernel(&pairs, 2, 128);
        run_kernel(&[pair(0, 0, 8192), pair(8192, 16_384, 8192), pair(16_384, 40_000, 8192 + 48)], 2, 128);
        // Fewer threads than a head or tail has bytes: the byte loops still cover them.
        run_kernel(&pairs[..2], 2, 4);
    }

    #[test]
    fn the_launcher_and_the_ptx_agree_on_the_kernels() {
        // The launcher passes (u64 descs, u64 count) to `kvx_gather_copy`, (u64 regions, u64
        // blocks, u64 nblocks, u64 count, u64 descs) to `kvx_grid_expand`, and both read or
        // write descriptors as three u64: the PTX must say the same.
        let ptx = include_str!("gather.ptx");
        let params = |entry: &str| -> Vec<String> {
            let (_, rest) = ptx.split_once(&format!(".visible .entry {entry}(")).expect("the entry point");
            let (head, _) = rest.split_once(')').expect("its parameters");
            head.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
        };
        let gather = params("kvx_gather_copy");
        assert_eq!(gather, [".param .u64 kvx_gather_copy_descs,", ".param .u64 kvx_gather_copy_count"]);
        let expand = params("kvx_grid_expand");
        let names = ["regions", "blocks", "nblocks", "count", "descs"];
        assert_eq!(expand.len(), names.len(), "{expand:?}");
        for (p, n) in expand.iter().zip(names) {
            assert!(p.starts_with(".param .u64 ") && p.contains(&format!("kvx_grid_expand_{n}")), "{p}");
        }
        assert!(ptx.contains("mul.lo.u64 \t%rd7, %rd3, 24;"), "24-byte descriptors read");
        assert!(ptx.contains("mul.lo.u64 \t%rd23, %rd10, 24;"), "24-byte descriptors written");
        assert!(ptx.contains("mul.lo.u64 \t%rd14, %rd12, 40;"), "five-word regions");
        assert_eq!(grid::REGION_WORDS, 5);
        assert!(ptx.contains(".address_size 64"));
    }

    #[test]
    fn the_expand_kernel_run_in_a_simulator_writes_the_grids_descriptors() {
        use crate::layouts::plan::RegionXfer;
        const BASE: u64 = 0x7f00_0000_0000;
        let region = |l_base, r_base, len| RegionXfer { l_base, l_step: 8192, r_base, r_step: 16_384, len };
        let a = [region(0, 0, 4096), region(1 << 19, 4096, 4096), region(4096, 8, 3)];
        let b = [region(4096, 4096, 4096)];
        let (l, r) = ([3u64, 0, 7, 5], [1u64, 5, 2, 60]);
        let mut g = GridBatch::default();
        g.pack(&[(&a, P), (&b, L)], &l, &r, L).expect("in bounds");
        let count = g.descriptors() as usize;
        let table_at = 24 * count;
        let mut mem = vec![0xee_u8; table_at + 8 * g.words().len()];
        for (i, w) in g.words().iter().enumerate() {
            mem[table_at + 8 * i..table_at + 8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        let kernel = ptx_sim::Kernel::parse(
            include_str!("gather.ptx"),
            "kvx_grid_expand",
            &[
                "kvx_grid_expand_regions",
                "kvx_grid_expand_blocks",
                "kvx_grid_expand_nblocks",
                "kvx_grid_expand_count",
                "kvx_grid_expand_descs",
            ],
        );
        let regions = BASE + table_at as u64;
        let blocks = regions + 8 * g.table_words() as u64;
        let want: Vec<u64> = g.expand().flat_map(|(d, s, n)| [d, s, n]).collect();
        assert_eq!(want.len(), 3 * 16);
        // More threads than descriptors, fewer (the grid-stride loop), one.
        for (grid_blocks, threads) in [(2, 32), (1, 5), (3, 2), (1, 1)] {
            let mut m = mem.clone();
            let params = [regions, blocks, g.pairs(), count as u64, BASE];
            kernel.run(grid_blocks, threads, &params, &mut m, BASE);
            let got: Vec<u64> =
                m[..table_at].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect();
            assert_eq!(got, want, "{grid_blocks}x{threads}");
            assert_eq!(m[table_at..], mem[table_at..], "the table is only read");
        }
        // No block pairs: nothing written, and no division by zero.
        let mut m = mem.clone();
        kernel.run(2, 4, &[regions, blocks, 0, 0, BASE], &mut m, BASE);
        assert_eq!(m, mem);
    }

    #[test]
    fn batch_paths_count_their_driver_calls() {
        assert_eq!(BatchPath::Kernel.calls(10_240), 2, "the descriptor copy and the launch");
        assert_eq!(BatchPath::Kernel.calls(0), 0);
        assert_eq!(BatchPath::BatchV2.calls(10_240), 1);
        assert_eq!(BatchPath::BatchV1.calls(0), 0);
        assert_eq!(BatchPath::PerDescriptor.calls(10_240), 10_240);
        assert_eq!(
            serde_json::to_string(&BatchPath::PerDescriptor).ok().as_deref(),
            Some("\"per-descriptor\"")
        );
        assert_eq!(BatchPath::BatchV1.to_string(), "batch-v1");
    }

    #[test]
    fn each_batch_copy_forces_its_path_or_names_the_flag() {
        // A CUDA 13 driver with both entry points, a 12.8 one with v1 only, a 12.4 one with none.
        let v13 = |c: BatchCopy| c.choose(13000, true, true);
        let v128 = |c: BatchCopy| c.choose(12080, false, true);
        let v124 = |c: BatchCopy| c.choose(12040, false, false);
        assert_eq!(v13(BatchCopy::Api), Ok(BatchPath::BatchV2));
        assert_eq!(v128(BatchCopy::Api), Ok(BatchPath::BatchV1));
        assert_eq!(v124(BatchCopy::Api), Ok(BatchPath::PerDescriptor), "api falls back, as before");
        assert_eq!(v13(BatchCopy::ApiV1), Ok(BatchPath::BatchV1));
        assert_eq!(v13(BatchCopy::PerCopy), Ok(BatchPath::PerDescriptor));
        assert_eq!(v124(BatchCopy::Kernel), Ok(BatchPath::Kernel));
        let e = v128(BatchCopy::ApiV2).expect_err("no v2 in 12.8");
        assert!(e.to_string().starts_with("--batch-copy api-v2 forces cuMemcpyBatchAsync_v2"), "{e}");
        assert!(e.to_string().contains("version 12080"), "{e}");
        let e = v124(BatchCopy::ApiV1).expect_err("no v1 in 12.4");
        assert!(e.to_string().contains("--batch-copy api-v1") && e.to_string().contains("12.8"), "{e}");
        for c in [BatchCopy::ApiV2, BatchCopy::ApiV1, BatchCopy::PerCopy, BatchCopy::Kernel] {
            assert_eq!(v13(c).ok(), c.forced(), "{c:?} forces the path it takes");
        }
        assert_eq!(BatchCopy::Api.forced(), None);
    }

    #[test]
    fn batch_copy_names_agree_between_flag_file_and_help() {
        use clap::ValueEnum as _;
        for c in BatchCopy::value_variants() {
            let flag = c.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(flag.as_deref(), Some(c.as_str()));
            let file = serde_json::to_string(c).ok();
            assert_eq!(file, Some(format!("\"{}\"", c.as_str())), "the bench file's spelling");
        }
        assert_eq!(BatchCopy::default(), BatchCopy::Kernel);
        assert!(BatchCopy::help().ends_with("[default: kernel]"), "{}", BatchCopy::help());
    }

    fn export(machine: &str, pid: u32, handle: usize) -> CudaIpcExport {
        CudaIpcExport {
            handle: vec![7; handle],
            base_addr: 0x1000,
            len: 4096,
            device: 0,
            machine_id: machine.into(),
            pid,
        }
    }

    #[test]
    fn exports_that_cannot_be_opened_here_are_refused_before_cuda() {
        let here = machine_id();
        assert!(!here.is_empty());
        let other_pid = std::process::id().wrapping_add(1);
        assert!(check_export("prefill rank 0", Some(&export(&here, other_pid, 64))).is_ok());
        let e = check_export("prefill rank 0", None).expect_err("none");
        assert!(e.to_string().contains("--transport cuda-batch"), "{e}");
        let e =
            check_export("prefill rank 1", Some(&export("elsewhere", other_pid, 64))).expect_err("machine");
        assert!(
            matches!(e, CudaBatchError::OtherMachine { .. }) && e.to_string().contains("--transport ucx")
        );
        let e = check_export("p", Some(&export(&here, std::process::id(), 64))).expect_err("same process");
        assert!(matches!(e, CudaBatchError::SameProcess { .. }), "{e}");
        let e = check_export("p", Some(&export(&here, other_pid, 63))).expect_err("short handle");
        assert_eq!(e, CudaBatchError::BadHandle { peer: "p".into(), len: 63 });
    }
}
