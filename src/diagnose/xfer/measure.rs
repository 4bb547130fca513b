//! What `kvx xfer` times: every (size, reads in flight) case on UCX (one `read_batch` of GETs
//! per batch) or cuda-batch (one batched copy per batch), against a ceiling measured in the
//! same run over the same working set (a host memcpy, or a device-to-device copy), with the
//! timed reads' destinations verified in place against the target's pattern.
#![forbid(unsafe_code)]

use std::ops::Range;
use std::time::{Duration, Instant};

use super::buffers::{BufferAccess, make_region, with_region};
use super::control::{PATTERN_SEED, Session, TargetRequest};
use super::{Result, XferError};
use crate::config::xfer::{Misalign, XferConfig};
use crate::layouts::pattern::{check_at, fill_at};
use crate::report::xfer::{
    CeilingKind, MemoryReport, Residency, UcxReport, VERIFY_EVERY, XferMemory, XferReport, XferResult,
    protocol_warnings, verification_rule,
};
use crate::transfer::cuda::{self, CudaBuffer, CudaDevice};
use crate::transfer::cuda_batch::{BatchCopier, CopyBatch, PeerMapping, Span};
use crate::transfer::memory::{HostBuffer, MemPlace, PageSize};
use crate::transfer::ucx::{MemRegion, ReadDesc, ReadOptions, Registrable, Rma};

/// The measurement loop of `kvx xfer --transport cuda-batch`.
pub(super) struct BatchMeasure<'a> {
    pub(super) cfg: &'a XferConfig,
    pub(super) copier: &'a mut BatchCopier,
    pub(super) peer: &'a std::sync::Arc<PeerMapping>,
    pub(super) batch: CopyBatch,
    pub(super) seed: u64,
    pub(super) scratch: Vec<u8>,
}

impl BatchMeasure<'_> {
    pub(super) fn cases(
        &mut self,
        local: &mut CudaBuffer,
        ws: u64,
        ceiling: &mut Ceiling,
        mut on_result: impl FnMut(&XferResult),
    ) -> Result<Vec<XferResult>> {
        let cfg = self.cfg;
        let mut results = Vec::new();
        let remote_len = self.peer.span().len.saturating_sub(cfg.misalign.remote_bytes);
        for &size in &cfg.sizes {
            for &inflight in &cfg.inflight {
                if crate::interrupt::requested().is_some() {
                    return Ok(results);
                }
                let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
                let mut r = self.case(local, size, inflight, ws.min(remote_len), ceiling_gbps)?;
                r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
                on_result(&r);
                results.push(r);
            }
        }
        Ok(results)
    }

    fn case(
        &mut self,
        local: &mut CudaBuffer,
        size: u64,
        inflight: usize,
        ws: u64,
        ceiling_gbps: f64,
    ) -> Result<XferResult> {
        let cfg = self.cfg;
        // Remote offsets rotate forward over the working set as a UCX case's do, local ones
        // backward, so no two reads of a batch are contiguous on both sides and the batch
        // keeps `inflight` copies (vLLM's descriptors are strided too); coalesced, a cold batch
        // would be one large copy and measure nothing of posting.
        let layout = ReadLayout::of_case(cfg, size, ws, local.len() as u64, true);
        let mut case = BatchCase { m: self, local, layout, per_batch: inflight as u64 };
        let timed = timed_batches(cfg, inflight as u64, layout.remote_slots, &mut case)?;
        Ok(timed.result(size, inflight, ceiling_gbps))
    }
}

/// A cuda-batch case: each batch one batched copy of `per_batch` reads.
struct BatchCase<'a, 'm> {
    m: &'a mut BatchMeasure<'m>,
    local: &'a mut CudaBuffer,
    layout: ReadLayout,
    per_batch: u64,
}

impl CaseRunner for BatchCase<'_, '_> {
    fn batch(&mut self, k: u64) -> Result<BatchTimes> {
        let pairs = self.layout.batch(k, self.per_batch).map(|d| crate::layouts::read_plan::Pair {
            local: d.local_off,
            remote: d.remote_off,
            len: d.len,
        });
        let span = Span { base: Registrable::addr(&*self.local), len: self.local.len() as u64 };
        let t_pack = std::time::Instant::now();
        self.m.batch.pack(pairs, span, self.m.peer.span())?;
        let pack_ns = t_pack.elapsed().as_nanos() as u64;
        let st = self.m.copier.copy(self.local, self.m.peer, &mut self.m.batch, self.m.cfg.timeout)?;
        Ok(BatchTimes {
            bytes: st.bytes,
            post_ns: st.post_ns,
            complete_ns: st.complete_ns,
            pack_ns,
            fill_ns: st.fill_ns,
            unaligned: st.unaligned_descriptors,
            ..BatchTimes::default()
        })
    }
    fn clear(&mut self, k: u64) -> Result<()> {
        clear_destinations(&mut *self.local, &self.layout.checks(k, self.per_batch))
    }
    fn check(&mut self, k: u64) -> Result<u64> {
        let checks = self.layout.checks(k, self.per_batch);
        check_destinations(&*self.local, &checks, self.m.seed, "cuda-batch copy", &mut self.m.scratch)
    }
}

