//! A prefill rank: registers its KV pool, advertises it, fills request blocks with the
//! byte pattern, holds them under a lease, and frees them after the decode side's
//! notifications (or when the lease runs out).
//!
//! One thread waits on everything at once: the engine's control socket, the ZMQ
//! notification socket and UCX's event fd, which also wakes it for notifications sent as
//! UCX active messages (drained after each progress round). The UCX worker is progressed
//! whenever it has work, because UCX builds that emulate GET in software need the target
//! to progress.
//!
//! With the storage transport the rank also writes each request's blocks to the shared
//! directory: eagerly (`--transport storage`), or when a decode rank asks for it after its
//! first transport failed (`--transport multi`, a `FB:` message).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::config::worker::{Fault, Overlap, WorkerConfig};
use crate::layouts::Region;
use crate::layouts::verify::FillPlan;
use crate::pipeline::wire::{FailureCause, FromWorker, PushStats, ReadyInfo, ToWorker, UcxChoices};
use crate::pipeline::worker::plumbing::{
    Control, Stage as _, WorkerError, advertised_payload, block_ranges, host_pool, rss_bytes,
};
use crate::pipeline::worker::pusher::{HybridHeld, PushJob, Pusher};
use crate::topology::TransferMode;
use crate::transfer::memory::KvBuffer;
use crate::transfer::notify::{LeaseTable, Notification, NotifyListener, UcxNotifyReceiver};
use crate::transfer::storage::StoragePublisher;
use crate::transfer::ucx::{Context, ContextOptions, HYBRID_SPIN, MemRegion, ProgressMode, Ucx, Worker};
use crate::vocab::kinds::{TransportKind, VerifyMode};

/// Upper bound of one wait, so leases are checked even when nothing happens.
const MAX_WAIT: Duration = Duration::from_millis(100);
/// How often a `--transport nixl` rank drains NIXL's notifications while idle (vLLM drains
/// them once per engine step, a few milliseconds).
const NIXL_POLL: Duration = Duration::from_millis(1);

/// The rank's UCX side: context, worker and the registered pool. Field order is drop order.
struct UcxSide {
    /// Notifications sent as UCX active messages.
    am: UcxNotifyReceiver,
    region: MemRegion<KvBuffer>,
    worker: Worker,
    ctx: Context,
}

/// The KV pool, registered with UCX or NIXL, or (after `Fault::KillUcx`, or without either)
/// plain.
enum Pool {
    Ucx(Box<UcxSide>),
    Nixl(Box<crate::pipeline::worker::nixl::NixlSide>),
    Plain(KvBuffer),
    /// Transient state while switching.
    Gone,
}

impl Pool {
    fn memory(&self) -> Result<&KvBuffer, WorkerError> {
        match self {
            Pool::Ucx(u) => u.region.memory().stage("KV pool"),
            Pool::Nixl(n) => Ok(n.region.memory()),
            Pool::Plain(m) => Ok(m),
            Pool::Gone => Err(WorkerError::PoolGone),
        }
    }

    fn memory_mut(&mut self) -> Result<&mut KvBuffer, WorkerError> {
        match self {
            Pool::Ucx(u) => u.region.memory_mut().stage("KV pool"),
            Pool::Nixl(n) => Ok(n.region.memory_mut()),
            Pool::Plain(m) => Ok(m),
            Pool::Gone => Err(WorkerError::PoolGone),
        }
    }

    fn worker(&self) -> Option<&Worker> {
        match self {
            Pool::Ucx(u) => Some(&u.worker),
            _ => None,
        }
    }

    /// Notifications received as UCX active messages (or through NIXL) since the last
    /// call, and how many NIXL messages were not vLLM's.
    fn drain_am(&mut self) -> (Vec<Notification>, u64) {
        match self {
            Pool::Ucx(u) => (u.am.drain(), 0),
            Pool::Nixl(n) => n.drain(),
            _ => (Vec::new(), 0),
        }
    }

    /// Tears the UCX side (or the NIXL agent) down and keeps the memory.
    fn kill_ucx(&mut self) -> Result<(), WorkerError> {
        match std::mem::replace(self, Pool::Gone) {
            Pool::Ucx(u) => {
                let UcxSide { am, region, worker, ctx } = *u;
                drop(am);
                let mem = region.deregister().stage("deregister the KV pool")?;
                drop(worker);
                drop(ctx);
                *self = Pool::Plain(mem);
            }
            Pool::Nixl(side) => {
                let crate::pipeline::worker::nixl::NixlSide { region, agent, .. } = *side;
                let mem = region.deregister();
                // The agent goes with its last handle (push mode's WRITE targets hold it until
                // they have told their decode ranks nothing more will be written).
                drop(agent);
                *self = Pool::Plain(mem);
            }
            other => *self = other,
        }
        Ok(())
    }
}

