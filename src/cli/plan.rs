//! `kvx plan`: the descriptor pairs each decode rank posts for one request, and what posting
//! them costs on each transport (`layouts::posting`: is the request post-bound?); with
//! `--mode push`, the WRITEs each prefill rank posts into the decode ranks' blocks.

use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::common::Format;
use super::topo::reject;
use crate::error::ConfigError;
use crate::error::Outcome;
use crate::layouts::plan::{DRankPlan, Pair, Planner};
use crate::layouts::posting::{PathCost, PostRates, ReadShape, request_costs};
use crate::layouts::push::{PRankPlan, PushPlanner};
use crate::output;
use crate::report::numbers::bytes_text;
use crate::settings::plan::{DescriptorPlan, PlanFlags, resolve_descriptor_plan};
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

/// Plans every requested decode rank.
/// A decode rank's plan with its coalesced pairs per READ.
type RankPlan = (DRankPlan, Vec<Vec<Pair>>);

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
            let mut text = render(args, &resolved, &plans);
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

/// `850 ns`, `12.3 us`, `4.56 ms`, `1.23 s`.
fn time_text(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

/// A rate as it reads: three significant digits, no trailing zeros.
fn num_text(v: f64) -> String {
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

fn render_posting(costs: &[PathCost], rates: &PostRates) -> String {
    let mut out = String::from(
        "\nposting cost per request (the busiest decode rank; each posts its own reads in parallel):\n",
    );
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "transport",
        "memory",
        "D rank",
        "descriptors",
        "calls",
        "ns/desc",
        "post",
        "bytes at ceiling",
        "post-bound",
        "GB/s at most",
    ]);
    for c in costs {
        let rate = rates.of(c.transport);
        table.add_row(vec![
            c.transport.key().to_string(),
            c.memory.to_string(),
            c.d_rank.to_string(),
            c.descriptors.to_string(),
            c.calls.to_string(),
            num_text(rate.ns_per_descriptor),
            time_text(c.post_ns),
            format!("{} ({} GB/s)", time_text(c.copy_ns), num_text(rate.ceiling_gbps)),
            if c.post_bound { "yes".into() } else { "no".into() },
            format!("{:.2}", c.bound_gbps),
        ]);
    }
    out.push_str(&table.to_string());
    out.push('\n');
    for c in costs {
        let r = rates.of(c.transport);
        let call = if r.ns_per_call > 0.0 {
            format!(" + {} ns/call", num_text(r.ns_per_call))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{}: {} ns/desc{call} (from {}); ceiling {} GB/s (from {})\n",
            c.transport.key(),
            num_text(r.ns_per_descriptor),
            r.post_source.text(),
            num_text(r.ceiling_gbps),
            r.ceiling_source.text()
        ));
    }
    out
}

fn render(args: &PlanFlags, r: &DescriptorPlan, plans: &[RankPlan]) -> String {
    let mut out = format!(
        "kvx plan: P tp {} -> D tp {}  |  {}  |  layouts {} / {}  |  vLLM {} rules\n\
         request: {} prefill blocks, {} decode blocks to fill{}\n",
        r.pair.p.tp,
        r.pair.d.tp,
        r.pair.model.name,
        r.pair.p.layout,
        r.pair.d.layout,
        r.pair.version,
        r.blocks.remote.len(),
        r.blocks.local.len(),
        if r.blocks.local.is_empty() { " (full prefix hit: notifications only)" } else { "" }
    );
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "D rank",
        "P rank",
        "descriptors",
        "coalesced",
        "bytes",
        "notif",
        "first pairs (local, remote, len)",
    ]);
    let (mut total_raw, mut total_co, mut total_bytes) = (0usize, 0usize, 0u64);
    for (plan, co) in plans {
        for (i, read) in plan.reads.iter().enumerate() {
            let n_co = co.get(i).map_or(0, Vec::len);
            let bytes: u64 = read.pairs.iter().map(|p| p.len).sum();
            total_raw += read.pairs.len();
            total_co += n_co;
            total_bytes += bytes;
            let first: Vec<String> = read
                .pairs
                .iter()
                .take(args.show_pairs)
                .map(|p| format!("({}, {}, {})", p.local, p.remote, p.len))
                .collect();
            let more = read.pairs.len().saturating_sub(args.show_pairs);
            table.add_row(vec![
                plan.d_rank.to_string(),
                read.p_rank.to_string(),
                read.pairs.len().to_string(),
                n_co.to_string(),
                bytes_text(bytes),
                read.notif_msg.clone(),
                if more > 0 { format!("{} ... +{more}", first.join(" ")) } else { first.join(" ") },
            ]);
        }
        for n in &plan.notifs_only {
            table.add_row(vec![
                plan.d_rank.to_string(),
                n.p_rank.to_string(),
                "0".into(),
                "0".into(),
                "-".into(),
                format!("{} (notification only)", n.msg),
                String::new(),
            ]);
        }
    }
    out.push_str(&table.to_string());
    out.push_str(&format!(
        "\ntotal: {total_raw} descriptors ({total_co} coalesced, {:.1}x fewer), {}\n",
        if total_co > 0 { total_raw as f64 / total_co as f64 } else { 1.0 },
        bytes_text(total_bytes)
    ));
    out
}

