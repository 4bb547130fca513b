//! Push mode for hybrid models, as vLLM 0.33's `NixlPushConnector` builds its WRITEs
//! (`docs/hybrid-push-vllm033.md`): prefill builds every WRITE from decode's per-group lists
//! (its registration) and its own, with the same descriptor-id math, prefix trim and clipping
//! as pull, in its own frame. kvx derives each WRITE from the pull plan of the decode rank it
//! writes into: the pull READ (decode rank `d` from prefill rank `p`) with its roles swapped
//! is the push WRITE (`p` into `d`), which vLLM's code gives for equal TP and for
//! heterogeneous TP with unreplicated heads. Where push differs, kvx follows push:
//!
//! - prefill TP above the KV heads (heads replicated over prefill ranks): every prefill rank
//!   writes its copy of the head; pull reads it from one ([`HybridWrite::duplicate_pairs`]);
//! - decode TP above prefill TP and above the KV heads: vLLM's push writes attention only into
//!   the first decode rank of each head, so the others get none (**as read** from vLLM's
//!   code, `push_worker.py` 588-596); [`PushAttention::EveryRank`] writes each rank's;
//! - kernel block sizes must be equal on both sides (vLLM asserts each direction).
//!
//! Pure arithmetic over plain data, as the rest of the planning core.

use serde::Serialize;

use super::desc_lists::RowKind;
use super::error::{HybridError, RefusalKind};
use super::pair::HybridPairSpec;
pub use super::pair::PushAttention;
use super::planner::{HybridPlan, HybridPlanner};
use crate::layouts::read_plan::Pair;
use crate::vocab::knob::Knob;

/// One WRITE: what a prefill rank puts into one decode rank. `pairs[i].local` is the offset in
/// the prefill rank's registered memory, `remote` in the decode rank's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridWrite {
    pub d_rank: u32,
    pub pairs: Vec<Pair>,
    /// Of `pairs`, how many (at the end) write a head another prefill rank writes too (the
    /// same bytes to the same place).
    pub duplicate_pairs: usize,
    /// vLLM's rule left this decode rank's attention out of the WRITE.
    pub attention_skipped: bool,
    /// The KV cache groups the pairs write, ascending.
    pub groups: Vec<u32>,
}

impl HybridWrite {
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(|p| p.len).sum()
    }
}

/// The decode ranks prefill rank `p_rank` writes into (vLLM's `write_ranks`): the one decode
/// rank holding its slice when prefill TP is at least decode TP, else the `D/P` decode ranks
/// its slice covers.
pub fn write_ranks(p_tp: u32, d_tp: u32, p_rank: u32) -> Vec<u32> {
    if p_tp >= d_tp {
        vec![p_rank * d_tp / p_tp]
    } else {
        let k = d_tp / p_tp;
        (p_rank * k..(p_rank + 1) * k).collect()
    }
}

/// The prefill ranks that write into decode rank `d_rank` (those whose [`write_ranks`] hold it),
/// ascending.
pub fn writers(p_tp: u32, d_tp: u32, d_rank: u32) -> Vec<u32> {
    (0..p_tp).filter(|&p| write_ranks(p_tp, d_tp, p).contains(&d_rank)).collect()
}

/// Notifications a decode rank counts per request (`pp * max(1, P_TP / D_TP)`, one per WRITE
/// into it).
pub fn expected_notifs(p_tp: u32, d_tp: u32) -> u32 {
    (p_tp / d_tp.max(1)).max(1)
}