pub(super) fn measure(
    s: &Session,
    cfg: &XferConfig,
    req: &TargetRequest,
    ws: u64,
    on_result: &mut impl FnMut(&XferResult),
) -> Result<XferReport> {
    let local_len = (ws + cfg.misalign.local_bytes) as usize;
    let mut local = make_region(&s.ctx, local_len, req)?;
    let pages = local.page_size();
    // Making and filling the ceiling's buffers takes a second or more for a large working set:
    // an interrupt that came while the region was made skips them (no case is measured).
    let results = if crate::interrupt::requested().is_some() {
        Vec::new()
    } else {
        let mut ceiling = Ceiling::new(cfg.mem, ws, pages)?;
        with_region!(&mut local, r => measure_cases(s, cfg, ws, &mut ceiling, r, on_result)?)
    };
    let info = s.ucx.info();
    let protocols = s.ctx.protocols().only(Rma::Get);
    let env = s.ctx.env_notes().to_vec();
    let warnings = protocol_warnings(cfg.mem, Rma::Get, &protocols, &env, &s.transports);
    Ok(XferReport {
        ucx: UcxReport {
            library: info.library.display().to_string(),
            version: info.version,
            transports: s.transports.clone(),
            source: info.source.to_string(),
            err_mode: cfg.session.err_mode,
            progress: cfg.session.progress,
            target_library: s.hello.ucx.library.display().to_string(),
            target_version: s.hello.ucx.version.clone(),
            protocols,
            env,
        },
        memory: MemoryReport {
            kind: XferMemory::of(cfg.mem, cfg.ucx_alloc),
            device: cfg.mem.device(),
            huge_pages: cfg.huge_pages,
            pages: pages.to_string(),
            working_set_bytes: ws,
            residency: Residency::of(cfg.hot),
        },
        ceiling: CeilingKind::over(cfg.mem),
        warnings,
        results,
        transport: "ucx".into(),
        cuda_batch: None,
        nixl: None,
        verification: verification_rule(),
        misalign: cfg.misalign,
    })
}

/// The same-run ceiling the transfer rates are divided by.
pub(super) enum Ceiling {
    /// Single-thread memcpy between two more host buffers of the same size and pages.
    Memcpy { src: HostBuffer, dst: HostBuffer },
    /// Device-to-device copies between two more buffers on the same device.
    DeviceCopy { src: CudaBuffer, dst: CudaBuffer },
}

impl Ceiling {
    pub(super) fn new(mem: MemPlace, ws: u64, pages: PageSize) -> Result<Ceiling> {
        Ok(match mem {
            MemPlace::Host => {
                let pages = if pages == PageSize::Normal { PageSize::Normal } else { PageSize::Huge };
                let mut src = HostBuffer::alloc(ws as usize, pages)?;
                fill_at(src.as_mut_slice(), PATTERN_SEED, 0);
                let mut dst = HostBuffer::alloc(ws as usize, pages)?;
                dst.prefault();
                Ceiling::Memcpy { src, dst }
            }
            MemPlace::Cuda { device } => {
                let dev = CudaDevice::open(device)?;
                Ceiling::DeviceCopy {
                    src: CudaBuffer::alloc(&dev, ws as usize)?,
                    dst: CudaBuffer::alloc(&dev, ws as usize)?,
                }
            }
        })
    }

    pub(super) fn measure(&mut self, size: u64, inflight: usize, ws: u64, cfg: &XferConfig) -> Result<f64> {
        match self {
            Ceiling::Memcpy { src, dst } => Ok(memcpy_ceiling(src, dst.as_mut_slice(), size, ws, cfg)),
            Ceiling::DeviceCopy { src, dst } => {
                let min_time = if cfg.iters.is_some() { Duration::ZERO } else { cfg.duration };
                Ok(cuda::dtod_copy_gbps(src, dst, size, inflight, cfg.hot, min_time, cfg.iters.unwrap_or(3))?)
            }
        }
    }

