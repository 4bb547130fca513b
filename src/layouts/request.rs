//! `kvx plan`'s request, planned whole: one resolved [`PlanRequest`] (a uniform or a hybrid
//! pair; decode pulling or prefill pushing) goes through one function, [`plan`], into one
//! typed answer, [`Planned`], that `report::plan` renders.
//!
//! Owns: which planner each case takes and what it is asked (every decode rank's READs or
//! every prefill rank's WRITEs, only those into one decode rank where the request names one) and the posting
//! cost of a pull plan. Pure: no I/O, no flag names (a [`PlanError`] says what is wrong;
//! `settings` names the flag to change).

use thiserror::Error;

use super::compat::PairSpec;
use super::hybrid::write_plan::{self as hybrid_push, HybridWrite};
use super::hybrid::{HybridError, HybridPairSpec, HybridPlan, HybridPlanner, HybridRequest};
use super::posting::{PathCost, PostPath, PostRates, ReadShape, request_costs};
use super::predict::{RankLoad, RequestPrediction};
use super::read_plan::{DRankPlan, Pair, Planner, RequestBlocks, RequestIds};
use super::write_plan::{PRankPlan, PushPlanner};
use crate::error::ConfigError;
use crate::topology::push_map::DRankPushView;

/// A decode rank's plan with its coalesced pairs per READ.
pub type RankPlan = (DRankPlan, Vec<Vec<Pair>>);

/// A prefill rank's push plan with its coalesced pairs per WRITE.
pub type PushRankPlan = (PRankPlan, Vec<Vec<Pair>>);

/// What `kvx plan` plans: one request, on one pair, in one mode.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    pub case: PlanCase,
    /// Only this decode rank (in push mode, only the WRITEs into it); `None`: every rank.
    pub d_rank: Option<u32>,
}

/// The four kinds of request: a uniform or a hybrid pair, pulled or pushed. A pull plan's
/// posting cost is worked out at `rates`.
#[derive(Debug, Clone)]
pub enum PlanCase {
    UniformPull { request: UniformRequest, rates: PostRates },
    UniformPush { request: UniformRequest, rates: PostRates },
    HybridPull { request: HybridPlanRequest, rates: PostRates },
    HybridPush { request: HybridPlanRequest, rates: PostRates },
}

/// A uniform pair's request: the pair, its block ids, its notification ids.
#[derive(Debug, Clone)]
pub struct UniformRequest {
    pub pair: PairSpec,
    pub blocks: RequestBlocks,
    pub ids: RequestIds,
}

/// A hybrid pair's request: a case of vLLM's hybrid oracle, or a hybrid preset with a prompt.
#[derive(Debug, Clone)]
pub struct HybridPlanRequest {
    /// The case's name (the model's, for a preset).
    pub name: String,
    pub pair: HybridPairSpec,
    pub source: HybridSource,
    /// The prefill request id in notifications.
    pub p_request_id: String,
    /// The vLLM release whose rules the hybrid planner follows, as the JSON view names it.
    pub vllm_version: &'static str,
}

/// Where a hybrid request's block lists come from.
#[derive(Debug, Clone)]
pub enum HybridSource {
    /// An oracle case's own lists.
    Case(HybridRequest),
    /// A prompt (and the fraction of it decode already holds): lists allocated as vLLM's
    /// allocator leaves them, once the pair's aligned block sizes are known.
    Prompt { tokens: u32, prefix_hit: f64 },
}

impl HybridSource {
    /// The request, for the planner of its pair.
    fn for_planner(&self, planner: &HybridPlanner) -> HybridRequest {
        match self {
            HybridSource::Case(r) => r.clone(),
            HybridSource::Prompt { tokens, prefix_hit } => {
                let d_blocks = tokens.div_ceil(planner.d.sizing.block_tokens.max(1));
                let hit = (f64::from(d_blocks) * prefix_hit).floor() as u32;
                HybridRequest::simulated(planner, *tokens, hit)
            }
        }
    }
}

