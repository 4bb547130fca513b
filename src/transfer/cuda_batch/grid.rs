//! `--batch-descriptors device`: a request's descriptors made on the GPU from its plan as it
//! stands, instead of packed one by one on the host.
//!
//! A uniform plan's descriptors are a grid: for every region of a READ (a layer's K or V, with
//! the READ's head slice) and every block pair of the request, `(local base + local block x
//! local step, remote base + remote block x remote step, len)` ([`RegionXfer::pair`]). The
//! host writes the grid's two sides (five u64 per region, two per block pair: a few KiB for a
//! request of tens of thousands of descriptors), checks its bounds per region instead of per
//! descriptor, and the gather module's `kvx_grid_expand` kernel writes the `(dst, src, len)`
//! descriptors the gather kernel then copies. Nothing is coalesced: the descriptors are the
//! plan's, in its posting order.
//!
//! Owns: the host side of the grid (its table, bounds, counts) and [`GridBatch::expand`], the
//! kernel's arithmetic in Rust, which the tests hold the PTX to.

use super::error::CudaBatchError;
use super::pack::Span;
use crate::layouts::read_plan::RegionXfer;

/// Words per region in the table: dst base, dst step, src base, src step, len.
pub const REGION_WORDS: usize = 5;

/// One batch of grid descriptors: the regions of one or more READs (each against its peer's
/// pool) over one request's block pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GridBatch {
    /// The upload, as the kernel reads it: [`REGION_WORDS`] u64 per region (absolute
    /// addresses), then two u64 (local block, remote block) per block pair.
    words: Vec<u64>,
    regions: usize,
    pairs: usize,
    local: Span,
    peers: Vec<Span>,
    bytes: u64,
    unaligned: u64,
    longest: u64,
}

impl GridBatch {
    /// Packs `reads` (each READ's regions, against its peer's pool) over the block pairs
    /// (`local_ids[i]` with `remote_ids[i]`), all into `local`, replacing what the batch held
    /// (its table is reused). Bounds are checked per region at the largest block id on each
    /// side, which is where a region's descriptors reach furthest (steps are not negative).
    /// Fails on the first READ with a descriptor outside either pool, naming the descriptor
    /// as [`super::CopyBatch::add`] does (its index counts from that READ's first); the batch
    /// is then empty.
    pub fn pack(
        &mut self,
        reads: &[(&[RegionXfer], Span)],
        local_ids: &[u64],
        remote_ids: &[u64],
        local: Span,
    ) -> Result<(), (usize, CudaBatchError)> {
        self.clear();
        let n = local_ids.len().min(remote_ids.len());
        let (local_ids, remote_ids) = (&local_ids[..n], &remote_ids[..n]);
        // The position of the largest id on each side (the first, if several).
        let argmax = |ids: &[u64]| {
            ids.iter().copied().enumerate().max_by_key(|&(i, v)| (v, std::cmp::Reverse(i))).unwrap_or((0, 0))
        };
        let ((l_at, l_max), (r_at, r_max)) = (argmax(local_ids), argmax(remote_ids));
        let room = |s: Span| if s.base.checked_add(s.len).is_some() { s.len } else { 0 };
        let l_room = room(local);
        self.local = local;
        self.words.reserve(REGION_WORDS * reads.iter().map(|(r, _)| r.len()).sum::<usize>() + 2 * n);
        for (read, &(regions, peer)) in reads.iter().enumerate() {
            let p_room = room(peer);
            for (k, x) in regions.iter().enumerate() {
                if n > 0 && x.len > 0 {
                    // The furthest descriptor on each side; an overflow is outside too.
                    let reach = |base: u64, step: u64, id: u64| {
                        id.checked_mul(step).and_then(|o| o.checked_add(base))
                    };
                    let fits =
                        |off: Option<u64>, room: u64| off.is_some_and(|o| o <= room && x.len <= room - o);
                    let (l_off, r_off) = (reach(x.l_base, x.l_step, l_max), reach(x.r_base, x.r_step, r_max));
                    let local_ok = fits(l_off, l_room);
                    if !local_ok || !fits(r_off, p_room) {
                        let (side, offset, span, at) = if local_ok {
                            ("peer", r_off.unwrap_or(u64::MAX), peer, r_at)
                        } else {
                            ("local", l_off.unwrap_or(u64::MAX), local, l_at)
                        };
                        self.clear();
                        return Err((
                            read,
                            CudaBatchError::OutOfBounds {
                                index: k * n + at,
                                side,
                                offset,
                                end: offset.saturating_add(x.len),
                                len: span.len,
                            },
                        ));
                    }
                }
                // In bounds (or never read): the spans' ends do not overflow, nor do these.
                let (dst, src) = (local.base.wrapping_add(x.l_base), peer.base.wrapping_add(x.r_base));
                self.words.extend_from_slice(&[dst, x.l_step, src, x.r_step, x.len]);
                self.bytes += x.len * n as u64;
                self.longest = self.longest.max(x.len);
                self.unaligned += if x.len == 0 {
                    0
                } else if (x.l_step | x.r_step).is_multiple_of(16) {
                    // Every descriptor of the region shares its alignment.
                    if (dst | src | x.len).is_multiple_of(16) { 0 } else { n as u64 }
                } else {
                    local_ids
                        .iter()
                        .zip(remote_ids)
                        .filter(|&(&l, &r)| {
                            let (d, s) = (dst + l * x.l_step, src + r * x.r_step);
                            !(d | s | x.len).is_multiple_of(16)
                        })
                        .count() as u64
                };
            }
            self.regions += regions.len();
            self.peers.push(peer);
        }
        for (&l, &r) in local_ids.iter().zip(remote_ids) {
            self.words.extend_from_slice(&[l, r]);
        }
        self.pairs = n;
        Ok(())
    }

