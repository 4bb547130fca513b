//! The data model of a run: the schema-versioned [`Summary`] that `kvx bench` fills and every
//! exporter, `kvx report` and `kvx gate` read, the per-request [`RequestRow`] written to
//! `requests.csv`, and [`RequestTotals`], which turns rows into the summary's headline figures.
//!
//! Owns the JSON shape of `summary.json` (bump [`SCHEMA_VERSION`] on any change that an older
//! reader would misread; adding an optional field is not such a change). Must not do file I/O
//! (that is `writer.rs`) nor measure anything: figures arrive here already measured.
//!
//! Units live in field names: `_us` microseconds, `_ns` nanoseconds, `_gbps` 1e9 bytes per
//! second, `_s` seconds, `bytes_` bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::transfer::cuda_batch::{BatchDescriptors, BatchLaunch, BatchPath};
use crate::transfer::ucx::ProtoReport;

/// Version of the `summary.json` schema this kvx writes and reads.
pub const SCHEMA_VERSION: u32 = 1;

/// The stages of a request's life that every run reports, in display order.
///
/// `stages` is a map keyed by name so a run may add more; these are the ones kvx knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Waiting for a free slot (closed loop) or for the scheduler (open loop).
    Queue,
    /// Side-channel metadata exchange, only on a request that opened a connection.
    Handshake,
    /// Building the descriptor plan.
    Plan,
    /// Posting the reads to UCX.
    Post,
    /// The slowest rank's own transfer: from posting to its last read completing.
    Transfer,
    /// The request's wall span: the first rank's transfer start to the last rank's end, on
    /// one host's clock (absent for ranks on several hosts).
    TransferSpan,
    /// Sending the done notification to every P rank read from.
    Notify,
    /// End to end, from the request's arrival to its notification.
    E2e,
}

impl Stage {
    /// Every known stage in display order.
    pub const ALL: [Stage; 8] = [
        Stage::Queue,
        Stage::Handshake,
        Stage::Plan,
        Stage::Post,
        Stage::Transfer,
        Stage::TransferSpan,
        Stage::Notify,
        Stage::E2e,
    ];

    /// The key used in `stages` and in CSV columns.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Queue => "queue",
            Stage::Handshake => "handshake",
            Stage::Plan => "plan",
            Stage::Post => "post",
            Stage::Transfer => "transfer",
            Stage::TransferSpan => "transfer_span",
            Stage::Notify => "notify",
            Stage::E2e => "e2e",
        }
    }

    /// The known stage with this key, if any.
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Stage names of a map in display order: known stages first in [`Stage::ALL`] order, then
/// any others alphabetically.
pub fn ordered_stage_names<V>(stages: &BTreeMap<String, V>) -> Vec<&str> {
    let mut names: Vec<&str> =
        Stage::ALL.iter().map(|s| s.as_str()).filter(|n| stages.contains_key(*n)).collect();
    names.extend(stages.keys().map(String::as_str).filter(|n| Stage::from_name(n).is_none()));
    names
}

/// Everything one run measured, as written to `results/<run>/summary.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub schema_version: u32,
    pub kvx_version: String,
    pub run_id: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    /// Wall time of the measured part of the run (warm-up excluded).
    #[serde(default)]
    pub duration_s: f64,
    /// True while the run is still going (or was killed before it finished).
    #[serde(default)]
    pub partial: bool,
    pub scenario: Scenario,
    pub environment: Environment,
    pub ucx: UcxInfo,
    pub requests_ok: u64,
    pub requests_failed: u64,
    pub requests_recomputed: u64,
    #[serde(default)]
    pub failures_by_cause: BTreeMap<String, u64>,
    pub bytes_read: u64,
    pub bytes_verified: u64,
    /// Bytes read that hold no layer's data (a hybrid model's group padding): not verifiable.
    #[serde(default, skip_serializing_if = "crate::report::summary::is_zero")]
    pub bytes_padding_read: u64,
    pub verify_failures: u64,
    pub blocks_leaked: u64,
    #[serde(default)]
    pub blocks_expired: u64,
    /// Aggregate read throughput over the measured wall time.
    pub throughput_gbps: f64,
    pub requests_per_s: f64,
    pub descriptors_per_request: DescriptorsPerRequest,
    pub bytes_per_request: f64,
    #[serde(default)]
    pub per_rank: Vec<RankThroughput>,
    /// Latency percentiles keyed by stage name (see [`Stage`]).
    pub stages: BTreeMap<String, StageStats>,
    /// One entry per `--repeat` of the scenario; empty for a single repeat.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<RepeatMetrics>,
    /// Reference figures measured in the same run, kept apart from kvx's own metrics so the gate
    /// can tell a slower machine from a slower kvx.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// One row per point of a matrix run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Vec<SweepPoint>>,
    /// Labels a reader must see next to the figures (e.g. "cache-hot").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// What makes the figures worse than they should be, with the fix (e.g. device memory
    /// read by UCX's software emulation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Named event counts of the run (e.g. `fallbacks_to_storage`), apart from the metrics.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub counters: BTreeMap<String, u64>,
    /// Per-request bandwidth by the wall-span rule, beside each rank's own (see
    /// [`super::bandwidth`]); absent where no transfer was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_bandwidth: Option<super::bandwidth::TransferBandwidth>,
    /// `--transport cuda-batch`: how the decode ranks' batched copies went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_batch: Option<CudaBatchInfo>,
    /// A hybrid model: bytes and descriptors per KV cache group and part, summed over the
    /// measured requests that ended ok (every decode rank).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hybrid_parts: Vec<PartBytes>,
    /// Serving runs: the client-side TTFT split into the stages of the P/D path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waterfall: Option<Waterfall>,
    /// Serving runs with `--slo`: requests within every objective (`goodput.share`,
    /// `goodput.requests_per_s` for the gate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<super::slo::Goodput>,
    /// When the warm-up ran, faults were injected and leases expired (see [`RunEvent`]), for
    /// the charts over time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<RunEvent>,
    /// `--rates`: the transfer times the fitted model predicted for this run's plan, beside
    /// the measured ones (`report::prediction`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prediction: Option<BenchPrediction>,
}

