//! The engine's KV side: the [`KvBackend`] trait the HTTP engine calls, and [`NullKv`], a
//! backend that moves no KV at all (for measuring pure HTTP and proxy overhead). The
//! worker-backed backend, with real UCX reads, is [`super::workers::WorkerKv`].
//!
//! Owns the contract between `serve::http_engine` and whatever holds KV blocks. Must not do HTTP
//! and must not know about OpenAI request shapes: the engine translates requests into
//! [`PrefillJob`] / [`LoadJob`] and back. `kv_transfer_params` is the pipeline's
//! [`KvTransferParams`] (one type for the bench driver, the engines and the wire).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;

use super::metrics::{
    Histogram, HistogramSnapshot, NIXL_BYTES_BUCKETS, NIXL_DESCRIPTORS_BUCKETS, NIXL_POST_TIME_BUCKETS_S,
    NIXL_XFER_TIME_BUCKETS_S,
};
use crate::config::serve::EngineIdentity;
pub use crate::pipeline::params::KvTransferParams;
use crate::topology::TransferMode;

/// What the prefill engine asks its backend for: compute and hold the KV of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillJob {
    /// Engine-internal id (`cmpl-<X-Request-Id>-0-<8 hex>`), returned as `remote_request_id`.
    pub request_id: String,
    /// The `X-Request-Id` the proxy sent to both legs.
    pub x_request_id: String,
    pub prompt_tokens: u64,
    pub block_size_tokens: u32,
}

/// What the decode engine asks its backend for: pull the blocks P described.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadJob {
    /// Decode engine's internal id for this request (the key for [`KvBackend::abort`]).
    pub request_id: String,
    pub x_request_id: String,
    pub prompt_tokens: u64,
    pub block_size_tokens: u32,
    pub params: KvTransferParams,
}

/// What one load did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub blocks_read: u64,
    pub bytes_read: u64,
    pub elapsed: Duration,
    /// Whether the bytes read were checked against the pattern P wrote.
    pub verified: bool,
    pub bytes_verified: u64,
    /// Set when this load opened the connection to P (side-channel handshake).
    pub handshake: Option<Duration>,
    /// Slowest decode rank's read time.
    pub transfer: Duration,
    /// Slowest decode rank's notification of the prefill engine.
    pub notify: Duration,
    /// Slowest decode rank's check of what it read (zero with verification off).
    pub verify: Duration,
}

/// Why a backend could not prefill or load.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    #[error("kv_transfer_params.{field}: {reason}")]
    InvalidParams { field: &'static str, reason: String },
    #[error("handshake with prefill engine {engine_id} at {host}:{port} failed: {reason}")]
    Handshake { engine_id: String, host: String, port: u16, reason: String },
    #[error("KV read for request {request_id} failed: {reason}")]
    Transfer { request_id: String, reason: String },
    #[error(
        "KV read for request {request_id} returned bytes that are not what the prefill engine wrote: {reason}"
    )]
    Verify { request_id: String, reason: String },
    #[error("no free KV blocks: need {needed}, {free} free (raise the block pool or lower the load)")]
    OutOfBlocks { needed: u64, free: u64 },
    #[error("the prompt needs {needed} KV blocks but the pool holds {capacity}; raise --pool-blocks")]
    PoolTooSmall { needed: u64, capacity: u64 },
    #[error("KV workers unavailable: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Backend(String),
}

impl KvError {
    /// HTTP status the engine answers with when this error ends a request.
    pub fn http_status(&self) -> u16 {
        match self {
            KvError::InvalidParams { .. } => 400,
            KvError::OutOfBlocks { .. } | KvError::PoolTooSmall { .. } | KvError::Unavailable(_) => 503,
            _ => 500,
        }
    }
}

