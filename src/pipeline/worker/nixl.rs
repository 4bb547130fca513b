//! `--transport nixl` in the ranks: NIXL agents (from the wheel's C API) in place of kvx's
//! UCX side, vLLM's own handshake payload (`NixlAgentMetadata` with the agent's blob, vLLM's
//! compatibility hash), READs made from prepared descriptor lists with vLLM's descriptor
//! ids, and notifications through NIXL in vLLM's format.
//!
//! Prefill: one agent per rank registers the pool and advertises it; notifications (request
//! completions `"<id>:<n>"`, heartbeats `HB:`) are drained from the agent as vLLM's worker
//! drains `get_new_notifs()`. Decode: one agent per rank; at the handshake with a prefill
//! engine it loads each source rank's agent blob and prepares, per READ of its plan, one
//! list of its own sub-blocks and one of the source rank's blocks, region-major (descriptor
//! id = region * blocks + block, vLLM's `_get_block_descs_ids`); a request's READ is one
//! transfer request from those ids, carrying the completion notification.
//!
//! A layer above the transfer layer: holds no `unsafe`.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::config::worker::WorkerConfig;
use crate::layouts::Region;
use crate::layouts::compat::PairSpec;
use crate::layouts::read_plan::{BlockPairs, Planner};
use crate::pipeline::wire::FailureCause;
use crate::pipeline::worker::plumbing::{Stage as _, WorkerError};
use crate::topology::VllmVersion;
use crate::transfer::handshake::meta::VllmAgentMetadata;
use crate::transfer::handshake::vllm_meta::{
    AdvertisedRegion, DEFAULT_ATTN_BACKEND, EngineFactors, VllmAdvertised, vllm_factors,
};
use crate::transfer::handshake::{CompatFactors, HandshakeClient, Payload};
use crate::transfer::memory::KvBuffer;
use crate::transfer::nixl::{
    Agent, AgentOptions, Desc, Nixl, NixlError, Op, Prepped, Region as NixlRegion, Xfer, XferState,
};
use crate::transfer::notify::Notification;
use crate::transfer::ucx::MemType;

type Failure = (FailureCause, String);

/// A rank's agent and its registered pool.
pub struct NixlSide {
    pub region: NixlRegion<KvBuffer>,
    pub agent: Agent,
    /// The library, for the run's report.
    pub library: (String, String),
}

/// A name no other agent of this run or of an earlier one has: vLLM names agents with a
/// fresh UUID, so a restarted engine is a new agent to its peers.
fn agent_name(cfg: &WorkerConfig, role: &str) -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("kvx-{}-{role}{}-{}-{nanos:x}", cfg.engine_id, cfg.rank, std::process::id())
}

impl NixlSide {
    /// Loads NIXL, creates the rank's agent (UCX backend) and registers `mem`.
    pub fn new(cfg: &WorkerConfig, mem: KvBuffer, role: &str) -> Result<NixlSide, WorkerError> {
        let nixl = Nixl::load().stage("load NIXL")?;
        let opts = AgentOptions {
            progress_thread: cfg.transport.nixl.progress_thread,
            err_mode: cfg.transport.err_mode,
            ..AgentOptions::default()
        };
        let agent = Agent::new(&nixl, &agent_name(cfg, role), &opts).stage("NIXL agent")?;
        let dev = u64::from(cfg.mem.device().unwrap_or(0));
        let region = agent.register(mem, dev).stage("register the KV pool with NIXL")?;
        let info = nixl.info();
        let library = (
            format!("NIXL {} ({})", info.version.as_deref().unwrap_or("?"), info.library.display()),
            nixl.bundled_ucx_version().map_or_else(String::new, |v| format!("NIXL's UCX {v}")),
        );
        Ok(NixlSide { region, agent, library })
    }

    pub fn mem_type(&self) -> MemType {
        if self.region.is_device() { MemType::Cuda } else { MemType::Host }
    }

    /// Notifications received since the last call, parsed; what does not parse is logged
    /// and counted as unrecognised by the caller (returned apart).
    pub fn drain(&self) -> (Vec<Notification>, u64) {
        let raw = match self.agent.notifs() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("NIXL notifications: {e}");
                return (Vec::new(), 0);
            }
        };
        let mut bad = 0;
        let parsed = raw
            .into_iter()
            .filter_map(|(from, msg)| match Notification::parse(&msg) {
                Ok(n) => Some(n),
                Err(e) => {
                    bad += 1;
                    tracing::warn!("a notification from NIXL agent {from} that is not vLLM's: {e}");
                    None
                }
            })
            .collect();
        (parsed, bad)
    }
}