/// Predicted against measured transfer times of a run (`kvx bench --rates`): the model of
/// `layouts::predict` applied to each decode rank's descriptors and bytes per request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchPrediction {
    /// The path whose model predicted (`ucx`, `cuda-ipc`, `cuda-batch`).
    pub transport: String,
    /// The rates file's note (host, date) and name.
    pub rates: String,
    /// Decode ranks reading at once on the host.
    pub readers: u32,
    /// The term that bounds the slowest rank: `posting`, `bytes` or `fixed`.
    pub bound: String,
    pub transfer_span_p50_us: f64,
    pub transfer_span_p90_us: f64,
    pub measured_transfer_span_p50_us: f64,
    pub measured_transfer_span_p90_us: f64,
    /// Measured / predicted, p50.
    pub ratio: f64,
    pub ratio_p90: f64,
    /// Each decode rank's predicted transfer per request.
    pub ranks: Vec<RankPredicted>,
    /// Every rank's measured transfer per request, pooled.
    pub measured_rank_transfer_p50_us: f64,
    pub measured_rank_transfer_p90_us: f64,
    /// Why the prediction lies outside what the rates were fitted over; empty inside.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extrapolated: Vec<String>,
    /// What else shared the host while the measured transfers ran, which the model (a
    /// deployment's transfer alone) leaves out; empty when nothing did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_host: Vec<String>,
    /// Per request of several decode ranks: the last rank's start minus the first's, p50 (us).
    /// The model predicts ranks that start together; a measured span holds this wait too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_start_skew_p50_us: Option<f64>,
    /// What the measured span holds beside the transfers the model predicts (the ranks'
    /// start skew, where it is 5% of the span or more); empty when nothing notable.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub span_includes: Vec<String>,
    /// Several requests at once in a closed loop: the most a request's span can be by the model,
    /// `concurrency` x the busiest rank's predicted transfer (a request is sent once the one
    /// `concurrency` before it finished on every rank, so a rank starts it at most
    /// `concurrency - 1` transfers after another). `None` with one request at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_loop: Option<ClosedLoopBound>,
}

/// The span of a request among `concurrency` at once, as the model bounds it: at least the
/// busiest rank's transfer, at most `concurrency` of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosedLoopBound {
    pub concurrency: u32,
    pub span_min_us: f64,
    pub span_max_us: f64,
    /// The measured span p50 is at most `span_max_us`.
    pub measured_p50_at_most_max: bool,
}

/// One decode rank's predicted transfer of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankPredicted {
    pub rank: u32,
    pub descriptors: u64,
    pub bytes: u64,
    pub fixed_us: f64,
    pub post_us: f64,
    pub bytes_us: f64,
    pub transfer_us: f64,
    pub bound: String,
}

