//! A decode rank: for each request, handshakes with the prefill engine on first contact
//! (lazily, as vLLM does), plans its reads with the planning core, posts one-sided GETs
//! to every source rank, notifies the prefill ranks, and verifies what landed.
//!
//! Requests are served one at a time in arrival order; the time a request waits behind
//! others is its queue time. Verification runs after the notifications and is timed on
//! its own, so it never counts as transfer or pipeline time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::config::worker::WorkerConfig;
use crate::layouts::Region;
use crate::layouts::compat::PairSpec;
use crate::layouts::read_plan::{BlockPairs, Pair, Planner, ReadPlan, RequestBlocks, RequestIds};
use crate::layouts::verify::VerifyPlan;
use crate::pipeline::params::KvTransferParams;
use crate::pipeline::wire::{FailureCause, FromWorker, LoadResult, ReadyInfo, ToWorker};
use crate::pipeline::worker::plumbing::{
    Control, Stage as _, WorkerError, advertised_payload, classify_ucx, compat_factors, fetch_peers,
    first_region, host_pool_mut, peer_pair, rss_bytes,
};
use crate::pipeline::worker::pusher::{Landed, PushWaiter};
use crate::topology::TransferMode;
use crate::topology::{self, TpSpec};
use crate::transfer::handshake::client::{FetchOptions, HandshakeClient};
use crate::transfer::handshake::meta::KvxMetadata;
use crate::transfer::memory::KvBuffer;
use crate::transfer::notify::{
    Notification, NotifyError, NotifyListener, NotifySender, NotifyTransport, PushRegistration,
    UcxNotifyReceiver, UcxNotifySender, heartbeat_interval,
};
use crate::transfer::storage::StorageFetcher;
use crate::transfer::ucx::{
    Context, ContextOptions, Endpoint, ErrMode, MemRegion, PackedRkey, ReadDesc, ReadOptions, RemoteRegion,
    Ucx, UcxError, Worker,
};
use crate::vocab::kinds::TransportKind;

mod hybrid;

type Failure = (FailureCause, String);

struct RemoteRank {
    /// `None` with the storage transport (no UCX connection).
    region: Option<RemoteRegion>,
    /// The cuda-batch transport: the rank's pool mapped with CUDA IPC.
    ipc: Option<std::sync::Arc<crate::transfer::cuda_batch::PeerMapping>>,
    /// Notifications as UCX active messages on `region`'s endpoint (`notify = ucx` with the
    /// UCX transport).
    am: Option<UcxNotifySender>,
    /// Notifications over ZMQ: `notify = zmq`, and whenever UCX does not work (the
    /// storage transport, a multi fallback). `None` with NIXL (vLLM's metadata names no
    /// such endpoint).
    zmq: Option<NotifySender>,
    /// `--transport nixl`: the rank's NIXL agent, loaded into this rank's agent; its
    /// notifications go through NIXL.
    nixl: Option<crate::transfer::nixl::Peer>,
}

impl RemoteRank {
    fn send(&self, n: &Notification, ucx_ok: bool) -> Result<(), NotifyError> {
        if let Some(p) = &self.nixl {
            return p
                .send_notif(&n.encode()?)
                .map_err(|source| NotifyError::Nixl { peer: p.name().to_owned(), source });
        }
        match (&self.am, &self.zmq) {
            (Some(am), _) if ucx_ok => am.send(n),
            (_, Some(zmq)) => zmq.send(n),
            (Some(am), None) => am.send(n),
            (None, None) => Ok(()),
        }
    }
}

/// A prefill engine this rank has handshaked with.
struct RemoteEngine {
    planner: Planner,
    pair: PairSpec,
    p_regions: Vec<Region>,
    ranks: BTreeMap<u32, RemoteRank>,
    transports: Option<String>,
    /// Multi transport: UCX failed for this engine; go straight to the next transport.
    ucx_broken: bool,
    /// `--transport nixl`: each READ's prepared lists (in the planner's read order).
    nixl_lists: Vec<crate::pipeline::worker::nixl::ReadLists>,
}

/// The rank's UCX side. Field order is drop order.
struct UcxSide {
    local: MemRegion<KvBuffer>,
    worker: Worker,
    ctx: Context,
}

/// The rank's KV pool: registered with UCX, or plain (storage transport).
enum Local {
    Ucx(Box<UcxSide>),
    Nixl(Box<crate::pipeline::worker::nixl::NixlSide>),
    Plain(KvBuffer),
}

impl Local {
    fn memory(&self) -> Result<&KvBuffer, Failure> {
        match self {
            Local::Ucx(u) => u.local.memory().map_err(|e| (FailureCause::Internal, e.to_string())),
            Local::Nixl(n) => Ok(n.region.memory()),
            Local::Plain(m) => Ok(m),
        }
    }

    fn memory_mut(&mut self) -> Result<&mut KvBuffer, Failure> {
        match self {
            Local::Ucx(u) => u.local.memory_mut().map_err(|e| (FailureCause::Internal, e.to_string())),
            Local::Nixl(n) => Ok(n.region.memory_mut()),
            Local::Plain(m) => Ok(m),
        }
    }
}

/// Push mode: what a decode rank receives on (completion notifications from the prefill
/// ranks that write into it) and the registrations it has made.
struct PushSide {
    waiter: PushWaiter,
    listener: NotifyListener,
    /// Notifications as UCX active messages (with the UCX transport).
    am: Option<UcxNotifyReceiver>,
}

struct Decoder<'a> {
    cfg: &'a WorkerConfig,
    push: Option<PushSide>,
    /// Control messages that arrived while a push request waited, for the main loop.
    deferred: Vec<ToWorker>,
    /// The engine asked this rank to stop (the message may sit queued behind loads): a push
    /// load waits for no WRITE after that.
    stopping: bool,
    /// Prefill engines a rank of which is gone (push mode): their WRITEs are not waited for.
    gone_engines: std::collections::HashSet<String>,
    /// Push mode: prefill request ids whose prefill failed (the driver released them): a load
    /// of one fails at once instead of waiting for WRITEs that will not come.
    released: std::collections::HashSet<String>,
    /// Loads the engine said to start ([`ToWorker::Go`]) that have not started yet.
    go: std::collections::HashSet<u64>,
    /// The cuda-batch transport's copier; dropped (its stream drained) before the pool.
    batch: Option<crate::pipeline::worker::batch::BatchSide>,
    local: Local,
    /// `--kv-buffer-device cpu`: the KV pool, behind the host buffer `local` registers.
    staged: Option<crate::transfer::memory::KvBuffer>,
    storage: Option<StorageFetcher>,
    geom: crate::layouts::RankGeometry,
    regions: Vec<Region>,
    client: HandshakeClient,
    engines: HashMap<String, RemoteEngine>,
    bufs: Vec<Vec<Pair>>,
    err_mode: ErrMode,
    timeout: Duration,
    /// A hybrid model: its planner and the prefill engines handshaked with.
    hybrid: Option<hybrid::HybridDecode>,
}

