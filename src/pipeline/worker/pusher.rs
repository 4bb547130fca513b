//! Push mode in the worker processes, as vLLM's `NixlPushConnector` does it
//! (`docs/push-semantics.md`): decode ranks register their blocks with the prefill ranks
//! they handshake with (`PUSH_REG`), each prefill rank WRITEs its KV into the registered
//! blocks once it holds both the filled blocks and a registration (in either order),
//! flushes the endpoints (remote completion) and sends every decode rank it wrote to
//! `"<decode request id>:<prefill TP>"`; decode ranks count those, then verify.
//!
//! Owns the prefill side's matching and WRITEs ([`Pusher`]) and the decode side's
//! connections to prefill ranks and its count of arrivals ([`PushWaiter`]). The rank loops
//! (`prefill`, `decode`) own the sockets and the pools and call these.
//!
//! Where kvx differs from vLLM 0.33: a WRITE that fails to post or complete sends the decode
//! ranks a failure notification counted like a completion (vllm-project/vllm#50754's fix),
//! so decode fails the request instead of waiting; decode waits at most `--timeout` for its
//! notifications (vLLM's registration watchdog is 480 s); a registration names the prefill
//! request id, which kvx matches exactly (vLLM matches ids with their random suffixes
//! stripped).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::worker::WorkerConfig;
use crate::layouts::compat::PairSpec;
use crate::layouts::hybrid::blocks::{ExchangedBlocks, TokenCounts};
use crate::layouts::hybrid::geometry::{EngineGeometry, Side};
use crate::layouts::hybrid::handshake_ranks;
use crate::layouts::hybrid::write_plan as hybrid_push;
use crate::layouts::hybrid::{HybridPairSpec, HybridPlanner};
use crate::layouts::read_plan::{RequestBlocks, RequestIds};
use crate::layouts::write_plan::PushPlanner;
use crate::pipeline::params::base_request_id;
use crate::pipeline::wire::{FailureCause, PushStats};
use crate::pipeline::worker::nixl::{self, NixlSide};
use crate::pipeline::worker::plumbing::{classify_ucx, compat_factors, fetch_peers, first_region, peer_spec};
use crate::topology::push_map::PushRankMap;
use crate::transfer::handshake::client::{FetchOptions, HandshakeClient, PeerMetadata};
use crate::transfer::handshake::meta::KvxMetadata;
use crate::transfer::memory::KvBuffer;
use crate::transfer::nixl::{Desc, NixlError, Op, Peer, Prepped, XferState};
use crate::transfer::notify::{
    Notification, NotifyError, NotifySender, NotifyTransport, PushRegistration, UcxNotifySender,
};
use crate::transfer::ucx::{
    Endpoint, MemRegion, PackedRkey, ReadDesc, ReadOptions, RemoteRegion, Rma, UcxError, Worker, rma_batch,
};
use crate::vocab::kinds::TransportKind;

/// A failed step: its cause and what happened.
pub type Failure = (FailureCause, String);

/// How a rank reaches one peer rank's notification channel: UCX active messages on the
/// endpoint to it (notify = ucx), ZMQ, or (`--transport nixl`) NIXL's notifications to the
/// peer's agent, as vLLM sends them.
pub enum NotifyPath {
    Kvx { am: Option<UcxNotifySender>, zmq: NotifySender },
    Nixl(Peer),
}

impl NotifyPath {
    pub fn send(&self, n: &Notification) -> Result<(), NotifyError> {
        match self {
            NotifyPath::Kvx { am: Some(am), .. } => am.send(n),
            NotifyPath::Kvx { am: None, zmq } => zmq.send(n),
            NotifyPath::Nixl(peer) => send_nixl(peer, n),
        }
    }

    /// Sends without the UCX side (it may be gone): over ZMQ, or through NIXL.
    pub fn send_beside_ucx(&self, n: &Notification) -> Result<(), NotifyError> {
        match self {
            NotifyPath::Kvx { zmq, .. } => zmq.send(n),
            NotifyPath::Nixl(peer) => send_nixl(peer, n),
        }
    }
}

/// A notification to a NIXL peer's agent (vLLM's `send_notif`).
fn send_nixl(peer: &Peer, n: &Notification) -> Result<(), NotifyError> {
    peer.send_notif(&n.encode()?).map_err(|source| NotifyError::Nixl { peer: peer.name().to_owned(), source })
}

/// Connects the notification path to the rank `meta` describes, over `ep` when notifications
/// travel as UCX active messages.
fn notify_path(
    cfg: &WorkerConfig,
    meta: &KvxMetadata,
    ep: Option<Endpoint>,
    timeout: Duration,
) -> Result<NotifyPath, Failure> {
    let endpoint = meta.notify_endpoint.clone().ok_or((
        FailureCause::Incompatible,
        format!("rank {} of {} has no notification endpoint", meta.tp_rank, meta.engine_id),
    ))?;
    let zmq = NotifySender::connect(&endpoint, timeout)
        .map_err(|e| (FailureCause::Handshake, format!("notification channel {endpoint}: {e}")))?;
    let am = match (ep, cfg.transport.notify) {
        (Some(ep), NotifyTransport::Ucx) => {
            Some(UcxNotifySender::new(ep, format!("rank {} of {}", meta.tp_rank, meta.engine_id), timeout))
        }
        _ => None,
    };
    Ok(NotifyPath::Kvx { am, zmq })
}

/// The push map of a pair, with push's refusals as the reason.
fn push_map(pair: &PairSpec) -> Result<PushRankMap, Failure> {
    pair.validate_push().map_err(|e| (FailureCause::Incompatible, e.to_string()))
}

// ---------------------------------------------------------------------------------------
// Prefill side

/// One decode rank a prefill rank writes into: its pool (over kvx's UCX; `None` through
/// NIXL, whose WRITEs go by the engine's prepared lists) and its notification path.
struct DTarget {
    region: Option<RemoteRegion>,
    notify: NotifyPath,
}

impl DTarget {
    fn region(&self, d_rank: u32) -> Result<&RemoteRegion, Failure> {
        self.region
            .as_ref()
            .ok_or((FailureCause::Internal, format!("no UCX connection to decode rank {d_rank}")))
    }
}