/// A request this rank holds.
struct Held {
    req: u64,
    blocks: Vec<u32>,
    published: bool,
    /// The request's simulated prefill, until it is done and reported (`Filled`).
    compute: Option<Compute>,
    /// Push with `--overlap layers`: the WRITE under way while the prefill computes.
    job: Option<PushJob>,
    /// A hybrid model: the request's per-group lists and tokens (push plans from them).
    hybrid: Option<HybridHeld>,
    /// Notifications that free it (`None`: the count the first one names); its lease is
    /// taken when its prefill is done.
    expected: Option<u32>,
}

/// A request's simulated prefill on this rank (`PrefillSim`): layer `l` is computed at
/// `start + (l + 1) * per_layer`.
#[derive(Debug, Clone, Copy)]
struct Compute {
    start: Instant,
    fill_ns: u64,
    publish_ns: u64,
    save_ns: u64,
}

/// The simulated prefill of a rank: its settings and the end of the last request queued (one
/// forward at a time, as on one GPU).
struct Prefill {
    per_layer: Duration,
    layers: u32,
    overlap: Overlap,
    busy_until: Instant,
}

impl Prefill {
    fn new(cfg: &WorkerConfig) -> Self {
        Prefill {
            per_layer: cfg.prefill.per_layer(),
            layers: cfg.pair.model.num_layers.max(1),
            overlap: cfg.prefill.overlap,
            busy_until: Instant::now(),
        }
    }

    fn simulated(&self) -> bool {
        !self.per_layer.is_zero()
    }

    /// Queues a request's computation behind the ones before it.
    fn start(&mut self, now: Instant, fill_ns: u64, publish_ns: u64, save_ns: u64) -> Compute {
        let start = self.busy_until.max(now);
        self.busy_until = start + self.total();
        Compute { start, fill_ns, publish_ns, save_ns }
    }

    fn total(&self) -> Duration {
        self.per_layer * self.layers
    }

    fn end(&self, c: &Compute) -> Instant {
        c.start + self.total()
    }

    /// Layers computed by `now`.
    fn layers_done(&self, c: &Compute, now: Instant) -> u32 {
        let elapsed = now.saturating_duration_since(c.start).as_nanos();
        let per = self.per_layer.as_nanos().max(1);
        u32::try_from(elapsed / per).unwrap_or(u32::MAX).min(self.layers)
    }

    /// When something next happens to `c`: its next layer (when layers are written as they
    /// come), else its end.
    fn next_event(&self, c: &Compute, now: Instant) -> Instant {
        match self.overlap {
            Overlap::Layers => c.start + self.per_layer * (self.layers_done(c, now) + 1).min(self.layers),
            Overlap::None => self.end(c),
        }
    }
}

/// Asks the kernel not to let this process preempt the one that woke it (`SCHED_BATCH`,
/// through the UCX module's [`crate::transfer::ucx::defer_wakeups`]).
///
/// A prefill rank sleeps on its worker's event fd and is woken by every notification. On a
/// host where decode and prefill ranks share cores, a normal wakeup runs the prefill rank at
/// once, in the middle of the decode rank's notify loop: with 4 P ranks to notify, p8d2 paid
/// about 100 us per notification on 2 cores. The prefill rank's work after a wakeup (free
/// blocks, answer a side-channel request) can wait for the decode rank's time slice; its
/// share of the CPU is unchanged. Failure is harmless and only logged.
fn defer_wakeups() {
    if let Err(e) = crate::transfer::ucx::defer_wakeups() {
        tracing::debug!("sched_setscheduler(SCHED_BATCH): {e}");
    }
}

