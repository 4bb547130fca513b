//! [`WorkerKv`]: the [`KvBackend`] of a serving engine whose KV lives in real worker
//! processes, one per TP rank: a pipeline [`Engine`] (prefill or decode role), the same one
//! `kvx bench` drives.
//!
//! Prefill role: a prefill job becomes `Engine::prefill` (allocate, fill with the byte
//! pattern, hold under a lease) and the engine's `kv_transfer_params` go back as they are.
//! Decode role: a load becomes `Engine::load` into `ceil(prompt tokens / block size)` local
//! blocks; the decode ranks handshake with the prefill engine's side channel on first
//! contact, read with one-sided UCX GETs, notify P and verify what landed.
//!
//! The byte pattern's seed is a hash of P's request id, which travels in
//! `kv_transfer_params.remote_request_id`, so a decode engine in another process verifies
//! exactly what the prefill engine wrote without any other channel.
//!
//! Owns the translation between the serving contract ([`PrefillJob`], [`LoadJob`],
//! [`LoadReport`], [`KvError`]) and the pipeline engine, and the KV figures behind
//! `/metrics`. Must not do HTTP, and must not reach into the workers: everything goes
//! through the engine's public calls.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::kv::{
    BackendMetrics, KvBackend, KvError, KvTransferParams, LoadJob, LoadReport, NixlHistograms, PrefillJob,
    blocks_for_tokens,
};
use super::metrics::{Histogram, KV_STAGE_BUCKETS_S};
use crate::config::engine::EngineConfig;
use crate::pipeline::engine::{Engine, EngineError, EngineFinal, EngineInfo, LoadDone};
use crate::pipeline::params::base_request_id;
use crate::pipeline::wire::{FailureCause, LoadResult};
use crate::report::recorder::StageRecorder;
use crate::topology::TransferMode;
use crate::vocab::kinds::Role;

/// Decode-side stages recorded per load (slowest rank), in report order.
pub const LOAD_STAGES: [&str; 8] =
    ["queue", "handshake", "plan", "post", "transfer", "notify", "e2e", "verify"];

