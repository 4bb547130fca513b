//! Descriptor plans: the `(local offset, remote offset, length)` pairs a decode rank posts
//! for one request, in vLLM's posting order, and their coalesced form.
//!
//! Offsets are bytes from each rank's allocation base. Posting order is vLLM's: one READ
//! per source P rank (in read-rank order), and inside it region-major: every block of
//! region 0, then region 1, and so on, because descriptor ids are
//! `region * num_blocks + block`.
//!
//! Block ids are paired as vLLM's `_read_blocks` does: each local (decode) block `b` is
//! expanded into sub-blocks `b*r .. b*r+r-1` (`r` = block-size ratio), the expanded list is
//! clipped to the number of remote blocks, and the remote list is trimmed to its last
//! `len(expanded)` entries (a partial prefix hit reads only the missing tail).
//!
//! The pair arithmetic is a precomputed per-(read, region) affine map, so materialising a
//! plan is a streaming write, and `PlanStream` walks the same plan without storing it.

use serde::Serialize;

use super::compat::PairSpec;
use super::geometry::Region;
use crate::error::KnobError;
use crate::topology::{DRankMap, RankMap, VllmVersion};
use crate::vocab::knob::Knob;

/// One descriptor pair: read `len` bytes at `remote` (P rank offset) into `local` (D rank
/// offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
#[repr(C)]
pub struct Pair {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// A request's block ids on both sides (one KV cache group).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct RequestBlocks {
    /// Decode blocks to fill (the unhashed, newly allocated ones).
    pub local: Vec<u32>,
    /// Prefill blocks holding the whole prompt.
    pub remote: Vec<u32>,
}

/// The request ids that go into notification strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestIds {
    /// The prefill engine's request id (`remote_request_id`).
    pub p_request_id: String,
    /// The decode engine's own request id (only vLLM 0.19.1's MLA broadcast uses it).
    pub d_request_id: String,
}

/// Sub-block and remote block indices paired 1:1, after expansion, clipping and trimming.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockPairs {
    /// Local sub-block indices (`b * r + k`).
    pub local: Vec<u64>,
    pub remote: Vec<u64>,
    /// Position of the first paired remote block in the request's remote list.
    pub first_remote_pos: usize,
}

impl BlockPairs {
    pub fn len(&self) -> usize {
        self.local.len()
    }

    pub fn is_empty(&self) -> bool {
        self.local.is_empty()
    }
}

/// Pairs a request's block ids; checks them against both pools.
pub fn pair_blocks(
    req: &RequestBlocks,
    bsr: u32,
    local_pool: u32,
    remote_pool: u32,
) -> Result<BlockPairs, KnobError> {
    if let Some(&b) = req.local.iter().find(|&&b| b >= local_pool) {
        return Err(KnobError::new(
            Knob::LocalBlocks,
            format!("decode block id {b} is outside the decode pool of {local_pool} blocks"),
        ));
    }
    if let Some(&b) = req.remote.iter().find(|&&b| b >= remote_pool) {
        return Err(KnobError::new(
            Knob::RemoteBlocks,
            format!("prefill block id {b} is outside the prefill pool of {remote_pool} blocks"),
        ));
    }
    let r = u64::from(bsr.max(1));
    let local: Vec<u64> = req
        .local
        .iter()
        .flat_map(|&b| (0..r).map(move |k| u64::from(b) * r + k))
        .take(req.remote.len())
        .collect();
    let first_remote_pos = req.remote.len() - local.len();
    let remote = req.remote[first_remote_pos..].iter().map(|&b| u64::from(b)).collect();
    Ok(BlockPairs { local, remote, first_remote_pos })
}

/// The affine map of one (read, region): `local = l_base + l_idx * l_step`,
/// `remote = r_base + r_idx * r_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RegionXfer {
    pub l_base: u64,
    pub l_step: u64,
    pub r_base: u64,
    pub r_step: u64,
    pub len: u64,
}

impl RegionXfer {
    #[inline]
    pub(crate) fn pair(&self, l: u64, r: u64) -> Pair {
        Pair { local: self.l_base + l * self.l_step, remote: self.r_base + r * self.r_step, len: self.len }
    }
}