impl Summary {
    /// The command that wrote the run: `kvx load` (an HTTP endpoint driven, no ranks) or
    /// `kvx bench` (ranks, with or without its serving path).
    pub fn run_kind(&self) -> &'static str {
        if self.scenario.p_tp.is_none() && self.scenario.extra.endpoint.is_some() {
            "kvx load"
        } else {
            "kvx bench"
        }
    }

    /// Whether the run measured KV transfers (a `kvx load` run of an HTTP endpoint did not:
    /// its reports leave the KV figures out rather than print zeros).
    pub fn measured_kv(&self) -> bool {
        self.bytes_read > 0 || self.stages.contains_key(Stage::Transfer.as_str()) || self.sweep.is_some()
    }

    /// An empty summary of the current schema and kvx version; the caller fills the figures.
    pub fn new(run_id: impl Into<String>, started_at: impl Into<String>, scenario: Scenario) -> Self {
        Summary {
            schema_version: SCHEMA_VERSION,
            kvx_version: env!("CARGO_PKG_VERSION").to_string(),
            run_id: run_id.into(),
            started_at: started_at.into(),
            finished_at: None,
            duration_s: 0.0,
            partial: false,
            scenario,
            environment: Environment::default(),
            ucx: UcxInfo::default(),
            requests_ok: 0,
            requests_failed: 0,
            requests_recomputed: 0,
            failures_by_cause: BTreeMap::new(),
            bytes_read: 0,
            bytes_verified: 0,
            bytes_padding_read: 0,
            verify_failures: 0,
            blocks_leaked: 0,
            blocks_expired: 0,
            throughput_gbps: 0.0,
            requests_per_s: 0.0,
            descriptors_per_request: DescriptorsPerRequest::default(),
            bytes_per_request: 0.0,
            per_rank: Vec::new(),
            stages: BTreeMap::new(),
            repeats: Vec::new(),
            calibration: None,
            sweep: None,
            notes: Vec::new(),
            warnings: Vec::new(),
            counters: BTreeMap::new(),
            transfer_bandwidth: None,
            cuda_batch: None,
            hybrid_parts: Vec::new(),
            waterfall: None,
            goodput: None,
            events: Vec::new(),
            prediction: None,
        }
    }

    /// Replaces `stages` with these percentiles (a `StageRecorder`'s `stats()`).
    pub fn set_stages(&mut self, stages: BTreeMap<String, StageStats>) {
        self.stages = stages;
    }

    /// Requests that finished in any way.
    /// Adds another run's counts and bytes to this one (a sweep or comparison summing its
    /// points); rates are left for the caller to recompute over the summed duration.
    pub fn absorb(&mut self, other: &Summary) {
        self.requests_ok += other.requests_ok;
        self.requests_failed += other.requests_failed;
        self.requests_recomputed += other.requests_recomputed;
        self.bytes_read += other.bytes_read;
        self.bytes_verified += other.bytes_verified;
        self.bytes_padding_read += other.bytes_padding_read;
        self.verify_failures += other.verify_failures;
        self.blocks_leaked += other.blocks_leaked;
        self.blocks_expired += other.blocks_expired;
        self.duration_s += other.duration_s;
        for (k, v) in &other.failures_by_cause {
            *self.failures_by_cause.entry(k.clone()).or_default() += v;
        }
        // The fault counters decide the exit code of a sweep or comparison as of a single run.
        for k in [super::verdict::FAULT_INJECTED, super::verdict::FAILURES_AFTER_FAULT] {
            if let Some(v) = other.counters.get(k) {
                *self.counters.entry(k.to_string()).or_default() += v;
            }
        }
        if self.ucx.library.is_empty() && !other.ucx.version.is_empty() {
            self.ucx = other.ucx.clone();
        }
        // A comparison with a cuda-batch run keeps how its batches went.
        if self.cuda_batch.is_none() {
            self.cuda_batch = other.cuda_batch.clone();
        }
        self.throughput_gbps = ratio(self.bytes_read as f64, self.duration_s) / 1e9;
        self.requests_per_s = ratio(self.requests_ok as f64, self.duration_s);
        self.bytes_per_request = ratio(self.bytes_read as f64, self.requests_ok as f64);
    }

    pub fn requests_total(&self) -> u64 {
        self.requests_ok + self.requests_failed + self.requests_recomputed
    }

    /// True when the run saw anything that makes its figures unfit for a baseline.
    pub fn has_failures(&self) -> bool {
        self.requests_failed > 0 || self.verify_failures > 0 || self.blocks_leaked > 0
    }
}

// What was run: `scenario` owns its shape and how a bench run fills it.
pub use super::scenario::{Scenario, ScenarioExtra, display_value};

// The machine the run ran on: `host` reads it from the system, the summary only carries it.
pub use crate::host::Environment;

/// How a cuda-batch run moved its bytes: the driver path (the batch API or the per-copy
/// fallback) and what posting cost, per request (all its decode ranks together).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CudaBatchInfo {
    /// `batch-v2`, `batch-v1`, `per-descriptor` or `kernel`: every path a decode rank reported.
    pub paths: Vec<BatchPath>,
    /// The driver functions behind them (`cuMemcpyBatchAsync_v2`, ...).
    pub driver_calls: Vec<String>,
    /// `rank` (one batch per request per decode rank, over all its peers) or `peer` (one per
    /// peer): `--batch-launch`.
    pub launches: Vec<BatchLaunch>,
    /// Where the gather kernel's descriptors were made: `host` (packed from the plan's pairs)
    /// or `device` (expanded from the plan's region table and block ids:
    /// `--batch-descriptors device`). Absent from older summaries: empty (the struct's
    /// `serde(default)`).
    pub descriptors_made_on: Vec<BatchDescriptors>,
    /// Driver calls per request (with the batch API or the kernel: one per decode rank with
    /// `--batch-launch rank`, one per peer with `peer`).
    pub calls_per_request: f64,
    /// Copies per request after coalescing runs contiguous on both sides: the descriptors
    /// copied, against `descriptors_per_request` planned.
    pub copies_per_request: f64,
    /// The plan's descriptors per request (planned).
    pub descriptors_per_request: f64,
    /// Posting time per plan descriptor, ns (the rate `kvx plan --post-ns cuda-batch=` takes).
    pub post_ns_per_descriptor: f64,
    /// Posting time per driver call, us.
    pub post_us_per_call: f64,
    /// Of the plan's descriptors per request, those whose address (either side) or length is
    /// not a multiple of 16: the gather kernel copies a few bytes of each one by one.
    pub unaligned_descriptors_per_request: f64,
    /// Per decode rank and request, us: packing the plan's pairs into its batches (host),
    /// posting them (descriptors written and uploaded, the launch: host), and waiting for
    /// their copies (the device, behind whatever else it runs).
    pub pack_us_per_rank: f64,
    pub post_us_per_rank: f64,
    pub wait_us_per_rank: f64,
}

