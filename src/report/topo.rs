//! `kvx topo`'s report: the rank map of a P/D pair in the oracle's field names ([`TopoJson`];
//! [`PushTopoJson`] for `--mode push`: which prefill rank WRITEs which bytes into which decode
//! rank's blocks; [`HybridTopoJson`] for a hybrid pair), and their table views ([`render`]).
//! Pure: `layouts::rank_maps` maps the pair, this builds the report from the map, `cli::topo`
//! prints what [`render`] returns; `--format json` is these types as they serialize.

use std::ops::Range;

use serde::Serialize;

use super::export::pretty_json as pretty;
use super::numbers::bytes_text;
use super::table::wrapped_table;
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::geometry::GroupKind;
use crate::layouts::rank_maps::{EnginePorts, HybridMap, HybridPushMap, PullMap, PushMap, TopoMap};
use crate::topology::TransferMode;

/// How `kvx topo` shows a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopoView {
    /// Pretty JSON.
    Json,
    /// The table view.
    Table,
}

/// The map as `view` asks, ready to print.
pub fn render(map: &TopoMap, view: TopoView) -> serde_json::Result<String> {
    Ok(match (map, view) {
        (TopoMap::UniformPull(m), TopoView::Json) => pretty(&TopoJson::new(m))?,
        (TopoMap::UniformPull(m), TopoView::Table) => render_table(&TopoJson::new(m)),
        (TopoMap::UniformPush(m), TopoView::Json) => pretty(&PushTopoJson::new(m))?,
        (TopoMap::UniformPush(m), TopoView::Table) => render_push_table(&PushTopoJson::new(m)),
        (TopoMap::Hybrid(m), TopoView::Json) => pretty(&HybridTopoJson::new(m))?,
        (TopoMap::Hybrid(m), TopoView::Table) => render_hybrid_table(&HybridTopoJson::new(m)),
    })
}

fn slice(r: &Range<u32>) -> [u32; 2] {
    [r.start, r.end]
}

/// A rank's side-channel port in every engine (data-parallel rank) of its side.
fn every_engine_port(ports: &EnginePorts, rank: u32) -> Vec<u16> {
    ports.iter().filter_map(|engine| engine.get(rank as usize).copied()).collect()
}

/// A rank's side-channel port in the first engine of its side (0 if it has none).
fn first_engine_port(ports: &EnginePorts, rank: u32) -> u16 {
    ports.first().and_then(|engine| engine.get(rank as usize)).copied().unwrap_or(0)
}

/// What both maps say about the pair, flattened into [`TopoJson`] and [`PushTopoJson`].
#[derive(Debug, Serialize)]
pub struct PairJson {
    pub vllm_version: &'static str,
    pub model: String,
    pub p_tp: u32,
    pub d_tp: u32,
    pub num_kv_heads: u32,
    pub use_mla: bool,
    /// vLLM's `tp_ratio`, from the side that posts the transfers (decode in pull, prefill in
    /// push: the local side).
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
    /// Prefill ranks per decode rank, at most (those it reads from in pull, those writing into
    /// it in push).
    pub fan_in: usize,
}

impl PairJson {
    /// The pair's part of a map: its shape from `pair`, the rest from the rank map.
    pub fn new(pair: &PairSpec, tp_ratio: i64, heads_per_rank: [u32; 2], fan_in: usize) -> PairJson {
        let (pg, dg) = (pair.p_geometry(0), pair.d_geometry(0));
        let (pr, dr) = (pg.regions(), dg.regions());
        PairJson {
            vllm_version: pair.version.as_str(),
            model: pair.model.name.clone(),
            p_tp: pair.p.tp,
            d_tp: pair.d.tp,
            num_kv_heads: pair.model.num_kv_heads,
            use_mla: pair.model.is_mla(),
            tp_ratio,
            p_layout: pair.p.layout.to_string(),
            d_layout: pair.d.layout.to_string(),
            p_block_size: pair.p.block_tokens,
            d_block_size: pair.d.block_tokens,
            p_heads_per_rank: heads_per_rank[0],
            d_heads_per_rank: heads_per_rank[1],
            p_block_len_bytes: pr.first().map_or(0, |x| x.block_len),
            d_block_len_bytes: dr.first().map_or(0, |x| x.block_len),
            p_block_bytes_all_layers: pg.block_bytes_all_layers(),
            d_block_bytes_all_layers: dg.block_bytes_all_layers(),
            fan_in,
        }
    }
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
    #[serde(flatten)]
    pub pair: PairJson,
    pub port_scheme: String,
    pub p_ranks: Vec<PRankJson>,
    pub d_ranks: Vec<DRankJson>,
}

