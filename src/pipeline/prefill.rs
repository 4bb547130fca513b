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

use super::proto::FailureCause;
use super::proto::{Fault, FromWorker, ReadyInfo, ToWorker, TransferMode, TransportKind, WorkerConfig};
use super::push::Pusher;
use super::worker::{Control, Stage as _, WorkerError, advertised_payload_with, host_pool, rss_bytes};
use crate::layouts::Region;
use crate::layouts::verify::FillPlan;
use crate::transfer::memory::{KvBuffer, PageSize};
use crate::transfer::notify::{LeaseTable, Notification, NotifyListener, UcxNotifyReceiver};
use crate::transfer::storage::StoragePublisher;
use crate::transfer::ucx::{Context, ContextOptions, HYBRID_SPIN, MemRegion, ProgressMode, Ucx, Worker};

/// Upper bound of one wait, so leases are checked even when nothing happens.
const MAX_WAIT: Duration = Duration::from_millis(100);

/// The rank's UCX side: context, worker and the registered pool. Field order is drop order.
struct UcxSide {
    /// Notifications sent as UCX active messages.
    am: UcxNotifyReceiver,
    region: MemRegion<KvBuffer>,
    worker: Worker,
    _ctx: Context,
}

/// The KV pool, registered with UCX or (after `Fault::KillUcx`, or without UCX) plain.
enum Pool {
    Ucx(Box<UcxSide>),
    Plain(KvBuffer),
    /// Transient state while switching.
    Gone,
}

impl Pool {
    fn memory(&self) -> Result<&KvBuffer, WorkerError> {
        match self {
            Pool::Ucx(u) => u.region.memory().stage("KV pool"),
            Pool::Plain(m) => Ok(m),
            Pool::Gone => Err(WorkerError::PoolGone),
        }
    }