/// The UCX library a run loaded and what it selected.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UcxInfo {
    /// Path of the `libucp` loaded.
    pub library: String,
    pub version: String,
    /// Transports UCX actually selected for the reads (e.g. `cma`, `posix`, `tcp`).
    pub transports: Vec<String>,
    /// `none` or `peer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub err_mode: Option<String>,
    /// The protocols UCX chose for the reads, per memory-type pair (`zero-copy cma/memory`,
    /// `software emulation sysv/memory`), or why they are unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocols: Option<ProtoReport>,
    /// UCX settings kvx made on the user's behalf, as `NAME=value (why)`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub settings: Vec<String>,
}

/// Latency figures of one stage, from hdrhistogram.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    pub count: u64,
    pub mean_us: f64,
    #[serde(default)]
    pub min_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

/// Mean descriptors per request, before and after coalescing contiguous ranges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DescriptorsPerRequest {
    pub raw: f64,
    pub coalesced: f64,
}

/// Throughput of one rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankThroughput {
    /// `p` or `d`.
    pub role: String,
    pub rank: u32,
    pub throughput_gbps: f64,
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub requests: u64,
}

/// Headline figures of one repeat of the scenario, for the gate's robust statistics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RepeatMetrics {
    pub index: u32,
    pub throughput_gbps: f64,
    pub requests_per_s: f64,
    pub requests_ok: u64,
    pub requests_failed: u64,
    pub verify_failures: u64,
    pub duration_s: f64,
    pub stages: BTreeMap<String, StageStats>,
    /// Calibration measured next to this repeat, when the run measures it per repeat; the gate
    /// normalises each repeat by its own calibration, so calibration noise shows up as noise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
}

impl RepeatMetrics {
    /// The headline figures of one repeat from what it accumulated.
    /// `stages`: the repeat's percentiles (its `StageRecorder`'s `stats()`).
    pub fn from_parts(
        index: u32,
        totals: &RequestTotals,
        stages: BTreeMap<String, StageStats>,
        duration_s: f64,
    ) -> Self {
        RepeatMetrics {
            index,
            throughput_gbps: ratio(totals.bytes_ok as f64, duration_s) / 1e9,
            requests_per_s: ratio(totals.requests_ok as f64, duration_s),
            requests_ok: totals.requests_ok,
            requests_failed: totals.requests_failed,
            verify_failures: 0,
            duration_s,
            stages,
            calibration: None,
        }
    }
}

/// Reference figures measured in the same run on the same machine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Calibration {
    /// Single-thread memcpy bandwidth over a DRAM-sized working set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_gbps: Option<f64>,
    /// A fixed UCX loopback read (same size and transports on every run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ucx_loopback_gbps: Option<f64>,
    /// Other figures (and what was measured, e.g. sizes), kept as written.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Calibration {
    /// The figure of this name, whether named by the schema or in `extra`.
    pub fn figure(&self, name: &str) -> Option<f64> {
        match name {
            "memcpy_gbps" => self.memcpy_gbps,
            "ucx_loopback_gbps" => self.ucx_loopback_gbps,
            other => self.extra.get(other).and_then(serde_json::Value::as_f64),
        }
        .filter(|v| v.is_finite() && *v > 0.0)
    }
}

/// One point of a matrix run: its parameters and headline figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SweepPoint {
    /// Short name of the point, e.g. `p8d2 nhd 8192 fragmented`.
    pub label: String,
    /// Series the point belongs to in charts (e.g. the layout); points with the same series
    /// are joined by a line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub series: Option<String>,
    /// The point's parameters (`p_tp`, `layout`, `prompt_len`, `alloc`, ...).
    pub params: BTreeMap<String, serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Mean bytes per coalesced descriptor (the message size UCX sees).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_descriptor: Option<f64>,
    pub throughput_gbps: f64,
    pub requests_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e2e_p50_us: Option<f64>,
    /// Prefill start to the KV in every decode rank's blocks (`kv_ready`), p50.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_ready_p50_us: Option<f64>,
    /// The point's per-request bandwidth (wall span) and per-rank figures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_bandwidth: Option<super::bandwidth::TransferBandwidth>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub descriptors_per_request: Option<DescriptorsPerRequest>,
    pub requests_ok: u64,
    pub requests_failed: u64,
    /// `--rates`: the point's predicted and measured transfer span p50 (see [`BenchPrediction`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_span_p50_us: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_span_p50_us: Option<f64>,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestOutcome {
    #[default]
    Ok,
    Failed,
    /// The load failed and the policy was `recompute`.
    Recomputed,
}