pub fn run(ctl: &Control, cfg: WorkerConfig) -> Result<(), WorkerError> {
    defer_wakeups();
    let geom = cfg.pair.p_geometry(cfg.rank);
    let hybrid = crate::pipeline::worker::plumbing::hybrid_geometry(&cfg)?;
    let hybrid_cache = crate::pipeline::worker::plumbing::hybrid_cache_geometry(&cfg)?;
    let progress = cfg.transport.progress;
    let kind = cfg.transport.kind;
    let (regions, total) = crate::pipeline::worker::plumbing::rank_regions(&geom, hybrid.as_ref());
    let cache_total = hybrid_cache.as_ref().map_or(total, crate::pipeline::worker::plumbing::hybrid_span);
    let crate::pipeline::worker::plumbing::RankPool {
        regions,
        total,
        uses_ucx,
        uses_storage,
        mut mem,
        mut staged,
    } = crate::pipeline::worker::plumbing::rank_pool(&cfg, regions, total, cache_total)?;
    if cfg.verify != VerifyMode::Full {
        // No fill will touch every page (nothing checks the bytes, or only the sample's):
        // touched now, so that reads find real memory, not the kernel's shared zero page.
        mem.prefault();
        if let Some(s) = staged.as_mut() {
            s.prefault();
        }
    }
    let mut ucx_lib = None;
    let (mut pool, worker_address, rkey, base) = if kind == TransportKind::Nixl {
        let side = crate::pipeline::worker::nixl::NixlSide::new(&cfg, mem, "p")?;
        ucx_lib = Some(side.library.clone());
        let base = side.region.addr();
        (Pool::Nixl(Box::new(side)), Vec::new(), Vec::new(), base)
    } else if uses_ucx {
        let ucx = Ucx::load(cfg.transport.ucx_lib.as_deref()).stage("load UCX")?;
        // Active messages always: decode ranks choose how to notify, this rank takes both.
        let ctx = Context::new(
            &ucx,
            &ContextOptions {
                progress,
                active_messages: true,
                cuda_device: cfg.mem.device(),
                ..ContextOptions::default()
            },
        )
        .stage("UCX context")?;
        let worker = Worker::new(&ctx).stage("UCX worker")?;
        let am = UcxNotifyReceiver::new(&worker).stage("UCX notification handler")?;
        let region = MemRegion::register(&ctx, mem).stage("register the KV pool with UCX")?;
        let rkey = region.pack_rkey().stage("pack the remote key")?.as_bytes().to_vec();
        let base = region.addr();
        let address = worker.address().stage("UCX worker address")?;
        ucx_lib = Some((ucx.path().display().to_string(), ucx.version().to_string()));
        (Pool::Ucx(Box::new(UcxSide { am, region, worker, ctx })), address, rkey, base)
    } else {
        let base = crate::transfer::ucx::Registrable::addr(&mem);
        (Pool::Plain(mem), Vec::new(), Vec::new(), base)
    };
    // cuda-batch: the pool exported once; decode ranks map it and copy from it directly.
    let cuda_ipc = match kind {
        TransportKind::CudaBatch => Some(crate::pipeline::worker::batch::export_pool(pool.memory()?)?),
        _ => None,
    };
    let listener = NotifyListener::bind(&format!("tcp://{}:0", cfg.bind_host))
        .stage("bind the notification listener")?;
    let notify_ep = advertise(listener.endpoint(), &cfg.advertise_host);
    // What the side channel advertises: with an empty worker address and remote key once the
    // UCX side is gone (`Fault::KillUcx`), so decode ranks fail fast instead of timing out.
    let payload_of = |worker_address: Vec<u8>, rkey: &[u8]| {
        let ipc = cuda_ipc.clone();
        advertised_payload(&cfg, &cfg.pair.p, &regions, base, worker_address, rkey, &notify_ep, ipc)
    };
    let payload = match &pool {
        Pool::Nixl(side) => {
            crate::pipeline::worker::nixl::advertised_payload(&cfg, &cfg.pair.p, &regions, side)?
        }
        _ => payload_of(worker_address, &rkey)?,
    };
    let mut storage = if uses_storage {
        let opts = crate::pipeline::worker::plumbing::storage_options(&cfg);
        Some(StoragePublisher::new(opts, &cfg.engine_id, cfg.rank).stage("storage transport")?)
    } else {
        None
    };
    let (lib, version) =
        ucx_lib.unwrap_or_else(|| (format!("(not loaded: {} transport)", kind.as_str()), String::new()));
    ctl.send(&FromWorker::Ready(Box::new(ReadyInfo {
        rank: cfg.rank,
        handshake_payload: Some(payload),
        ucx_library: lib,
        ucx_version: version,
        // With a host buffer the rank holds the pool twice over (pool and buffer).
        pool_bytes: total as u64 + if staged.is_some() { cache_total } else { 0 },
        rss_bytes: rss_bytes(),
    })))?;

    let mut leases = LeaseTable::new(Duration::from_millis(cfg.lease_ms));
    let mut held: HashMap<String, Held> = HashMap::new();
    // Push mode: registrations from decode ranks, matched with fills; the WRITEs.
    let mut pusher = (cfg.transport.mode == TransferMode::Push)
        .then(|| Pusher::new(Duration::from_millis(cfg.timeout_ms)));
    let mut sim = Prefill::new(&cfg);
    let mut last_work = Instant::now();
    let mut unrecognized_seen = 0;
    let eager_publish = kind == TransportKind::Storage;
    loop {
        // Progress UCX until it has nothing to do. Only work other than notifications
        // (serving reads UCX emulates in software) starts a spin: a notification ends a
        // request, and a rank that spins after it keeps the core from the decode rank
        // that just woke it, whose send then waits out the whole spin.
        if let Pool::Ucx(u) = &pool {
            let am_before = u.am.am_stats().received;
            let (mut spins, mut events) = (0u32, 0u64);
            loop {
                let n = u.worker.progress();
                if n == 0 || spins >= 65_536 {
                    break;
                }
                spins += 1;
                events += u64::from(n);
            }
            if events > u.am.am_stats().received - am_before {
                last_work = Instant::now();
            }
        }
        // Control messages. In push mode one starts a spin (WRITEs may follow that this rank
        // must progress); in pull mode nothing does: a fill is done here when its message is
        // handled, and a rank that spins after it polls its sockets on the cores the decode
        // ranks' reads need (4 prefill ranks spinning took ~40% of a core from 2 readers).
        while let Some(msg) = ctl.try_recv()? {
            if pusher.is_some() {
                last_work = Instant::now();
            }
            match msg {
                ToWorker::Fill { req, p_request_id, tokens, blocks, seed, expected_notifs } => {
                    let t0 = Instant::now();
                    // With a host buffer the KV pool is filled (the prefill's output), then the
                    // request's blocks are copied to the buffer decode reads (vLLM's
                    // `save_kv_to_host`), timed as their own stage.
                    let filled = staged.as_mut().map_or_else(|| pool.memory_mut(), Ok)?;
                    let mut lists = None;
                    // Nothing checks the bytes with --verify off: the pattern is not written, so
                    // this rank's CPU (a GPU's work, in a real prefill) does not compete with
                    // the reads of other requests.
                    // With --verify sample, only the blocks decode checks (the same set on both
                    // sides: `coverage::Sample`, `verify::sampled`).
                    let write = cfg.verify.stride();
                    match (&hybrid, write) {
                        // The NIXL peers' bytes: every region of each block, whole (what a
                        // peer's decode checks), whatever --verify says.
                        (None, _) if cfg.fill == crate::vocab::kinds::FillPattern::Peer => {
                            let ids: Vec<(u64, u64)> = blocks
                                .iter()
                                .flat_map(|&b| (0..regions.len() as u64).map(move |j| (j, u64::from(b))))
                                .collect();
                            let ranges: Vec<std::ops::Range<u64>> = ids
                                .iter()
                                .map(|&(j, b)| {
                                    let r = &regions[j as usize];
                                    r.block_off(b)..r.block_off(b) + r.block_len
                                })
                                .collect();
                            filled
                                .write_ranges(&ranges, |i, bytes| {
                                    crate::layouts::pattern::fill_peer(bytes, ids[i].0, ids[i].1, 0)
                                })
                                .stage("fill the request's blocks with the peer pattern")?;
                        }
                        // Every block of every group, each byte by what it means (in the KV
                        // cache's layout, which a host buffer does not share).
                        (Some(g), _) => {
                            let cache = hybrid_cache.as_ref().unwrap_or(g);
                            lists = Some(fill_hybrid(filled, cache, cfg.rank, tokens, &blocks, seed, write)?);
                        }
                        (None, Some(stride)) => {
                            let plan = FillPlan::new(&geom, &regions, &blocks, seed).only(stride);
                            filled
                                .write_ranges(&plan.ranges(), |i, bytes| plan.fill(i, bytes))
                                .stage("fill the request's blocks")?;
                        }
                        (None, None) => {}
                    }
                    let fill_ns = t0.elapsed().as_nanos() as u64;
                    let mut save_ns = 0;
                    if let Some(kv) = staged.as_ref() {
                        let ts = Instant::now();
                        match (&hybrid, &hybrid_cache, &lists) {
                            (Some(host), Some(cache), Some(lists)) => {
                                let (from, to) = hybrid_save_moves(cache, host, lists)?;
                                crate::transfer::memory::copy_moved(kv, &from, pool.memory_mut()?, &to)
                            }
                            _ => crate::transfer::memory::copy_ranges(
                                kv,
                                pool.memory_mut()?,
                                &block_ranges(&regions, &blocks),
                            ),
                        }
                        .stage("copy the request's blocks to the host buffer")?;
                        save_ns = ts.elapsed().as_nanos() as u64;
                    }
                    let mut publish_ns = 0;
                    if eager_publish && let Some(s) = storage.as_mut() {
                        let t1 = Instant::now();
                        publish(s, &p_request_id, &regions, &blocks, pool.memory()?)?;
                        publish_ns = t1.elapsed().as_nanos() as u64;
                    }
                    // 0: the decode side's TP is unknown here (a serving engine); take the count
                    // the first notification names, as vLLM's P does.
                    let expected = (expected_notifs > 0).then_some(expected_notifs);
                    // The simulated prefill (if any) starts now; the request is reported
                    // filled when it is done.
                    let compute =
                        sim.simulated().then(|| sim.start(Instant::now(), fill_ns, publish_ns, save_ns));
                    // The lease runs from the end of the prefill, as vLLM's abort timeout runs
                    // from the request's finish: a request still computing (or queued behind
                    // another on this rank) is not freed under its reader.
                    let leased = if held.contains_key(&p_request_id) {
                        Err(crate::transfer::notify::AlreadyHeld(p_request_id.clone()))
                    } else if compute.is_some() {
                        Ok(())
                    } else {
                        leases.register(&p_request_id, expected, Instant::now()).map(|_| ())
                    };
                    match leased {
                        Ok(()) => {
                            held.insert(
                                p_request_id.clone(),
                                Held {
                                    req,
                                    blocks,
                                    published: eager_publish,
                                    compute,
                                    job: None,
                                    hybrid: lists.map(|lists| HybridHeld { lists, tokens }),
                                    expected,
                                },
                            );
                        }
                        Err(e) => tracing::warn!("{e}"),
                    }
                    if compute.is_none() {
                        ctl.send(&FromWorker::Filled { req, fill_ns, publish_ns, save_ns })?;
                        // Push: the registration may have come first.
                        if let Some(p) = pusher.as_mut()
                            && p.is_registered(&p_request_id)
                        {
                            push_one(ctl, &cfg, &mut pool, p, &mut leases, &mut held, &p_request_id, 0)?;
                        }
                    }
                }
                ToWorker::Fault(Fault::KillUcx) => {
                    tracing::warn!("fault injected: tearing down this rank's UCX side");
                    pool.kill_ucx()?;
                    ctl.send(&FromWorker::Republish { payload: payload_of(Vec::new(), &[])? })?;
                }
                ToWorker::Fault(Fault::Exit) => crate::transfer::nixl::exit(3),
                // No decode engine will read these blocks (the request's decode leg failed, or
                // its client left before the handoff): free them now, not at lease expiry.
                ToWorker::Release { p_request_id } => {
                    leases.release(&p_request_id);
                    if let Some(p) = pusher.as_mut() {
                        // A decode rank registered for it waits for WRITEs: tell it none come.
                        p.give_up(&p_request_id);
                        p.forget(&p_request_id);
                    }
                    if let Some(mut h) = held.remove(&p_request_id) {
                        abandon(&mut pusher, &mut h, "the request was released");
                        release(&mut storage, &p_request_id, h.published);
                        ctl.send(&FromWorker::Freed { req: h.req, expired: false })?;
                    }
                }
                ToWorker::Init(_)
                | ToWorker::Load { .. }
                | ToWorker::Go { .. }
                | ToWorker::PeerGone { .. } => {}
                ToWorker::Shutdown => return Ok(()),
            }
        }
        // Notifications, heartbeats and fallback requests.
        let now = Instant::now();
        let zmq_notifs = listener.drain().stage("notifications")?;
        let (drained, not_vllm) = pool.drain_am();
        if not_vllm > 0 {
            ctl.send(&FromWorker::Unrecognized { count: not_vllm })?;
        }
        for n in drained.into_iter().chain(zmq_notifs) {
            if let Notification::PushReg(reg) = n {
                let matched = pusher.as_mut().and_then(|p| p.register(*reg));
                // Written now if its prefill is done; while it computes, by `advance` below.
                let id = matched.and_then(|k| Pusher::held_id(&k, held.keys()));
                if let (Some(id), Some(p)) = (id, pusher.as_mut())
                    && held.get(&id).is_some_and(|h| h.compute.is_none())
                {
                    push_one(ctl, &cfg, &mut pool, p, &mut leases, &mut held, &id, 0)?;
                }
                continue;
            }
            if let Notification::Fallback { ids } = &n {
                for id in ids {
                    if let (Some(h), Some(s)) = (held.get_mut(id), storage.as_mut())
                        && !h.published
                    {
                        publish(s, id, &regions, &h.blocks, pool.memory()?)?;
                        h.published = true;
                    }
                }
                continue;
            }
            for id in leases.apply(&n, now) {
                if let Some(h) = held.remove(&id) {
                    release(&mut storage, &id, h.published);
                    ctl.send(&FromWorker::Freed { req: h.req, expired: false })?;
                }
            }
        }
        // Simulated prefills that advanced: layers to write, requests to report.
        if sim.simulated() {
            advance(ctl, &cfg, &mut sim, &mut pool, &mut pusher, &mut leases, &mut held)?;
        }
        for id in leases.expire(Instant::now()) {
            if let Some(p) = pusher.as_mut() {
                p.forget(&id);
            }
            if let Some(mut h) = held.remove(&id) {
                abandon(&mut pusher, &mut h, "its lease expired");
                release(&mut storage, &id, h.published);
                ctl.send(&FromWorker::Freed { req: h.req, expired: true })?;
            }
        }
        let unrecognized = leases.stats().unrecognized;
        if unrecognized > unrecognized_seen {
            ctl.send(&FromWorker::Unrecognized { count: unrecognized - unrecognized_seen })?;
            unrecognized_seen = unrecognized;
        }
        // Wait for the next event.
        let spin = match progress {
            ProgressMode::Busy => pool.worker().is_some(),
            ProgressMode::Hybrid => last_work.elapsed() < HYBRID_SPIN,
            ProgressMode::Wait => false,
        };
        if spin {
            continue;
        }
        if let Some(w) = pool.worker()
            && !w.arm().stage("arm the UCX worker")?
        {
            continue;
        }
        let now = Instant::now();
        let next_compute =
            held.values().filter_map(|h| h.compute.as_ref()).map(|c| sim.next_event(c, now)).min();
        // NIXL has no event to wait on: its notifications are polled, as vLLM's worker polls
        // them every engine step.
        let max_wait = if matches!(pool, Pool::Nixl(_)) { NIXL_POLL } else { MAX_WAIT };
        let wait = leases
            .next_deadline()
            .into_iter()
            .chain(next_compute)
            .min()
            .map_or(max_wait, |d| d.saturating_duration_since(now).min(max_wait));
        // A layer due within a millisecond: poll's timeout is in milliseconds, so sleep to it.
        if next_compute.is_some() && wait < Duration::from_millis(1) {
            std::thread::sleep(wait);
            continue;
        }
        let mut items =
            vec![ctl.socket().as_poll_item(zmq::POLLIN), listener.socket().as_poll_item(zmq::POLLIN)];
        if let Some(fd) = pool.worker().and_then(Worker::event_fd) {
            items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
        }
        let ms = (wait.as_millis() as i64).max(1);
        zmq::poll(&mut items, ms).stage("wait for events")?;
    }
}