/// `--transport nixl`: one WRITE's prepared lists (this prefill rank's blocks, region-major,
/// and the decode rank's), made at the handshake as vLLM's push worker makes them.
struct WriteLists {
    local: Prepped,
    remote: Prepped,
    /// Blocks per region on each side (`id = region * blocks + block`).
    local_per_region: usize,
    remote_per_region: usize,
}

/// How a decode engine's WRITEs are planned: one KV cache group (the uniform push planner), or
/// a hybrid model's groups and state (from the pull plans of the decode ranks written into).
enum WritePlanner {
    Uniform(Box<PushPlanner>),
    Hybrid(Arc<HybridPlanner>),
}

/// A decode engine a prefill rank has handshaked with.
struct DEngine {
    planner: WritePlanner,
    ranks: BTreeMap<u32, DTarget>,
    /// The decode ranks this rank writes into.
    write_ranks: Vec<u32>,
    /// What each of this rank's notifications names as the count (prefill TP).
    notif_count: u32,
    /// `--transport nixl`: each WRITE's prepared lists, in the planner's write order.
    nixl_lists: Vec<WriteLists>,
}

/// A hybrid request a prefill rank holds, as push plans it: its per-group lists (as its
/// allocator holds them, before clipping) and its prompt's tokens.
pub struct HybridHeld {
    pub lists: Vec<Vec<u32>>,
    pub tokens: u32,
}

/// One WRITE's pairs per layer.
type WriteLayers = Vec<Vec<crate::layouts::read_plan::Pair>>;

/// A request's WRITEs as a job takes them: pairs per WRITE and layer, and per WRITE its
/// decode rank and notification.
type Planned = (Vec<WriteLayers>, Vec<(u32, String)>);

/// One request being written by a prefill rank: where to, what per layer, how far.
pub struct PushJob {
    /// The decode engine written into.
    engine: String,
    reg: PushRegistration,
    /// Pairs per WRITE and per layer (`[write][layer]`).
    layers: Vec<WriteLayers>,
    /// Per WRITE: the decode rank and its notification.
    writes: Vec<(u32, String)>,
    num_layers: u32,
    /// Layers posted so far.
    next_layer: u32,
    stats: PushStats,
}

/// The prefill side: registrations waiting for their fills, decode engines handshaked with,
/// and the WRITEs.
pub struct Pusher {
    client: HandshakeClient,
    engines: HashMap<String, DEngine>,
    /// Registrations by prefill request id, waiting for (or matched with) a fill.
    registrations: HashMap<String, PushRegistration>,
    /// Requests already written: later registrations for them (one per decode rank that
    /// registers with this rank) are not written again.
    written: HashSet<String>,
    timeout: Duration,
    /// What UCX chose for the WRITEs was reported (with the first written request).
    reported: bool,
}

impl Pusher {
    pub fn new(timeout: Duration) -> Self {
        Pusher {
            client: HandshakeClient::new(FetchOptions {
                attempt_timeout: timeout,
                deadline: timeout * 3,
                ..FetchOptions::default()
            }),
            engines: HashMap::new(),
            registrations: HashMap::new(),
            written: HashSet::new(),
            timeout,
            reported: false,
        }
    }

    /// True once: when the caller is to report what UCX chose for the WRITEs.
    pub fn first_report(&mut self) -> bool {
        !std::mem::replace(&mut self.reported, true)
    }

    /// The UCX transports of an endpoint this rank writes over (for reports).
    pub fn transports(&self) -> Option<String> {
        self.engines
            .values()
            .flat_map(|e| e.ranks.values())
            .find_map(|t| t.region.as_ref().and_then(|r| r.endpoint().transports().ok()))
    }

    /// Records a registration; returns the key it is filed under, if this rank has not
    /// written that request yet (the caller writes it if it holds the blocks). A registration
    /// that names the prefill request id (decode got prefill's answer first) is filed under it;
    /// one sent before prefill answered (concurrent dispatch) knows only its own id, and is
    /// filed under that id's base, which the prefill leg's id shares (vLLM's fuzzy match).
    pub fn register(&mut self, reg: PushRegistration) -> Option<String> {
        let id = match &reg.remote_request_id {
            Some(p) if !p.is_empty() => p.clone(),
            _ => base_request_id(&reg.request_id).to_string(),
        };
        if self.written.contains(&id) {
            return None;
        }
        self.registrations.entry(id.clone()).or_insert(reg);
        Some(id)
    }

    /// The key a request's registration is filed under, if one came: its exact id, else its
    /// base id.
    fn key_of(&self, p_request_id: &str) -> Option<String> {
        [p_request_id, base_request_id(p_request_id)]
            .into_iter()
            .find(|k| self.registrations.contains_key(*k))
            .map(str::to_string)
    }

    /// Whether a registration is waiting for this request's fill.
    pub fn is_registered(&self, p_request_id: &str) -> bool {
        self.key_of(p_request_id).is_some()
    }

