//! Push-mode rank maps: which prefill rank WRITEs which heads into which decode rank's
//! blocks, as vLLM's `NixlPushConnector` (0.33) decides, and how many notifications each
//! decode rank waits for.
//!
//! In push mode the prefill rank is the *local* side of vLLM's `TransferTopology` and the
//! decode engine the *remote* one, so vLLM's pull arithmetic (`compute_tp_mapping`,
//! `compute_head_offset`, `handshake_target_ranks`) runs with P and D swapped. The rules
//! and where they come from are in `docs/push-semantics.md`; in short:
//!
//! - P tp >= D tp: prefill rank `p` writes its whole block into decode rank
//!   `p * D / P`, at head offset `compute_head_offset(p, P, D, H)` (the mirror of pull's
//!   P > D reads). With more prefill ranks than KV heads, several prefill ranks hold the
//!   same head and all of them write it: vLLM accepts this in push (pull refuses it).
//! - P tp < D tp: prefill rank `p` splits its block into `D / P` head slices and writes
//!   slice `i` into the whole block of decode rank `p * D / P + i` (the mirror of pull's
//!   D > P reads). With more decode ranks than KV heads vLLM fails a bare assertion on the
//!   prefill side (`_validate_remote_agent_handshake`), so kvx refuses it.
//! - MLA: every prefill rank writes the whole latent block: to decode rank `p * D / P`
//!   when P >= D (so `P / D` ranks write the same bytes), or to every decode rank it
//!   handshakes with when P < D (`replicate_attn` in `push_worker._xfer_blocks_for_req`).
//! - Every WRITE carries `"<decode request id>:<P tp>"`; a decode rank is done after
//!   `pp_size * max(1, P / D)` of them (`push_worker._get_new_notifs`); kvx models PP 1.
//!
//! Pure arithmetic: no I/O. Push exists only under vLLM 0.33's rules.

use std::ops::Range;

use serde::Serialize;

use super::{TpSpec, VllmVersion, check_tp_pair, heads_per_rank, rank_heads};
use crate::error::KnobError;
use crate::vocab::knob::Knob;

/// One WRITE a prefill rank posts: which decode rank, and which heads of its own block
/// land where in the decode block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeadWrite {
    pub d_rank: u32,
    /// Position of this target among the prefill rank's targets: the split handle (chunk of
    /// the prefill block) vLLM writes from when P < D (`rank_to_attention_slot`).
    pub slot: u32,
    /// Head slice `[start, end)` inside the prefill rank's block (the source).
    pub p_heads: Range<u32>,
    /// Head slice `[start, end)` inside the decode rank's block (the destination).
    pub d_heads: Range<u32>,
    /// The model's global KV heads this write carries.
    pub global_heads: Range<u32>,
    /// Another prefill rank writes the same bytes to the same place (replicated heads or
    /// MLA with P > D); vLLM posts both WRITEs and the decode rank counts both.
    pub duplicate_of: Option<u32>,
}

/// The push map of one prefill rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PRankPushMap {
    pub p_rank: u32,
    /// Global KV heads this prefill rank holds.
    pub p_heads: Range<u32>,
    /// Decode ranks this prefill rank fetches metadata from before writing (vLLM's
    /// `handshake_target_ranks` with the decode engine as the remote).
    pub handshake_ranks: Vec<u32>,
    /// Decode ranks this prefill rank writes into, in posting order.
    pub write_ranks: Vec<u32>,
    /// vLLM's `rank_offset_factor` with P as the local side: the slot of the decode block
    /// (in prefill-block lengths) this rank's whole block lands in, when P >= D.
    pub rank_offset_factor: u32,
    /// The `n` in `"<decode request id>:<n>"` every WRITE carries: the prefill TP size.
    pub notif_count: u32,
    pub writes: Vec<HeadWrite>,
}