/// Push mode: WRITEs a held, registered request into the decode blocks, then frees it here
/// (a prefill rank frees on its own WRITEs' completion, not on notifications) and reports.
/// `compute_ns`: the request's simulated prefill, for the report.
#[expect(clippy::too_many_arguments, reason = "the rank loop's state a push touches")]
fn push_one(
    ctl: &Control,
    cfg: &WorkerConfig,
    pool: &mut Pool,
    pusher: &mut Pusher,
    leases: &mut LeaseTable,
    held: &mut HashMap<String, Held>,
    id: &str,
    compute_ns: u64,
) -> Result<(), WorkerError> {
    let Some(h) = held.remove(id) else { return Ok(()) };
    let result = match pool {
        Pool::Ucx(u) => {
            let UcxSide { region, worker, .. } = &mut **u;
            pusher.push(cfg, worker, region, id, &h.blocks, h.hybrid.as_ref())
        }
        Pool::Nixl(side) => pusher.push_nixl(cfg, side, id, &h.blocks),
        _ => {
            pusher.give_up(id);
            Err((FailureCause::PeerGone, "this rank's UCX side is gone: nothing can be written".into()))
        }
    };
    pushed(ctl, pool, pusher, leases, id, h.req, compute_ns, result)
}

/// A request written (or not): frees it here and tells the engine what the WRITE took, and
/// with this rank's first written request, what UCX chose for the WRITEs.
#[expect(clippy::too_many_arguments, reason = "the rank loop's state a push touches")]
fn pushed(
    ctl: &Control,
    pool: &Pool,
    pusher: &mut Pusher,
    leases: &mut LeaseTable,
    id: &str,
    req: u64,
    compute_ns: u64,
    result: Result<PushStats, crate::pipeline::worker::pusher::Failure>,
) -> Result<(), WorkerError> {
    leases.release(id);
    pusher.forget(id);
    ctl.send(&FromWorker::Freed { req, expired: false })?;
    let (stats, error) = match result {
        Ok(st) => (st, None),
        Err(e) => (PushStats::default(), Some(e)),
    };
    let ucx = match pool {
        Pool::Ucx(u) if error.is_none() && pusher.first_report() => Some(Box::new(UcxChoices {
            transports: pusher.transports(),
            // UCX chose its protocols at these first WRITEs.
            protocols: u.ctx.protocols().only(crate::transfer::ucx::Rma::Put),
            settings: u.ctx.env_notes().to_vec(),
        })),
        _ => None,
    };
    ctl.send(&FromWorker::Pushed { req, stats, compute_ns, error, ucx })
}