    /// Device memory: `bytes` (at most the working set) moved by one device copy, GB/s.
    pub(super) fn bulk(&mut self, bytes: u64, ws: u64, cfg: &XferConfig) -> Result<Option<f64>> {
        match self {
            Ceiling::Memcpy { .. } => Ok(None),
            Ceiling::DeviceCopy { src, dst } => {
                let min_time = if cfg.iters.is_some() { Duration::ZERO } else { cfg.duration };
                let bytes = bytes.clamp(1, ws);
                Ok(Some(cuda::dtod_copy_gbps(src, dst, bytes, 1, cfg.hot, min_time, cfg.iters.unwrap_or(3))?))
            }
        }
    }
}

impl XferResult {
    pub(super) fn set_bulk(&mut self, bulk_gbps: Option<f64>) {
        self.bulk_copy_gbps = bulk_gbps;
        self.ratio_to_bulk_copy = bulk_gbps.filter(|&b| b > 0.0).map(|b| self.gbps / b);
    }
}

/// Offsets of the `k`-th GET of a run: rotating over the working set when cold, fixed
/// at 0 when hot.
#[inline]
fn slot_offset(k: u64, size: u64, slots: u64, hot: bool) -> u64 {
    if hot { 0 } else { (k % slots) * size }
}

fn measure_cases<M: BufferAccess>(
    s: &Session,
    cfg: &XferConfig,
    ws: u64,
    ceiling: &mut Ceiling,
    local: &mut MemRegion<M>,
    on_result: &mut impl FnMut(&XferResult),
) -> Result<Vec<XferResult>> {
    let remote_len = s.remote.len().saturating_sub(cfg.misalign.remote_bytes);
    let mut results = Vec::new();
    for &size in &cfg.sizes {
        for &inflight in &cfg.inflight {
            // An interrupted run keeps the cases it measured (its report says it is partial).
            if crate::interrupt::requested().is_some() {
                return Ok(results);
            }
            // Measured right before each case so both see the same machine (other load,
            // frequency), which is what makes their ratio meaningful on a shared host.
            let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
            let mut r = measure_case(s, cfg, local, size, inflight, ws.min(remote_len), ceiling_gbps)?;
            r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
            if matches!(ceiling, Ceiling::Memcpy { .. }) {
                r.memcpy_gbps = Some(r.ceiling_gbps);
                r.ratio_to_memcpy = Some(r.ratio_to_ceiling);
            }
            on_result(&r);
            results.push(r);
        }
    }
    Ok(results)
}

fn memcpy_ceiling(src: &HostBuffer, dst: &mut [u8], size: u64, ws: u64, cfg: &XferConfig) -> f64 {
    let slots = (ws / size).max(1);
    let src = src.as_slice();
    let size_us = size as usize;
    let mut k: u64 = 0;
    let copy = |k: u64, dst: &mut [u8]| {
        let off = slot_offset(k, size, slots, cfg.hot) as usize;
        // Different slots for source and destination, as a GET's local and remote offsets are.
        let doff = slot_offset(k + slots / 2, size, slots, cfg.hot) as usize;
        dst[doff..doff + size_us].copy_from_slice(&src[off..off + size_us]);
    };
    for _ in 0..slots.min(8) {
        copy(k, dst);
        k += 1;
    }
    let min_copies = cfg.iters.unwrap_or(0).max(3);
    let start = Instant::now();
    let mut n: u64 = 0;
    // The clock is read once per 16 copies, so tiny copies measure memcpy, not the clock.
    'outer: loop {
        for _ in 0..16 {
            copy(k, dst);
            k += 1;
            n += 1;
            if cfg.iters.is_some() && n >= min_copies {
                break 'outer;
            }
        }
        // An interrupt ends the ceiling too (the case after it is not measured).
        if n >= min_copies && (start.elapsed() >= cfg.duration || crate::interrupt::requested().is_some()) {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst[..1]);
    (n * size) as f64 / secs / 1e9
}

fn measure_case<M: BufferAccess>(
    s: &Session,
    cfg: &XferConfig,
    local: &mut MemRegion<M>,
    size: u64,
    inflight: usize,
    ws: u64,
    ceiling_gbps: f64,
) -> Result<XferResult> {
    let layout = ReadLayout::of_case(cfg, size, ws, local.len() as u64, false);
    let (local_base, remote_base) = (local.addr(), s.remote.base());
    let mut case = UcxCase {
        s,
        local,
        layout,
        per_batch: inflight as u64,
        opts: ReadOptions { max_inflight: inflight, timeout: cfg.timeout },
        scratch: Vec::new(),
    };
    let mut timed = timed_batches(cfg, inflight as u64, layout.remote_slots, &mut case)?;
    timed.unaligned =
        layout.unaligned(timed.first_read, timed.batches * inflight as u64, local_base, remote_base);
    Ok(timed.result(size, inflight, ceiling_gbps))
}

