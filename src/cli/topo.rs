//! `kvx topo`: the rank map of a P/D pair, as a table or as JSON with the oracle's field names.
//! `--mode push` shows the push-mode map instead: which prefill rank WRITEs which bytes into
//! which decode rank's blocks, and how many notifications each decode rank waits for.

use std::ops::Range;

use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::common::{Format, ModelFlags, PairFlags, PortFlags};
use crate::error::ConfigError;
use crate::layouts::compat::PairSpec;
use crate::layouts::plan::Planner;
use crate::layouts::push::PushPlanner;
use crate::settings::scenario::{self, Ports};
use crate::topology::ports::engine_ports;
use crate::topology::push::PushRankMap;
use crate::topology::{RankMap, TransferMode};
use crate::{Outcome, output};

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
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// One read in the oracle's vocabulary.
#[derive(Debug, Serialize)]
pub struct ReadJson {
    pub p_rank: u32,
    pub remote_offset_in_block: u64,
    pub local_offset_in_block: u64,
    pub length: u64,
    pub p_local_head_slice: [u32; 2],
    pub d_local_head_slice: [u32; 2],
    pub global_heads: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct ExtraNotifJson {
    pub p_rank: u32,
    /// vLLM 0.19.1 keys these by the decode request id, which P does not recognise.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub uses_decode_request_id: bool,
}

#[derive(Debug, Serialize)]
pub struct DRankJson {
    pub d_rank: u32,
    pub heads: Vec<u32>,
    pub handshake_ranks: Vec<u32>,
    pub read_ranks: Vec<u32>,
    pub rank_offset_factor: u32,
    pub expected_consumers_in_notif: u32,
    pub p_waits_for_notifs: u32,
    pub reads: Vec<ReadJson>,
    pub extra_notifs: Vec<ExtraNotifJson>,
    pub side_channel_ports: Vec<u16>,
}

#[derive(Debug, Serialize)]
pub struct PRankJson {
    pub p_rank: u32,
    pub heads: Vec<u32>,
    pub block_len_bytes: u64,
    pub readers: usize,
    pub side_channel_port: u16,
}

/// The whole `kvx topo --format json` object.
#[derive(Debug, Serialize)]
pub struct TopoJson {
    pub status: &'static str,
    pub vllm_version: &'static str,
    pub model: String,
    pub p_tp: u32,
    pub d_tp: u32,
    pub num_kv_heads: u32,
    pub use_mla: bool,
    pub tp_ratio: i64,
    pub p_layout: String,
    pub d_layout: String,
    pub p_block_size: u32,
    pub d_block_size: u32,
    pub p_heads_per_rank: u32,
    pub d_heads_per_rank: u32,
    /// Bytes of one block of one region (one layer for layer-wise regions).
    pub p_block_len_bytes: u64,
    pub d_block_len_bytes: u64,
    /// Bytes of one block over all layers.
    pub p_block_bytes_all_layers: u64,
    pub d_block_bytes_all_layers: u64,
    pub fan_in: usize,
    pub port_scheme: String,
    pub p_ranks: Vec<PRankJson>,
    pub d_ranks: Vec<DRankJson>,
}

fn slice(r: &Range<u32>) -> [u32; 2] {
    [r.start, r.end]
}

/// Builds the report of a validated pair.
pub fn build(pair: &PairSpec, map: &RankMap, ports: &Ports) -> Result<TopoJson, ConfigError> {
    let p_ports = engine_ports(ports.scheme, ports.base, ports.p_dp, pair.p.tp)?;
    let d_ports = engine_ports(ports.scheme, ports.base, ports.d_dp, pair.d.tp)?;
    let (pg, dg) = (pair.p_geometry(0), pair.d_geometry(0));
    let (pr, dr) = (pg.regions(), dg.regions());
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
        vllm_version: pair.version.as_str(),
        model: pair.model.name.clone(),
        p_tp: pair.p.tp,
        d_tp: pair.d.tp,
        num_kv_heads: pair.model.num_kv_heads,
        use_mla: pair.model.is_mla(),
        tp_ratio: map.tp_ratio,
        p_layout: pair.p.layout.to_string(),
        d_layout: pair.d.layout.to_string(),
        p_block_size: pair.p.block_tokens,
        d_block_size: pair.d.block_tokens,
        p_heads_per_rank: map.p_heads_per_rank,
        d_heads_per_rank: map.d_heads_per_rank,
        p_block_len_bytes: pr.first().map_or(0, |x| x.block_len),
        d_block_len_bytes: dr.first().map_or(0, |x| x.block_len),
        p_block_bytes_all_layers: pg.block_bytes_all_layers(),
        d_block_bytes_all_layers: dg.block_bytes_all_layers(),
        fan_in: map.fan_in(),
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

/// One push WRITE in the vocabulary of the pull report (local = prefill, remote = decode).
#[derive(Debug, Serialize)]
pub struct WriteJson {
    pub d_rank: u32,
    pub slot: u32,
    /// Byte offset inside one prefill block where the written bytes start.
    pub local_offset_in_block: u64,
    /// Byte offset inside one decode block where they land.
    pub remote_offset_in_block: u64,
    pub length: u64,
    pub p_local_head_slice: [u32; 2],
    pub d_local_head_slice: [u32; 2],
    pub global_heads: Vec<u32>,
    /// The prefill rank that already writes these bytes to this place, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicate_of: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct PushPRankJson {
    pub p_rank: u32,
    pub heads: Vec<u32>,
    /// Decode ranks this prefill rank handshakes with (it fetches their block addresses).
    pub handshake_ranks: Vec<u32>,
    pub write_ranks: Vec<u32>,
    pub rank_offset_factor: u32,
    /// The `n` of `"<decode request id>:<n>"` on every WRITE (the prefill TP size).
    pub notif_count: u32,
    pub writes: Vec<WriteJson>,
    pub side_channel_port: u16,
}

#[derive(Debug, Serialize)]
pub struct PushDRankJson {
    pub d_rank: u32,
    pub heads: Vec<u32>,
    /// Prefill ranks this decode rank sends its `PUSH_REG` block registration to.
    pub registers_with: Vec<u32>,
    /// Prefill ranks whose WRITEs land in this decode rank.
    pub writers: Vec<u32>,
    /// Notifications this decode rank counts before the request's KV is complete.
    pub expected_notifs: u32,
    pub side_channel_ports: Vec<u16>,
}

/// The whole `kvx topo --mode push --format json` object.
#[derive(Debug, Serialize)]
pub struct PushTopoJson {
    pub status: &'static str,
    pub mode: &'static str,
    pub vllm_version: &'static str,
    pub model: String,
    pub p_tp: u32,
    pub d_tp: u32,
    pub num_kv_heads: u32,
    pub use_mla: bool,
    /// vLLM's `tp_ratio` from the prefill side (the local side in push).
    pub tp_ratio: i64,
    pub p_layout: String,
    pub d_layout: String,
    pub p_block_size: u32,
    pub d_block_size: u32,
    pub p_heads_per_rank: u32,
    pub d_heads_per_rank: u32,
    pub p_block_len_bytes: u64,
    pub d_block_len_bytes: u64,
    pub p_block_bytes_all_layers: u64,
    pub d_block_bytes_all_layers: u64,
    /// Prefill ranks writing into one decode rank, at most.
    pub fan_in: usize,
    /// WRITEs that repeat bytes another prefill rank writes to the same place.
    pub duplicate_writes: usize,
    pub port_scheme: String,
    pub p_ranks: Vec<PushPRankJson>,
    pub d_ranks: Vec<PushDRankJson>,
}

/// Builds the push report of a pair validated by `validate_push`.
pub fn build_push(pair: &PairSpec, map: &PushRankMap, ports: &Ports) -> Result<PushTopoJson, ConfigError> {
    let p_ports = engine_ports(ports.scheme, ports.base, ports.p_dp, pair.p.tp)?;
    let d_ports = engine_ports(ports.scheme, ports.base, ports.d_dp, pair.d.tp)?;
    let (pg, dg) = (pair.p_geometry(0), pair.d_geometry(0));
    let (pr, dr) = (pg.regions(), dg.regions());
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
        vllm_version: pair.version.as_str(),
        model: pair.model.name.clone(),
        p_tp: pair.p.tp,
        d_tp: pair.d.tp,
        num_kv_heads: pair.model.num_kv_heads,
        use_mla: pair.model.is_mla(),
        tp_ratio: map.tp_ratio,
        p_layout: pair.p.layout.to_string(),
        d_layout: pair.d.layout.to_string(),
        p_block_size: pair.p.block_tokens,
        d_block_size: pair.d.block_tokens,
        p_heads_per_rank: map.p_heads_per_rank,
        d_heads_per_rank: map.d_heads_per_rank,
        p_block_len_bytes: pr.first().map_or(0, |x| x.block_len),
        d_block_len_bytes: dr.first().map_or(0, |x| x.block_len),
        p_block_bytes_all_layers: pg.block_bytes_all_layers(),
        d_block_bytes_all_layers: dg.block_bytes_all_layers(),
        fan_in: map.fan_in(),
        duplicate_writes: map.duplicate_writes(),
        port_scheme: ports.scheme.to_string(),
        p_ranks,
        d_ranks,
    })
}

