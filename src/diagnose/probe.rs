//! `kvx probe`: ask a side channel (a kvx engine or a live vLLM) what it advertises for
//! one rank, and describe it: decoded fields, opaque parts, and how the hash relates to
//! the factors when the peer says.
//!
//! Framing `auto` sends a 0.33 request first. A kvx or vLLM 0.33 peer answers with two
//! frames. vLLM 0.19 answers with one, having read the request's second element (our
//! pp_rank) as its tp_rank; kvx then re-asks in 0.19 framing for the right rank.
//!
//! Owns: probing and the probe report (pure rendering into table or JSON text). Must
//! not retry beyond the caller's timeout or interpret layouts.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use comfy_table::Table;
use serde::Serialize;

use crate::config::probe::{ProbeFraming, ProbeOptions};
use crate::transfer::handshake::meta::describe_bytes;
use crate::transfer::handshake::{
    AgentMetadata, FetchOptions, Framing, HandshakeClient, HandshakeError, KvxMetadata, Payload,
    VllmAgentMetadata,
};
use crate::transfer::nixl::blob::{self, AgentBlob};

/// What a side channel advertised for one rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeReport {
    pub endpoint: String,
    pub pp_rank: u32,
    pub tp_rank: u32,
    /// The framing the peer answered in.
    pub framing: Framing,
    /// Reply frames after the envelope (1: vLLM 0.19, 2: vLLM 0.33 or kvx).
    pub reply_frames: usize,
    /// The peer's clock frame (vLLM: `perf_counter`, kvx: Unix seconds).
    pub peer_clock_s: Option<f64>,
    /// Connect, request, reply and decode of the final exchange.
    pub latency_us: f64,
    pub compatibility_hash: Option<String>,
    pub advertised: Advertised,
}

/// The decoded `agent_metadata_bytes`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Advertised {
    Kvx {
        metadata: Box<KvxView>,
    },
    Vllm {
        metadata: Box<VllmAgentMetadata>,
        /// `agent_metadata` decoded as a NIXL agent blob; `None` when it is not one (then
        /// `opaque` says why).
        nixl_agent: Option<Box<AgentBlob>>,
        /// Parts kvx cannot decode.
        opaque: Vec<OpaquePart>,
    },
    Unknown {
        len: usize,
        reason: String,
    },
    /// The peer answered with an error payload instead of metadata.
    PeerError {
        message: String,
    },
}