/// What one decode rank does and waits for in push mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DRankPushView {
    pub d_rank: u32,
    /// Global KV heads this decode rank owns.
    pub d_heads: Range<u32>,
    /// Prefill ranks this decode rank sends its `PUSH_REG` registration to (its
    /// notification-only handshake targets, as in pull).
    pub registers_with: Vec<u32>,
    /// Prefill ranks that write into this decode rank.
    pub writers: Vec<u32>,
    /// Notifications the decode rank counts before the request is complete:
    /// `max(1, P / D)` (times the prefill PP size, 1 here).
    pub expected_notifs: u32,
}

/// The push-mode rank map of a P/D pair of engines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PushRankMap {
    pub spec: TpSpec,
    /// vLLM's `tp_ratio` from the prefill side: `P/D` when P >= D, else `-(D/P)`.
    pub tp_ratio: i64,
    pub p_heads_per_rank: u32,
    pub d_heads_per_rank: u32,
    pub p_ranks: Vec<PRankPushMap>,
    pub d_ranks: Vec<DRankPushView>,
}

impl PushRankMap {
    /// Prefill ranks writing into each decode rank (fan-in), at most.
    pub fn fan_in(&self) -> usize {
        self.d_ranks.iter().map(|d| d.writers.len()).max().unwrap_or(0)
    }

    /// WRITEs that repeat bytes another prefill rank already writes.
    pub fn duplicate_writes(&self) -> usize {
        self.p_ranks.iter().flat_map(|p| &p.writes).filter(|w| w.duplicate_of.is_some()).count()
    }
}

/// vLLM's `tp_ratio` with the prefill engine as the local side.
pub fn push_tp_ratio(spec: &TpSpec) -> i64 {
    if spec.p_tp >= spec.d_tp { i64::from(spec.p_tp / spec.d_tp) } else { -i64::from(spec.d_tp / spec.p_tp) }
}

/// vLLM's `compute_head_offset(tp_rank, tp_size, remote_tp_size, H)` with the prefill rank
/// as the local one: where (in prefill-block lengths) prefill rank `p`'s block lands inside
/// the decode block when P >= D.
fn head_offset(p_rank: u32, p: u32, d: u32, h: u32) -> u32 {
    if p <= d {
        return 0;
    }
    if p > h {
        let d_rank = u64::from(p_rank) * u64::from(d) / u64::from(p);
        let local_head = u64::from(p_rank) * u64::from(h) / u64::from(p);
        let remote_head = d_rank * u64::from(h) / u64::from(d);
        return (local_head - remote_head) as u32;
    }
    p_rank % (p / d)
}

/// Validates the TP pair for push mode and computes its rank map.
pub fn push_rank_map(spec: &TpSpec) -> Result<PushRankMap, KnobError> {
    if spec.version != VllmVersion::V0_33 {
        return Err(KnobError::new(
            Knob::Vllm,
            format!(
                "vLLM {} has no push connector (NixlPushConnector came later); use {vllm} 0.33 with \
                 {mode} push, or {mode} pull",
                spec.version,
                vllm = Knob::Vllm,
                mode = Knob::Mode,
            ),
        ));
    }
    check_tp_pair(spec)?;
    let (p, d) = (spec.p_tp, spec.d_tp);
    let h = spec.effective_heads();
    if !spec.use_mla && d > p && d > h {
        return Err(KnobError::new(
            Knob::DTp,
            format!(
                "decode TP {d} > prefill TP {p} with more decode ranks than KV heads ({h}): decode ranks hold \
                 replicated heads, and vLLM's push connector refuses this (a bare assertion in the prefill \
                 side's _validate_remote_agent_handshake, so its handshake with decode fails and the request \
                 waits out its lease); lower {} to at most {h}, or use {} pull, which accepts it",
                Knob::DTp,
                Knob::Mode,
            ),
        ));
    }
    let (h_p, h_d) = (heads_per_rank(h, p), heads_per_rank(h, d));
    let mut p_ranks: Vec<PRankPushMap> = (0..p).map(|r| p_rank_map(spec, r, h_p, h_d)).collect();
    mark_duplicates(&mut p_ranks);
    let d_ranks = (0..d)
        .map(|dr| {
            let src = (u64::from(dr) * u64::from(p) / u64::from(d)) as u32;
            let registers_with = if p > d { (src..src + p / d).collect() } else { vec![src] };
            let writers =
                p_ranks.iter().filter(|pm| pm.write_ranks.contains(&dr)).map(|pm| pm.p_rank).collect();
            DRankPushView {
                d_rank: dr,
                d_heads: rank_heads(h, d, dr),
                registers_with,
                writers,
                expected_notifs: (p / d).max(1),
            }
        })
        .collect();
    Ok(PushRankMap {
        spec: *spec,
        tp_ratio: push_tp_ratio(spec),
        p_heads_per_rank: h_p,
        d_heads_per_rank: h_d,
        p_ranks,
        d_ranks,
    })
}