/// The byte-pattern seed of a request, from P's request id: both engines compute it from
/// what `kv_transfer_params` carries.
pub fn pattern_seed(p_request_id: &str) -> u64 {
    use sha2::Digest as _;
    let d = sha2::Sha256::digest(format!("kvx-pattern:{p_request_id}").as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// Everything the decode side measured so far, for reports (`kvx bench --serve`).
#[derive(Debug, Clone, Default)]
pub struct KvStats {
    /// Stage samples in nanoseconds: [`LOAD_STAGES`] (decode) or `fill` (prefill).
    pub recorder: StageRecorder,
    pub loads_ok: u64,
    pub loads_failed: u64,
    pub failures_by_cause: BTreeMap<String, u64>,
    pub bytes_read: u64,
    pub bytes_verified: u64,
    pub verify_failures: u64,
    pub descriptors_raw: u64,
    pub descriptors_coalesced: u64,
    /// Bytes and requests per decode rank.
    pub per_rank: BTreeMap<u32, (u64, u64)>,
    /// UCX transports and protocols of the first connection (`cma`, `posix`, `tcp`, ...).
    pub ucx: crate::pipeline::bench::UcxSeen,
    /// What the first failed load said (a wrong range and the vLLM rule behind it, a refusal).
    pub first_failure: Option<String>,
}

/// One load as the decode ranks measured it (slowest rank per stage), kept while
/// [`WorkerKv::record_requests`] is on so a driver can join it with its own records.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvRequestRecord {
    /// The `X-Request-Id` the request came with.
    pub x_request_id: String,
    pub blocks: u64,
    pub bytes: u64,
    pub descriptors_raw: u64,
    pub descriptors_coalesced: u64,
    pub queue_ns: u64,
    pub handshake_ns: Option<u64>,
    pub plan_ns: u64,
    pub post_ns: u64,
    pub transfer_ns: u64,
    pub notify_ns: u64,
    pub e2e_ns: u64,
    pub verify_ns: u64,
    /// `--kv-buffer-device cpu`: the slowest rank's copy from its host buffer into its pool.
    pub sync_ns: u64,
    pub bytes_verified: u64,
    /// Decode ranks whose bytes differed from the pattern.
    pub verify_failures: u64,
    /// Bytes each decode rank read.
    pub rank_bytes: Vec<(u32, u64)>,
    /// Each decode rank's part of the transfer (its bytes, own time and clock span).
    pub transfers: Vec<crate::report::bandwidth::RankTransfer>,
    /// The failure cause (`handshake`, `transfer`, `verify`, ...), if the load failed.
    pub failure: Option<String>,
}

#[derive(Debug, Default)]
struct Counters {
    prefills: AtomicU64,
    prefill_failures: AtomicU64,
    blocks_read: AtomicU64,
    handshakes: AtomicU64,
    aborts: AtomicU64,
    failed_transfers: AtomicU64,
    failed_notifications: AtomicU64,
}

/// A request the engine is working on: P's request id.
#[derive(Debug, Clone)]
struct Pending {
    p_request_id: String,
}

/// A [`KvBackend`] over a pipeline [`Engine`] of worker processes.
pub struct WorkerKv {
    role: Role,
    info: EngineInfo,
    engine: Mutex<Option<Engine>>,
    block_tokens: u32,
    /// The longest a job waits for the engine (its own deadline plus time queued for blocks).
    wait: Duration,
    next_req: AtomicU64,
    pending: Mutex<HashMap<String, Pending>>,
    counters: Counters,
    stats: Mutex<KvStats>,
    /// `Some` while per-request records are kept (off in a long-running server).
    records: Mutex<Option<Vec<KvRequestRecord>>>,
    load_seconds: Histogram,
    stage_seconds: Vec<(&'static str, Histogram)>,
    /// Per decode rank and load, as vLLM's NIXL connector observes each transfer.
    nixl: NixlHistograms,
    /// Whether the ranks post coalesced descriptors (what `vllm:nixl_num_descriptors` counts).
    coalesce: bool,
    /// The transport's name for the `kv_transfer` label (`ucx`, `nixl`).
    transport: &'static str,
}

impl std::fmt::Debug for WorkerKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerKv").field("role", &self.role).field("info", &self.info).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the metrics down with it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl WorkerKv {
    /// Starts the engine's workers and waits until every rank is ready (and, for a prefill
    /// engine, its side channel is bound). Blocks the calling thread.
    pub fn start(cfg: EngineConfig) -> Result<WorkerKv, EngineError> {
        let role = cfg.worker.role;
        let block_tokens = cfg.block_tokens;
        let coalesce = cfg.worker.transport.coalesce;
        let transport = cfg.worker.transport.kind.as_str();
        // Deadline of a started request, plus as long again queued behind others for blocks.
        let wait = cfg.timeout * 2;
        let engine = Engine::start(cfg)?;
        let info = engine.info().clone();
        let stages: &[&'static str] = match role {
            Role::Prefill => &["fill"],
            Role::Decode => &LOAD_STAGES,
        };
        Ok(WorkerKv {
            role,
            info,
            engine: Mutex::new(Some(engine)),
            block_tokens,
            wait,
            next_req: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            stats: Mutex::new(KvStats::default()),
            records: Mutex::new(None),
            load_seconds: Histogram::new(KV_STAGE_BUCKETS_S),
            stage_seconds: stages.iter().map(|&s| (s, Histogram::new(KV_STAGE_BUCKETS_S))).collect(),
            nixl: NixlHistograms::default(),
            coalesce,
            transport,
        })
    }

    /// The engine's identity: id, side channel, TP, UCX library.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// A copy of what this backend measured so far.
    pub fn stats(&self) -> KvStats {
        lock(&self.stats).clone()
    }

    /// Starts keeping a [`KvRequestRecord`] per load (memory grows with every request).
    pub fn record_requests(&self) {
        lock(&self.records).get_or_insert_with(Vec::new);
    }

    /// The records kept so far (and clears them).
    pub fn take_records(&self) -> Vec<KvRequestRecord> {
        lock(&self.records).as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn keep(&self, rec: impl FnOnce() -> KvRequestRecord) {
        if let Some(v) = lock(&self.records).as_mut() {
            v.push(rec());
        }
    }

    /// Stops the workers (waiting for held blocks to be freed, at most one lease) and returns
    /// the engine's final accounting; `None` if already shut down.
    pub fn shutdown(&self) -> Option<EngineFinal> {
        let engine = lock(&self.engine).take()?;
        Some(engine.shutdown())
    }

    fn with_engine<T>(&self, f: impl FnOnce(&Engine) -> T) -> Option<T> {
        lock(&self.engine).as_ref().map(f)
    }

    fn stage(&self, name: &str, ns: u64) {
        if let Some((_, h)) = self.stage_seconds.iter().find(|(s, _)| *s == name) {
            h.observe(Duration::from_nanos(ns));
        }
        lock(&self.stats).recorder.record_ns(name, ns);
    }

    fn engine_error(&self, e: EngineError) -> KvError {
        match e {
            EngineError::TooLarge { needed, capacity, .. } => {
                KvError::PoolTooSmall { needed: u64::from(needed), capacity: u64::from(capacity) }
            }
            EngineError::RankGone { .. }
            | EngineError::Closed
            | EngineError::Startup { .. }
            | EngineError::Interrupted { .. } => KvError::Unavailable(e.to_string()),
            EngineError::Timeout { .. } | EngineError::Rejected { .. } => KvError::Backend(e.to_string()),
        }
    }

    /// Turns every decode rank's account of one load into a report or the first error.
    fn judge(&self, job: &LoadJob, done: LoadDone, elapsed: Duration) -> Result<LoadReport, KvError> {
        let ranks = &done.ranks;
        let max = |f: fn(&LoadResult) -> u64| ranks.iter().map(f).max().unwrap_or(0);
        let error = ranks.iter().find_map(|r| r.error.clone());
        let verify_failure = ranks.iter().find_map(|r| r.verify_failure.clone());
        let handshake = ranks.iter().filter_map(|r| r.handshake_ns).max();
        let handshakes = ranks.iter().filter(|r| r.handshake_ns.is_some()).count() as u64;
        self.counters.handshakes.fetch_add(handshakes, Ordering::Relaxed);
        let bytes: u64 = ranks.iter().map(|r| r.bytes).sum();
        let bytes_verified: u64 = ranks.iter().map(|r| r.bytes_verified).sum();
        let verify_failures = ranks.iter().filter(|r| r.verify_failure.is_some()).count() as u64;
        for r in ranks {
            match r.error.as_ref().map(|(c, _)| *c) {
                None => self.nixl.observe(
                    Duration::from_nanos(r.transfer_ns),
                    Duration::from_nanos(r.post_ns),
                    r.bytes,
                    if self.coalesce { r.descs_coalesced } else { r.descs_raw },
                ),
                Some(FailureCause::Notify) => {
                    self.counters.failed_notifications.fetch_add(1, Ordering::Relaxed);
                }
                Some(FailureCause::Transfer | FailureCause::Timeout | FailureCause::PeerGone) => {
                    self.counters.failed_transfers.fetch_add(1, Ordering::Relaxed);
                }
                Some(_) => {}
            }
        }
        {
            let mut st = lock(&self.stats);
            st.verify_failures += verify_failures;
            for r in ranks.iter() {
                st.ucx.see(r);
            }
            match (&error, &verify_failure) {
                (None, None) => {
                    st.loads_ok += 1;
                    st.bytes_read += bytes;
                    st.bytes_verified += bytes_verified;
                    st.descriptors_raw += ranks.iter().map(|r| r.descs_raw).sum::<u64>();
                    st.descriptors_coalesced += ranks.iter().map(|r| r.descs_coalesced).sum::<u64>();
                    for r in ranks {
                        let e = st.per_rank.entry(r.d_rank).or_default();
                        e.0 += r.bytes;
                        e.1 += 1;
                    }
                }
                (Some((cause, reason)), _) => {
                    st.loads_failed += 1;
                    *st.failures_by_cause.entry(cause.as_str().to_string()).or_default() += 1;
                    st.first_failure.get_or_insert_with(|| format!("{}: {reason}", cause.as_str()));
                }
                (None, Some(reason)) => {
                    st.loads_failed += 1;
                    *st.failures_by_cause.entry("verify".to_string()).or_default() += 1;
                    st.first_failure.get_or_insert_with(|| format!("verify: {reason}"));
                }
            }
        }
        if let Some(ns) = handshake {
            self.stage("handshake", ns);
        }
        self.keep(|| KvRequestRecord {
            x_request_id: job.x_request_id.clone(),
            blocks: u64::from(done.local_blocks),
            bytes,
            descriptors_raw: ranks.iter().map(|r| r.descs_raw).sum(),
            descriptors_coalesced: ranks.iter().map(|r| r.descs_coalesced).sum(),
            queue_ns: max(|r| r.queue_ns),
            handshake_ns: handshake,
            plan_ns: max(|r| r.plan_ns),
            post_ns: max(|r| r.post_ns),
            transfer_ns: max(|r| r.transfer_ns),
            notify_ns: max(|r| r.notify_ns),
            e2e_ns: max(|r| r.e2e_ns),
            verify_ns: max(|r| r.verify_ns),
            sync_ns: max(|r| r.sync_ns),
            bytes_verified,
            verify_failures,
            rank_bytes: ranks.iter().map(|r| (r.d_rank, r.bytes)).collect(),
            // Pull: the decode ranks' reads are the transfer; a push decode rank only waited.
            transfers: ranks
                .iter()
                .filter(|_| job.params.transfer_mode != TransferMode::Push)
                .map(|r| crate::report::bandwidth::RankTransfer {
                    rank: r.d_rank,
                    bytes: r.bytes,
                    transfer_ns: r.transfer_ns,
                    post_ns: r.post_ns,
                    span: r.transfer_span,
                })
                .collect(),
            failure: error
                .as_ref()
                .map(|(c, _)| c.as_str().to_string())
                .or_else(|| verify_failure.as_ref().map(|_| "verify".to_string())),
        });
        let params = &job.params;
        if let Some((cause, reason)) = error {
            return Err(match cause {
                FailureCause::Handshake | FailureCause::Incompatible => KvError::Handshake {
                    engine_id: params.remote_engine_id.clone(),
                    host: params.remote_host.clone(),
                    port: params.remote_port,
                    reason,
                },
                FailureCause::Verify => KvError::Verify { request_id: job.request_id.clone(), reason },
                _ => KvError::Transfer { request_id: job.request_id.clone(), reason },
            });
        }
        if let Some(reason) = verify_failure {
            return Err(KvError::Verify { request_id: job.request_id.clone(), reason });
        }
        for (name, f) in [
            ("queue", (|r: &LoadResult| r.queue_ns) as fn(&LoadResult) -> u64),
            ("plan", |r| r.plan_ns),
            ("post", |r| r.post_ns),
            ("transfer", |r| r.transfer_ns),
            ("notify", |r| r.notify_ns),
            ("e2e", |r| r.e2e_ns),
            ("verify", |r| r.verify_ns),
            (crate::pipeline::bench::SYNC_TO_DEVICE, |r| r.sync_ns),
        ] {
            // Stages some runs have: recorded where they happened.
            if !matches!(name, "verify" | crate::pipeline::bench::SYNC_TO_DEVICE) || max(f) > 0 {
                self.stage(name, max(f));
            }
        }
        self.counters.blocks_read.fetch_add(u64::from(done.local_blocks), Ordering::Relaxed);
        self.load_seconds.observe(elapsed);
        Ok(LoadReport {
            blocks_read: u64::from(done.local_blocks),
            bytes_read: bytes,
            elapsed,
            verified: bytes_verified > 0,
            bytes_verified,
            handshake: handshake.map(Duration::from_nanos),
            transfer: Duration::from_nanos(max(|r| r.transfer_ns)),
            notify: Duration::from_nanos(max(|r| r.notify_ns)),
            verify: Duration::from_nanos(max(|r| r.verify_ns)),
        })
    }
}

/// Removes a job from the pending table when its future ends or is dropped. A prefill
/// dropped before the engine answered (the client went away) is released: no decode engine
/// can learn its blocks, so they are freed at once rather than at lease expiry.
struct PendingGuard<'a> {
    kv: &'a WorkerKv,
    id: String,
    done: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        let p = lock(&self.kv.pending).remove(&self.id);
        if !self.done
            && self.kv.role == Role::Prefill
            && let Some(p) = p
        {
            self.kv.with_engine(|e| e.release(p.p_request_id));
        }
    }
}

