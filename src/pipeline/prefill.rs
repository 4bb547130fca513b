//! A prefill rank: registers its KV pool, advertises it, fills request blocks with the
//! byte pattern, holds them under a lease, and frees them after the decode side's
//! notifications (or when the lease runs out).
//!
//! One thread waits on everything at once: the engine's control socket, the ZMQ
//! notification socket and UCX's event fd, which also wakes it for notifications sent as
//! UCX active messages (drained after each progress round). The UCX worker is progressed
//! whenever it has work, because UCX builds that emulate GET in software need the target
//! to progress.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::proto::{FromWorker, ReadyInfo, ToWorker, WorkerConfig};
use super::worker::{Control, WorkerError, compat_factors, rss_bytes, werr};
use crate::layouts::verify::fill_request;
use crate::transfer::handshake::meta::{KvxMetadata, KvxRegion};
use crate::transfer::memory::{HostBuffer, PageSize};
use crate::transfer::notify::{LeaseTable, NotifyListener, UcxNotifyReceiver};
use crate::transfer::ucx::{Context, ContextOptions, HYBRID_SPIN, MemRegion, ProgressMode, Ucx, Worker};

/// Upper bound of one wait, so leases are checked even when nothing happens.
const MAX_WAIT: Duration = Duration::from_millis(100);

