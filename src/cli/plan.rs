//! `kvx plan`: the descriptor pairs each decode rank posts for one request, and what posting
//! them costs on each transport (`layouts::posting`: is the request post-bound?); with
//! `--mode push`, the WRITEs each prefill rank posts into the decode ranks' blocks. The table
//! views are `report::plan`'s; this file plans the request and prints it.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use super::common::{Format, ModelArgs, PairArgs};
use super::topo::reject;
use crate::error::ConfigError;
use crate::layouts::alloc::{AllocPattern, allocate};
use crate::layouts::compat::PairSpec;
use crate::layouts::plan::{Planner, RequestBlocks, RequestIds};
use crate::layouts::posting::{PathCost, PostRates, ReadShape, request_costs};
use crate::layouts::push::PushPlanner;
use crate::pipeline::workload::MAX_PROMPT;
use crate::report::plan::{PushRankPlan, RankPlan, render_posting, render_pull, render_push};
use crate::settings::scenario::{self, PlanScenario};
use crate::topology::TransferMode;
use crate::topology::push::DRankPushView;
use crate::{Outcome, output};

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
    pub model: ModelArgs,
    #[command(flatten)]
    pub pair: PairArgs,
    /// Read the model and request from a JSON scenario ({"vllm_version", "model", "request"},
    /// the objects of a case in vLLM oracle descriptors.json).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["local_blocks", "prompt_len"])]
    pub scenario: Option<PathBuf>,
    /// Decode block ids of the request (comma-separated).
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        requires = "remote_blocks",
        help_heading = "Request"
    )]
    pub local_blocks: Option<Vec<u32>>,
    /// Prefill block ids of the request (comma-separated).
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        requires = "local_blocks",
        help_heading = "Request"
    )]
    pub remote_blocks: Option<Vec<u32>>,
    /// Prompt length in tokens (blocks are then allocated with --alloc).
    #[arg(long, value_name = "TOKENS", help_heading = "Request")]
    pub prompt_len: Option<u32>,
    /// Allocation pattern for --prompt-len: contiguous, fragmented, random.
    #[arg(long, value_name = "PATTERN", default_value = "contiguous", help_heading = "Request")]
    pub alloc: String,
    /// Seed of the allocation pattern.
    #[arg(long, default_value_t = 0, help_heading = "Request")]
    pub seed: u64,
    /// Fraction of the prompt already cached on decode (only the rest is read).
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0, help_heading = "Request")]
    pub prefix_hit: f64,
    /// Prefill pool size in blocks (default: enough for the request, at least 2x).
    #[arg(long, value_name = "N", help_heading = "Request")]
    pub p_num_blocks: Option<u32>,
    /// Decode pool size in blocks (default: enough for the request, at least 2x).
    #[arg(long, value_name = "N", help_heading = "Request")]
    pub d_num_blocks: Option<u32>,
    /// The prefill request id used in notifications.
    #[arg(long, default_value = "req-P", help_heading = "Request")]
    pub p_request_id: String,
    /// Only this decode rank (default: all); in push mode, only the WRITEs into it.
    #[arg(long, value_name = "RANK")]
    pub d_rank: Option<u32>,
    /// Transfer mode: pull (decode READs) or push (prefill WRITEs into decode's blocks).
    #[arg(long, value_enum, default_value_t = TransferMode::Pull)]
    pub mode: TransferMode,
    /// Pairs to print per read in the table view.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub show_pairs: usize,
    /// A results file whose rates replace the built-in ones: a `kvx xfer --format json`
    /// report (UCX on host or device memory, or --transport cuda-batch) or the JSON that
    /// scripts/gpu-check.sh writes.
    #[arg(long, value_name = "FILE", help_heading = "Posting cost")]
    pub rates: Option<std::path::PathBuf>,
    /// Measured posting costs replacing the defaults, in ns per descriptor: ucx, cuda-ipc,
    /// cuda-batch, and cuda-batch-call (ns per batched call), e.g. ucx=76,cuda-batch=150.
    #[arg(long, value_name = "KEY=NS", value_delimiter = ',', help_heading = "Posting cost")]
    pub post_ns: Vec<String>,
    /// Bandwidth ceilings replacing the defaults, in GB/s: ucx, cuda-ipc, cuda-batch.
    #[arg(long, value_name = "KEY=GBPS", value_delimiter = ',', help_heading = "Posting cost")]
    pub ceiling_gbps: Vec<String>,
    /// Output format; json prints every uncoalesced pair.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
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

struct Resolved {
    pair: PairSpec,
    blocks: RequestBlocks,
    ids: RequestIds,
}

fn parse_alloc(s: &str) -> Result<AllocPattern, ConfigError> {
    s.parse().map_err(|e| ConfigError::new("--alloc", e))
}