/// The table view of a push map.
pub fn render_push_table(t: &PushTopoJson) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "kvx topo --mode push: P tp {} -> D tp {}  |  {}  |  {} KV heads{}  |  vLLM {} rules (NixlPushConnector)\n",
        t.p_tp,
        t.d_tp,
        t.model,
        t.num_kv_heads,
        if t.use_mla { " (MLA: one latent head)" } else { "" },
        t.vllm_version
    ));
    out.push_str(&format!(
        "layouts P {} / D {}  |  block {} / {} tokens  |  heads per rank P {} / D {}  |  fan-in {} prefill writers per D rank\n",
        t.p_layout, t.d_layout, t.p_block_size, t.d_block_size, t.p_heads_per_rank, t.d_heads_per_rank, t.fan_in
    ));
    out.push_str(&format!(
        "bytes per block per rank: P {} per region block, {} over all layers; D {} / {}\n",
        bytes_text(t.p_block_len_bytes),
        bytes_text(t.p_block_bytes_all_layers),
        bytes_text(t.d_block_len_bytes),
        bytes_text(t.d_block_bytes_all_layers)
    ));
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "P rank",
        "heads",
        "handshake (D ranks)",
        "WRITEs (D rank: bytes of the P block -> D block offset)",
        "notif",
    ]);
    for p in &t.p_ranks {
        let writes: Vec<String> = p
            .writes
            .iter()
            .map(|w| {
                format!(
                    "D{}: [{}, {}) heads {} -> @{}{}",
                    w.d_rank,
                    w.local_offset_in_block,
                    w.local_offset_in_block + w.length,
                    heads_text(&w.global_heads),
                    w.remote_offset_in_block,
                    w.duplicate_of.map(|o| format!(" (same bytes as P{o})")).unwrap_or_default()
                )
            })
            .collect();
        table.add_row(vec![
            p.p_rank.to_string(),
            heads_text(&p.heads),
            ranks_text(&p.handshake_ranks),
            writes.join("\n"),
            format!("<D id>:{}", p.notif_count),
        ]);
    }
    out.push_str(&table.to_string());
    out.push('\n');
    let mut dt = Table::new();
    dt.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    dt.set_header(vec!["D rank", "heads", "PUSH_REG to (P ranks)", "written by", "waits for notifs"]);
    for d in &t.d_ranks {
        dt.add_row(vec![
            d.d_rank.to_string(),
            heads_text(&d.heads),
            ranks_text(&d.registers_with),
            ranks_text(&d.writers),
            d.expected_notifs.to_string(),
        ]);
    }
    out.push_str(&dt.to_string());
    out.push('\n');
    if t.duplicate_writes > 0 {
        out.push_str(&format!(
            "note: {} WRITEs repeat bytes another prefill rank writes to the same place (replicated heads or MLA); \
             vLLM posts them all and decode counts each notification\n",
            t.duplicate_writes
        ));
    }
    // Distinct ports only: under the engine scheme every rank of an engine shares one.
    let distinct = |ports: Vec<u16>| {
        let mut ports = ports;
        ports.sort_unstable();
        ports.dedup();
        ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
    };
    out.push_str(&format!(
        "ports ({} scheme): decode ranks handshake with prefill's side channel on {} (notification-only, to send \
         PUSH_REG); prefill ranks handshake with decode's on {} (to learn its block addresses)\n",
        t.port_scheme,
        distinct(t.p_ranks.iter().map(|p| p.side_channel_port).collect()),
        distinct(t.d_ranks.iter().flat_map(|d| d.side_channel_ports.iter().copied()).collect())
    ));
    out
}