pub fn run(ctl: &Control, cfg: WorkerConfig) -> Result<(), WorkerError> {
    let geom = cfg.pair.d_geometry(cfg.rank);
    let hybrid_geom = crate::pipeline::worker::plumbing::hybrid_geometry(&cfg)?;
    let hybrid_cache = crate::pipeline::worker::plumbing::hybrid_cache_geometry(&cfg)?;
    let cache_span = hybrid_cache.as_ref().map(crate::pipeline::worker::plumbing::hybrid_span);
    let hybrid = cfg
        .hybrid
        .as_deref()
        .map(|c| hybrid::HybridDecode::new(c, hybrid_cache))
        .transpose()
        .stage("the hybrid model's descriptor lists")?;
    let (progress, err_mode) = (cfg.transport.progress, cfg.transport.err_mode);
    let kind = cfg.transport.kind;
    let (regions, total) = crate::pipeline::worker::plumbing::rank_regions(&geom, hybrid_geom.as_ref());
    let cache_bytes = cache_span.unwrap_or(total);
    let crate::pipeline::worker::plumbing::RankPool { regions, total, uses_ucx, uses_storage, mem, staged } =
        crate::pipeline::worker::plumbing::rank_pool(&cfg, regions, total, cache_bytes)?;
    let (local, lib) = if kind == TransportKind::Nixl {
        let side = crate::pipeline::worker::nixl::NixlSide::new(&cfg, mem, "d")?;
        let lib = side.library.clone();
        (Local::Nixl(Box::new(side)), lib)
    } else if uses_ucx {
        let ucx = Ucx::load(cfg.transport.ucx_lib.as_deref()).stage("load UCX")?;
        let active_messages = cfg.transport.notify == NotifyTransport::Ucx && kind == TransportKind::Ucx
            || cfg.transport.mode == TransferMode::Push;
        let opts = ContextOptions {
            progress,
            active_messages,
            cuda_device: cfg.mem.device(),
            ..ContextOptions::default()
        };
        let ctx = Context::new(&ucx, &opts).stage("UCX context")?;
        let worker = Worker::new(&ctx).stage("UCX worker")?;
        let local = MemRegion::register(&ctx, mem).stage("register the KV pool with UCX")?;
        let lib = (ucx.path().display().to_string(), ucx.version().to_string());
        (Local::Ucx(Box::new(UcxSide { local, worker, ctx })), lib)
    } else {
        (Local::Plain(mem), (format!("(not loaded: {} transport)", kind.as_str()), String::new()))
    };
    let batch = match kind {
        TransportKind::CudaBatch => Some(crate::pipeline::worker::batch::BatchSide::new(
            cfg.mem,
            cfg.transport.batch_copy,
            cfg.transport.batch_launch,
            cfg.transport.batch_descriptors,
        )?),
        _ => None,
    };
    let storage = if uses_storage {
        let opts = crate::pipeline::worker::plumbing::storage_options(&cfg);
        Some(StorageFetcher::new(opts).stage("storage transport")?)
    } else {
        None
    };
    let timeout = Duration::from_millis(cfg.timeout_ms);
    // Push mode: this rank is written into, so it advertises its pool on the engine's side
    // channel (prefill ranks handshake with it) and listens for completion notifications.
    let (push, handshake_payload) = if cfg.transport.mode == TransferMode::Push {
        let (side, payload) = push_side(&cfg, &local, &regions, timeout)?;
        (Some(side), Some(payload))
    } else {
        (None, None)
    };
    ctl.send(&FromWorker::Ready(Box::new(ReadyInfo {
        rank: cfg.rank,
        handshake_payload,
        ucx_library: lib.0,
        ucx_version: lib.1,
        // With a host buffer the rank holds the pool twice over (pool and buffer).
        pool_bytes: total as u64 + if staged.is_some() { cache_bytes } else { 0 },
        rss_bytes: rss_bytes(),
    })))?;
    let client = HandshakeClient::new(FetchOptions {
        attempt_timeout: timeout,
        deadline: timeout * 3,
        ..FetchOptions::default()
    });
    let mut d = Decoder {
        cfg: &cfg,
        push,
        deferred: Vec::new(),
        stopping: false,
        gone_engines: Default::default(),
        released: Default::default(),
        go: Default::default(),
        batch,
        local,
        staged,
        storage,
        geom,
        regions,
        client,
        engines: HashMap::new(),
        bufs: Vec::new(),
        err_mode,
        timeout,
        hybrid,
    };
    let hb_every = heartbeat_interval(Duration::from_millis(cfg.lease_ms));
    let mut queue: VecDeque<(Instant, ToWorker)> = VecDeque::new();
    let mut last_hb = Instant::now();
    loop {
        if d.next_ready(&queue).is_none()
            && let Some(m) = ctl.recv(Duration::from_millis(100))?
            && let Some(m) = d.admit(m)
        {
            queue.push_back((Instant::now(), m));
        }
        while let Some(m) = ctl.try_recv()? {
            if let Some(m) = d.admit(m) {
                queue.push_back((Instant::now(), m));
            }
        }
        if last_hb.elapsed() >= hb_every {
            d.heartbeats(&queue);
            last_hb = Instant::now();
        }
        let Some((received, msg)) = d.next_ready(&queue).and_then(|i| queue.remove(i)) else { continue };
        match msg {
            ToWorker::Load { req, d_request_id, params, local_blocks, seed, side_channel, .. } => {
                d.go.remove(&req);
                let push = params.transfer_mode == TransferMode::Push;
                let job = LoadJob {
                    received,
                    req,
                    d_request_id: &d_request_id,
                    params: &params,
                    local_blocks,
                    seed,
                };
                let r = if push {
                    let r = d.push_load(ctl, job, side_channel);
                    let now = Instant::now();
                    for m in std::mem::take(&mut d.deferred) {
                        if let Some(m) = d.admit(m) {
                            queue.push_back((now, m));
                        }
                    }
                    r
                } else {
                    d.load(job)
                };
                ctl.send(&FromWorker::Loaded(Box::new(r)))?;
            }
            ToWorker::Shutdown => return Ok(()),
            ToWorker::Fault(crate::config::worker::Fault::Exit) => crate::transfer::nixl::exit(3),
            _ => {}
        }
    }
}