/// Whether timed batch `j` (0-based) is one whose destinations are cleared and checked: one
/// in [`VERIFY_EVERY`] starting with the first, and `last` when the number of timed batches
/// is known beforehand (`--iters`), so that the last batch's check is also of bytes it wrote.
pub fn sampled(j: u64, last: Option<u64>) -> bool {
    j.is_multiple_of(VERIFY_EVERY) || last == Some(j)
}

/// Where the reads of one case go: read `i` (counted over the whole case, warm-up included)
/// moves `size` bytes from remote slot `i` (rotating forward over `remote_slots`) to a local
/// slot (forward, or backward on cuda-batch so that no two reads of a batch are contiguous on
/// both sides and coalesce), both at offset 0 when hot, each offset shifted by `--misalign`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLayout {
    pub size: u64,
    pub remote_slots: u64,
    pub local_slots: u64,
    pub hot: bool,
    pub local_backward: bool,
    pub shift: Misalign,
}

impl ReadLayout {
    /// The layout of a case of `size`-byte reads over `ws` remote bytes into a local buffer of
    /// `local_len` bytes, as `cfg` asks (hot or cold, `--misalign`).
    pub(super) fn of_case(
        cfg: &XferConfig,
        size: u64,
        ws: u64,
        local_len: u64,
        local_backward: bool,
    ) -> ReadLayout {
        ReadLayout {
            size,
            remote_slots: (ws / size).max(1),
            local_slots: (local_len.saturating_sub(cfg.misalign.local_bytes) / size).max(1),
            hot: cfg.hot,
            local_backward,
            shift: cfg.misalign,
        }
    }

    /// Read `i`.
    pub fn read(&self, i: u64) -> ReadDesc {
        let local = match (self.hot, self.local_backward) {
            (true, _) => 0,
            (false, false) => (i % self.local_slots) * self.size,
            (false, true) => (self.local_slots - 1 - i % self.local_slots) * self.size,
        };
        ReadDesc {
            local_off: local + self.shift.local_bytes,
            remote_off: slot_offset(i, self.size, self.remote_slots, self.hot) + self.shift.remote_bytes,
            len: self.size,
        }
    }

    /// Reads `k0..k0 + n`: one batch.
    pub fn batch(&self, k0: u64, n: u64) -> impl Iterator<Item = ReadDesc> + '_ {
        (k0..k0 + n).map(|i| self.read(i))
    }

    /// The destinations of reads `k0..k0 + n` to check once they completed, by local offset:
    /// each local range once (reads of a batch that land on one slot, as hot ones all do,
    /// are checked once). A slot two reads of the batch filled from different remote bytes is
    /// left out, since which of them landed last is not defined (no layout kvx uses makes one:
    /// local and remote slots wrap together).
    pub fn checks(&self, k0: u64, n: u64) -> Vec<ReadDesc> {
        let mut by_local: std::collections::BTreeMap<u64, Option<ReadDesc>> =
            std::collections::BTreeMap::new();
        for d in self.batch(k0, n) {
            by_local
                .entry(d.local_off)
                .and_modify(|seen| {
                    if seen.is_some_and(|s| s.remote_off != d.remote_off) {
                        *seen = None;
                    }
                })
                .or_insert(Some(d));
        }
        by_local.into_values().flatten().collect()
    }

    /// How many of reads `k0..k0 + n` have a local or remote address (registration bases
    /// `local_base`, `remote_base`) or a length that is not a multiple of 16.
    pub fn unaligned(&self, k0: u64, n: u64, local_base: u64, remote_base: u64) -> u64 {
        self.batch(k0, n)
            .filter(|d| {
                !((local_base + d.local_off) | (remote_base + d.remote_off) | d.len).is_multiple_of(16)
            })
            .count() as u64
    }
}

/// Clears `checks`' destinations in `mem` (before a sampled batch is posted).
pub(super) fn clear_destinations<M: BufferAccess>(mem: &mut M, checks: &[ReadDesc]) -> Result<()> {
    let ranges: Vec<Range<u64>> = checks.iter().map(|d| d.local_off..d.local_off + d.len).collect();
    mem.zero_ranges(&ranges)
}

