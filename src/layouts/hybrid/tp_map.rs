//! Which prefill ranks a decode rank reads, group by group (vLLM 0.33's `tp_mapping.py`):
//! attention from one prefill rank when D >= P, else the ranks of its slice deduplicated by
//! KV head; state from every prefill rank of the slice. One READ per source rank, in rank
//! order, each notifying `"<req>:<max(1, D/P)>"`.

use serde::Serialize;

/// How one decode rank maps onto prefill ranks (vLLM `TPMapping`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TpMapping {
    /// Prefill ranks read, per group, in slot order.
    pub source_ranks_per_group: Vec<Vec<u32>>,
    /// Every prefill rank read (one READ each), ascending.
    pub all_source_ranks: Vec<u32>,
    /// `(prefill rank, attention head slot)`; in JSON an object keyed by rank, as vLLM's dict.
    #[serde(serialize_with = "slots_by_rank")]
    pub rank_to_attention_slot: Vec<(u32, u32)>,
    /// Which head slice of a prefill block this rank reads when D > P.
    pub rank_offset_factor: u32,
    /// Notifications each prefill rank waits for.
    pub local_consumers: u32,
}

fn slots_by_rank<S: serde::Serializer>(slots: &[(u32, u32)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(slots.iter().map(|(rank, slot)| (rank.to_string(), slot)))
}

/// vLLM's signed TP ratio from the decode side: `D/P` when D >= P, else `-(P/D)`.
pub fn tp_ratio(p_tp: u32, d_tp: u32) -> i64 {
    if d_tp >= p_tp { i64::from(d_tp / p_tp) } else { -i64::from(p_tp / d_tp) }
}

/// The prefill ranks decode rank `d_rank` handshakes with.
pub fn handshake_ranks(p_tp: u32, d_tp: u32, d_rank: u32) -> Vec<u32> {
    if d_tp >= p_tp {
        vec![d_rank / (d_tp / p_tp)]
    } else {
        let k = p_tp / d_tp;
        (d_rank * k..(d_rank + 1) * k).collect()
    }
}

/// vLLM's `compute_tp_mapping` for a hybrid model (no MLA, no DCP).
pub fn tp_mapping(p_tp: u32, d_tp: u32, d_rank: u32, total_heads: u32, group_is_state: &[bool]) -> TpMapping {
    let head = |r: u32| u64::from(r) * u64::from(total_heads) / u64::from(p_tp);
    let attn: Vec<u32> = if d_tp >= p_tp {
        vec![d_rank * p_tp / d_tp]
    } else {
        let k = p_tp / d_tp;
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for r in d_rank * k..(d_rank + 1) * k {
            if !seen.contains(&head(r)) {
                seen.push(head(r));
                out.push(r);
            }
        }
        out
    };
    let has_state = group_is_state.iter().any(|&s| s);
    let state: Vec<u32> = match (has_state, d_tp < p_tp) {
        (false, _) => Vec::new(),
        (true, true) => {
            let k = p_tp / d_tp;
            (d_rank * k..(d_rank + 1) * k).collect()
        }
        (true, false) => attn.clone(),
    };
    let mut all: Vec<u32> = attn.iter().chain(&state).copied().collect();
    all.sort_unstable();
    all.dedup();
    let slot_of_head = |h: u64| attn.iter().position(|&r| head(r) == h).map_or(0, |i| i as u32);
    let rank_offset_factor = if d_tp <= p_tp {
        0
    } else if d_tp > total_heads {
        let remote = d_rank * p_tp / d_tp;
        let local_head = u64::from(d_rank) * u64::from(total_heads) / u64::from(d_tp);
        u32::try_from(local_head - head(remote)).unwrap_or(0)
    } else {
        d_rank % (d_tp / p_tp)
    };
    TpMapping {
        source_ranks_per_group: group_is_state
            .iter()
            .map(|&s| if s { state.clone() } else { attn.clone() })
            .collect(),
        rank_to_attention_slot: all.iter().map(|&r| (r, slot_of_head(head(r)))).collect(),
        all_source_ranks: all,
        rank_offset_factor,
        local_consumers: if d_tp >= p_tp { d_tp / p_tp } else { 1 },
    }
}
