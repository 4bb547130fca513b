//! One engine's shared state ([`EngineState`]): its settings, KV backend, admission
//! semaphore and counters, and the bookkeeping that lets `/abort_requests` name a request by
//! its X-Request-Id: prefill legs by that id ([`HandoffIds`]) and generation requests in
//! progress ([`LiveRequest`]). Its `/metrics` families are `exposition.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{Semaphore, watch};

use crate::config::serve::HttpEngineConfig;
use crate::serve::kv::KvBackend;
use crate::serve::metrics::{
    Counter, Gauge, Histogram, VLLM_ITL_BUCKETS_S, VLLM_REQUEST_LATENCY_BUCKETS_S, VLLM_TTFT_BUCKETS_S,
};

/// Engine counters behind `/metrics`.
#[derive(Debug)]
pub(super) struct EngineMetrics {
    pub(super) running: Gauge,
    pub(super) waiting: Gauge,
    pub(super) prompt_tokens: Counter,
    pub(super) generation_tokens: Counter,
    pub(super) success_length: Counter,
    pub(super) success_stop: Counter,
    pub(super) aborted: Counter,
    /// Admitted requests that ended with an error (`finished_reason="error"`).
    pub(super) failed: Counter,
    /// Every error answer, validation included (`kvx:request_errors_total`).
    pub(super) errors: Counter,
    pub(super) ttft: Histogram,
    pub(super) itl: Histogram,
    pub(super) tpot: Histogram,
    pub(super) e2e: Histogram,
    pub(super) kv_handoffs: Counter,
    pub(super) kv_loads: Counter,
    pub(super) kv_load_failures: Counter,
    pub(super) kv_load_seconds: Histogram,
    pub(super) fallback_missing: Counter,
    pub(super) fallback_incomplete: Counter,
    pub(super) fallback_wrong_direction: Counter,
}

impl EngineMetrics {
    fn new() -> Self {
        Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            success_length: Counter::default(),
            success_stop: Counter::default(),
            aborted: Counter::default(),
            failed: Counter::default(),
            errors: Counter::default(),
            ttft: Histogram::new(VLLM_TTFT_BUCKETS_S),
            itl: Histogram::new(VLLM_ITL_BUCKETS_S),
            tpot: Histogram::new(VLLM_ITL_BUCKETS_S),
            e2e: Histogram::new(VLLM_REQUEST_LATENCY_BUCKETS_S),
            kv_handoffs: Counter::default(),
            kv_loads: Counter::default(),
            kv_load_failures: Counter::default(),
            kv_load_seconds: Histogram::latency(),
            fallback_missing: Counter::default(),
            fallback_incomplete: Counter::default(),
            fallback_wrong_direction: Counter::default(),
        }
    }
}

/// Shared state of one engine.
pub struct EngineState {
    pub(super) cfg: HttpEngineConfig,
    pub(super) backend: Arc<dyn KvBackend>,
    /// Prefill role: the internal id of each recent prefill leg by the X-Request-Id it came
    /// with, so `/abort_requests` takes either (a proxy whose client left before the leg's
    /// answer knows only the header). Entries older than [`HANDOFF_IDS_KEPT`] are dropped.
    handoff_ids: std::sync::Mutex<HandoffIds>,
    /// Generation requests in progress by X-Request-Id, so `/abort_requests` ends them too: a
    /// proxy whose client left before this engine answered (a non-streaming answer comes only
    /// at the end of its generation) knows no other id.
    live: std::sync::Mutex<HashMap<String, Live>>,
    pub(super) seqs: Arc<Semaphore>,
    pub(super) metrics: EngineMetrics,
    pub(super) system_fingerprint: String,
    pub(super) started_unix_s: u64,
}

impl std::fmt::Debug for EngineState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineState").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