/// Checks every byte of `checks`' destinations in `mem` against the pattern at the remote
/// offsets they came from; the bytes checked, or an error naming the first wrong read.
pub(super) fn check_destinations<M: BufferAccess>(
    mem: &M,
    checks: &[ReadDesc],
    seed: u64,
    what: &str,
    scratch: &mut Vec<u8>,
) -> Result<u64> {
    let ranges: Vec<Range<u64>> = checks.iter().map(|d| d.local_off..d.local_off + d.len).collect();
    let check = |i: usize, got: &[u8]| check_at(got, seed, checks[i].remote_off).err();
    match mem.check_ranges(&ranges, scratch, &check)? {
        None => Ok(checks.iter().map(|d| d.len).sum()),
        Some((i, off)) => {
            let d = checks[i];
            Err(XferError::Verify(format!(
                "{}-byte {what} from remote offset {} into local offset {}: first wrong byte at remote offset {off}",
                d.len, d.remote_off, d.local_off
            )))
        }
    }
}

/// What one batch did, as [`timed_batches`] records it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct BatchTimes {
    pub(super) bytes: u64,
    pub(super) post_ns: u64,
    pub(super) complete_ns: u64,
    /// cuda-batch: the host's time packing the batch, and writing the gather kernel's
    /// descriptors (part of `post_ns`); 0 elsewhere.
    pub(super) pack_ns: u64,
    pub(super) fill_ns: u64,
    /// Descriptors of the batch that are not 16-byte aligned, where the transport counts them.
    pub(super) unaligned: u64,
    /// nixl: NIXL's telemetry of the batch (post, and post to completion); 0 elsewhere.
    pub(super) nixl_post_ns: u64,
    pub(super) nixl_xfer_ns: u64,
    /// nixl: kvx's clock around `make_xfer_req` (part of `post_ns`) and around the release
    /// after completion (after `complete_ns`, inside the measured time); 0 elsewhere, and for
    /// a request made before the timed batches (`--nixl-requests reuse`).
    pub(super) nixl_make_ns: u64,
    pub(super) nixl_release_ns: u64,
}

/// One case's batches on one transport, as [`timed_batches`] drives them.
pub(super) trait CaseRunner {
    /// Runs batch `k` (reads `k..k + per_batch`).
    fn batch(&mut self, k: u64) -> Result<BatchTimes>;
    /// Clears batch `k`'s destinations.
    fn clear(&mut self, k: u64) -> Result<()>;
    /// Checks every byte of batch `k`'s destinations; the bytes checked.
    fn check(&mut self, k: u64) -> Result<u64>;
}

/// A UCX case: each batch one `read_batch` of `per_batch` GETs.
struct UcxCase<'a, M: BufferAccess> {
    s: &'a Session,
    local: &'a mut MemRegion<M>,
    layout: ReadLayout,
    per_batch: u64,
    opts: ReadOptions,
    scratch: Vec<u8>,
}

impl<M: BufferAccess> CaseRunner for UcxCase<'_, M> {
    fn batch(&mut self, k: u64) -> Result<BatchTimes> {
        let st = self.s.remote.read_batch(self.local, self.layout.batch(k, self.per_batch), &self.opts)?;
        Ok(BatchTimes {
            bytes: st.bytes,
            post_ns: st.post_ns,
            complete_ns: st.complete_ns,
            ..BatchTimes::default()
        })
    }
    fn clear(&mut self, k: u64) -> Result<()> {
        clear_destinations(self.local.memory_mut()?, &self.layout.checks(k, self.per_batch))
    }
    fn check(&mut self, k: u64) -> Result<u64> {
        let checks = self.layout.checks(k, self.per_batch);
        check_destinations(
            self.local.memory()?,
            &checks,
            self.s.hello.pattern_seed,
            "read",
            &mut self.scratch,
        )
    }
}

/// What the timed batches of one case measured and verified.
pub(super) struct Timed {
    hist: hdrhistogram::Histogram<u64>,
    post_ns: u64,
    complete_ns: u64,
    pack_ns: u64,
    fill_ns: u64,
    nixl_post_ns: u64,
    nixl_xfer_ns: u64,
    nixl_make_ns: u64,
    nixl_release_ns: u64,
    bytes: u64,
    batches: u64,
    per_batch: u64,
    /// Measured seconds: the timed loop's, less the time spent clearing and checking.
    secs: f64,
    /// The first read of the first timed batch (the warm-up's reads come before it).
    first_read: u64,
    verified_batches: u64,
    verified_bytes: u64,
    unaligned: u64,
}

