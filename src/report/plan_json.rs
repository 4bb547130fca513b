//! `kvx plan --format json`: one JSON object per planned request ([`json`]), in the shape of
//! the oracle's descriptor lists: per decode rank its READs (per prefill rank its WRITEs in
//! push mode), every uncoalesced pair, and the posting cost of a pull plan. Pure: the shapes
//! are built from `layouts::request::Planned` alone.

use serde::Serialize;

use crate::layouts::hybrid::{
    Finding, GeometrySource, GroupClipping, HostCopyRule, HybridPlan, HybridPlanner, PushAttention,
    StateSlices,
};
use crate::layouts::posting::{PathCost, PathRate, PostRates};
use crate::layouts::request::{HybridPull, HybridPushed, Planned, PushRankPlan, UniformPull, UniformPush};
use crate::topology::TransferMode;

/// The planned request as one line of JSON (no newline).
pub fn json(planned: &Planned) -> serde_json::Result<String> {
    match planned {
        Planned::UniformPull(p) => serde_json::to_string(&uniform_pull(p)),
        Planned::UniformPush(p) => serde_json::to_string(&uniform_push(p)),
        Planned::HybridPull(p) => serde_json::to_string(&hybrid_pull(p)),
        Planned::HybridPush(p) => serde_json::to_string(&hybrid_push(p)),
    }
}

#[derive(Debug, Serialize)]
struct ReadJson {
    p_rank: u32,
    notif_msg: String,
    num_descs: usize,
    num_descs_coalesced: usize,
    bytes: u64,
    pairs: Vec<[u64; 3]>,
}

#[derive(Debug, Serialize)]
struct NotifJson {
    p_rank: u32,
    msg: String,
}

#[derive(Debug, Serialize)]
struct DRankJson {
    d_rank: u32,
    reads: Vec<ReadJson>,
    notifs_only: Vec<NotifJson>,
}

#[derive(Debug, Serialize)]
struct PlanJson {
    status: &'static str,
    vllm_version: &'static str,
    local_blocks: Vec<u32>,
    remote_blocks: Vec<u32>,
    d_ranks: Vec<DRankJson>,
    posting: PostingJson,
}

/// The posting-cost section: per transport, the busiest decode rank's cost, and the rates used.
#[derive(Debug, Serialize)]
struct PostingJson {
    paths: Vec<PathCostJson>,
}

#[derive(Debug, Serialize)]
struct PathCostJson {
    #[serde(flatten)]
    cost: PathCost,
    #[serde(flatten)]
    rate: PathRate,
}

impl PostingJson {
    fn new(costs: &[PathCost], rates: &PostRates) -> Self {
        PostingJson {
            paths: costs
                .iter()
                .map(|c| PathCostJson { cost: c.clone(), rate: rates.of(c.transport).clone() })
                .collect(),
        }
    }
}

fn uniform_pull(p: &UniformPull) -> PlanJson {
    PlanJson {
        status: "ok",
        vllm_version: p.request.pair.version.as_str(),
        local_blocks: p.request.blocks.local.clone(),
        remote_blocks: p.request.blocks.remote.clone(),
        d_ranks: p
            .plans
            .iter()
            .map(|(plan, co)| DRankJson {
                d_rank: plan.d_rank,
                reads: plan
                    .reads
                    .iter()
                    .enumerate()
                    .map(|(i, r)| ReadJson {
                        p_rank: r.p_rank,
                        notif_msg: r.notif_msg.clone(),
                        num_descs: r.pairs.len(),
                        num_descs_coalesced: co.get(i).map_or(0, Vec::len),
                        bytes: r.pairs.iter().map(|x| x.len).sum(),
                        pairs: r.pairs.iter().map(|x| [x.local, x.remote, x.len]).collect(),
                    })
                    .collect(),
                notifs_only: plan
                    .notifs_only
                    .iter()
                    .map(|n| NotifJson { p_rank: n.p_rank, msg: n.msg.clone() })
                    .collect(),
            })
            .collect(),
        posting: PostingJson::new(&p.costs, &p.rates),
    }
}