pub(super) fn unix_now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl EngineState {
    pub fn new(cfg: HttpEngineConfig, backend: Arc<dyn KvBackend>) -> Arc<Self> {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(
            format!("{}|{}|{}|{}", cfg.model_name, cfg.tp_size, cfg.block_size_tokens, cfg.max_model_len)
                .as_bytes(),
        );
        let system_fingerprint =
            format!("kvx-{}-tp{}-{}", env!("CARGO_PKG_VERSION"), cfg.tp_size, &hex::encode(digest)[..8]);
        Arc::new(Self {
            seqs: Arc::new(Semaphore::new(cfg.max_num_seqs.max(1))),
            cfg,
            backend,
            handoff_ids: std::sync::Mutex::new(HandoffIds::default()),
            live: std::sync::Mutex::new(HashMap::new()),
            metrics: EngineMetrics::new(),
            system_fingerprint,
            started_unix_s: unix_now_s(),
        })
    }

    pub fn config(&self) -> &HttpEngineConfig {
        &self.cfg
    }

    pub(super) fn handoff_ids(&self) -> std::sync::MutexGuard<'_, HandoffIds> {
        self.handoff_ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers a prefill leg's internal id under its X-Request-Id (and forgets those older
    /// than [`HANDOFF_IDS_KEPT`], oldest first: a few per call, never a scan of the map).
    pub(super) fn remember_handoff(&self, x_request_id: &str, internal_id: &str) {
        let now = Instant::now();
        let mut ids = self.handoff_ids();
        while let Some((at, _)) = ids.order.front()
            && now.duration_since(*at) >= HANDOFF_IDS_KEPT
        {
            if let Some((at, key)) = ids.order.pop_front()
                && ids.by_x.get(&key).is_some_and(|h| h.at == at)
            {
                ids.by_x.remove(&key);
            }
        }
        ids.order.push_back((now, x_request_id.to_string()));
        ids.by_x.insert(
            x_request_id.to_string(),
            HandoffId { internal_id: internal_id.to_string(), at: now, aborted: false },
        );
    }

    /// Whether an abort named this prefill leg (by either id) since it began.
    pub(super) fn handoff_aborted(&self, x_request_id: &str) -> bool {
        self.handoff_ids().by_x.get(x_request_id).is_some_and(|h| h.aborted)
    }

    pub(super) fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers a generation request under its X-Request-Id until the returned guard drops.
    pub(super) fn register_live(self: &Arc<Self>, x_request_id: &str) -> LiveRequest {
        let mut live = self.live();
        let l = live
            .entry(x_request_id.to_string())
            .or_insert_with(|| Live { count: 0, abort: Arc::new(watch::channel(false).0) });
        l.count += 1;
        LiveRequest {
            st: self.clone(),
            x_request_id: x_request_id.to_string(),
            abort: l.abort.clone(),
            aborted: l.abort.subscribe(),
        }
    }

    /// Aborts the generation requests in progress under `x_request_id` (each at its next
    /// point where stopping is safe); whether there were any. A request that comes later
    /// under the same id is not affected.
    pub(super) fn abort_live(&self, x_request_id: &str) -> bool {
        let Some(l) = self.live().remove(x_request_id) else { return false };
        l.abort.send_replace(true);
        true
    }
}

/// How long a prefill leg's X-Request-Id still aborts it: far longer than a proxy takes to
/// notice its client left, and it bounds the map.
const HANDOFF_IDS_KEPT: Duration = Duration::from_secs(60);

/// The generation requests in progress under one X-Request-Id (a client may send several
/// under one): how many, and the switch that aborts them all.
#[derive(Debug)]
pub(super) struct Live {
    count: usize,
    abort: Arc<watch::Sender<bool>>,
}

/// A generation request registered under its X-Request-Id while it runs (unregistered on
/// drop). Its handler waits on [`aborted`](Self::aborted) where stopping is safe: while it
/// waits for admission, after its KV phase (a KV load is never cut short: the prefill engine's
/// blocks are freed by its notifications, never pulled from under its reads) and between a
/// non-streaming answer's tokens.
pub(super) struct LiveRequest {
    st: Arc<EngineState>,
    x_request_id: String,
    abort: Arc<watch::Sender<bool>>,
    aborted: watch::Receiver<bool>,
}

impl LiveRequest {
    pub(super) fn is_aborted(&self) -> bool {
        *self.aborted.borrow()
    }

    /// Resolves once `/abort_requests` names this request.
    pub(super) async fn aborted(&mut self) {
        if self.aborted.wait_for(|a| *a).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for LiveRequest {
    fn drop(&mut self) {
        let mut live = self.st.live();
        // An abort took the entry out; a later request under the id may have put a new one.
        if let Some(l) = live.get_mut(&self.x_request_id)
            && Arc::ptr_eq(&l.abort, &self.abort)
        {
            l.count -= 1;
            if l.count == 0 {
                live.remove(&self.x_request_id);
            }
        }
    }
}

/// Recent prefill legs by X-Request-Id, and the order they came in (to forget old ones).
#[derive(Debug, Default)]
pub(super) struct HandoffIds {
    pub(super) by_x: HashMap<String, HandoffId>,
    pub(super) order: std::collections::VecDeque<(Instant, String)>,
}

/// A prefill leg's internal id, when it began, and whether an abort named it (a leg aborted
/// before its blocks were held does not hold them).
#[derive(Debug)]
pub(super) struct HandoffId {
    pub(super) internal_id: String,
    pub(super) at: Instant,
    pub(super) aborted: bool,
}