impl TopoJson {
    /// The report of a uniform pair's pull map.
    pub fn new(m: &PullMap) -> TopoJson {
        let (pair, map) = (&m.pair, &m.map);
        let pr = pair.p_geometry(0).regions();
        let fan_out = map.fan_out();
        let d_ranks = map
            .d_ranks
            .iter()
            .zip(&m.reads)
            .map(|(d, geoms)| DRankJson {
                d_rank: d.d_rank,
                heads: d.d_heads.clone().collect(),
                handshake_ranks: d.handshake_ranks.clone(),
                read_ranks: d.read_ranks.clone(),
                rank_offset_factor: d.rank_offset_factor,
                expected_consumers_in_notif: d.notif_count,
                p_waits_for_notifs: d.p_waits_for,
                reads: d
                    .reads
                    .iter()
                    .zip(geoms)
                    .map(|(hr, g)| ReadJson {
                        p_rank: hr.p_rank,
                        remote_offset_in_block: g.remote_offset_in_block,
                        local_offset_in_block: g.local_offset_in_block,
                        length: g.length,
                        p_local_head_slice: slice(&hr.p_heads),
                        d_local_head_slice: slice(&hr.d_heads),
                        global_heads: hr.global_heads.clone().collect(),
                    })
                    .collect(),
                extra_notifs: d
                    .extra_notifs
                    .iter()
                    .map(|&p| ExtraNotifJson {
                        p_rank: p,
                        uses_decode_request_id: d.extra_notif_uses_d_request_id,
                    })
                    .collect(),
                side_channel_ports: every_engine_port(&m.d_ports, d.d_rank),
            })
            .collect();
        let p_ranks = (0..pair.p.tp)
            .map(|r| PRankJson {
                p_rank: r,
                heads: pair.p_geometry(r).global_heads.collect(),
                block_len_bytes: pr.first().map_or(0, |x| x.block_len),
                readers: fan_out.get(r as usize).copied().unwrap_or(0),
                side_channel_port: first_engine_port(&m.p_ports, r),
            })
            .collect();
        TopoJson {
            status: "ok",
            pair: PairJson::new(
                pair,
                map.tp_ratio,
                [map.p_heads_per_rank, map.d_heads_per_rank],
                map.fan_in(),
            ),
            port_scheme: m.scheme.to_string(),
            p_ranks,
            d_ranks,
        }
    }
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
    #[serde(flatten)]
    pub pair: PairJson,
    /// WRITEs that repeat bytes another prefill rank writes to the same place.
    pub duplicate_writes: usize,
    pub port_scheme: String,
    pub p_ranks: Vec<PushPRankJson>,
    pub d_ranks: Vec<PushDRankJson>,
}

