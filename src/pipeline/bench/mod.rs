//! `kvx bench`: a prefill engine and a decode engine of real worker processes, a stream of
//! requests through the whole lifecycle, and a report.
//!
//! The driver plays vLLM's proxy and schedulers: for each request it asks the prefill
//! engine to fill and hold blocks, hands the resulting `kv_transfer_params` to the decode
//! engine, and records what every decode rank measured. Timed stages are measured inside
//! the workers; the driver only aggregates them, so its own scheduling never shows up as
//! transfer time.

pub mod compare;
pub mod sweep;
pub mod workload;

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::arrival::Arrival;
use crate::config::bench::{BenchSettings, DescriptorShare, FailurePolicy};
use crate::config::engine::WorkerSettings;
use crate::config::xfer::{SessionOptions, TargetSpec, XferConfig};
use crate::layouts::compat::PairSpec;
use crate::pipeline::bench::workload::Generator;
use crate::pipeline::engine::{Engine, EngineError, EngineFinal};
use crate::pipeline::wire::LoadResult;
use crate::report::bandwidth::{BandwidthTally, RankTransfer};
use crate::report::files::RunWriter;
use crate::report::recorder::StageRecorder;
use crate::report::summary::{
    Calibration, RankList, RankRead, RankReads, RankThroughput, RepeatMetrics, RequestOutcome, RequestRow,
    RequestTotals, RunEvent, Stage, Summary, UcxInfo,
};
use crate::report::verdict::{FAILURES_AFTER_FAULT, FAULT_CAUSES, FAULT_INJECTED};
use crate::report::xfer::XferReport;
use crate::vocab::kinds::Role;

/// Why a bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Report(#[from] crate::report::ReportError),
    #[error("{0}")]
    Other(String),
}

/// One finished request, as the driver saw it.
struct Finished {
    row: RequestRow,
    /// From sending the prefill leg to the KV landed on every decode rank (0: failed).
    ready_ns: u64,
    publish_ns: u64,
    /// `--kv-buffer-device cpu`: the slowest prefill rank's copy to its host buffer.
    save_ns: u64,
    ranks: Vec<LoadResult>,
    /// Each rank's part of the transfer, for the wall-span bandwidth (pull mode).
    transfers: Vec<RankTransfer>,
    verify_failures: u64,
    bytes_verified: u64,
    bytes_padding: u64,
}

impl Finished {
    /// A request that failed before any decode rank reported on it.
    fn failed(row: RequestRow) -> Self {
        Finished {
            row,
            ready_ns: 0,
            publish_ns: 0,
            save_ns: 0,
            ranks: vec![],
            transfers: vec![],
            verify_failures: 0,
            bytes_verified: 0,
            bytes_padding: 0,
        }
    }
}

/// The two engines of a bench.
pub struct Engines {
    pub prefill: Engine,
    pub decode: Engine,
}

impl Engines {
    pub fn start(s: &BenchSettings) -> Result<Engines, BenchError> {
        let prefill = Engine::start(s.engine(Role::Prefill))?;
        let decode = Engine::start(s.engine(Role::Decode))?;
        Ok(Engines { prefill, decode })
    }
}

/// The notifications each prefill rank waits for per request.
fn expected_notifs(pair: &PairSpec) -> u32 {
    let (p, d) = (pair.p.tp, pair.d.tp);
    if d > p { d / p } else { 1 }
}

/// What the driver shares with every request of a repeat.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    engines: &'a Engines,
    s: &'a BenchSettings,
    run_id: &'a str,
    t_start: Instant,
    repeat: u32,
}