impl std::fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestOutcome::Ok => "ok",
            RequestOutcome::Failed => "failed",
            RequestOutcome::Recomputed => "recomputed",
        })
    }
}

/// Decode ranks a request was read by, written to CSV as `0;1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankList(pub Vec<u32>);

impl Serialize for RankList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = self.0.iter().map(u32::to_string).collect();
        s.serialize_str(&text.join(";"))
    }
}

impl<'de> Deserialize<'de> for RankList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.split(';')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| t.parse::<u32>().map_err(|e| serde::de::Error::custom(format!("rank `{t}`: {e}"))))
            .collect::<Result<Vec<_>, _>>()
            .map(RankList)
    }
}

/// One decode rank's reads of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankRead {
    pub rank: u32,
    /// When the rank's reads began, after the first rank's began (us); `None` when the ranks
    /// are on different hosts' clocks.
    pub start_us: Option<f64>,
    /// The rank's own transfer: from posting to its last read completing (us).
    pub read_us: f64,
    pub bytes: u64,
}

impl RankRead {
    /// The rank's own bandwidth over its reads, 1e9 bytes per second.
    pub fn gbps(&self) -> f64 {
        ratio(self.bytes as f64, self.read_us) / 1e3
    }
}

/// Each decode rank's reads of a request, written to CSV as `RANK:START_US:READ_US:BYTES`
/// joined by `;` (`0:0:812.5:1048576;1:3.25:790:1048576`), `START_US` empty when unknown.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankReads(pub Vec<RankRead>);

impl Serialize for RankReads {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = self
            .0
            .iter()
            .map(|r| {
                let start = r.start_us.map(|v| v.to_string()).unwrap_or_default();
                format!("{}:{start}:{}:{}", r.rank, r.read_us, r.bytes)
            })
            .collect();
        s.serialize_str(&text.join(";"))
    }
}

impl<'de> Deserialize<'de> for RankReads {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        let bad =
            |t: &str| serde::de::Error::custom(format!("rank read `{t}`: want RANK:START_US:READ_US:BYTES"));
        text.split(';')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                let f: Vec<&str> = t.split(':').collect();
                let [rank, start, read, bytes] = f.as_slice() else { return Err(bad(t)) };
                let start_us = if start.is_empty() { None } else { Some(start.parse().map_err(|_| bad(t))?) };
                Ok(RankRead {
                    rank: rank.parse().map_err(|_| bad(t))?,
                    start_us,
                    read_us: read.parse().map_err(|_| bad(t))?,
                    bytes: bytes.parse().map_err(|_| bad(t))?,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(RankReads)
    }
}

/// Something that happened at a moment of a run, for the charts over time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    /// `warm_up` (the unmeasured requests before the repeat's start: `t_s` is negative, their
    /// start), `fault` (an injected `--fault`), `lease_expired` (a prefill rank's blocks freed
    /// by their lease, not by a notification).
    pub kind: String,
    /// The repeat whose timeline the event is on.
    pub repeat: u32,
    /// Seconds from the start of that repeat's measured part (`start_offset_us`'s origin).
    pub t_s: f64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// One request of a run, one line of `requests.csv`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRow {
    pub request_id: String,
    /// Repeat the request belongs to (0 for a single-repeat run).
    pub repeat: u32,
    /// Arrival, relative to the start of the measured part of the run.
    pub start_offset_us: f64,
    pub prompt_tokens: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub descriptors_raw: u64,
    pub descriptors_coalesced: u64,
    pub queue_us: Option<f64>,
    pub handshake_us: Option<f64>,
    pub plan_us: Option<f64>,
    pub post_us: Option<f64>,
    pub transfer_us: Option<f64>,
    /// The request's wall span over its ranks (see [`Stage::TransferSpan`]).
    #[serde(default)]
    pub transfer_span_us: Option<f64>,
    pub notify_us: Option<f64>,
    pub e2e_us: Option<f64>,
    pub outcome: RequestOutcome,
    pub failure_cause: Option<String>,
    pub d_ranks: RankList,
    /// Checking the bytes read: outside the timed path (the slowest rank's); absent in files
    /// written before it was recorded.
    #[serde(default)]
    pub verify_us: Option<f64>,
    /// Each decode rank's reads of this request (see [`RankReads`]); empty in files written
    /// before it was recorded, and in push mode (the prefill ranks write).
    #[serde(default)]
    pub rank_reads: RankReads,
}