/// kvx metadata as shown (opaque byte fields summarised).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvxView {
    pub engine_id: String,
    pub kvx_version: String,
    pub format_version: u32,
    pub tp_size: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub dp_rank: u32,
    pub layout: String,
    pub block_size_tokens: u32,
    pub notify_endpoint: Option<String>,
    pub worker_address: String,
    pub regions: Vec<RegionView>,
    pub factors: serde_json::Value,
    /// Whether the advertised factors hash to the advertised hash.
    pub factors_match_hash: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegionView {
    pub name: String,
    pub mem_type: String,
    pub device_id: u32,
    pub base_addr: u64,
    pub block_len_bytes: u64,
    pub block_stride_bytes: u64,
    pub num_blocks: u64,
    pub rkey: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpaquePart {
    pub field: String,
    pub bytes: usize,
    pub preview: String,
    pub note: String,
}

/// Probes `endpoint` once.
pub fn probe(endpoint: &str, opts: &ProbeOptions) -> Result<ProbeReport, HandshakeError> {
    let started = Instant::now();
    let client_for = |framing: Framing, budget: Duration| {
        HandshakeClient::new(FetchOptions {
            attempt_timeout: budget,
            deadline: budget,
            framing,
            ..FetchOptions::default()
        })
    };
    let first = match opts.framing {
        ProbeFraming::Fixed(f) => f,
        ProbeFraming::Auto => Framing::V0_33,
    };
    let mut t0 = Instant::now();
    let mut raw = client_for(first, opts.timeout).fetch_raw(endpoint, opts.pp_rank, opts.tp_rank)?;
    if opts.framing == ProbeFraming::Auto
        && raw.reply.framing == Framing::V0_19
        && opts.tp_rank != opts.pp_rank
    {
        // A 0.19 peer answered for tp_rank = our pp_rank: ask again in its framing.
        let left = opts.timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
        t0 = Instant::now();
        raw = client_for(Framing::V0_19, left).fetch_raw(endpoint, opts.pp_rank, opts.tp_rank)?;
    }
    let (compatibility_hash, advertised) = match &raw.reply.payload {
        Payload::Error(message) => (None, Advertised::PeerError { message: message.clone() }),
        Payload::Meta { compatibility_hash, agent_metadata_bytes } => {
            let advertised = match AgentMetadata::decode(agent_metadata_bytes) {
                Ok(AgentMetadata::Kvx(m)) => {
                    Advertised::Kvx { metadata: Box::new(kvx_view(&m, compatibility_hash)) }
                }
                Ok(AgentMetadata::Vllm(m)) => vllm_advertised(m),
                Ok(AgentMetadata::Unknown { len, reason }) => Advertised::Unknown { len, reason },
                Err(e) => Advertised::Unknown { len: agent_metadata_bytes.len(), reason: e.to_string() },
            };
            (Some(compatibility_hash.clone()), advertised)
        }
    };
    Ok(ProbeReport {
        endpoint: endpoint.to_owned(),
        pp_rank: opts.pp_rank,
        tp_rank: opts.tp_rank,
        framing: raw.reply.framing,
        reply_frames: match raw.reply.framing {
            Framing::V0_19 => 1,
            Framing::V0_33 => 2,
        },
        peer_clock_s: raw.reply.peer_clock_s,
        latency_us: t0.elapsed().as_secs_f64() * 1e6,
        compatibility_hash,
        advertised,
    })
}

/// vLLM metadata with its NIXL agent blob decoded, or summarised with the reason it did not
/// decode.
fn vllm_advertised(m: Box<VllmAgentMetadata>) -> Advertised {
    match blob::decode(&m.agent_metadata) {
        Ok(b) => Advertised::Vllm { metadata: m, nixl_agent: Some(Box::new(b)), opaque: Vec::new() },
        Err(e) => {
            let opaque = vec![OpaquePart {
                field: "agent_metadata".into(),
                bytes: m.agent_metadata.len(),
                preview: describe_bytes(&m.agent_metadata),
                note: format!("NIXL agent metadata that kvx could not decode: {e}"),
            }];
            Advertised::Vllm { metadata: m, nixl_agent: None, opaque }
        }
    }
}

fn kvx_view(m: &KvxMetadata, advertised_hash: &str) -> KvxView {
    let factors = m.factors().ok();
    KvxView {
        engine_id: m.engine_id.clone(),
        kvx_version: m.kvx_version.clone(),
        format_version: m.format_version,
        tp_size: m.tp_size,
        tp_rank: m.tp_rank,
        pp_rank: m.pp_rank,
        dp_rank: m.dp_rank,
        layout: m.layout.clone(),
        block_size_tokens: m.block_size_tokens,
        notify_endpoint: m.notify_endpoint.clone(),
        worker_address: describe_bytes(&m.worker_address),
        regions: m
            .regions
            .iter()
            .map(|r| RegionView {
                name: r.name.clone(),
                mem_type: r.mem_type.clone(),
                device_id: r.device_id,
                base_addr: r.base_addr,
                block_len_bytes: r.block_len_bytes,
                block_stride_bytes: r.block_stride_bytes,
                num_blocks: r.num_blocks,
                rkey: describe_bytes(&r.rkey),
            })
            .collect(),
        factors_match_hash: factors.as_ref().is_some_and(|f| f.hash_hex() == advertised_hash),
        factors: factors
            .map(|f| serde_json::Value::Object(f.iter().map(|(k, v)| (k.to_owned(), v.clone())).collect()))
            .unwrap_or(serde_json::Value::Null),
    }
}

/// The report as pretty JSON.
pub fn render_json(report: &ProbeReport) -> String {
    serde_json::to_string_pretty(report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

fn list<T: ToString>(v: &Option<Vec<T>>) -> String {
    v.as_ref().map_or_else(
        || "(absent)".to_owned(),
        |v| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
    )
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "(absent)".to_owned(), ToString::to_string)
}

/// The report as terminal tables.
pub fn render_table(report: &ProbeReport) -> String {
    let mut head = Table::new();
    head.set_header(["field", "value"]);
    head.add_row(["endpoint".to_owned(), report.endpoint.clone()]);
    head.add_row(["rank".to_owned(), format!("pp_rank {}, tp_rank {}", report.pp_rank, report.tp_rank)]);
    head.add_row(["framing".to_owned(), report.framing.to_string()]);
    head.add_row(["peer clock".to_owned(), opt(&report.peer_clock_s)]);
    head.add_row(["latency".to_owned(), format!("{:.0} µs", report.latency_us)]);
    head.add_row(["compatibility hash".to_owned(), opt(&report.compatibility_hash)]);
    let mut out = String::new();
    let mut regions: Option<Table> = None;
    let mut nixl_regions: Option<Table> = None;
    let mut notes: Vec<String> = Vec::new();
    match &report.advertised {
        Advertised::PeerError { message } => {
            head.add_row(["advertised".to_owned(), format!("error: {message}")]);
        }
        Advertised::Unknown { len, reason } => {
            head.add_row(["advertised".to_owned(), format!("{len} bytes of unknown metadata ({reason})")]);
        }
        Advertised::Kvx { metadata: m } => {
            head.add_row(["advertised".to_owned(), format!("kvx metadata format {}", m.format_version)]);
            head.add_row(["kvx version".to_owned(), m.kvx_version.clone()]);
            head.add_row(["engine id".to_owned(), m.engine_id.clone()]);
            head.add_row(["tp size / rank".to_owned(), format!("{} / {}", m.tp_size, m.tp_rank)]);
            head.add_row(["pp rank / dp rank".to_owned(), format!("{} / {}", m.pp_rank, m.dp_rank)]);
            head.add_row(["layout".to_owned(), m.layout.clone()]);
            head.add_row(["block size".to_owned(), format!("{} tokens", m.block_size_tokens)]);
            head.add_row(["notify endpoint".to_owned(), opt(&m.notify_endpoint)]);
            head.add_row(["worker address".to_owned(), m.worker_address.clone()]);
            head.add_row([
                "factors".to_owned(),
                format!(
                    "{} ({})",
                    m.factors,
                    if m.factors_match_hash {
                        "hash to the advertised hash"
                    } else {
                        "do NOT hash to the advertised hash"
                    }
                ),
            ]);
            let mut t = Table::new();
            t.set_header(["region", "mem", "base addr", "block len", "stride", "blocks", "rkey"]);
            for r in &m.regions {
                t.add_row([
                    r.name.clone(),
                    format!("{}:{}", r.mem_type, r.device_id),
                    format!("{:#x}", r.base_addr),
                    r.block_len_bytes.to_string(),
                    r.block_stride_bytes.to_string(),
                    r.num_blocks.to_string(),
                    r.rkey.clone(),
                ]);
            }
            regions = Some(t);
        }
        Advertised::Vllm { metadata: m, nixl_agent, opaque } => {
            head.add_row(["advertised".to_owned(), "vLLM NixlAgentMetadata".to_owned()]);
            head.add_row(["engine id".to_owned(), opt(&m.engine_id)]);
            head.add_row(["layout".to_owned(), opt(&m.kv_cache_layout)]);
            head.add_row([
                "block size".to_owned(),
                m.block_size.map_or("(absent)".into(), |b| format!("{b} tokens")),
            ]);
            head.add_row(["num blocks".to_owned(), opt(&m.num_blocks)]);
            head.add_row(["block lens".to_owned(), list(&m.block_lens)]);
            head.add_row(["block strides".to_owned(), list(&m.block_strides)]);
            head.add_row(["base addrs".to_owned(), list(&m.kv_caches_base_addr)]);
            head.add_row(["device id".to_owned(), opt(&m.device_id)]);
            head.add_row(["attention backend".to_owned(), opt(&m.attn_backend_name)]);
            head.add_row([
                "tp size".to_owned(),
                "not in the handshake (vLLM sends it in kv_transfer_params)".to_owned(),
            ]);
            for (k, v) in &m.other_fields {
                head.add_row([k.clone(), v.to_string()]);
            }
            if let Some(b) = nixl_agent {
                nixl_regions = nixl_rows(&mut head, &mut notes, b);
            }
            for (k, v) in &m.undecodable {
                notes.push(format!("field {k}: unexpected {v}, not decoded"));
            }
            for o in opaque {
                notes.push(format!("opaque: {} {} — {}", o.field, o.preview, o.note));
            }
            notes.push("factors: not advertised (vLLM sends only the hash)".to_owned());
            let n = m.kv_caches_base_addr.as_ref().map_or(0, Vec::len);
            if n > 0 {
                let mut t = Table::new();
                t.set_header(["#", "region", "mem", "base addr", "block len", "stride", "blocks"]);
                let at = |v: &Option<Vec<u64>>, i: usize| {
                    v.as_ref().and_then(|v| v.get(i)).map_or("-".to_owned(), ToString::to_string)
                };
                let at_s = |v: &Option<Vec<String>>, i: usize| {
                    v.as_ref().and_then(|v| v.get(i)).cloned().unwrap_or_else(|| "-".to_owned())
                };
                for i in 0..n {
                    t.add_row([
                        i.to_string(),
                        at_s(&m.region_names, i),
                        at_s(&m.region_mem_types, i),
                        m.kv_caches_base_addr
                            .as_ref()
                            .and_then(|v| v.get(i))
                            .map_or("-".into(), |a| format!("{a:#x}")),
                        at(&m.block_lens, i),
                        at(&m.block_strides, i),
                        m.region_num_blocks
                            .as_ref()
                            .and_then(|v| v.get(i))
                            .or(m.num_blocks.as_ref())
                            .map_or("-".to_owned(), ToString::to_string),
                    ]);
                }
                regions = Some(t);
            }
        }
    }
    let _ = writeln!(out, "{head}");
    for t in [regions, nixl_regions].into_iter().flatten() {
        let _ = writeln!(out, "{t}");
    }
    for n in notes {
        let _ = writeln!(out, "{n}");
    }
    out
}

/// The decoded NIXL agent blob: rows for the head table, and its regions as a table.
fn nixl_rows(head: &mut Table, notes: &mut Vec<String>, b: &AgentBlob) -> Option<Table> {
    head.add_row(["nixl agent".to_owned(), b.agent_name.clone()]);
    if let Some(uuid) = &b.agent_uuid {
        head.add_row(["nixl agent uuid".to_owned(), uuid.clone()]);
    }
    let backends: Vec<String> = b
        .backends
        .iter()
        .map(|c| format!("{} (connection info {} bytes)", c.backend, c.conn_info_len_bytes))
        .collect();
    head.add_row([
        "nixl backends".to_owned(),
        if backends.is_empty() { "none".to_owned() } else { backends.join(", ") },
    ]);
    head.add_row(["nixl regions".to_owned(), b.regions.len().to_string()]);
    if b.unparsed_tail > 0 {
        notes.push(format!(
            "nixl agent metadata: {} trailing bytes kvx does not know, not decoded",
            b.unparsed_tail
        ));
    }
    if b.regions.is_empty() {
        return None;
    }
    let mut t = Table::new();
    t.set_header(["nixl #", "backend", "mem", "addr", "len", "rkey"]);
    for (i, r) in b.regions.iter().enumerate() {
        t.add_row([
            i.to_string(),
            r.backend.clone(),
            format!("{}:{}", r.mem_type, r.device_id),
            format!("{:#x}", r.addr),
            r.len_bytes.to_string(),
            format!("{} bytes", r.rkey_len_bytes),
        ]);
    }
    Some(t)
}

/// Latency summary of repeated probes, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: usize,
    pub min_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl LatencySummary {
    /// Nearest-rank percentiles of `samples_us`; `None` when empty.
    pub fn of(samples_us: &[f64]) -> Option<Self> {
        if samples_us.is_empty() {
            return None;
        }
        let mut v = samples_us.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(LatencySummary {
            count: v.len(),
            min_us: *v.first()?,
            p50_us: rank(0.50),
            p99_us: rank(0.99),
            max_us: *v.last()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(LatencySummary::of(&[]), None);
        let s = LatencySummary::of(&[5.0, 1.0, 3.0, 2.0, 4.0]).expect("non-empty");
        assert_eq!((s.count, s.min_us, s.p50_us, s.p99_us, s.max_us), (5, 1.0, 3.0, 5.0, 5.0));
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = LatencySummary::of(&hundred).expect("non-empty");
        assert_eq!((s.p50_us, s.p99_us), (50.0, 99.0));
    }

    fn vllm_report(agent_metadata: &[u8]) -> ProbeReport {
        let m = VllmAgentMetadata {
            engine_id: Some("P-engine".into()),
            agent_metadata: agent_metadata.to_vec(),
            ..VllmAgentMetadata::default()
        };
        ProbeReport {
            endpoint: "tcp://127.0.0.1:5600".into(),
            pp_rank: 0,
            tp_rank: 0,
            framing: Framing::V0_33,
            reply_frames: 2,
            peer_clock_s: None,
            latency_us: 100.0,
            compatibility_hash: Some("ab".repeat(32)),
            advertised: vllm_advertised(Box::new(m)),
        }
    }

    #[test]
    fn a_nixl_agent_blob_is_shown_decoded() {
        let blob = include_bytes!("../../tests/fixtures/nixl/agent-3-regions.bin");
        let registered: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/nixl/agent-3-regions.json"))
                .expect("JSON");
        let report = vllm_report(blob);

        let j: serde_json::Value = serde_json::from_str(&render_json(&report)).expect("JSON");
        let agent = &j["advertised"]["nixl_agent"];
        assert_eq!(agent["agent_name"], "kvx-agent-3-regions");
        assert_eq!(agent["backends"][0]["backend"], "UCX");
        assert_eq!(j["advertised"]["opaque"], serde_json::json!([]));
        let regions = agent["regions"].as_array().expect("regions");
        assert_eq!(regions.len(), 3);
        // The blob lists a section by device id, then address.
        let mut want = registered["registered"].as_array().expect("registered").clone();
        want.sort_by_key(|r| (r["dev_id"].as_u64(), r["addr"].as_u64()));
        for (got, want) in regions.iter().zip(&want) {
            assert_eq!(
                (&got["addr"], &got["len_bytes"], &got["device_id"], &got["mem_type"]),
                (&want["addr"], &want["len"], &want["dev_id"], &want["mem"])
            );
        }

        let table = render_table(&report);
        let conn = match &report.advertised {
            Advertised::Vllm { nixl_agent: Some(b), .. } => b.backends[0].conn_info_len_bytes,
            other => panic!("not decoded: {other:?}"),
        };
        for needle in [
            "kvx-agent-3-regions".to_owned(),
            format!("UCX (connection info {conn} bytes)"),
            "DRAM:0".to_owned(),
            "1048576".to_owned(),
        ] {
            assert!(table.contains(&needle), "{needle} missing from\n{table}");
        }
        for r in registered["registered"].as_array().expect("registered") {
            let addr = format!("{:#x}", r["addr"].as_u64().expect("addr"));
            assert!(table.contains(&addr), "{addr} missing from\n{table}");
        }
        assert!(!table.contains("opaque: agent_metadata"), "{table}");
    }

    #[test]
    fn an_agent_blob_without_regions_has_no_region_table() {
        let report = vllm_report(include_bytes!("../../tests/fixtures/nixl/agent-0-regions.bin"));
        let table = render_table(&report);
        assert!(table.contains("kvx-agent-0-regions") && !table.contains("nixl #"), "{table}");
    }

    #[test]
    fn an_undecodable_agent_blob_stays_opaque_with_the_reason() {
        let report = vllm_report(b"agent-md:1e07837");
        let j: serde_json::Value = serde_json::from_str(&render_json(&report)).expect("JSON");
        assert_eq!(j["advertised"]["nixl_agent"], serde_json::Value::Null);
        let opaque = &j["advertised"]["opaque"][0];
        assert_eq!((opaque["field"].as_str(), opaque["bytes"].as_u64()), (Some("agent_metadata"), Some(16)));
        let table = render_table(&report);
        assert!(
            table.contains("opaque: agent_metadata <16 bytes")
                && table.contains("could not decode: not a NIXL agent blob"),
            "{table}"
        );

        // A real blob cut short says where.
        let blob = include_bytes!("../../tests/fixtures/nixl/agent-1-region.bin");
        let report = vllm_report(&blob[..blob.len() - 1]);
        let Advertised::Vllm { nixl_agent: None, opaque, .. } = &report.advertised else {
            panic!("decoded a truncated blob");
        };
        assert!(opaque[0].note.contains("ends inside field"), "{}", opaque[0].note);
    }
}