/// The precomputed geometry of one READ (one source P rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadGeom {
    pub p_rank: u32,
    /// Byte offset inside one P region block where the read starts (first region).
    pub remote_offset_in_block: u64,
    /// Byte offset inside one D region block where the bytes land (first region).
    pub local_offset_in_block: u64,
    /// Bytes per region block read.
    pub length: u64,
    pub regions: Vec<RegionXfer>,
}

/// A notification-only message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotifOnly {
    pub p_rank: u32,
    pub msg: String,
}

/// One READ of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadPlan {
    pub p_rank: u32,
    pub notif_msg: String,
    pub pairs: Vec<Pair>,
}

/// The plan of one decode rank for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DRankPlan {
    pub d_rank: u32,
    pub reads: Vec<ReadPlan>,
    pub notifs_only: Vec<NotifOnly>,
}

impl DRankPlan {
    pub fn descriptor_count(&self) -> usize {
        self.reads.iter().map(|r| r.pairs.len()).sum()
    }

    pub fn bytes(&self) -> u64 {
        self.reads.iter().flat_map(|r| &r.pairs).map(|p| p.len).sum()
    }
}

/// Everything needed to plan requests for one decode rank; build once, plan many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Planner {
    pub d_rank: u32,
    pub version: VllmVersion,
    pub bsr: u32,
    pub map: DRankMap,
    pub reads: Vec<ReadGeom>,
    pub local_regions: Vec<Region>,
    pub remote_regions: Vec<Region>,
    /// Local and remote pool sizes in blocks.
    pub local_pool: u32,
    pub remote_pool: u32,
}

impl Planner {
    /// Builds the planner of `d_rank`; `pair` must have been validated into `map`.
    pub fn new(pair: &PairSpec, map: &RankMap, d_rank: u32) -> Result<Self, KnobError> {
        let dmap = map.d_ranks.get(d_rank as usize).cloned().ok_or_else(|| {
            KnobError::new(
                Knob::DRank,
                format!("decode rank {d_rank} does not exist (decode TP is {})", map.spec.d_tp),
            )
        })?;
        let bsr = pair.block_size_ratio();
        let local_regions = pair.d_geometry(d_rank).regions();
        let remote_regions = pair.p_geometry(0).regions();
        let (hp, hd) = (u64::from(map.p_heads_per_rank), u64::from(map.d_heads_per_rank));
        let r = u64::from(bsr);
        let reads = dmap
            .reads
            .iter()
            .map(|hr| {
                let regions: Vec<RegionXfer> = local_regions
                    .iter()
                    .zip(&remote_regions)
                    .map(|(l, rm)| {
                        // Head slices scale a region block's bytes (heads are its outermost
                        // axis whenever a slice is not the whole block).
                        let heads = u64::from(hr.p_heads.end - hr.p_heads.start);
                        RegionXfer {
                            l_base: l.base_off + l.block_len * u64::from(hr.d_heads.start) / hd / r,
                            l_step: l.block_stride / r,
                            r_base: rm.base_off + rm.block_len * u64::from(hr.p_heads.start) / hp,
                            r_step: rm.block_stride,
                            len: rm.block_len * heads / hp,
                        }
                    })
                    .collect();
                let first = regions.first().copied();
                ReadGeom {
                    p_rank: hr.p_rank,
                    remote_offset_in_block: first.map_or(0, |x| x.r_base - remote_regions[0].base_off),
                    local_offset_in_block: first.map_or(0, |x| x.l_base - local_regions[0].base_off),
                    length: first.map_or(0, |x| x.len),
                    regions,
                }
            })
            .collect();
        Ok(Planner {
            d_rank,
            version: pair.version,
            bsr,
            map: dmap,
            reads,
            local_regions,
            remote_regions,
            local_pool: pair.d.num_blocks,
            remote_pool: pair.p.num_blocks,
        })
    }

    /// Pairs the request's block ids for this planner's pools.
    pub fn pair_blocks(&self, req: &RequestBlocks) -> Result<BlockPairs, KnobError> {
        pair_blocks(req, self.bsr, self.local_pool, self.remote_pool)
    }

    /// The notification string attached to every READ.
    pub fn notif_msg(&self, ids: &RequestIds) -> String {
        format!("{}:{}", ids.p_request_id, self.map.notif_count)
    }

