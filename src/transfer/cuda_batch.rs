//! `--transport cuda-batch`: KV blocks moved between GPUs of one machine with one batched
//! copy per peer and request, instead of one `cuMemcpyAsync` (plus an event) per descriptor
//! as UCX's cuda_ipc posts them.
//!
//! The prefill rank exports its whole KV pool once with `cuIpcGetMemHandle` ([`export`]);
//! the handle travels in its handshake metadata (`KvxMetadata::cuda_ipc`). A decode rank
//! opens each peer's handle once ([`PeerMapping::open`], closed on drop), packs one request's
//! descriptors from that peer into the `(dst, src, size)` arrays of a batched copy
//! ([`CopyBatch::pack`]: bounds-checked against both buffers, contiguous runs coalesced), and
//! [`BatchCopier::copy`] issues them as ONE `cuMemcpyBatchAsync_v2` (CUDA 13), else one
//! `cuMemcpyBatchAsync` (CUDA 12.8), else (an older driver) one `cuMemcpyDtoDAsync` per
//! copy on one stream; then records one event and waits for it with a deadline. Which of
//! the three ran is [`BatchPath`], reported with every request.
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
//! Not built: a gather-copy kernel (PTX loaded with `cuModuleLoadData`) that reads the
//! descriptor list from device memory. It could not be verified without a GPU; the batch
//! API is the one path here.
#![allow(unsafe_code, reason = "CUDA IPC and batched-copy driver calls of the cuda-batch transport")]

use serde::{Deserialize, Serialize};

use super::handshake::meta::CudaIpcExport;
use crate::layouts::plan::Pair;

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
}

impl BatchPath {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "batch-v2",
            BatchPath::BatchV1 => "batch-v1",
            BatchPath::PerDescriptor => "per-descriptor",
        }
    }

    /// The driver function behind the path, for reports.
    pub fn driver_call(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "cuMemcpyBatchAsync_v2",
            BatchPath::BatchV1 => "cuMemcpyBatchAsync",
            BatchPath::PerDescriptor => "cuMemcpyDtoDAsync per copy (no batch API in this driver)",
        }
    }

    /// Driver calls one batch of `copies` copies costs on this path.
    pub fn calls(self, copies: usize) -> u64 {
        match self {
            BatchPath::BatchV2 | BatchPath::BatchV1 => u64::from(copies > 0),
            BatchPath::PerDescriptor => copies as u64,
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

impl Span {
    /// The absolute address of `len` bytes at `offset`, if they lie inside the span.
    fn at(self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(())?;
        self.base.checked_add(offset)
    }
}

/// One request's copies from one peer, in the `(dst, src, size)` arrays a batched copy takes:
/// absolute device addresses inside `local` (destination) and `peer` (the mapped source),
/// each range checked against its buffer when packed, and ranges that continue the previous
/// one on both sides merged into it. The fields are private, so a batch only exists as
/// [`CopyBatch::pack`] built it: the copier relies on that to know every address is in bounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyBatch {
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    local: Span,
    peer: Span,
    descriptors: u64,
    bytes: u64,
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
        self.local = local;
        self.peer = peer;
        for (index, p) in pairs.into_iter().enumerate() {
            self.descriptors += 1;
            if p.len == 0 {
                continue;
            }
            let out = |side: &'static str, offset: u64, span: Span| CudaBatchError::OutOfBounds {
                index,
                side,
                offset,
                end: offset.saturating_add(p.len),
                len: span.len,
            };
            let (Some(dst), Some(src), Ok(size)) =
                (local.at(p.local, p.len), peer.at(p.remote, p.len), usize::try_from(p.len))
            else {
                let e = match local.at(p.local, p.len) {
                    None => out("local", p.local, local),
                    Some(_) => out("peer", p.remote, peer),
                };
                self.clear();
                return Err(e);
            };
            self.bytes += p.len;
            match (self.dsts.last(), self.srcs.last(), self.sizes.last_mut()) {
                (Some(&d), Some(&s), Some(n)) if d + *n as u64 == dst && s + *n as u64 == src => *n += size,
                _ => {
                    self.dsts.push(dst);
                    self.srcs.push(src);
                    self.sizes.push(size);
                }
            }
        }
        Ok(())
    }

    fn clear(&mut self) {
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        self.descriptors = 0;
        self.bytes = 0;
    }

    /// Copies after coalescing: the entries of one batched call.
    pub fn copies(&self) -> usize {
        self.sizes.len()
    }

    /// Plan descriptors packed (before coalescing, zero-length ones included).
    pub fn descriptors(&self) -> u64 {
        self.descriptors
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// `(dst, src, size)` of each copy.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, usize)> + '_ {
        self.dsts.iter().zip(&self.srcs).zip(&self.sizes).map(|((&d, &s), &n)| (d, s, n))
    }
}

/// What one batch cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchStats {
    /// Time to issue the driver call(s) and record the event.
    pub post_ns: u64,
    /// From the start of posting to the event's completion.
    pub complete_ns: u64,
    /// Driver calls made (1 with the batch API, one per copy without it).
    pub calls: u64,
    /// Copies after coalescing.
    pub copies: u64,
    /// Plan descriptors before coalescing.
    pub descriptors: u64,
    pub bytes: u64,
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
    fn batch_paths_count_their_driver_calls() {
        assert_eq!(BatchPath::BatchV2.calls(10_240), 1);
        assert_eq!(BatchPath::BatchV1.calls(0), 0);
        assert_eq!(BatchPath::PerDescriptor.calls(10_240), 10_240);
        assert_eq!(
            serde_json::to_string(&BatchPath::PerDescriptor).ok().as_deref(),
            Some("\"per-descriptor\"")
        );
        assert_eq!(BatchPath::BatchV1.to_string(), "batch-v1");
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