    /// The prefill request id a registration key stands for, among those this rank holds.
    pub fn held_id<'a>(key: &str, mut held: impl Iterator<Item = &'a String>) -> Option<String> {
        held.find(|id| id.as_str() == key || base_request_id(id) == key).cloned()
    }

    /// Forgets a request (its blocks were freed).
    pub fn forget(&mut self, p_request_id: &str) {
        for k in [p_request_id, base_request_id(p_request_id)] {
            self.registrations.remove(k);
            self.written.remove(k);
        }
    }

    /// Tells the decode ranks of a registered request that this rank will not WRITE it (its
    /// UCX side is gone), over ZMQ, where this rank already knows the decode engine.
    pub fn give_up(&mut self, p_request_id: &str) {
        let Some(key) = self.key_of(p_request_id) else { return };
        let Some(reg) = self.registrations.remove(&key) else { return };
        self.written.insert(key);
        if let Some(eng) = self.engines.get(&reg.decode_engine_id) {
            let count = eng.notif_count;
            let n = Notification::PushFailed { d_request_id: reg.request_id.clone(), count };
            for (d, t) in &eng.ranks {
                if let Err(e) = t.notify.send_beside_ucx(&n) {
                    tracing::warn!("push failure notification to decode rank {d}: {e}");
                }
            }
        }
    }

    /// WRITEs the request's blocks into the registered decode blocks, flushes, notifies.
    /// On a failure after the decode engine was reached, its ranks get a failure
    /// notification, so none waits for a WRITE that will not come.
    pub fn push(
        &mut self,
        cfg: &WorkerConfig,
        worker: &Worker,
        local: &mut MemRegion<KvBuffer>,
        p_request_id: &str,
        blocks: &[u32],
        hybrid: Option<&HybridHeld>,
    ) -> Result<PushStats, Failure> {
        let mut job = self.begin(cfg, worker, p_request_id, blocks, hybrid)?;
        let all = job.num_layers;
        self.write_layers(cfg, &mut job, local, all, None)?;
        self.finish(job)
    }

    /// The registration of a request about to be written (it is written once).
    fn take_registration(&mut self, p_request_id: &str) -> Result<PushRegistration, Failure> {
        let none = || (FailureCause::Internal, format!("no registration for {p_request_id}"));
        let key = self.key_of(p_request_id).ok_or_else(none)?;
        let reg = self.registrations.remove(&key).ok_or_else(none)?;
        self.written.insert(key);
        Ok(reg)
    }

    /// `--transport nixl`: WRITEs the request's blocks into the registered decode blocks as
    /// vLLM's push worker does: one transfer per decode rank from the lists prepared at the
    /// handshake, with vLLM's descriptor ids, carrying `"<decode request id>:<prefill TP>"`,
    /// which NIXL delivers once the WRITE has landed; completion by NIXL's transfer state.
    pub fn push_nixl(
        &mut self,
        cfg: &WorkerConfig,
        side: &NixlSide,
        p_request_id: &str,
        blocks: &[u32],
    ) -> Result<PushStats, Failure> {
        let reg = self.take_registration(p_request_id)?;
        let mut stats = PushStats::default();
        if !self.engines.contains_key(&reg.decode_engine_id) {
            let t = Instant::now();
            let engine = self.connect_nixl(cfg, side, &reg)?;
            stats.handshake_ns = t.elapsed().as_nanos() as u64;
            self.engines.insert(reg.decode_engine_id.clone(), engine);
        }
        match self.write_nixl(side, &reg, p_request_id, blocks, &mut stats) {
            Ok(()) => Ok(stats),
            Err(e) => {
                let job = PushJob {
                    engine: reg.decode_engine_id.clone(),
                    reg,
                    layers: Vec::new(),
                    writes: Vec::new(),
                    num_layers: 1,
                    next_layer: 1,
                    stats: PushStats::default(),
                };
                Err(self.fail(job, e))
            }
        }
    }

    fn write_nixl(
        &self,
        side: &NixlSide,
        reg: &PushRegistration,
        p_request_id: &str,
        blocks: &[u32],
        stats: &mut PushStats,
    ) -> Result<(), Failure> {
        let eng = self
            .engines
            .get(&reg.decode_engine_id)
            .ok_or((FailureCause::Internal, "decode engine vanished from the cache".to_string()))?;
        let WritePlanner::Uniform(planner) = &eng.planner else {
            return Err((FailureCause::Incompatible, "hybrid models are not written through NIXL".into()));
        };
        let incompatible = |e: crate::error::KnobError| (FailureCause::Incompatible, e.to_string());
        let d_blocks: Vec<u32> = reg
            .local_block_ids
            .first()
            .map(|g| g.iter().map(|&b| u32::try_from(b).unwrap_or(u32::MAX)).collect())
            .unwrap_or_default();
        if d_blocks.is_empty() {
            // A full prefix hit on decode: nothing to write.
            return Ok(());
        }
        let req = RequestBlocks { local: d_blocks, remote: blocks.to_vec() };
        let bp = planner.pair_blocks(&req).map_err(incompatible)?;
        let notif = planner.notif_msg(&RequestIds {
            p_request_id: p_request_id.to_string(),
            d_request_id: reg.request_id.clone(),
        });
        let t0 = Instant::now();
        let t_mono = crate::clock::now_ns();
        let mut xfers = Vec::with_capacity(planner.writes.len());
        for (w, lists) in planner.writes.iter().zip(&eng.nixl_lists) {
            let tp = Instant::now();
            let n = w.regions.len() * bp.len();
            let (mut lids, mut rids) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (j, x) in w.regions.iter().enumerate() {
                let (lo, ro) = ((j * lists.local_per_region) as u64, (j * lists.remote_per_region) as u64);
                // Push pairs are decode-centric: `remote` = prefill blocks, `local` = decode's.
                for (&pb, &db) in bp.remote.iter().zip(&bp.local) {
                    lids.push(i32::try_from(lo + pb).unwrap_or(i32::MAX));
                    rids.push(i32::try_from(ro + db).unwrap_or(i32::MAX));
                }
                stats.bytes += x.len * bp.len() as u64;
            }
            stats.descriptors += n as u64;
            let fail =
                |e: NixlError| (FailureCause::Transfer, format!("WRITE to decode rank {}: {e}", w.d_rank));
            let mut x = side
                .agent
                .make_xfer(Op::Write, &lists.local, &lids, &lists.remote, &rids, Some(notif.as_bytes()), true)
                .map_err(fail)?;
            let st = x.post().map_err(fail)?;
            stats.post_ns += tp.elapsed().as_nanos() as u64;
            if st == XferState::InProgress {
                xfers.push((w.d_rank, x));
            }
        }
        // Completion by NIXL's transfer state, polled as vLLM's push worker polls it; the
        // notification rides each WRITE.
        nixl::wait_all(xfers, t0, self.timeout, ("WRITE to decode rank", "WRITEs to decode ranks"))?;
        stats.transfer_ns += t0.elapsed().as_nanos() as u64;
        stats.span = crate::clock::ClockSpan::cover(stats.span, crate::clock::ClockSpan::since(t_mono));
        Ok(())
    }

    /// Starts writing a registered request: handshakes with its decode engine if this rank has
    /// not, and plans the WRITEs layer by layer ([`PushPlanner::layer_pairs`]). Nothing is
    /// posted yet: [`Self::write_layers`] posts, [`Self::finish`] flushes and notifies.
    pub fn begin(
        &mut self,
        cfg: &WorkerConfig,
        worker: &Worker,
        p_request_id: &str,
        blocks: &[u32],
        hybrid: Option<&HybridHeld>,
    ) -> Result<PushJob, Failure> {
        let reg = self.take_registration(p_request_id)?;
        let mut stats = PushStats::default();
        if !self.engines.contains_key(&reg.decode_engine_id) {
            let t = Instant::now();
            let engine = self.connect(cfg, worker, &reg)?;
            stats.handshake_ns = t.elapsed().as_nanos() as u64;
            self.engines.insert(reg.decode_engine_id.clone(), engine);
        }
        let Some(eng) = self.engines.get(&reg.decode_engine_id) else {
            return Err((FailureCause::Internal, "decode engine vanished from the cache".into()));
        };
        let planner = match &eng.planner {
            WritePlanner::Uniform(planner) => planner,
            WritePlanner::Hybrid(planner) => {
                let planned = hybrid_writes(cfg, planner, &reg, p_request_id, hybrid);
                let job = |layers, writes| PushJob {
                    engine: reg.decode_engine_id.clone(),
                    reg: reg.clone(),
                    layers,
                    writes,
                    // The whole request in one step: written after its prefill.
                    num_layers: 1,
                    next_layer: 0,
                    stats,
                };
                return match planned {
                    Ok((layers, writes)) => Ok(job(layers, writes)),
                    Err(e) => Err(self.fail(job(Vec::new(), Vec::new()), e)),
                };
            }
        };
        let num_layers = cfg.pair.model.num_layers.max(1);
        let planned = (|| {
            let d_blocks: Vec<u32> = reg
                .local_block_ids
                .first()
                .map(|g| g.iter().map(|&b| u32::try_from(b).unwrap_or(u32::MAX)).collect())
                .unwrap_or_default();
            let req = RequestBlocks { local: d_blocks, remote: blocks.to_vec() };
            let plan = planner.plan(
                &req,
                &RequestIds { p_request_id: p_request_id.to_string(), d_request_id: reg.request_id.clone() },
            )?;
            let layers = if plan.writes.is_empty() {
                Vec::new()
            } else {
                planner.layer_pairs(&planner.pair_blocks(&req)?, cfg.transport.coalesce, num_layers)
            };
            Ok::<_, crate::error::ConfigError>((plan, layers))
        })();
        let job = |layers, writes: Vec<(u32, String)>, stats| PushJob {
            engine: reg.decode_engine_id.clone(),
            reg: reg.clone(),
            layers,
            writes,
            num_layers,
            next_layer: 0,
            stats,
        };
        match planned {
            Ok((plan, layers)) => {
                let writes = plan.writes.into_iter().map(|w| (w.d_rank, w.notif_msg)).collect();
                Ok(job(layers, writes, stats))
            }
            Err(e) => {
                Err(self
                    .fail(job(Vec::new(), Vec::new(), stats), (FailureCause::Incompatible, e.to_string())))
            }
        }
    }

    /// Posts the WRITEs of the job's layers up to `upto` (exclusive) not posted yet, and waits
    /// for them to complete locally. `compute_end`: when the simulated prefill of the request
    /// ends; WRITE time before it counts as hidden behind prefill.
    pub fn write_layers(
        &mut self,
        cfg: &WorkerConfig,
        job: &mut PushJob,
        local: &mut MemRegion<KvBuffer>,
        upto: u32,
        compute_end: Option<Instant>,
    ) -> Result<(), Failure> {
        let upto = upto.min(job.num_layers);
        if upto <= job.next_layer || job.layers.is_empty() {
            job.next_layer = job.next_layer.max(upto);
            return Ok(());
        }
        let (from, to) = (job.next_layer as usize, upto as usize);
        job.next_layer = upto;
        let result = (|| {
            let eng = self
                .engines
                .get(&job.engine)
                .ok_or((FailureCause::Internal, "decode engine vanished from the cache".to_string()))?;
            let mut dests = Vec::with_capacity(job.writes.len());
            for ((d_rank, _), layers) in job.writes.iter().zip(&job.layers) {
                let target = eng
                    .ranks
                    .get(d_rank)
                    .ok_or((FailureCause::Internal, format!("no connection to decode rank {d_rank}")))?;
                let pairs = layers.get(from..to).unwrap_or_default();
                job.stats.descriptors += pairs.iter().map(|l| l.len() as u64).sum::<u64>();
                dests.push((
                    target.region(*d_rank)?,
                    pairs.iter().flatten().map(|x| ReadDesc {
                        local_off: x.local,
                        remote_off: x.remote,
                        len: x.len,
                    }),
                ));
            }
            let t = Instant::now();
            let t_mono = crate::clock::now_ns();
            let opts =
                ReadOptions { max_inflight: cfg.transport.inflight.max(1) as usize, timeout: self.timeout };
            let st = rma_batch(Rma::Put, local, dests, &opts)
                .map_err(|e| (classify_ucx(&e), format!("write to the decode ranks: {e}")))?;
            let done = Instant::now();
            job.stats.transfer_ns += done.duration_since(t).as_nanos() as u64;
            job.stats.span =
                crate::clock::ClockSpan::cover(job.stats.span, crate::clock::ClockSpan::since(t_mono));
            job.stats.post_ns += st.post_ns;
            job.stats.bytes += st.bytes;
            if let Some(end) = compute_end {
                job.stats.hidden_ns += end.min(done).saturating_duration_since(t).as_nanos() as u64;
            }
            Ok(())
        })();
        result.map_err(|e| self.fail_in_place(job, e))
    }

    /// Remote completion, then the notifications: the request is in decode's blocks.
    pub fn finish(&mut self, mut job: PushJob) -> Result<PushStats, Failure> {
        let result = (|| {
            let eng = self
                .engines
                .get(&job.engine)
                .ok_or((FailureCause::Internal, "decode engine vanished from the cache".to_string()))?;
            // Remote completion before the notification: a PUT's completion frees its source,
            // it does not say the bytes arrived.
            let tf = Instant::now();
            let tf_mono = crate::clock::now_ns();
            for (d_rank, _) in &job.writes {
                if let Some(t) = eng.ranks.get(d_rank) {
                    t.region(*d_rank)?
                        .endpoint()
                        .flush(self.timeout)
                        .map_err(|e| (classify_ucx(&e), format!("flush to decode rank {d_rank}: {e}")))?;
                }
            }
            job.stats.transfer_ns += tf.elapsed().as_nanos() as u64;
            job.stats.span =
                crate::clock::ClockSpan::cover(job.stats.span, crate::clock::ClockSpan::since(tf_mono));
            let tn = Instant::now();
            for (d_rank, msg) in &job.writes {
                let (id, count) = msg.rsplit_once(':').unwrap_or((msg.as_str(), "1"));
                let n =
                    Notification::Notif { p_request_id: id.to_string(), count: count.parse().unwrap_or(1) };
                if let Some(t) = eng.ranks.get(d_rank) {
                    t.notify
                        .send(&n)
                        .map_err(|e| (FailureCause::Notify, format!("notify decode rank {d_rank}: {e}")))?;
                }
            }
            job.stats.notify_ns = tn.elapsed().as_nanos() as u64;
            Ok(())
        })();
        match result {
            Ok(()) => Ok(job.stats),
            Err(e) => Err(self.fail(job, e)),
        }
    }

    /// Ends a job that failed: its decode ranks get a failure notification (counted like a
    /// completion, so none waits), and a broken connection is made again next time.
    pub fn fail(&mut self, mut job: PushJob, e: Failure) -> Failure {
        self.fail_in_place(&mut job, e)
    }

    fn fail_in_place(&mut self, job: &mut PushJob, e: Failure) -> Failure {
        if let Some(eng) = self.engines.get(&job.engine) {
            let n =
                Notification::PushFailed { d_request_id: job.reg.request_id.clone(), count: eng.notif_count };
            for w in &eng.write_ranks {
                if let Some(t) = eng.ranks.get(w)
                    && let Err(err) = t.notify.send(&n)
                {
                    tracing::warn!("push failure notification to decode rank {w} ({}): {err}", e.1);
                }
            }
        }
        if matches!(e.0, FailureCause::PeerGone | FailureCause::Timeout | FailureCause::Transfer) {
            self.engines.remove(&job.engine);
        }
        // Nothing more is written for it.
        job.layers.clear();
        job.writes.clear();
        e
    }

    /// Handshakes with the decode engine a registration names (its side channel), for the
    /// decode ranks this rank writes into; connects, unpacks their remote keys.
    fn connect(
        &self,
        cfg: &WorkerConfig,
        worker: &Worker,
        reg: &PushRegistration,
    ) -> Result<DEngine, Failure> {
        if let Some(config) = &cfg.hybrid {
            return self.connect_hybrid(cfg, worker, reg, config);
        }
        let endpoint = format!("tcp://{}:{}", reg.decode_host, reg.decode_port);
        let mut pair = cfg.pair.clone();
        pair.d.tp = reg.decode_tp_size;
        let prelim = push_map(&pair)?;
        let me = prelim
            .p_ranks
            .get(cfg.rank as usize)
            .ok_or((FailureCause::Internal, format!("prefill rank {} is not in the push map", cfg.rank)))?;
        let ranks: Vec<(u32, u32)> = me.write_ranks.iter().map(|&d| (0, d)).collect();
        let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
        let local = cfg.pair.clone();
        let validate = |meta: &KvxMetadata| -> Result<(), String> {
            let mut p = local.clone();
            p.d = peer_spec(meta, &local)?;
            p.validate_push().map(|_| ()).map_err(|e| e.to_string())
        };
        let peers: Vec<PeerMetadata> = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
        let first = &peers[0];
        pair.d = peer_spec(&first.metadata, &cfg.pair).map_err(|e| (FailureCause::Incompatible, e))?;
        let map = push_map(&pair)?;
        let planner = PushPlanner::new(&pair, &map, cfg.rank)
            .map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        let d_regions = pair.d_geometry(0).regions();
        let first = d_regions.first().map_or(0, |r| r.base_off);
        let out = self.targets(cfg, worker, &peers, first, pair.d_geometry(0).total_bytes())?;
        let write_ranks = planner.map.write_ranks.clone();
        let notif_count = planner.map.notif_count;
        Ok(DEngine {
            planner: WritePlanner::Uniform(Box::new(planner)),
            ranks: out,
            write_ranks,
            notif_count,
            nixl_lists: Vec::new(),
        })
    }

    /// `--transport nixl`: handshakes with the decode engine a registration names as vLLM's
    /// push worker does (vLLM's payload and hash from the decode ranks this rank writes into),
    /// checks their regions are the planned ones, loads their agents and prepares each WRITE's
    /// lists.
    fn connect_nixl(
        &self,
        cfg: &WorkerConfig,
        side: &NixlSide,
        reg: &PushRegistration,
    ) -> Result<DEngine, Failure> {
        if cfg.hybrid.is_some() {
            return Err((FailureCause::Incompatible, "hybrid models are not written through NIXL".into()));
        }
        let endpoint = format!("tcp://{}:{}", reg.decode_host, reg.decode_port);
        let mut pair = cfg.pair.clone();
        pair.d.tp = reg.decode_tp_size;
        let prelim = push_map(&pair)?;
        let me = prelim
            .p_ranks
            .get(cfg.rank as usize)
            .ok_or((FailureCause::Internal, format!("prefill rank {} is not in the push map", cfg.rank)))?;
        let ranks: Vec<(u32, u32)> = me.write_ranks.iter().map(|&d| (0, d)).collect();
        let (d_spec, peers) = nixl::fetch_engine(
            &self.client,
            cfg,
            &endpoint,
            &ranks,
            reg.decode_tp_size,
            &reg.decode_engine_id,
        )?;
        pair.d = d_spec;
        let map = push_map(&pair)?;
        let planner = PushPlanner::new(&pair, &map, cfg.rank)
            .map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        let mut out = BTreeMap::new();
        let mut bases = BTreeMap::new();
        for (tp_rank, meta) in &peers {
            let who = format!("decode rank {tp_rank} at {endpoint}");
            let base = nixl::peer_base(meta, &planner.remote_regions, &who)?;
            let peer = side
                .agent
                .load_peer(&meta.agent_metadata)
                .map_err(|e| (FailureCause::Handshake, format!("load {who}'s NIXL agent: {e}")))?;
            bases.insert(*tp_rank, (peer.name().to_owned(), base, meta.device_id.unwrap_or(0)));
            out.insert(*tp_rank, DTarget { region: None, notify: NotifyPath::Nixl(peer) });
        }
        let nixl_lists = prepare_writes(side, &planner, &bases)?;
        let write_ranks = planner.map.write_ranks.clone();
        let notif_count = planner.map.notif_count;
        Ok(DEngine {
            planner: WritePlanner::Uniform(Box::new(planner)),
            ranks: out,
            write_ranks,
            notif_count,
            nixl_lists,
        })
    }

    /// Connects to each decode rank of `peers` and unpacks its remote key over the `len` bytes
    /// its pool spans from the plan's offset 0 (`first`: the plan's offset of its first
    /// region), with its notification path.
    fn targets(
        &self,
        cfg: &WorkerConfig,
        worker: &Worker,
        peers: &[PeerMetadata],
        first: u64,
        len: u64,
    ) -> Result<BTreeMap<u32, DTarget>, Failure> {
        let mut out = BTreeMap::new();
        for peer in peers {
            let meta = &peer.metadata;
            let r0 = first_region(meta, "decode rank")?;
            if meta.worker_address.is_empty() {
                return Err((
                    FailureCause::PeerGone,
                    format!("decode rank {} advertises no UCX side", meta.tp_rank),
                ));
            }
            let ucx_err = |what: &str, e: UcxError| {
                (classify_ucx(&e), format!("{what} with decode rank {}: {e}", meta.tp_rank))
            };
            let ep = Endpoint::connect(worker, &meta.worker_address, cfg.transport.err_mode)
                .map_err(|e| ucx_err("UCX endpoint", e))?;
            let rkey = PackedRkey::from_bytes(&r0.rkey).map_err(|e| ucx_err("remote key", e))?;
            let region = ep
                .unpack_rkey(&rkey, r0.base_addr - first, len)
                .map_err(|e| ucx_err("unpack remote key", e))?;
            let notify = notify_path(cfg, meta, Some(ep), self.timeout)?;
            out.insert(meta.tp_rank, DTarget { region: Some(region), notify });
        }
        Ok(out)
    }

    /// [`Self::connect`] for a hybrid model: handshakes with the decode ranks this rank writes
    /// into (vLLM's `write_ranks`), learns decode's pool from their metadata, plans the pair
    /// as vLLM's push connector does (or refuses it), checks their regions are the planned
    /// ones, connects and unpacks their remote keys.
    fn connect_hybrid(
        &self,
        cfg: &WorkerConfig,
        worker: &Worker,
        reg: &PushRegistration,
        config: &HybridPairSpec,
    ) -> Result<DEngine, Failure> {
        let incompatible = |e: String| (FailureCause::Incompatible, e);
        let endpoint = format!("tcp://{}:{}", reg.decode_host, reg.decode_port);
        let d_tp = reg.decode_tp_size;
        let mut config = config.clone();
        config.d.tp = d_tp;
        let engine = &reg.decode_engine_id;
        let d = EngineGeometry::new(&config.model, &config.d, Side::Decode)
            .map_err(|e| incompatible(format!("decode engine {engine} (TP {d_tp}): {e}")))?;
        let targets = hybrid_push::write_ranks(config.p.tp, d_tp, cfg.rank);
        let ranks: Vec<(u32, u32)> = targets.iter().map(|&r| (0, r)).collect();
        let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
        let block_tokens = d.sizing.block_tokens;
        let validate = |meta: &KvxMetadata| -> Result<(), String> {
            if meta.tp_size != d_tp {
                Err(format!("TP {} where the registration named {d_tp}", meta.tp_size))
            } else if meta.block_size_tokens != block_tokens {
                Err(format!(
                    "{}-token blocks where {block_tokens} were planned for decode TP {d_tp} (give both engines \
                     the same --block-size and --kernel-block-size)",
                    meta.block_size_tokens
                ))
            } else {
                Ok(())
            }
        };
        let peers: Vec<PeerMetadata> = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
        // Decode's pool: its ranks' first region holds one kernel block per logical block's
        // kernel split.
        if let Some(r0) = peers.first().and_then(|p| p.metadata.regions.first()) {
            let blocks = r0.num_blocks / u64::from(d.physical_per_logical.max(1));
            config.d.num_blocks = u32::try_from(blocks)
                .map_err(|_| incompatible(format!("decode engine {engine}: {blocks} blocks per rank")))?;
        }
        let planner = HybridPlanner::new(&config)
            .and_then(|p| hybrid_push::check_push(&p).map(|()| p))
            .map_err(|e| incompatible(format!("decode engine {engine} (TP {d_tp}): {e}")))?;
        let (first, d_len) = crate::pipeline::worker::plumbing::hybrid_peer_regions(
            &planner.d,
            &peers,
            &format!("decode engine {engine}"),
            &format!("this prefill engine plans for it at TP {d_tp}"),
        )?;
        let out = self.targets(cfg, worker, &peers, first, d_len)?;
        let notif_count = config.p.tp;
        Ok(DEngine {
            planner: WritePlanner::Hybrid(Arc::new(planner)),
            ranks: out,
            write_ranks: targets,
            notif_count,
            nixl_lists: Vec::new(),
        })
    }
}