/// Runs a case as it runs on every transport: a warm-up (connection set-up, registration
/// caches, page faults: 3 batches, or 20 ms up to one pass over `slots`), then timed batches
/// until `--iters` or `--duration`, or an interrupt (the batches done so far still count).
///
/// What the timed batches wrote is verified in place, not by an extra read: timed batch `j`
/// with [`sampled`]`(j, ..)` (1 in [`VERIFY_EVERY`], the first included) has its destinations
/// cleared before it is posted and every byte of them checked against the pattern at the
/// remote offsets they came from once it completed; the last timed batch's destinations are
/// checked after the loop if it was not sampled (without clearing: a sampled batch is what
/// proves they were written, this shows nothing overwrote them since). Clearing and checking
/// are not measured: their time is taken out of the case's seconds, and `--duration` counts
/// measured time. One bias stays: a cleared destination is cache-warm (host memory: in the
/// CPU's caches; device memory: just written by a host-to-device copy), which may make a
/// sampled batch a little faster, on 1 batch in 16.
pub(super) fn timed_batches(
    cfg: &XferConfig,
    per_batch: u64,
    slots: u64,
    run: &mut impl CaseRunner,
) -> Result<Timed> {
    let mut k: u64 = 0;
    let warm_start = Instant::now();
    while k < per_batch * 3 || (warm_start.elapsed() < Duration::from_millis(20) && k < slots.max(per_batch))
    {
        run.batch(k)?;
        k += per_batch;
    }
    let hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
        .map_err(|e| XferError::Protocol { stage: "histogram", reason: e.to_string() })?;
    let mut t = Timed {
        hist,
        post_ns: 0,
        complete_ns: 0,
        pack_ns: 0,
        fill_ns: 0,
        nixl_post_ns: 0,
        nixl_xfer_ns: 0,
        nixl_make_ns: 0,
        nixl_release_ns: 0,
        bytes: 0,
        batches: 0,
        per_batch,
        secs: 0.0,
        first_read: k,
        verified_batches: 0,
        verified_bytes: 0,
        unaligned: 0,
    };
    let last = cfg.iters.map(|n| n.saturating_sub(1));
    let mut unmeasured = Duration::ZERO;
    let start = Instant::now();
    let last_checked = loop {
        let sample = sampled(t.batches, last);
        if sample {
            let c = Instant::now();
            run.clear(k)?;
            unmeasured += c.elapsed();
        }
        let b = run.batch(k)?;
        if sample {
            let c = Instant::now();
            t.verified_bytes += run.check(k)?;
            t.verified_batches += 1;
            unmeasured += c.elapsed();
        }
        k += per_batch;
        t.batches += 1;
        t.bytes += b.bytes;
        t.post_ns += b.post_ns;
        t.complete_ns += b.complete_ns;
        t.pack_ns += b.pack_ns;
        t.fill_ns += b.fill_ns;
        t.nixl_post_ns += b.nixl_post_ns;
        t.nixl_xfer_ns += b.nixl_xfer_ns;
        t.nixl_make_ns += b.nixl_make_ns;
        t.nixl_release_ns += b.nixl_release_ns;
        t.unaligned += b.unaligned;
        t.hist.saturating_record(b.complete_ns.max(1));
        let done = match cfg.iters {
            Some(n) => t.batches >= n,
            None => t.batches >= 3 && start.elapsed().saturating_sub(unmeasured) >= cfg.duration,
        };
        if done || crate::interrupt::requested().is_some() {
            break sample;
        }
    };
    t.secs = start.elapsed().saturating_sub(unmeasured).as_secs_f64();
    if !last_checked {
        t.verified_bytes += run.check(k - per_batch)?;
        t.verified_batches += 1;
    }
    Ok(t)
}