/// One `Load` message as a decode rank works on it.
struct LoadJob<'m> {
    /// When the message was queued.
    received: Instant,
    req: u64,
    d_request_id: &'m str,
    params: &'m KvTransferParams,
    local_blocks: Vec<u32>,
    seed: u64,
}

impl Decoder<'_> {
    /// Heartbeats for requests still waiting, so their prefill leases are extended.
    fn heartbeats(&self, queue: &VecDeque<(Instant, ToWorker)>) {
        let mut by_engine: HashMap<&str, Vec<String>> = HashMap::new();
        for (_, m) in queue {
            if let ToWorker::Load { params, .. } = m {
                by_engine
                    .entry(params.remote_engine_id.as_str())
                    .or_default()
                    .push(params.remote_request_id.clone());
            }
        }
        for (engine, ids) in by_engine {
            if let Some(e) = self.engines.get(engine) {
                let hb = Notification::Heartbeat { ids };
                for r in e.ranks.values() {
                    let _ = r.send(&hb, !e.ucx_broken);
                }
            }
        }
    }

    /// Checks the received blocks against the plan (staged through the host for device
    /// memory); the bytes verified, or the first byte that differs, go into `r`.
    fn verify(&self, r: &mut LoadResult, plan: &VerifyPlan) -> Result<(), Failure> {
        let (mut bytes, mut mismatch) = (0, None);
        // With a host buffer, what the model sees is the pool the buffer was copied into.
        let kv = match &self.staged {
            Some(pool) => pool,
            None => self.local.memory()?,
        };
        kv.read_ranges(&plan.ranges(), |i, got| {
            if mismatch.is_none() {
                match plan.check(i, got) {
                    Ok(n) => bytes += n,
                    Err(m) => mismatch = Some(m),
                }
            }
        })
        .map_err(|e| (FailureCause::Internal, format!("read back the received blocks: {e}")))?;
        match mismatch {
            None => r.bytes_verified = bytes,
            Some(m) => r.verify_failure = Some(m.to_string()),
        }
        Ok(())
    }

    fn handshake(&mut self, params: &KvTransferParams) -> Result<RemoteEngine, Failure> {
        if let Local::Nixl(side) = &self.local {
            return handshake_nixl(self.cfg, &self.client, side, params);
        }
        let cfg = self.cfg;
        let endpoint = format!("tcp://{}:{}", params.remote_host, params.remote_port);
        let tp = TpSpec {
            p_tp: params.tp_size,
            d_tp: cfg.pair.d.tp,
            num_kv_heads: cfg.pair.model.num_kv_heads,
            use_mla: cfg.pair.model.is_mla(),
            version: cfg.pair.version,
        };
        let prelim = topology::rank_map(&tp).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        let ranks: Vec<(u32, u32)> =
            prelim.d_ranks[cfg.rank as usize].handshake_ranks.iter().map(|&r| (0, r)).collect();
        let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
        let validate = |meta: &KvxMetadata| -> Result<(), String> {
            let pair = peer_pair(&cfg.pair, meta)?;
            pair.validate().map(|_| ()).map_err(|e| e.to_string())
        };
        let peers = fetch_peers(&self.client, &endpoint, &ranks, &factors, validate)?;
        let first = &peers[0];
        let pair = peer_pair(&cfg.pair, &first.metadata).map_err(|e| (FailureCause::Incompatible, e))?;
        let map = pair.validate().map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        let planner =
            Planner::new(&pair, &map, cfg.rank).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        let p_geom = pair.p_geometry(0);
        let p_regions = p_geom.regions();
        let p_len = p_geom.total_bytes();
        let mut out = BTreeMap::new();
        for peer in &peers {
            let first = p_regions.first().map_or(0, |r| r.base_off);
            out.insert(peer.metadata.tp_rank, self.connect_peer(&peer.metadata, first, p_len)?);
        }
        let ucx_broken = out.values().any(|r| r.region.is_none());
        Ok(RemoteEngine {
            planner,
            pair,
            p_regions,
            ranks: out,
            transports: None,
            ucx_broken,
            nixl_lists: Vec::new(),
        })
    }

    /// Connects to one prefill rank from its metadata: UCX endpoint and remote key (the
    /// rank's pool of `p_len` bytes, its first region `first_base_off` past the base), its
    /// notification channels, its CUDA IPC mapping (cuda-batch).
    fn connect_peer(
        &self,
        meta: &KvxMetadata,
        first_base_off: u64,
        p_len: u64,
    ) -> Result<RemoteRank, Failure> {
        let cfg = self.cfg;
        let r0 = first_region(meta, "peer")?;
        let base = r0.base_addr - first_base_off;
        let ucx_err = |what: &str, e: UcxError| {
            (classify_ucx(&e), format!("{what} with prefill rank {}: {e}", meta.tp_rank))
        };
        // Multi: a UCX connection that cannot be made leaves the next transport to serve.
        let region = match &self.local {
            Local::Ucx(u) => {
                let connect = || -> Result<RemoteRegion, Failure> {
                    if meta.worker_address.is_empty() {
                        return Err((
                            FailureCause::PeerGone,
                            format!(
                                "prefill rank {} advertises no UCX side (it was torn down): its blocks \
                                 cannot be read over UCX",
                                meta.tp_rank
                            ),
                        ));
                    }
                    let ep = Endpoint::connect(&u.worker, &meta.worker_address, self.err_mode)
                        .map_err(|e| ucx_err("UCX endpoint", e))?;
                    let rkey = PackedRkey::from_bytes(&r0.rkey).map_err(|e| ucx_err("remote key", e))?;
                    ep.unpack_rkey(&rkey, base, p_len).map_err(|e| ucx_err("unpack remote key", e))
                };
                match connect() {
                    Ok(r) => Some(r),
                    Err(e) if self.storage.is_some() => {
                        tracing::warn!("{}; falling back to storage", e.1);
                        None
                    }
                    Err(e) => return Err(e),
                }
            }
            Local::Plain(_) | Local::Nixl(_) => None,
        };
        let notify_ep = meta.notify_endpoint.clone().ok_or((
            FailureCause::Incompatible,
            format!("prefill rank {} has no notification endpoint", meta.tp_rank),
        ))?;
        let zmq = NotifySender::connect(&notify_ep, self.timeout)
            .map_err(|e| (FailureCause::Handshake, format!("notification channel {notify_ep}: {e}")))?;
        // Multi keeps notifications on ZMQ: a channel that shares UCX's fate would lose
        // them exactly when the fallback is needed.
        let am = match (&region, cfg.transport.notify, cfg.transport.kind) {
            (Some(rg), NotifyTransport::Ucx, TransportKind::Ucx) => Some(UcxNotifySender::new(
                rg.endpoint().clone(),
                format!("prefill rank {}", meta.tp_rank),
                self.timeout,
            )),
            _ => None,
        };
        let ipc = self.batch.as_ref().map(|b| b.open(meta)).transpose()?;
        Ok(RemoteRank { region, ipc, am, zmq: Some(zmq), nixl: None })
    }

    /// The queue's first message this rank can act on now: a load the engine holds back (its
    /// ranks start together, [`ToWorker::Go`]) waits, and what comes after it goes first (a
    /// shutdown among them: a held load never starts once the engine stops).
    fn next_ready(&self, queue: &VecDeque<(Instant, ToWorker)>) -> Option<usize> {
        queue.iter().position(|(_, m)| match m {
            ToWorker::Load { req, go, .. } => *go || self.go.contains(req),
            _ => true,
        })
    }

    /// Takes a control message as it arrives: word that a prefill engine's rank is gone, that
    /// a request's prefill was released, or that a held load may start, applies at once (a load queued before it must not wait
    /// for WRITEs that will not come); anything else is returned to be queued in order.
    fn admit(&mut self, m: ToWorker) -> Option<ToWorker> {
        match m {
            ToWorker::Go { req } => {
                self.go.insert(req);
                None
            }
            ToWorker::PeerGone { engine_id } => {
                self.gone_engines.insert(engine_id);
                None
            }
            ToWorker::Shutdown => {
                self.stopping = true;
                Some(ToWorker::Shutdown)
            }
            ToWorker::Release { p_request_id } => {
                // Bounded: an id is removed when its load arrives; ids of loads that never
                // come (pull mode) are dropped wholesale past a cap.
                if self.released.len() >= 4096 {
                    self.released.clear();
                }
                self.released.insert(p_request_id);
                None
            }
            other => Some(other),
        }
    }

    /// The result of request `req` as its load starts: this rank, the time it queued.
    fn started(&self, req: u64, received: Instant) -> LoadResult {
        LoadResult {
            req,
            d_rank: self.cfg.rank,
            queue_ns: received.elapsed().as_nanos() as u64,
            transport: Some(TransportKind::Ucx),
            ..LoadResult::default()
        }
    }

    fn load(&mut self, job: LoadJob<'_>) -> LoadResult {
        let params = job.params;
        let mut r = self.started(job.req, job.received);
        let t0 = Instant::now();
        let result = match self.hybrid.take() {
            Some(mut h) => {
                let result = self.load_hybrid(&mut h, &mut r, t0, job);
                if let Err((FailureCause::PeerGone | FailureCause::Timeout | FailureCause::Transfer, _)) =
                    &result
                {
                    h.forget(&params.remote_engine_id);
                }
                self.hybrid = Some(h);
                result
            }
            None => self.load_inner(&mut r, t0, job),
        };
        if let Err((cause, msg)) = result {
            // A broken connection is re-established on the next request.
            if matches!(cause, FailureCause::PeerGone | FailureCause::Timeout | FailureCause::Transfer) {
                self.engines.remove(&params.remote_engine_id);
            }
            r.error = Some((cause, msg));
        }
        r
    }

    fn load_inner(&mut self, r: &mut LoadResult, t0: Instant, job: LoadJob<'_>) -> Result<(), Failure> {
        let LoadJob { d_request_id, params, local_blocks, seed, .. } = job;
        if !self.engines.contains_key(&params.remote_engine_id) {
            let th = Instant::now();
            let engine = self.handshake(params)?;
            r.handshake_ns = Some(th.elapsed().as_nanos() as u64);
            self.engines.insert(params.remote_engine_id.clone(), engine);
        }
        let timeout = self.timeout;
        let inflight = self.cfg.transport.inflight.max(1) as usize;
        let coalesce = self.cfg.transport.coalesce;
        let Some(eng) = self.engines.get_mut(&params.remote_engine_id) else {
            return Err((FailureCause::Internal, "engine vanished from the cache".into()));
        };
        // Plan.
        let tp = Instant::now();
        let remote = params.block_ids().map_err(|e| (FailureCause::Incompatible, e))?;
        let blocks = RequestBlocks { local: local_blocks, remote };
        let bp = eng.planner.pair_blocks(&blocks).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
        self.bufs.resize_with(eng.planner.reads.len(), Vec::new);
        let coalesced = if coalesce { Some(eng.planner.coalesced(&bp)) } else { None };
        // cuda-batch with --batch-descriptors device: the GPU makes the descriptors from the
        // plan's grid, so the pairs are never materialised here.
        let grid = !coalesce
            && self
                .batch
                .as_ref()
                .is_some_and(|b| b.device_descriptors(eng.planner.reads.iter().flat_map(|rd| &rd.regions)));
        if !coalesce && !grid {
            eng.planner.plan_into(&bp, &mut self.bufs);
        }
        r.plan_ns = tp.elapsed().as_nanos() as u64;
        r.descs_raw = (eng.planner.pairs_per_read(&bp) * eng.planner.reads.len()) as u64;
        r.descs_coalesced = match &coalesced {
            Some(c) => c.iter().map(Vec::len).sum::<usize>() as u64,
            None => eng.planner.coalesced_counts(&bp).iter().sum::<usize>() as u64,
        };
        // Read: over UCX, or through storage (the storage transport, or a multi fallback).
        let tt = Instant::now();
        let tt_mono = crate::clock::now_ns();
        let ucx_first =
            matches!(self.cfg.transport.kind, TransportKind::Ucx | TransportKind::Multi) && !eng.ucx_broken;
        // cuda-batch: one batched copy over all source ranks' mapped pools (`--batch-launch
        // rank`), or one per source rank, each posted while the ones before it copy; then one
        // wait for all of them.
        if let Some(side) = self.batch.as_mut().filter(|_| grid) {
            let mem = self.local.memory_mut()?;
            let reads: Vec<crate::pipeline::worker::batch::GridRead<'_>> = eng
                .planner
                .reads
                .iter()
                .map(|read| {
                    let ipc = eng.ranks.get(&read.p_rank).and_then(|rk| rk.ipc.as_ref());
                    (read.p_rank, ipc, read.regions.as_slice())
                })
                .collect();
            side.read_grid(mem, &reads, &bp, timeout, r)?;
        } else if let Some(side) = self.batch.as_mut() {
            let mem = self.local.memory_mut()?;
            let reads: Vec<crate::pipeline::worker::batch::BatchRead<'_>> = eng
                .planner
                .reads
                .iter()
                .enumerate()
                .map(|(i, read)| {
                    let pairs = coalesced.as_ref().map_or(&self.bufs[i], |c| &c[i]);
                    (
                        read.p_rank,
                        eng.ranks.get(&read.p_rank).and_then(|rk| rk.ipc.as_ref()),
                        pairs.as_slice(),
                    )
                })
                .collect();
            side.read_request(mem, &reads, timeout, r)?;
        }
        if let (Local::Nixl(side), TransportKind::Nixl) = (&self.local, self.cfg.transport.kind) {
            // The completion notification rides each READ, as vLLM's does.
            let notif = Notification::Notif {
                p_request_id: params.remote_request_id.clone(),
                count: eng.planner.map.notif_count,
            }
            .encode()
            .map_err(|e| (FailureCause::Notify, e.to_string()))?;
            if !blocks.local.is_empty() {
                let (bytes, post_ns) = crate::pipeline::worker::nixl::read_request(
                    side,
                    &eng.planner,
                    &eng.nixl_lists,
                    &bp,
                    &notif,
                    timeout,
                )?;
                r.bytes += bytes;
                r.post_ns += post_ns;
            }
            r.transport = Some(TransportKind::Nixl);
            if eng.transports.is_none() {
                eng.transports = Some("nixl/UCX".into());
            }
        }
        let mut ucx_error: Option<Failure> = None;
        if ucx_first {
            let Local::Ucx(u) = &mut self.local else {
                return Err((FailureCause::Internal, "UCX transport without a UCX side".into()));
            };
            for (i, read) in eng.planner.reads.iter().enumerate() {
                let Some(region) = eng.ranks.get(&read.p_rank).and_then(|rk| rk.region.as_ref()) else {
                    ucx_error = Some((
                        FailureCause::PeerGone,
                        format!("no UCX connection to prefill rank {}", read.p_rank),
                    ));
                    break;
                };
                let pairs = coalesced.as_ref().map_or(&self.bufs[i], |c| &c[i]);
                let descs =
                    pairs.iter().map(|p| ReadDesc { local_off: p.local, remote_off: p.remote, len: p.len });
                match region.read_batch(&mut u.local, descs, &ReadOptions { max_inflight: inflight, timeout })
                {
                    Ok(stats) => {
                        r.post_ns += stats.post_ns;
                        r.bytes += stats.bytes;
                    }
                    Err(e) => {
                        ucx_error =
                            Some((classify_ucx(&e), format!("read from prefill rank {}: {e}", read.p_rank)));
                        break;
                    }
                }
            }
            if ucx_error.is_none() && eng.transports.is_none() {
                eng.transports = ucx_choices(&eng.ranks, &u.ctx, r);
            }
        }
        let nixl = self.cfg.transport.kind == TransportKind::Nixl;
        if (!ucx_first || ucx_error.is_some()) && self.batch.is_none() && !nixl {
            let Some(fetcher) = self.storage.as_mut() else {
                return Err(ucx_error.unwrap_or((FailureCause::Internal, "no transport to read with".into())));
            };
            if let Some((cause, msg)) = &ucx_error {
                // Multi: the first transport failed; ask every source rank to publish.
                tracing::warn!(
                    "request {}: UCX failed ({} {msg}); falling back to storage",
                    r.req,
                    cause.as_str()
                );
                eng.ucx_broken = true;
                r.fallbacks += 1;
                r.bytes = 0;
                r.post_ns = 0;
            }
            if self.cfg.transport.kind == TransportKind::Multi {
                let fb = Notification::Fallback { ids: vec![params.remote_request_id.clone()] };
                for read in &eng.planner.reads {
                    if let Some(rank) = eng.ranks.get(&read.p_rank) {
                        rank.send(&fb, false).map_err(|e| {
                            (
                                FailureCause::Notify,
                                format!("ask prefill rank {} to publish: {e}", read.p_rank),
                            )
                        })?;
                    }
                }
            }
            let reads: Vec<ReadPlan> = eng
                .planner
                .reads
                .iter()
                .enumerate()
                .map(|(i, rd)| ReadPlan {
                    p_rank: rd.p_rank,
                    notif_msg: String::new(),
                    pairs: coalesced.as_ref().map_or_else(|| self.bufs[i].clone(), |c| c[i].clone()),
                })
                .collect();
            let mem = host_pool_mut(self.local.memory_mut()?)
                .map_err(|e| (FailureCause::Internal, e.to_string()))?;
            let stats = fetcher
                .fetch(
                    &params.remote_engine_id,
                    &params.remote_request_id,
                    &reads,
                    &eng.p_regions,
                    &blocks.remote,
                    mem.as_mut_slice(),
                    timeout,
                )
                .map_err(|e| (FailureCause::Transfer, format!("storage read: {e}")))?;
            r.bytes = stats.bytes;
            r.transport = Some(TransportKind::Storage);
            r.transports = Some("storage".into());
        }
        if self.cfg.transport.slowdown > 0.0 {
            // A staged regression for testing gates (`--slowdown`): the read takes longer.
            std::thread::sleep(tt.elapsed().mul_f64(self.cfg.transport.slowdown));
        }
        r.transfer_ns = tt.elapsed().as_nanos() as u64;
        r.transfer_span = Some(crate::clock::ClockSpan::since(tt_mono));
        if r.transports.is_none() {
            r.transports = eng.transports.clone();
        }
        // Notify.
        let tn = Instant::now();
        let ids = RequestIds {
            p_request_id: params.remote_request_id.clone(),
            d_request_id: d_request_id.to_string(),
        };
        let full_hit = blocks.local.is_empty();
        let ucx_ok = !eng.ucx_broken;
        if !full_hit && !nixl {
            let done = Notification::Notif {
                p_request_id: ids.p_request_id.clone(),
                count: eng.planner.map.notif_count,
            };
            for read in &eng.planner.reads {
                if let Some(rank) = eng.ranks.get(&read.p_rank) {
                    rank.send(&done, ucx_ok).map_err(|e| {
                        (FailureCause::Notify, format!("notify prefill rank {}: {e}", read.p_rank))
                    })?;
                }
            }
        }
        for n in eng.planner.notifs_only(&ids, full_hit) {
            let (id, count) = n.msg.rsplit_once(':').unwrap_or((n.msg.as_str(), "1"));
            if let Some(rank) = eng.ranks.get(&n.p_rank) {
                let done =
                    Notification::Notif { p_request_id: id.to_owned(), count: count.parse().unwrap_or(1) };
                rank.send(&done, ucx_ok)
                    .map_err(|e| (FailureCause::Notify, format!("notify prefill rank {}: {e}", n.p_rank)))?;
            }
        }
        r.notify_ns = tn.elapsed().as_nanos() as u64;
        r.e2e_ns = t0.elapsed().as_nanos() as u64;
        // Host buffer: the received blocks into the KV pool (vLLM's `sync_recved_kv_to_device`),
        // every layer of each block, timed as its own stage.
        if let Some(pool) = self.staged.as_mut() {
            let ts = Instant::now();
            crate::transfer::memory::copy_ranges(
                self.local.memory()?,
                pool,
                &crate::pipeline::worker::plumbing::block_ranges(&self.regions, &blocks.local),
            )
            .map_err(|e| {
                (FailureCause::Internal, format!("copy the received blocks into the KV pool: {e}"))
            })?;
            r.sync_ns = ts.elapsed().as_nanos() as u64;
        }
        // Verify (outside the timed path).
        if self.cfg.verify.stride().is_some() && self.cfg.fill == crate::vocab::kinds::FillPattern::Peer {
            let tv = Instant::now();
            verify_peer(self.local.memory()?, r, &eng.planner, &eng.p_regions, &bp)?;
            r.verify_ns = tv.elapsed().as_nanos() as u64;
        } else if let Some(stride) = self.cfg.verify.stride() {
            let tv = Instant::now();
            let plan = VerifyPlan::new(
                &self.geom,
                &self.regions,
                &bp,
                eng.planner.bsr,
                eng.pair.permutes(),
                eng.pair.p.block_tokens,
                seed,
                stride,
            );
            self.verify(r, &plan)?;
            r.verify_ns = tv.elapsed().as_nanos() as u64;
        }
        Ok(())
    }
}