/// The map of one prefill rank; `spec` has been validated.
fn p_rank_map(spec: &TpSpec, p_rank: u32, h_p: u32, h_d: u32) -> PRankPushMap {
    let (p, d) = (spec.p_tp, spec.d_tp);
    let h = spec.effective_heads();
    let p_heads = rank_heads(h, p, p_rank);
    // Decode ranks this prefill rank handshakes with: one when P >= D, else D/P of them.
    let first = (u64::from(p_rank) * u64::from(d) / u64::from(p)) as u32;
    let handshake_ranks: Vec<u32> = if d > p { (first..first + d / p).collect() } else { vec![first] };
    let mut map = PRankPushMap {
        p_rank,
        p_heads: p_heads.clone(),
        handshake_ranks: handshake_ranks.clone(),
        write_ranks: vec![],
        rank_offset_factor: 0,
        notif_count: p,
        writes: vec![],
    };
    if spec.use_mla {
        // The latent is the same on every rank: written whole, at offset 0, to the one decode
        // rank (P >= D) or to every decode rank handshaked (P < D), so none decodes stale KV.
        map.write_ranks = handshake_ranks;
        map.writes = map
            .write_ranks
            .iter()
            .map(|&dr| HeadWrite {
                d_rank: dr,
                slot: 0,
                p_heads: 0..1,
                d_heads: 0..1,
                global_heads: 0..1,
                duplicate_of: None,
            })
            .collect();
        return map;
    }
    if p >= d {
        let f = head_offset(p_rank, p, d, h);
        map.rank_offset_factor = f;
        map.write_ranks = vec![first];
        map.writes.push(HeadWrite {
            d_rank: first,
            slot: 0,
            p_heads: 0..h_p,
            d_heads: f * h_p..(f + 1) * h_p,
            global_heads: p_heads,
            duplicate_of: None,
        });
    } else {
        // D > P (and D <= H, checked): the block splits into D/P head slices, slice i for
        // decode rank first + i, landing at the start of its block.
        map.write_ranks = handshake_ranks;
        map.writes = map
            .write_ranks
            .iter()
            .enumerate()
            .map(|(i, &dr)| {
                let i = i as u32;
                let slice = i * h_d..(i + 1) * h_d;
                HeadWrite {
                    d_rank: dr,
                    slot: i,
                    global_heads: p_heads.start + slice.start..p_heads.start + slice.end,
                    p_heads: slice,
                    d_heads: 0..h_d,
                    duplicate_of: None,
                }
            })
            .collect();
    }
    map
}