/// Prepares each WRITE's lists for a handshaked decode engine: this rank's blocks of every
/// region the WRITE covers, and the decode rank's blocks of the same regions (`decode`:
/// per decode rank, its agent, pool base and device).
fn prepare_writes(
    side: &NixlSide,
    planner: &PushPlanner,
    decode: &BTreeMap<u32, (String, u64, u64)>,
) -> Result<Vec<WriteLists>, Failure> {
    let mem = side.mem_type();
    let (local_base, local_dev) = (side.region.addr(), side.region.dev());
    let (local_n, remote_n) = (planner.p_pool as usize, planner.d_pool as usize);
    let nixl = |what: String| move |e: NixlError| (FailureCause::Handshake, format!("{what}: {e}"));
    planner
        .writes
        .iter()
        .map(|w| {
            let Some((agent, base, dev)) = decode.get(&w.d_rank) else {
                return Err((FailureCause::Internal, format!("no NIXL peer for decode rank {}", w.d_rank)));
            };
            let mut l = Vec::with_capacity(w.regions.len() * local_n);
            let mut r = Vec::with_capacity(w.regions.len() * remote_n);
            for x in &w.regions {
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
                .map_err(nixl(format!("prepare the local list for decode rank {}", w.d_rank)))?;
            let remote = side
                .agent
                .prep_remote(agent, &r, mem)
                .map_err(nixl(format!("prepare decode rank {}'s list", w.d_rank)))?;
            Ok(WriteLists { local, remote, local_per_region: local_n, remote_per_region: remote_n })
        })
        .collect()
}

/// A hybrid request's WRITEs from this prefill rank: the request planned for every decode rank
/// from both sides' lists (prefill's as it holds them, decode's as registered), then this
/// rank's WRITEs ([`hybrid_push::writes`]), each one step; with each its decode rank and
/// notification (`"<decode request id>:<prefill TP>"`).
fn hybrid_writes(
    cfg: &WorkerConfig,
    planner: &HybridPlanner,
    reg: &PushRegistration,
    p_request_id: &str,
    held: Option<&HybridHeld>,
) -> Result<Planned, Failure> {
    let incompatible = |e: String| (FailureCause::Incompatible, e);
    let held =
        held.ok_or((FailureCause::Internal, format!("hybrid request {p_request_id} without its lists")))?;
    let local = reg
        .local_block_ids
        .iter()
        .map(|g| g.iter().map(|&b| u32::try_from(b)).collect::<Result<Vec<u32>, _>>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| incompatible("the registration's block ids are out of range".into()))?;
    // Decode's prefix hit is in its lists (they hold only what it loads).
    let tokens = TokenCounts::new(planner.d.has_state(), held.tokens, 0);
    let blocks = ExchangedBlocks::new(
        &planner.p.groups,
        planner.p.sizing.block_tokens,
        planner.d.sizing.block_tokens,
        &held.lists,
        &local,
        tokens.d_external_tokens,
    )
    .map_err(|e| incompatible(e.to_string()))?;
    // Only the decode ranks this rank writes into.
    let targets = hybrid_push::write_ranks(planner.config.p.tp, planner.config.d.tp, cfg.rank);
    let plan = planner
        .plan_exchanged_ranks(tokens, blocks, &targets, p_request_id)
        .map_err(|e| incompatible(e.to_string()))?;
    let notif = format!("{}:{}", reg.request_id, planner.config.p.tp);
    let mut layers = Vec::new();
    let mut writes = Vec::new();
    for w in hybrid_push::writes(planner, &plan, cfg.rank) {
        writes.push((w.d_rank, notif.clone()));
        layers.push(vec![w.pairs]);
    }
    Ok((layers, writes))
}

// ---------------------------------------------------------------------------------------
// Decode side

/// A prefill engine a decode rank registers with.
struct PEngine {
    /// Prefill ranks this decode rank registers with, and how to reach each.
    ranks: BTreeMap<u32, NotifyPath>,
    /// Notifications this decode rank counts per request.
    expected: u32,
    /// Descriptors and bytes the writers put into this rank per decode block.
    descs_per_block: u64,
    /// The pair as the handshake settled it (for verification).
    pair: PairSpec,
    /// UCX transports of the endpoints to the prefill ranks (the pair of hosts the WRITEs
    /// cross), for reports.
    transports: Option<String>,
}

/// Where a request's notifications stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Arrived {
    ok: u32,
    failed: u32,
}