impl RequestRow {
    /// Column names of `requests.csv`, in order (a test checks they match the fields).
    pub const HEADERS: [&'static str; 21] = [
        "request_id",
        "repeat",
        "start_offset_us",
        "prompt_tokens",
        "blocks",
        "bytes",
        "descriptors_raw",
        "descriptors_coalesced",
        "queue_us",
        "handshake_us",
        "plan_us",
        "post_us",
        "transfer_us",
        "transfer_span_us",
        "notify_us",
        "e2e_us",
        "outcome",
        "failure_cause",
        "d_ranks",
        "verify_us",
        "rank_reads",
    ];

    /// This request's duration of a known stage.
    pub fn stage_us(&self, stage: Stage) -> Option<f64> {
        match stage {
            Stage::Queue => self.queue_us,
            Stage::Handshake => self.handshake_us,
            Stage::Plan => self.plan_us,
            Stage::Post => self.post_us,
            Stage::Transfer => self.transfer_us,
            Stage::TransferSpan => self.transfer_span_us,
            Stage::Notify => self.notify_us,
            Stage::E2e => self.e2e_us,
        }
    }

    /// Sets this request's duration of a known stage.
    pub fn set_stage_us(&mut self, stage: Stage, us: Option<f64>) {
        let slot = match stage {
            Stage::Queue => &mut self.queue_us,
            Stage::Handshake => &mut self.handshake_us,
            Stage::Plan => &mut self.plan_us,
            Stage::Post => &mut self.post_us,
            Stage::Transfer => &mut self.transfer_us,
            Stage::TransferSpan => &mut self.transfer_span_us,
            Stage::Notify => &mut self.notify_us,
            Stage::E2e => &mut self.e2e_us,
        };
        *slot = us;
    }
}

/// Headline figures accumulated from request rows as they arrive.
///
/// Rows feed the counts, byte totals and per-request means; stage percentiles come from the
/// `StageRecorder` (workers record samples in nanoseconds, which rows only round to us).
#[derive(Debug, Clone, Default)]
pub struct RequestTotals {
    pub requests_ok: u64,
    pub requests_failed: u64,
    pub requests_recomputed: u64,
    pub failures_by_cause: BTreeMap<String, u64>,
    /// Bytes of successful requests.
    pub bytes_ok: u64,
    descriptors_raw: u64,
    descriptors_coalesced: u64,
}

impl RequestTotals {
    pub fn add(&mut self, row: &RequestRow) {
        match row.outcome {
            RequestOutcome::Ok => {
                self.requests_ok += 1;
                self.bytes_ok += row.bytes;
                self.descriptors_raw += row.descriptors_raw;
                self.descriptors_coalesced += row.descriptors_coalesced;
            }
            RequestOutcome::Failed | RequestOutcome::Recomputed => {
                if row.outcome == RequestOutcome::Failed {
                    self.requests_failed += 1;
                } else {
                    self.requests_recomputed += 1;
                }
                let cause = row.failure_cause.clone().unwrap_or_else(|| "unknown".to_string());
                *self.failures_by_cause.entry(cause).or_default() += 1;
            }
        }
    }

    /// Writes counts, bytes read, throughput (over `duration_s` of wall time) and per-request
    /// means into `summary`. Leaves verification, leak and calibration figures alone.
    pub fn apply(&self, summary: &mut Summary, duration_s: f64) {
        summary.requests_ok = self.requests_ok;
        summary.requests_failed = self.requests_failed;
        summary.requests_recomputed = self.requests_recomputed;
        summary.failures_by_cause = self.failures_by_cause.clone();
        summary.bytes_read = self.bytes_ok;
        summary.duration_s = duration_s;
        summary.throughput_gbps = ratio(self.bytes_ok as f64, duration_s) / 1e9;
        summary.requests_per_s = ratio(self.requests_ok as f64, duration_s);
        let n = self.requests_ok as f64;
        summary.bytes_per_request = ratio(self.bytes_ok as f64, n);
        summary.descriptors_per_request = DescriptorsPerRequest {
            raw: ratio(self.descriptors_raw as f64, n),
            coalesced: ratio(self.descriptors_coalesced as f64, n),
        };
    }
}

/// `a / b`, or 0 when `b` is not positive: JSON has no NaN, and a run with no requests or no
/// time has no rate rather than an undefined one.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 && a.is_finite() && b.is_finite() { a / b } else { 0.0 }
}