fn resolve(args: &PlanArgs) -> Result<Resolved, ConfigError> {
    if let Some(path) = &args.scenario {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new("--scenario", format!("cannot read {}: {e}", path.display())))?;
        let sc = PlanScenario::parse(&text, &path.display().to_string())?;
        return Ok(Resolved { pair: sc.pair()?, blocks: sc.blocks()?, ids: sc.ids() });
    }
    if !(0.0..1.0).contains(&args.prefix_hit) || args.prefix_hit.is_nan() {
        return Err(ConfigError::new("--prefix-hit", format!("must be in [0, 1), got {}", args.prefix_hit)));
    }
    let ids = RequestIds { p_request_id: args.p_request_id.clone(), d_request_id: "req-D".into() };
    let p_bs = args.pair.p_block_size.unwrap_or(args.pair.block_size()).max(1);
    let d_bs = args.pair.d_block_size.unwrap_or(args.pair.block_size()).max(1);
    match (&args.local_blocks, &args.remote_blocks, args.prompt_len) {
        (Some(local), Some(remote), _) => {
            let p_pool = args.p_num_blocks.unwrap_or_else(|| remote.iter().max().map_or(1, |m| m + 1));
            let d_pool = args.d_num_blocks.unwrap_or_else(|| local.iter().max().map_or(1, |m| m + 1));
            let pair = scenario::resolve_pair(&args.model.flags(), &args.pair.flags(), p_pool, d_pool)?;
            Ok(Resolved { pair, blocks: RequestBlocks { local: local.clone(), remote: remote.clone() }, ids })
        }
        (_, _, Some(tokens)) => {
            if tokens == 0 || tokens > MAX_PROMPT {
                return Err(ConfigError::new(
                    "--prompt-len",
                    format!("a prompt is 1..={MAX_PROMPT} tokens, got {tokens}"),
                ));
            }
            let n_p = tokens.div_ceil(p_bs);
            let n_d = tokens.div_ceil(d_bs);
            let p_pool = args.p_num_blocks.unwrap_or(n_p.saturating_mul(2));
            let d_pool = args.d_num_blocks.unwrap_or(n_d.saturating_mul(2));
            let pair = scenario::resolve_pair(&args.model.flags(), &args.pair.flags(), p_pool, d_pool)?;
            let pattern = parse_alloc(&args.alloc)?;
            let remote = allocate(pattern, n_p, p_pool, args.seed, "--p-num-blocks")?;
            let hit = (f64::from(n_d) * args.prefix_hit).floor() as u32;
            let local = allocate(pattern, n_d - hit, d_pool, args.seed ^ 0x5eed, "--d-num-blocks")?;
            check_listable(&pair, args.mode, remote.len(), tokens)?;
            Ok(Resolved { pair, blocks: RequestBlocks { local, remote }, ids })
        }
        _ => Err(ConfigError::new(
            "--prompt-len",
            "give the request as --prompt-len TOKENS, as --local-blocks and --remote-blocks, or as --scenario FILE",
        )),
    }
}

/// Most descriptors `kvx plan` lists for one request (its JSON alone is about 30 bytes each).
const MAX_LISTED_DESCRIPTORS: u64 = 1 << 25;

/// Refuses a request whose plan is too large to list, before any of it is built (an upper
/// bound: every block of every region, read from every rank of the larger engine).
fn check_listable(
    pair: &PairSpec,
    mode: TransferMode,
    blocks: usize,
    tokens: u32,
) -> Result<(), ConfigError> {
    // Geometry needs a valid pair (a TP of 0 has none): its own errors come first.
    match mode {
        TransferMode::Pull => pair.validate().map(|_| ())?,
        TransferMode::Push => pair.validate_push().map(|_| ())?,
    }
    let regions = pair.p_geometry(0).regions().len().max(pair.d_geometry(0).regions().len()) as u64;
    let ranks = u64::from(pair.p.tp.max(pair.d.tp));
    let bound = (blocks as u64).saturating_mul(regions).saturating_mul(ranks);
    if bound > MAX_LISTED_DESCRIPTORS {
        return Err(ConfigError::new(
            "--prompt-len",
            format!(
                "a request of {tokens} tokens can take up to {bound} descriptors, more than the \
                 {MAX_LISTED_DESCRIPTORS} kvx plan lists; give a shorter prompt (descriptor counts grow \
                 linearly with it)"
            ),
        ));
    }
    Ok(())
}

/// Plans every requested decode rank.
fn plan_all(args: &PlanArgs, r: &Resolved) -> Result<Vec<RankPlan>, ConfigError> {
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
    let resolved = resolve(args).map_err(|e| reject(args.format, e))?;
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
            let mut text = render_pull(&resolved.pair, &resolved.blocks, &plans, args.show_pairs);
            text.push_str(&render_posting(&costs, &rates));
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
    args: &PlanArgs,
    r: &Resolved,
) -> Result<(Vec<PushRankPlan>, Vec<DRankPushView>), ConfigError> {
    let map = r.pair.validate_push()?;
    if let Some(d) = args.d_rank
        && d >= r.pair.d.tp
    {
        return Err(ConfigError::new(
            "--d-rank",
            format!("decode rank {d} does not exist (decode TP is {})", r.pair.d.tp),
        ));
    }
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

fn run_push(args: &PlanArgs, resolved: &Resolved) -> anyhow::Result<Outcome> {
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
        Format::Table => {
            output::stdout(render_push(&resolved.pair, &resolved.blocks, &plans, &views, args.show_pairs))?
        }
    }
    Ok(Outcome::Ok)
}