/// The decode side: prefill engines registered with, and the notifications that arrived.
pub struct PushWaiter {
    client: HandshakeClient,
    engines: HashMap<String, PEngine>,
    arrived: HashMap<String, Arrived>,
}

/// What registering and waiting for one request took.
#[derive(Debug, Clone, Default)]
pub struct Landed {
    pub handshake_ns: Option<u64>,
    /// Sending the registrations.
    pub register_ns: u64,
    /// From the registrations sent to the last notification counted.
    pub wait_ns: u64,
    pub descriptors: u64,
    pub pair: Option<PairSpec>,
    /// Filled on the request that handshaked.
    pub transports: Option<String>,
}

impl PushWaiter {
    pub fn new(timeout: Duration) -> Self {
        PushWaiter {
            client: HandshakeClient::new(FetchOptions {
                attempt_timeout: timeout,
                deadline: timeout * 3,
                ..FetchOptions::default()
            }),
            engines: HashMap::new(),
            arrived: HashMap::new(),
        }
    }

    /// Counts a notification (any request's: they may arrive before their request is
    /// waited for).
    pub fn note(&mut self, n: &Notification) {
        match n {
            Notification::Notif { p_request_id, count: _ } => {
                self.arrived.entry(p_request_id.clone()).or_default().ok += 1
            }
            Notification::PushFailed { d_request_id, .. } => {
                self.arrived.entry(d_request_id.clone()).or_default().failed += 1;
            }
            _ => {}
        }
    }

