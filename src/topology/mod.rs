//! Heterogeneous tensor-parallel rank maps, as vLLM's NixlConnector computes them.
//!
//! Given the prefill (P) and decode (D) TP sizes and the model's KV heads, this module says,
//! for every D rank, which P ranks it handshakes with, which it reads, which heads each read
//! covers (as head slices of the P block and the D block), the count carried by its
//! notification, and which P ranks get notification-only messages. Bytes come later: the
//! `layouts` module turns head slices into byte slices of each region's blocks.
//!
//! Pure arithmetic: no I/O. Rules follow vLLM 0.33 (`TransferTopology`, `compute_tp_mapping`)
//! by default and vLLM 0.19.1 (`TpKVTopology`) on request; where the two differ the
//! difference is spelled out next to the rule. Rejections are `KnobError`s that name the
//! setting to change (a [`Knob`]) and say why.
//!
//! This file holds pull mode (decode READs); `push` holds push mode (prefill WRITEs into
//! decode's blocks, vLLM's `NixlPushConnector`), which shares the TP checks below.

#![forbid(unsafe_code)]

pub mod ports;
pub mod push_map;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::KnobError;
use crate::vocab::knob::Knob;

/// Upper bound on TP sizes kvx accepts; larger values are typos, not deployments.
pub const MAX_TP: u32 = 1024;
/// Upper bound on KV heads kvx accepts.
pub const MAX_KV_HEADS: u32 = 65_536;

/// Which vLLM release's rules to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum VllmVersion {
    /// vLLM 0.33 (current): `TransferTopology`, 5-D layouts, K|V packed per cell.
    #[default]
    #[serde(rename = "0.33")]
    V0_33,
    /// vLLM 0.19.1: `TpKVTopology`, K and V as separate regions, HND/NHD naming.
    #[serde(rename = "0.19")]
    V0_19,
}

impl VllmVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            VllmVersion::V0_33 => "0.33",
            VllmVersion::V0_19 => "0.19",
        }
    }

    /// The full release string vLLM puts in its compatibility hash.
    pub fn release(self) -> &'static str {
        match self {
            VllmVersion::V0_33 => "0.33.0",
            VllmVersion::V0_19 => "0.19.1",
        }
    }
}

impl fmt::Display for VllmVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for VllmVersion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().trim_start_matches('v') {
            "0.33" | "0.33.0" | "latest" => Ok(VllmVersion::V0_33),
            "0.19" | "0.19.1" => Ok(VllmVersion::V0_19),
            other => Err(format!("unsupported vLLM version '{other}' (kvx follows 0.33 or 0.19)")),
        }
    }
}

/// Which way KV blocks move between the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// Decode READs prefill's blocks (vLLM `NixlConnector` / `NixlPullConnector`).
    #[default]
    Pull,
    /// Decode registers its blocks with prefill, which WRITEs into them
    /// (vLLM `NixlPushConnector`, 0.33 rules only).
    Push,
}

impl TransferMode {
    /// The name vLLM puts in `kv_transfer_params.transfer_mode` and its compatibility hash.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }
}

impl fmt::Display for TransferMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The inputs of a rank map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TpSpec {
    pub p_tp: u32,
    pub d_tp: u32,
    /// The model's total KV heads as its config reports them (for MLA, DeepSeek says 128).
    pub num_kv_heads: u32,
    pub use_mla: bool,
    pub version: VllmVersion,
}

impl TpSpec {
    /// KV heads as the rank map sees them: vLLM 0.33 forces MLA to one head.
    pub fn effective_heads(&self) -> u32 {
        if self.use_mla { 1 } else { self.num_kv_heads }
    }

    /// vLLM's `tp_ratio` from the decode side: `D/P` when D >= P, else `-(P/D)`.
    pub fn tp_ratio(&self) -> i64 {
        if self.d_tp >= self.p_tp {
            i64::from(self.d_tp / self.p_tp)
        } else {
            -i64::from(self.p_tp / self.d_tp)
        }
    }

    /// Whether the prefill side replicates KV heads across ranks, by the version's rule.
    /// 0.33: `P > H`. 0.19.1: `P >= H`, with MLA using the config's head count.
    pub fn prefill_replicated(&self) -> bool {
        match self.version {
            VllmVersion::V0_33 => self.p_tp > self.effective_heads(),
            VllmVersion::V0_19 => self.p_tp >= self.num_kv_heads,
        }
    }
}

