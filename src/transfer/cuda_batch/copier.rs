//! [`BatchCopier`]: one stream and one event on a device, and the driver path that issues a
//! batch's copies (the gather kernel, a batch entry point, or one copy per call), posting
//! batches behind each other and waiting for them with a deadline; the peers' mappings a batch
//! reads stay open until it completed.
#![allow(unsafe_code, reason = "CUDA streams, events, copies and launches of the cuda-batch transport")]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use super::driver::{BatchV1, BatchV2, call, driver_version, lookup};
use super::error::CudaBatchError;
use super::gather::{EXPAND_THREADS, GATHER_MAX_BLOCKS, Gather, launch_gather};
use super::grid::GridBatch;
use super::ipc::PeerMapping;
use super::pack::{
    CopyBatch, GATHER_PIECE, PARALLEL_PAIRS, PackFailure, Span, gather_into, gather_pieces, pack_descriptors,
    pack_parts,
};
use super::path::{BatchCopy, BatchPath, BatchStats};
use crate::layouts::read_plan::Pair;
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::ucx::Registrable as _;

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
    /// [`enqueue_pairs`](Self::enqueue_pairs) on a batch API path: one batch per part,
    /// reused.
    parts: Vec<CopyBatch>,
    /// Batches posted since the last wait, and their copies.
    posted: usize,
    posted_copies: usize,
    // Released after the stream and event (Drop runs first).
    dev: Arc<CudaDevice>,
}