/// Runs one request through both engines.
async fn one_request(c: Ctx<'_>, req: u64, tokens: u32, seed: u64, arrival: Instant) -> Finished {
    let Ctx { engines, s, run_id, t_start, repeat } = c;
    let p_request_id = format!("cmpl-{run_id}-{req}-0");
    let d_request_id = format!("cmpl-{run_id}-{req}-d");
    let d_info = engines.decode.info();
    let n_d = match &d_info.hybrid {
        // A hybrid model's block positions: of the tokens prefill computes.
        Some(shape) => shape.positions(tokens),
        None => tokens.div_ceil(s.workers.pair.d.block_tokens),
    };
    let hit = (f64::from(n_d) * s.prefix_hit).floor() as u32;
    // Blocks decode allocates (a hybrid model: one per group and position).
    let local_blocks = d_info.request_blocks(tokens, s.workers.pair.d.block_tokens, hit);
    let mut row = RequestRow {
        request_id: p_request_id.clone(),
        repeat,
        start_offset_us: arrival.saturating_duration_since(t_start).as_secs_f64() * 1e6,
        prompt_tokens: u64::from(tokens),
        blocks: u64::from(n_d - hit),
        ..RequestRow::default()
    };
    let fail = |row: &mut RequestRow, cause: &str| {
        row.outcome = match s.on_failure {
            FailurePolicy::Fail => RequestOutcome::Failed,
            FailurePolicy::Recompute => RequestOutcome::Recomputed,
        };
        row.failure_cause = Some(cause.to_string());
    };
    // An engine with a dead rank cannot serve: fail at once rather than fill prefill blocks
    // no decode rank will read (they would sit out their lease and starve later requests).
    if let Some(e) = engines.prefill.gone().or_else(|| engines.decode.gone()) {
        fail(&mut row, e.cause().as_str());
        return Finished::failed(row);
    }
    let dispatched = Instant::now();
    let prefill =
        engines.prefill.prefill(req, p_request_id.clone(), tokens, seed, expected_notifs(&s.workers.pair));
    // Concurrent dispatch (push): decode registers its blocks while prefill computes; it needs
    // only the prefill engine's identity, not its answer.
    let early_load = (s.dispatch == crate::config::worker::Dispatch::Concurrent).then(|| {
        let params = engines.prefill.info().kv_params(&p_request_id, tokens, &[], s.workers.transport.mode);
        engines.decode.load(req, d_request_id.clone(), params, local_blocks, seed)
    });
    let prefill = prefill.await;
    let (params, publish_ns, save_ns) = match prefill {
        Ok(Ok(done)) => (done.params, done.publish_ns, done.save_ns),
        Ok(Err(e)) => {
            fail(&mut row, e.cause().as_str());
            tracing::warn!("request {req}: prefill failed: {e}");
            // Ranks that did fill hold the blocks; nothing will read them.
            engines.prefill.release(p_request_id.clone());
            if let Some(load) = early_load {
                // Its decode ranks would wait for WRITEs that will not come: tell them.
                engines.decode.release(p_request_id);
                let _ = load.await;
            }
            return Finished::failed(row);
        }
        Err(_) => {
            fail(&mut row, "internal");
            return Finished::failed(row);
        }
    };
    let load = match early_load {
        Some(load) => load.await,
        None => engines.decode.load(req, d_request_id, params, local_blocks, seed).await,
    };
    let ready_ns = dispatched.elapsed().as_nanos() as u64;
    let ranks = match load {
        Ok(Ok(done)) => done.ranks,
        Ok(Err(e)) => {
            fail(&mut row, e.cause().as_str());
            tracing::warn!("request {req}: load failed: {e}");
            // No decode rank will read these blocks: free them now, not at lease expiry (as
            // the serving proxy does when a decode leg fails).
            engines.prefill.release(p_request_id);
            return Finished::failed(row);
        }
        Err(_) => {
            fail(&mut row, "internal");
            return Finished::failed(row);
        }
    };
    let us = |ns: u64| ns as f64 / 1e3;
    let max = |f: fn(&LoadResult) -> u64| ranks.iter().map(f).max().unwrap_or(0);
    row.bytes = ranks.iter().map(|r| r.bytes).sum();
    row.descriptors_raw = ranks.iter().map(|r| r.descs_raw).sum();
    row.descriptors_coalesced = ranks.iter().map(|r| r.descs_coalesced).sum();
    row.queue_us = Some(us(max(|r| r.queue_ns)));
    row.handshake_us = ranks.iter().filter_map(|r| r.handshake_ns).max().map(us);
    row.plan_us = Some(us(max(|r| r.plan_ns)));
    row.post_us = Some(us(max(|r| r.post_ns)));
    row.transfer_us = Some(us(max(|r| r.transfer_ns)));
    // Pull: the decode ranks' reads are the transfer (push: the prefill ranks' WRITEs, which
    // they report at the end, `push_stages`).
    let transfers: Vec<RankTransfer> = if s.workers.transport.mode == crate::topology::TransferMode::Pull {
        ranks
            .iter()
            .map(|r| RankTransfer {
                rank: r.d_rank,
                bytes: r.bytes,
                transfer_ns: r.transfer_ns,
                post_ns: r.post_ns,
                span: r.transfer_span,
            })
            .collect()
    } else {
        Vec::new()
    };
    row.transfer_span_us = crate::clock::wall_span_ns(transfers.iter().map(|t| t.span)).map(us);
    // Each rank's reads on the request's timeline: starts after the first rank's, where the
    // ranks share a clock (the wall span exists only then).
    let first_start =
        row.transfer_span_us.and_then(|_| transfers.iter().filter_map(|t| t.span.map(|s| s.start_ns)).min());
    row.rank_reads = RankReads(
        transfers
            .iter()
            .map(|t| RankRead {
                rank: t.rank,
                start_us: first_start.zip(t.span).map(|(f, s)| us(s.start_ns.saturating_sub(f))),
                read_us: us(t.transfer_ns),
                bytes: t.bytes,
            })
            .collect(),
    );
    row.notify_us = Some(us(max(|r| r.notify_ns)));
    row.e2e_us = Some(us(max(|r| r.e2e_ns)));
    row.d_ranks = RankList(ranks.iter().map(|r| r.d_rank).collect());
    if let Some((cause, msg)) = ranks.iter().find_map(|r| r.error.clone()) {
        fail(&mut row, cause.as_str());
        tracing::warn!("request {req}: {msg}");
        // A rank that failed its reads sent no notification: release the prefill blocks.
        engines.prefill.release(p_request_id.clone());
    }
    let verify_failures = ranks.iter().filter(|r| r.verify_failure.is_some()).count() as u64;
    if let Some(m) = ranks.iter().find_map(|r| r.verify_failure.as_ref()) {
        tracing::warn!("request {req}: verification failed: {m}");
        if row.outcome == RequestOutcome::Ok {
            fail(&mut row, "verify");
        }
    }
    row.verify_us = Some(max(|r| r.verify_ns)).filter(|v| *v > 0).map(us);
    let bytes_verified = ranks.iter().map(|r| r.bytes_verified).sum();
    let bytes_padding = ranks.iter().map(|r| r.bytes_padding).sum();
    // Prefill start to the KV in decode's blocks, as the driver saw it (verification excluded).
    let ready_ns = ready_ns.saturating_sub(ranks.iter().map(|r| r.verify_ns).max().unwrap_or(0));
    Finished {
        row,
        publish_ns,
        save_ns,
        ranks,
        transfers,
        verify_failures,
        bytes_verified,
        bytes_padding,
        ready_ns,
    }
}

/// The run's events on its repeats' timelines (see [`RunEvent`]): the warm-up before the
/// first repeat, the fault injected, and each lease that expired (one before the first
/// repeat's start is on its timeline, at a negative time).
fn run_events(
    s: &BenchSettings,
    warm_start: Instant,
    repeat_starts: &[Instant],
    fault_at: Option<(u32, Duration)>,
    lease_expired_at: &[Instant],
) -> Vec<RunEvent> {
    let Some(&first) = repeat_starts.first() else { return Vec::new() };
    let mut events = Vec::new();
    if s.warmup > 0 {
        events.push(RunEvent {
            kind: "warm_up".into(),
            repeat: 0,
            t_s: -first.saturating_duration_since(warm_start).as_secs_f64(),
            detail: format!("{} requests, not measured", s.warmup),
        });
    }
    if let (Some((repeat, at)), Some(plan)) = (fault_at, s.fault) {
        events.push(RunEvent {
            kind: "fault".into(),
            repeat,
            t_s: at.as_secs_f64(),
            detail: format!("{:?} into {} rank {}", plan.fault, plan.role.as_str(), plan.rank),
        });
    }
    for at in lease_expired_at {
        let repeat = repeat_starts.iter().rposition(|r| r <= at).unwrap_or(0);
        let origin = repeat_starts[repeat];
        let t_s = if *at >= origin {
            at.duration_since(origin).as_secs_f64()
        } else {
            -origin.duration_since(*at).as_secs_f64()
        };
        events.push(RunEvent {
            kind: "lease_expired".into(),
            repeat: repeat as u32,
            t_s,
            detail: String::new(),
        });
    }
    events
}

