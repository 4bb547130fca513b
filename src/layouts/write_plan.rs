//! Push-mode descriptor plans: the `(local, remote, len)` pairs a prefill rank posts as
//! WRITEs for one request, with *local* = the prefill rank (the source) and *remote* = the
//! decode rank (the destination), as in vLLM's `NixlPushConnectorWorker._xfer_blocks`.
//!
//! Posting order mirrors pull: one WRITE per target decode rank (in the order of the push
//! rank map), and inside it region-major (descriptor ids are `region * num_blocks + block`
//! on both sides). Block ids pair as vLLM's push path pairs them: the decode side
//! registered only its uncached blocks, and `_apply_prefix_caching` end-trims the prefill
//! list to that many, so a partial prefix hit writes only the missing tail. Block sizes are
//! equal in push (see `PairSpec::validate_push`), so there are no sub-blocks.
//!
//! The pair arithmetic and coalescing are pull's (`plan::RegionXfer`, `plan::best_order`):
//! the same bytes move, only the side that posts is the other one.

use serde::Serialize;

use super::compat::PairSpec;
use super::geometry::Region;
use super::read_plan::{
    BlockPairs, Pair, RegionXfer, RequestBlocks, RequestIds, best_order, coalesce_regions, pair_blocks,
};
use crate::error::KnobError;
use crate::topology::push_map::{PRankPushMap, PushRankMap};
use crate::vocab::knob::Knob;

/// The precomputed geometry of one WRITE (one target decode rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WriteGeom {
    pub d_rank: u32,
    /// The split handle (chunk of the prefill block) the write comes from.
    pub slot: u32,
    /// Byte offset inside one prefill region block where the written bytes start (first
    /// region).
    pub local_offset_in_block: u64,
    /// Byte offset inside one decode region block where they land (first region).
    pub remote_offset_in_block: u64,
    /// Bytes per region block written.
    pub length: u64,
    /// Another prefill rank writes the same bytes to the same place.
    pub duplicate_of: Option<u32>,
    /// Per region: `local` = prefill offsets, `remote` = decode offsets.
    pub regions: Vec<RegionXfer>,
}

/// One WRITE of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WritePlan {
    pub d_rank: u32,
    /// `"<decode request id>:<prefill TP>"`, carried by the WRITE.
    pub notif_msg: String,
    pub duplicate_of: Option<u32>,
    /// `local` = prefill offset, `remote` = decode offset.
    pub pairs: Vec<Pair>,
}

/// The plan of one prefill rank for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PRankPlan {
    pub p_rank: u32,
    pub writes: Vec<WritePlan>,
}

impl PRankPlan {
    pub fn descriptor_count(&self) -> usize {
        self.writes.iter().map(|w| w.pairs.len()).sum()
    }

    pub fn bytes(&self) -> u64 {
        self.writes.iter().flat_map(|w| &w.pairs).map(|p| p.len).sum()
    }
}

/// Everything needed to plan requests for one prefill rank; build once, plan many.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PushPlanner {
    pub p_rank: u32,
    pub map: PRankPushMap,
    pub writes: Vec<WriteGeom>,
    /// The prefill rank's regions (the local side).
    pub local_regions: Vec<Region>,
    /// A decode rank's regions (the remote side; every decode rank has the same geometry).
    pub remote_regions: Vec<Region>,
    /// Decode and prefill pool sizes in blocks.
    pub d_pool: u32,
    pub p_pool: u32,
}

impl PushPlanner {
    /// Builds the planner of `p_rank`; `pair` must have been validated into `map` (by
    /// `PairSpec::validate_push`).
    pub fn new(pair: &PairSpec, map: &PushRankMap, p_rank: u32) -> Result<Self, KnobError> {
        let pmap = map.p_ranks.get(p_rank as usize).cloned().ok_or_else(|| {
            KnobError::new(
                Knob::PRank,
                format!("prefill rank {p_rank} does not exist (prefill TP is {})", map.spec.p_tp),
            )
        })?;
        let local_regions = pair.p_geometry(p_rank).regions();
        let remote_regions = pair.d_geometry(0).regions();
        let (hp, hd) = (u64::from(map.p_heads_per_rank), u64::from(map.d_heads_per_rank));
        let writes = pmap
            .writes
            .iter()
            .map(|w| {
                let heads = u64::from(w.p_heads.end - w.p_heads.start);
                let regions: Vec<RegionXfer> = local_regions
                    .iter()
                    .zip(&remote_regions)
                    .map(|(l, r)| RegionXfer {
                        // Head slices scale a region block's bytes: heads are its outermost
                        // axis whenever a slice is not the whole block (checked layouts).
                        l_base: l.base_off + l.block_len * u64::from(w.p_heads.start) / hp,
                        l_step: l.block_stride,
                        r_base: r.base_off + r.block_len * u64::from(w.d_heads.start) / hd,
                        r_step: r.block_stride,
                        len: l.block_len * heads / hp,
                    })
                    .collect();
                let first = regions.first().copied();
                WriteGeom {
                    d_rank: w.d_rank,
                    slot: w.slot,
                    local_offset_in_block: first.map_or(0, |x| x.l_base - local_regions[0].base_off),
                    remote_offset_in_block: first.map_or(0, |x| x.r_base - remote_regions[0].base_off),
                    length: first.map_or(0, |x| x.len),
                    duplicate_of: w.duplicate_of,
                    regions,
                }
            })
            .collect();
        Ok(PushPlanner {
            p_rank,
            map: pmap,
            writes,
            local_regions,
            remote_regions,
            d_pool: pair.d.num_blocks,
            p_pool: pair.p.num_blocks,
        })
    }