/// What UCX chose at an engine's first reads, said once per engine: its protocols and settings
/// (into `r`), and the transports of its endpoints (returned).
fn ucx_choices(ranks: &BTreeMap<u32, RemoteRank>, ctx: &Context, r: &mut LoadResult) -> Option<String> {
    r.protocols = Some(ctx.protocols().only(crate::transfer::ucx::Rma::Get));
    r.ucx_settings = Some(ctx.env_notes().to_vec());
    ranks.values().filter_map(|rk| rk.region.as_ref().and_then(|rg| rg.endpoint().transports().ok())).next()
}

/// Push mode: binds the notification listener, registers the active-message handler, and
/// encodes the metadata prefill ranks handshake for (worker address, the pool's remote key
/// and regions, the notification endpoint).
fn push_side(
    cfg: &WorkerConfig,
    local: &Local,
    regions: &[Region],
    timeout: Duration,
) -> Result<(PushSide, Vec<u8>), WorkerError> {
    use crate::transfer::ucx::Registrable as _;
    let listener = NotifyListener::bind(&format!("tcp://{}:0", cfg.bind_host))
        .stage("bind the push notification listener")?;
    let notify_ep = crate::pipeline::worker::prefill::advertise(listener.endpoint(), &cfg.advertise_host);
    let (address, rkey, base, am) = match local {
        Local::Ucx(u) => (
            u.worker.address().stage("UCX worker address")?,
            u.local.pack_rkey().stage("pack the remote key")?.as_bytes().to_vec(),
            u.local.addr(),
            Some(UcxNotifyReceiver::new(&u.worker).stage("UCX notification handler")?),
        ),
        Local::Plain(m) => (Vec::new(), Vec::new(), m.addr(), None),
        Local::Nixl(n) => {
            // vLLM's payload: prefill ranks read this rank's agent and regions from it.
            let payload = crate::pipeline::worker::nixl::advertised_payload(cfg, &cfg.pair.d, regions, n)?;
            return Ok((PushSide { waiter: PushWaiter::new(timeout), listener, am: None }, payload));
        }
    };
    let payload = advertised_payload(cfg, &cfg.pair.d, regions, base, address, &rkey, &notify_ep, None)?;
    Ok((PushSide { waiter: PushWaiter::new(timeout), listener, am }, payload))
}

