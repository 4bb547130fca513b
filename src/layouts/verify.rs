//! Request-level fill and verification: what a prefill rank writes into the blocks of a
//! request, and what a decode rank checks after its reads land.
//!
//! Verification is derived from the decode rank's *own* geometry (its global heads, its
//! layout, the block-size ratio and the permute flag), never from the rank map or the
//! plan, so a wrong map, offset or layout is caught as a mismatch.
//!
//! Both come in two forms: over a whole allocation as one byte slice ([`fill_request`],
//! [`VerifyPlan::verify_in`]), and as a list of byte ranges with what each must hold
//! ([`FillPlan`], [`VerifyPlan`]), for memory that is reached one range at a time (device
//! memory, staged through the host). The slice forms are the plans applied in place.

use std::ops::Range;

use super::geometry::{Axis, BlockContent, RankGeometry, Region};
use super::pattern::{BlockOrigin, Mismatch, fill_block, verify_block};
use super::read_plan::BlockPairs;

/// One block of one region, at a byte range of the allocation, with its content.
#[derive(Debug, Clone)]
struct BlockJob {
    range: Range<u64>,
    /// Index into the plan's contents.
    content: usize,
    origin: BlockOrigin,
}

/// Whether [verification] with stride `stride` fills (prefill) and checks (decode) the block at
/// position `pos` of the request's prompt in a region holding `content`: with stride 1 every
/// block; otherwise one in `stride` of each region's blocks and of each position's regions,
/// on a diagonal shifted by the request's seed. It depends only on what the block holds, so
/// both sides choose the same blocks by themselves and prefill writes nothing decode does not
/// read back.
///
/// [verification]: crate::vocab::knob::Knob::Verify
pub fn sampled(content: &BlockContent, pos: u64, seed: u64, stride: u32) -> bool {
    let s = u64::from(stride.max(1));
    let key = u64::from(content.layer.unwrap_or(0)) * 2 + u64::from(content.kv.unwrap_or(0));
    s == 1 || (pos + key + seed % s).is_multiple_of(s)
}

/// What a prefill rank writes for a request: the byte range of every (block, region) and
/// the pattern it holds. Apply with [`FillPlan::fill`] to each range's bytes.
#[derive(Debug, Clone)]
pub struct FillPlan {
    contents: Vec<BlockContent>,
    jobs: Vec<BlockJob>,
    block_tokens: u32,
}

impl FillPlan {
    /// The plan of a request whose prefill block ids, in prompt order, are `remote`. Ranges
    /// go region by region, so consecutive blocks of a region are neighbours in the list as
    /// they are in memory (device memory copies such runs at once).
    pub fn new(geom: &RankGeometry, regions: &[Region], remote: &[u32], seed: u64) -> FillPlan {
        let n = u64::from(geom.block_tokens);
        let mut jobs = Vec::with_capacity(remote.len() * regions.len());
        for (ri, r) in regions.iter().enumerate() {
            for (pos, &b) in remote.iter().enumerate() {
                let origin = BlockOrigin {
                    seed,
                    first_global_head: geom.global_heads.start,
                    first_token: (pos as u64 * n) as u32,
                };
                let off = r.block_off(u64::from(b));
                jobs.push(BlockJob { range: off..off + r.block_len, content: ri, origin });
            }
        }
        FillPlan {
            contents: regions.iter().map(|r| r.content.clone()).collect(),
            jobs,
            block_tokens: geom.block_tokens,
        }
    }

    /// Only the blocks [verification] `sample` with stride `stride` checks ([`sampled`]).
    ///
    /// [verification]: crate::vocab::knob::Knob::Verify
    pub fn only(mut self, stride: u32) -> FillPlan {
        let n = u64::from(self.block_tokens.max(1));
        let contents = &self.contents;
        self.jobs.retain(|j| {
            sampled(&contents[j.content], u64::from(j.origin.first_token) / n, j.origin.seed, stride)
        });
        self
    }

    /// The byte ranges to write, in the order [`FillPlan::fill`] numbers them.
    pub fn ranges(&self) -> Vec<Range<u64>> {
        self.jobs.iter().map(|j| j.range.clone()).collect()
    }

    /// Writes range `i`'s pattern into `bytes` (that range's bytes).
    pub fn fill(&self, i: usize, bytes: &mut [u8]) {
        if let Some(j) = self.jobs.get(i) {
            fill_block(&self.contents[j.content], j.origin, bytes);
        }
    }
}