/// A held request that will not be written after all: a WRITE under way is ended with a
/// failure notification, so no decode rank waits for the rest.
fn abandon(pusher: &mut Option<Pusher>, h: &mut Held, why: &str) {
    if let (Some(p), Some(job)) = (pusher.as_mut(), h.job.take()) {
        p.fail(job, (FailureCause::Transfer, format!("prefill rank stopped writing: {why}")));
    }
}

/// Fills a hybrid request's blocks (a flat allocation of `blocks`, group after group) by
/// meaning, with `write` = `Some(stride)` the sample of one in `stride` that decode checks:
/// the per-group lists vLLM's allocator holds for `tokens` prompt tokens (returned).
fn fill_hybrid(
    pool: &mut KvBuffer,
    g: &crate::layouts::hybrid::geometry::EngineGeometry,
    rank: u32,
    tokens: u32,
    blocks: &[u32],
    seed: u64,
    write: Option<u32>,
) -> Result<Vec<Vec<u32>>, WorkerError> {
    use crate::layouts::hybrid::blocks::RequestShape;
    use crate::layouts::hybrid::coverage::{RequestFill, Sample};
    let shape = RequestShape::of(g);
    let lists = shape.lists(tokens, 0, blocks).ok_or_else(|| WorkerError::Protocol {
        reason: format!(
            "a {tokens}-token request of a hybrid model needs {} blocks; the engine sent {}",
            shape.blocks(tokens, 0),
            blocks.len()
        ),
    })?;
    let Some(stride) = write else { return Ok(lists) };
    let fill = RequestFill::new(g, rank, &lists, shape.tokens(tokens, 0).p_computed_tokens, seed)
        .only(&Sample::new(g, stride, seed));
    pool.write_ranges(&fill.ranges(), |i, bytes| {
        fill.fill(i, bytes);
    })
    .stage("fill the request's blocks")?;
    Ok(lists)
}