impl Decoder<'_> {
    /// Push mode: registers the request's blocks with the prefill ranks, waits for every
    /// WRITE's notification (or a failure notification, or the deadline), then verifies.
    fn push_load(
        &mut self,
        ctl: &Control,
        job: LoadJob<'_>,
        side_channel: Option<(String, u16)>,
    ) -> LoadResult {
        let (d_request_id, params) = (job.d_request_id, job.params);
        let mut r = self.started(job.req, job.received);
        let t0 = Instant::now();
        if let Err((cause, msg)) = self.push_load_inner(ctl, &mut r, t0, job, side_channel) {
            if let Some(p) = self.push.as_mut() {
                p.waiter.forget(d_request_id);
                if matches!(cause, FailureCause::PeerGone | FailureCause::Timeout | FailureCause::Transfer) {
                    p.waiter.drop_engine(&params.remote_engine_id);
                }
            }
            r.error = Some((cause, msg));
        }
        r
    }

    fn push_load_inner(
        &mut self,
        ctl: &Control,
        r: &mut LoadResult,
        t0: Instant,
        job: LoadJob<'_>,
        side_channel: Option<(String, u16)>,
    ) -> Result<(), Failure> {
        let LoadJob { d_request_id, params, local_blocks, seed, .. } = job;
        let cfg = self.cfg;
        let timeout = self.timeout;
        let gone = |engine: &str| {
            (
                FailureCause::PeerGone,
                format!("a rank of prefill engine {engine} is gone: its WRITEs will not come"),
            )
        };
        if self.gone_engines.contains(&params.remote_engine_id) {
            return Err(gone(&params.remote_engine_id));
        }
        let released = |id: &str| {
            (
                FailureCause::Transfer,
                format!("prefill of request {id} failed and was released: its WRITEs will not come"),
            )
        };
        if self.released.remove(&params.remote_request_id) {
            return Err(released(&params.remote_request_id));
        }
        let (decode_host, decode_port) = side_channel.ok_or((
            FailureCause::Internal,
            "push mode needs this decode engine's side channel, which it did not start".into(),
        ))?;
        // A hybrid model: the lists per group its scheduler registers (clipped).
        let hybrid = match &self.hybrid {
            Some(h) => Some(h.push_lists(params, &local_blocks)?),
            None => None,
        };
        let local_block_ids = match &hybrid {
            Some((_, lists)) => lists.iter().map(|g| g.iter().map(|&b| u64::from(b)).collect()).collect(),
            None => vec![local_blocks.iter().map(|&b| u64::from(b)).collect()],
        };
        let reg = PushRegistration {
            request_id: d_request_id.to_string(),
            decode_engine_id: cfg.engine_id.clone(),
            decode_host,
            decode_port,
            decode_tp_size: cfg.pair.d.tp,
            local_block_ids,
            remote_engine_id: params.remote_engine_id.clone(),
            remote_host: params.remote_host.clone(),
            remote_port: params.remote_port,
            remote_tp_size: params.tp_size,
            remote_pp_size: params.pp_size,
            // Empty when decode was sent before prefill answered (concurrent dispatch): prefill
            // then matches the registration by the base id both legs share.
            remote_request_id: (!params.remote_request_id.is_empty())
                .then(|| params.remote_request_id.clone()),
        };
        let (worker, nixl) = match &self.local {
            Local::Ucx(u) => (Some(&u.worker), None),
            Local::Nixl(n) => (None, Some(&**n)),
            Local::Plain(_) => (None, None),
        };
        let Some(push) = self.push.as_mut() else {
            return Err((FailureCause::Internal, "a push request reached a pull-mode decode rank".into()));
        };
        let mut landed = Landed::default();
        push.waiter.register(cfg, worker, nixl, &reg, timeout, &mut landed)?;
        r.handshake_ns = landed.handshake_ns;
        r.post_ns = landed.register_ns;
        r.descs_raw = landed.descriptors;
        r.descs_coalesced = landed.descriptors;
        r.transports = landed.transports.clone();
        // Wait for the WRITEs' notifications.
        let tw = Instant::now();
        let deadline = tw + timeout;
        loop {
            // A shutdown that came in behind this load (queued by the main loop, or read here
            // and deferred) ends the wait: nobody will take the answer.
            if self.stopping {
                return Err((FailureCause::Internal, "the engine is shutting down".into()));
            }
            let mut got = push.listener.drain().map_err(|e| (FailureCause::Notify, e.to_string()))?;
            if let Local::Ucx(u) = &self.local {
                while u.worker.progress() > 0 {}
            }
            if let Some(am) = push.am.as_mut() {
                got.extend(am.drain());
            }
            if let Some(side) = nixl {
                let (n, unrecognized) = side.drain();
                if unrecognized > 0 {
                    tracing::warn!("{unrecognized} NIXL notifications that are not vLLM's");
                }
                got.extend(n);
            }
            for n in &got {
                push.waiter.note(n);
            }
            if push.waiter.complete(&params.remote_engine_id, d_request_id)? {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err((
                    FailureCause::Timeout,
                    format!(
                        "the prefill ranks' WRITEs of request {} did not all arrive within {timeout:?}",
                        params.remote_request_id
                    ),
                ));
            }
            // NIXL has no event to wait on: its notifications are polled (as vLLM polls them).
            let most = if nixl.is_some() { Duration::from_millis(1) } else { Duration::from_millis(20) };
            let wait = deadline.saturating_duration_since(now).min(most);
            if let Local::Ucx(u) = &self.local
                && !u.worker.arm().map_err(|e| (FailureCause::Internal, e.to_string()))?
            {
                continue;
            }
            // The control socket too: a shutdown, or word that a writer is gone, ends the wait.
            let mut items = vec![
                push.listener.socket().as_poll_item(zmq::POLLIN),
                ctl.socket().as_poll_item(zmq::POLLIN),
            ];
            if let Local::Ucx(u) = &self.local
                && let Some(fd) = u.worker.event_fd()
            {
                items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
            }
            zmq::poll(&mut items, (wait.as_millis() as i64).max(1))
                .map_err(|e| (FailureCause::Internal, format!("wait for notifications: {e}")))?;
            while let Some(m) = ctl.try_recv().map_err(|e| (FailureCause::Internal, e.to_string()))? {
                match m {
                    ToWorker::PeerGone { engine_id } => {
                        let mine = engine_id == params.remote_engine_id;
                        self.gone_engines.insert(engine_id);
                        if mine {
                            return Err(gone(&params.remote_engine_id));
                        }
                    }
                    ToWorker::Shutdown => {
                        self.stopping = true;
                        self.deferred.push(ToWorker::Shutdown);
                        return Err((FailureCause::Internal, "the engine is shutting down".into()));
                    }
                    ToWorker::Release { p_request_id } if p_request_id == params.remote_request_id => {
                        return Err(released(&p_request_id));
                    }
                    other => self.deferred.push(other),
                }
            }
        }
        push.waiter.forget(d_request_id);
        r.transfer_ns = tw.elapsed().as_nanos() as u64;
        if let (Some((tokens, lists)), Some(mut h)) = (hybrid, self.hybrid.take()) {
            r.e2e_ns = t0.elapsed().as_nanos() as u64;
            let result = self.push_landed(&mut h, r, params, (tokens, &lists), seed);
            self.hybrid = Some(h);
            return result;
        }
        r.bytes = self.regions.iter().map(|x| x.block_len).sum::<u64>() * local_blocks.len() as u64;
        r.e2e_ns = t0.elapsed().as_nanos() as u64;
        // Verify: decode's blocks hold the prompt's last blocks (a prefix hit keeps the first).
        if let (Some(stride), Some(pair)) = (cfg.verify.stride(), landed.pair) {
            let tv = Instant::now();
            let n_p = params.remote_num_tokens.div_ceil(u64::from(pair.p.block_tokens.max(1))) as usize;
            let bp = BlockPairs {
                local: local_blocks.iter().map(|&b| u64::from(b)).collect(),
                remote: Vec::new(),
                first_remote_pos: n_p.saturating_sub(local_blocks.len()),
            };
            let plan =
                VerifyPlan::new(&self.geom, &self.regions, &bp, 1, false, pair.p.block_tokens, seed, stride);
            self.verify(r, &plan)?;
            r.verify_ns = tv.elapsed().as_nanos() as u64;
        }
        Ok(())
    }
}