/// Whether vLLM's push leaves decode rank `d_rank`'s attention out (decode TP above prefill
/// TP and above the KV heads, and an earlier decode rank of the same prefill rank holds the
/// same head), under the pair's [`Knob::PushAttention`] rule.
pub fn attention_skipped(config: &HybridPairSpec, d_rank: u32) -> bool {
    let (p_tp, d_tp) = (config.p.tp, config.d.tp);
    let heads = config.model.attention.num_kv_heads;
    if config.push_attention == PushAttention::EveryRank || d_tp <= p_tp || d_tp <= heads {
        return false;
    }
    let head = |d: u32| u64::from(d) * u64::from(heads) / u64::from(d_tp);
    let k = d_tp / p_tp;
    let first = d_rank / k * k;
    (first..d_rank).any(|e| head(e) == head(d_rank))
}

/// Push's own refusals beyond pull's (vLLM 0.33's push connector): different kernel block
/// sizes on the two sides; decode TP above prefill TP and above the KV heads without state
/// (a bare assert on prefill, for every decode rank it handshakes with).
pub fn check_push(planner: &HybridPlanner) -> Result<(), HybridError> {
    let config = &planner.config;
    let heads = config.model.attention.num_kv_heads;
    if !planner.d.has_state() && config.d.tp > config.p.tp && config.d.tp > heads {
        return Err(HybridError::refused_by_assert(
            RefusalKind::ReplicatedKvPrefillAboveDecode,
            "assert not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))",
            "nixl/base_worker.py:2728 (_validate_remote_agent_handshake)",
            Knob::DTp,
            format!(
                "in push, prefill checks each decode rank it writes, so decode TP above prefill TP with \
                 replicated heads fails; with decode TP {} above the model's {heads} KV heads, push needs \
                 decode TP at most prefill TP {} (or {} pull)",
                config.d.tp,
                config.p.tp,
                Knob::Mode,
            ),
        ));
    }
    let (p, d) = (planner.p.kernel_block_tokens, planner.d.kernel_block_tokens);
    if p != d {
        return Err(HybridError::refused(
            RefusalKind::BlockSizeNotDivisible,
            format!(
                "assert P_bs % D_bs == 0 on prefill (add_remote_agent) and D_bs % P_bs == 0 on decode \
                 (get_transfer_results): kernel blocks of {p} and {d} tokens"
            ),
            "nixl/base_worker.py:2553, 3279",
            Knob::Mode,
            format!(
                "push needs equal kernel block sizes on both sides; use TP sizes with equal hybrid block \
                 sizes, or {} pull",
                Knob::Mode
            ),
        ));
    }
    Ok(())
}

/// The KV cache groups prefill rank `p_rank` writes into decode rank `d_rank` for any request
/// (the rank map alone, as [`writes`] builds the WRITEs), ascending; empty when it writes into
/// none of them.
pub fn write_groups(planner: &HybridPlanner, p_rank: u32, d_rank: u32) -> Vec<u32> {
    let config = &planner.config;
    let (p_tp, d_tp) = (config.p.tp, config.d.tp);
    let Some(setup) = planner.d_ranks.iter().find(|s| s.d_rank == d_rank) else { return Vec::new() };
    if !write_ranks(p_tp, d_tp, p_rank).contains(&d_rank) {
        return Vec::new();
    }
    let heads = u64::from(config.model.attention.num_kv_heads);
    let head = |p: u32| u64::from(p) * heads / u64::from(p_tp);
    let skip = attention_skipped(config, d_rank);
    let sources = &setup.mapping.source_ranks_per_group;
    let attention = |g: usize| planner.d.groups[g].kind.is_attention();
    let reads = |g: usize| sources.get(g).is_some_and(|s| s.contains(&p_rank));
    let groups = 0..planner.d.groups.len().min(sources.len());
    // Heads replicated over prefill ranks: a rank that reads no attention of its own writes
    // the copy another rank of its head is read for.
    let own_attention = groups.clone().any(|g| attention(g) && reads(g));
    let copies = |g: usize| {
        !own_attention && p_tp > d_tp && sources[g].iter().any(|&r| r != p_rank && head(r) == head(p_rank))
    };
    groups
        .filter(|&g| if attention(g) { !skip && (reads(g) || copies(g)) } else { reads(g) })
        .map(|g| planner.d.groups[g].index)
        .collect()
}

