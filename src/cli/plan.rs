//! `kvx plan`: the descriptor pairs each decode rank posts for one request, and what posting
//! them costs on each transport (`layouts::posting`: is the request post-bound?); with
//! `--mode push`, the WRITEs each prefill rank posts into the decode ranks' blocks.

use clap::Args;
use serde::Serialize;

use super::common::Format;
use super::topo::reject;
use crate::error::ConfigError;
use crate::error::Outcome;
use crate::layouts::hybrid::HybridPlanner;
use crate::layouts::plan::Planner;
use crate::layouts::posting::{PathCost, PostRates, ReadShape, request_costs};
use crate::layouts::push::PushPlanner;
use crate::output;
use crate::report::plan::{self as plan_report, PushRankPlan, RankPlan};
use crate::settings::hybrid_case::{HYBRID_VLLM, HybridCase};
use crate::settings::plan::{DescriptorPlan, PlanFlags, resolve_descriptor_plan, resolve_hybrid};
use crate::topology::TransferMode;
use crate::topology::push::DRankPushView;

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  kvx plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --alloc random\n  \
    kvx plan --p-tp 1 --d-tp 2 --num-kv-heads 2 --layers 2 --head-dim 64 --local-blocks 1,3 --remote-blocks 0,2\n  \
    kvx plan --scenario case.json --format json\n  \
    kvx plan --mode push --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 4096\n  \
    kvx plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --post-ns cuda-batch=150,cuda-batch-call=9000\n\n\
Posting cost: for each transport (ucx on host memory, UCX cuda_ipc, kvx's cuda-batch) the
descriptors the busiest decode rank posts, the time posting them takes at that transport's
per-descriptor rate, and the time the bytes take at its bandwidth ceiling; a request whose
posting takes longer is post-bound. Every rate names the results file and line it comes
from; `--rates FILE` takes your own `kvx xfer --format json` (or gpu-check) JSON instead."
)]
pub struct PlanArgs {
    #[command(flatten)]
    pub settings: PlanFlags,
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
    rate: crate::layouts::posting::PathRate,
}

fn plan_all(args: &PlanFlags, r: &DescriptorPlan) -> Result<Vec<RankPlan>, ConfigError> {
    let map = r.pair.validate()?;
    let ranks: Vec<u32> = match args.d_rank {
        Some(d) => vec![d],
        None => (0..r.pair.d.tp).collect(),
    };
    ranks
        .into_iter()
        .map(|d| {
            let planner = Planner::new(&r.pair, &map, d)?;
            let plan = planner.plan(&r.blocks, &r.ids)?;
            let bp = planner.pair_blocks(&r.blocks)?;
            let coalesced = if plan.reads.is_empty() { vec![] } else { planner.coalesced(&bp) };
            Ok((plan, coalesced))
        })
        .collect()
}

pub fn run(args: &PlanArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    if let Some(case) = resolve_hybrid(args).map_err(|e| reject(args.format, e))? {
        return run_hybrid(args, &case);
    }
    let resolved = resolve_descriptor_plan(args).map_err(|e| reject(args.format, e))?;
    if args.mode == TransferMode::Push {
        return run_push(args, &resolved);
    }
    let rates =
        crate::settings::posting::resolve_rates(args.rates.as_deref(), &args.post_ns, &args.ceiling_gbps)
            .map_err(|e| reject(args.format, e))?;
    let plans = plan_all(args, &resolved).map_err(|e| reject(args.format, e))?;
    let costs = posting_costs(&plans, &rates);
    match args.format {
        Format::Json => {
            let out = PlanJson {
                status: "ok",
                vllm_version: resolved.pair.version.as_str(),
                local_blocks: resolved.blocks.local.clone(),
                remote_blocks: resolved.blocks.remote.clone(),
                d_ranks: plans
                    .iter()
                    .map(|(p, co)| DRankJson {
                        d_rank: p.d_rank,
                        reads: p
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
                        notifs_only: p
                            .notifs_only
                            .iter()
                            .map(|n| NotifJson { p_rank: n.p_rank, msg: n.msg.clone() })
                            .collect(),
                    })
                    .collect(),
                posting: PostingJson {
                    paths: costs
                        .iter()
                        .map(|c| {
                            let rate = rates.of(c.transport).clone();
                            PathCostJson { cost: c.clone(), rate }
                        })
                        .collect(),
                },
            };
            output::stdout_line(serde_json::to_string(&out)?)?;
        }
        Format::Table => {
            let mut text =
                plan_report::render_pull(&resolved.pair, &resolved.blocks, &plans, args.show_pairs);
            text.push_str(&plan_report::render_posting(&costs, &rates));
            output::stdout(text)?
        }
    }
    Ok(Outcome::Ok)
}