/// `--transport nixl`: the handshake as vLLM's decode worker makes it (vLLM's payload and
/// hash from each source rank, the peers' agents loaded, each READ's lists prepared).
fn handshake_nixl(
    cfg: &WorkerConfig,
    client: &HandshakeClient,
    side: &crate::pipeline::worker::nixl::NixlSide,
    params: &KvTransferParams,
) -> Result<RemoteEngine, Failure> {
    use crate::pipeline::worker::nixl;
    let endpoint = format!("tcp://{}:{}", params.remote_host, params.remote_port);
    let tp = TpSpec {
        p_tp: params.tp_size,
        d_tp: cfg.pair.d.tp,
        num_kv_heads: cfg.pair.model.num_kv_heads,
        use_mla: cfg.pair.model.is_mla(),
        version: cfg.pair.version,
    };
    let prelim = topology::rank_map(&tp).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
    let ranks: Vec<(u32, u32)> =
        prelim.d_ranks[cfg.rank as usize].handshake_ranks.iter().map(|&r| (0, r)).collect();
    let hs = nixl::fetch(client, cfg, &endpoint, &ranks, params.tp_size, &params.remote_engine_id)?;
    let pair = hs.pair;
    let map = pair.validate().map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
    let planner =
        Planner::new(&pair, &map, cfg.rank).map_err(|e| (FailureCause::Incompatible, e.to_string()))?;
    let p_regions = pair.p_geometry(0).regions();
    let mut ranks = BTreeMap::new();
    let mut peers = BTreeMap::new();
    for (tp_rank, meta) in &hs.peers {
        let who = format!("prefill rank {tp_rank} at {endpoint}");
        let base = nixl::peer_base(meta, &p_regions, &who)?;
        let peer = side
            .agent
            .load_peer(&meta.agent_metadata)
            .map_err(|e| (FailureCause::Handshake, format!("load {who}'s NIXL agent: {e}")))?;
        peers.insert(
            *tp_rank,
            (nixl::NixlPeer { agent: peer.name().to_owned() }, base, meta.device_id.unwrap_or(0)),
        );
        ranks.insert(*tp_rank, RemoteRank { region: None, ipc: None, am: None, zmq: None, nixl: Some(peer) });
    }
    let nixl_lists = nixl::prepare_reads(side, &planner, &peers)?;
    Ok(RemoteEngine {
        planner,
        pair,
        p_regions,
        ranks,
        transports: Some("nixl/UCX".into()),
        ucx_broken: false,
        nixl_lists,
    })
}