    /// Notification-only messages: to P ranks handshaked but not read (MLA with P > D),
    /// and, on a full prefix hit (nothing to read), to every P rank that holds the blocks.
    pub fn notifs_only(&self, ids: &RequestIds, full_hit: bool) -> Vec<NotifOnly> {
        let mut out = Vec::new();
        if full_hit {
            out.extend(
                self.map.read_ranks.iter().map(|&p| NotifOnly { p_rank: p, msg: self.notif_msg(ids) }),
            );
        }
        let extra = match self.version {
            VllmVersion::V0_33 => format!("{}:1", ids.p_request_id),
            VllmVersion::V0_19 => format!("{}:{}", ids.d_request_id, self.map.notif_count),
        };
        out.extend(self.map.extra_notifs.iter().map(|&p| NotifOnly { p_rank: p, msg: extra.clone() }));
        out
    }

    /// Descriptor pairs of one request, per READ.
    pub fn plan(&self, req: &RequestBlocks, ids: &RequestIds) -> Result<DRankPlan, KnobError> {
        let bp = self.pair_blocks(req)?;
        let full_hit = req.local.is_empty();
        let mut reads = Vec::new();
        if !full_hit {
            let mut bufs = vec![Vec::new(); self.reads.len()];
            self.plan_into(&bp, &mut bufs);
            reads = self
                .reads
                .iter()
                .zip(bufs)
                .map(|(r, pairs)| ReadPlan { p_rank: r.p_rank, notif_msg: self.notif_msg(ids), pairs })
                .collect();
        }
        Ok(DRankPlan { d_rank: self.d_rank, reads, notifs_only: self.notifs_only(ids, full_hit) })
    }

    /// Number of pairs one READ of this request has.
    pub fn pairs_per_read(&self, bp: &BlockPairs) -> usize {
        bp.len() * self.local_regions.len()
    }

    /// Materialises the pairs of each READ into `out[i]` (cleared first, capacity reused).
    pub fn plan_into(&self, bp: &BlockPairs, out: &mut [Vec<Pair>]) {
        let n = self.pairs_per_read(bp);
        for (read, buf) in self.reads.iter().zip(out.iter_mut()) {
            buf.clear();
            buf.reserve(n);
            for x in &read.regions {
                buf.extend(bp.local.iter().zip(&bp.remote).map(|(&l, &r)| x.pair(l, r)));
            }
        }
    }

    /// Walks the plan without storing it, READ by READ in posting order.
    pub fn stream<'a>(&'a self, bp: &'a BlockPairs) -> PlanStream<'a> {
        PlanStream { planner: self, bp, read: 0, region: 0, block: 0 }
    }

    /// Descriptor count of each READ after coalescing (see `coalesced`); allocation-free.
    pub fn coalesced_counts(&self, bp: &BlockPairs) -> Vec<usize> {
        self.reads.iter().map(|read| best_order(&read.regions, &bp.local, &bp.remote).1).collect()
    }

    /// Coalesced pairs of each READ: neighbours contiguous on both sides are merged. Tries
    /// posting order and block order and keeps whichever merges more. Linear time.
    pub fn coalesced(&self, bp: &BlockPairs) -> Vec<Vec<Pair>> {
        self.reads.iter().map(|read| coalesce_regions(&read.regions, &bp.local, &bp.remote)).collect()
    }
}

/// Which order merges more for one transfer's `regions` over block ids paired 1:1
/// (`l_ids[i]` on the local side with `r_ids[i]` on the remote side): posting order (runs
/// of blocks inside a region) or block order (the layers of a block-outer layout). Counts
/// runs without storing anything; returns `(block_major, runs)`.
pub(crate) fn best_order(regions: &[RegionXfer], l_ids: &[u64], r_ids: &[u64]) -> (bool, usize) {
    let mut region_major = RunCounter::default();
    for x in regions {
        for (&l, &r) in l_ids.iter().zip(r_ids) {
            region_major.push(x.pair(l, r));
        }
    }
    if regions.len() < 2 {
        return (false, region_major.runs);
    }
    let mut block_major = RunCounter::default();
    for (&l, &r) in l_ids.iter().zip(r_ids) {
        for x in regions {
            block_major.push(x.pair(l, r));
        }
    }
    if block_major.runs < region_major.runs { (true, block_major.runs) } else { (false, region_major.runs) }
}