/// vLLM's `save_kv_to_host` of a hybrid request whose per-group lists are `lists`, as (KV
/// cache ranges, host buffer ranges): every group's blocks through every layer, or with
/// `--host-descriptors per-group` (decode reads each layer's own group's blocks only) each
/// layer's own group's.
fn hybrid_save_moves(
    cache: &crate::layouts::hybrid::geometry::EngineGeometry,
    host: &crate::layouts::hybrid::geometry::EngineGeometry,
    lists: &[Vec<u32>],
) -> Result<crate::pipeline::worker::plumbing::Moves, WorkerError> {
    use crate::layouts::hybrid::staging::{host_copy_moves, saved_kernel_ids};
    let kernel =
        saved_kernel_ids(cache, lists).map_err(|e| WorkerError::Protocol { reason: e.to_string() })?;
    let per_group = host.config.host_descriptors_per_group;
    Ok(crate::pipeline::worker::plumbing::split_moves(
        &host_copy_moves(cache, host, &kernel, per_group),
        true,
    ))
}

/// Moves the simulated prefills on: with `--overlap layers`, WRITEs the layers computed since
/// the last call of every registered request; reports each request whose prefill is done
/// (`Filled`, its fill time plus the computation), and writes it if it is registered.
fn advance(
    ctl: &Control,
    cfg: &WorkerConfig,
    sim: &mut Prefill,
    pool: &mut Pool,
    pusher: &mut Option<Pusher>,
    leases: &mut LeaseTable,
    held: &mut HashMap<String, Held>,
) -> Result<(), WorkerError> {
    let now = Instant::now();
    let due: Vec<(String, Compute, u32)> = held
        .iter()
        .filter_map(|(id, h)| h.compute.map(|c| (id.clone(), c, sim.layers_done(&c, now))))
        .filter(|&(_, _, done)| done == sim.layers || (done > 0 && sim.overlap == Overlap::Layers))
        .collect();
    for (id, c, done) in due {
        let end = sim.end(&c);
        // Overlap: write what is computed, once decode registered.
        if sim.overlap == Overlap::Layers
            && let Some(p) = pusher.as_mut()
            && let Some(h) = held.get_mut(&id)
            && (h.job.is_some() || p.is_registered(&id))
        {
            let step = match pool {
                Pool::Ucx(u) => {
                    let UcxSide { region, worker, .. } = &mut **u;
                    let job = match h.job.take() {
                        Some(j) => Ok(j),
                        None => p.begin(cfg, worker, &id, &h.blocks, h.hybrid.as_ref()),
                    };
                    job.and_then(|mut j| p.write_layers(cfg, &mut j, region, done, Some(end)).map(|()| j))
                }
                _ => {
                    if let Some(j) = h.job.take() {
                        p.fail(j, (FailureCause::PeerGone, "this rank's UCX side is gone".into()));
                    } else {
                        p.give_up(&id);
                    }
                    Err((
                        FailureCause::PeerGone,
                        "this rank's UCX side is gone: nothing can be written".into(),
                    ))
                }
            };
            match step {
                Ok(j) => h.job = Some(j),
                Err(e) => {
                    let req = h.req;
                    held.remove(&id);
                    pushed(ctl, pool, p, leases, &id, req, sim.total().as_nanos() as u64, Err(e))?;
                    continue;
                }
            }
        }
        if done < sim.layers {
            continue;
        }
        // The prefill is done: report it, and finish (or start) its WRITE.
        let Some(h) = held.get_mut(&id) else { continue };
        h.compute = None;
        if let Err(e) = leases.register(&id, h.expected, now) {
            tracing::warn!("{e}");
        }
        let compute_ns = sim.total().as_nanos() as u64;
        ctl.send(&FromWorker::Filled {
            req: h.req,
            fill_ns: c.fill_ns + compute_ns,
            publish_ns: c.publish_ns,
            save_ns: c.save_ns,
        })?;
        let Some(p) = pusher.as_mut() else { continue };
        if let Some(job) = h.job.take() {
            let req = h.req;
            held.remove(&id);
            let result = match pool {
                Pool::Ucx(u) => {
                    let UcxSide { region, .. } = &mut **u;
                    let mut job = job;
                    let all = sim.layers;
                    p.write_layers(cfg, &mut job, region, all, Some(end)).and_then(|()| p.finish(job))
                }
                _ => Err(p.fail(job, (FailureCause::PeerGone, "this rank's UCX side is gone".into()))),
            };
            pushed(ctl, pool, p, leases, &id, req, compute_ns, result)?;
        } else if p.is_registered(&id) {
            push_one(ctl, cfg, pool, p, leases, held, &id, compute_ns)?;
        }
    }
    Ok(())
}

fn publish(
    s: &mut StoragePublisher,
    id: &str,
    regions: &[Region],
    blocks: &[u32],
    mem: &KvBuffer,
) -> Result<(), WorkerError> {
    s.publish(id, regions, blocks, host_pool(mem)?.as_slice()).map(|_| ()).stage("storage publish")
}

fn release(storage: &mut Option<StoragePublisher>, id: &str, published: bool) {
    if published
        && let Some(s) = storage.as_mut()
        && let Err(e) = s.release(id)
    {
        tracing::warn!("storage: {e}");
    }
}

/// Replaces a wildcard bind host in an endpoint with the host peers should dial.
pub(super) fn advertise(endpoint: &str, host: &str) -> String {
    let (h, port) = crate::config::engine::split_endpoint(endpoint);
    if h == "0.0.0.0" || h == "*" || h.is_empty() {
        format!("tcp://{host}:{port}")
    } else {
        endpoint.to_string()
    }
}