/// The line vLLM's NixlConnector logs (`KV Transfer metrics: ...`), from a summary's
/// per-rank figures ([`super::bandwidth::TransferBandwidth`]); `None` without them.
///
/// Follows vLLM's definitions: a transfer is one rank's reads of one request (each worker
/// records its own), MB are MiB (2^20 bytes), and throughput is the total MB over the sum of
/// transfer times (the per-transfer bandwidth, not wall-clock).
pub fn vllm_metrics_line(s: &Summary) -> Option<String> {
    let b = s.transfer_bandwidth.as_ref()?;
    let n = b.rank_transfer_us.count;
    if n == 0 {
        return None;
    }
    let post = &b.rank_post_us;
    let mib = f64::from(1u32 << 20);
    let total_s = b.rank_transfer_us.mean * n as f64 / 1e6;
    let per_request = ratio(n as f64, s.requests_ok as f64);
    Some(format!(
        "KV Transfer metrics: Num successful transfers={n}, Avg xfer time (ms)={:.3}, P90 xfer time (ms)={:.3}, \
         Avg post time (ms)={:.3}, P90 post time (ms)={:.3}, Avg MB per transfer={:.3}, Throughput (MB/s)={:.3}, \
         Avg number of descriptors={:.1}",
        b.rank_transfer_us.mean / 1e3,
        b.rank_transfer_us.p90 / 1e3,
        post.mean / 1e3,
        post.p90 / 1e3,
        b.rank_bytes as f64 / n as f64 / mib,
        ratio(b.rank_bytes as f64 / mib, total_s),
        ratio(s.descriptors_per_request.coalesced, per_request),
    ))
}

// The current time as RFC 3339, for `started_at`: `clock` reads it, the summary only carries it.
pub use crate::clock::now_rfc3339;

/// A fresh run id: UTC start time plus a short random suffix, sortable and unique, e.g.
/// `20250102T030405Z-1a2b3c`.
pub fn new_run_id(started_at_rfc3339: &str) -> String {
    let stamp: String = started_at_rfc3339.chars().filter(|c| !matches!(c, '-' | ':')).collect();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{stamp}-{}", &suffix[..6])
}

// ---- The TTFT waterfall a serving run carries (built by `report::waterfall`). ----

/// The stages, in order, with what each covers.
pub const STAGES: [(&str, &str); 10] = [
    ("proxy", "HTTP hops client <-> proxy <-> engines and the proxy's own work"),
    ("prefill_queue", "prefill engine: waiting for admission"),
    ("prefill_compute", "prefill engine: prefill and KV blocks filled and held"),
    ("decode_admission", "decode engine: waiting for admission"),
    ("handshake", "decode engine: side-channel handshake (first contact only)"),
    ("kv_transfer", "decode engine: KV reads (queue, plan, post, read)"),
    ("notification", "decode engine: notifying the prefill engine"),
    ("verify", "decode engine: checking the bytes read"),
    ("first_decode_step", "decode step of the first token and its way to the client"),
    ("other", "engine time outside the named stages"),
];

/// Number of stages.
pub const N: usize = STAGES.len();

/// One stacked bar of the chart: a request's (or the mean) stages.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WaterfallBar {
    /// `mean`, `p50 request`, `p90 request`, `p99 request`.
    pub label: String,
    pub ttft_us: f64,
    /// Per stage, in [`STAGES`] order.
    pub stages_us: Vec<f64>,
}

/// Percentiles of one stage over the requests (zeros included: a stage a request did not go
/// through took it no time).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WaterfallStage {
    pub name: String,
    #[serde(flatten)]
    pub stats: StageStats,
}

/// The waterfall of a run's measured streaming requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Waterfall {
    /// Requests with a breakdown.
    pub requests: u64,
    /// Client-side TTFT of those requests.
    pub ttft: StageStats,
    pub stages: Vec<WaterfallStage>,
    /// The mean request, then the requests at the TTFT percentiles: each bar adds up to its TTFT.
    pub bars: Vec<WaterfallBar>,
    /// Sum of the stages' p50s, and its distance from the TTFT p50 as a fraction of it (p50s
    /// of parts need not add up to the p50 of the whole; a small distance means the table's
    /// p50 column reads as a waterfall too).
    pub stage_p50_sum_us: f64,
    pub stage_p50_sum_error: f64,
    /// The p50 request's `other` stage as a fraction of its TTFT: what the named stages leave
    /// unexplained.
    pub unattributed_share_p50: f64,
}

/// Bytes and descriptors of one part of one KV cache group (a hybrid model): attention pages,
/// or one state part (`mamba_conv_x`, `mamba_ssm`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartBytes {
    pub group: u32,
    /// The group's kind as vLLM names its spec (`FullAttention`, `SlidingWindow`, `Mamba`).
    pub kind: String,
    pub part: String,
    pub bytes: u64,
    pub descriptors: u64,
    /// Bytes the part would also have moved had the group sent every block of the prompt
    /// instead of clipping (a window's tail, the last state slot), at the bytes per block it
    /// moved.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clipped_bytes: u64,
}

/// Adds `more` into `into`, part by part (same group and part: summed).
pub fn add_parts(into: &mut Vec<PartBytes>, more: &[PartBytes]) {
    for m in more {
        match into.iter_mut().find(|p| p.group == m.group && p.part == m.part) {
            Some(p) => {
                p.bytes += m.bytes;
                p.descriptors += m.descriptors;
                p.clipped_bytes += m.clipped_bytes;
            }
            None => into.push(m.clone()),
        }
    }
    into.sort_by(|a, b| (a.group, &a.part).cmp(&(b.group, &b.part)));
}