/// The engine factors vLLM hashes, for a kvx engine of this configuration.
pub fn factors(cfg: &WorkerConfig) -> CompatFactors {
    let m = &cfg.pair.model;
    vllm_factors(
        &EngineFactors {
            model: m.name.clone(),
            dtype: m.dtype.torch_name().to_string(),
            num_kv_heads: u64::from(if m.is_mla() { 1 } else { m.num_kv_heads }),
            head_size: u64::from(m.mla.map_or(m.head_dim, |x| x.head_size())),
            num_hidden_layers: u64::from(m.num_layers),
            attn_backend_name: DEFAULT_ATTN_BACKEND.into(),
            is_hma_enabled: cfg.pair.version == VllmVersion::V0_33,
            transfer_mode: cfg.transport.mode.as_str().into(),
        },
        cfg.pair.version,
    )
}

/// The side-channel payload of a prefill rank: vLLM's handshake payload exactly.
pub fn advertised_payload(
    cfg: &WorkerConfig,
    spec: &crate::layouts::EngineSpec,
    regions: &[Region],
    side: &NixlSide,
) -> Result<Vec<u8>, WorkerError> {
    let base = side.region.addr();
    let adv = VllmAdvertised {
        engine_id: cfg.engine_id.clone(),
        agent_metadata: side.agent.local_metadata().stage("NIXL agent metadata")?,
        device_id: u64::from(cfg.mem.device().unwrap_or(0)),
        mem_type: if side.region.is_device() { "VRAM" } else { "DRAM" }.into(),
        regions: regions
            .iter()
            .map(|r| AdvertisedRegion {
                name: r.name.clone(),
                base_addr: base + r.base_off,
                block_len: r.block_len,
                block_stride: r.block_stride,
                num_blocks: r.num_blocks,
            })
            .collect(),
        layout: spec.layout.vllm_name().to_string(),
        block_size: u64::from(spec.block_tokens),
        attn_backend_name: DEFAULT_ATTN_BACKEND.into(),
    };
    Ok(Payload::Meta {
        compatibility_hash: factors(cfg).hash_hex(),
        agent_metadata_bytes: adv.encode(cfg.pair.version),
    }
    .encode())
}

/// A source rank as a decode rank reads it through NIXL.
pub struct NixlPeer {
    /// The peer's agent name (loaded into this rank's agent).
    pub agent: String,
}

/// One READ's prepared lists (this rank's sub-blocks, the source rank's blocks).
pub struct ReadLists {
    pub local: Prepped,
    pub remote: Prepped,
    /// Descriptors per region on each side (`ids = region * per_region + index`).
    pub local_per_region: usize,
    pub remote_per_region: usize,
}

/// What a decode rank learned from a prefill engine's side channel.
pub struct NixlHandshake {
    pub pair: PairSpec,
    /// tp_rank -> the peer's metadata.
    pub peers: Vec<(u32, VllmAgentMetadata)>,
}

/// Fetches and checks vLLM metadata of `ranks` at `endpoint`: vLLM's compatibility hash
/// first (vLLM's two-phase decode), then the metadata, then the prefill side it describes.
pub fn fetch(
    client: &HandshakeClient,
    cfg: &WorkerConfig,
    endpoint: &str,
    ranks: &[(u32, u32)],
    p_tp: u32,
    engine_id: &str,
) -> Result<NixlHandshake, Failure> {
    let (p, peers) = fetch_engine(client, cfg, endpoint, ranks, p_tp, engine_id)?;
    Ok(NixlHandshake { pair: PairSpec { p, ..cfg.pair.clone() }, peers })
}