    /// Handshakes (notification only) with the prefill engine in `reg`'s `remote_*` fields
    /// if this rank has not, then sends the registration to the prefill ranks it registers
    /// with. Returns what the handshake took and the prefill engine's expected count.
    pub fn register(
        &mut self,
        cfg: &WorkerConfig,
        worker: Option<&Worker>,
        nixl: Option<&NixlSide>,
        reg: &PushRegistration,
        timeout: Duration,
        landed: &mut Landed,
    ) -> Result<(), Failure> {
        if !self.engines.contains_key(&reg.remote_engine_id) {
            let t = Instant::now();
            let eng = match nixl {
                Some(side) => self.connect_nixl(cfg, side, reg)?,
                None => self.connect(cfg, worker, reg, timeout)?,
            };
            landed.handshake_ns = Some(t.elapsed().as_nanos() as u64);
            self.engines.insert(reg.remote_engine_id.clone(), eng);
        }
        let Some(eng) = self.engines.get(&reg.remote_engine_id) else {
            return Err((FailureCause::Internal, "prefill engine vanished from the cache".into()));
        };
        let t = Instant::now();
        let n = Notification::PushReg(Box::new(reg.clone()));
        for (p, path) in &eng.ranks {
            if let Err(e) = path.send(&n) {
                // As vLLM: other registrations may still trigger the WRITEs.
                tracing::warn!("push registration to prefill rank {p}: {e}");
            }
        }
        landed.register_ns = t.elapsed().as_nanos() as u64;
        landed.descriptors = eng.descs_per_block * reg.local_block_ids.first().map_or(0, |g| g.len() as u64);
        landed.pair = Some(eng.pair.clone());
        if landed.handshake_ns.is_some() {
            landed.transports = eng.transports.clone();
        }
        Ok(())
    }