/// Counters a backend exposes on the engine's `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendMetrics {
    /// Short backend name, shown as the `backend` label (`"null"`, `"workers"`, ...).
    pub backend: &'static str,
    /// What the backend really transfers (`"none"` for [`NullKv`], `"ucx"` for workers),
    /// shown as a label so a dashboard can never mistake a no-transfer run for a real one.
    pub kv_transfer: &'static str,
    pub prefills: u64,
    pub prefill_failures: u64,
    pub loads_ok: u64,
    pub loads_failed: u64,
    /// Failed loads by cause (`handshake`, `transfer`, `timeout`, `verify`, ...).
    pub load_failures: Vec<(&'static str, u64)>,
    pub blocks_read: u64,
    pub bytes_read: u64,
    pub bytes_verified: u64,
    pub verify_failures: u64,
    /// Side-channel handshakes the decode ranks did (one per new prefill engine and rank).
    pub handshakes: u64,
    /// Blocks P currently holds for D to read.
    pub blocks_held: u64,
    /// Blocks allocated from this engine's pool right now (both roles).
    pub blocks_in_use: u64,
    /// Requests waiting for free blocks.
    pub backlog: u64,
    /// Holds released because their lease ran out before D read them (per rank).
    pub leases_expired: u64,
    /// Notifications for requests no prefill rank held, or that were not vLLM's (per rank).
    pub unrecognized_notifs: u64,
    pub aborts: u64,
    pub load_seconds: HistogramSnapshot,
    /// Per-stage times of loads (decode) or fills (prefill), slowest rank per request.
    pub stage_seconds: Vec<(&'static str, HistogramSnapshot)>,
    /// Blocks in this engine's pool (0: the backend has no pool), for
    /// `vllm:kv_cache_usage_perc`.
    pub pool_blocks: u64,
    /// The NIXL connector's figures, as vLLM's `vllm:nixl_*` families report them.
    pub nixl: NixlSnapshot,
}

/// What vLLM's NIXL connector reports (`NixlKVConnectorStats`): one observation per transfer,
/// i.e. per decode rank and request, and failure counts.
#[derive(Debug, Clone, PartialEq)]
pub struct NixlSnapshot {
    /// From posting a transfer to its completion, seconds.
    pub xfer_time: HistogramSnapshot,
    /// Time to post a transfer's reads, seconds.
    pub post_time: HistogramSnapshot,
    pub bytes_transferred: HistogramSnapshot,
    pub num_descriptors: HistogramSnapshot,
    pub failed_transfers: u64,
    pub failed_notifications: u64,
    /// Prefill side: held requests whose lease ran out (per rank, as each vLLM worker counts).
    pub kv_expired_reqs: u64,
}

impl Default for NixlSnapshot {
    fn default() -> Self {
        Self {
            xfer_time: HistogramSnapshot::empty(NIXL_XFER_TIME_BUCKETS_S),
            post_time: HistogramSnapshot::empty(NIXL_POST_TIME_BUCKETS_S),
            bytes_transferred: HistogramSnapshot::empty(NIXL_BYTES_BUCKETS),
            num_descriptors: HistogramSnapshot::empty(NIXL_DESCRIPTORS_BUCKETS),
            failed_transfers: 0,
            failed_notifications: 0,
            kv_expired_reqs: 0,
        }
    }
}

/// The live histograms behind a [`NixlSnapshot`].
#[derive(Debug)]
pub struct NixlHistograms {
    pub xfer_time: Histogram,
    pub post_time: Histogram,
    pub bytes_transferred: Histogram,
    pub num_descriptors: Histogram,
}

impl Default for NixlHistograms {
    fn default() -> Self {
        Self {
            xfer_time: Histogram::new(NIXL_XFER_TIME_BUCKETS_S),
            post_time: Histogram::new(NIXL_POST_TIME_BUCKETS_S),
            bytes_transferred: Histogram::new(NIXL_BYTES_BUCKETS),
            num_descriptors: Histogram::new(NIXL_DESCRIPTORS_BUCKETS),
        }
    }
}

impl NixlHistograms {
    /// Records one completed transfer.
    pub fn observe(&self, xfer: Duration, post: Duration, bytes: u64, descriptors: u64) {
        self.xfer_time.observe(xfer);
        self.post_time.observe(post);
        self.bytes_transferred.observe_value(bytes as f64);
        self.num_descriptors.observe_value(descriptors as f64);
    }

    /// The histograms' snapshot with the given failure counts.
    pub fn snapshot(
        &self,
        failed_transfers: u64,
        failed_notifications: u64,
        kv_expired_reqs: u64,
    ) -> NixlSnapshot {
        NixlSnapshot {
            xfer_time: self.xfer_time.snapshot(),
            post_time: self.post_time.snapshot(),
            bytes_transferred: self.bytes_transferred.snapshot(),
            num_descriptors: self.num_descriptors.snapshot(),
            failed_transfers,
            failed_notifications,
            kv_expired_reqs,
        }
    }
}

/// The KV side of one engine. Both roles use the same object; the engine calls
/// [`prefill`](Self::prefill) in the prefill role and [`load`](Self::load) in the decode role.
pub trait KvBackend: Send + Sync + 'static {
    /// Prefill role: allocate, fill and hold blocks for the prompt, and describe them in
    /// vLLM 0.33's shape. The blocks stay held until D reads them or the lease expires.
    fn prefill(&self, job: PrefillJob) -> BoxFuture<'_, Result<KvTransferParams, KvError>>;

    /// Decode role: read the blocks `job.params` describes (handshaking with P if needed),
    /// verify them and notify P so it frees them.
    fn load(&self, job: LoadJob) -> BoxFuture<'_, Result<LoadReport, KvError>>;

    /// The request ended early (client disconnect), or no decode engine will read a prefill
    /// handoff (`POST /abort_requests`, sent by the proxy when the decode leg failed): stop an
    /// in-flight load, and free held blocks now rather than at lease expiry. `request_id` is
    /// the engine-internal id (`remote_request_id` for a prefill handoff). Unknown ids are
    /// ignored.
    fn abort(&self, request_id: &str);

    fn metrics(&self) -> BackendMetrics;

    /// `Err(why)` when the backend cannot serve any request (a worker process died): the
    /// engine's `/health` then answers 503, as vLLM's does when its engine core is dead.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A backend that transfers nothing. The prefill role still computes a real block-id list
/// (`ceil(tokens / block_size)` consecutive ids per request) so the wire shape is the one D
/// and proxies see from vLLM; the decode role "loads" instantly. Use it to measure the HTTP
/// path alone; every metric it emits carries `kv_transfer="none"`.
#[derive(Debug)]
pub struct NullKv {
    identity: EngineIdentity,
    next_block: AtomicU64,
    prefills: AtomicU64,
    loads: AtomicU64,
    aborts: AtomicU64,
}

impl NullKv {
    pub fn new(identity: EngineIdentity) -> Self {
        Self {
            identity,
            next_block: AtomicU64::new(0),
            prefills: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            aborts: AtomicU64::new(0),
        }
    }

    pub fn identity(&self) -> &EngineIdentity {
        &self.identity
    }
}

/// Number of blocks a prompt occupies (vLLM allocates the partial last block too).
pub fn blocks_for_tokens(tokens: u64, block_size_tokens: u32) -> u64 {
    tokens.div_ceil(u64::from(block_size_tokens.max(1)))
}

impl KvBackend for NullKv {
    fn prefill(&self, job: PrefillJob) -> BoxFuture<'_, Result<KvTransferParams, KvError>> {
        let n = blocks_for_tokens(job.prompt_tokens, job.block_size_tokens);
        let first = self.next_block.fetch_add(n, Ordering::Relaxed);
        self.prefills.fetch_add(1, Ordering::Relaxed);
        let id = &self.identity;
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: vec![(first..first + n).collect()],
            remote_engine_id: id.engine_id.clone(),
            remote_request_id: job.request_id,
            remote_host: id.side_channel_host.clone(),
            remote_port: id.side_channel_port,
            tp_size: id.tp_size,
            dcp_size: 1,
            pp_size: 1,
            remote_num_tokens: job.prompt_tokens,
            remote_blocks_expiry_time: None,
            remote_registration_generation: 0,
            transfer_mode: TransferMode::Pull,
        };
        Box::pin(std::future::ready(Ok(params)))
    }

    fn load(&self, _job: LoadJob) -> BoxFuture<'_, Result<LoadReport, KvError>> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        Box::pin(std::future::ready(Ok(LoadReport::default())))
    }

    fn abort(&self, _request_id: &str) {
        self.aborts.fetch_add(1, Ordering::Relaxed);
    }

    fn metrics(&self) -> BackendMetrics {
        BackendMetrics {
            backend: "null",
            kv_transfer: "none",
            prefills: self.prefills.load(Ordering::Relaxed),
            loads_ok: self.loads.load(Ordering::Relaxed),
            aborts: self.aborts.load(Ordering::Relaxed),
            ..BackendMetrics::default()
        }
    }
}