impl PushTopoJson {
    /// The report of a uniform pair's push map.
    pub fn new(m: &PushMap) -> PushTopoJson {
        let (pair, map) = (&m.pair, &m.map);
        let p_ranks = map
            .p_ranks
            .iter()
            .zip(&m.writes)
            .map(|(pm, geoms)| PushPRankJson {
                p_rank: pm.p_rank,
                heads: pm.p_heads.clone().collect(),
                handshake_ranks: pm.handshake_ranks.clone(),
                write_ranks: pm.write_ranks.clone(),
                rank_offset_factor: pm.rank_offset_factor,
                notif_count: pm.notif_count,
                writes: pm
                    .writes
                    .iter()
                    .zip(geoms)
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
                    .collect(),
                side_channel_port: first_engine_port(&m.p_ports, pm.p_rank),
            })
            .collect();
        let d_ranks = map
            .d_ranks
            .iter()
            .map(|d| PushDRankJson {
                d_rank: d.d_rank,
                heads: d.d_heads.clone().collect(),
                registers_with: d.registers_with.clone(),
                writers: d.writers.clone(),
                expected_notifs: d.expected_notifs,
                side_channel_ports: every_engine_port(&m.d_ports, d.d_rank),
            })
            .collect();
        PushTopoJson {
            status: "ok",
            mode: TransferMode::Push.as_str(),
            pair: PairJson::new(
                pair,
                map.tp_ratio,
                [map.p_heads_per_rank, map.d_heads_per_rank],
                map.fan_in(),
            ),
            duplicate_writes: map.duplicate_writes(),
            port_scheme: m.scheme.to_string(),
            p_ranks,
            d_ranks,
        }
    }
}

/// The three lines both maps open with: the pair and its rules, layouts, heads and fan-in
/// (`fan_in` names what it counts), bytes per block.
fn heading(p: &PairJson, command: &str, rules: &str, fan_in: &str) -> String {
    format!(
        "{command}: P tp {} -> D tp {}  |  {}  |  {} KV heads{}  |  vLLM {} rules{rules}\n\
         layouts P {} / D {}  |  block {} / {} tokens  |  heads per rank P {} / D {}  |  fan-in {} {fan_in}\n\
         bytes per block per rank: P {} per region block, {} over all layers; D {} / {}\n",
        p.p_tp,
        p.d_tp,
        p.model,
        p.num_kv_heads,
        if p.use_mla { " (MLA: one latent head)" } else { "" },
        p.vllm_version,
        p.p_layout,
        p.d_layout,
        p.p_block_size,
        p.d_block_size,
        p.p_heads_per_rank,
        p.d_heads_per_rank,
        p.fan_in,
        bytes_text(p.p_block_len_bytes),
        bytes_text(p.p_block_bytes_all_layers),
        bytes_text(p.d_block_len_bytes),
        bytes_text(p.d_block_bytes_all_layers)
    )
}