    /// Pairs the request's block ids (decode-centric, as in pull: `local` = decode blocks,
    /// `remote` = prefill blocks). Decode must not register more blocks than prefill holds:
    /// vLLM asserts it (`_apply_prefix_caching`).
    pub fn pair_blocks(&self, req: &RequestBlocks) -> Result<BlockPairs, KnobError> {
        if req.local.len() > req.remote.len() {
            return Err(KnobError::new(
                Knob::LocalBlocks,
                format!(
                    "decode registers {} blocks but prefill holds only {}: in push mode prefill writes its blocks \
                     into decode's, and vLLM asserts decode allocated no more than prefill supplied",
                    req.local.len(),
                    req.remote.len()
                ),
            ));
        }
        pair_blocks(req, 1, self.d_pool, self.p_pool)
    }

    /// The notification every WRITE carries: the decode request id and the prefill TP.
    pub fn notif_msg(&self, ids: &RequestIds) -> String {
        format!("{}:{}", ids.d_request_id, self.map.notif_count)
    }

    /// Descriptor pairs of one request, per WRITE. A full prefix hit on decode (no decode
    /// blocks) means no registration and so no WRITE: prefill frees on lease expiry.
    pub fn plan(&self, req: &RequestBlocks, ids: &RequestIds) -> Result<PRankPlan, KnobError> {
        let bp = self.pair_blocks(req)?;
        let mut writes = Vec::new();
        if !req.local.is_empty() {
            writes = self
                .writes
                .iter()
                .map(|w| {
                    let mut pairs = Vec::with_capacity(bp.len() * w.regions.len());
                    for x in &w.regions {
                        pairs.extend(bp.remote.iter().zip(&bp.local).map(|(&p, &d)| x.pair(p, d)));
                    }
                    WritePlan {
                        d_rank: w.d_rank,
                        notif_msg: self.notif_msg(ids),
                        duplicate_of: w.duplicate_of,
                        pairs,
                    }
                })
                .collect();
        }
        Ok(PRankPlan { p_rank: self.p_rank, writes })
    }

    /// Descriptor count of each WRITE after coalescing; allocation-free.
    pub fn coalesced_counts(&self, bp: &BlockPairs) -> Vec<usize> {
        self.writes.iter().map(|w| best_order(&w.regions, &bp.remote, &bp.local).1).collect()
    }

    /// Coalesced pairs of each WRITE: neighbours contiguous on both sides merged.
    pub fn coalesced(&self, bp: &BlockPairs) -> Vec<Vec<Pair>> {
        self.writes.iter().map(|w| coalesce_regions(&w.regions, &bp.remote, &bp.local)).collect()
    }

