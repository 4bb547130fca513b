//! `kvx plan`: the descriptor pairs each decode rank posts for one request.

use std::path::PathBuf;

use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::common::{Format, ModelArgs, PairArgs};
use super::topo::{bytes_text, reject};
use crate::error::ConfigError;
use crate::layouts::alloc::{AllocPattern, allocate};
use crate::layouts::compat::PairSpec;
use crate::layouts::plan::{DRankPlan, Pair, Planner, RequestBlocks, RequestIds};
use crate::settings::scenario::{self, PlanScenario};
use crate::{Outcome, output};

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  kvx plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --alloc random\n  \
    kvx plan --p-tp 1 --d-tp 2 --num-kv-heads 2 --layers 2 --head-dim 64 --local-blocks 1,3 --remote-blocks 0,2\n  \
    kvx plan --scenario case.json --format json"
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
    /// Only this decode rank (default: all).
    #[arg(long, value_name = "RANK")]
    pub d_rank: Option<u32>,
    /// Pairs to print per read in the table view.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub show_pairs: usize,
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
            if tokens == 0 {
                return Err(ConfigError::new("--prompt-len", "a prompt needs at least 1 token"));
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
            Ok(Resolved { pair, blocks: RequestBlocks { local, remote }, ids })
        }
        _ => Err(ConfigError::new(
            "--prompt-len",
            "give the request as --prompt-len TOKENS, as --local-blocks and --remote-blocks, or as --scenario FILE",
        )),
    }
}

/// Plans every requested decode rank.
/// A decode rank's plan with its coalesced pairs per READ.
type RankPlan = (DRankPlan, Vec<Vec<Pair>>);

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
    let plans = plan_all(args, &resolved).map_err(|e| reject(args.format, e))?;
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
            };
            output::stdout_line(serde_json::to_string(&out)?)?;
        }
        Format::Table => output::stdout(render(args, &resolved, &plans))?,
    }
    Ok(Outcome::Ok)
}

fn render(args: &PlanArgs, r: &Resolved, plans: &[RankPlan]) -> String {
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