    /// Whether every notification of `d_request_id` from `engine` arrived: `Ok(true)` when
    /// complete, `Err` when a writer reported a failure.
    pub fn complete(&self, engine: &str, d_request_id: &str) -> Result<bool, Failure> {
        let expected = self.engines.get(engine).map_or(1, |e| e.expected);
        let a = self.arrived.get(d_request_id).copied().unwrap_or_default();
        if a.failed > 0 && a.ok + a.failed >= expected {
            return Err((
                FailureCause::Transfer,
                format!("{} of {expected} prefill WRITEs into this rank failed", a.failed),
            ));
        }
        Ok(a.ok >= expected)
    }

    /// Forgets a request's arrivals (done, failed or given up).
    pub fn forget(&mut self, d_request_id: &str) {
        self.arrived.remove(d_request_id);
    }

    /// A prefill engine that failed this rank is handshaked with again next time.
    pub fn drop_engine(&mut self, engine: &str) {
        self.engines.remove(engine);
    }

    /// `--transport nixl`: the handshake vLLM's decode worker makes to register (its
    /// `notif_agents_only`): vLLM's payload and hash from the prefill ranks this rank registers
    /// with, their agents loaded for notifications; no lists (decode reads nothing).
    fn connect_nixl(
        &self,
        cfg: &WorkerConfig,
        side: &NixlSide,
        reg: &PushRegistration,
    ) -> Result<PEngine, Failure> {
        if cfg.hybrid.is_some() {
            return Err((FailureCause::Incompatible, "hybrid models are not written through NIXL".into()));
        }
        let endpoint = format!("tcp://{}:{}", reg.remote_host, reg.remote_port);
        let mut pair = cfg.pair.clone();
        pair.p.tp = reg.remote_tp_size;
        let prelim = push_map(&pair)?;
        let me = prelim
            .d_ranks
            .get(cfg.rank as usize)
            .ok_or((FailureCause::Internal, format!("decode rank {} is not in the push map", cfg.rank)))?;
        let ranks: Vec<(u32, u32)> = me.registers_with.iter().map(|&p| (0, p)).collect();
        let hs =
            nixl::fetch(&self.client, cfg, &endpoint, &ranks, reg.remote_tp_size, &reg.remote_engine_id)?;
        let pair = hs.pair;
        let (expected, descs_per_block) = d_expectations(cfg, &pair)?;
        let mut out = BTreeMap::new();
        for (tp_rank, meta) in &hs.peers {
            let peer = side.agent.load_peer(&meta.agent_metadata).map_err(|e| {
                (
                    FailureCause::Handshake,
                    format!("load prefill rank {tp_rank}'s NIXL agent at {endpoint}: {e}"),
                )
            })?;
            out.insert(*tp_rank, NotifyPath::Nixl(peer));
        }
        Ok(PEngine { ranks: out, expected, descs_per_block, pair, transports: Some("nixl/UCX".into()) })
    }