/// Accumulates one measured repeat.
#[derive(Default)]
struct Tally {
    totals: RequestTotals,
    recorder: StageRecorder,
    verify_failures: u64,
    bytes_verified: u64,
    bytes_padding: u64,
    /// A hybrid model: bytes and descriptors per group and part of the requests that ended ok.
    parts: Vec<crate::report::summary::PartBytes>,
    per_rank_bytes: BTreeMap<u32, (u64, u64)>,
    ucx: UcxSeen,
    handshake: StageRecorder,
    /// Requests a fallback transport served after the first one failed.
    fallbacks: u64,
    /// Requests served by the storage transport.
    via_storage: u64,
    /// Batched copies of the cuda-batch transport.
    batch: crate::pipeline::worker::batch::BatchTally,
    /// Per-request bandwidth by the wall-span rule (pull mode; push tallies its WRITEs).
    bandwidth: BandwidthTally,
}

impl Tally {
    fn add(&mut self, f: &Finished) {
        self.totals.add(&f.row);
        self.verify_failures += f.verify_failures;
        self.bytes_verified += f.bytes_verified;
        self.bytes_padding += f.bytes_padding;
        if f.row.outcome == RequestOutcome::Ok {
            for r in &f.ranks {
                crate::report::summary::add_parts(&mut self.parts, &r.parts);
            }
            // Every known stage but the handshake, which only some requests have (below).
            for stage in Stage::ALL.into_iter().filter(|s| *s != Stage::Handshake) {
                if let Some(v) = f.row.stage_us(stage) {
                    self.recorder.record_ns(stage.as_str(), (v * 1e3) as u64);
                }
            }
            if f.publish_ns > 0 {
                self.recorder.record_ns("publish", f.publish_ns);
            }
            // Host buffer: its two copies, each the slowest rank's.
            if f.save_ns > 0 {
                self.recorder.record_ns(SAVE_TO_HOST, f.save_ns);
            }
            let sync = f.ranks.iter().map(|r| r.sync_ns).max().unwrap_or(0);
            if sync > 0 {
                self.recorder.record_ns(SYNC_TO_DEVICE, sync);
            }
            if f.ready_ns > 0 {
                self.recorder.record_ns(READY, f.ready_ns);
            }
            if f.ranks.iter().any(|r| r.fallbacks > 0) {
                self.fallbacks += 1;
            }
            if f.ranks.iter().any(|r| r.transport == Some(crate::vocab::kinds::TransportKind::Storage)) {
                self.via_storage += 1;
            }
            self.batch.add(&f.ranks);
            if !f.transfers.is_empty() {
                self.bandwidth.add(&f.transfers);
            }
            let verify = f.ranks.iter().map(|r| r.verify_ns).max().unwrap_or(0);
            if verify > 0 {
                self.recorder.record_ns("verify", verify);
            }
            for r in &f.ranks {
                let e = self.per_rank_bytes.entry(r.d_rank).or_default();
                e.0 += r.bytes;
                e.1 += 1;
            }
        }
        if let Some(h) = f.row.handshake_us {
            self.handshake.record_ns(Stage::Handshake.as_str(), (h * 1e3) as u64);
        }
        for r in &f.ranks {
            self.ucx.see(r);
        }
    }
}

/// What the ranks that move KV reported of UCX's choices, each from the first report that
/// said it: decode ranks report theirs once per prefill engine, after their first reads; in
/// push mode the prefill ranks report their WRITEs' with their first written request.
#[derive(Debug, Clone, Default)]
pub struct UcxSeen {
    transports: Option<String>,
    protocols: Option<crate::transfer::ucx::ProtoReport>,
    settings: Option<Vec<String>>,
}

impl UcxSeen {
    pub fn see(&mut self, r: &LoadResult) {
        self.transports = self.transports.take().or_else(|| r.transports.clone());
        self.protocols = self.protocols.take().or_else(|| r.protocols.clone());
        self.settings = self.settings.take().or_else(|| r.ucx_settings.clone());
    }

    /// What a prefill rank reported of its WRITEs (push mode).
    pub fn see_writes(&mut self, c: &crate::pipeline::wire::UcxChoices) {
        self.transports = self.transports.take().or_else(|| c.transports.clone());
        self.protocols = self.protocols.take().or_else(|| Some(c.protocols.clone()));
        self.settings = self.settings.take().or_else(|| Some(c.settings.clone()));
    }

    fn or(&mut self, other: &UcxSeen) {
        self.transports = self.transports.take().or_else(|| other.transports.clone());
        self.protocols = self.protocols.take().or_else(|| other.protocols.clone());
        self.settings = self.settings.take().or_else(|| other.settings.clone());
    }

    /// Fills the summary's UCX section, and warns when device memory is read the slow way.
    pub fn report(self, s: &WorkerSettings, summary: &mut Summary) {
        let transports = self.transports.unwrap_or_default();
        summary.ucx.transports =
            transports.split(", ").filter(|t| !t.is_empty()).map(str::to_string).collect();
        summary.ucx.settings = self.settings.unwrap_or_default();
        if let Some(p) = self.protocols {
            // The decode ranks' first slot follows the prefill ranks' (`KvMemory`'s rule).
            let d_place = s.mem.place(s.pair.p.tp);
            let op = match s.transport.mode {
                crate::topology::TransferMode::Pull => crate::transfer::ucx::Rma::Get,
                crate::topology::TransferMode::Push => crate::transfer::ucx::Rma::Put,
            };
            summary.warnings.extend(crate::report::xfer::protocol_warnings(
                d_place,
                op,
                &p,
                &summary.ucx.settings,
                &transports,
            ));
            summary.ucx.protocols = Some(p);
        }
    }
}