/// A prefill rank's push plan with its coalesced pairs per WRITE.
type PushRankPlan = (PRankPlan, Vec<Vec<Pair>>);

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
        Format::Table => output::stdout(render_push(args, resolved, &plans, &views))?,
    }
    Ok(Outcome::Ok)
}

fn render_push(
    args: &PlanFlags,
    r: &DescriptorPlan,
    plans: &[PushRankPlan],
    views: &[DRankPushView],
) -> String {
    let mut out = format!(
        "kvx plan --mode push: P tp {} -> D tp {}  |  {}  |  layouts {} / {}  |  vLLM {} rules (NixlPushConnector)\n\
         request: {} prefill blocks, {} decode blocks registered{}\n",
        r.pair.p.tp,
        r.pair.d.tp,
        r.pair.model.name,
        r.pair.p.layout,
        r.pair.d.layout,
        r.pair.version,
        r.blocks.remote.len(),
        r.blocks.local.len(),
        if r.blocks.local.is_empty() {
            " (full prefix hit: decode registers nothing, prefill writes nothing and frees on lease expiry)"
        } else {
            ""
        }
    );
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "P rank",
        "D rank",
        "descriptors",
        "coalesced",
        "bytes",
        "notif",
        "first pairs (local = P, remote = D, len)",
    ]);
    let (mut total_raw, mut total_co, mut total_bytes) = (0usize, 0usize, 0u64);
    for (plan, co) in plans {
        for (i, w) in plan.writes.iter().enumerate() {
            let n_co = co.get(i).map_or(0, Vec::len);
            let bytes: u64 = w.pairs.iter().map(|p| p.len).sum();
            total_raw += w.pairs.len();
            total_co += n_co;
            total_bytes += bytes;
            let first: Vec<String> = w
                .pairs
                .iter()
                .take(args.show_pairs)
                .map(|p| format!("({}, {}, {})", p.local, p.remote, p.len))
                .collect();
            let more = w.pairs.len().saturating_sub(args.show_pairs);
            table.add_row(vec![
                plan.p_rank.to_string(),
                w.d_rank.to_string(),
                w.pairs.len().to_string(),
                n_co.to_string(),
                bytes_text(bytes),
                match w.duplicate_of {
                    Some(o) => format!("{} (same bytes as P{o})", w.notif_msg),
                    None => w.notif_msg.clone(),
                },
                if more > 0 { format!("{} ... +{more}", first.join(" ")) } else { first.join(" ") },
            ]);
        }
    }
    out.push_str(&table.to_string());
    out.push_str(&format!(
        "\ntotal: {total_raw} descriptors ({total_co} coalesced, {:.1}x fewer), {}\n",
        if total_co > 0 { total_raw as f64 / total_co as f64 } else { 1.0 },
        bytes_text(total_bytes)
    ));
    let waits: Vec<String> = views
        .iter()
        .map(|d| {
            let writers: Vec<String> = d.writers.iter().map(|p| format!("P{p}")).collect();
            format!("D{} <- {} ({} notifications)", d.d_rank, writers.join(","), d.expected_notifs)
        })
        .collect();
    out.push_str(&format!("decode waits: {}\n", waits.join("; ")));
    out
}