/// Each transport's cost for this request (its busiest decode rank).
fn posting_costs(plans: &[RankPlan], rates: &PostRates) -> Vec<PathCost> {
    let ranks: Vec<(u32, Vec<ReadShape>)> = plans
        .iter()
        .map(|(plan, co)| {
            let reads = plan
                .reads
                .iter()
                .enumerate()
                .map(|(i, r)| ReadShape {
                    descriptors: r.pairs.len() as u64,
                    coalesced: co.get(i).map_or(0, Vec::len) as u64,
                    bytes: r.pairs.iter().map(|p| p.len).sum(),
                })
                .collect();
            (plan.d_rank, reads)
        })
        .collect();
    request_costs(&ranks, rates)
}

/// Plans every prefill rank's WRITEs (only those into `--d-rank` when given).
fn plan_all_push(
    args: &PlanFlags,
    r: &DescriptorPlan,
) -> Result<(Vec<PushRankPlan>, Vec<DRankPushView>), ConfigError> {
    let map = r.pair.validate_push()?;
    let keep = |d: u32| args.d_rank.is_none_or(|want| want == d);
    let mut plans = Vec::with_capacity(map.p_ranks.len());
    for p in 0..r.pair.p.tp {
        let planner = PushPlanner::new(&r.pair, &map, p)?;
        let mut plan = planner.plan(&r.blocks, &r.ids)?;
        let bp = planner.pair_blocks(&r.blocks)?;
        let mut coalesced = if plan.writes.is_empty() { vec![] } else { planner.coalesced(&bp) };
        if args.d_rank.is_some() && !plan.writes.is_empty() {
            let kept: Vec<bool> = plan.writes.iter().map(|w| keep(w.d_rank)).collect();
            let mut k = kept.iter();
            plan.writes.retain(|_| k.next().copied().unwrap_or(false));
            let mut k = kept.iter();
            coalesced.retain(|_| k.next().copied().unwrap_or(false));
        }
        plans.push((plan, coalesced));
    }
    let views = map.d_ranks.into_iter().filter(|d| keep(d.d_rank)).collect();
    Ok((plans, views))
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

fn run_push(args: &PlanFlags, resolved: &DescriptorPlan) -> anyhow::Result<Outcome> {
    let (plans, views) = plan_all_push(args, resolved).map_err(|e| reject(args.format, e))?;
    match args.format {
        Format::Json => {
            let out = PushPlanJson {
                status: "ok",
                mode: TransferMode::Push.as_str(),
                vllm_version: resolved.pair.version.as_str(),
                decode_blocks: resolved.blocks.local.clone(),
                prefill_blocks: resolved.blocks.remote.clone(),
                p_ranks: plans
                    .iter()
                    .map(|(p, co)| PushPRankJson {
                        p_rank: p.p_rank,
                        writes: p
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
                d_ranks: views
                    .iter()
                    .map(|d| PushDRankJson {
                        d_rank: d.d_rank,
                        writers: d.writers.clone(),
                        expected_notifs: d.expected_notifs,
                        bytes_written: bytes_into(&plans, d.d_rank),
                    })
                    .collect(),
            };
            output::stdout_line(serde_json::to_string(&out)?)?;
        }
        Format::Table => output::stdout(plan_report::render_push(
            &resolved.pair,
            &resolved.blocks,
            &plans,
            &views,
            args.show_pairs,
        ))?,
    }
    Ok(Outcome::Ok)
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
    clipping: &'a [crate::layouts::hybrid::GroupClipping],
    /// Where each engine came from (derived, or as the case states it) and, for a stated one,
    /// each field where kvx's own derivation differs.
    engines: &'a [crate::layouts::hybrid::GeometrySource; 2],
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
    fn new(name: &'a str, planner: &'a HybridPlanner, plan: &'a crate::layouts::hybrid::HybridPlan) -> Self {
        HybridRequestJson {
            name,
            vllm_version: HYBRID_VLLM,
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
    state_slices: Option<crate::layouts::hybrid::StateSlices>,
    /// `--host-copy per-group`: decode's host-to-device copy by kvx's rule (absent: vLLM's).
    #[serde(skip_serializing_if = "Option::is_none")]
    host_copy: Option<crate::layouts::hybrid::HostCopyRule>,
    /// Where vLLM's rules move the wrong bytes or reach outside registered memory.
    findings: Vec<&'a crate::layouts::hybrid::Finding>,
    /// What posting the busiest decode rank's descriptors costs on each transport.
    posting: PostingJson,
}

/// `kvx plan --scenario` of a hybrid case: vLLM's handshake (or its refusal), then the READs.
fn run_hybrid(args: &PlanFlags, case: &HybridCase) -> anyhow::Result<Outcome> {
    let refused = |e: crate::layouts::hybrid::HybridError| {
        let by_vllm = e.refusal().is_some();
        let err = ConfigError::from(e);
        if args.format == Format::Json && by_vllm {
            // vLLM's own refusal, as the oracle records it.
            let body = serde_json::json!({"status": "rejected", "by": "vllm", "error": err.to_string(), "flag": err.flag});
            let _ = output::stdout_line(body);
            return anyhow::Error::from(err);
        }
        reject(args.format, err)
    };
    let rates =
        crate::settings::posting::resolve_rates(args.rates.as_deref(), &args.post_ns, &args.ceiling_gbps)
            .map_err(|e| reject(args.format, e))?;
    let planner = HybridPlanner::new(&case.pair).map_err(refused)?;
    if let Some(d) = args.d_rank.filter(|&d| d >= planner.config.d.tp) {
        let why = format!("decode rank {d} does not exist (decode TP is {})", planner.config.d.tp);
        return Err(reject(args.format, ConfigError::new("--d-rank", why)));
    }
    if args.mode == TransferMode::Push {
        crate::layouts::hybrid::push::check_push(&planner).map_err(refused)?;
    }
    let plan = planner.plan(&case.request.for_planner(&planner), &args.p_request_id).map_err(refused)?;
    if args.mode == TransferMode::Push {
        return run_hybrid_push(args, case, &planner, &plan);
    }
    // The plan's findings include the planner's (those that hold for every request).
    let findings: Vec<_> = plan.findings.iter().collect();
    // Posting cost: every descriptor a decode rank posts, state rows included (vLLM merges
    // none of them, so each counts as its own copy).
    let ranks: Vec<(u32, Vec<ReadShape>)> = plan
        .d_ranks
        .iter()
        .map(|d| {
            let reads = d
                .reads
                .iter()
                .map(|r| ReadShape {
                    descriptors: r.pairs.len() as u64,
                    coalesced: r.pairs.len() as u64,
                    bytes: r.bytes(),
                })
                .collect();
            (d.d_rank, reads)
        })
        .collect();
    let costs = request_costs(&ranks, &rates);
    match args.format {
        Format::Json => {
            let d_ranks = plan
                .d_ranks
                .iter()
                .filter(|d| args.d_rank.is_none_or(|r| r == d.d_rank))
                .map(|d| HybridDRankJson {
                    d_rank: d.d_rank,
                    handshake_ranks: &d.handshake_ranks,
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
                                .map(|p| (p.label.to_string(), p.pair.local, p.pair.remote, p.pair.len))
                                .collect(),
                        })
                        .collect(),
                    notifs_only: &d.notifs_only,
                })
                .collect();
            let out = HybridPlanJson {
                status: "ok",
                request: HybridRequestJson::new(&case.name, &planner, &plan),
                d_ranks,
                state_slices: (case.pair.state_slices != crate::layouts::hybrid::StateSlices::Vllm)
                    .then_some(case.pair.state_slices),
                host_copy: (case.pair.host_copy != crate::layouts::hybrid::HostCopyRule::Vllm)
                    .then_some(case.pair.host_copy),
                findings,
                posting: PostingJson {
                    paths: costs
                        .iter()
                        .map(|c| PathCostJson { cost: c.clone(), rate: rates.of(c.transport).clone() })
                        .collect(),
                },
            };
            output::stdout_line(serde_json::to_string(&out)?)?;
        }
        Format::Table => {
            let mut text = plan_report::render_hybrid(&case.name, &planner, &plan, args.d_rank);
            text.push_str(&plan_report::render_posting(&costs, &rates));
            output::stdout(text)?
        }
    }
    Ok(Outcome::Ok)
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
    push_attention: Option<crate::layouts::hybrid::push::PushAttention>,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_slices: Option<crate::layouts::hybrid::StateSlices>,
    findings: Vec<&'a crate::layouts::hybrid::Finding>,
}

/// `kvx plan --mode push` of a hybrid model: each prefill rank's WRITEs, taken from the pull
/// plan of the decode ranks it writes into (`layouts::hybrid::push`), and what each decode
/// rank waits for.
fn run_hybrid_push(
    args: &PlanFlags,
    case: &HybridCase,
    planner: &HybridPlanner,
    plan: &crate::layouts::hybrid::HybridPlan,
) -> anyhow::Result<Outcome> {
    use crate::layouts::hybrid::push::{self, PushAttention};
    let (p_tp, d_tp) = (planner.config.p.tp, planner.config.d.tp);
    let shown = |d: u32| args.d_rank.is_none_or(|r| r == d);
    // Prefill names the request by decode's id and its own TP size (as kvx's push does).
    let notif = format!("req-D:{p_tp}");
    let per_p: Vec<(u32, Vec<push::HybridWrite>)> = (0..p_tp)
        .map(|p| (p, push::writes(planner, plan, p).into_iter().filter(|w| shown(w.d_rank)).collect()))
        .collect();
    let waits: Vec<(u32, Vec<u32>, u32)> = (0..d_tp)
        .filter(|&d| shown(d))
        .map(|d| {
            let writers = push::writers(p_tp, d_tp, d);
            (d, writers, push::expected_notifs(p_tp, d_tp))
        })
        .collect();
    match args.format {
        Format::Json => {
            let bytes_into = |d: u32| -> u64 {
                per_p
                    .iter()
                    .flat_map(|(_, ws)| ws)
                    .filter(|w| w.d_rank == d)
                    .map(push::HybridWrite::bytes)
                    .sum()
            };
            let out = HybridPushPlanJson {
                status: "ok",
                mode: "push",
                request: HybridRequestJson::new(&case.name, planner, plan),
                p_ranks: per_p
                    .iter()
                    .map(|(p, ws)| HybridPRankJson {
                        p_rank: *p,
                        writes: ws
                            .iter()
                            .map(|w| HybridWriteJson {
                                d_rank: w.d_rank,
                                notif_msg: notif.clone(),
                                num_descs: w.pairs.len(),
                                bytes: w.bytes(),
                                duplicate_pairs: w.duplicate_pairs,
                                attention_skipped: w.attention_skipped,
                                pairs: w.pairs.iter().map(|x| [x.local, x.remote, x.len]).collect(),
                            })
                            .collect(),
                    })
                    .collect(),
                d_ranks: waits
                    .iter()
                    .map(|(d, writers, n)| PushDRankJson {
                        d_rank: *d,
                        writers: writers.clone(),
                        expected_notifs: *n,
                        bytes_written: bytes_into(*d),
                    })
                    .collect(),
                push_attention: (case.pair.push_attention != PushAttention::Vllm)
                    .then_some(case.pair.push_attention),
                state_slices: (case.pair.state_slices != crate::layouts::hybrid::StateSlices::Vllm)
                    .then_some(case.pair.state_slices),
                findings: plan.findings.iter().collect(),
            };
            output::stdout_line(serde_json::to_string(&out)?)?;
        }
        Format::Table => {
            let rows: Vec<(u32, &push::HybridWrite)> =
                per_p.iter().flat_map(|(p, ws)| ws.iter().map(move |w| (*p, w))).collect();
            output::stdout(plan_report::render_hybrid_push(&case.name, planner, plan, &rows, &waits, &notif))?
        }
    }
    Ok(Outcome::Ok)
}