/// Drives `count` requests (or until `until`) and calls `done` for each.
async fn drive(
    c: Ctx<'_>,
    generator: &mut Generator,
    first_req: u64,
    count: Option<u64>,
    until: Option<Instant>,
    mut done: impl FnMut(Finished),
) -> Instant {
    let Ctx { s, .. } = c;
    let c = Ctx { t_start: Instant::now(), ..c };
    let t_start = c.t_start;
    let mut in_flight = FuturesUnordered::new();
    let mut next = first_req;
    let more =
        |next: u64| count.is_none_or(|c| next < first_req + c) && until.is_none_or(|u| Instant::now() < u);
    let mut next_at = Instant::now();
    // Set by an interrupt: no new requests; those in flight get until then to finish.
    let mut grace: Option<Instant> = None;
    let mut told_gone = false;
    loop {
        // Push mode: decode ranks wait for WRITE notifications; once a prefill rank is gone,
        // tell them, so the requests waiting for it fail now rather than at their deadline.
        if !told_gone
            && s.workers.transport.mode == crate::topology::TransferMode::Push
            && c.engines.prefill.gone().is_some()
        {
            c.engines.decode.peer_gone(c.engines.prefill.info().engine_id.clone());
            told_gone = true;
        }
        if grace.is_none() && crate::interrupt::requested().is_some() {
            grace = Some(Instant::now() + INTERRUPT_GRACE);
        }
        if grace.is_some_and(|g| in_flight.is_empty() || Instant::now() >= g) {
            break;
        }
        let arrive = grace.is_none() && more(next);
        let poisson = match s.arrival {
            Arrival::Closed { concurrency } => {
                if arrive {
                    while in_flight.len() < concurrency.max(1) as usize && more(next) {
                        let (tokens, seed) = (generator.prompt_len(), generator.pattern_seed());
                        in_flight.push(one_request(c, next, tokens, seed, Instant::now()));
                        next += 1;
                    }
                }
                None
            }
            Arrival::Poisson { rate } => arrive.then_some(rate),
        };
        if in_flight.is_empty() && poisson.is_none() {
            break;
        }
        let sleep = tokio::time::sleep_until(next_at.into());
        tokio::pin!(sleep);
        tokio::select! {
            () = &mut sleep, if poisson.is_some() => {
                let (tokens, seed) = (generator.prompt_len(), generator.pattern_seed());
                in_flight.push(one_request(c, next, tokens, seed, next_at));
                next += 1;
                next_at += generator.inter_arrival(poisson.unwrap_or(1.0));
            }
            Some(f) = in_flight.next() => done(f),
            // Polls for an interrupt while requests are slow to finish.
            () = tokio::time::sleep(INTERRUPT_POLL) => {}
        }
    }
    t_start
}

/// The stage from sending a request's prefill leg to its KV in every decode rank's blocks
/// (prefill, handoff and transfer; verification excluded): the KV part of TTFT, and the one
/// figure that compares pull and push whatever the dispatch.
pub const READY: &str = "kv_ready";

/// `--kv-buffer-device cpu`: prefill's copy of a request's blocks from its KV pool to its host
/// buffer (vLLM's `save_kv_to_host`), the slowest rank's.
pub const SAVE_TO_HOST: &str = "save_to_host";

/// `--kv-buffer-device cpu`: decode's copy of the received blocks from its host buffer into its
/// KV pool (vLLM's `sync_recved_kv_to_device`), the slowest rank's.
pub const SYNC_TO_DEVICE: &str = "sync_to_device";

/// How long requests in flight get to finish after an interrupt before the run stops
/// waiting for them (the engines' teardown and the report must fit in the 2 s a user waits).
const INTERRUPT_GRACE: Duration = Duration::from_millis(700);

/// How often a run waiting on its requests checks for an interrupt.
const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// The size of the fixed UCX loopback read the gate normalises by: the same on every run,
/// whatever the scenario's descriptors, so a scenario change cannot move the yardstick.
pub const CALIBRATION_READ_BYTES: u64 = 64 << 10;

/// Calibration samples taken before the engines start, and as many again after they stop, in a
/// run with repeats (what the gate compares); the summary keeps each figure's median, so a busy
/// moment at either end does not move it alone. A single run takes one sample at each end (a
/// sample costs about 2.5 s).
fn calibration_sample_count(s: &BenchSettings) -> usize {
    if s.repeat > 1 { 3 } else { 1 }
}