#[derive(Debug, Serialize)]
struct WriteJson {
    d_rank: u32,
    notif_msg: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    duplicate_of: Option<u32>,
    num_descs: usize,
    num_descs_coalesced: usize,
    bytes: u64,
    /// `[local (prefill offset), remote (decode offset), len]`.
    pairs: Vec<[u64; 3]>,
}

#[derive(Debug, Serialize)]
struct PushPRankJson {
    p_rank: u32,
    writes: Vec<WriteJson>,
}

#[derive(Debug, Serialize)]
struct PushDRankJson {
    d_rank: u32,
    writers: Vec<u32>,
    expected_notifs: u32,
    /// Bytes this request's WRITEs put into the rank (duplicates counted once per WRITE).
    bytes_written: u64,
}

#[derive(Debug, Serialize)]
struct PushPlanJson {
    status: &'static str,
    mode: &'static str,
    vllm_version: &'static str,
    /// The decode blocks registered with prefill (`PUSH_REG`), in prompt order.
    decode_blocks: Vec<u32>,
    /// The prefill blocks holding the prompt.
    prefill_blocks: Vec<u32>,
    p_ranks: Vec<PushPRankJson>,
    d_ranks: Vec<PushDRankJson>,
}

fn bytes_into(plans: &[PushRankPlan], d_rank: u32) -> u64 {
    plans
        .iter()
        .flat_map(|(p, _)| &p.writes)
        .filter(|w| w.d_rank == d_rank)
        .flat_map(|w| &w.pairs)
        .map(|x| x.len)
        .sum()
}

fn uniform_push(p: &UniformPush) -> PushPlanJson {
    PushPlanJson {
        status: "ok",
        mode: TransferMode::Push.as_str(),
        vllm_version: p.request.pair.version.as_str(),
        decode_blocks: p.request.blocks.local.clone(),
        prefill_blocks: p.request.blocks.remote.clone(),
        p_ranks: p
            .plans
            .iter()
            .map(|(plan, co)| PushPRankJson {
                p_rank: plan.p_rank,
                writes: plan
                    .writes
                    .iter()
                    .enumerate()
                    .map(|(i, w)| WriteJson {
                        d_rank: w.d_rank,
                        notif_msg: w.notif_msg.clone(),
                        duplicate_of: w.duplicate_of,
                        num_descs: w.pairs.len(),
                        num_descs_coalesced: co.get(i).map_or(0, Vec::len),
                        bytes: w.pairs.iter().map(|x| x.len).sum(),
                        pairs: w.pairs.iter().map(|x| [x.local, x.remote, x.len]).collect(),
                    })
                    .collect(),
            })
            .collect(),
        d_ranks: p
            .views
            .iter()
            .map(|d| PushDRankJson {
                d_rank: d.d_rank,
                writers: d.writers.clone(),
                expected_notifs: d.expected_notifs,
                bytes_written: bytes_into(&p.plans, d.d_rank),
            })
            .collect(),
    }
}

#[derive(Debug, Serialize)]
struct HybridReadJson<'a> {
    p_rank: u32,
    notif_msg: &'a str,
    num_descs: usize,
    bytes: u64,
    /// `[label, local offset, remote offset, length]`, in posting order.
    pairs: Vec<(String, u64, u64, u64)>,
}

#[derive(Debug, Serialize)]
struct HybridDRankJson<'a> {
    d_rank: u32,
    handshake_ranks: &'a [u32],
    /// vLLM's `TPMapping` of this rank: the prefill ranks read per group, the head slice, the
    /// notifications each prefill rank waits for.
    tp_mapping: &'a crate::layouts::hybrid::TpMapping,
    /// vLLM's signed TP ratio (`D/P`, or `-(P/D)`) and its block-size ratio.
    tp_ratio: i64,
    block_size_ratio: u32,
    reads: Vec<HybridReadJson<'a>>,
    notifs_only: &'a [(u32, String)],
}