/// The coalesced pairs of one transfer, in whichever order merges more (see `best_order`).
pub(crate) fn coalesce_regions(regions: &[RegionXfer], l_ids: &[u64], r_ids: &[u64]) -> Vec<Pair> {
    let (block_major, runs) = best_order(regions, l_ids, r_ids);
    let mut c = Coalescer { out: Vec::with_capacity(runs), cur: None };
    if block_major {
        for (&l, &r) in l_ids.iter().zip(r_ids) {
            for x in regions {
                c.push(x.pair(l, r));
            }
        }
    } else {
        for x in regions {
            for (&l, &r) in l_ids.iter().zip(r_ids) {
                c.push(x.pair(l, r));
            }
        }
    }
    c.finish()
}

/// Counts the runs a coalescer would produce, without storing them.
#[derive(Debug, Default)]
struct RunCounter {
    runs: usize,
    end: Option<(u64, u64)>,
}

impl RunCounter {
    #[inline]
    fn push(&mut self, p: Pair) {
        if self.end != Some((p.local, p.remote)) {
            self.runs += 1;
        }
        self.end = Some((p.local + p.len, p.remote + p.len));
    }
}

/// Merges neighbouring pairs that are contiguous on both sides.
#[derive(Debug, Default)]
pub struct Coalescer {
    out: Vec<Pair>,
    cur: Option<Pair>,
}

impl Coalescer {
    #[inline]
    pub fn push(&mut self, p: Pair) {
        match &mut self.cur {
            Some(c) if c.local + c.len == p.local && c.remote + c.len == p.remote => c.len += p.len,
            Some(c) => {
                self.out.push(*c);
                self.cur = Some(p);
            }
            None => self.cur = Some(p),
        }
    }

    pub fn finish(mut self) -> Vec<Pair> {
        self.out.extend(self.cur.take());
        self.out
    }
}

/// Merges neighbours of a pair list in the given order.
pub fn coalesce(pairs: &[Pair]) -> Vec<Pair> {
    let mut c = Coalescer::default();
    for &p in pairs {
        c.push(p);
    }
    c.finish()
}

/// A plan walked in posting order without being stored: yields `(read index, pair)`.
#[derive(Debug, Clone)]
pub struct PlanStream<'a> {
    planner: &'a Planner,
    bp: &'a BlockPairs,
    read: usize,
    region: usize,
    block: usize,
}

impl Iterator for PlanStream<'_> {
    type Item = (usize, Pair);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let read = self.planner.reads.get(self.read)?;
            if let Some(x) = read.regions.get(self.region) {
                if let (Some(&l), Some(&r)) = (self.bp.local.get(self.block), self.bp.remote.get(self.block))
                {
                    self.block += 1;
                    return Some((self.read, x.pair(l, r)));
                }
                self.block = 0;
                self.region += 1;
            } else {
                self.region = 0;
                self.read += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairing_expands_clips_and_trims() {
        // vLLM's own worked example: local [5] with r = 2, remote [0, 1, 2].
        let req = RequestBlocks { local: vec![5], remote: vec![0, 1, 2] };
        let bp = pair_blocks(&req, 2, 8, 8).expect("in range");
        assert_eq!(bp.local, vec![10, 11]);
        assert_eq!(bp.remote, vec![1, 2]);
        assert_eq!(bp.first_remote_pos, 1);
        // Expanded local longer than remote: clipped.
        let req = RequestBlocks { local: vec![1, 2], remote: vec![0, 1, 3] };
        let bp = pair_blocks(&req, 2, 8, 8).expect("in range");
        assert_eq!((bp.local, bp.remote), (vec![2, 3, 4], vec![0, 1, 3]));
    }

    #[test]
    fn out_of_pool_block_names_flag() {
        let req = RequestBlocks { local: vec![9], remote: vec![0] };
        assert_eq!(pair_blocks(&req, 1, 8, 8).expect_err("out of range").knob, Knob::LocalBlocks);
    }

    #[test]
    fn coalescer_merges_only_both_side_contiguous() {
        let p = |l, r| Pair { local: l, remote: r, len: 10 };
        let c = coalesce(&[p(0, 100), p(10, 110), p(20, 200), p(30, 210)]);
        assert_eq!(
            c,
            vec![Pair { local: 0, remote: 100, len: 20 }, Pair { local: 20, remote: 200, len: 20 }]
        );
    }
}