/// Measures one calibration sample: a single-thread memcpy and a fixed UCX loopback read
/// ([`CALIBRATION_READ_BYTES`], 64 in flight, hybrid progress, cold working set) with the bench's
/// UCX library, plus `kvx xfer` at the scenario's own descriptor size and in-flight depth
/// (`xfer_same_size_gbps`, the reference the bench's throughput is compared with). The bench's
/// own progress and window settings are deliberately not used: they are what a gated change
/// might make slower.
///
/// Device-memory runs measure in the first decode rank's memory (`kvx xfer --mem cuda
/// --device N`); there the ceiling is a device-to-device copy of the descriptor size and
/// batch (`device_copy_gbps`), not a host memcpy.
pub fn calibrate(s: &BenchSettings, xfer: XferRunner, descriptor_bytes: u64) -> Option<Calibration> {
    use crate::transfer::cuda;
    use crate::transfer::ucx::ProgressMode;
    const FIXED_INFLIGHT: usize = 64;
    let mix = calibration_mix(&s.descriptor_mix);
    let mut sizes = vec![CALIBRATION_READ_BYTES, descriptor_bytes];
    sizes.extend(mix.iter().map(|d| d.descriptor_bytes));
    sizes.sort_unstable();
    sizes.dedup();
    let own_inflight = (s.workers.transport.inflight as usize).max(1);
    let mut inflight = vec![FIXED_INFLIGHT];
    if own_inflight != FIXED_INFLIGHT {
        inflight.push(own_inflight);
    }
    let mem = s.workers.mem.place(s.workers.pair.p.tp);
    let cfg = XferConfig {
        sizes,
        inflight,
        working_set_bytes: 256 << 20,
        hot: false,
        ucx_alloc: false,
        huge_pages: false,
        mem,
        duration: Duration::from_millis(300),
        iters: None,
        timeout: s.workers.timeout,
        peer_timeout: s.workers.timeout,
        session: SessionOptions {
            ucx_lib: s.workers.transport.ucx_lib.clone(),
            progress: ProgressMode::Hybrid,
            err_mode: crate::transfer::ucx::ErrMode::None,
            ucx_config: vec![],
        },
        cuda_batch: None,
        nixl: None,
        misalign: Default::default(),
    };
    match xfer(&cfg, &TargetSpec::Local { exe: s.workers.exe.clone() }) {
        Ok(rep) => {
            let at = |size: u64, depth: usize| {
                rep.results.iter().find(|r| r.size_bytes == size && r.inflight == depth)
            };
            let fixed = at(CALIBRATION_READ_BYTES, FIXED_INFLIGHT)?;
            let same = at(descriptor_bytes, own_inflight)?;
            let mut c = Calibration {
                memcpy_gbps: fixed.memcpy_gbps,
                ucx_loopback_gbps: Some(fixed.gbps),
                ..Calibration::default()
            };
            c.extra.insert("loopback_bytes".into(), serde_json::json!(CALIBRATION_READ_BYTES));
            c.extra.insert("descriptor_bytes".into(), serde_json::json!(descriptor_bytes));
            c.extra.insert("xfer_same_size_gbps".into(), serde_json::json!(same.gbps));
            // A hybrid run's reads mix sizes: xfer at each, weighted by the bytes each carries,
            // is the reference its transfers are compared with.
            let measured: Option<Vec<MixSize>> = mix
                .iter()
                .map(|d| {
                    at(d.descriptor_bytes, own_inflight).map(|r| MixSize {
                        descriptor_bytes: d.descriptor_bytes,
                        bytes_per_request: d.bytes,
                        gbps: r.gbps,
                    })
                })
                .collect();
            if let Some(measured) = measured.filter(|m| !m.is_empty()) {
                let all: u64 = s.descriptor_mix.iter().map(|d| d.bytes).sum();
                let kept: u64 = measured.iter().map(|m| m.bytes_per_request).sum();
                c.extra.insert("xfer_mix_share".into(), serde_json::json!(kept as f64 / all.max(1) as f64));
                insert_mix(&mut c, &measured);
            }
            c.extra.insert("transports".into(), serde_json::json!(rep.ucx.transports));
            if mem.is_device() {
                c.extra.insert("memory".into(), serde_json::json!(mem.to_string()));
                c.extra.insert("device_copy_gbps".into(), serde_json::json!(same.ceiling_gbps));
                // The GPU's own bandwidth: what a transport that moves a request's descriptors
                // without a copy each (cuda-batch) is measured against.
                if let Some(device) = mem.device() {
                    match cuda::device_bandwidth_gbps(device, Duration::from_millis(200)) {
                        Ok(g) => {
                            c.extra.insert("device_bandwidth_gbps".into(), serde_json::json!(g));
                            c.extra.insert(
                                "device_bandwidth_bytes".into(),
                                serde_json::json!(cuda::DEVICE_BANDWIDTH_BYTES),
                            );
                        }
                        Err(e) => tracing::warn!("device bandwidth not measured: {e}"),
                    }
                }
            }
            Some(c)
        }
        Err(e) => {
            tracing::warn!("calibration skipped: {e}");
            None
        }
    }
}

/// [`calibration_sample_count`] calibration samples, taken while no kvx worker runs (a change that
/// makes idle workers burn CPU must not slow its own yardstick).
fn calibration_samples(s: &BenchSettings, xfer: XferRunner) -> Vec<Calibration> {
    if !s.calibrate {
        return Vec::new();
    }
    (0..calibration_sample_count(s))
        .take_while(|_| crate::interrupt::requested().is_none())
        .filter_map(|_| calibrate(s, xfer, calibration_size(s)))
        .collect()
}

/// Runs a `kvx xfer` measurement for the calibration: `diagnose::xfer::run_for_calibration`,
/// handed in by the caller since `pipeline` sits below `diagnose`. `Err` says why the sample
/// is skipped.
pub type XferRunner = fn(&XferConfig, &TargetSpec) -> Result<XferReport, String>;