    /// The pairs of one request cut by model layer, `[write][layer]`, for WRITEs that start as
    /// each layer is computed ([`Knob::Overlap`] `layers`, vllm-project/vllm#56874): layer `l` holds the
    /// pairs of the regions of layer `l`, region-major, coalesced inside the layer when
    /// `coalesce`. Regions that hold several layers (block-outer and cross-layer layouts) go
    /// with the last layer: they can only be written once the whole prefill is done. Together
    /// the layers hold exactly the pairs of [`Self::plan`] (or of [`Self::coalesced`]).
    pub fn layer_pairs(&self, bp: &BlockPairs, coalesce: bool, num_layers: u32) -> Vec<Vec<Vec<Pair>>> {
        let last = num_layers.saturating_sub(1);
        let layer_of =
            |i: usize| self.local_regions.get(i).and_then(|r| r.content.layer).map_or(last, |l| l.min(last));
        self.writes
            .iter()
            .map(|w| {
                (0..num_layers.max(1))
                    .map(|l| {
                        let regions: Vec<RegionXfer> = w
                            .regions
                            .iter()
                            .enumerate()
                            .filter(|&(i, _)| layer_of(i) == l)
                            .map(|(_, x)| *x)
                            .collect();
                        if coalesce {
                            coalesce_regions(&regions, &bp.remote, &bp.local)
                        } else {
                            regions
                                .iter()
                                .flat_map(|x| bp.remote.iter().zip(&bp.local).map(|(&p, &d)| x.pair(p, d)))
                                .collect()
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::{EngineSpec, Layout};
    use crate::topology::VllmVersion;
    use crate::vocab::model::ModelShape;

    fn pair(p: u32, d: u32, heads: u32) -> PairSpec {
        PairSpec {
            version: VllmVersion::V0_33,
            model: ModelShape::toy(heads),
            p: EngineSpec { tp: p, block_tokens: 16, num_blocks: 8, layout: Layout::Lbhnc },
            d: EngineSpec { tp: d, block_tokens: 16, num_blocks: 8, layout: Layout::Lbhnc },
            permute: false,
        }
    }

    fn ids() -> RequestIds {
        RequestIds { p_request_id: "req-P".into(), d_request_id: "req-D".into() }
    }

    #[test]
    fn p4_d2_writes_whole_blocks_at_head_slots() {
        let pair = pair(4, 2, 4);
        let map = pair.validate_push().expect("valid");
        // 1 head x 16 tokens x K|V x 64 x 2 bytes = 4096 B per prefill block.
        let planner = PushPlanner::new(&pair, &map, 3).expect("planner");
        let w = &planner.writes[0];
        assert_eq!(
            (w.d_rank, w.local_offset_in_block, w.remote_offset_in_block, w.length),
            (1, 0, 4096, 4096)
        );
        let req = RequestBlocks { local: vec![6], remote: vec![2, 5] };
        let plan = planner.plan(&req, &ids()).expect("plan");
        // Prefix hit: only prefill's last block (5) is written, into decode block 6.
        let p0 = plan.writes[0].pairs[0];
        assert_eq!((p0.local, p0.remote, p0.len), (5 * 4096, 6 * 8192 + 4096, 4096));
        assert_eq!(plan.writes[0].notif_msg, "req-D:4");
    }

    #[test]
    fn layer_cut_holds_the_plans_pairs_layer_by_layer() {
        for (layout, p_tp) in [(Layout::Lbhnc, 8), (Layout::Bhlnc, 1)] {
            let mut pair = pair(p_tp, 2.min(p_tp), 8);
            pair.model.num_layers = 3;
            (pair.p.layout, pair.d.layout) = (layout, layout);
            let map = pair.validate_push().expect("valid");
            let planner = PushPlanner::new(&pair, &map, p_tp - 1).expect("planner");
            let req = RequestBlocks { local: vec![1, 2, 3], remote: vec![4, 0, 7] };
            let bp = planner.pair_blocks(&req).expect("pairs");
            let plan = planner.plan(&req, &ids()).expect("plan");
            let cut = planner.layer_pairs(&bp, false, 3);
            assert_eq!(cut.len(), plan.writes.len());
            for (w, layers) in plan.writes.iter().zip(&cut) {
                let flat: Vec<Pair> = layers.iter().flatten().copied().collect();
                assert_eq!(flat, w.pairs, "{layout}: the layers hold the plan's pairs in its order");
                if layout == Layout::Lbhnc {
                    assert!(layers.iter().all(|l| l.len() == 3), "one pair per block in every layer");
                } else {
                    // Heads outside layers: nothing can go before the whole prefill is done.
                    assert!(layers[..2].iter().all(Vec::is_empty));
                }
            }
            let coalesced: Vec<u64> =
                planner.layer_pairs(&bp, true, 3).iter().flatten().flatten().map(|p| p.len).collect();
            assert_eq!(coalesced.iter().sum::<u64>(), plan.bytes(), "{layout}: coalescing keeps the bytes");
        }
    }

    #[test]
    fn more_decode_blocks_than_prefill_blocks_is_refused() {
        let pair = pair(1, 1, 4);
        let map = pair.validate_push().expect("valid");
        let planner = PushPlanner::new(&pair, &map, 0).expect("planner");
        let req = RequestBlocks { local: vec![0, 1], remote: vec![3] };
        assert_eq!(planner.plan(&req, &ids()).expect_err("refused").knob, Knob::LocalBlocks);
        let full_hit = RequestBlocks { local: vec![], remote: vec![3] };
        assert!(planner.plan(&full_hit, &ids()).expect("plan").writes.is_empty());
    }
}