/// The WRITEs prefill rank `p_rank` posts for a request planned as `plan` (every decode
/// rank's pull plan, from both sides' lists), in decode-rank order.
pub fn writes(planner: &HybridPlanner, plan: &HybridPlan, p_rank: u32) -> Vec<HybridWrite> {
    let config = &planner.config;
    let (p_tp, d_tp) = (config.p.tp, config.d.tp);
    let heads = u64::from(config.model.attention.num_kv_heads);
    let head = |p: u32| u64::from(p) * heads / u64::from(p_tp);
    let mut out = Vec::new();
    for d_rank in write_ranks(p_tp, d_tp, p_rank) {
        let Some(rank) = plan.d_ranks.iter().find(|r| r.d_rank == d_rank) else { continue };
        let skip = attention_skipped(config, d_rank);
        let mut w = HybridWrite {
            d_rank,
            pairs: Vec::new(),
            duplicate_pairs: 0,
            attention_skipped: skip,
            groups: Vec::new(),
        };
        let transposed = |p: &Pair| Pair { local: p.remote, remote: p.local, len: p.len };
        let own = rank.reads.iter().find(|r| r.p_rank == p_rank);
        let mut own_attention = false;
        if let Some(read) = own {
            for run in read.runs() {
                let attention = run.label.kind == RowKind::AttnPage;
                own_attention |= attention;
                if attention && skip {
                    continue;
                }
                w.groups.push(run.group);
                w.pairs.extend(read.pairs[run.pairs()].iter().map(transposed));
            }
        }
        // Heads replicated over prefill ranks: pull reads the head from one of them, push has
        // each write its copy (same offsets: prefill ranks lay their pools out alike).
        if !own_attention && !skip && p_tp > d_tp {
            let reader = rank.reads.iter().find(|r| {
                r.p_rank != p_rank
                    && head(r.p_rank) == head(p_rank)
                    && r.runs().any(|x| x.label.kind == RowKind::AttnPage)
            });
            if let Some(read) = reader {
                let before = w.pairs.len();
                for run in read.runs().filter(|x| x.label.kind == RowKind::AttnPage) {
                    w.groups.push(run.group);
                    w.pairs.extend(read.pairs[run.pairs()].iter().map(transposed));
                }
                w.duplicate_pairs = w.pairs.len() - before;
            }
        }
        w.groups.sort_unstable();
        w.groups.dedup();
        out.push(w);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::layouts::hybrid::{HybridEngineSpec, HybridRequest, preset};

    fn planner(model: &str, p_tp: u32, d_tp: u32, rule: PushAttention) -> Option<HybridPlanner> {
        // Qwen3-Next's hybrid block size follows TP: one size on both sides, so more TP pairs
        // are accepted.
        let block_tokens = if model.starts_with("qwen3-next") { 544 } else { 16 };
        let engine =
            |tp| HybridEngineSpec { tp, num_blocks: 400, block_tokens, ..HybridEngineSpec::default() };
        let config = HybridPairSpec {
            model: preset(model).expect("preset"),
            p: engine(p_tp),
            d: engine(d_tp),
            permute_local_kv: false,
            state_slices: Default::default(),
            host_copy: Default::default(),
            push_attention: rule,
            stated: Default::default(),
        };
        HybridPlanner::new(&config).ok()
    }

    /// Per decode rank: every (decode offset, length) written, with the prefill offset and
    /// how often.
    fn landed(planner: &HybridPlanner, plan: &HybridPlan) -> BTreeMap<(u32, u64, u64), (u64, usize)> {
        let mut out = BTreeMap::new();
        for p in 0..planner.config.p.tp {
            for w in writes(planner, plan, p) {
                for x in &w.pairs {
                    out.entry((w.d_rank, x.remote, x.len)).or_insert((x.local, 0)).1 += 1;
                }
            }
        }
        out
    }

    fn pulled(plan: &HybridPlan) -> BTreeMap<(u32, u64, u64), u64> {
        let mut out = BTreeMap::new();
        for r in &plan.d_ranks {
            for read in &r.reads {
                for x in &read.pairs {
                    out.insert((r.d_rank, x.local, x.len), x.remote);
                }
            }
        }
        out
    }

    #[test]
    fn write_ranks_cover_every_decode_rank_once_per_expected_notification() {
        for (p_tp, d_tp) in [(1, 1), (1, 2), (2, 1), (4, 2), (2, 8), (8, 2)] {
            let mut count = vec![0; d_tp as usize];
            for p in 0..p_tp {
                for d in write_ranks(p_tp, d_tp, p) {
                    count[d as usize] += 1;
                }
            }
            assert!(count.iter().all(|&c| c == expected_notifs(p_tp, d_tp)), "P{p_tp} D{d_tp}: {count:?}");
        }
    }

    #[test]
    fn push_lands_what_pull_reads_where_vllm_writes_every_head() {
        let mut checked = 0;
        for model in ["qwen3-next-80b-a3b", "nemotron-h-8b", "jamba-v0.1", "gpt-oss-120b", "falcon-h1-7b"] {
            for (p_tp, d_tp) in [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2), (2, 4), (8, 2), (1, 8)] {
                for rule in [PushAttention::Vllm, PushAttention::EveryRank] {
                    let Some(planner) = planner(model, p_tp, d_tp, rule) else { continue };
                    if check_push(&planner).is_err() {
                        continue;
                    }
                    let req = HybridRequest::simulated(&planner, 3000, 0);
                    let plan = planner.plan(&req, "req").expect("plan");
                    let pull = pulled(&plan);
                    let push = landed(&planner, &plan);
                    // Every byte range push writes is one pull reads, from the same prefill
                    // offset (duplicates write the same bytes).
                    for (&(d, remote, len), &(local, _)) in &push {
                        assert_eq!(
                            pull.get(&(d, remote, len)),
                            Some(&local),
                            "{model} P{p_tp} D{d_tp} {rule:?}"
                        );
                    }
                    // Every range pull reads is written, unless vLLM's rule skips the rank's
                    // attention.
                    let skipped: Vec<u32> =
                        (0..d_tp).filter(|&d| attention_skipped(&planner.config, d)).collect();
                    for &(d, local, len) in pull.keys() {
                        if !skipped.contains(&d) {
                            assert!(
                                push.contains_key(&(d, local, len)),
                                "{model} P{p_tp} D{d_tp} {rule:?}: missing"
                            );
                        }
                    }
                    if rule == PushAttention::EveryRank {
                        assert!(skipped.is_empty());
                    }
                    // Equal TP: the same pairs, once each.
                    if p_tp == d_tp {
                        assert_eq!(push.len(), pull.len());
                        assert!(push.values().all(|&(_, n)| n == 1));
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 30, "{checked} pairs checked");
    }

    /// The rank map's groups (what `kvx topo --mode push` shows) are the groups a request's
    /// WRITEs hold, for every pair push accepts; and the groups carry every byte written.
    #[test]
    fn write_groups_are_the_groups_the_writes_hold() {
        let mut checked = 0;
        for model in ["qwen3-next-80b-a3b", "nemotron-h-8b", "jamba-v0.1", "gpt-oss-120b", "falcon-h1-7b"] {
            for (p_tp, d_tp) in [(1, 1), (2, 2), (1, 2), (2, 1), (4, 2), (2, 4), (8, 2), (1, 8), (4, 1)] {
                for rule in [PushAttention::Vllm, PushAttention::EveryRank] {
                    let Some(planner) = planner(model, p_tp, d_tp, rule) else { continue };
                    if check_push(&planner).is_err() {
                        continue;
                    }
                    let plan =
                        planner.plan(&HybridRequest::simulated(&planner, 3000, 0), "req").expect("plan");
                    for p in 0..p_tp {
                        let ws = writes(&planner, &plan, p);
                        for d in 0..d_tp {
                            let from_plan = ws.iter().find(|w| w.d_rank == d).map(|w| w.groups.clone());
                            assert_eq!(
                                write_groups(&planner, p, d),
                                from_plan.unwrap_or_default(),
                                "{model} P{p_tp} D{d_tp} {rule:?}: P{p} -> D{d}"
                            );
                        }
                        for w in &ws {
                            assert_eq!(w.groups.is_empty(), w.pairs.is_empty(), "{model} P{p_tp} D{d_tp}");
                        }
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 30, "{checked} pairs checked");
    }

    #[test]
    fn replicated_heads_are_written_by_every_prefill_rank_holding_them() {
        let planner = planner("qwen3-next-80b-a3b", 4, 1, PushAttention::Vllm).expect("pair");
        // Qwen3-Next has 2 KV heads: P4 -> D1 replicates each head over two prefill ranks.
        let plan = planner.plan(&HybridRequest::simulated(&planner, 3000, 0), "req").expect("plan");
        let dups: Vec<usize> = (0..4).map(|p| writes(&planner, &plan, p)[0].duplicate_pairs).collect();
        // Pull reads each head from its first rank; push's second rank writes it again.
        assert_eq!(dups[0], 0);
        assert!(dups[1] > 0, "{dups:?}");
        assert_eq!(dups[2], 0);
        assert_eq!(dups[1], dups[3]);
    }

    #[test]
    fn vllm_skips_attention_of_decode_ranks_sharing_a_head() {
        // Qwen3-Next: 2 KV heads; P1 -> D4: decode ranks 0,1 share head 0, 2,3 head 1.
        let planner = planner("qwen3-next-80b-a3b", 1, 4, PushAttention::Vllm).expect("pair");
        let skipped: Vec<bool> = (0..4).map(|d| attention_skipped(&planner.config, d)).collect();
        assert_eq!(skipped, [false, true, false, true]);
        let plan = planner.plan(&HybridRequest::simulated(&planner, 3000, 0), "req").expect("plan");
        let w = writes(&planner, &plan, 0);
        assert!(w[1].attention_skipped && w[1].bytes() < w[0].bytes());
        let every = self::planner("qwen3-next-80b-a3b", 1, 4, PushAttention::EveryRank).expect("pair");
        assert!((0..4).all(|d| !attention_skipped(&every.config, d)));
    }

    #[test]
    fn push_refuses_what_vllm_push_refuses() {
        // No state, decode TP above prefill TP and above the KV heads (gemma-3-4b: 4).
        let gemma = planner("gemma-3-4b", 1, 8, PushAttention::Vllm).expect("pull accepts it");
        let e = check_push(&gemma).expect_err("push refuses it");
        assert_eq!(e.knob(), Knob::DTp);
        // Different kernel block sizes (Qwen3-Next at its TP-dependent sizes: 272 at TP 4).
        let mut config = planner("qwen3-next-80b-a3b", 2, 2, PushAttention::Vllm).expect("pair").config;
        // Triton GDN prefill (A100-class): 272 and 544 tokens divide; FlashInfer's 320 and 576 do not.
        let triton = crate::layouts::hybrid::GdnPrefillBackend::Triton;
        config.p = HybridEngineSpec { tp: 4, block_tokens: 16, gdn_prefill: triton, ..config.p };
        config.d = HybridEngineSpec { tp: 2, block_tokens: 16, gdn_prefill: triton, ..config.d };
        let qwen = HybridPlanner::new(&config).expect("pull accepts P4 -> D2");
        let e = check_push(&qwen).expect_err("push refuses it");
        assert_eq!(e.knob(), Knob::Mode);
        assert!(e.to_string().contains("272"), "{e}");
    }
}