/// What both hybrid views' JSON open with: the pair's sizes and the request's lists.
#[derive(Debug, Serialize)]
struct HybridRequestJson<'a> {
    name: &'a str,
    vllm_version: &'static str,
    /// Prefill's and decode's aligned block size (tokens) and padded page (bytes).
    p_block_size: u32,
    d_block_size: u32,
    p_page_bytes: u64,
    d_page_bytes: u64,
    tokens: &'a crate::layouts::hybrid::blocks::TokenCounts,
    /// What prefill sends (one list per KV cache group) and decode fills (or, in push mode,
    /// registers), after clipping.
    remote_block_ids: &'a [Vec<u32>],
    local_block_ids: &'a [Vec<u32>],
    clipping: &'a [GroupClipping],
    /// Where each engine came from (derived, or as the case states it) and, for a stated one,
    /// each field where kvx's own derivation differs.
    engines: &'a [GeometrySource; 2],
    /// The engine settings kvx derives with.
    settings: EngineSettingsJson,
}

/// The engine settings a hybrid plan's derivation used.
#[derive(Debug, Serialize)]
struct EngineSettingsJson {
    attention_backend: &'static str,
    gdn_prefill: &'static str,
    prefix_caching: bool,
}

impl<'a> HybridRequestJson<'a> {
    fn new(
        name: &'a str,
        vllm_version: &'static str,
        planner: &'a HybridPlanner,
        plan: &'a HybridPlan,
    ) -> Self {
        HybridRequestJson {
            name,
            vllm_version,
            p_block_size: planner.p.sizing.block_tokens,
            d_block_size: planner.d.sizing.block_tokens,
            p_page_bytes: planner.p.sizing.page_bytes,
            d_page_bytes: planner.d.sizing.page_bytes,
            tokens: &plan.tokens,
            remote_block_ids: &plan.blocks.remote_block_ids,
            local_block_ids: &plan.blocks.local_block_ids,
            clipping: &plan.clipping,
            engines: &planner.sources,
            settings: EngineSettingsJson {
                attention_backend: planner.config.p.attention_backend.vllm_name(),
                gdn_prefill: planner.config.p.gdn_prefill.name(),
                prefix_caching: planner.config.p.prefix_caching,
            },
        }
    }
}

#[derive(Debug, Serialize)]
struct HybridPlanJson<'a> {
    status: &'static str,
    #[serde(flatten)]
    request: HybridRequestJson<'a>,
    d_ranks: Vec<HybridDRankJson<'a>>,
    /// `--state-slices exact`: state slices read by kvx's rule, not vLLM's (absent: vLLM's).
    #[serde(skip_serializing_if = "Option::is_none")]
    state_slices: Option<StateSlices>,
    /// `--host-copy per-group`: decode's host-to-device copy by kvx's rule (absent: vLLM's).
    #[serde(skip_serializing_if = "Option::is_none")]
    host_copy: Option<HostCopyRule>,
    /// Where vLLM's rules move the wrong bytes or reach outside registered memory.
    findings: Vec<&'a Finding>,
    /// What posting the busiest decode rank's descriptors costs on each transport.
    posting: PostingJson,
}