/// Runs the bench and writes the run directory; returns the final summary. `xfer` measures
/// the calibration samples (taken unless `s.calibrate` is off).
pub fn run(
    s: &BenchSettings,
    writer: &mut RunWriter,
    run_id: &str,
    xfer: XferRunner,
) -> Result<Summary, BenchError> {
    let started = crate::report::summary::now_rfc3339();
    let mut summary = Summary::new(run_id, started, crate::report::scenario::bench_scenario(s));
    summary.environment = crate::host::Environment::detect();
    summary.environment.launcher = s.launcher.clone();
    summary.partial = true;
    // The first partial summary marks the directory as a run under way; a disk that cannot
    // hold it does not stop the measurement (what cannot be written is said at the end, and
    // the tables are printed first).
    if let Err(e) = writer.write_partial(&summary) {
        crate::output::note!(
            "kvx bench: warning: {}: measuring anyway; the tables are printed at the end",
            crate::report::files::error_chain(&e)
        );
    }
    let mut calibration = calibration_samples(s, xfer);

    // An interrupt before the first request ends the run here, its summary empty but written.
    let started = match crate::interrupt::requested() {
        Some(sig) => Err(sig),
        None => match Engines::start(s) {
            Ok(engines) => Ok(engines),
            Err(e) => Err(crate::interrupt::requested().ok_or(e)?),
        },
    };
    let engines = match started {
        Ok(engines) => engines,
        Err(sig) => {
            summary.calibration = median_calibration(&calibration);
            summary.notes.push(format!("interrupted by {} before any request ran", sig.name()));
            summary.finished_at = Some(crate::report::summary::now_rfc3339());
            return Ok(summary);
        }
    };
    let info = engines.decode.info().clone();
    summary.ucx = UcxInfo {
        library: info.ucx_library.clone(),
        version: info.ucx_version.clone(),
        err_mode: Some(s.workers.transport.err_mode.to_string()),
        ..UcxInfo::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| BenchError::Other(format!("async runtime: {e}")))?;
    let mut generator = Generator::new(s.lens.clone(), s.workers.seed);
    let mut handshakes = StageRecorder::new();
    let mut seen = UcxSeen::default();
    // Warm-up: connections, first-touch of pages, caches. Not recorded (but its handshake is,
    // and wrong bytes are: a read that returned wrong bytes is a failed run whenever it ran).
    let mut warm_verify_failures = 0;
    let warm_start = Instant::now();
    if s.warmup > 0 {
        let mut warm = Tally::default();
        let ctx = Ctx { engines: &engines, s, run_id, t_start: Instant::now(), repeat: 0 };
        rt.block_on(drive(ctx, &mut generator, 0, Some(s.warmup), None, |f| warm.add(&f)));
        let _ = handshakes.merge(&warm.handshake);
        seen = warm.ucx.clone();
        warm_verify_failures = warm.verify_failures;
    }
    let total_requests = s.requests.map(|r| r * u64::from(s.repeat));
    let bar = progress_bar(s.progress_bar, total_requests);
    let mut all = Tally::default();
    // (fault injected, failures it explains): see `report::verdict`.
    let mut fault_counts = (0u64, 0u64);
    let mut repeats = Vec::new();
    let mut wall = 0.0;
    let mut first_req = s.warmup;
    // The start of each repeat's measured part, and when the fault went in: the events the
    // charts over time mark.
    let mut repeat_starts: Vec<Instant> = Vec::new();
    let mut fault_at: Option<(u32, Duration)> = None;
    // The measured loop's wall time is the run's throughput, so it does no I/O and no display:
    // each finished request's row goes over a channel to this thread, which writes it to
    // requests.csv, ticks the bar and rewrites the partial summary every 2 s.
    let (rows_tx, rows_rx) = mpsc::channel::<RequestRow>();
    let partial = summary.clone();
    let bar_for_writer = bar.clone();
    let written = std::thread::scope(|scope| {
        let rows_writer =
            scope.spawn(move || write_as_it_goes(&rows_rx, writer, partial, &bar_for_writer, Instant::now()));
        for repeat in 0..s.repeat.max(1) {
            let mut tally = Tally::default();
            let until = s.duration.map(|d| Instant::now() + d);
            let t0 = Instant::now();
            let ctx = Ctx { engines: &engines, s, run_id, t_start: Instant::now(), repeat };
            repeat_starts.push(ctx.t_start);
            let rep_start = ctx.t_start;
            let mut completed = 0u64;
            let engines_ref = &engines;
            let fault_counts = &mut fault_counts;
            let fault_at = &mut fault_at;
            rt.block_on(drive(ctx, &mut generator, first_req, s.requests, until, |f| {
                completed += 1;
                if let Some(plan) = s.fault
                    && repeat == 0
                    && completed == plan.after
                {
                    crate::output::note!(
                        "kvx bench: injecting {:?} into {} rank {}",
                        plan.fault,
                        plan.role.as_str(),
                        plan.rank
                    );
                    let engine =
                        if plan.role == Role::Prefill { &engines_ref.prefill } else { &engines_ref.decode };
                    engine.inject(plan.rank, plan.fault);
                    *fault_at = Some((repeat, rep_start.elapsed()));
                    fault_counts.0 = 1;
                } else if fault_counts.0 > 0
                    && f.row.outcome != RequestOutcome::Ok
                    && f.row.failure_cause.as_deref().is_some_and(|c| FAULT_CAUSES.contains(&c))
                {
                    // Finished after the fault was injected, failed the way a lost peer fails.
                    fault_counts.1 += 1;
                }
                tally.add(&f);
                all.add(&f);
                // A send fails only once the writer has stopped on an error (returned below).
                let _ = rows_tx.send(f.row);
            }));
            let secs = t0.elapsed().as_secs_f64();
            wall += secs;
            first_req += completed;
            let mut rm = RepeatMetrics::from_parts(repeat, &tally.totals, tally.recorder.stats(), secs);
            rm.verify_failures = tally.verify_failures;
            repeats.push(rm);
            let _ = handshakes.merge(&tally.handshake);
            seen.or(&tally.ucx);
            if rows_writer.is_finished() || crate::interrupt::requested().is_some() {
                break;
            }
        }
        drop(rows_tx);
        rows_writer.join().unwrap_or_else(|_| Err(BenchError::Other("the results writer panicked".into())))
    });
    written?;
    bar.finish_and_clear();
    let Engines { prefill, decode } = engines;
    let d_fin: EngineFinal = decode.shutdown();
    let p_fin: EngineFinal = prefill.shutdown();
    let interrupted = crate::interrupt::requested();
    if interrupted.is_none() {
        calibration.extend(calibration_samples(s, xfer));
    }

    all.totals.apply(&mut summary, wall);
    let _ = all.recorder.merge(&handshakes);
    if s.workers.transport.mode == crate::topology::TransferMode::Push {
        push_stages(s, &p_fin.pushes, &mut all.recorder, &mut summary);
    }
    summary.set_stages(all.recorder.stats());
    if summary.transfer_bandwidth.is_none() {
        summary.transfer_bandwidth = all.bandwidth.summary();
    }
    summary.bytes_verified = all.bytes_verified;
    summary.bytes_padding_read = all.bytes_padding;
    summary.hybrid_parts = all.parts.clone();
    if matches!(
        s.workers.transport.kind,
        crate::vocab::kinds::TransportKind::Storage | crate::vocab::kinds::TransportKind::Multi
    ) {
        summary.counters.insert("requests_via_storage".into(), all.via_storage);
        summary.counters.insert("fallbacks_to_storage".into(), all.fallbacks);
    }
    summary.verify_failures = all.verify_failures + warm_verify_failures;
    if warm_verify_failures > 0 {
        summary.warnings.push(format!(
            "{warm_verify_failures} warm-up request(s) read wrong bytes (counted in verify failures; \
             the warm-up's other numbers are not recorded)"
        ));
    }
    all.batch.report(&mut summary);
    if s.fault.is_some() {
        summary.counters.insert(FAULT_INJECTED.into(), fault_counts.0);
        summary.counters.insert(FAILURES_AFTER_FAULT.into(), fault_counts.1);
    }
    summary.blocks_leaked = u64::from(p_fin.blocks_leaked + d_fin.blocks_leaked);
    summary.blocks_expired = p_fin.leases_expired;
    summary.events = run_events(s, warm_start, &repeat_starts, fault_at, &p_fin.lease_expired_at);
    if let Some(c) = &p_fin.push_ucx {
        seen.see_writes(c);
    }
    seen.report(&s.workers, &mut summary);
    summary.per_rank = all
        .per_rank_bytes
        .iter()
        .map(|(&rank, &(bytes, requests))| RankThroughput {
            role: "decode".into(),
            rank,
            throughput_gbps: if wall > 0.0 { bytes as f64 / wall / 1e9 } else { 0.0 },
            bytes,
            requests,
        })
        .collect();
    if s.repeat > 1 {
        summary.repeats = repeats;
    }
    // Each worker should hold its KV pool plus at most 50 MB of its own.
    let rss_note = |role: &str, fin: &EngineFinal, pool: u64| {
        let peak = fin.worker_rss_bytes.iter().copied().max().unwrap_or(0);
        let mib = |b: u64| b as f64 / 1048576.0;
        let verdict = if peak <= pool + (50 << 20) { "within" } else { "OVER" };
        format!(
            "{role} workers: peak RSS {:.0} MiB, KV pool {:.0} MiB ({verdict} pool + 50 MiB)",
            mib(peak),
            mib(pool)
        )
    };
    let p_pool = s.workers.pair.p_geometry(0).total_bytes();
    let d_pool = s.workers.pair.d_geometry(0).total_bytes();
    summary.notes.push(rss_note("prefill", &p_fin, p_pool));
    summary.notes.push(rss_note("decode", &d_fin, d_pool));
    if !p_fin.dead_ranks.is_empty() || !d_fin.dead_ranks.is_empty() {
        summary.notes.push(format!(
            "ranks that died: prefill {:?}, decode {:?}; {} blocks written off with them",
            p_fin.dead_ranks,
            d_fin.dead_ranks,
            p_fin.blocks_lost_with_dead_ranks + d_fin.blocks_lost_with_dead_ranks
        ));
    }
    if p_fin.unrecognized_notifs > 0 {
        summary.notes.push(format!("{} notifications for unrecognized requests", p_fin.unrecognized_notifs));
    }
    summary.calibration = median_calibration(&calibration);
    if let Some(p) = &s.prediction {
        summary.prediction =
            crate::report::prediction::bench_prediction(&summary, &p.model, p.path, &p.rates);
    }
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    summary.partial = interrupted.is_some();
    if let Some(sig) = interrupted {
        let planned = s.requests.map_or_else(String::new, |r| format!(" of {}", r * u64::from(s.repeat)));
        summary.notes.push(format!(
            "interrupted by {}: {} requests{planned} finished; the figures cover those only",
            sig.name(),
            summary.requests_ok + summary.requests_failed + summary.requests_recomputed
        ));
    }
    Ok(summary)
}