/// Why a request cannot be planned.
#[derive(Debug, Error)]
pub enum PlanError {
    /// The uniform pair or request does not hold (the error names its flag).
    #[error(transparent)]
    Uniform(#[from] ConfigError),
    /// The hybrid planner's refusal (vLLM's own, or a configuration kvx does not model).
    #[error(transparent)]
    Hybrid(#[from] HybridError),
    /// The decode rank asked for is not one of the pair's.
    #[error("decode rank {d_rank} does not exist (decode TP is {d_tp})")]
    NoDecodeRank { d_rank: u32, d_tp: u32 },
}

impl PlanError {
    /// vLLM itself refuses the pair (its handshake would fail).
    pub fn refused_by_vllm(&self) -> bool {
        matches!(self, PlanError::Hybrid(e) if e.refusal().is_some())
    }
}

/// A planned request, one variant per [`PlanCase`].
#[derive(Debug)]
pub enum Planned {
    UniformPull(UniformPull),
    UniformPush(UniformPush),
    HybridPull(HybridPull),
    HybridPush(HybridPushed),
}

/// Decode's READs on a uniform pair, and what posting them costs.
#[derive(Debug)]
pub struct UniformPull {
    pub request: UniformRequest,
    /// One per decode rank shown.
    pub plans: Vec<RankPlan>,
    /// Per transport, the busiest decode rank's cost.
    pub costs: Vec<PathCost>,
    pub rates: PostRates,
    /// Per path with a fitted model (a rates file of `kvx calibrate`), the predicted transfer.
    pub predictions: Vec<(PostPath, RequestPrediction)>,
}

/// Prefill's WRITEs on a uniform pair.
#[derive(Debug)]
pub struct UniformPush {
    pub request: UniformRequest,
    /// One per prefill rank (only the WRITEs into the decode rank shown, where one is).
    pub plans: Vec<PushRankPlan>,
    /// What each decode rank shown waits for.
    pub views: Vec<DRankPushView>,
    /// Per path with a fitted model, the predicted transfer (the prefill ranks post).
    pub predictions: Vec<(PostPath, RequestPrediction)>,
    pub rates: PostRates,
}

/// Decode's READs on a hybrid pair (vLLM's handshake passed), and what posting them costs.
#[derive(Debug)]
pub struct HybridPull {
    pub name: String,
    pub vllm_version: &'static str,
    pub planner: HybridPlanner,
    /// Every decode rank's READs (the views show `d_rank`'s only, where one is given).
    pub plan: HybridPlan,
    pub d_rank: Option<u32>,
    /// Per transport, the busiest decode rank's cost (every rank counted).
    pub costs: Vec<PathCost>,
    pub rates: PostRates,
    /// Per path with a fitted model, the predicted transfer.
    pub predictions: Vec<(PostPath, RequestPrediction)>,
}

/// Prefill's WRITEs on a hybrid pair: taken from the pull plan of the decode ranks each
/// prefill rank writes into (`layouts::hybrid::write_plan`).
#[derive(Debug)]
pub struct HybridPushed {
    pub name: String,
    pub vllm_version: &'static str,
    pub planner: HybridPlanner,
    pub plan: HybridPlan,
    /// Per prefill rank, its WRITEs into the decode ranks shown.
    pub writes: Vec<(u32, Vec<HybridWrite>)>,
    /// Per decode rank shown: the prefill ranks that write into it, and the notifications it
    /// counts.
    pub waits: Vec<(u32, Vec<u32>, u32)>,
    /// The notification every WRITE carries.
    pub notif: String,
    /// Per path with a fitted model, the predicted transfer (the prefill ranks post).
    pub predictions: Vec<(PostPath, RequestPrediction)>,
    pub rates: PostRates,
}

/// Plans the request.
pub fn plan(request: PlanRequest) -> Result<Planned, PlanError> {
    let d_rank = request.d_rank;
    Ok(match request.case {
        PlanCase::UniformPull { request, rates } => {
            let plans = pull_plans(&request, d_rank)?;
            let costs = posting_costs(&plans, &rates);
            let predictions = predict(&pull_shapes(&plans), request.pair.d.tp, &rates);
            Planned::UniformPull(UniformPull { request, plans, costs, rates, predictions })
        }
        PlanCase::UniformPush { request, rates } => {
            let (plans, views) = push_plans(&request, d_rank)?;
            let shapes: Vec<(u32, Vec<ReadShape>)> = plans
                .iter()
                .map(|(plan, co)| {
                    let writes = plan
                        .writes
                        .iter()
                        .enumerate()
                        .map(|(i, w)| ReadShape {
                            descriptors: w.pairs.len() as u64,
                            coalesced: co.get(i).map_or(0, Vec::len) as u64,
                            bytes: w.pairs.iter().map(|p| p.len).sum(),
                        })
                        .collect();
                    (plan.p_rank, writes)
                })
                .collect();
            let predictions = predict(&shapes, request.pair.p.tp, &rates);
            Planned::UniformPush(UniformPush { request, plans, views, predictions, rates })
        }
        PlanCase::HybridPull { request, rates } => {
            let (planner, plan) = hybrid_plan(&request, d_rank, false)?;
            let costs = hybrid_posting_costs(&plan, &rates);
            let predictions = predict(&hybrid_shapes(&plan), planner.config.d.tp, &rates);
            Planned::HybridPull(HybridPull {
                name: request.name,
                vllm_version: request.vllm_version,
                planner,
                plan,
                d_rank,
                costs,
                rates,
                predictions,
            })
        }
        PlanCase::HybridPush { request, rates } => {
            let (planner, plan) = hybrid_plan(&request, d_rank, true)?;
            let shown = |d: u32| d_rank.is_none_or(|r| r == d);
            let (p_tp, d_tp) = (planner.config.p.tp, planner.config.d.tp);
            // Prefill names the request by decode's id and its own TP size (as kvx's push does).
            let notif = format!("req-D:{p_tp}");
            let writes: Vec<(u32, Vec<HybridWrite>)> = (0..p_tp)
                .map(|p| {
                    let ws = hybrid_push::writes(&planner, &plan, p);
                    (p, ws.into_iter().filter(|w| shown(w.d_rank)).collect())
                })
                .collect();
            let shapes: Vec<(u32, Vec<ReadShape>)> = writes
                .iter()
                .map(|(p, ws): &(u32, Vec<HybridWrite>)| {
                    let shapes = ws
                        .iter()
                        .map(|w| ReadShape {
                            descriptors: w.pairs.len() as u64,
                            coalesced: w.pairs.len() as u64,
                            bytes: w.bytes(),
                        })
                        .collect();
                    (*p, shapes)
                })
                .collect();
            let predictions = predict(&shapes, p_tp, &rates);
            let waits = (0..d_tp)
                .filter(|&d| shown(d))
                .map(|d| (d, hybrid_push::writers(p_tp, d_tp, d), hybrid_push::expected_notifs(p_tp, d_tp)))
                .collect();
            Planned::HybridPush(HybridPushed {
                name: request.name,
                vllm_version: request.vllm_version,
                planner,
                plan,
                writes,
                waits,
                notif,
                predictions,
                rates,
            })
        }
    })
}

/// Every decode rank's READs (only `d_rank`'s when given), with their coalesced pairs.
fn pull_plans(r: &UniformRequest, d_rank: Option<u32>) -> Result<Vec<RankPlan>, ConfigError> {
    let map = r.pair.validate()?;
    let ranks: Vec<u32> = match d_rank {
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

/// Per path with a fitted model, the predicted transfer of posting ranks `ranks` (their
/// READs or WRITEs), `readers` of them posting at once on the host: UCX posts every
/// descriptor as its own call, cuda-batch the coalesced ones of each peer in one call.
fn predict(
    ranks: &[(u32, Vec<ReadShape>)],
    readers: u32,
    rates: &PostRates,
) -> Vec<(PostPath, RequestPrediction)> {
    PostPath::ALL
        .iter()
        .filter_map(|&path| {
            let model = rates.of(path).model.as_ref()?;
            let loads: Vec<RankLoad> = ranks
                .iter()
                .map(|(rank, shapes)| {
                    let bytes = shapes.iter().map(|r| r.bytes).sum();
                    let (descriptors, calls) = if path == PostPath::CudaBatch {
                        (
                            shapes.iter().map(|r| r.coalesced).sum(),
                            shapes.iter().filter(|r| r.coalesced > 0).count() as u64,
                        )
                    } else {
                        let n = shapes.iter().map(|r| r.descriptors).sum();
                        (n, n)
                    };
                    RankLoad { rank: *rank, descriptors, calls, bytes }
                })
                .collect();
            Some((path, model.predict_request(&loads, readers)))
        })
        .collect()
}

/// Each transport's cost for this request (its busiest decode rank).
fn posting_costs(plans: &[RankPlan], rates: &PostRates) -> Vec<PathCost> {
    request_costs(&pull_shapes(plans), rates)
}

/// Each decode rank's READs as the cost models see them.
fn pull_shapes(plans: &[RankPlan]) -> Vec<(u32, Vec<ReadShape>)> {
    plans
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
        .collect()
}

/// Every prefill rank's WRITEs (only those into `d_rank` when given), and what the decode
/// ranks shown wait for.
fn push_plans(
    r: &UniformRequest,
    d_rank: Option<u32>,
) -> Result<(Vec<PushRankPlan>, Vec<DRankPushView>), ConfigError> {
    let map = r.pair.validate_push()?;
    let keep = |d: u32| d_rank.is_none_or(|want| want == d);
    let mut plans = Vec::with_capacity(map.p_ranks.len());
    for p in 0..r.pair.p.tp {
        let planner = PushPlanner::new(&r.pair, &map, p)?;
        let mut plan = planner.plan(&r.blocks, &r.ids)?;
        let bp = planner.pair_blocks(&r.blocks)?;
        let mut coalesced = if plan.writes.is_empty() { vec![] } else { planner.coalesced(&bp) };
        if d_rank.is_some() && !plan.writes.is_empty() {
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

/// vLLM's handshake of a hybrid pair (or its refusal), then the request's READs for every
/// decode rank; in push mode, the pair must take push first.
fn hybrid_plan(
    r: &HybridPlanRequest,
    d_rank: Option<u32>,
    push: bool,
) -> Result<(HybridPlanner, HybridPlan), PlanError> {
    let planner = HybridPlanner::new(&r.pair)?;
    if let Some(d) = d_rank.filter(|&d| d >= planner.config.d.tp) {
        return Err(PlanError::NoDecodeRank { d_rank: d, d_tp: planner.config.d.tp });
    }
    if push {
        hybrid_push::check_push(&planner)?;
    }
    let plan = planner.plan(&r.source.for_planner(&planner), &r.p_request_id)?;
    Ok((planner, plan))
}

/// A hybrid plan's posting cost: every descriptor a decode rank posts, state rows included
/// (vLLM merges none of them, so each counts as its own copy).
fn hybrid_posting_costs(plan: &HybridPlan, rates: &PostRates) -> Vec<PathCost> {
    request_costs(&hybrid_shapes(plan), rates)
}

/// Each decode rank's READs of a hybrid plan as the cost models see them.
fn hybrid_shapes(plan: &HybridPlan) -> Vec<(u32, Vec<ReadShape>)> {
    plan.d_ranks
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
        .collect()
}
