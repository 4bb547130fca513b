//! `kvx topo`: the rank map of a P/D pair, as a table or as JSON with the oracle's field names.
//! `--mode push` shows the push-mode map instead: which prefill rank WRITEs which bytes into
//! which decode rank's blocks, and how many notifications each decode rank waits for. The
//! report's shape and its table views are `report::topo`'s; this file builds and prints it.

use std::ops::Range;

use clap::Args;

use super::common::{Format, ModelFlags, PairFlags, PortFlags};
use crate::error::ConfigError;
use crate::error::Outcome;
use crate::layouts::compat::PairSpec;
use crate::layouts::plan::Planner;
use crate::layouts::push::PushPlanner;
use crate::output;
use crate::report::topo::{
    DRankJson, ExtraNotifJson, PRankJson, PairJson, PushDRankJson, PushPRankJson, PushTopoJson, ReadJson,
    TopoJson, WriteJson, render_push_table, render_table,
};
use crate::settings::scenario::{self, Ports};
use crate::topology::ports::engine_ports;
use crate::topology::push::PushRankMap;
use crate::topology::{RankMap, TransferMode};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx topo --p-tp 8 --d-tp 2 --model llama-3.1-70b\n  \
    kvx topo --p-tp 2 --d-tp 8 --num-kv-heads 4 --format json\n  \
    kvx topo --p-tp 4 --d-tp 1 --model deepseek-v3 --vllm 0.19\n  \
    kvx topo --mode push --p-tp 2 --d-tp 4 --model llama-3.1-70b")]
pub struct TopoArgs {
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    pub pair: PairFlags,
    #[command(flatten)]
    pub ports: PortFlags,
    /// Transfer mode: pull (decode READs, vLLM NixlConnector) or push (prefill WRITEs into
    /// decode's blocks, vLLM NixlPushConnector).
    #[arg(long, value_enum, default_value_t = TransferMode::Pull)]
    pub mode: TransferMode,
    /// Hybrid models in push mode, decode TP above prefill TP and above the KV heads: which
    /// decode ranks prefill writes attention into: vllm (the first of each head only, as vLLM
    /// 0.33's push connector reads) or every-rank (each its head, as pull reads them)
    /// [default: vllm].
    #[arg(long, value_enum)]
    pub push_attention: Option<crate::layouts::hybrid::push::PushAttention>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

fn slice(r: &Range<u32>) -> [u32; 2] {
    [r.start, r.end]
}

/// Builds the report of a validated pair.
pub fn build(pair: &PairSpec, map: &RankMap, ports: &Ports) -> Result<TopoJson, ConfigError> {
    let p_ports = engine_ports(ports.scheme, ports.base, ports.p_dp, pair.p.tp)?;
    let d_ports = engine_ports(ports.scheme, ports.base, ports.d_dp, pair.d.tp)?;
    let pr = pair.p_geometry(0).regions();
    let fan_out = map.fan_out();
    let mut d_ranks = Vec::with_capacity(map.d_ranks.len());
    for d in &map.d_ranks {
        let planner = Planner::new(pair, map, d.d_rank)?;
        let reads = d
            .reads
            .iter()
            .zip(&planner.reads)
            .map(|(hr, g)| ReadJson {
                p_rank: hr.p_rank,
                remote_offset_in_block: g.remote_offset_in_block,
                local_offset_in_block: g.local_offset_in_block,
                length: g.length,
                p_local_head_slice: slice(&hr.p_heads),
                d_local_head_slice: slice(&hr.d_heads),
                global_heads: hr.global_heads.clone().collect(),
            })
            .collect();
        d_ranks.push(DRankJson {
            d_rank: d.d_rank,
            heads: d.d_heads.clone().collect(),
            handshake_ranks: d.handshake_ranks.clone(),
            read_ranks: d.read_ranks.clone(),
            rank_offset_factor: d.rank_offset_factor,
            expected_consumers_in_notif: d.notif_count,
            p_waits_for_notifs: d.p_waits_for,
            reads,
            extra_notifs: d
                .extra_notifs
                .iter()
                .map(|&p| ExtraNotifJson {
                    p_rank: p,
                    uses_decode_request_id: d.extra_notif_uses_d_request_id,
                })
                .collect(),
            side_channel_ports: d_ports.iter().filter_map(|dp| dp.get(d.d_rank as usize).copied()).collect(),
        });
    }
    let p_ranks = (0..pair.p.tp)
        .map(|r| PRankJson {
            p_rank: r,
            heads: pair.p_geometry(r).global_heads.collect(),
            block_len_bytes: pr.first().map_or(0, |x| x.block_len),
            readers: fan_out.get(r as usize).copied().unwrap_or(0),
            side_channel_port: p_ports.first().and_then(|p| p.get(r as usize)).copied().unwrap_or(0),
        })
        .collect();
    Ok(TopoJson {
        status: "ok",
        pair: PairJson::new(pair, map.tp_ratio, [map.p_heads_per_rank, map.d_heads_per_rank], map.fan_in()),
        port_scheme: ports.scheme.to_string(),
        p_ranks,
        d_ranks,
    })
}

/// Prints a rejection in the requested format; the caller turns it into exit code 2.
pub fn reject(format: Format, err: ConfigError) -> anyhow::Error {
    if format == Format::Json {
        let body = serde_json::json!({"status": "rejected", "error": err.to_string(), "flag": err.flag});
        // The rejection is the error either way; a closed stdout changes nothing.
        let _ = output::stdout_line(body);
    }
    err.into()
}

pub fn run(args: &TopoArgs) -> anyhow::Result<Outcome> {
    let hybrid = crate::settings::hybrid_flags::hybrid_preset_of(&args.model, args.pair.vllm, &[])
        .map_err(|e| reject(args.format, e))?;
    if args.push_attention.is_some() && (hybrid.is_none() || args.mode != TransferMode::Push) {
        let why = "applies to hybrid models in push mode (which decode ranks prefill writes attention into): add \
                   --mode push with a hybrid --model, or drop it";
        return Err(reject(args.format, ConfigError::new("--push-attention", why)));
    }
    if let Some(model) = hybrid {
        return run_hybrid(args, model);
    }
    if args.mode == TransferMode::Push {
        return run_push(args);
    }
    let result = (|| {
        let pair = scenario::resolve_pair(&args.model, &args.pair, 1, 1)?;
        let ports = scenario::resolve_ports(&args.ports)?;
        let map = pair.validate()?;
        build(&pair, &map, &ports)
    })();
    let report = result.map_err(|e| reject(args.format, e))?;
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render_table(&report))?,
    }
    Ok(Outcome::Ok)
}

