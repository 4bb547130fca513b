//! Packing a request's plan pairs into a batch of `(dst, src, size)` copies ([`CopyBatch`]):
//! bounds-checked against both buffers, contiguous runs coalesced, one part per peer packed on
//! several threads when large ([`pack_parts`]); and the gather kernel's descriptors made from a
//! batch ([`gather_descriptors`]: long copies split into pieces, [`gather_split`]: the
//! kernel's per-copy arithmetic, kept here so it is tested), or straight from the pairs in one
//! pass into the buffer that is uploaded ([`pack_descriptors`], what the copier does with the
//! kernel). Pure: no CUDA. Its one `unsafe` (module `wide`) calls the packing loop compiled
//! for AVX-512 or AVX2 on a CPU that said it has them.

use super::error::CudaBatchError;
use crate::layouts::read_plan::Pair;

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

    /// The buffer the copies write into (what `pack` was given as `local`).
    pub fn local(&self) -> Span {
        self.local
    }

    /// The peer buffers the copies read from, in the order they were added.
    pub fn peers(&self) -> &[Span] {
        &self.peers
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
/// pairs and four threads, else one after the other: a decode rank's packing per request on
/// the batch API's paths (with the gather kernel, [`pack_descriptors`] packs straight into
/// the upload), which bounds a request on a host whose cores are slow (results/gpu-nvidia-h200-2026-11-27-run3.json).
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

/// What [`pack_descriptors`] wrote to the front of its buffer, and the plan it came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Packed {
    /// The gather kernel's descriptors written (three u64 each): the copies, those longer than
    /// a piece split as [`gather_descriptors`] splits them.
    pub pieces: usize,
    /// Copies after merging runs contiguous on both sides (before splitting): what the
    /// batch copies, against `descriptors` planned.
    pub copies: u64,
    /// The plan's descriptors (pairs), zero-length ones included.
    pub descriptors: u64,
    pub bytes: u64,
    /// As [`CopyBatch::unaligned_descriptors`].
    pub unaligned: u64,
}

/// Why [`pack_descriptors`] wrote no batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PackFailure {
    /// A pair of part `.0` lies outside either buffer (its index counts from that part's
    /// first pair).
    Pair(usize, CudaBatchError),
    /// The buffer holds fewer than `words` u64: pack again into one that holds them. Copies
    /// are at most one per pair, so `3 * pairs` words always hold them unsplit; more is needed
    /// only when merged runs are longer than a piece.
    Room { words: usize },
}

/// One part's pairs packed by [`pack_part`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Part {
    /// Words written (three per copy).
    words: usize,
    bytes: u64,
    unaligned: u64,
    longest: u64,
}

/// The first pair of `pairs` outside `local` or `peer` (a span whose end overflows holds
/// nothing), as [`CopyBatch::add`] names it.
fn out_of_bounds(pairs: &[Pair], local: Span, peer: Span) -> Option<CudaBatchError> {
    let room = |s: Span| if s.base.checked_add(s.len).is_some() { s.len } else { 0 };
    let (l_room, p_room) = (room(local), room(peer));
    pairs.iter().enumerate().filter(|(_, p)| p.len > 0).find_map(|(index, p)| {
        let local_ok = p.local <= l_room && p.len <= l_room - p.local;
        let peer_ok = p.remote <= p_room && p.len <= p_room - p.remote;
        let (side, offset, span) = match (local_ok, peer_ok) {
            (true, true) => return None,
            (false, _) => ("local", p.local, local),
            (true, false) => ("peer", p.remote, peer),
        };
        Some(CudaBatchError::OutOfBounds {
            index,
            side,
            offset,
            end: offset.saturating_add(p.len),
            len: span.len,
        })
    })
}