fn hybrid_pull(p: &HybridPull) -> HybridPlanJson<'_> {
    let config = &p.planner.config;
    let d_ranks = p
        .plan
        .d_ranks
        .iter()
        .filter(|d| p.d_rank.is_none_or(|r| r == d.d_rank))
        .map(|d| HybridDRankJson {
            d_rank: d.d_rank,
            handshake_ranks: &d.handshake_ranks,
            tp_mapping: &d.mapping,
            tp_ratio: p.planner.tp_ratio,
            block_size_ratio: p.planner.block_size_ratio,
            reads: d
                .reads
                .iter()
                .map(|r| HybridReadJson {
                    p_rank: r.p_rank,
                    notif_msg: &r.notif_msg,
                    num_descs: r.pairs.len(),
                    bytes: r.bytes(),
                    pairs: r
                        .labeled()
                        .map(|x| (x.label.to_string(), x.pair.local, x.pair.remote, x.pair.len))
                        .collect(),
                })
                .collect(),
            notifs_only: &d.notifs_only,
        })
        .collect();
    HybridPlanJson {
        status: "ok",
        request: HybridRequestJson::new(&p.name, p.vllm_version, &p.planner, &p.plan),
        d_ranks,
        state_slices: (config.state_slices != StateSlices::Vllm).then_some(config.state_slices),
        host_copy: (config.host_copy != HostCopyRule::Vllm).then_some(config.host_copy),
        // The plan's findings include the planner's (those that hold for every request).
        findings: p.plan.findings.iter().collect(),
        posting: PostingJson::new(&p.costs, &p.rates),
    }
}

#[derive(Debug, Serialize)]
struct HybridWriteJson {
    d_rank: u32,
    notif_msg: String,
    num_descs: usize,
    bytes: u64,
    /// Of `pairs`, how many (at the end) write a head another prefill rank writes too.
    duplicate_pairs: usize,
    /// vLLM's push rule left this decode rank's attention out (`--push-attention`).
    attention_skipped: bool,
    /// `[local (prefill offset), remote (decode offset), len]`, in posting order.
    pairs: Vec<[u64; 3]>,
}

#[derive(Debug, Serialize)]
struct HybridPRankJson {
    p_rank: u32,
    writes: Vec<HybridWriteJson>,
}

#[derive(Debug, Serialize)]
struct HybridPushPlanJson<'a> {
    status: &'static str,
    mode: &'static str,
    #[serde(flatten)]
    request: HybridRequestJson<'a>,
    p_ranks: Vec<HybridPRankJson>,
    d_ranks: Vec<PushDRankJson>,
    /// `--push-attention every-rank` (absent: vLLM's rule).
    #[serde(skip_serializing_if = "Option::is_none")]
    push_attention: Option<PushAttention>,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_slices: Option<StateSlices>,
    findings: Vec<&'a Finding>,
}

fn hybrid_push(p: &HybridPushed) -> HybridPushPlanJson<'_> {
    let config = &p.planner.config;
    let bytes_into = |d: u32| -> u64 {
        p.writes.iter().flat_map(|(_, ws)| ws).filter(|w| w.d_rank == d).map(|w| w.bytes()).sum()
    };
    HybridPushPlanJson {
        status: "ok",
        mode: "push",
        request: HybridRequestJson::new(&p.name, p.vllm_version, &p.planner, &p.plan),
        p_ranks: p
            .writes
            .iter()
            .map(|(p_rank, ws)| HybridPRankJson {
                p_rank: *p_rank,
                writes: ws
                    .iter()
                    .map(|w| HybridWriteJson {
                        d_rank: w.d_rank,
                        notif_msg: p.notif.clone(),
                        num_descs: w.pairs.len(),
                        bytes: w.bytes(),
                        duplicate_pairs: w.duplicate_pairs,
                        attention_skipped: w.attention_skipped,
                        pairs: w.pairs.iter().map(|x| [x.local, x.remote, x.len]).collect(),
                    })
                    .collect(),
            })
            .collect(),
        d_ranks: p
            .waits
            .iter()
            .map(|(d, writers, n)| PushDRankJson {
                d_rank: *d,
                writers: writers.clone(),
                expected_notifs: *n,
                bytes_written: bytes_into(*d),
            })
            .collect(),
        push_attention: (config.push_attention != PushAttention::Vllm).then_some(config.push_attention),
        state_slices: (config.state_slices != StateSlices::Vllm).then_some(config.state_slices),
        findings: p.plan.findings.iter().collect(),
    }
}