/// `kvx topo` of a hybrid preset: vLLM 0.33's handshake (or its refusal) and each decode
/// rank's sources per KV cache group.
fn run_hybrid(args: &TopoArgs, model: crate::layouts::hybrid::HybridModel) -> anyhow::Result<Outcome> {
    use crate::layouts::hybrid::geometry::GroupKind;
    use crate::report::topo::{HybridDRankJson, HybridGroupJson, HybridTopoJson, render_hybrid_table};
    let result = (|| {
        // The rank map does not depend on the pool: a small one serves.
        let (p, d) = crate::settings::hybrid_flags::hybrid_engines(&args.pair, 64, None, None)?;
        let config = crate::layouts::hybrid::HybridPairSpec {
            model,
            p,
            d,
            permute_local_kv: args.pair.permute,
            state_slices: Default::default(),
            host_copy: Default::default(),
            push_attention: args.push_attention.unwrap_or_default(),
            stated: Default::default(),
        };
        let planner = crate::layouts::hybrid::HybridPlanner::new(&config).map_err(ConfigError::from)?;
        let push = (args.mode == TransferMode::Push)
            .then(|| {
                crate::layouts::hybrid::push::check_push(&planner)?;
                Ok::<_, ConfigError>(hybrid_push_map(&planner))
            })
            .transpose()?;
        let groups = planner
            .d
            .groups
            .iter()
            .map(|g| HybridGroupJson {
                group: g.index,
                kind: match g.kind {
                    GroupKind::Full => "full".to_string(),
                    GroupKind::SlidingWindow { window_tokens } => format!("sliding_window({window_tokens})"),
                    GroupKind::State(k) => k.name().to_string(),
                },
                layers: g.layers.len(),
            })
            .collect();
        let d_ranks = planner
            .d_ranks
            .iter()
            .map(|r| HybridDRankJson {
                d_rank: r.d_rank,
                handshake_ranks: r.handshake_ranks.to_vec(),
                read_ranks: r.mapping.all_source_ranks.clone(),
                source_ranks_per_group: r.mapping.source_ranks_per_group.clone(),
                rank_offset_factor: r.mapping.rank_offset_factor,
                expected_consumers_in_notif: r.mapping.local_consumers,
            })
            .collect();
        Ok::<_, ConfigError>(HybridTopoJson {
            status: "ok",
            model: config.model.name.clone(),
            p_tp: config.p.tp,
            d_tp: config.d.tp,
            tp_ratio: planner.tp_ratio,
            block_size: [planner.p.sizing.block_tokens, planner.d.sizing.block_tokens],
            groups,
            d_ranks,
            push,
        })
    })();
    let report = result.map_err(|e| reject(args.format, e))?;
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render_hybrid_table(&report))?,
    }
    Ok(Outcome::Ok)
}