/// Push mode: the prefill ranks' side of each measured request, from what they reported
/// (`EngineFinal::pushes`). `push_write` is the slowest rank's WRITE time (posting, local
/// completion, flush), `push_hidden` the WRITE time the ranks spent while the request's
/// prefill still computed (their mean), and a note says which share of the WRITE time that is.
fn push_stages(
    s: &BenchSettings,
    pushes: &[crate::pipeline::engine::PushRecord],
    rec: &mut StageRecorder,
    summary: &mut Summary,
) {
    let mut per_req: BTreeMap<u64, (u64, u64, u32)> = BTreeMap::new();
    let mut writes: BTreeMap<u64, Vec<RankTransfer>> = BTreeMap::new();
    for p in pushes.iter().filter(|p| p.req >= s.warmup && p.error.is_none()) {
        let e = per_req.entry(p.req).or_default();
        e.0 = e.0.max(p.stats.transfer_ns);
        e.1 += p.stats.hidden_ns;
        e.2 += 1;
        writes.entry(p.req).or_default().push(RankTransfer {
            rank: p.rank,
            bytes: p.stats.bytes,
            transfer_ns: p.stats.transfer_ns,
            post_ns: p.stats.post_ns,
            span: p.stats.span,
        });
    }
    // The request's WRITE span over its prefill ranks, and its bandwidth by that span.
    let mut bandwidth = BandwidthTally::default();
    for w in writes.values() {
        if let Some(ns) = bandwidth.add(w) {
            rec.record_ns(Stage::TransferSpan.as_str(), ns);
        }
    }
    summary.transfer_bandwidth = bandwidth.summary();
    let (mut hidden, mut written) = (0u64, 0u64);
    for p in pushes.iter().filter(|p| p.req >= s.warmup && p.error.is_none()) {
        hidden += p.stats.hidden_ns.min(p.stats.transfer_ns);
        written += p.stats.transfer_ns;
    }
    for (write, hid, n) in per_req.values() {
        rec.record_ns("push_write", *write);
        if s.workers.prefill.overlap == crate::config::worker::Overlap::Layers {
            rec.record_ns("push_hidden", hid / u64::from((*n).max(1)));
        }
    }
    if written > 0 && !s.workers.prefill.per_layer().is_zero() {
        summary.notes.push(format!(
            "push: {:.0}% of the prefill ranks' WRITE time ran while prefill computed (hidden), {:.0}% after it \
             (--overlap {}, --prefill-time-per-layer {:?}, dispatch {})",
            100.0 * hidden as f64 / written as f64,
            100.0 * (written - hidden) as f64 / written as f64,
            s.workers.prefill.overlap.as_str(),
            s.workers.prefill.per_layer(),
            s.dispatch.as_str(),
        ));
    }
}

/// The run's progress bar on stderr (hidden off a terminal). It is ticked by the thread that
/// writes rows and redrawn by indicatif's own ticker thread, never by the measured loop.
fn progress_bar(visible: bool, total_requests: Option<u64>) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let b = match total_requests {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    b.set_draw_target(ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} requests {msg} [{elapsed}]")
    {
        b.set_style(style);
    }
    b.enable_steady_tick(Duration::from_millis(200));
    b
}

/// How often the partial summary is rewritten while a run goes.
const PARTIAL_EVERY: Duration = Duration::from_secs(2);

