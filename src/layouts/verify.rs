//! Request-level fill and verification: what a prefill rank writes into the blocks of a
//! request, and what a decode rank checks after its reads land.
//!
//! Verification is derived from the decode rank's *own* geometry (its global heads, its
//! layout, the block-size ratio and the permute flag), never from the rank map or the
//! plan, so a wrong map, offset or layout is caught as a mismatch.

use super::geometry::{Axis, BlockContent, RankGeometry, Region};
use super::pattern::{BlockOrigin, Mismatch, fill_block, verify_block};
use super::plan::BlockPairs;

/// Fills every region block of a request on a prefill rank. `remote` are the request's
/// prefill block ids in prompt order; `alloc` is the rank's whole allocation.
pub fn fill_request(geom: &RankGeometry, regions: &[Region], remote: &[u32], seed: u64, alloc: &mut [u8]) {
    let n = u64::from(geom.block_tokens);
    for (pos, &b) in remote.iter().enumerate() {
        let origin = BlockOrigin {
            seed,
            first_global_head: geom.global_heads.start,
            first_token: (pos as u64 * n) as u32,
        };
        for r in regions {
            let off = r.block_off(u64::from(b)) as usize;
            if let Some(block) = alloc.get_mut(off..off + r.block_len as usize) {
                fill_block(&r.content, origin, block);
            }
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

/// Checks the sub-blocks a decode rank received for one request. `bp` pairs local
/// sub-blocks with remote positions; `p_block_tokens` is the prefill block size; with
/// `sample` > 1 every `sample`-th (sub-block, region) is checked whole (1 = everything),
/// so sampling costs in proportion to what it checks.
#[expect(clippy::too_many_arguments, reason = "each is an independent fact of the request")]
pub fn verify_request(
    geom: &RankGeometry,
    regions: &[Region],
    bp: &BlockPairs,
    bsr: u32,
    permutes: bool,
    p_block_tokens: u32,
    seed: u64,
    alloc: &[u8],
    sample: u32,
) -> Result<Verified, Mismatch> {
    let r = u64::from(bsr.max(1));
    let mut bytes = 0;
    let sample = u64::from(sample.max(1));
    let phase = seed % sample;
    for (ri, region) in regions.iter().enumerate() {
        let content = landing_sub_content(region, bsr, permutes);
        let sub_len = region.block_len / r;
        let sub_step = region.block_stride / r;
        for (i, &sub) in bp.local.iter().enumerate() {
            if sample > 1 && (i as u64 * regions.len() as u64 + ri as u64) % sample != phase {
                continue;
            }
            let off = region.base_off + sub * sub_step;
            let origin = BlockOrigin {
                seed,
                first_global_head: geom.global_heads.start,
                first_token: ((bp.first_remote_pos + i) as u64 * u64::from(p_block_tokens)) as u32,
            };
            let block = alloc.get(off as usize..(off + sub_len) as usize).unwrap_or(&[]);
            bytes += verify_block(&content, origin, block, 1)
                .map_err(|m| Mismatch { offset: off + m.offset, ..m })?;
        }
    }
    Ok(Verified { bytes })
}