impl KvBackend for WorkerKv {
    fn prefill(&self, job: PrefillJob) -> BoxFuture<'_, Result<KvTransferParams, KvError>> {
        Box::pin(async move {
            let tokens = u32::try_from(job.prompt_tokens).map_err(|_| KvError::PoolTooSmall {
                needed: blocks_for_tokens(job.prompt_tokens, self.block_tokens),
                capacity: u64::from(self.info.pool_blocks),
            })?;
            let req = self.next_req.fetch_add(1, Ordering::Relaxed);
            let p_request_id = job.request_id.clone();
            // From the id both legs share: a push decode leg sent before prefill answered
            // knows only its own (`base_request_id`).
            let seed = pattern_seed(base_request_id(&p_request_id));
            lock(&self.pending)
                .insert(job.request_id.clone(), Pending { p_request_id: p_request_id.clone() });
            let mut guard = PendingGuard { kv: self, id: job.request_id.clone(), done: false };
            // 0 notifications expected: P learns the decode side's fan-in from the first one.
            let rx = self
                .with_engine(|e| e.prefill(req, p_request_id, tokens, seed, 0))
                .ok_or_else(|| KvError::Unavailable("the engine has shut down".into()))?;
            let r = tokio::time::timeout(self.wait, rx).await;
            let out = match r {
                Ok(Ok(Ok(done))) => {
                    guard.done = true;
                    self.counters.prefills.fetch_add(1, Ordering::Relaxed);
                    self.stage("fill", done.fill_ns);
                    if done.save_ns > 0 {
                        self.stage(crate::pipeline::bench::SAVE_TO_HOST, done.save_ns);
                    }
                    Ok(done.params)
                }
                Ok(Ok(Err(e))) => Err(self.engine_error(e)),
                Ok(Err(_)) => Err(KvError::Unavailable("the engine has shut down".into())),
                Err(_) => Err(KvError::Backend(format!(
                    "prefill of request {} not done within {:?} (the pool may be full)",
                    job.request_id, self.wait
                ))),
            };
            if out.is_err() {
                self.counters.prefill_failures.fetch_add(1, Ordering::Relaxed);
            }
            out
        })
    }

    fn load(&self, job: LoadJob) -> BoxFuture<'_, Result<LoadReport, KvError>> {
        Box::pin(async move {
            let mut params = job.params.clone();
            // Push: prefill writes into the blocks decode registers, so decode needs neither
            // its block ids nor (sent before prefill answered) its request id.
            let push = params.transfer_mode == TransferMode::Push;
            if !push {
                match &self.info.hybrid {
                    Some(shape) => params.check_group_block_ids(shape.groups.len()).map(|_| ()),
                    None => params.block_ids().map(|_| ()),
                }
                .map_err(|reason| KvError::InvalidParams { field: "remote_block_ids", reason })?;
                if params.remote_request_id.is_empty() {
                    return Err(KvError::InvalidParams {
                        field: "remote_request_id",
                        reason: "is empty; the prefill engine's request id is needed to notify it".into(),
                    });
                }
            }
            if params.remote_num_tokens == 0 {
                params.remote_num_tokens = match u32::try_from(job.prompt_tokens) {
                    Ok(tokens) => u64::from(self.info.computed_tokens(tokens)),
                    Err(_) => job.prompt_tokens,
                };
            }
            let params = &params;
            let too_large =
                |needed| KvError::PoolTooSmall { needed, capacity: u64::from(self.info.pool_blocks) };
            // Blocks this engine allocates (a hybrid model: one per KV cache group and position
            // of the tokens prefill computed).
            let local_blocks = match u32::try_from(job.prompt_tokens) {
                Ok(tokens) => self.info.request_blocks(tokens, self.block_tokens, 0),
                Err(_) => return Err(too_large(blocks_for_tokens(job.prompt_tokens, self.block_tokens))),
            };
            let req = self.next_req.fetch_add(1, Ordering::Relaxed);
            let shared_id =
                if params.remote_request_id.is_empty() { &job.request_id } else { &params.remote_request_id };
            let seed = pattern_seed(base_request_id(shared_id));
            lock(&self.pending)
                .insert(job.request_id.clone(), Pending { p_request_id: params.remote_request_id.clone() });
            let mut guard = PendingGuard { kv: self, id: job.request_id.clone(), done: false };
            let t0 = Instant::now();
            let rx = self
                .with_engine(|e| e.load(req, job.request_id.clone(), params.clone(), local_blocks, seed))
                .ok_or_else(|| KvError::Unavailable("the engine has shut down".into()))?;
            let r = tokio::time::timeout(self.wait, rx).await;
            guard.done = true;
            let fail = |cause: &str, e: KvError| {
                {
                    let mut st = lock(&self.stats);
                    st.loads_failed += 1;
                    *st.failures_by_cause.entry(cause.to_string()).or_default() += 1;
                    st.first_failure.get_or_insert_with(|| format!("{cause}: {e}"));
                }
                self.keep(|| KvRequestRecord {
                    x_request_id: job.x_request_id.clone(),
                    failure: Some(cause.to_string()),
                    ..KvRequestRecord::default()
                });
                e
            };
            match r {
                Ok(Ok(Ok(done))) => self.judge(&job, done, t0.elapsed()),
                Ok(Ok(Err(e))) => {
                    let cause = match &e {
                        EngineError::TooLarge { .. } => "pool",
                        other => other.cause().as_str(),
                    };
                    if matches!(e, EngineError::Timeout { .. } | EngineError::RankGone { .. }) {
                        self.counters.failed_transfers.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(fail(cause, self.engine_error(e)))
                }
                Ok(Err(_)) => Err(fail(
                    FailureCause::PeerGone.as_str(),
                    KvError::Unavailable("the engine has shut down".into()),
                )),
                Err(_) => Err({
                    self.counters.failed_transfers.fetch_add(1, Ordering::Relaxed);
                    fail(
                        FailureCause::Timeout.as_str(),
                        KvError::Transfer {
                            request_id: job.request_id.clone(),
                            reason: format!("no answer from the decode ranks within {:?}", self.wait),
                        },
                    )
                }),
            }
        })
    }

    fn abort(&self, request_id: &str) {
        self.counters.aborts.fetch_add(1, Ordering::Relaxed);
        // Prefill: a fill in flight or blocks already handed off (the engine-internal id is
        // P's request id) are released now; the ranks ignore ids they do not hold. Decode: a
        // load already handed to the ranks runs to its end, and its notifications free P's
        // blocks; one that never started leaves them to P (the proxy aborts it there).
        if self.role == Role::Prefill {
            self.with_engine(|e| e.release(request_id.to_string()));
        }
    }

    fn health(&self) -> Result<(), String> {
        match self.with_engine(Engine::gone) {
            None => Err("the KV workers have shut down".into()),
            Some(Some(e)) => Err(e.to_string()),
            Some(None) => Ok(()),
        }
    }

    fn metrics(&self) -> BackendMetrics {
        let live = self.with_engine(Engine::live).unwrap_or_default();
        let st = lock(&self.stats);
        let c = &self.counters;
        let mut load_failures: Vec<(&'static str, u64)> = Vec::new();
        for cause in [
            FailureCause::Handshake,
            FailureCause::Incompatible,
            FailureCause::Transfer,
            FailureCause::Timeout,
            FailureCause::PeerGone,
            FailureCause::Verify,
            FailureCause::Notify,
            FailureCause::Internal,
        ] {
            if let Some(&n) = st.failures_by_cause.get(cause.as_str()) {
                load_failures.push((cause.as_str(), n));
            }
        }
        if let Some(&n) = st.failures_by_cause.get("pool") {
            load_failures.push(("pool", n));
        }
        BackendMetrics {
            backend: "workers",
            kv_transfer: self.transport,
            prefills: c.prefills.load(Ordering::Relaxed),
            prefill_failures: c.prefill_failures.load(Ordering::Relaxed),
            loads_ok: st.loads_ok,
            loads_failed: st.loads_failed,
            load_failures,
            blocks_read: c.blocks_read.load(Ordering::Relaxed),
            bytes_read: st.bytes_read,
            bytes_verified: st.bytes_verified,
            verify_failures: st.verify_failures,
            handshakes: c.handshakes.load(Ordering::Relaxed),
            blocks_held: if self.role == Role::Prefill { u64::from(live.blocks_in_use) } else { 0 },
            blocks_in_use: u64::from(live.blocks_in_use),
            backlog: u64::from(live.backlog),
            leases_expired: live.leases_expired,
            unrecognized_notifs: live.unrecognized_notifs,
            aborts: c.aborts.load(Ordering::Relaxed),
            load_seconds: self.load_seconds.snapshot(),
            stage_seconds: self.stage_seconds.iter().map(|(n, h)| (*n, h.snapshot())).collect(),
            pool_blocks: u64::from(self.info.pool_blocks),
            nixl: self.nixl.snapshot(
                c.failed_transfers.load(Ordering::Relaxed),
                c.failed_notifications.load(Ordering::Relaxed),
                if self.role == Role::Prefill { live.leases_expired } else { 0 },
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED: u64 = 0x9340_c144_0c25_b643;

    #[test]
    fn pattern_seed_is_stable_and_spreads() {
        assert_eq!(pattern_seed("cmpl-a-0-12345678"), pattern_seed("cmpl-a-0-12345678"));
        assert_ne!(pattern_seed("cmpl-a-0-12345678"), pattern_seed("cmpl-a-0-12345679"));
        // Pinned: P and D may be different kvx builds; the seed must not drift.
        assert_eq!(pattern_seed("cmpl-x-0-00000000"), PINNED);
    }
}