impl std::fmt::Debug for BatchCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchCopier").field("device", &self.dev.ordinal()).field("path", &self.path).finish()
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
        let stream = call("cuStreamCreate", result::stream::create(result::stream::StreamKind::NonBlocking))?;
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
            parts: Vec::new(),
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
        let mut st = self.enqueue(local, std::slice::from_ref(peer), std::slice::from_mut(batch), timeout)?;
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
        let packed = parts.iter().flat_map(|b| b.peers().iter().copied());
        let local_span = Span { base: local.addr(), len: local.len() as u64 };
        if parts.iter().any(|b| b.local() != local_span) || !packed.eq(peers.iter().map(|p| p.span())) {
            return Err(CudaBatchError::WrongBuffers);
        }
        let n: usize = parts.iter().map(CopyBatch::copies).sum();
        let mut st = self.submit(local, peers, timeout, |c| {
            let fill_ns = if n > 0 { c.post(parts)? } else { 0 };
            Ok(BatchStats { fill_ns, copies: n as u64, ..BatchStats::default() })
        })?;
        st.calls = self.path.calls(n);
        st.descriptors = parts.iter().map(CopyBatch::descriptors).sum();
        st.bytes = parts.iter().map(CopyBatch::bytes).sum();
        st.unaligned_descriptors = parts.iter().map(CopyBatch::unaligned_descriptors).sum();
        Ok(st)
    }

    /// Posts one batch of a request's plan pairs (`jobs[i]`: the pairs read from `peers[i]`,
    /// into `local`) as [`enqueue`](Self::enqueue) posts packed parts, packing them on the way.
    /// With the gather kernel the pairs go straight into this batch's pinned slot as the
    /// kernel's descriptors ([`pack_descriptors`]: one pass, runs merged, no intermediate
    /// batch and no second copy); on the other paths into the copier's own batches first
    /// ([`pack_parts`]), then posted as `enqueue` posts them. The stats' `pack_ns` is that
    /// packing, within `post_ns`. Fails with the index of the part a pair out of bounds
    /// belongs to, where that is the cause.
    pub fn enqueue_pairs(
        &mut self,
        local: &mut CudaBuffer,
        peers: &[Arc<PeerMapping>],
        jobs: &[&[Pair]],
        timeout: Duration,
    ) -> Result<BatchStats, (Option<usize>, CudaBatchError)> {
        if jobs.len() != peers.len() {
            return Err((None, CudaBatchError::WrongBuffers));
        }
        let local_span = Span { base: local.addr(), len: local.len() as u64 };
        let jobs: Vec<(&[Pair], Span)> = jobs.iter().zip(peers).map(|(&p, peer)| (p, peer.span())).collect();
        let mut bad_part = None;
        let st = self.submit(local, peers, timeout, |c| c.post_pairs(&jobs, local_span, &mut bad_part));
        st.map_err(|e| (bad_part, e))
    }

    /// [`enqueue_pairs`](Self::enqueue_pairs)'s packing and posting; `bad_part` names the part
    /// of a pair out of bounds.
    fn post_pairs(
        &mut self,
        jobs: &[(&[Pair], Span)],
        local: Span,
        bad_part: &mut Option<usize>,
    ) -> Result<BatchStats, CudaBatchError> {
        let descriptors: u64 = jobs.iter().map(|(p, _)| p.len() as u64).sum();
        let Some(g) = self.gather.as_mut().filter(|_| self.path == BatchPath::Kernel) else {
            // The batch entry points take arrays of copies: packed into batches first.
            let mut parts = std::mem::take(&mut self.parts);
            if parts.len() < jobs.len() {
                parts.resize_with(jobs.len(), CopyBatch::default);
            }
            let t_pack = Instant::now();
            let packed = pack_parts(&mut parts, jobs, local);
            let pack_ns = t_pack.elapsed().as_nanos() as u64;
            let parts_done = &parts[..jobs.len()];
            let n: usize = parts_done.iter().map(CopyBatch::copies).sum();
            let posted = match packed {
                Ok(()) if n > 0 => self.post(parts_done).map(|_| ()),
                Ok(()) => Ok(()),
                Err((i, e)) => {
                    *bad_part = Some(i);
                    Err(e)
                }
            };
            let st = BatchStats {
                pack_ns,
                calls: self.path.calls(n),
                copies: n as u64,
                descriptors,
                bytes: parts_done.iter().map(CopyBatch::bytes).sum(),
                unaligned_descriptors: parts_done.iter().map(CopyBatch::unaligned_descriptors).sum(),
                ..BatchStats::default()
            };
            self.parts = parts;
            return posted.map(|()| st);
        };
        // Room for one descriptor per pair; more only when merged runs need splitting (then
        // packed again into a slot that holds their pieces).
        let mut words = 3 * descriptors as usize;
        let t_pack = Instant::now();
        let packed = loop {
            let slot = g.slot(&self.dev, self.posted, words)?;
            match pack_descriptors(jobs, local, GATHER_PIECE, slot.host.words()) {
                Ok(packed) => break packed,
                Err(PackFailure::Room { words: more }) if more > words => words = more,
                Err(PackFailure::Room { words }) => {
                    return Err(CudaBatchError::Call {
                        op: "cuda-batch pack",
                        reason: format!("internal error: a slot of {words} words was too small twice"),
                    });
                }
                Err(PackFailure::Pair(i, e)) => {
                    *bad_part = Some(i);
                    return Err(e);
                }
            }
        };
        let pack_ns = t_pack.elapsed().as_nanos() as u64;
        let pieces = packed.pieces;
        if pieces > 0 {
            // The slot just packed into (it holds `words`: not made again).
            let slot = g.slot(&self.dev, self.posted, words)?;
            let descs = slot.descs.addr();
            let host = &slot.host.words()[..3 * pieces];
            // SAFETY: as in `post_kernel`: `descs` holds the slot's words (at least
            // `3 * pieces`), and the pinned source is not written again before the copier has
            // waited for this batch (slot discipline), so the asynchronous upload reads it
            // unchanged.
            call("cuMemcpyHtoDAsync", unsafe { result::memcpy_htod_async(descs, host, self.stream) })?;
            // SAFETY: every piece lies inside the local pool and its mapped peer pool
            // (`pack_descriptors` checked each pair against both, and merging and splitting
            // keep copies inside the pairs' ranges); the launch follows the upload on this
            // stream.
            unsafe { launch_gather(g.func, self.stream, descs, pieces) }?;
        }
        Ok(BatchStats {
            pack_ns,
            fill_ns: pack_ns,
            calls: self.path.calls(pieces),
            copies: packed.copies,
            descriptors,
            bytes: packed.bytes,
            unaligned_descriptors: packed.unaligned,
            ..BatchStats::default()
        })
    }

    /// What every enqueue does around its posting: the pool's device checked, a batch
    /// that timed out before waited for, `post` run (it returns the batch's counts), the
    /// event recorded, the peers kept mapped until it fires. Returns the batch's stats with
    /// `post_ns` set.
    fn submit(
        &mut self,
        local: &CudaBuffer,
        peers: &[Arc<PeerMapping>],
        timeout: Duration,
        post: impl FnOnce(&mut Self) -> Result<BatchStats, CudaBatchError>,
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
        let mut st = post(self)?;
        // SAFETY: event and stream belong to this copier and the current context.
        call("cuEventRecord", unsafe { result::event::record(self.event, self.stream) })?;
        st.post_ns = t0.elapsed().as_nanos() as u64;
        self.in_flight.extend(peers.iter().cloned());
        self.posted += 1;
        self.posted_copies += st.copies as usize;
        Ok(st)
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
        if grid.local() != local_span || !grid.peers().iter().copied().eq(peers.iter().map(|p| p.span())) {
            return Err(CudaBatchError::WrongBuffers);
        }
        let n = grid.descriptors() as usize;
        let mut st = self.submit(local, peers, timeout, |c| {
            let fill_ns = if n > 0 { c.post_grid(grid)? } else { 0 };
            Ok(BatchStats { fill_ns, copies: n as u64, ..BatchStats::default() })
        })?;
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
                reason: "descriptors made on the device need the gather kernel (--batch-copy kernel)".into(),
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
        let counts: Vec<usize> = parts.iter().map(|b| gather_pieces(b, GATHER_PIECE)).collect();
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
            let fill = |(b, out): (&CopyBatch, &mut &mut [u64])| gather_into(b, GATHER_PIECE, out);
            if parts.len() > 1 && pieces >= PARALLEL_PAIRS && rayon::current_num_threads() >= 4 {
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
    fn wait(&mut self, deadline: Instant, timeout: Duration, copies: usize) -> Result<(), CudaBatchError> {
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