/// [`fetch`] for either side: the engine (of TP `tp`) the metadata describes, and each
/// rank's metadata. Push mode's prefill ranks fetch decode engines with it.
pub fn fetch_engine(
    client: &HandshakeClient,
    cfg: &WorkerConfig,
    endpoint: &str,
    ranks: &[(u32, u32)],
    tp: u32,
    engine_id: &str,
) -> Result<(crate::layouts::EngineSpec, Vec<(u32, VllmAgentMetadata)>), Failure> {
    let raws = client
        .fetch_raw_many(endpoint, ranks)
        .map_err(|e| (crate::pipeline::worker::plumbing::handshake_cause(&e), e.to_string()))?;
    let local_hash = factors(cfg).hash_hex();
    let mut peers = Vec::new();
    for raw in raws {
        let (hash, bytes) = match raw.reply.payload {
            Payload::Meta { compatibility_hash, agent_metadata_bytes } => {
                (compatibility_hash, agent_metadata_bytes)
            }
            Payload::Error(m) => {
                return Err((FailureCause::Handshake, format!("{endpoint} rank {}: {m}", raw.tp_rank)));
            }
        };
        if hash != local_hash {
            return Err((
                FailureCause::Incompatible,
                format!(
                    "NIXL compatibility hash mismatch. Local: {local_hash}, Remote: {hash} ({endpoint} rank {}): \
                     the engines differ in model, dtype, KV heads, head size, layers, attention backend, \
                     vLLM version or transfer mode",
                    raw.tp_rank
                ),
            ));
        }
        let meta = VllmAgentMetadata::decode(&bytes).map_err(|e| {
            (FailureCause::Incompatible, format!("Failed to decode NixlAgentMetadata from {endpoint}: {e}"))
        })?;
        if meta.engine_id.as_deref() != Some(engine_id) {
            return Err((
                FailureCause::Incompatible,
                format!(
                    "remote engine id {engine_id} in kv_transfer_params, {} in the handshake of {endpoint}",
                    meta.engine_id.as_deref().unwrap_or("none")
                ),
            ));
        }
        peers.push((raw.tp_rank, meta));
    }
    let Some((_, first)) = peers.first() else {
        return Err((FailureCause::Handshake, format!("{endpoint} returned no metadata")));
    };
    let bad = |what: &str| (FailureCause::Incompatible, format!("{endpoint} advertises no {what}"));
    let layout = crate::layouts::Layout::parse_for(
        first.kv_cache_layout.as_deref().ok_or_else(|| bad("kv_cache_layout"))?,
        cfg.pair.version,
    )
    .map_err(|e| (FailureCause::Incompatible, format!("peer layout: {e}")))?;
    let num_blocks = first.num_blocks.ok_or_else(|| bad("num_blocks"))?;
    let block_size = first.block_size.ok_or_else(|| bad("block_size"))?;
    let spec = crate::layouts::EngineSpec {
        tp,
        block_tokens: u32::try_from(block_size).map_err(|_| bad("usable block_size"))?,
        num_blocks: u32::try_from(num_blocks).map_err(|_| bad("usable num_blocks"))?,
        layout,
    };
    Ok((spec, peers))
}

/// Checks a peer's advertised regions against the prefill side kvx planned from its
/// metadata (same offsets from the first, lengths, strides): descriptors would land
/// elsewhere otherwise. Returns the address of the peer's allocation base.
pub fn peer_base(meta: &VllmAgentMetadata, planned: &[Region], who: &str) -> Result<u64, Failure> {
    let bases = meta.kv_caches_base_addr.clone().unwrap_or_default();
    let lens = meta.block_lens.clone().unwrap_or_default();
    let strides = meta.block_strides.clone().unwrap_or_else(|| lens.clone());
    let first_planned = planned.first().map_or(0, |r| r.base_off);
    let (Some(&b0), true) = (bases.first(), bases.len() == planned.len()) else {
        return Err((
            FailureCause::Incompatible,
            format!("{who} advertises {} regions, kvx plans {} for its layout", bases.len(), planned.len()),
        ));
    };
    for (i, r) in planned.iter().enumerate() {
        let advertised = (bases[i].wrapping_sub(b0), lens.get(i).copied(), strides.get(i).copied());
        let plan = (r.base_off - first_planned, Some(r.block_len), Some(r.block_stride));
        if advertised != plan {
            return Err((
                FailureCause::Incompatible,
                format!(
                    "{who} region {i} ({}) is at +{} with blocks of {:?} every {:?} bytes; kvx plans +{} with \
                     {} every {} for this model, layout and TP (give both engines the same model and layout)",
                    r.name, advertised.0, advertised.1, advertised.2, plan.0, r.block_len, r.block_stride
                ),
            ));
        }
    }
    Ok(b0.wrapping_sub(first_planned))
}