fn heads_text(h: &[u32]) -> String {
    match (h.first(), h.last()) {
        (Some(a), Some(b)) if a == b => format!("{a}"),
        (Some(a), Some(b)) => format!("{a}-{b}"),
        _ => "-".into(),
    }
}

fn ranks_text(r: &[u32]) -> String {
    if r.is_empty() {
        return "-".into();
    }
    r.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Human units: 8192 -> "8 KiB".
pub fn bytes_text(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v.fract()).abs() < 1e-9 { format!("{v:.0} {}", UNITS[u]) } else { format!("{v:.1} {}", UNITS[u]) }
}

/// The table view.
pub fn render_table(t: &TopoJson) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "kvx topo: P tp {} -> D tp {}  |  {}  |  {} KV heads{}  |  vLLM {} rules\n",
        t.p_tp,
        t.d_tp,
        t.model,
        t.num_kv_heads,
        if t.use_mla { " (MLA: one latent head)" } else { "" },
        t.vllm_version
    ));
    out.push_str(&format!(
        "layouts P {} / D {}  |  block {} / {} tokens  |  heads per rank P {} / D {}  |  fan-in {} P ranks per D rank\n",
        t.p_layout, t.d_layout, t.p_block_size, t.d_block_size, t.p_heads_per_rank, t.d_heads_per_rank, t.fan_in
    ));
    out.push_str(&format!(
        "bytes per block per rank: P {} per region block, {} over all layers; D {} / {}\n",
        bytes_text(t.p_block_len_bytes),
        bytes_text(t.p_block_bytes_all_layers),
        bytes_text(t.d_block_len_bytes),
        bytes_text(t.d_block_bytes_all_layers)
    ));
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    table.set_header(vec![
        "D rank",
        "heads",
        "handshake",
        "reads (P rank: bytes of a P block -> D offset)",
        "notif",
        "notif-only",
    ]);
    for d in &t.d_ranks {
        let reads: Vec<String> = d
            .reads
            .iter()
            .map(|r| {
                format!(
                    "P{}: [{}, {}) heads {} -> @{}",
                    r.p_rank,
                    r.remote_offset_in_block,
                    r.remote_offset_in_block + r.length,
                    heads_text(&r.global_heads),
                    r.local_offset_in_block
                )
            })
            .collect();
        let extra: Vec<u32> = d.extra_notifs.iter().map(|e| e.p_rank).collect();
        table.add_row(vec![
            d.d_rank.to_string(),
            heads_text(&d.heads),
            ranks_text(&d.handshake_ranks),
            reads.join("\n"),
            format!("<id>:{}", d.expected_consumers_in_notif),
            ranks_text(&extra),
        ]);
    }
    out.push_str(&table.to_string());
    out.push('\n');
    let mut ports = Table::new();
    ports.load_style(UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    ports.set_header(vec![
        "P rank",
        "heads",
        "block bytes",
        "D readers (fan-out)",
        "side-channel port (dp 0)",
    ]);
    for p in &t.p_ranks {
        ports.add_row(vec![
            p.p_rank.to_string(),
            heads_text(&p.heads),
            bytes_text(p.block_len_bytes),
            p.readers.to_string(),
            p.side_channel_port.to_string(),
        ]);
    }
    out.push_str(&ports.to_string());
    out.push_str(&format!("\nports: {} scheme; D ranks listen on ", t.port_scheme));
    let d_ports: Vec<String> = t
        .d_ranks
        .iter()
        .map(|d| {
            format!(
                "D{}={}",
                d.d_rank,
                ranks_text(&d.side_channel_ports.iter().map(|&p| u32::from(p)).collect::<Vec<_>>())
            )
        })
        .collect();
    out.push_str(&d_ports.join(" "));
    out.push('\n');
    out
}