/// `--fill peer`: every byte the plan read, against the peer pattern at the prefill
/// region, block and offset it came from.
fn verify_peer(
    mem: &KvBuffer,
    r: &mut LoadResult,
    planner: &Planner,
    p_regions: &[Region],
    bp: &BlockPairs,
) -> Result<(), Failure> {
    let mut bufs: Vec<Vec<Pair>> = Vec::new();
    bufs.resize_with(planner.reads.len(), Vec::new);
    planner.plan_into(bp, &mut bufs);
    // Each pair cut at prefill block boundaries: (local range, region, block, offset).
    let mut segs: Vec<(std::ops::Range<u64>, u64, u64, u64)> = Vec::new();
    for p in bufs.iter().flatten() {
        let (mut q, mut l, mut left) = (p.remote, p.local, p.len);
        while left > 0 {
            let Some((j, reg)) = p_regions
                .iter()
                .enumerate()
                .find(|(_, g)| q >= g.base_off && q < g.base_off + g.num_blocks * g.block_stride)
            else {
                return Err((FailureCause::Internal, format!("prefill offset {q} is in no region")));
            };
            let (b, off) = ((q - reg.base_off) / reg.block_stride, (q - reg.base_off) % reg.block_stride);
            let n = left.min(reg.block_stride - off);
            segs.push((l..l + n, j as u64, b, off));
            (q, l, left) = (q + n, l + n, left - n);
        }
    }
    let ranges: Vec<std::ops::Range<u64>> = segs.iter().map(|s| s.0.clone()).collect();
    let (mut bytes, mut mismatch) = (0u64, None);
    mem.read_ranges(&ranges, |i, got| {
        let (_, j, b, off) = &segs[i];
        match crate::layouts::pattern::check_peer(got, *j, *b, *off) {
            None => bytes += got.len() as u64,
            Some(k) if mismatch.is_none() => {
                mismatch = Some(format!(
                    "byte {} of prefill region {j} block {b} (local offset {}) is not the peer pattern",
                    off + k as u64,
                    segs[i].0.start + k as u64
                ));
            }
            Some(_) => {}
        }
    })
    .map_err(|e| (FailureCause::Internal, format!("read back the received blocks: {e}")))?;
    match mismatch {
        None => r.bytes_verified = bytes,
        Some(m) => r.verify_failure = Some(m),
    }
    Ok(())
}