/// Whether a count is 0 (fields written only when something happened).
pub(crate) fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_names_round_trip_and_order() {
        for s in Stage::ALL {
            assert_eq!(Stage::from_name(s.as_str()), Some(s));
        }
        let mut m = BTreeMap::new();
        for k in ["e2e", "zeta", "post", "queue", "alpha"] {
            m.insert(k.to_string(), ());
        }
        assert_eq!(ordered_stage_names(&m), vec!["queue", "post", "e2e", "alpha", "zeta"]);
    }

    #[test]
    fn totals_count_outcomes_and_means() {
        let mut t = RequestTotals::default();
        let ok =
            RequestRow { bytes: 1000, descriptors_raw: 10, descriptors_coalesced: 4, ..Default::default() };
        t.add(&ok);
        t.add(&RequestRow { bytes: 3000, descriptors_raw: 30, descriptors_coalesced: 2, ..ok.clone() });
        t.add(&RequestRow {
            outcome: RequestOutcome::Failed,
            failure_cause: Some("timeout".into()),
            bytes: 99,
            ..Default::default()
        });
        t.add(&RequestRow { outcome: RequestOutcome::Recomputed, ..Default::default() });
        let mut s = Summary::new("r", "t", Scenario::default());
        t.apply(&mut s, 2.0);
        assert_eq!((s.requests_ok, s.requests_failed, s.requests_recomputed), (2, 1, 1));
        assert_eq!(s.bytes_read, 4000);
        assert_eq!(s.bytes_per_request, 2000.0);
        assert_eq!(s.descriptors_per_request, DescriptorsPerRequest { raw: 20.0, coalesced: 3.0 });
        assert_eq!(s.throughput_gbps, 2000.0 / 1e9);
        assert_eq!(s.requests_per_s, 1.0);
        assert_eq!(s.failures_by_cause.get("timeout"), Some(&1));
        assert_eq!(s.failures_by_cause.get("unknown"), Some(&1));
        assert_eq!(s.requests_total(), 4);
    }

    #[test]
    fn repeat_metrics_from_parts() {
        let mut t = RequestTotals::default();
        t.add(&RequestRow { bytes: 2_000_000_000, ..Default::default() });
        let stages = BTreeMap::from([("e2e".to_string(), StageStats { count: 1, ..Default::default() })]);
        let r = RepeatMetrics::from_parts(3, &t, stages, 0.5);
        assert_eq!((r.index, r.requests_ok, r.throughput_gbps, r.requests_per_s), (3, 1, 4.0, 2.0));
        assert_eq!(r.stages["e2e"].count, 1);
    }

    #[test]
    fn zero_duration_gives_zero_rates_not_nan() {
        let mut s = Summary::new("r", "t", Scenario::default());
        RequestTotals::default().apply(&mut s, 0.0);
        assert_eq!(s.throughput_gbps, 0.0);
        assert!(serde_json::to_string(&s).is_ok_and(|j| !j.contains("null")));
    }

    #[test]
    fn vllm_line_counts_each_rank_s_transfer_in_mib_and_its_own_time() {
        let mut s = Summary::new("r", "t", Scenario::default());
        assert_eq!(vllm_metrics_line(&s), None, "no per-rank figures, no line");
        s.requests_ok = 7;
        s.descriptors_per_request.coalesced = 24.5;
        // 7 requests of 2 ranks, each rank 4 MiB in 2 ms (p90 3 ms).
        let spread =
            |mean, p90| super::super::bandwidth::Spread { count: 14, mean, p90, ..Default::default() };
        s.transfer_bandwidth = Some(super::super::bandwidth::TransferBandwidth {
            rank_transfer_us: spread(2000.0, 3000.0),
            rank_post_us: spread(50.0, 80.0),
            rank_bytes: 14 * (4 << 20),
            ..Default::default()
        });
        assert_eq!(
            vllm_metrics_line(&s).as_deref(),
            Some(
                "KV Transfer metrics: Num successful transfers=14, Avg xfer time (ms)=2.000, P90 xfer time (ms)=3.000, \
                 Avg post time (ms)=0.050, P90 post time (ms)=0.080, Avg MB per transfer=4.000, \
                 Throughput (MB/s)=2000.000, Avg number of descriptors=12.2"
            )
        );
    }

    #[test]
    fn calibration_figures_ignore_nonsense() {
        let c: Calibration =
            serde_json::from_str(r#"{"memcpy_gbps": 10.0, "ucx_loopback_gbps": 0.0, "other_gbps": 3}"#)
                .expect("parse");
        assert_eq!(c.figure("memcpy_gbps"), Some(10.0));
        assert_eq!(c.figure("ucx_loopback_gbps"), None);
        assert_eq!(c.figure("other_gbps"), Some(3.0));
        assert_eq!(c.figure("absent"), None);
    }

    #[test]
    fn run_ids_sort_by_time() {
        let a = new_run_id("2025-01-02T03:04:05Z");
        assert!(a.starts_with("20250102T030405Z-"), "{a}");
        assert_eq!(a.len(), "20250102T030405Z-".len() + 6);
        assert!(now_rfc3339().ends_with('Z'));
    }
}