    fn clear(&mut self) {
        self.words.clear();
        self.peers.clear();
        self.regions = 0;
        self.pairs = 0;
        self.bytes = 0;
        self.unaligned = 0;
        self.longest = 0;
    }

    /// The upload: the region table, then the block pairs.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Words of the upload before the block pairs.
    pub fn table_words(&self) -> usize {
        REGION_WORDS * self.regions
    }

    /// Block pairs of the request.
    pub fn pairs(&self) -> u64 {
        self.pairs as u64
    }

    /// The plan's descriptors: every region over every block pair (zero-length ones too).
    pub fn descriptors(&self) -> u64 {
        (self.regions * self.pairs) as u64
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Descriptors whose local or peer address or length is not a multiple of 16.
    pub fn unaligned_descriptors(&self) -> u64 {
        self.unaligned
    }

    /// The longest descriptor: one block of the gather kernel copies each.
    pub fn longest(&self) -> u64 {
        self.longest
    }

    pub fn local(&self) -> Span {
        self.local
    }

    /// The peer pools the READs read from, in order.
    pub fn peers(&self) -> &[Span] {
        &self.peers
    }

    pub fn is_empty(&self) -> bool {
        self.descriptors() == 0
    }

    /// What `kvx_grid_expand` writes, descriptor by descriptor: `(dst, src, len)` of region
    /// `i / pairs` and block pair `i % pairs`.
    pub fn expand(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let (table, pairs) = self.words.split_at(self.table_words());
        table.chunks_exact(REGION_WORDS).flat_map(move |x| {
            pairs.chunks_exact(2).map(move |p| (x[0] + p[0] * x[1], x[2] + p[1] * x[3], x[4]))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::read_plan::Pair;

    const L: Span = Span { base: 0x7000_0000, len: 1 << 20 };
    const P: Span = Span { base: 0x9000_0000, len: 1 << 20 };
    const Q: Span = Span { base: 0xb000_0000, len: 1 << 20 };

    fn region(l_base: u64, l_step: u64, r_base: u64, r_step: u64, len: u64) -> RegionXfer {
        RegionXfer { l_base, l_step, r_base, r_step, len }
    }

    /// The plan's pairs of `regions` over the block pairs, region-major (`Planner::plan_into`).
    fn plan(regions: &[RegionXfer], l: &[u64], r: &[u64]) -> Vec<Pair> {
        regions
            .iter()
            .flat_map(|x| {
                l.iter().zip(r).map(move |(&a, &b)| Pair {
                    local: x.l_base + a * x.l_step,
                    remote: x.r_base + b * x.r_step,
                    len: x.len,
                })
            })
            .collect()
    }

    #[test]
    fn the_grid_expands_to_the_plans_descriptors_in_posting_order() {
        let a = [region(0, 8192, 4096, 16_384, 4096), region(1 << 19, 8192, 0, 16_384, 4096)];
        let b = [region(4096, 8192, 4096, 16_384, 4096)];
        let (l, r) = ([3u64, 0, 7], [1u64, 5, 2]);
        let mut g = GridBatch::default();
        g.pack(&[(&a, P), (&b, Q)], &l, &r, L).expect("in bounds");
        let want: Vec<(u64, u64, u64)> = plan(&a, &l, &r)
            .iter()
            .map(|p| (L.base + p.local, P.base + p.remote, p.len))
            .chain(plan(&b, &l, &r).iter().map(|p| (L.base + p.local, Q.base + p.remote, p.len)))
            .collect();
        assert_eq!(g.expand().collect::<Vec<_>>(), want);
        assert_eq!(g.descriptors(), 9);
        assert_eq!(g.bytes(), 9 * 4096);
        assert_eq!(g.unaligned_descriptors(), 0);
        assert_eq!(g.peers(), [P, Q]);
        assert_eq!(g.words().len(), 3 * REGION_WORDS + 2 * 3);
    }

    #[test]
    fn a_region_reaching_past_either_pool_is_refused_at_its_furthest_descriptor() {
        let mut g = GridBatch::default();
        // Local: block 127 of 8 KiB steps ends at 1 MiB exactly (fits); 128 does not.
        let ok = [region(0, 8192, 0, 8192, 8192)];
        g.pack(&[(&ok, P)], &[127, 3], &[0, 1], L).expect("ends at the pool's end");
        let err = g.pack(&[(&ok, P)], &[5, 128, 128], &[0, 1, 2], L).expect_err("past the local pool");
        assert_eq!(
            err,
            (
                0,
                CudaBatchError::OutOfBounds {
                    index: 1,
                    side: "local",
                    offset: 128 * 8192,
                    end: 129 * 8192,
                    len: 1 << 20
                }
            )
        );
        assert!(g.is_empty() && g.words().is_empty(), "nothing is left of a refused batch");
        // The peer side of the second READ, second region.
        let far = [region(0, 8192, 0, 8192, 8192), region(0, 8192, 8, 8192, 8192)];
        let err = g.pack(&[(&ok, P), (&far, Q)], &[1, 2], &[127, 4], L).expect_err("past the peer's pool");
        assert_eq!(err.0, 1);
        assert!(matches!(err.1, CudaBatchError::OutOfBounds { index: 2, side: "peer", .. }), "{err:?}");
        // Steps that overflow are outside, not wrapped around.
        let huge = [region(0, u64::MAX / 2, 0, 8192, 16)];
        assert!(g.pack(&[(&huge, P)], &[3], &[0], L).is_err());
        // Zero-length regions read nothing and are never out of bounds.
        let empty = [region(u64::MAX - 4, 1, 0, 8192, 0)];
        g.pack(&[(&empty, P)], &[9], &[0], L).expect("reads nothing");
        assert_eq!((g.descriptors(), g.bytes()), (1, 0));
    }

    #[test]
    fn a_decode_ranks_grid_is_its_planners_pairs_for_every_layout_and_tp_pair() {
        use crate::layouts::compat::PairSpec;
        use crate::layouts::read_plan::{Planner, RequestBlocks};
        use crate::layouts::{EngineSpec, Layout};
        use crate::topology::VllmVersion;
        use crate::vocab::model::ModelShape;
        let layouts =
            [Layout::Lbhnc, Layout::Lbnhc, Layout::Lhbnc, Layout::Blhnc, Layout::Blnhc, Layout::Bhlnc];
        let (mut checked, mut seen) = (0, Vec::new());
        for layout in layouts {
            for (p, d, p_tokens, d_tokens) in
                [(8, 2, 16, 16), (2, 4, 16, 16), (4, 4, 32, 16), (1, 2, 16, 16), (2, 2, 16, 16)]
            {
                let engine = |tp, block_tokens| EngineSpec { tp, block_tokens, num_blocks: 64, layout };
                let pair = PairSpec {
                    version: VllmVersion::V0_33,
                    model: ModelShape::toy(8),
                    p: engine(p, p_tokens),
                    d: engine(d, d_tokens),
                    permute: false,
                };
                let Ok(map) = pair.validate() else { continue };
                for d_rank in 0..d {
                    let planner = Planner::new(&pair, &map, d_rank).expect("planner");
                    let req = RequestBlocks { local: vec![9, 3, 40, 41], remote: vec![7, 0, 12, 63] };
                    let bp = planner.pair_blocks(&req).expect("in the pools");
                    let mut pairs = vec![Vec::new(); planner.reads.len()];
                    planner.plan_into(&bp, &mut pairs);
                    let peers: Vec<Span> = (0..planner.reads.len() as u64)
                        .map(|i| Span { base: 0x1_0000_0000 * (i + 2), len: 1 << 30 })
                        .collect();
                    let reads: Vec<(&[RegionXfer], Span)> =
                        planner.reads.iter().zip(&peers).map(|(rd, &s)| (rd.regions.as_slice(), s)).collect();
                    let local = Span { base: 0x1_0000_0000, len: 1 << 30 };
                    let mut g = GridBatch::default();
                    g.pack(&reads, &bp.local, &bp.remote, local).expect("in bounds");
                    let want: Vec<(u64, u64, u64)> = pairs
                        .iter()
                        .zip(&peers)
                        .flat_map(|(ps, s)| {
                            ps.iter().map(|p| (local.base + p.local, s.base + p.remote, p.len))
                        })
                        .collect();
                    assert_eq!(g.expand().collect::<Vec<_>>(), want, "{layout:?} P{p}->D{d} rank {d_rank}");
                    assert_eq!(g.bytes(), want.iter().map(|w| w.2).sum::<u64>());
                    checked += 1;
                    if !seen.contains(&layout) {
                        seen.push(layout);
                    }
                }
            }
        }
        // vLLM refuses some of these pairs (a TP mismatch under a token-major layout, ...).
        assert!(
            checked >= 16 && seen.len() == layouts.len(),
            "{checked} decode ranks checked, layouts {seen:?}"
        );
    }

    #[test]
    fn unaligned_descriptors_are_counted_exactly() {
        let mut g = GridBatch::default();
        // Steps multiples of 16: the region's alignment is every descriptor's.
        let a = [region(0, 8192, 0, 8192, 4096), region(3, 8192, 3, 8192, 100)];
        g.pack(&[(&a, P)], &[0, 1, 2], &[2, 1, 0], L).expect("in bounds");
        assert_eq!(g.unaligned_descriptors(), 3);
        // Odd steps: block by block (local ids 0 and 16 land on multiples of 16).
        let b = [region(0, 8193, 0, 8192, 32)];
        g.pack(&[(&b, P)], &[0, 1, 16, 3], &[0, 0, 0, 0], L).expect("in bounds");
        let want = g.expand().filter(|(d, s, n)| (d | s | n) % 16 != 0).count() as u64;
        assert_eq!((g.unaligned_descriptors(), want), (2, 2));
    }
}