    fn connect(
        &self,
        cfg: &WorkerConfig,
        worker: Option<&Worker>,
        reg: &PushRegistration,
        timeout: Duration,
    ) -> Result<PEngine, Failure> {
        let endpoint = format!("tcp://{}:{}", reg.remote_host, reg.remote_port);
        let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
        let (peers, expected, descs_per_block, pair) = match &cfg.hybrid {
            // A hybrid model: vLLM's handshake set, one notification per WRITE into this rank;
            // what the WRITEs hold this rank plans per request.
            Some(config) => {
                let p_tp = reg.remote_tp_size;
                let ranks: Vec<(u32, u32)> =
                    handshake_ranks(p_tp, config.d.tp, cfg.rank).into_iter().map(|r| (0, r)).collect();
                let validate = |meta: &KvxMetadata| -> Result<(), String> {
                    if meta.tp_size == p_tp {
                        Ok(())
                    } else {
                        Err(format!("TP {} where the request named {p_tp}", meta.tp_size))
                    }
                };
                let peers = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
                (peers, hybrid_push::expected_notifs(p_tp, config.d.tp), 0, cfg.pair.clone())
            }
            None => {
                let mut pair = cfg.pair.clone();
                pair.p.tp = reg.remote_tp_size;
                let prelim = push_map(&pair)?;
                let me = prelim.d_ranks.get(cfg.rank as usize).ok_or((
                    FailureCause::Internal,
                    format!("decode rank {} is not in the push map", cfg.rank),
                ))?;
                let ranks: Vec<(u32, u32)> = me.registers_with.iter().map(|&p| (0, p)).collect();
                let local = cfg.pair.clone();
                let validate = |meta: &KvxMetadata| -> Result<(), String> {
                    let mut p = local.clone();
                    p.p = peer_spec(meta, &local)?;
                    p.validate_push().map(|_| ()).map_err(|e| e.to_string())
                };
                let peers = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
                let first = &peers[0];
                pair.p =
                    peer_spec(&first.metadata, &cfg.pair).map_err(|e| (FailureCause::Incompatible, e))?;
                let (expected, descs_per_block) = d_expectations(cfg, &pair)?;
                (peers, expected, descs_per_block, pair)
            }
        };
        let mut out = BTreeMap::new();
        let mut transports = None;
        for peer in &peers {
            let meta = &peer.metadata;
            // An endpoint also with notify = zmq: its lanes name the transports for reports.
            let ep = match (worker, cfg.transport.kind) {
                (Some(w), TransportKind::Ucx) if !meta.worker_address.is_empty() => {
                    Some(Endpoint::connect(w, &meta.worker_address, cfg.transport.err_mode).map_err(|e| {
                        (classify_ucx(&e), format!("UCX endpoint with prefill rank {}: {e}", meta.tp_rank))
                    })?)
                }
                _ => None,
            };
            if transports.is_none() {
                transports = ep.as_ref().and_then(|e| e.transports().ok());
            }
            out.insert(meta.tp_rank, notify_path(cfg, meta, ep, timeout)?);
        }
        Ok(PEngine { ranks: out, expected, descs_per_block, pair, transports })
    }
}

/// What a decode rank of a settled pair waits for: its notification count per request, and
/// the descriptors per decode block its writers put into it (every WRITE into this rank has
/// one pair per region).
fn d_expectations(cfg: &WorkerConfig, pair: &PairSpec) -> Result<(u32, u64), Failure> {
    let map = push_map(pair)?;
    let view = map
        .d_ranks
        .get(cfg.rank as usize)
        .ok_or((FailureCause::Internal, format!("decode rank {} is not in the push map", cfg.rank)))?;
    let mut descs_per_block = 0u64;
    for p in &view.writers {
        let planner =
            PushPlanner::new(pair, &map, *p).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        descs_per_block += planner
            .writes
            .iter()
            .filter(|w| w.d_rank == cfg.rank)
            .map(|w| w.regions.len() as u64)
            .sum::<u64>();
    }
    Ok((view.expected_notifs, descs_per_block))
}