impl Timed {
    pub(super) fn result(&self, size: u64, inflight: usize, ceiling_gbps: f64) -> XferResult {
        let gbps = self.bytes as f64 / self.secs / 1e9;
        let us = |ns: u64| ns as f64 / 1e3;
        let batches = self.batches.max(1);
        // A NIXL case: its telemetry, or kvx's clock around its calls, has something.
        let nixl = self.nixl_post_ns + self.nixl_xfer_ns + self.nixl_make_ns + self.nixl_release_ns > 0;
        XferResult {
            size_bytes: size,
            inflight,
            gbps,
            ceiling_gbps,
            ratio_to_ceiling: if ceiling_gbps > 0.0 { gbps / ceiling_gbps } else { 0.0 },
            memcpy_gbps: None,
            ratio_to_memcpy: None,
            bulk_copy_gbps: None,
            ratio_to_bulk_copy: None,
            p50_us: us(self.hist.value_at_quantile(0.50)),
            p99_us: us(self.hist.value_at_quantile(0.99)),
            max_us: us(self.hist.max()),
            post_us: us(self.post_ns) / batches as f64,
            complete_us: us(self.complete_ns) / batches as f64,
            pack_us: (self.pack_ns > 0).then(|| us(self.pack_ns) / batches as f64),
            fill_us: (self.fill_ns > 0).then(|| us(self.fill_ns) / batches as f64),
            nixl_post_us: (self.nixl_post_ns > 0).then(|| us(self.nixl_post_ns) / batches as f64),
            nixl_xfer_us: (self.nixl_xfer_ns > 0).then(|| us(self.nixl_xfer_ns) / batches as f64),
            nixl_make_us: nixl.then(|| us(self.nixl_make_ns) / batches as f64),
            nixl_release_us: nixl.then(|| us(self.nixl_release_ns) / batches as f64),
            msgs_per_sec: (self.batches * self.per_batch) as f64 / self.secs,
            batches: self.batches,
            bytes: self.bytes,
            verified_bytes: self.verified_bytes,
            verified_batches: self.verified_batches,
            timed_batches: self.batches,
            unaligned_descriptors: self.unaligned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::xfer::SessionOptions;

    #[test]
    fn one_timed_batch_in_16_is_sampled_starting_with_the_first_and_a_known_last() {
        let picked: Vec<u64> = (0..40).filter(|&j| sampled(j, None)).collect();
        assert_eq!(picked, [0, 16, 32]);
        let picked: Vec<u64> = (0..40).filter(|&j| sampled(j, Some(39))).collect();
        assert_eq!(picked, [0, 16, 32, 39], "--iters 40: the last batch is cleared and checked too");
        assert!(sampled(0, Some(0)), "a single timed batch");
    }

    fn layout(hot: bool, backward: bool, shift: Misalign) -> ReadLayout {
        ReadLayout { size: 4096, remote_slots: 8, local_slots: 8, hot, local_backward: backward, shift }
    }

    #[test]
    fn a_batch_s_checks_are_its_destinations_each_once_at_their_remote_offsets() {
        let none = Misalign::default();
        // Cold, forward (UCX): reads 6..10 wrap around 8 slots on both sides.
        let c = layout(false, false, none).checks(6, 4);
        let got: Vec<(u64, u64)> = c.iter().map(|d| (d.local_off / 4096, d.remote_off / 4096)).collect();
        assert_eq!(got, [(0, 0), (1, 1), (6, 6), (7, 7)]);
        assert!(c.iter().all(|d| d.len == 4096));
        // Backward local slots (cuda-batch): local 7 - i % 8 holds remote i % 8.
        let c = layout(false, true, none).checks(0, 3);
        let got: Vec<(u64, u64)> = c.iter().map(|d| (d.local_off / 4096, d.remote_off / 4096)).collect();
        assert_eq!(got, [(5, 2), (6, 1), (7, 0)]);
        // More reads than slots: each slot checked once (its reads brought the same bytes).
        assert_eq!(layout(false, true, none).checks(0, 20).len(), 8);
        // Hot: every read lands on local 0 from remote 0, checked once.
        let c = layout(true, false, none).checks(100, 64);
        assert_eq!(c, [ReadDesc { local_off: 0, remote_off: 0, len: 4096 }]);
        // --misalign moves both sides.
        let shift = Misalign { local_bytes: 3, remote_bytes: 5 };
        let c = layout(false, false, shift).checks(1, 1);
        assert_eq!(c, [ReadDesc { local_off: 4096 + 3, remote_off: 4096 + 5, len: 4096 }]);
        // A slot two reads filled from different remote bytes is not checked (either may be last).
        let odd = ReadLayout { local_slots: 3, ..layout(false, false, none) };
        let c = odd.checks(0, 4);
        assert_eq!(
            c.iter().map(|d| d.local_off / 4096).collect::<Vec<_>>(),
            [1, 2],
            "slot 0 got remote 0 and 3"
        );
    }

    #[test]
    fn misaligned_reads_are_counted_on_either_side_and_by_length() {
        let none = Misalign::default();
        assert_eq!(layout(false, false, none).unaligned(0, 10, 0x1000, 0x2000), 0);
        let one_side = Misalign { local_bytes: 0, remote_bytes: 1 };
        assert_eq!(layout(false, false, one_side).unaligned(0, 10, 0x1000, 0x2000), 10);
        assert_eq!(layout(false, false, none).unaligned(0, 10, 0x1008, 0x2000), 10, "the base counts");
        let odd = ReadLayout { size: 4100, ..layout(false, false, none) };
        assert_eq!(odd.unaligned(0, 10, 0x1000, 0x2000), 10, "a length not a multiple of 16");
    }

    /// Copies reads in this process from a pattern-filled buffer, as a transport would, and
    /// damages one byte of one chosen batch: drives [`timed_batches`]'s verification (the
    /// transports themselves are tested over real UCX and CUDA elsewhere).
    struct Copying {
        src: Vec<u8>,
        dst: HostBuffer,
        layout: ReadLayout,
        per_batch: u64,
        damage_batch: Option<u64>,
        scratch: Vec<u8>,
    }

    impl CaseRunner for Copying {
        fn batch(&mut self, k: u64) -> Result<BatchTimes> {
            let dst = self.dst.as_mut_slice();
            for d in self.layout.batch(k, self.per_batch) {
                let (l, r, n) = (d.local_off as usize, d.remote_off as usize, d.len as usize);
                dst[l..l + n].copy_from_slice(&self.src[r..r + n]);
            }
            if self.damage_batch == Some(k / self.per_batch) {
                let d = self.layout.read(k + self.per_batch - 1);
                dst[(d.local_off + d.len / 2) as usize] ^= 0x40;
            }
            Ok(BatchTimes { bytes: self.per_batch * self.layout.size, ..BatchTimes::default() })
        }
        fn clear(&mut self, k: u64) -> Result<()> {
            clear_destinations(&mut self.dst, &self.layout.checks(k, self.per_batch))
        }
        fn check(&mut self, k: u64) -> Result<u64> {
            let checks = self.layout.checks(k, self.per_batch);
            check_destinations(&self.dst, &checks, 7, "read", &mut self.scratch)
        }
    }

    fn xfer_cfg(iters: u64) -> XferConfig {
        XferConfig {
            sizes: vec![4096],
            inflight: vec![4],
            working_set_bytes: 1 << 20,
            hot: false,
            ucx_alloc: false,
            huge_pages: false,
            mem: MemPlace::Host,
            duration: Duration::ZERO,
            iters: Some(iters),
            timeout: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(1),
            session: SessionOptions::default(),
            cuda_batch: None,
            nixl: None,
            misalign: Misalign::default(),
        }
    }

    fn copying(damage_batch: Option<u64>, shift: Misalign) -> Copying {
        let mut src = vec![0u8; (64 << 10) + 64];
        fill_at(&mut src, 7, 0);
        let dst = HostBuffer::alloc((64 << 10) + 64, PageSize::Normal).expect("a host buffer");
        let layout = ReadLayout {
            size: 4096,
            remote_slots: 16,
            local_slots: 16,
            hot: false,
            local_backward: true,
            shift,
        };
        Copying { src, dst, layout, per_batch: 4, damage_batch, scratch: Vec::new() }
    }

    #[test]
    fn a_damaged_byte_in_a_sampled_timed_batch_fails_the_case_naming_the_read() {
        // 40 timed batches after 3 of warm-up (`slots` 4 ends the warm-up at 3 batches): timed
        // batch j is batch 3 + j.
        let cfg = xfer_cfg(40);
        let shift = Misalign { local_bytes: 3, remote_bytes: 11 };
        let t = timed_batches(&cfg, 4, 4, &mut copying(None, shift)).expect("clean copies verify");
        assert_eq!((t.verified_batches, t.batches), (4, 40), "0, 16, 32 and the last");
        assert_eq!(t.verified_bytes, 4 * 4 * 4096);
        for (j, caught) in [(0, true), (16, true), (39, true), (5, false)] {
            let out = timed_batches(&cfg, 4, 4, &mut copying(Some(3 + j), shift));
            match (out, caught) {
                (Err(XferError::Verify(why)), true) => {
                    assert!(why.starts_with("4096-byte read from remote offset "), "{why}");
                    assert!(why.contains("into local offset") && why.contains("first wrong byte"), "{why}");
                }
                (Ok(t), false) => assert_eq!(t.verified_batches, 4, "batch {j} is not sampled: not seen"),
                (other, _) => panic!("timed batch {j}: {:?}", other.map(|t| t.verified_batches)),
            }
        }
        // Without --iters the last batch is checked as it stands after the loop.
        let cfg = XferConfig { iters: None, duration: Duration::from_millis(1), ..xfer_cfg(1) };
        let t = timed_batches(&cfg, 4, 4, &mut copying(None, Misalign::default())).expect("verifies");
        assert!(
            t.verified_batches >= 1 && t.verified_batches <= t.batches.div_ceil(16) + 1,
            "{}",
            t.verified_batches
        );
    }

    #[test]
    fn cold_offsets_rotate_over_the_working_set_and_hot_ones_do_not() {
        let offs: Vec<u64> = (0..6).map(|k| slot_offset(k, 4096, 4, false)).collect();
        assert_eq!(offs, vec![0, 4096, 8192, 12288, 0, 4096]);
        assert!((0..6).all(|k| slot_offset(k, 4096, 4, true) == 0));
    }
}