/// What a request's incoming `kv_transfer_params` ask the engine to do.
#[derive(Debug, Clone, PartialEq)]
pub enum KvIntent {
    /// No params (or `null`): a plain request.
    None,
    /// `do_remote_decode: true`: the proxy's prefill leg; hold the KV for a decode engine.
    RemoteDecode,
    /// `do_remote_prefill: true` with every field D needs: pull the KV from P.
    RemotePrefill(Box<KvTransferParams>),
    /// `do_remote_prefill: true` but unusable; vLLM warns and prefills locally.
    Incomplete { reason: String },
}

/// A `kv_transfer_params` field that is present but unusable: the request is refused (400)
/// rather than silently prefilled locally, as a missing field is.
#[derive(Debug, Clone, PartialEq)]
pub struct KvParamError {
    /// The field, `kv_transfer_params.<name>` (the error's `param`).
    pub param: String,
    pub message: String,
}

impl KvParamError {
    fn new(field: &str, message: impl Into<String>) -> Self {
        let param = if field.is_empty() {
            "kv_transfer_params".to_string()
        } else {
            format!("kv_transfer_params.{field}")
        };
        KvParamError { param, message: message.into() }
    }
}

impl KvIntent {
    /// Reads incoming params the way vLLM's decode scheduler does: the transfer happens only
    /// when `remote_block_ids` and `remote_engine_id/request_id/host/port` are all present.
    /// Accepts the older flat `remote_block_ids: [int]` and missing newer fields. A field that
    /// is present with the wrong type or an impossible value (`tp_size: 0`, a block id that
    /// is not an integer) is an error naming it, not a silent local prefill.
    pub fn from_json(v: Option<&serde_json::Value>) -> Result<KvIntent, KvParamError> {
        use serde_json::Value;
        let m = match v {
            None | Some(Value::Null) => return Ok(KvIntent::None),
            Some(Value::Object(m)) => m,
            Some(_) => return Err(KvParamError::new("", "`kv_transfer_params` must be an object")),
        };
        let flag = |k: &str| match m.get(k) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(KvParamError::new(k, format!("`{k}` must be true or false"))),
        };
        if flag("do_remote_decode")? {
            return Ok(KvIntent::RemoteDecode);
        }
        if !flag("do_remote_prefill")? {
            return Ok(KvIntent::None);
        }
        // A present field of the wrong type is an error; a missing (or null) one is None.
        let text = |k: &'static str| match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(KvParamError::new(k, format!("`{k}` must be a string"))),
        };
        let int = |k: &'static str, min: u64, max: u64| match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
                _ => Err(KvParamError::new(
                    k,
                    format!("`{k}` must be an integer from {min} to {max}, got {x}"),
                )),
            },
        };
        // Push (vLLM's NixlPushConnector): decode registers its blocks with prefill, which
        // writes into them; decode needs only prefill's identity, so the proxy may send it
        // before prefill answered, without block ids or prefill's request id.
        let transfer_mode = match text("transfer_mode")?.as_deref() {
            None | Some("pull") => TransferMode::Pull,
            Some("push") => TransferMode::Push,
            Some(other) => {
                return Err(KvParamError::new(
                    "transfer_mode",
                    format!("`transfer_mode` is pull or push, got {other:?}"),
                ));
            }
        };
        let push = transfer_mode == TransferMode::Push;
        let blocks = match m.get("remote_block_ids") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                let ids = |list: &[Value]| -> Result<Vec<u64>, KvParamError> {
                    list.iter()
                        .map(|b| {
                            b.as_u64().ok_or_else(|| {
                                KvParamError::new(
                                    "remote_block_ids",
                                    format!("block ids are non-negative integers, got {b}"),
                                )
                            })
                        })
                        .collect()
                };
                if a.iter().all(Value::is_array) {
                    Some(
                        a.iter()
                            .map(|g| ids(g.as_array().map(Vec::as_slice).unwrap_or_default()))
                            .collect::<Result<_, _>>()?,
                    )
                } else {
                    Some(vec![ids(a)?])
                }
            }
            Some(other) => {
                return Err(KvParamError::new(
                    "remote_block_ids",
                    format!(
                        "`remote_block_ids` must be a list of block ids (or one list per group), got {other}"
                    ),
                ));
            }
        };
        let engine_id = text("remote_engine_id")?;
        let request_id = text("remote_request_id")?;
        let host = text("remote_host")?;
        let port = int("remote_port", 1, u64::from(u16::MAX))?;
        let sizes = |k: &'static str| int(k, 1, 1 << 16).map(|n| n.map_or(1, |n| n as u32));
        let (tp_size, dcp_size, pp_size) = (sizes("tp_size")?, sizes("dcp_size")?, sizes("pp_size")?);
        let remote_num_tokens = int("remote_num_tokens", 0, u64::MAX)?.unwrap_or(0);
        let remote_registration_generation = int("remote_registration_generation", 0, u64::MAX)?.unwrap_or(0);
        let remote_blocks_expiry_time = match m.get("remote_blocks_expiry_time") {
            None | Some(Value::Null) => None,
            Some(x) => match x.as_f64() {
                Some(t) if t.is_finite() => Some(t),
                _ => {
                    return Err(KvParamError::new(
                        "remote_blocks_expiry_time",
                        "must be a number of seconds",
                    ));
                }
            },
        };
        let mut missing = Vec::new();
        for (k, absent) in [
            ("remote_engine_id", engine_id.is_none()),
            ("remote_request_id", request_id.is_none() && !push),
            ("remote_host", host.is_none()),
            ("remote_port", port.is_none()),
            ("remote_block_ids", blocks.is_none() && !push),
        ] {
            if absent {
                missing.push(k);
            }
        }
        if !missing.is_empty() {
            return Ok(KvIntent::Incomplete { reason: format!("missing: {}", missing.join(", ")) });
        }
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: blocks.unwrap_or_default(),
            remote_engine_id: engine_id.unwrap_or_default(),
            remote_request_id: request_id.unwrap_or_default(),
            remote_host: host.unwrap_or_default(),
            remote_port: port.map_or(0, |p| p as u16),
            tp_size,
            dcp_size,
            pp_size,
            remote_num_tokens,
            remote_blocks_expiry_time,
            remote_registration_generation,
            transfer_mode,
        };
        Ok(KvIntent::RemotePrefill(Box::new(params)))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn identity() -> EngineIdentity {
        EngineIdentity {
            engine_id: "P-engine".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 2,
        }
    }

    #[test]
    fn null_kv_prefill_matches_vllm_033_shape() {
        // The executed vLLM 0.33 example: 40 tokens, block size 16 -> 3 blocks.
        let kv = NullKv::new(identity());
        kv.next_block.store(7, Ordering::Relaxed);
        let job = PrefillJob {
            request_id: "cmpl-abc-0".into(),
            x_request_id: "abc".into(),
            prompt_tokens: 40,
            block_size_tokens: 16,
        };
        let p = futures::executor::block_on(kv.prefill(job)).expect("prefill");
        let got = serde_json::to_string(&p).expect("json");
        let want = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[7,8,9]],"remote_engine_id":"P-engine","remote_request_id":"cmpl-abc-0","remote_host":"localhost","remote_port":5600,"tp_size":2,"dcp_size":1,"pp_size":1,"remote_num_tokens":40,"remote_blocks_expiry_time":null,"remote_registration_generation":0,"transfer_mode":"pull"}"#;
        assert_eq!(got, want);
        assert_eq!(kv.metrics().kv_transfer, "none");
    }

    #[test]
    fn blocks_round_up() {
        assert_eq!(blocks_for_tokens(17, 16), 2);
        assert_eq!(blocks_for_tokens(16, 16), 1);
        assert_eq!(blocks_for_tokens(1, 16), 1);
    }

    #[test]
    fn intent_reads_proxy_and_prefill_params() {
        assert_eq!(KvIntent::from_json(None), Ok(KvIntent::None));
        assert_eq!(KvIntent::from_json(Some(&json!(null))), Ok(KvIntent::None));
        let p_leg = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null});
        assert_eq!(KvIntent::from_json(Some(&p_leg)), Ok(KvIntent::RemoteDecode));
        let flat = json!({"do_remote_prefill": true, "remote_block_ids": [0, 1], "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "h", "remote_port": 5600, "tp_size": 4});
        match KvIntent::from_json(Some(&flat)).expect("flat") {
            KvIntent::RemotePrefill(p) => {
                assert_eq!(p.remote_block_ids, vec![vec![0, 1]]);
                assert_eq!(p.tp_size, 4);
            }
            other => panic!("unexpected {other:?}"),
        }
        // Push: the identity alone (sent before prefill answered) is enough.
        let push = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h",
            "remote_port": 5600, "tp_size": 2, "transfer_mode": "push"});
        match KvIntent::from_json(Some(&push)).expect("push") {
            KvIntent::RemotePrefill(p) => {
                assert_eq!((p.remote_request_id.as_str(), p.tp_size), ("", 2));
                assert!(p.remote_block_ids.is_empty());
            }
            other => panic!("push identity: {other:?}"),
        }
        let partial = json!({"do_remote_prefill": true, "remote_block_ids": [[0]], "remote_engine_id": "e"});
        match KvIntent::from_json(Some(&partial)).expect("partial") {
            KvIntent::Incomplete { reason } => {
                assert!(reason.contains("remote_request_id") && reason.contains("remote_port"), "{reason}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn present_but_unusable_params_name_the_field() {
        let base = json!({"do_remote_prefill": true, "remote_block_ids": [[0]], "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "h", "remote_port": 5600, "tp_size": 1});
        for (field, value) in [
            ("remote_block_ids", json!("x")),
            ("remote_block_ids", json!([1, -2])),
            ("remote_block_ids", json!([[1], ["a"]])),
            ("tp_size", json!(0)),
            ("tp_size", json!(-1)),
            ("tp_size", json!("2")),
            ("remote_port", json!(70000)),
            ("remote_host", json!(5)),
            ("transfer_mode", json!("teleport")),
            ("do_remote_prefill", json!("yes")),
        ] {
            let mut v = base.clone();
            v[field] = value.clone();
            match KvIntent::from_json(Some(&v)) {
                Err(e) => {
                    assert_eq!(e.param, format!("kv_transfer_params.{field}"), "{field}={value}: {e:?}")
                }
                Ok(i) => panic!("{field}={value} accepted as {i:?}"),
            }
        }
        assert!(KvIntent::from_json(Some(&json!([1]))).is_err());
    }
}