/// The table view.
pub fn render_table(t: &TopoJson) -> String {
    let mut out = heading(&t.pair, "kvx topo", "", "P ranks per D rank");
    let mut table = wrapped_table(vec![
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
                copy_text(
                    &format!("P{}", r.p_rank),
                    r.remote_offset_in_block,
                    r.length,
                    &r.global_heads,
                    r.local_offset_in_block,
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
    let mut ports = wrapped_table(vec![
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

/// The table view of a push map.
pub fn render_push_table(t: &PushTopoJson) -> String {
    let mut out =
        heading(&t.pair, "kvx topo --mode push", " (NixlPushConnector)", "prefill writers per D rank");
    let mut table = wrapped_table(vec![
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
                let copy = copy_text(
                    &format!("D{}", w.d_rank),
                    w.local_offset_in_block,
                    w.length,
                    &w.global_heads,
                    w.remote_offset_in_block,
                );
                match w.duplicate_of {
                    Some(o) => format!("{copy} (same bytes as P{o})"),
                    None => copy,
                }
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
    let mut dt =
        wrapped_table(vec!["D rank", "heads", "PUSH_REG to (P ranks)", "written by", "waits for notifs"]);
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

/// One READ or WRITE in a table cell: the peer, the bytes of the prefill block it moves
/// (`[start, end)`), their heads, and where in the decode block they land.
fn copy_text(peer: &str, p_offset: u64, length: u64, heads: &[u32], d_offset: u64) -> String {
    format!("{peer}: [{p_offset}, {}) heads {} -> @{d_offset}", p_offset + length, heads_text(heads))
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

/// `kvx topo` of a hybrid model: per decode rank and KV cache group, the prefill ranks it
/// reads (attention deduplicated by head, state from every prefill rank of its slice), as
/// vLLM 0.33's `TPMapping` gives them.
#[derive(Debug, Serialize)]
pub struct HybridTopoJson {
    pub status: &'static str,
    pub model: String,
    pub p_tp: u32,
    pub d_tp: u32,
    /// vLLM's signed ratio from the decode side: `D/P` when D >= P, else `-(P/D)`.
    pub tp_ratio: i64,
    /// Tokens per block after vLLM's hybrid alignment, per side.
    pub block_size: [u32; 2],
    pub groups: Vec<HybridGroupJson>,
    pub d_ranks: Vec<HybridDRankJson>,
    /// `--mode push`: who writes what (absent in pull mode).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<HybridPushJson>,
}

impl HybridTopoJson {
    /// The report of a hybrid pair's map.
    pub fn new(m: &HybridMap) -> HybridTopoJson {
        let (planner, config) = (&m.planner, &m.planner.config);
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
        HybridTopoJson {
            status: "ok",
            model: config.model.name.clone(),
            p_tp: config.p.tp,
            d_tp: config.d.tp,
            tp_ratio: planner.tp_ratio,
            block_size: [planner.p.sizing.block_tokens, planner.d.sizing.block_tokens],
            groups,
            d_ranks,
            push: m.push.as_ref().map(|p| HybridPushJson::new(config.push_attention, p)),
        }
    }
}

impl HybridPushJson {
    fn new(
        push_attention: crate::layouts::hybrid::write_plan::PushAttention,
        m: &HybridPushMap,
    ) -> HybridPushJson {
        HybridPushJson {
            push_attention,
            p_ranks: m
                .p_ranks
                .iter()
                .map(|(p, writes)| HybridPushPRankJson {
                    p_rank: *p,
                    writes: writes
                        .iter()
                        .map(|(d, groups)| HybridPushWriteJson { d_rank: *d, groups: groups.clone() })
                        .collect(),
                })
                .collect(),
            d_ranks: m
                .d_ranks
                .iter()
                .map(|w| HybridPushDRankJson {
                    d_rank: w.d_rank,
                    registers_with: w.registers_with.clone(),
                    written_by: w.written_by.clone(),
                    expected_notifs: w.expected_notifs,
                    attention_skipped: w.attention_skipped,
                })
                .collect(),
        }
    }
}

/// A hybrid pair in push mode (vLLM 0.33's `NixlPushConnector`).
#[derive(Debug, Serialize)]
pub struct HybridPushJson {
    /// Which decode ranks prefill writes attention into (`--push-attention`).
    pub push_attention: crate::layouts::hybrid::write_plan::PushAttention,
    pub p_ranks: Vec<HybridPushPRankJson>,
    pub d_ranks: Vec<HybridPushDRankJson>,
}

#[derive(Debug, Serialize)]
pub struct HybridPushPRankJson {
    pub p_rank: u32,
    /// The decode ranks it writes into (vLLM's `write_ranks`), each with the groups written.
    pub writes: Vec<HybridPushWriteJson>,
}

#[derive(Debug, Serialize)]
pub struct HybridPushWriteJson {
    pub d_rank: u32,
    /// KV cache groups written (empty: a notification only).
    pub groups: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct HybridPushDRankJson {
    pub d_rank: u32,
    /// The prefill ranks its registration (`PUSH_REG`) goes to: vLLM's handshake set.
    pub registers_with: Vec<u32>,
    pub written_by: Vec<u32>,
    /// Notifications it counts per request (one per WRITE into it).
    pub expected_notifs: u32,
    /// vLLM's rule leaves its attention out (`--push-attention vllm`).
    pub attention_skipped: bool,
}

#[derive(Debug, Serialize)]
pub struct HybridGroupJson {
    pub group: u32,
    /// `full`, `sliding_window(N)`, or the state kind (`mamba2`, `gdn`, ...).
    pub kind: String,
    pub layers: usize,
}

#[derive(Debug, Serialize)]
pub struct HybridDRankJson {
    pub d_rank: u32,
    pub handshake_ranks: Vec<u32>,
    /// Every prefill rank read (one READ each).
    pub read_ranks: Vec<u32>,
    /// Prefill ranks read, per group (index = group).
    pub source_ranks_per_group: Vec<Vec<u32>>,
    /// Which head slice of a prefill block this rank reads when D > P.
    pub rank_offset_factor: u32,
    /// Notifications each prefill rank waits for.
    pub expected_consumers_in_notif: u32,
}

/// The table view of a hybrid pair's rank map.
pub fn render_hybrid_table(t: &HybridTopoJson) -> String {
    let mut out = format!(
        "kvx topo{}: {} P{} -> D{} (tp_ratio {}), aligned block size P {} / D {} tokens\n",
        if t.push.is_some() { " --mode push" } else { "" },
        t.model,
        t.p_tp,
        t.d_tp,
        t.tp_ratio,
        t.block_size[0],
        t.block_size[1]
    );
    if let Some(push) = &t.push {
        // Push: the groups once, then who writes them (the READs of pull do not happen).
        let mut groups = wrapped_table(vec!["group", "kind", "layers"]);
        for g in &t.groups {
            groups.add_row(vec![g.group.to_string(), g.kind.clone(), g.layers.to_string()]);
        }
        out.push_str(&groups.to_string());
        out.push('\n');
        out.push_str(&render_hybrid_push(t, push));
        return out;
    }
    let mut table =
        wrapped_table(vec!["D rank", "group", "kind", "layers", "reads P ranks", "handshake", "notif"]);
    for d in &t.d_ranks {
        for g in &t.groups {
            let sources =
                d.source_ranks_per_group.get(g.group as usize).map(Vec::as_slice).unwrap_or_default();
            table.add_row(vec![
                d.d_rank.to_string(),
                g.group.to_string(),
                g.kind.clone(),
                g.layers.to_string(),
                ranks_text(sources),
                ranks_text(&d.handshake_ranks),
                format!("<id>:{}", d.expected_consumers_in_notif),
            ]);
        }
    }
    out.push_str(&table.to_string());
    out.push('\n');
    out
}

/// The push half of a hybrid topology: who writes which groups into whom, and what each decode
/// rank waits for.
fn render_hybrid_push(t: &HybridTopoJson, push: &HybridPushJson) -> String {
    let group_kinds = |groups: &[u32]| -> String {
        if groups.is_empty() {
            return "notification only".into();
        }
        let names: Vec<String> = groups
            .iter()
            .map(|g| match t.groups.iter().find(|x| x.group == *g) {
                Some(x) => format!("{g} ({})", x.kind),
                None => g.to_string(),
            })
            .collect();
        names.join(", ")
    };
    let rule = match push.push_attention {
        crate::layouts::hybrid::write_plan::PushAttention::Vllm => {
            "the first decode rank of each head only, where decode TP is above prefill TP and the KV heads \
             (vLLM 0.33, as read; --push-attention every-rank: every rank)"
        }
        crate::layouts::hybrid::write_plan::PushAttention::EveryRank => {
            "every decode rank (--push-attention every-rank)"
        }
    };
    let mut out = format!(
        "push (NixlPushConnector): prefill WRITEs into the blocks decode registers; attention into {rule}\n"
    );
    let mut writes = wrapped_table(vec!["P rank", "writes D rank", "groups written"]);
    for p in &push.p_ranks {
        for w in &p.writes {
            writes.add_row(vec![p.p_rank.to_string(), w.d_rank.to_string(), group_kinds(&w.groups)]);
        }
    }
    out.push_str(&writes.to_string());
    out.push('\n');
    let mut waits =
        wrapped_table(vec!["D rank", "PUSH_REG to (P ranks)", "written by", "waits for notifs", "attention"]);
    for d in &push.d_ranks {
        waits.add_row(vec![
            d.d_rank.to_string(),
            ranks_text(&d.registers_with),
            ranks_text(&d.written_by),
            d.expected_notifs.to_string(),
            if d.attention_skipped { "none (vLLM's rule)".into() } else { "written".into() },
        ]);
    }
    out.push_str(&waits.to_string());
    out.push('\n');
    out
}