/// One peer's pairs written to `out` (which holds at least three u64 per pair) as `(dst, src,
/// len)` copies, runs contiguous on both sides merged, in one pass: the hot loop of a decode
/// rank's posting. Bounds are checked for every pair without a branch per pair (an
/// out-of-bounds pair only sets a flag; the pairs are then scanned again for the first one,
/// and nothing written counts). A plan with nothing to merge takes [`pack_plain`].
fn pack_part(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Result<Part, CudaBatchError> {
    match pack_plain(pairs, local, peer, out) {
        Some(part) => Ok(part),
        None => pack_merging(pairs, local, peer, out),
    }
}

/// Pairs per stretch of [`pack_plain`] between two looks at whether the plan needs
/// [`pack_merging`]: what a plan that merges wastes before it switches.
const PLAIN_STRETCH: usize = 256;

/// [`pack_part`] for a plan with no run to merge, no empty pair and none out of bounds (the
/// usual one: vLLM's blocks are allocated apart): [`plain_loop`], in the widest vector
/// instructions this CPU has. Returns `None` as soon as a stretch of pairs holds one of those,
/// before finishing the plan: the part is then packed again by [`pack_merging`].
///
/// The loop's bounds, merge and alignment tests cost more instructions than writing the
/// copy; compiled for the x86-64 baseline (SSE2) they run one pair at a time, at about three
/// times a plain copy's cost. LLVM vectorises the same loop when AVX2 or AVX-512 may be used,
/// which brings it to a plain copy's speed (benches/batch.rs): on x86-64 it is compiled for
/// those too ([`wide`]), and the CPU's own picked at run time.
fn pack_plain(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Option<Part> {
    #[cfg(target_arch = "x86_64")]
    if let Some(width) = wide::Width::detect() {
        return wide::plain_loop(width, pairs, local, peer, out);
    }
    plain_loop(pairs, local, peer, out)
}

/// [`plain_loop`] compiled for AVX-512 and for AVX2 (the same Rust, so the same result: the
/// tests hold each to the baseline's), and the widest this CPU has.
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{Pair, Part, Span};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Level {
        Avx2,
        Avx512,
    }

    /// Vector instructions beyond the x86-64 baseline that this CPU has: only
    /// [`Width::detect`] (and, in tests, [`Width::all`]) make one, so holding one is the
    /// proof that [`plain_loop`] may use them.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct Width(Level);

    impl Width {
        /// The widest this CPU has (`std` caches what the CPU said: a load per call).
        pub(super) fn detect() -> Option<Width> {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512vl") && has!("avx512dq") && has!("avx512bw") {
                Some(Width(Level::Avx512))
            } else if has!("avx2") {
                Some(Width(Level::Avx2))
            } else {
                None
            }
        }

        /// Every width this CPU has, widest first.
        #[cfg(test)]
        pub(super) fn all() -> Vec<Width> {
            let avx2 = std::arch::is_x86_feature_detected!("avx2").then_some(Width(Level::Avx2));
            Width::detect().filter(|w| w.0 == Level::Avx512).into_iter().chain(avx2).collect()
        }
    }

    /// [`super::plain_loop`] in `width`'s instructions.
    #[expect(
        unsafe_code,
        reason = "calls a function compiled for vector instructions the CPU was checked to have"
    )]
    pub(super) fn plain_loop(
        width: Width,
        pairs: &[Pair],
        local: Span,
        peer: Span,
        out: &mut [u64],
    ) -> Option<Part> {
        match width.0 {
            // SAFETY: a `Width` of this level exists only where the CPU said it has AVX-512
            // F, VL, DQ and BW (`Width::detect`), all that `avx512` is compiled for; the
            // function is otherwise plain safe Rust.
            Level::Avx512 => unsafe { avx512(pairs, local, peer, out) },
            // SAFETY: as above, with AVX2.
            Level::Avx2 => unsafe { avx2(pairs, local, peer, out) },
        }
    }

    #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw")]
    fn avx512(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Option<Part> {
        super::plain_loop(pairs, local, peer, out)
    }

    #[target_feature(enable = "avx2")]
    fn avx2(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Option<Part> {
        super::plain_loop(pairs, local, peer, out)
    }
}

/// [`pack_plain`]'s loop: each pair written as a copy with no branch that depends on the
/// data, the tests folded into flags checked once per stretch. Inlined into each of
/// [`wide`]'s functions, so that each is compiled for its instructions.
#[inline(always)]
fn plain_loop(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Option<Part> {
    let room = |s: Span| if s.base.checked_add(s.len).is_some() { s.len } else { 0 };
    let (l_room, p_room) = (room(local), room(peer));
    let out = &mut out[..3 * pairs.len()];
    let (mut bytes, mut unaligned, mut longest) = (0u64, 0u64, 0u64);
    // Where the last copy ends on both sides (none yet: no pair starts at u64::MAX on both
    // sides, as every pair of a plain plan has at least one byte inside its span).
    let (mut end_d, mut end_s) = (u64::MAX, u64::MAX);
    for (pairs, out) in pairs.chunks(PLAIN_STRETCH).zip(out.chunks_mut(3 * PLAIN_STRETCH)) {
        let mut odd = false;
        for (p, o) in pairs.iter().zip(out.chunks_exact_mut(3)) {
            let (dst, src) = (local.base.wrapping_add(p.local), peer.base.wrapping_add(p.remote));
            o[0] = dst;
            o[1] = src;
            o[2] = p.len;
            let (l_end, l_wrap) = p.local.overflowing_add(p.len);
            let (r_end, r_wrap) = p.remote.overflowing_add(p.len);
            odd |= l_wrap | r_wrap | (l_end > l_room) | (r_end > p_room) | (p.len == 0);
            odd |= (dst == end_d) & (src == end_s);
            unaligned += u64::from((dst | src | p.len) & 15 != 0);
            bytes = bytes.wrapping_add(p.len);
            longest = longest.max(p.len);
            (end_d, end_s) = (dst.wrapping_add(p.len), src.wrapping_add(p.len));
        }
        if odd {
            return None;
        }
    }
    Some(Part { words: 3 * pairs.len(), bytes, unaligned, longest })
}

/// [`pack_part`] for any plan: runs merged, empty pairs dropped, the first pair out of bounds
/// named.
fn pack_merging(pairs: &[Pair], local: Span, peer: Span, out: &mut [u64]) -> Result<Part, CudaBatchError> {
    let room = |s: Span| if s.base.checked_add(s.len).is_some() { s.len } else { 0 };
    let (l_room, p_room) = (room(local), room(peer));
    let out = &mut out[..3 * pairs.len()];
    let (mut w, mut bytes, mut unaligned, mut longest) = (0usize, 0u64, 0u64, 0u64);
    // Where the last copy written ends on both sides.
    let (mut end_d, mut end_s) = (0, 0);
    let mut bad = false;
    for p in pairs {
        if p.len == 0 {
            continue;
        }
        // `room - offset` wraps when the offset is past the room: the first test catches it.
        bad |= (p.local > l_room)
            | (p.len > l_room.wrapping_sub(p.local))
            | (p.remote > p_room)
            | (p.len > p_room.wrapping_sub(p.remote));
        // Wrapping: only an out-of-bounds pair (whose batch is dropped) can wrap.
        let (dst, src) = (local.base.wrapping_add(p.local), peer.base.wrapping_add(p.remote));
        bytes = bytes.wrapping_add(p.len);
        unaligned += u64::from((dst | src | p.len) & 15 != 0);
        if w > 0 && dst == end_d && src == end_s {
            let len = out[w - 1].wrapping_add(p.len);
            out[w - 1] = len;
            longest = longest.max(len);
        } else {
            out[w] = dst;
            out[w + 1] = src;
            out[w + 2] = p.len;
            w += 3;
            longest = longest.max(p.len);
        }
        (end_d, end_s) = (dst.wrapping_add(p.len), src.wrapping_add(p.len));
    }
    if bad {
        // `bad` was set by some pair, which the scan finds.
        return Err(out_of_bounds(pairs, local, peer).unwrap_or(CudaBatchError::WrongBuffers));
    }
    Ok(Part { words: w, bytes, unaligned, longest })
}

/// Fewest threads of rayon's pool for [`pack_descriptors`] to pack a request's parts on
/// several of them.
pub const PARALLEL_THREADS: usize = 2;

/// Fewest pairs in a request for [`pack_descriptors`] to pack its parts on rayon's threads
/// ([`PackThreads::Auto`]). Handing parts to other threads costs their wake-up, and the
/// packing loop runs at a plain copy's speed where it is vectorised: at the sizes measured,
/// one thread was the faster. `cargo bench --bench batch` (40,960 pairs in four parts) packs
/// them on one thread at a smaller multiple of the store ceiling than on rayon's pool of two
/// on the development machine (results/docs/bench-batch), and the H200 host packed the same
/// request fastest with `RAYON_NUM_THREADS=1` (results/gpu-nvidia-h200-2026-11-28b-rayon.json,
/// before the loop was vectorised). Requests this large were not measured: the bound keeps
/// the parallel path for them, where a wake-up is small against the packing.
pub const PARALLEL_PACK_PAIRS: usize = 1 << 18;

/// Where [`pack_descriptors_on`] packs a request's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackThreads {
    /// On the calling thread one after the other, on rayon's threads from
    /// [`PARALLEL_PACK_PAIRS`] pairs: what [`pack_descriptors`] (and so the copier) does.
    Auto,
    /// On rayon's threads whenever there are several parts and at least
    /// [`PARALLEL_THREADS`] threads: what the bench compares `Auto` with.
    Pool,
}

/// Packs a request's parts (`jobs[i] = (pairs, peer)`, all into `local`) straight into `out`,
/// the pinned buffer the gather kernel's descriptors are uploaded from: each pair
/// bounds-checked, runs contiguous on both sides merged (never across two parts), copies
/// longer than `piece` split as [`gather_descriptors`] splits them, written once in the
/// kernel's format. What [`CopyBatch::pack`] then [`gather_into`] did in two passes and an
/// intermediate array (benches/batch.rs measures both).
///
/// Each part is packed into its own stretch of `out` (three words per pair), on rayon's
/// threads as [`PackThreads::Auto`] says; stretches that merging shortened are then moved up
/// behind each other. Needs `out` to hold `3 * pairs` words, more when merged runs must be
/// split ([`PackFailure::Room`]). On a failure `out` holds nothing of use.
pub fn pack_descriptors(
    jobs: &[(&[Pair], Span)],
    local: Span,
    piece: u64,
    out: &mut [u64],
) -> Result<Packed, PackFailure> {
    pack_descriptors_on(PackThreads::Auto, jobs, local, piece, out)
}

/// [`pack_descriptors`], the parts packed where `threads` says (the result is the same).
pub fn pack_descriptors_on(
    threads: PackThreads,
    jobs: &[(&[Pair], Span)],
    local: Span,
    piece: u64,
    out: &mut [u64],
) -> Result<Packed, PackFailure> {
    let piece = (piece & !15).max(16);
    let pairs: usize = jobs.iter().map(|(p, _)| p.len()).sum();
    if out.len() < 3 * pairs {
        return Err(PackFailure::Room { words: 3 * pairs });
    }
    let mut stretches = Vec::with_capacity(jobs.len());
    let mut rest = &mut *out;
    for (p, _) in jobs {
        let (head, tail) = rest.split_at_mut(3 * p.len());
        stretches.push(head);
        rest = tail;
    }
    let pack =
        |((pairs, peer), out): (&(&[Pair], Span), &mut &mut [u64])| pack_part(pairs, local, *peer, out);
    let least = match threads {
        PackThreads::Auto => PARALLEL_PACK_PAIRS,
        PackThreads::Pool => 0,
    };
    let parts: Result<Vec<Part>, PackFailure> =
        if jobs.len() > 1 && pairs >= least && rayon::current_num_threads() >= PARALLEL_THREADS {
            use rayon::prelude::*;
            let done: Vec<_> = jobs.par_iter().zip(stretches.par_iter_mut()).map(pack).collect();
            done.into_iter().enumerate().map(|(i, r)| r.map_err(|e| PackFailure::Pair(i, e))).collect()
        } else {
            jobs.iter()
                .zip(stretches.iter_mut())
                .enumerate()
                .map(|(i, j)| pack(j).map_err(|e| PackFailure::Pair(i, e)))
                .collect()
        };
    drop(stretches);
    let parts = parts?;
    // The parts' copies behind each other.
    let (mut w, mut at) = (0, 0);
    let mut packed = Packed { descriptors: pairs as u64, ..Packed::default() };
    let mut longest = 0;
    for (part, (p, _)) in parts.iter().zip(jobs) {
        if at != w {
            out.copy_within(at..at + part.words, w);
        }
        w += part.words;
        at += 3 * p.len();
        packed.bytes += part.bytes;
        packed.unaligned += part.unaligned;
        longest = longest.max(part.longest);
    }
    let copies = w / 3;
    packed.copies = copies as u64;
    // A copy's first piece is `piece - dst % 16` long, at least `piece - 15`.
    packed.pieces = if longest <= piece - 15 { copies } else { split_in_place(out, copies, piece)? };
    Ok(packed)
}

/// The `copies` copies at the front of `out` split into pieces of at most `piece` bytes (a
/// multiple of 16) as [`gather_into`] splits them, in place: from the last copy back, each
/// copy's pieces written at the back of what the pieces take, which never reaches a copy not
/// yet read (every copy makes at least one piece). Returns the piece count.
fn split_in_place(out: &mut [u64], copies: usize, piece: u64) -> Result<usize, PackFailure> {
    let count = |c: &[u64]| (c[2] + c[0] % 16).div_ceil(piece) as usize;
    let pieces: usize = out[..3 * copies].chunks_exact(3).map(count).sum();
    if out.len() < 3 * pieces {
        return Err(PackFailure::Room { words: 3 * pieces });
    }
    let mut end = 3 * pieces;
    for k in (0..copies).rev() {
        let (dst, src, size) = (out[3 * k], out[3 * k + 1], out[3 * k + 2]);
        let n = (size + dst % 16).div_ceil(piece) as usize;
        let mut w = end - 3 * n;
        end = w;
        // The first piece ends where the destination reaches a multiple of 16.
        let (mut off, mut len) = (0, piece - dst % 16);
        while off < size {
            len = len.min(size - off);
            out[w..w + 3].copy_from_slice(&[dst + off, src + off, len]);
            w += 3;
            off += len;
            len = piece;
        }
    }
    Ok(pieces)
}

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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_width_packs_what_the_baseline_loop_packs() {
        // Parts of many lengths around the stretch (256 pairs) and the vector loops' steps,
        // strided on both sides with some unaligned pairs: plain ones, and ones that stop
        // the loop (an empty pair, one out of bounds, a run to merge) in some stretch.
        let plain = |n: u64| -> Vec<Pair> {
            (0..n)
                .map(|k| {
                    let len = if k % 7 == 3 { 100 + k % 5 } else { 8192 };
                    pair((k * 37 % 50) * 16_384 + (k % 3) * 4, k * 9000 % 1_000_000, len)
                })
                .collect()
        };
        let big = Span { base: L.base, len: 1 << 30 };
        let peer = Span { base: P.base, len: 1 << 30 };
        let mut cases: Vec<(Vec<Pair>, bool)> =
            [0, 1, 7, 8, 31, 255, 256, 257, 600, 1031].into_iter().map(|n| (plain(n), true)).collect();
        for (at, bad) in [
            (5, pair(0, 0, 0)),
            (700, pair(0, 0, 0)),
            (300, pair(big.len - 8, 0, 16)),
            (1030, pair(0, u64::MAX, 2)),
        ] {
            let mut c = plain(1031);
            c[at] = bad;
            cases.push((c, false));
        }
        let mut merged = plain(600);
        merged[512].len = 8192;
        merged[513] = pair(merged[512].local + 8192, merged[512].remote + 8192, 8192);
        cases.push((merged, false));
        let widths = wide::Width::all();
        for (pairs, packs) in &cases {
            let mut want = vec![0u64; 3 * pairs.len()];
            let base = plain_loop(pairs, big, peer, &mut want);
            assert_eq!(base.is_some(), *packs, "{} pairs", pairs.len());
            let n = pairs.len() as u64;
            assert!(
                base.is_none_or(|p| n < 8 || (p.unaligned > 0 && p.unaligned < n)),
                "aligned and not: {base:?}"
            );
            for &w in &widths {
                let mut got = vec![0u64; 3 * pairs.len()];
                assert_eq!(
                    wide::plain_loop(w, pairs, big, peer, &mut got),
                    base,
                    "{w:?}, {} pairs",
                    pairs.len()
                );
                if base.is_some() {
                    assert!(got == want, "{w:?}, {} pairs: the words differ", pairs.len());
                }
            }
        }
    }

    /// The two-pass packing (`CopyBatch::pack` and `add`, then [`gather_descriptors`]) of the
    /// same parts: the words and counts [`pack_descriptors`] must give.
    fn two_pass(jobs: &[(&[Pair], Span)], piece: u64) -> Result<(Vec<u64>, Packed), (usize, CudaBatchError)> {
        let mut b = CopyBatch::default();
        for (i, (pairs, peer)) in jobs.iter().enumerate() {
            let added = if i == 0 {
                b.pack(pairs.iter().copied(), L, *peer)
            } else {
                b.add(pairs.iter().copied(), L, *peer)
            };
            added.map_err(|e| (i, e))?;
        }
        let mut out = Vec::new();
        let pieces = gather_descriptors(&b, piece, &mut out);
        let packed = Packed {
            pieces,
            copies: b.copies() as u64,
            descriptors: b.descriptors(),
            bytes: b.bytes(),
            unaligned: b.unaligned_descriptors(),
        };
        Ok((out, packed))
    }

    /// [`pack_descriptors`] into a buffer of `3 * pairs` words (grown once when it says so),
    /// with a sentinel word behind it that must stay untouched.
    fn one_pass(jobs: &[(&[Pair], Span)], piece: u64) -> Result<(Vec<u64>, Packed), PackFailure> {
        one_pass_on(PackThreads::Auto, jobs, piece)
    }

    /// [`one_pass`] with the parts packed where `threads` says.
    fn one_pass_on(
        threads: PackThreads,
        jobs: &[(&[Pair], Span)],
        piece: u64,
    ) -> Result<(Vec<u64>, Packed), PackFailure> {
        let pairs: usize = jobs.iter().map(|(p, _)| p.len()).sum();
        let mut words = 3 * pairs;
        loop {
            let mut out = vec![7u64; words + 1];
            match pack_descriptors_on(threads, jobs, L, piece, &mut out[..words]) {
                Ok(p) => {
                    assert_eq!(out[words], 7, "nothing written past the buffer");
                    out.truncate(3 * p.pieces);
                    return Ok((out, p));
                }
                Err(PackFailure::Room { words: more }) => {
                    assert!(more > words, "a larger buffer is asked for: {more} <= {words}");
                    words = more;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Peers one after the other above `P`, each 1 MiB.
    fn peer(i: u64) -> Span {
        Span { base: P.base + (i << 24), len: 1 << 20 }
    }

    #[test]
    fn one_pass_packing_writes_what_packing_then_gathering_wrote() {
        // Runs to merge, zero-length pairs, unaligned ones, and a merged run longer than a
        // piece (four 10 KiB pairs contiguous on both sides), over three peers.
        let a =
            [pair(0, 0, 100), pair(100, 100, 100), pair(200, 300, 100), pair(1000, 5, 0), pair(300, 400, 3)];
        let b: Vec<Pair> = (0..4u64).map(|k| pair(4096 + k * 10_240, 7 + k * 10_240, 10_240)).collect();
        let c = [pair(1 << 19, 1 << 19, 8192), pair(0, 0, 8192), pair(8192, 8192, 8192)];
        let jobs: Vec<(&[Pair], Span)> = vec![(&a, peer(0)), (&b, peer(1)), (&c, peer(2))];
        let (want, want_packed) = two_pass(&jobs, GATHER_PIECE).expect("in bounds");
        let (got, packed) = one_pass(&jobs, GATHER_PIECE).expect("in bounds");
        assert_eq!(got, want);
        assert_eq!(packed, want_packed);
        assert_eq!((packed.descriptors, packed.copies), (12, 5), "planned 12, copied 5");
        assert_eq!(packed.pieces, 6, "the 40 KiB run is split in two: {packed:?}");
        // Into a buffer just large enough for one descriptor per pair: a 100 KiB pair's
        // four pieces need more, and it says how much.
        let long = [pair(0, 0, 100 << 10)];
        let mut out = vec![0u64; 3];
        assert_eq!(
            pack_descriptors(&[(&long, P)], L, GATHER_PIECE, &mut out),
            Err(PackFailure::Room { words: 3 * 4 })
        );
        let mut out = vec![0u64; 3 * 12];
        assert_eq!(
            pack_descriptors(&jobs, L, GATHER_PIECE, &mut out[..3 * 12 - 1]),
            Err(PackFailure::Room { words: 3 * 12 }),
            "one descriptor per pair, before anything is packed"
        );
    }

    #[test]
    fn one_pass_packing_refuses_a_pair_outside_either_buffer_as_the_batch_does() {
        let ok = [pair(0, 0, 8), pair(64, 64, 8)];
        for bad in [
            pair(L.len - 4, 0, 8),
            pair(0, peer(1).len, 1),
            pair(u64::MAX - 1, 0, 4),
            pair(0, u64::MAX, u64::MAX),
        ] {
            let second = [pair(8, 8, 8), bad, pair(0, 0, 0)];
            let jobs: Vec<(&[Pair], Span)> = vec![(&ok, peer(0)), (&second, peer(1))];
            let want = two_pass(&jobs, GATHER_PIECE).expect_err("out of bounds");
            let got = one_pass(&jobs, GATHER_PIECE).expect_err("out of bounds");
            assert_eq!(got, PackFailure::Pair(want.0, want.1), "{bad:?}");
        }
        // A local span whose end overflows the address space holds nothing.
        let top = Span { base: u64::MAX - 8, len: 64 };
        let mut out = vec![0u64; 3];
        let e = pack_descriptors(&[(&[pair(0, 0, 1)], P)], top, GATHER_PIECE, &mut out).expect_err("wrap");
        assert!(
            matches!(e, PackFailure::Pair(0, CudaBatchError::OutOfBounds { side: "local", .. })),
            "{e:?}"
        );
    }

    #[test]
    fn one_pass_packing_on_several_threads_is_packing_on_one() {
        // Four peers of 5,000 pairs, some runs contiguous (so stretches shorten and move up),
        // packed on the pool's threads (`PackThreads::Pool`) on pools of four, two and one
        // thread.
        let lists: Vec<Vec<Pair>> = (0..4u64)
            .map(|i| {
                (0..5_000u64)
                    .map(|k| {
                        pair(
                            (k * 97 + i) % 8000 * 128,
                            if k % 3 == 0 { k * 128 } else { k % 4000 * 256 },
                            64 + i,
                        )
                    })
                    .collect()
            })
            .collect();
        let jobs: Vec<(&[Pair], Span)> = lists.iter().map(Vec::as_slice).zip((0..4).map(peer)).collect();
        let (want, want_packed) = two_pass(&jobs, GATHER_PIECE).expect("in bounds");
        for threads in [4, 2, 1] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let (got, packed) =
                pool.install(|| one_pass_on(PackThreads::Pool, &jobs, GATHER_PIECE)).expect("in bounds");
            assert_eq!(packed, want_packed, "{threads} threads");
            assert!(got == want, "{threads} threads: the words differ");
            let mut bad = lists.clone();
            bad[2][10] = pair(L.len, 0, 8);
            let jobs: Vec<(&[Pair], Span)> = bad.iter().map(Vec::as_slice).zip((0..4).map(peer)).collect();
            let e = pool
                .install(|| one_pass_on(PackThreads::Pool, &jobs, GATHER_PIECE))
                .expect_err("out of bounds");
            assert!(
                matches!(
                    e,
                    PackFailure::Pair(2, CudaBatchError::OutOfBounds { index: 10, side: "local", .. })
                ),
                "{e:?}"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 400, ..Default::default() })]

        /// Random plans (runs contiguous on both sides, on one side only, zero-length and
        /// unaligned pairs, copies longer than a piece, small pieces): one pass writes what two
        /// passes wrote, word for word.
        #[test]
        fn one_pass_packing_matches_two_passes(
            parts in proptest::collection::vec(
                proptest::collection::vec((0u64..4, 0u64..3, 0u64..20_000), 0..40),
                1..5,
            ),
            piece in proptest::prop_oneof![proptest::strategy::Just(GATHER_PIECE), 16u64..5000],
        ) {
            // Each step continues the last pair on both sides (0), on the local side only
            // (1), jumps (2) or jumps back (3); lengths 0 (step 1 of 3) or up to 20,000 bytes.
            let lists: Vec<Vec<Pair>> = parts.iter().map(|steps| {
                let (mut l, mut r) = (0u64, 0u64);
                steps.iter().map(|&(kind, zero, len)| {
                    let len = if zero == 1 { 0 } else { len };
                    match kind {
                        0 => {}
                        1 => r += 4099,
                        2 => { l += 777; r += 13; }
                        _ => { l /= 2; r /= 3; }
                    }
                    let p = pair(l, r, len);
                    l += len;
                    r += len;
                    p
                }).collect()
            }).collect();
            let peers: Vec<Span> = (0..lists.len() as u64).map(|i| Span { base: P.base + (i << 24), len: 1 << 22 }).collect();
            let local = Span { base: L.base, len: 1 << 22 };
            let jobs: Vec<(&[Pair], Span)> = lists.iter().map(Vec::as_slice).zip(peers.iter().copied()).collect();
            let mut b = CopyBatch::default();
            for (i, (pairs, peer)) in jobs.iter().enumerate() {
                if i == 0 { b.pack(pairs.iter().copied(), local, *peer) } else { b.add(pairs.iter().copied(), local, *peer) }
                    .expect("in bounds");
            }
            let mut want = Vec::new();
            let pieces = gather_descriptors(&b, piece, &mut want);
            let mut out = vec![0u64; 3 * pieces.max(b.descriptors() as usize)];
            let packed = pack_descriptors(&jobs, local, piece, &mut out).expect("room for every piece");
            proptest::prop_assert_eq!(packed.pieces, pieces);
            proptest::prop_assert_eq!(&out[..3 * pieces], &want[..]);
            proptest::prop_assert_eq!(
                (packed.copies, packed.descriptors, packed.bytes, packed.unaligned),
                (b.copies() as u64, b.descriptors(), b.bytes(), b.unaligned_descriptors())
            );
        }
    }
}