/// Writes each row as it arrives (requests.csv), ticks `bar`, and rewrites the partial summary
/// every [`PARTIAL_EVERY`] with the totals so far, until the sender hangs up. Stops at the
/// first error writing a row and returns it.
fn write_as_it_goes(
    rows: &mpsc::Receiver<RequestRow>,
    writer: &mut RunWriter,
    mut partial: Summary,
    bar: &ProgressBar,
    measuring_since: Instant,
) -> Result<(), BenchError> {
    let mut totals = RequestTotals::default();
    let mut last_partial = Instant::now();
    for row in rows {
        writer.write_request(&row)?;
        totals.add(&row);
        bar.inc(1);
        if last_partial.elapsed() > PARTIAL_EVERY {
            last_partial = Instant::now();
            totals.apply(&mut partial, measuring_since.elapsed().as_secs_f64());
            // A partial summary is a courtesy to whoever watches the run; the final one counts.
            let _ = writer.write_partial(&partial);
        }
    }
    Ok(())
}

/// `kvx xfer` at one descriptor size of a hybrid run's mix (`summary.json`'s
/// `calibration.xfer_mix`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MixSize {
    pub descriptor_bytes: u64,
    /// The bytes per request descriptors of this size carry.
    pub bytes_per_request: u64,
    pub gbps: f64,
}

/// The GB/s of moving the mix's bytes at each size's rate: its bytes over the time each
/// size's bytes take (a harmonic mean weighted by bytes). `None` if a size moved nothing.
pub fn mix_gbps(mix: &[MixSize]) -> Option<f64> {
    let bytes: u64 = mix.iter().map(|m| m.bytes_per_request).sum();
    if bytes == 0 || mix.iter().any(|m| m.gbps.is_nan() || m.gbps <= 0.0) {
        return None;
    }
    Some(bytes as f64 / mix.iter().map(|m| m.bytes_per_request as f64 / m.gbps).sum::<f64>())
}

/// Records the mix's sizes and its weighted figure (`xfer_mix`, `xfer_mix_gbps`).
fn insert_mix(c: &mut Calibration, mix: &[MixSize]) {
    c.extra.insert("xfer_mix".into(), serde_json::json!(mix));
    match mix_gbps(mix) {
        Some(g) => c.extra.insert("xfer_mix_gbps".into(), serde_json::json!(g)),
        None => c.extra.remove("xfer_mix_gbps"),
    };
}

/// Most descriptor sizes of a hybrid run's mix the calibration measures (each costs a `kvx
/// xfer` of 300 ms per sample): the sizes that carry the most bytes.
const CALIBRATION_MIX_SIZES: usize = 6;

/// The sizes of `mix` the calibration measures: the [`CALIBRATION_MIX_SIZES`] that carry the
/// most bytes (`mix` is sorted so).
fn calibration_mix(mix: &[DescriptorShare]) -> &[DescriptorShare] {
    &mix[..mix.len().min(CALIBRATION_MIX_SIZES)]
}

/// The descriptor size the calibration reads: one block of the prefill side's first region.
fn calibration_size(s: &BenchSettings) -> u64 {
    s.workers.pair.p_geometry(0).regions().first().map_or(65536, |r| r.block_len)
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
fn median_of(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (n > 0).then(|| (v[(n - 1) / 2] + v[n / 2]) / 2.0)
}

/// Each figure's median over the samples (the first sample's descriptive fields).
fn median_calibration(samples: &[Calibration]) -> Option<Calibration> {
    let median = |name: &str| median_of(samples.iter().filter_map(|c| c.figure(name)).collect());
    let mut c = samples.first()?.clone();
    c.memcpy_gbps = median("memcpy_gbps");
    c.ucx_loopback_gbps = median("ucx_loopback_gbps");
    if let Some(x) = median("xfer_same_size_gbps") {
        c.extra.insert("xfer_same_size_gbps".into(), serde_json::json!(x));
    }
    // The mix: each size's median, weighted again (every sample measured the same sizes).
    let mixes: Vec<Vec<MixSize>> = samples
        .iter()
        .filter_map(|c| serde_json::from_value(c.extra.get("xfer_mix")?.clone()).ok())
        .collect();
    if let Some(first) = mixes.first() {
        let mix: Vec<MixSize> = first
            .iter()
            .enumerate()
            .map(|(i, size)| {
                let gbps = median_of(mixes.iter().filter_map(|m| m.get(i)).map(|m| m.gbps).collect());
                MixSize { gbps: gbps.unwrap_or(size.gbps), ..*size }
            })
            .collect();
        insert_mix(&mut c, &mix);
    }
    c.extra.insert("samples".into(), serde_json::json!(samples.len()));
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(descriptor_bytes: u64, gbps: f64) -> MixSize {
        MixSize { descriptor_bytes, bytes_per_request: 1_000_000_000, gbps }
    }

    #[test]
    fn a_mix_takes_the_time_each_size_takes() {
        // Half the bytes at 1 GB/s, half at 3: 2 GB in 1 + 1/3 s is 1.5 GB/s, not the mean 2.
        assert_eq!(mix_gbps(&[size(4096, 1.0), size(1 << 20, 3.0)]), Some(1.5));
        assert_eq!(mix_gbps(&[size(4096, 1.0), size(1 << 20, 0.0)]), None, "a size that moved nothing");
        assert_eq!(mix_gbps(&[]), None);
    }

    #[test]
    fn the_median_calibration_weighs_each_sizes_median() {
        let sample = |a: f64, b: f64| {
            let mut c = Calibration::default();
            insert_mix(&mut c, &[size(4096, a), size(1 << 20, b)]);
            c
        };
        // Per size: medians 2 and 6 (an outlier in one sample moves neither).
        let c =
            median_calibration(&[sample(1.0, 6.0), sample(2.0, 100.0), sample(3.0, 5.0)]).expect("samples");
        let mix: Vec<MixSize> = serde_json::from_value(c.extra["xfer_mix"].clone()).expect("mix");
        assert_eq!(mix.iter().map(|m| m.gbps).collect::<Vec<_>>(), [2.0, 6.0]);
        assert_eq!(c.figure("xfer_mix_gbps"), Some(3.0), "2 GB in 0.5 + 1/6 s");
    }
}