/// Prepares each READ's lists for a handshaked engine: this rank's sub-blocks of every
/// region the READ covers, and the source rank's blocks of the same regions.
pub fn prepare_reads(
    side: &NixlSide,
    planner: &Planner,
    peers: &std::collections::BTreeMap<u32, (NixlPeer, u64, u64)>,
) -> Result<Vec<ReadLists>, Failure> {
    let mem = side.mem_type();
    let local_base = side.region.addr();
    let local_dev = side.region.dev();
    let local_n = planner.local_pool as usize * planner.bsr.max(1) as usize;
    let remote_n = planner.remote_pool as usize;
    let nixl = |what: String| move |e: NixlError| (FailureCause::Handshake, format!("{what}: {e}"));
    planner
        .reads
        .iter()
        .map(|read| {
            let Some((peer, base, dev)) = peers.get(&read.p_rank) else {
                return Err((
                    FailureCause::Internal,
                    format!("no NIXL peer for prefill rank {}", read.p_rank),
                ));
            };
            let mut l = Vec::with_capacity(read.regions.len() * local_n);
            let mut r = Vec::with_capacity(read.regions.len() * remote_n);
            for x in &read.regions {
                l.extend((0..local_n as u64).map(|i| Desc {
                    addr: local_base + x.l_base + i * x.l_step,
                    len: x.len,
                    dev: local_dev,
                }));
                r.extend((0..remote_n as u64).map(|i| Desc {
                    addr: base + x.r_base + i * x.r_step,
                    len: x.len,
                    dev: *dev,
                }));
            }
            let local = side
                .agent
                .prep_local(&l, mem)
                .map_err(nixl(format!("prepare the local list for prefill rank {}", read.p_rank)))?;
            let remote = side
                .agent
                .prep_remote(&peer.agent, &r, mem)
                .map_err(nixl(format!("prepare prefill rank {}'s list", read.p_rank)))?;
            Ok(ReadLists { local, remote, local_per_region: local_n, remote_per_region: remote_n })
        })
        .collect()
}

/// Posts one request's READs (one transfer per source rank, each carrying `notif` for its
/// rank), waits for all of them, and returns the bytes and the time spent posting.
pub fn read_request(
    side: &NixlSide,
    planner: &Planner,
    lists: &[ReadLists],
    bp: &BlockPairs,
    notif: &[u8],
    timeout: Duration,
) -> Result<(u64, u64), Failure> {
    let t0 = Instant::now();
    let mut xfers: Vec<(u32, Xfer)> = Vec::with_capacity(lists.len());
    let mut post_ns = 0;
    let mut bytes = 0;
    for (read, l) in planner.reads.iter().zip(lists) {
        let tp = Instant::now();
        let n = read.regions.len() * bp.len();
        let (mut lids, mut rids) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (j, x) in read.regions.iter().enumerate() {
            let (lo, ro) = ((j * l.local_per_region) as u64, (j * l.remote_per_region) as u64);
            for (&lb, &rb) in bp.local.iter().zip(&bp.remote) {
                lids.push(i32::try_from(lo + lb).unwrap_or(i32::MAX));
                rids.push(i32::try_from(ro + rb).unwrap_or(i32::MAX));
            }
            bytes += x.len * bp.len() as u64;
        }
        let fail =
            |e: NixlError| (FailureCause::Transfer, format!("READ from prefill rank {}: {e}", read.p_rank));
        let mut x = side
            .agent
            .make_xfer(Op::Read, &l.local, &lids, &l.remote, &rids, Some(notif), true)
            .map_err(fail)?;
        let st = x.post().map_err(fail)?;
        post_ns += tp.elapsed().as_nanos() as u64;
        if st == XferState::InProgress {
            xfers.push((read.p_rank, x));
        }
    }
    // Completion by NIXL's transfer state, polled as vLLM's worker polls `check_xfer_state`.
    wait_all(xfers, t0, timeout, ("READ from prefill rank", "READs from prefill ranks"))?;
    Ok((bytes, post_ns))
}

/// Polls posted transfers (each with its peer rank) until every one is done, `timeout` after
/// `t0` at most; `what`: how a failure names one transfer and several ("READ from prefill
/// rank", "READs from prefill ranks").
pub fn wait_all(
    mut xfers: Vec<(u32, Xfer)>,
    t0: Instant,
    timeout: Duration,
    what: (&str, &str),
) -> Result<(), Failure> {
    while !xfers.is_empty() {
        if t0.elapsed() > timeout {
            let ranks: Vec<u32> = xfers.iter().map(|(r, _)| *r).collect();
            return Err((
                FailureCause::Timeout,
                format!("{} {ranks:?} did not complete within {timeout:?}", what.1),
            ));
        }
        let mut i = 0;
        // Polling is all NIXL offers; give the core to the ranks on it between rounds.
        std::thread::yield_now();
        while i < xfers.len() {
            match xfers[i].1.status() {
                Ok(XferState::Done) => {
                    xfers.swap_remove(i);
                }
                Ok(XferState::InProgress) => i += 1,
                Err(e) => return Err((FailureCause::PeerGone, format!("{} {}: {e}", what.0, xfers[i].0))),
            }
        }
    }
    Ok(())
}