/// Fills every region block of a request on a prefill rank. `remote` are the request's
/// prefill block ids in prompt order; `alloc` is the rank's whole allocation.
pub fn fill_request(geom: &RankGeometry, regions: &[Region], remote: &[u32], seed: u64, alloc: &mut [u8]) {
    let plan = FillPlan::new(geom, regions, remote, seed);
    for (i, j) in plan.jobs.iter().enumerate() {
        if let Some(block) = alloc.get_mut(j.range.start as usize..j.range.end as usize) {
            plan.fill(i, block);
        }
    }
}

/// What one prefill-sized sub-block of a decode region block holds right after the reads
/// land: the region's content with prefill-sized token runs, in HND order when permuting.
pub fn landing_sub_content(region: &Region, bsr: u32, permutes: bool) -> BlockContent {
    let mut c = region.content.clone();
    if permutes {
        let mut axes: Vec<(Axis, u32)> = c.axes.iter().copied().filter(|(a, _)| *a == Axis::Head).collect();
        axes.extend(c.axes.iter().copied().filter(|(a, _)| *a != Axis::Head));
        c.axes = axes;
    }
    if bsr > 1 {
        c.axes = c.axes.iter().map(|&(a, n)| if a == Axis::Token { (a, n / bsr) } else { (a, n) }).collect();
    }
    c
}

/// Totals of a verification.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verified {
    pub bytes: u64,
}

/// What a decode rank checks for a request: the byte range of every (sub-block, region)
/// it received, or with stride `sample` those [`sampled`] chooses, and the pattern each must
/// hold. Check with [`VerifyPlan::check`] against each range's bytes.
#[derive(Debug, Clone)]
pub struct VerifyPlan {
    contents: Vec<BlockContent>,
    jobs: Vec<BlockJob>,
}

impl VerifyPlan {
    /// `bp` pairs local sub-blocks with remote positions; `p_block_tokens` is the prefill
    /// block size; with `sample` > 1 the (sub-block, region)s [`sampled`] chooses are checked
    /// whole (1 = everything), so sampling costs in proportion to what it checks.
    #[expect(clippy::too_many_arguments, reason = "each is an independent fact of the request")]
    pub fn new(
        geom: &RankGeometry,
        regions: &[Region],
        bp: &BlockPairs,
        bsr: u32,
        permutes: bool,
        p_block_tokens: u32,
        seed: u64,
        sample: u32,
    ) -> VerifyPlan {
        let r = u64::from(bsr.max(1));
        let mut jobs = Vec::new();
        for (ri, region) in regions.iter().enumerate() {
            let sub_len = region.block_len / r;
            let sub_step = region.block_stride / r;
            for (i, &sub) in bp.local.iter().enumerate() {
                if !sampled(&region.content, (bp.first_remote_pos + i) as u64, seed, sample) {
                    continue;
                }
                let off = region.base_off + sub * sub_step;
                let origin = BlockOrigin {
                    seed,
                    first_global_head: geom.global_heads.start,
                    first_token: ((bp.first_remote_pos + i) as u64 * u64::from(p_block_tokens)) as u32,
                };
                jobs.push(BlockJob { range: off..off + sub_len, content: ri, origin });
            }
        }
        let contents = regions.iter().map(|rg| landing_sub_content(rg, bsr, permutes)).collect();
        VerifyPlan { contents, jobs }
    }

    /// Checks the sub-blocks a decode rank received for one request in its whole allocation
    /// `alloc` (the plan applied in place).
    pub fn verify_in(&self, alloc: &[u8]) -> Result<Verified, Mismatch> {
        let mut bytes = 0;
        for (i, j) in self.jobs.iter().enumerate() {
            let block = alloc.get(j.range.start as usize..j.range.end as usize).unwrap_or(&[]);
            bytes += self.check(i, block)?;
        }
        Ok(Verified { bytes })
    }

    /// The byte ranges to check, in the order [`VerifyPlan::check`] numbers them.
    pub fn ranges(&self) -> Vec<Range<u64>> {
        self.jobs.iter().map(|j| j.range.clone()).collect()
    }

    /// Checks range `i` against `bytes` (that range's bytes, fewer if the allocation ends
    /// early): the bytes checked, or the first byte that differs, as an offset from the
    /// allocation's start.
    pub fn check(&self, i: usize, bytes: &[u8]) -> Result<u64, Mismatch> {
        let Some(j) = self.jobs.get(i) else { return Ok(0) };
        verify_block(&self.contents[j.content], j.origin, bytes, 1)
            .map_err(|m| Mismatch { offset: j.range.start + m.offset, ..m })
    }
}