/// KV heads held by each rank of an engine of `tp` ranks (vLLM `get_num_kv_heads`).
pub fn heads_per_rank(total_heads: u32, tp: u32) -> u32 {
    (total_heads / tp).max(1)
}

/// The global KV heads rank `rank` of a `tp`-rank engine holds. With more ranks than
/// heads, rank `r` holds a replica of head `floor(r * H / tp)`.
pub fn rank_heads(total_heads: u32, tp: u32, rank: u32) -> Range<u32> {
    if tp <= total_heads {
        let h = total_heads / tp;
        rank * h..(rank + 1) * h
    } else {
        let head = (u64::from(rank) * u64::from(total_heads) / u64::from(tp)) as u32;
        head..head + 1
    }
}

/// One READ a decode rank posts: which P rank, and which heads of its block land where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeadRead {
    pub p_rank: u32,
    /// Position of this source among the D rank's read ranks (vLLM `rank_to_attention_slot`).
    pub slot: u32,
    /// Head slice `[start, end)` inside the P rank's block.
    pub p_heads: Range<u32>,
    /// Head slice `[start, end)` inside the D rank's block where the bytes land.
    pub d_heads: Range<u32>,
    /// The model's global KV heads this read carries.
    pub global_heads: Range<u32>,
}

/// The rank map of one decode rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DRankMap {
    pub d_rank: u32,
    /// Global KV heads this D rank owns.
    pub d_heads: Range<u32>,
    /// P ranks this D rank fetches metadata from.
    pub handshake_ranks: Vec<u32>,
    /// P ranks this D rank reads from, in posting order.
    pub read_ranks: Vec<u32>,
    /// vLLM's `rank_offset_factor` (0.33): the head-group index inside the P block.
    pub rank_offset_factor: u32,
    /// The `n` in the notification `"<request id>:<n>"` this rank sends.
    pub notif_count: u32,
    /// How many notifications each P rank waits for before freeing the request's blocks.
    pub p_waits_for: u32,
    pub reads: Vec<HeadRead>,
    /// P ranks that get a notification-only message (MLA with P > D).
    pub extra_notifs: Vec<u32>,
    /// vLLM 0.19.1 builds those notification-only messages from the *decode* request id,
    /// which P does not recognise, so it only frees on timeout. kvx reproduces it to show it.
    pub extra_notif_uses_d_request_id: bool,
}

/// The rank map of a P/D pair of engines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankMap {
    pub spec: TpSpec,
    pub tp_ratio: i64,
    pub p_heads_per_rank: u32,
    pub d_heads_per_rank: u32,
    pub d_ranks: Vec<DRankMap>,
}

impl RankMap {
    /// P ranks each D rank reads from (fan-in).
    pub fn fan_in(&self) -> usize {
        self.d_ranks.iter().map(|d| d.read_ranks.len()).max().unwrap_or(0)
    }

    /// D ranks reading from each P rank (fan-out), indexed by P rank.
    pub fn fan_out(&self) -> Vec<usize> {
        let mut out = vec![0; self.spec.p_tp as usize];
        for d in &self.d_ranks {
            for &p in &d.read_ranks {
                if let Some(slot) = out.get_mut(p as usize) {
                    *slot += 1;
                }
            }
        }
        out
    }
}

fn check_range(knob: Knob, what: &str, value: u32, max: u32) -> Result<(), KnobError> {
    if value == 0 {
        return Err(KnobError::new(knob, format!("{what} must be at least 1, got 0")));
    }
    if value > max {
        return Err(KnobError::new(
            knob,
            format!("{what} of {value} is beyond anything kvx models (at most {max})"),
        ));
    }
    Ok(())
}

/// Checks that an engine of `tp` ranks can shard `heads` KV heads the way vLLM requires:
/// `H % tp == 0` when `tp <= H`, else `tp % H == 0` (each head replicated equally).
fn check_head_sharding(knob: Knob, tp: u32, heads: u32) -> Result<(), KnobError> {
    if tp <= heads && !heads.is_multiple_of(tp) {
        return Err(KnobError::new(
            knob,
            format!("TP {tp} does not divide the model's {heads} KV heads; pick a TP that divides {heads}"),
        ));
    }
    if tp > heads && !tp.is_multiple_of(heads) {
        return Err(KnobError::new(
            knob,
            format!(
                "TP {tp} is larger than the model's {heads} KV heads but not a multiple of it, so heads cannot be replicated evenly"
            ),
        ));
    }
    Ok(())
}