pub fn run(ctl: &Control, cfg: WorkerConfig) -> Result<(), WorkerError> {
    let geom = cfg.pair.p_geometry(cfg.rank);
    let regions = geom.regions();
    let total = usize::try_from(geom.total_bytes()).map_err(werr!("pool size"))?;
    let progress: ProgressMode = parse_progress(&cfg.transport.progress)?;
    let ucx = Ucx::load(cfg.transport.ucx_lib.as_deref()).map_err(werr!("load UCX"))?;
    // Active messages always: decode ranks choose how to notify, this rank takes both.
    let ctx =
        Context::new(&ucx, &ContextOptions { progress, active_messages: true, ..ContextOptions::default() })
            .map_err(werr!("UCX context"))?;
    let worker = Worker::new(&ctx).map_err(werr!("UCX worker"))?;
    let mut am_notify = UcxNotifyReceiver::new(&worker).map_err(werr!("UCX notification handler"))?;
    let pages = if cfg.transport.huge_pages { PageSize::Huge } else { PageSize::Normal };
    let mem = HostBuffer::alloc(total, pages).map_err(werr!(format!("allocate the {total}-byte KV pool")))?;
    let mut region = MemRegion::register(&ctx, mem).map_err(werr!("register the KV pool with UCX"))?;
    let rkey = region.pack_rkey().map_err(werr!("pack the remote key"))?;
    let listener = NotifyListener::bind(&format!("tcp://{}:0", cfg.bind_host))
        .map_err(werr!("bind the notification listener"))?;
    let notify_ep = advertise(listener.endpoint(), &cfg.advertise_host);
    let base = region.addr();
    let kvx_regions: Vec<KvxRegion> = regions
        .iter()
        .map(|r| KvxRegion {
            name: r.name.clone(),
            mem_type: "host".into(),
            device_id: 0,
            base_addr: base + r.base_off,
            rkey: rkey.as_bytes().to_vec(),
            block_len_bytes: r.block_len,
            block_stride_bytes: r.block_stride,
            num_blocks: r.num_blocks,
        })
        .collect();
    let factors = compat_factors(&cfg.pair.model, cfg.pair.version);
    let meta = KvxMetadata::new(
        cfg.engine_id.clone(),
        worker.address().map_err(werr!("UCX worker address"))?,
        (cfg.pair.p.tp, cfg.rank, 0, 0),
        cfg.pair.p.layout.name(),
        cfg.pair.p.block_tokens,
        kvx_regions,
        Some(notify_ep),
        &factors,
    );
    let payload = meta.to_payload().map_err(werr!("encode metadata"))?.encode();
    ctl.send(&FromWorker::Ready(Box::new(ReadyInfo {
        rank: cfg.rank,
        handshake_payload: Some(payload),
        ucx_library: ucx.path().display().to_string(),
        ucx_version: ucx.version().to_string(),
        pool_bytes: total as u64,
        rss_bytes: rss_bytes(),
    })))?;

    let mut leases = LeaseTable::new(Duration::from_millis(cfg.lease_ms));
    // p_request_id -> engine request number, for reporting frees.
    let mut held: HashMap<String, u64> = HashMap::new();
    let mut last_work = Instant::now();
    let mut unrecognized_seen = 0;
    loop {
        // Progress UCX until it has nothing to do. Only work other than notifications
        // (serving reads UCX emulates in software) starts a spin: a notification ends a
        // request, and a rank that spins after it keeps the core from the decode rank
        // that just woke it, whose send then waits out the whole spin.
        let mut spins = 0u32;
        let mut events = 0u64;
        let am_before = am_notify.am_stats().received;
        loop {
            let n = worker.progress();
            if n == 0 || spins >= 65_536 {
                break;
            }
            spins += 1;
            events += u64::from(n);
        }
        if events > am_notify.am_stats().received - am_before {
            last_work = Instant::now();
        }
        // Control messages.
        while let Some(msg) = ctl.try_recv()? {
            last_work = Instant::now();
            match msg {
                ToWorker::Fill { req, p_request_id, blocks, seed, expected_notifs } => {
                    let t0 = Instant::now();
                    let mem = region.memory_mut().map_err(werr!("KV pool"))?;
                    fill_request(&geom, &regions, &blocks, seed, mem.as_mut_slice());
                    let fill_ns = t0.elapsed().as_nanos() as u64;
                    match leases.register(&p_request_id, Some(expected_notifs), Instant::now()) {
                        Ok(_) => {
                            held.insert(p_request_id, req);
                        }
                        Err(e) => tracing::warn!("{e}"),
                    }
                    ctl.send(&FromWorker::Filled { req, fill_ns })?;
                }
                ToWorker::Abandon { .. } => {}
                ToWorker::Shutdown => return Ok(()),
                ToWorker::Init(_) | ToWorker::Load { .. } => {}
            }
        }
        // Notifications and heartbeats.
        let now = Instant::now();
        let zmq_notifs = listener.drain().map_err(werr!("notifications"))?;
        for n in am_notify.drain().into_iter().chain(zmq_notifs) {
            for id in leases.apply(&n, now) {
                if let Some(req) = held.remove(&id) {
                    ctl.send(&FromWorker::Freed { req, expired: false })?;
                }
            }
        }
        for id in leases.expire(Instant::now()) {
            if let Some(req) = held.remove(&id) {
                ctl.send(&FromWorker::Freed { req, expired: true })?;
            }
        }
        let unrecognized = leases.stats().unrecognized;
        if unrecognized > unrecognized_seen {
            ctl.send(&FromWorker::Unrecognized { count: unrecognized - unrecognized_seen })?;
            unrecognized_seen = unrecognized;
        }
        // Wait for the next event.
        let spin = match progress {
            ProgressMode::Busy => true,
            ProgressMode::Hybrid => last_work.elapsed() < HYBRID_SPIN,
            ProgressMode::Wait => false,
        };
        if spin || !worker.arm().map_err(werr!("arm the UCX worker"))? {
            continue;
        }
        let wait = leases
            .next_deadline()
            .map_or(MAX_WAIT, |d| d.saturating_duration_since(Instant::now()).min(MAX_WAIT));
        let mut items =
            vec![ctl.socket().as_poll_item(zmq::POLLIN), listener.socket().as_poll_item(zmq::POLLIN)];
        if let Some(fd) = worker.event_fd() {
            items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
        }
        let ms = (wait.as_millis() as i64).max(1);
        zmq::poll(&mut items, ms).map_err(werr!("wait for events"))?;
    }
}

pub(super) fn parse_progress(s: &str) -> Result<ProgressMode, WorkerError> {
    match s {
        "" | "hybrid" => Ok(ProgressMode::Hybrid),
        "busy" => Ok(ProgressMode::Busy),
        "wait" => Ok(ProgressMode::Wait),
        other => Err(WorkerError::new(format!("unknown progress mode '{other}' (busy, wait or hybrid)"))),
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