    fn memory_mut(&mut self) -> Result<&mut KvBuffer, WorkerError> {
        match self {
            Pool::Ucx(u) => u.region.memory_mut().stage("KV pool"),
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

    /// Notifications received as UCX active messages since the last call.
    fn drain_am(&mut self) -> Vec<Notification> {
        match self {
            Pool::Ucx(u) => u.am.drain(),
            _ => Vec::new(),
        }
    }

    /// Tears the UCX side down and keeps the memory.
    fn kill_ucx(&mut self) -> Result<(), WorkerError> {
        if let Pool::Ucx(u) = std::mem::replace(self, Pool::Gone) {
            let UcxSide { am, region, worker, _ctx } = *u;
            drop(am);
            let mem = region.deregister().stage("deregister the KV pool")?;
            drop(worker);
            *self = Pool::Plain(mem);
        }
        Ok(())
    }
}

/// A request this rank holds.
struct Held {
    req: u64,
    blocks: Vec<u32>,
    published: bool,
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
    let regions = geom.regions();
    let total = usize::try_from(geom.total_bytes()).stage("pool size")?;
    let progress = cfg.transport.progress;
    let kind = cfg.transport.kind;
    let uses_ucx = !matches!(kind, TransportKind::Storage | TransportKind::CudaBatch);
    let uses_storage = kind == TransportKind::Storage
        || kind == TransportKind::Multi && cfg.transport.chain.contains(&TransportKind::Storage);
    let pages = if cfg.transport.huge_pages { PageSize::Huge } else { PageSize::Normal };
    let mem = KvBuffer::alloc(cfg.mem, total, pages)
        .stage(format!("allocate the {total}-byte KV pool in {} memory", cfg.mem))?;
    let mut ucx_lib = None;
    let (mut pool, worker_address, rkey, base) = if uses_ucx {
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
        (Pool::Ucx(Box::new(UcxSide { am, region, worker, _ctx: ctx })), address, rkey, base)
    } else {
        let base = crate::transfer::ucx::Registrable::addr(&mem);
        (Pool::Plain(mem), Vec::new(), Vec::new(), base)
    };
    // cuda-batch: the pool exported once; decode ranks map it and copy from it directly.
    let cuda_ipc = match kind {
        TransportKind::CudaBatch => Some(super::batch::export_pool(pool.memory()?)?),
        _ => None,
    };
    let listener = NotifyListener::bind(&format!("tcp://{}:0", cfg.bind_host))
        .stage("bind the notification listener")?;
    let notify_ep = advertise(listener.endpoint(), &cfg.advertise_host);
    // What the side channel advertises: with an empty worker address and remote key once the
    // UCX side is gone (`Fault::KillUcx`), so decode ranks fail fast instead of timing out.
    let payload_of = |worker_address: Vec<u8>, rkey: &[u8]| {
        let ipc = cuda_ipc.clone();
        advertised_payload_with(&cfg, &cfg.pair.p, &regions, base, worker_address, rkey, &notify_ep, ipc)
    };
    let payload = payload_of(worker_address, &rkey)?;
    let mut storage = if uses_storage {
        let opts = super::worker::storage_options(&cfg);
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
        pool_bytes: total as u64,
        rss_bytes: rss_bytes(),
    })))?;

    let mut leases = LeaseTable::new(Duration::from_millis(cfg.lease_ms));
    let mut held: HashMap<String, Held> = HashMap::new();
    // Push mode: registrations from decode ranks, matched with fills; the WRITEs.
    let mut pusher = (cfg.transport.mode == TransferMode::Push)
        .then(|| Pusher::new(Duration::from_millis(cfg.timeout_ms)));
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
        // Control messages.
        while let Some(msg) = ctl.try_recv()? {
            last_work = Instant::now();
            match msg {
                ToWorker::Fill { req, p_request_id, blocks, seed, expected_notifs } => {
                    let t0 = Instant::now();
                    let plan = FillPlan::new(&geom, &regions, &blocks, seed);
                    pool.memory_mut()?
                        .write_ranges(&plan.ranges(), |i, bytes| plan.fill(i, bytes))
                        .stage("fill the request's blocks")?;
                    let fill_ns = t0.elapsed().as_nanos() as u64;
                    let mut publish_ns = 0;
                    if eager_publish && let Some(s) = storage.as_mut() {
                        let t1 = Instant::now();
                        publish(s, &p_request_id, &regions, &blocks, pool.memory()?)?;
                        publish_ns = t1.elapsed().as_nanos() as u64;
                    }
                    // 0: the decode side's TP is unknown here (a serving engine); take the count
                    // the first notification names, as vLLM's P does.
                    let expected = (expected_notifs > 0).then_some(expected_notifs);
                    match leases.register(&p_request_id, expected, Instant::now()) {
                        Ok(_) => {
                            held.insert(p_request_id.clone(), Held { req, blocks, published: eager_publish });
                        }
                        Err(e) => tracing::warn!("{e}"),
                    }
                    ctl.send(&FromWorker::Filled { req, fill_ns, publish_ns })?;
                    // Push: the registration may have come first.
                    if let Some(p) = pusher.as_mut()
                        && p.is_registered(&p_request_id)
                    {
                        push_one(ctl, &cfg, &mut pool, p, &mut leases, &mut held, &p_request_id)?;
                    }
                }
                ToWorker::Fault(Fault::KillUcx) => {
                    tracing::warn!("fault injected: tearing down this rank's UCX side");
                    pool.kill_ucx()?;
                    ctl.send(&FromWorker::Republish { payload: payload_of(Vec::new(), &[])? })?;
                }
                ToWorker::Fault(Fault::Exit) => std::process::exit(3),
                // No decode engine will read these blocks (the request's decode leg failed, or
                // its client left before the handoff): free them now, not at lease expiry.
                ToWorker::Release { p_request_id } => {
                    leases.release(&p_request_id);
                    if let Some(p) = pusher.as_mut() {
                        p.forget(&p_request_id);
                    }
                    if let Some(h) = held.remove(&p_request_id) {
                        release(&mut storage, &p_request_id, h.published);
                        ctl.send(&FromWorker::Freed { req: h.req, expired: false })?;
                    }
                }
                ToWorker::Init(_) | ToWorker::Load { .. } | ToWorker::PeerGone { .. } => {}
                ToWorker::Shutdown => return Ok(()),
            }
        }
        // Notifications, heartbeats and fallback requests.
        let now = Instant::now();
        let zmq_notifs = listener.drain().stage("notifications")?;
        for n in pool.drain_am().into_iter().chain(zmq_notifs) {
            if let Notification::PushReg(reg) = n {
                let matched = pusher.as_mut().and_then(|p| p.register(*reg));
                if let (Some(id), Some(p)) = (matched, pusher.as_mut())
                    && held.contains_key(&id)
                {
                    push_one(ctl, &cfg, &mut pool, p, &mut leases, &mut held, &id)?;
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
        for id in leases.expire(Instant::now()) {
            if let Some(p) = pusher.as_mut() {
                p.forget(&id);
            }
            if let Some(h) = held.remove(&id) {
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
        let wait = leases
            .next_deadline()
            .map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()).min(MAX_WAIT));
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
fn push_one(
    ctl: &Control,
    cfg: &WorkerConfig,
    pool: &mut Pool,
    pusher: &mut Pusher,
    leases: &mut LeaseTable,
    held: &mut HashMap<String, Held>,
    id: &str,
) -> Result<(), WorkerError> {
    let Some(h) = held.remove(id) else { return Ok(()) };
    let result = match pool {
        Pool::Ucx(u) => {
            let UcxSide { region, worker, .. } = &mut **u;
            pusher.push(cfg, worker, region, id, &h.blocks)
        }
        _ => {
            pusher.give_up(id);
            Err((FailureCause::PeerGone, "this rank's UCX side is gone: nothing can be written".into()))
        }
    };
    leases.release(id);
    pusher.forget(id);
    ctl.send(&FromWorker::Freed { req: h.req, expired: false })?;
    let (stats, error) = match result {
        Ok(st) => (st, None),
        Err(e) => (Default::default(), Some(e)),
    };
    ctl.send(&FromWorker::Pushed {
        req: h.req,
        handshake_ns: stats.handshake_ns,
        post_ns: stats.post_ns,
        transfer_ns: stats.transfer_ns,
        notify_ns: stats.notify_ns,
        bytes: stats.bytes,
        descriptors: stats.descriptors,
        error,
    })
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
    let (h, port) = super::engine::split_endpoint(endpoint);
    if h == "0.0.0.0" || h == "*" || h.is_empty() {
        format!("tcp://{host}:{port}")
    } else {
        endpoint.to_string()
    }
}