/// The checks pull and push share: sizes in range, one TP dividing the other (vLLM's
/// `TransferTopology.tp_ratio` asserts), and heads sharded evenly on both sides.
pub(crate) fn check_tp_pair(spec: &TpSpec) -> Result<(), KnobError> {
    check_range(Knob::PTp, "prefill TP size", spec.p_tp, MAX_TP)?;
    check_range(Knob::DTp, "decode TP size", spec.d_tp, MAX_TP)?;
    check_range(Knob::NumKvHeads, "number of KV heads", spec.num_kv_heads, MAX_KV_HEADS)?;
    let (p, d) = (spec.p_tp, spec.d_tp);
    if d >= p && d % p != 0 {
        return Err(KnobError::new(
            Knob::DTp,
            format!(
                "decode TP {d} is not a multiple of prefill TP {p}; vLLM requires one TP size to divide the other"
            ),
        ));
    }
    if p > d && p % d != 0 {
        return Err(KnobError::new(
            Knob::PTp,
            format!(
                "prefill TP {p} is not a multiple of decode TP {d}; vLLM requires one TP size to divide the other"
            ),
        ));
    }
    let h = spec.effective_heads();
    if !spec.use_mla {
        check_head_sharding(Knob::PTp, p, h)?;
        check_head_sharding(Knob::DTp, d, h)?;
    }
    Ok(())
}

/// Validates the TP pair and computes the rank map.
pub fn rank_map(spec: &TpSpec) -> Result<RankMap, KnobError> {
    check_tp_pair(spec)?;
    let (p, d) = (spec.p_tp, spec.d_tp);
    let h = spec.effective_heads();
    if p > d && spec.prefill_replicated() && !(spec.use_mla && spec.version == VllmVersion::V0_33) {
        let rule = match spec.version {
            VllmVersion::V0_33 => "more prefill ranks than KV heads",
            VllmVersion::V0_19 => "at least as many prefill ranks as KV heads (vLLM 0.19 rule)",
        };
        return Err(KnobError::new(
            Knob::PTp,
            format!(
                "prefill TP {p} > decode TP {d} with {rule} ({} KV heads): prefill ranks hold replicated heads \
                 and vLLM cannot map them onto fewer decode ranks (it fails a bare assertion); lower {} to at most {} or raise {} to {p}",
                spec.num_kv_heads,
                Knob::PTp,
                match spec.version {
                    VllmVersion::V0_33 => h,
                    VllmVersion::V0_19 => spec.num_kv_heads.saturating_sub(1).max(1),
                },
                Knob::DTp,
            ),
        ));
    }
    if spec.version == VllmVersion::V0_19 && !spec.use_mla && d > p && p < h && h < d {
        return Err(KnobError::new(
            Knob::DTp,
            format!(
                "vLLM 0.19 cannot read from prefill TP {p} into decode TP {d} when {p} < {h} KV heads < {d} \
                 (its block-length check fails: 'Remote P worker KV layer cache must be of shape ...'); \
                 use {} 0.33, or keep {} at most {h}",
                Knob::Vllm,
                Knob::DTp,
            ),
        ));
    }
    let d_ranks = (0..d).map(|rank| d_rank_map(spec, rank)).collect();
    Ok(RankMap {
        spec: *spec,
        tp_ratio: spec.tp_ratio(),
        p_heads_per_rank: heads_per_rank(h, p),
        d_heads_per_rank: heads_per_rank(h, d),
        d_ranks,
    })
}