/// Who writes what in push mode for a hybrid pair `check_push` accepted: each prefill rank's
/// decode ranks and the groups it writes into each, and what each decode rank waits for.
fn hybrid_push_map(planner: &crate::layouts::hybrid::HybridPlanner) -> crate::report::topo::HybridPushJson {
    use crate::layouts::hybrid::push;
    use crate::report::topo::{
        HybridPushDRankJson, HybridPushJson, HybridPushPRankJson, HybridPushWriteJson,
    };
    let config = &planner.config;
    let (p_tp, d_tp) = (config.p.tp, config.d.tp);
    let p_ranks = (0..p_tp)
        .map(|p| HybridPushPRankJson {
            p_rank: p,
            writes: push::write_ranks(p_tp, d_tp, p)
                .into_iter()
                .map(|d| HybridPushWriteJson { d_rank: d, groups: push::write_groups(planner, p, d) })
                .collect(),
        })
        .collect();
    let d_ranks = planner
        .d_ranks
        .iter()
        .map(|r| HybridPushDRankJson {
            d_rank: r.d_rank,
            registers_with: r.handshake_ranks.to_vec(),
            written_by: push::writers(p_tp, d_tp, r.d_rank),
            expected_notifs: push::expected_notifs(p_tp, d_tp),
            attention_skipped: push::attention_skipped(config, r.d_rank),
        })
        .collect();
    HybridPushJson { push_attention: config.push_attention, p_ranks, d_ranks }
}

fn run_push(args: &TopoArgs) -> anyhow::Result<Outcome> {
    let result = (|| {
        let pair = scenario::resolve_pair(&args.model, &args.pair, 1, 1)?;
        let ports = scenario::resolve_ports(&args.ports)?;
        let map = pair.validate_push()?;
        build_push(&pair, &map, &ports)
    })();
    let report = result.map_err(|e| reject(args.format, e))?;
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render_push_table(&report))?,
    }
    Ok(Outcome::Ok)
}

/// Builds the push report of a pair validated by `validate_push`.
pub fn build_push(pair: &PairSpec, map: &PushRankMap, ports: &Ports) -> Result<PushTopoJson, ConfigError> {
    let p_ports = engine_ports(ports.scheme, ports.base, ports.p_dp, pair.p.tp)?;
    let d_ports = engine_ports(ports.scheme, ports.base, ports.d_dp, pair.d.tp)?;
    let mut p_ranks = Vec::with_capacity(map.p_ranks.len());
    for pm in &map.p_ranks {
        let planner = PushPlanner::new(pair, map, pm.p_rank)?;
        let writes = pm
            .writes
            .iter()
            .zip(&planner.writes)
            .map(|(hw, g)| WriteJson {
                d_rank: hw.d_rank,
                slot: hw.slot,
                local_offset_in_block: g.local_offset_in_block,
                remote_offset_in_block: g.remote_offset_in_block,
                length: g.length,
                p_local_head_slice: slice(&hw.p_heads),
                d_local_head_slice: slice(&hw.d_heads),
                global_heads: hw.global_heads.clone().collect(),
                duplicate_of: hw.duplicate_of,
            })
            .collect();
        p_ranks.push(PushPRankJson {
            p_rank: pm.p_rank,
            heads: pm.p_heads.clone().collect(),
            handshake_ranks: pm.handshake_ranks.clone(),
            write_ranks: pm.write_ranks.clone(),
            rank_offset_factor: pm.rank_offset_factor,
            notif_count: pm.notif_count,
            writes,
            side_channel_port: p_ports.first().and_then(|p| p.get(pm.p_rank as usize)).copied().unwrap_or(0),
        });
    }
    let d_ranks = map
        .d_ranks
        .iter()
        .map(|d| PushDRankJson {
            d_rank: d.d_rank,
            heads: d.d_heads.clone().collect(),
            registers_with: d.registers_with.clone(),
            writers: d.writers.clone(),
            expected_notifs: d.expected_notifs,
            side_channel_ports: d_ports.iter().filter_map(|dp| dp.get(d.d_rank as usize).copied()).collect(),
        })
        .collect();
    Ok(PushTopoJson {
        status: "ok",
        mode: TransferMode::Push.as_str(),
        pair: PairJson::new(pair, map.tp_ratio, [map.p_heads_per_rank, map.d_heads_per_rank], map.fan_in()),
        duplicate_writes: map.duplicate_writes(),
        port_scheme: ports.scheme.to_string(),
        p_ranks,
        d_ranks,
    })
}