/// Marks every write whose (decode rank, destination heads) an earlier prefill rank
/// already covers.
fn mark_duplicates(p_ranks: &mut [PRankPushMap]) {
    let mut first: Vec<((u32, u32, u32), u32)> = Vec::new();
    for pm in p_ranks.iter_mut() {
        for w in &mut pm.writes {
            let key = (w.d_rank, w.d_heads.start, w.d_heads.end);
            match first.iter().find(|(k, _)| *k == key) {
                Some(&(_, owner)) => w.duplicate_of = Some(owner),
                None => first.push((key, pm.p_rank)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(p: u32, d: u32, h: u32, mla: bool) -> TpSpec {
        TpSpec { p_tp: p, d_tp: d, num_kv_heads: h, use_mla: mla, version: VllmVersion::V0_33 }
    }

    /// vLLM `compute_tp_mapping` with P local: P 8 -> D 2 (H 8) gives `all_source_ranks`
    /// `[p * 2 // 8]` and `compute_head_offset(p, 8, 2, 8) = p % 4`; the decode rank waits for
    /// `max(1, 8 // 2) = 4` notifications (`push_worker._get_new_notifs`).
    #[test]
    fn p8_d2_each_prefill_rank_writes_one_slot() {
        let m = push_rank_map(&spec(8, 2, 8, false)).expect("accepted");
        let targets: Vec<u32> = m.p_ranks.iter().map(|p| p.write_ranks[0]).collect();
        assert_eq!(targets, vec![0, 0, 0, 0, 1, 1, 1, 1]);
        let slots: Vec<u32> = m.p_ranks.iter().map(|p| p.writes[0].d_heads.start).collect();
        assert_eq!(slots, vec![0, 1, 2, 3, 0, 1, 2, 3]);
        assert_eq!(m.d_ranks[1].writers, vec![4, 5, 6, 7]);
        assert_eq!(m.d_ranks[0].expected_notifs, 4);
        assert_eq!(m.p_ranks[5].notif_count, 8);
        assert_eq!(m.duplicate_writes(), 0);
    }

    /// P 2 -> D 4 (H 8): `handshake_target_ranks` from P gives `[p*2, p*2+1]`; the split
    /// handles give chunk i (2 heads) to decode rank p*2+i at offset 0.
    #[test]
    fn p2_d4_splits_each_block_in_two() {
        let m = push_rank_map(&spec(2, 4, 8, false)).expect("accepted");
        let p1 = &m.p_ranks[1];
        assert_eq!(p1.write_ranks, vec![2, 3]);
        assert_eq!(p1.writes[1].p_heads, 2..4);
        assert_eq!(p1.writes[1].global_heads, 6..8);
        assert_eq!(p1.writes[1].d_heads, 0..2);
        assert!(m.d_ranks.iter().all(|d| d.expected_notifs == 1 && d.writers.len() == 1));
    }

    #[test]
    fn replicated_decode_refused_replicated_prefill_accepted() {
        let e = push_rank_map(&spec(2, 8, 4, false)).expect_err("D > P and D > H");
        assert_eq!(e.knob, Knob::DTp);
        // P 8 -> D 2 with 4 heads: prefill ranks 0 and 1 both hold head 0 and both write it.
        let m = push_rank_map(&spec(8, 2, 4, false)).expect("accepted in push");
        let f: Vec<u32> = m.p_ranks.iter().map(|p| p.rank_offset_factor).collect();
        assert_eq!(f, vec![0, 0, 1, 1, 0, 0, 1, 1]);
        assert_eq!(m.p_ranks[1].writes[0].duplicate_of, Some(0));
        assert_eq!(m.duplicate_writes(), 4);
        assert_eq!(m.d_ranks[0].expected_notifs, 4);
    }

    #[test]
    fn mla_replicates_to_every_decode_rank() {
        let m = push_rank_map(&spec(2, 4, 128, true)).expect("accepted");
        assert_eq!(m.p_ranks[0].write_ranks, vec![0, 1]);
        assert!(m.p_ranks[0].writes.iter().all(|w| w.d_heads == (0..1)));
        let m = push_rank_map(&spec(4, 2, 128, true)).expect("accepted");
        assert_eq!(m.d_ranks[0].writers, vec![0, 1]);
        assert_eq!(m.p_ranks[1].writes[0].duplicate_of, Some(0));
    }

    #[test]
    fn push_needs_vllm_033() {
        let mut s = spec(2, 2, 8, false);
        s.version = VllmVersion::V0_19;
        assert_eq!(push_rank_map(&s).expect_err("0.19").knob, Knob::Vllm);
    }
}