/// The map of one D rank; `spec` has been validated.
fn d_rank_map(spec: &TpSpec, d_rank: u32) -> DRankMap {
    let (p, d) = (spec.p_tp, spec.d_tp);
    let h = spec.effective_heads();
    let h_p = heads_per_rank(h, p);
    let h_d = heads_per_rank(h, d);
    // The first (or only) source rank: floor(d_rank * P / D).
    let src = (u64::from(d_rank) * u64::from(p) / u64::from(d)) as u32;
    let d_heads = rank_heads(h, d, d_rank);
    let (notif_count, p_waits_for) = match spec.version {
        VllmVersion::V0_33 => {
            let n = if d >= p { d / p } else { 1 };
            (n, n)
        }
        // 0.19 sends the decode world size; P converts it to D/P (or 1).
        VllmVersion::V0_19 => (d, if d > p { d / p } else { 1 }),
    };
    let mut map = DRankMap {
        d_rank,
        d_heads: d_heads.clone(),
        handshake_ranks: vec![],
        read_ranks: vec![],
        rank_offset_factor: 0,
        notif_count,
        p_waits_for,
        reads: vec![],
        extra_notifs: vec![],
        extra_notif_uses_d_request_id: false,
    };
    if spec.use_mla {
        // One latent block, read whole from one source; the other prefill ranks that hold
        // the same blocks only need to hear that they can free them.
        map.handshake_ranks = if p > d { (src..src + p / d).collect() } else { vec![src] };
        map.read_ranks = vec![src];
        map.extra_notifs = map.handshake_ranks.iter().copied().filter(|&r| r != src).collect();
        map.extra_notif_uses_d_request_id = spec.version == VllmVersion::V0_19;
        map.reads.push(HeadRead { p_rank: src, slot: 0, p_heads: 0..1, d_heads: 0..1, global_heads: 0..1 });
        return map;
    }
    if d >= p {
        let f = if d == p || spec.prefill_replicated() {
            0
        } else if d > h {
            // GQA-replicated decode ranks: the head offset of d's head inside src's heads.
            let d_head = (u64::from(d_rank) * u64::from(h) / u64::from(d)) as u32;
            d_head - rank_heads(h, p, src).start
        } else {
            d_rank % (d / p)
        };
        map.rank_offset_factor = f;
        map.handshake_ranks = vec![src];
        map.read_ranks = vec![src];
        let p_heads = f * h_d..(f + 1) * h_d;
        let global_start = rank_heads(h, p, src).start;
        map.reads.push(HeadRead {
            p_rank: src,
            slot: 0,
            global_heads: global_start + p_heads.start..global_start + p_heads.end,
            p_heads,
            d_heads: 0..h_d,
        });
    } else {
        // P > D: every source block is read whole into its slot of the D block.
        let k = p / d;
        map.handshake_ranks = (src..src + k).collect();
        map.read_ranks = map.handshake_ranks.clone();
        for (slot, &p_rank) in map.read_ranks.iter().enumerate() {
            let slot = slot as u32;
            map.reads.push(HeadRead {
                p_rank,
                slot,
                p_heads: 0..h_p,
                d_heads: slot * h_p..(slot + 1) * h_p,
                global_heads: rank_heads(h, p, p_rank),
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(p: u32, d: u32, h: u32, mla: bool) -> TpSpec {
        TpSpec { p_tp: p, d_tp: d, num_kv_heads: h, use_mla: mla, version: VllmVersion::V0_33 }
    }

    #[test]
    fn p8_d2_reads_four_whole_blocks() {
        let m = rank_map(&spec(8, 2, 8, false)).expect("accepted");
        let d0 = &m.d_ranks[0];
        assert_eq!(d0.handshake_ranks, vec![0, 1, 2, 3]);
        assert_eq!(d0.reads.iter().map(|r| r.d_heads.start).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(d0.notif_count, 1);
        assert_eq!(m.d_ranks[1].read_ranks, vec![4, 5, 6, 7]);
    }

    #[test]
    fn p2_d8_h4_gqa_offsets() {
        let m = rank_map(&spec(2, 8, 4, false)).expect("accepted");
        let f: Vec<u32> = m.d_ranks.iter().map(|d| d.rank_offset_factor).collect();
        assert_eq!(f, vec![0, 0, 1, 1, 0, 0, 1, 1]);
        assert_eq!(m.d_ranks[2].reads[0].global_heads, 1..2);
        assert_eq!(m.d_ranks[0].notif_count, 4);
    }

    #[test]
    fn p_gt_d_and_p_gt_h_rejected_names_flag() {
        let e = rank_map(&spec(8, 2, 4, false)).expect_err("rejected");
        assert_eq!(e.knob, Knob::PTp);
        assert!(rank_map(&spec(8, 2, 4, true)).is_ok(), "MLA is exempt in 0.33");
    }

    #[test]
    fn non_dividing_tp_rejected() {
        assert_eq!(rank_map(&spec(3, 2, 6, false)).expect_err("rejected").knob, Knob::PTp);
        assert_eq!(rank_map(&spec(2, 3, 6, false)).expect_err("rejected").knob, Knob::DTp);
        assert_eq!(rank_map(&spec(0, 2, 8, false)).expect_err("rejected").knob, Knob::PTp);
        assert_eq!(rank_map(&spec(4, 4, 6, false)).expect_err("rejected").knob, Knob::PTp);
    }
}
