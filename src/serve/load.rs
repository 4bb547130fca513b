//! `kvx load`: a load generator for any OpenAI-compatible endpoint. Open loop (Poisson
//! arrivals at `--rate`) or closed loop (`--concurrency` workers), completions or chat,
//! streaming or not. Records TTFT, ITL, TPOT and end-to-end latency per request into
//! hdrhistograms and summarises them per target.
//!
//! Several targets run in the same invocation and the same time window (each with its own
//! arrival process), so a proxy path and a direct path are measured under identical machine
//! conditions; the summary then reports their difference. A target may also be a
//! *client-side P/D pair*: the generator itself does the prefill leg (rewritten exactly as
//! the proxy does) and then the decode leg, i.e. the proxy's work at zero proxy cost.
//!
//! Owns request generation, timing and aggregation: samples go into `report`'s
//! [`StageRecorder`] (hdrhistogram, nanoseconds) under the names vLLM's benchmark_serving
//! uses (`ttft`, `itl`, `tpot`, `e2el`). Each streamed request's TTFT is also split into the
//! stages of the P/D path from the `Server-Timing` entries its response carried
//! (`report::waterfall`), and with `--slo` every request is judged against the objectives
//! (`report::slo`). Presentation is `load_report` (the report machinery: summary, tables,
//! CSV, SVG); [`LoadSummary`] is the per-target document (`load.json`). [`LoadProgress`] is
//! what a progress display reads: counters the requests bump, never a timer or a draw in
//! their path. Must not start servers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Uri, header};
use http_body_util::{BodyExt as _, Full};
use rand::{RngExt as _, SeedableRng};
use serde::Serialize;

use super::client::{HttpClient, http_client};
use super::rewrite::{self, RawObject};
use super::timing;
use crate::config::arrival::Arrival;
use crate::config::load::Slo;
use crate::config::load::{LoadConfig, Target, endpoint_uri};
use crate::report::recorder::{StageRecorder, new_auto_histogram, record_into};
use crate::report::slo::{Goodput, RequestTimes};
use crate::report::summary::StageStats;
use crate::report::waterfall::{Breakdown, Waterfall, WaterfallBuilder};
use crate::vocab::kinds::Endpoint;

/// Stage names of the client-side latencies (vLLM benchmark_serving's names).
pub const TTFT: &str = "ttft";
pub const ITL: &str = "itl";
pub const TPOT: &str = "tpot";
/// End-to-end latency of one request as the client sees it.
pub const E2EL: &str = "e2el";
/// Open loop: how late a request left relative to its Poisson schedule.
pub const SEND_LAG: &str = "send_lag";

/// Live counts of a run for a progress display, updated as samples arrive (outside any
/// request's timed region).
#[derive(Debug, Default)]
pub struct LoadProgress {
    pub done: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    ttft: std::sync::Mutex<Option<hdrhistogram::Histogram<u64>>>,
}

impl LoadProgress {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn add(&self, s: &Sample) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if s.error.is_some() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.ok.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(t), Ok(mut h)) = (s.ttft, self.ttft.lock()) {
            record_into(h.get_or_insert_with(new_auto_histogram), ns(t));
        }
    }

    /// Median TTFT of the requests so far, in milliseconds.
    pub fn ttft_p50_ms(&self) -> Option<f64> {
        let h = self.ttft.lock().ok()?;
        h.as_ref().filter(|h| !h.is_empty()).map(|h| h.value_at_quantile(0.5) as f64 / 1e6)
    }
}

/// A progress bar of a load run on stderr: requests done, ok and failed, live TTFT p50. It
/// is drawn by its own thread from [`LoadProgress`] every 100 ms, so a request's timed path
/// never draws (the requests only bump counters), and it shows nothing when stderr is not
/// a terminal. Dropping it clears the bar.
pub struct ProgressDisplay {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ProgressDisplay {
    /// Starts the display for `total` requests (all targets, warm-up included; `None`: a
    /// timed run), or a no-op when stderr is not a terminal.
    pub fn start(progress: Arc<LoadProgress>, total: Option<u64>) -> Self {
        use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Self { stop: None, thread: None };
        }
        let bar = match total {
            Some(n) => ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr()),
            None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
        };
        let template = match total {
            Some(_) => "{spinner} {bar:30} {pos}/{len} requests {msg} [{elapsed}]",
            None => "{spinner} {pos} requests {msg} [{elapsed}]",
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvx-load-progress".into())
            .spawn(move || {
                let draw = |bar: &ProgressBar| {
                    bar.set_position(progress.done.load(Ordering::Relaxed));
                    let ttft =
                        progress.ttft_p50_ms().map_or_else(|| "-".to_string(), |v| format!("{v:.2} ms"));
                    bar.set_message(format!(
                        "ok {} failed {} | ttft p50 {ttft}",
                        progress.ok.load(Ordering::Relaxed),
                        progress.failed.load(Ordering::Relaxed)
                    ));
                };
                // Draw now, then every 100 ms until the run ends (the sender is dropped).
                draw(&bar);
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(Duration::from_millis(100))
                {
                    draw(&bar);
                }
                bar.finish_and_clear();
            })
            .ok();
        Self { stop: Some(tx), thread }
    }
}

impl Drop for ProgressDisplay {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What one request gave.
#[derive(Debug, Default)]
struct Sample {
    target: usize,
    index: u64,
    prompt_tokens: u64,
    measured: bool,
    error: Option<String>,
    start: Option<Instant>,
    end: Option<Instant>,
    e2e: Duration,
    ttft: Option<Duration>,
    itl: Vec<Duration>,
    tokens: u64,
    lag: Duration,
    /// From sending to the (decode leg's) response headers.
    to_headers: Option<Duration>,
    /// `Server-Timing` entries of the response (and of the prefill leg's, for a client-side
    /// P/D pair).
    server_timing: Vec<(String, f64)>,
}

impl Sample {
    /// The request's TTFT split into stages, when a kvx engine timed it (streaming only).
    fn breakdown(&self) -> Option<Breakdown> {
        if self.error.is_some() {
            return None;
        }
        timing::breakdown(self.ttft?, self.to_headers?, &self.server_timing)
    }

    fn times(&self) -> RequestTimes {
        let tpot = match (self.ttft, self.tokens) {
            (Some(t), n) if n > 1 && !self.itl.is_empty() => {
                Some(self.e2e.saturating_sub(t) / u32::try_from(n - 1).unwrap_or(u32::MAX))
            }
            _ => None,
        };
        RequestTimes {
            ok: self.error.is_none(),
            ttft: self.ttft,
            tpot,
            max_itl: self.itl.iter().copied().max(),
            e2el: self.e2e,
        }
    }

    /// The engine's token pacing as it reported it (`itl` in its Server-Timing), ms.
    fn pacing_ms(&self) -> Option<f64> {
        self.server_timing.iter().find(|(n, _)| n == timing::ITL).map(|(_, ms)| *ms)
    }
}

/// Percentiles of one latency, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LatencyMs {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl LatencyMs {
    /// From a stage's hdrhistogram figures (microseconds) to milliseconds.
    pub fn from_stats(st: Option<&StageStats>) -> Self {
        let Some(st) = st.filter(|s| s.count > 0) else { return Self::default() };
        Self {
            count: st.count,
            mean: st.mean_us / 1e3,
            p50: st.p50_us / 1e3,
            p90: st.p90_us / 1e3,
            p99: st.p99_us / 1e3,
            p999: st.p999_us / 1e3,
            max: st.max_us / 1e3,
        }
    }
}

/// Results of one target.
#[derive(Debug, Clone, Serialize)]
pub struct TargetSummary {
    pub name: String,
    pub url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_url: Option<String>,
    pub requests: u64,
    pub ok: u64,
    pub errors: BTreeMap<String, u64>,
    /// From the first measured request's start to the last one's end.
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub output_tokens: u64,
    pub ttft_ms: LatencyMs,
    pub itl_ms: LatencyMs,
    pub tpot_ms: LatencyMs,
    pub e2e_ms: LatencyMs,
    /// Open loop: how late requests left relative to their Poisson schedule. A large p99
    /// means the generator (not the target) could not keep up.
    pub send_lag_ms: LatencyMs,
    /// Token pacing the engines reported (`itl` in `Server-Timing`), ms; 0: pacing off, so
    /// ITL and TPOT say nothing. `None` when the target does not report it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_itl_ms: Option<f64>,
    /// With `--slo`: requests within every objective.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goodput: Option<Goodput>,
    /// Streamed requests' TTFT split into stages (kvx engines and proxy only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waterfall: Option<Waterfall>,
}

impl TargetSummary {
    /// Whether the engines sent every token at once (`--itl-ms 0`): ITL and TPOT of zero are
    /// then an artefact, not a measurement.
    pub fn pacing_off(&self) -> bool {
        self.engine_itl_ms == Some(0.0)
    }
}

/// `targets[0]` minus `targets[i]`, percentile by percentile (not a percentile of paired
/// differences).
#[derive(Debug, Clone, Serialize)]
pub struct Overhead {
    pub target: String,
    pub baseline: String,
    pub e2e_p50_ms: f64,
    pub e2e_p90_ms: f64,
    pub e2e_p99_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

/// Everything `kvx load` reports.
#[derive(Debug, Clone, Serialize)]
pub struct LoadSummary {
    pub schema: &'static str,
    pub arrival: String,
    pub endpoint: &'static str,
    pub stream: bool,
    pub prompt_len: String,
    pub max_tokens: u64,
    pub model: Option<String>,
    pub targets: Vec<TargetSummary>,
    pub overhead: Vec<Overhead>,
    /// Waits closed-loop workers took after failed requests (doubling from 10 ms to 1 s).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub backoffs: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Why a load run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid URL {url}: {reason} (change {flag})")]
    Url { flag: &'static str, url: String, reason: String },
}

struct Prepared {
    uri: Uri,
    prefill_uri: Option<Uri>,
}

struct Shared {
    cfg: LoadConfig,
    /// Per-run prefix of every `X-Request-Id`, so two runs against one engine never share ids.
    nonce: String,
    client: HttpClient,
    targets: Vec<Prepared>,
    auth: Option<HeaderValue>,
    /// Waits closed-loop workers took after failed requests.
    backoffs: AtomicU64,
}

/// Builds the body of request `i` of target `t`: a unique first word so no two prompts
/// share a prefix (prefix caching would hide prefill), then seeded random words.
fn request_body(cfg: &LoadConfig, t: usize, i: u64, rng: &mut rand::rngs::StdRng) -> (Vec<u8>, u64) {
    use std::fmt::Write as _;
    let (lo, hi) = cfg.prompt_len;
    let n = if lo == hi { lo } else { rng.random_range(lo..=hi) };
    let mut prompt = String::with_capacity(n as usize * 6);
    let _ = write!(prompt, "r{t}x{i}");
    for _ in 1..n {
        let _ = write!(prompt, " w{}", rng.random_range(0..10_000u32));
    }
    let mut body = serde_json::Map::new();
    let mut put = |k: &str, v: serde_json::Value| {
        body.insert(k.to_string(), v);
    };
    if let Some(m) = &cfg.model {
        put("model", m.clone().into());
    }
    match cfg.endpoint {
        Endpoint::Completions => {
            put("prompt", prompt.into());
            put("max_tokens", cfg.max_tokens.into());
        }
        Endpoint::Chat => {
            put("messages", serde_json::json!([{"role": "user", "content": prompt}]));
            put("max_completion_tokens", cfg.max_tokens.into());
        }
    }
    put("stream", cfg.stream.into());
    if cfg.stream {
        put("stream_options", serde_json::json!({"include_usage": true}));
    }
    if cfg.ignore_eos {
        put("ignore_eos", true.into());
    }
    (serde_json::to_vec(&body).unwrap_or_default(), n)
}

fn post(sh: &Shared, uri: &Uri, body: Bytes, request_id: &str) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .header("x-request-id", request_id);
    if let Some(a) = &sh.auth {
        b = b.header(header::AUTHORIZATION, a.clone());
    }
    b.body(Full::new(body)).unwrap_or_default()
}

fn classify(e: &hyper_util::client::legacy::Error) -> String {
    if e.is_connect() { "connect".into() } else { "transport".into() }
}

/// Incremental SSE reader: complete `data:` payloads out of arbitrary body frames.
#[derive(Debug, Default)]
pub struct SseReader {
    buf: Vec<u8>,
}

impl SseReader {
    /// Feeds bytes; calls `on_data` with each complete event's data payload.
    pub fn feed(&mut self, bytes: &[u8], mut on_data: impl FnMut(&[u8])) {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(pos) = self.buf[start..].windows(2).position(|w| w == b"\n\n") {
            let event = &self.buf[start..start + pos];
            for line in event.split(|&b| b == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if let Some(d) = line.strip_prefix(b"data:") {
                    on_data(d.strip_prefix(b" ").unwrap_or(d));
                }
            }
            start += pos + 2;
        }
        self.buf.drain(..start);
    }
}

#[derive(serde::Deserialize)]
struct ChunkIn<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChoiceIn<'a>>,
    #[serde(default)]
    usage: Option<UsageIn>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(serde::Deserialize)]
struct ChoiceIn<'a> {
    #[serde(default, borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<DeltaIn<'a>>,
    #[serde(default, borrow)]
    message: Option<DeltaIn<'a>>,
}

#[derive(serde::Deserialize)]
struct DeltaIn<'a> {
    #[serde(default, borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
}

#[derive(serde::Deserialize)]
struct UsageIn {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

impl ChunkIn<'_> {
    fn has_content(&self) -> bool {
        self.choices.iter().any(|c| {
            c.text.as_deref().is_some_and(|t| !t.is_empty())
                || c.delta.as_ref().and_then(|d| d.content.as_deref()).is_some_and(|t| !t.is_empty())
        })
    }
}

/// Sends one request (both legs for a client-side P/D target) and measures it.
async fn one_request(sh: &Shared, t: usize, body: Bytes, s: &mut Sample) {
    let target = &sh.targets[t];
    let rid = request_id(&sh.nonce, &sh.cfg.targets[t].name, s.index);
    let start = Instant::now();
    s.start = Some(start);
    let deadline = start + sh.cfg.timeout;
    let result = tokio::time::timeout_at(deadline.into(), async {
        let body = match &target.prefill_uri {
            None => body,
            Some(p_uri) => prefill_leg(sh, p_uri, &body, &rid, &mut s.server_timing).await?,
        };
        let resp = sh.client.request(post(sh, &target.uri, body, &rid)).await.map_err(|e| classify(&e))?;
        s.to_headers = Some(start.elapsed());
        s.server_timing.extend(timing::from_headers(resp.headers()));
        let status = resp.status();
        let mut b = resp.into_body();
        if !status.is_success() {
            let _ = b.collect().await;
            return Err(format!("http_{}", status.as_u16()));
        }
        if sh.cfg.stream {
            let mut sse = SseReader::default();
            let mut last: Option<Instant> = None;
            let mut events = 0u64;
            let mut usage_tokens = None;
            let mut err: Option<String> = None;
            let mut done = false;
            while let Some(frame) = b.frame().await {
                let frame = frame.map_err(|_| "body".to_string())?;
                let Some(data) = frame.data_ref() else { continue };
                let now = Instant::now();
                sse.feed(data, |d| {
                    if d == b"[DONE]" {
                        done = true;
                        return;
                    }
                    match serde_json::from_slice::<ChunkIn<'_>>(d) {
                        Ok(c) if c.error.is_some() => err = Some("stream_error".into()),
                        Ok(c) => {
                            if c.has_content() {
                                events += 1;
                                match last {
                                    None => s.ttft = Some(now - start),
                                    Some(prev) => s.itl.push(now - prev),
                                }
                                last = Some(now);
                            }
                            if let Some(u) = c.usage.and_then(|u| u.completion_tokens) {
                                usage_tokens = Some(u);
                            }
                        }
                        Err(_) => err = Some("invalid_response".into()),
                    }
                });
            }
            if let Some(e) = err {
                return Err(e);
            }
            if !done {
                return Err("stream_incomplete".into());
            }
            s.tokens = usage_tokens.unwrap_or(events);
        } else {
            let bytes = b.collect().await.map_err(|_| "body".to_string())?.to_bytes();
            let c: ChunkIn<'_> =
                serde_json::from_slice(&bytes).map_err(|_| "invalid_response".to_string())?;
            s.tokens =
                match c.usage.and_then(|u| u.completion_tokens) {
                    Some(n) => n,
                    None => u64::from(c.choices.iter().any(|c| {
                        c.text.is_some() || c.message.as_ref().is_some_and(|m| m.content.is_some())
                    })),
                };
            s.ttft = Some(start.elapsed());
        }
        Ok::<(), String>(())
    })
    .await;
    let end = Instant::now();
    s.end = Some(end);
    s.e2e = end - start;
    s.error = match result {
        Err(_) => Some("timeout".into()),
        Ok(Err(e)) => Some(e),
        Ok(Ok(())) => None,
    };
}

/// The client-side prefill leg: same rewriting as the proxy; returns the decode body.
async fn prefill_leg(
    sh: &Shared,
    p_uri: &Uri,
    body: &Bytes,
    request_id: &str,
    server_timing: &mut Vec<(String, f64)>,
) -> Result<Bytes, String> {
    let obj = RawObject::parse(body).map_err(|_| "invalid_request".to_string())?;
    let p_body = Bytes::from(rewrite::prefill_body(&obj));
    let resp = sh
        .client
        .request(post(sh, p_uri, p_body, request_id))
        .await
        .map_err(|e| format!("prefill_{}", classify(&e)))?;
    let status = resp.status();
    server_timing.extend(timing::from_headers(resp.headers()));
    let bytes = resp.into_body().collect().await.map_err(|_| "prefill_body".to_string())?.to_bytes();
    if !status.is_success() {
        return Err(format!("prefill_http_{}", status.as_u16()));
    }
    let p = RawObject::parse(&bytes).map_err(|_| "prefill_invalid_response".to_string())?;
    let params = p.get("kv_transfer_params").filter(|r| rewrite::is_truthy(r));
    Ok(Bytes::from(rewrite::decode_body(&obj, body, params)))
}

/// Asks `GET /v1/models` of a base URL for the first served model id: `None` when the server
/// does not say within [`DISCOVERY_TIMEOUT`] (headers and body), or an interrupt comes first.
pub async fn discover_model(base: &Uri, api_key: Option<&str>) -> Option<String> {
    let client = http_client(Some(Duration::from_secs(2)));
    // Even when a full endpoint URL was given, models live at the server root.
    let uri = Uri::builder()
        .scheme("http")
        .authority(base.authority()?.clone())
        .path_and_query("/v1/models")
        .build()
        .ok()?;
    let mut req = Request::get(uri);
    if let Some(k) = api_key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req.body(Full::new(Bytes::new())).ok()?;
    let ask = async {
        let resp = client.request(req).await.ok()?;
        resp.into_body().collect().await.ok().map(|b| b.to_bytes())
    };
    let bytes = tokio::select! {
        r = tokio::time::timeout(DISCOVERY_TIMEOUT, ask) => r.ok()??,
        () = until_interrupted() => return None,
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v["data"][0]["id"].as_str().map(str::to_string)
}

/// How long `kvx load` waits for a server to name its model.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// Returns once an interrupt has been asked for (checked every [`INTERRUPT_POLL`]).
async fn until_interrupted() {
    while crate::interrupt::requested().is_none() {
        tokio::time::sleep(INTERRUPT_POLL).await;
    }
}

/// The `X-Request-Id` a request is sent with (both legs of a client-side P/D pair too, as
/// the proxy does): engines name the request after it, so their records join with ours.
pub fn request_id(nonce: &str, target: &str, index: u64) -> String {
    format!("{nonce}-{target}-{index}")
}

/// One measured request, as the client saw it (a line of `http_requests.csv`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// The `X-Request-Id` it was sent with.
    pub request_id: String,
    pub target: String,
    /// Request number within its target (warm-up requests come first).
    pub index: u64,
    /// Start, relative to the first measured request of the run.
    pub start_offset_us: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub ttft_us: Option<f64>,
    pub e2el_us: f64,
    /// Mean gap between streamed tokens (streaming requests with at least two tokens).
    pub itl_mean_us: Option<f64>,
    pub send_lag_us: f64,
    pub error: Option<String>,
}

/// One measured request's TTFT waterfall (a line of `ttft_waterfall.csv`).
#[derive(Debug, Clone, PartialEq)]
pub struct RequestWaterfall {
    pub request_id: String,
    pub target: String,
    pub ttft_us: f64,
    /// Per stage of [`crate::report::waterfall::STAGES`], nanoseconds.
    pub stages_ns: Breakdown,
}

/// Everything a load run measured.
#[derive(Debug, Clone)]
pub struct LoadRun {
    pub summary: LoadSummary,
    /// Samples per target (same order as `summary.targets`), nanoseconds, by stage name.
    pub recorders: Vec<StageRecorder>,
    /// Every measured request, in completion order.
    pub requests: Vec<RequestRecord>,
    /// Every measured request a kvx engine timed, in completion order.
    pub waterfalls: Vec<RequestWaterfall>,
}

/// Runs the load and returns per-target summaries, samples and request records.
pub async fn run(cfg: LoadConfig) -> Result<LoadRun, LoadError> {
    run_with_progress(cfg, None).await
}

/// [`run`], counting finished requests into `progress` as they come in.
pub async fn run_with_progress(
    cfg: LoadConfig,
    progress: Option<Arc<LoadProgress>>,
) -> Result<LoadRun, LoadError> {
    let mut targets = Vec::new();
    for t in &cfg.targets {
        let path = cfg.endpoint.path();
        let uri = endpoint_uri(&t.url, path).map_err(|reason| LoadError::Url {
            flag: "--url",
            url: t.url.to_string(),
            reason,
        })?;
        let prefill_uri = match &t.prefill_url {
            Some(p) => Some(endpoint_uri(p, path).map_err(|reason| LoadError::Url {
                flag: "--baseline-prefill-url",
                url: p.to_string(),
                reason,
            })?),
            None => None,
        };
        targets.push(Prepared { uri, prefill_uri });
    }
    let auth = cfg.api_key.as_ref().and_then(|k| HeaderValue::from_str(&format!("Bearer {k}")).ok());
    let nonce = format!("load-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let sh = Arc::new(Shared {
        client: http_client(Some(Duration::from_secs(5))),
        nonce,
        targets,
        auth,
        cfg,
        backoffs: AtomicU64::new(0),
    });

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Sample>();
    let started = Instant::now();
    let mut drivers = tokio::task::JoinSet::new();
    for t in 0..sh.targets.len() {
        let sh = sh.clone();
        let tx = tx.clone();
        drivers.spawn(async move { drive(sh, t, started, tx).await });
    }
    drop(tx);

    let n = sh.targets.len();
    let open_loop = matches!(sh.cfg.arrival, Arrival::Poisson { .. });
    let mut agg: Vec<Agg> = (0..n).map(|_| Agg { open_loop, slo: sh.cfg.slo, ..Agg::default() }).collect();
    let mut measured = Vec::new();
    while let Some(s) = rx.recv().await {
        if let Some(p) = &progress {
            p.add(&s);
        }
        if s.measured {
            agg[s.target].add(&s);
            measured.push(s);
        }
    }
    while drivers.join_next().await.is_some() {}

    let cfg = &sh.cfg;
    let first = measured.iter().filter_map(|s| s.start).min().unwrap_or(started);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let requests = measured
        .iter()
        .map(|s| RequestRecord {
            request_id: request_id(&sh.nonce, &cfg.targets[s.target].name, s.index),
            target: cfg.targets[s.target].name.clone(),
            index: s.index,
            start_offset_us: s.start.map_or(0.0, |t| us(t.saturating_duration_since(first))),
            prompt_tokens: s.prompt_tokens,
            output_tokens: s.tokens,
            ttft_us: s.ttft.map(us),
            e2el_us: us(s.e2e),
            itl_mean_us: (!s.itl.is_empty())
                .then(|| s.itl.iter().map(|d| us(*d)).sum::<f64>() / s.itl.len() as f64),
            send_lag_us: us(s.lag),
            error: s.error.clone(),
        })
        .collect();
    let waterfalls = measured
        .iter()
        .filter_map(|s| {
            let b = s.breakdown()?;
            Some(RequestWaterfall {
                request_id: request_id(&sh.nonce, &cfg.targets[s.target].name, s.index),
                target: cfg.targets[s.target].name.clone(),
                ttft_us: s.ttft.map_or(0.0, us),
                stages_ns: b,
            })
        })
        .collect();
    let recorders: Vec<StageRecorder> = agg.iter().map(|a| a.rec.clone()).collect();
    let summaries: Vec<TargetSummary> =
        agg.into_iter().zip(&cfg.targets).map(|(a, t)| a.summary(t)).collect();
    let overhead = summaries
        .iter()
        .skip(1)
        .map(|b| {
            let a = &summaries[0];
            Overhead {
                target: a.name.clone(),
                baseline: b.name.clone(),
                e2e_p50_ms: a.e2e_ms.p50 - b.e2e_ms.p50,
                e2e_p90_ms: a.e2e_ms.p90 - b.e2e_ms.p90,
                e2e_p99_ms: a.e2e_ms.p99 - b.e2e_ms.p99,
                ttft_p50_ms: a.ttft_ms.p50 - b.ttft_ms.p50,
                ttft_p99_ms: a.ttft_ms.p99 - b.ttft_ms.p99,
            }
        })
        .collect();
    let summary = LoadSummary {
        schema: "kvx.load/v1",
        arrival: match cfg.arrival {
            Arrival::Poisson { rate: r } => format!("poisson {r} req/s per target"),
            Arrival::Closed { concurrency: c } => format!("closed loop, {c} in flight per target"),
        },
        endpoint: cfg.endpoint.path(),
        stream: cfg.stream,
        prompt_len: prompt_len_label(cfg.prompt_len),
        max_tokens: cfg.max_tokens,
        model: cfg.model.clone(),
        targets: summaries,
        overhead,
        backoffs: sh.backoffs.load(Ordering::Relaxed),
    };
    Ok(LoadRun { summary, recorders, requests, waterfalls })
}

/// `16` or `8..24`.
pub fn prompt_len_label((lo, hi): (u64, u64)) -> String {
    if lo == hi { lo.to_string() } else { format!("{lo}..{hi}") }
}

/// Sends all requests of one target and reports each sample.
async fn drive(sh: Arc<Shared>, t: usize, started: Instant, tx: tokio::sync::mpsc::UnboundedSender<Sample>) {
    let cfg = &sh.cfg;
    let total = cfg.requests.map(|r| r + cfg.warmup);
    let stop_at = cfg.duration.map(|d| started + d);
    let more = move |i: u64| {
        total.is_none_or(|n| i < n)
            && stop_at.is_none_or(|s| Instant::now() < s)
            && crate::interrupt::requested().is_none()
    };
    let seed = cfg.seed ^ ((t as u64 + 1) << 32);
    match cfg.arrival {
        Arrival::Poisson { rate } => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut tasks = tokio::task::JoinSet::new();
            let mut next = Instant::now();
            let mut i = 0u64;
            while more(i) {
                let u: f64 = rng.random();
                next += Duration::from_secs_f64(-(1.0 - u).ln() / rate);
                if let Some(s) = stop_at
                    && next >= s
                {
                    break;
                }
                // Past deadlines must not touch the timer: it rounds up to a 1 ms tick.
                if next > Instant::now() && !sleep_until_unless_interrupted(next).await {
                    break;
                }
                let (body, prompt_tokens) = request_body(cfg, t, i, &mut rng);
                let body = Bytes::from(body);
                let (sh, tx) = (sh.clone(), tx.clone());
                let measured = i >= cfg.warmup;
                let scheduled = next;
                tasks.spawn(async move {
                    let mut s = Sample {
                        target: t,
                        index: i,
                        prompt_tokens,
                        measured,
                        lag: Instant::now() - scheduled,
                        ..Sample::default()
                    };
                    one_request(&sh, t, body, &mut s).await;
                    let _ = tx.send(s);
                });
                i += 1;
                // Reap finished tasks so the set does not grow with the run.
                while tasks.try_join_next().is_some() {}
            }
            join_all(&mut tasks).await;
        }
        Arrival::Closed { concurrency: c } => {
            let counter = Arc::new(AtomicU64::new(0));
            let mut workers = tokio::task::JoinSet::new();
            // No more workers than requests: each would only find the counter spent.
            let c = total.map_or(c as usize, |n| (c as usize).min(usize::try_from(n).unwrap_or(usize::MAX)));
            for w in 0..c {
                let (sh, tx, counter) = (sh.clone(), tx.clone(), counter.clone());
                workers.spawn(async move {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (w as u64 + 1));
                    let mut backoff = Duration::ZERO;
                    loop {
                        let i = counter.fetch_add(1, Ordering::Relaxed);
                        if !more(i) {
                            break;
                        }
                        let (body, prompt_tokens) = request_body(&sh.cfg, t, i, &mut rng);
                        let body = Bytes::from(body);
                        let mut s = Sample {
                            target: t,
                            index: i,
                            prompt_tokens,
                            measured: i >= sh.cfg.warmup,
                            ..Sample::default()
                        };
                        one_request(&sh, t, body, &mut s).await;
                        let failed = s.error.is_some();
                        let _ = tx.send(s);
                        // A target that fails fast is not hammered: wait, doubling up to
                        // `BACKOFF_MAX`, until a request succeeds again.
                        backoff = if failed {
                            (backoff * 2).clamp(BACKOFF_MIN, BACKOFF_MAX)
                        } else {
                            Duration::ZERO
                        };
                        if !backoff.is_zero() {
                            sh.backoffs.fetch_add(1, Ordering::Relaxed);
                            if !sleep_until_unless_interrupted(Instant::now() + backoff).await {
                                break;
                            }
                        }
                    }
                });
            }
            join_all(&mut workers).await;
        }
    }
}

/// A closed-loop worker's wait after a failed request, doubled on each failure in a row.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How long requests in flight get to finish after an interrupt before they are abandoned.
const INTERRUPT_GRACE: Duration = Duration::from_millis(700);

/// How often a run waiting on its requests checks for an interrupt.
const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// Waits for every task of the set; after an interrupt, gives them [`INTERRUPT_GRACE`] and
/// aborts the rest (their samples are not sent: the report covers finished requests only).
async fn join_all<T: 'static>(set: &mut tokio::task::JoinSet<T>) {
    let mut grace: Option<Instant> = None;
    loop {
        tokio::select! {
            r = set.join_next() => if r.is_none() { return },
            () = tokio::time::sleep(INTERRUPT_POLL) => {}
        }
        if crate::interrupt::requested().is_some() {
            let deadline = *grace.get_or_insert_with(|| Instant::now() + INTERRUPT_GRACE);
            if Instant::now() >= deadline {
                set.abort_all();
                while set.join_next().await.is_some() {}
                return;
            }
        }
    }
}

/// Sleeps until `at`; `false` if an interrupt came first.
async fn sleep_until_unless_interrupted(at: Instant) -> bool {
    tokio::select! {
        () = tokio::time::sleep_until(at.into()) => crate::interrupt::requested().is_none(),
        () = until_interrupted() => false,
    }
}

/// Per-target accumulation.
#[derive(Default)]
struct Agg {
    requests: u64,
    ok: u64,
    errors: BTreeMap<String, u64>,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: u64,
    rec: StageRecorder,
    /// Send lag only means something against a schedule.
    open_loop: bool,
    slo: Option<Slo>,
    /// Requests within every objective.
    good: u64,
    waterfall: WaterfallBuilder,
    /// Smallest and largest token pacing the engines reported.
    pacing_ms: Option<(f64, f64)>,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Agg {
    fn add(&mut self, s: &Sample) {
        self.requests += 1;
        if let Some(t) = s.start {
            self.first = Some(self.first.map_or(t, |f| f.min(t)));
        }
        if let Some(t) = s.end {
            self.last = Some(self.last.map_or(t, |l| l.max(t)));
        }
        if self.open_loop {
            self.rec.record_ns(SEND_LAG, ns(s.lag));
        }
        if self.slo.is_some_and(|slo| slo.meets(&s.times())) {
            self.good += 1;
        }
        if let Some(p) = s.pacing_ms() {
            self.pacing_ms = Some(self.pacing_ms.map_or((p, p), |(lo, hi)| (lo.min(p), hi.max(p))));
        }
        if let (Some(b), Some(t)) = (s.breakdown(), s.ttft) {
            self.waterfall.add(t, b);
        }
        if let Some(e) = &s.error {
            *self.errors.entry(e.clone()).or_default() += 1;
            return;
        }
        self.ok += 1;
        self.tokens += s.tokens;
        self.rec.record_ns(E2EL, ns(s.e2e));
        if let Some(t) = s.ttft {
            self.rec.record_ns(TTFT, ns(t));
            if s.tokens > 1 && !s.itl.is_empty() {
                let tpot = s.e2e.saturating_sub(t) / u32::try_from(s.tokens - 1).unwrap_or(u32::MAX);
                self.rec.record_ns(TPOT, ns(tpot));
            }
        }
        for &d in &s.itl {
            self.rec.record_ns(ITL, ns(d));
        }
    }

    fn summary(self, t: &Target) -> TargetSummary {
        let dur = match (self.first, self.last) {
            (Some(a), Some(b)) if b > a => (b - a).as_secs_f64(),
            _ => 0.0,
        };
        let per_s = |n: u64| if dur > 0.0 { n as f64 / dur } else { 0.0 };
        let stats = self.rec.stats();
        let lat = |name: &str| LatencyMs::from_stats(stats.get(name));
        TargetSummary {
            name: t.name.clone(),
            url: t.url.to_string(),
            prefill_url: t.prefill_url.as_ref().map(ToString::to_string),
            requests: self.requests,
            ok: self.ok,
            errors: self.errors.clone(),
            duration_s: dur,
            requests_per_s: per_s(self.ok),
            output_tokens_per_s: per_s(self.tokens),
            output_tokens: self.tokens,
            ttft_ms: lat(TTFT),
            itl_ms: lat(ITL),
            tpot_ms: lat(TPOT),
            e2e_ms: lat(E2EL),
            send_lag_ms: lat(SEND_LAG),
            // A mix of paced and unpaced engines reports the largest pacing (not "off").
            engine_itl_ms: self.pacing_ms.map(|(_, hi)| hi),
            goodput: self.slo.map(|slo| Goodput::new(&slo, self.requests, self.good, dur)),
            waterfall: self.waterfall.finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_reader_handles_split_frames() {
        let mut r = SseReader::default();
        let mut got = Vec::new();
        r.feed(b"data: {\"a\":1}\n\nda", |d| got.push(d.to_vec()));
        r.feed(b"ta: [DONE]\n", |d| got.push(d.to_vec()));
        r.feed(b"\n", |d| got.push(d.to_vec()));
        assert_eq!(got, vec![b"{\"a\":1}".to_vec(), b"[DONE]".to_vec()]);
    }

    #[test]
    fn endpoint_uri_appends_only_to_bare_bases() {
        let u = |s: &str| s.parse::<Uri>().expect("uri");
        assert_eq!(
            endpoint_uri(&u("http://h:1"), "/v1/completions").expect("ok"),
            u("http://h:1/v1/completions")
        );
        assert_eq!(
            endpoint_uri(&u("http://h:1/"), "/v1/completions").expect("ok"),
            u("http://h:1/v1/completions")
        );
        assert_eq!(endpoint_uri(&u("http://h:1/x/y"), "/v1/completions").expect("ok"), u("http://h:1/x/y"));
        assert!(endpoint_uri(&u("https://h:1"), "/v1/completions").is_err());
    }

    #[test]
    fn request_bodies_have_the_asked_prompt_length() {
        let cfg = LoadConfig {
            targets: vec![],
            arrival: Arrival::Closed { concurrency: 1 },
            requests: Some(1),
            duration: None,
            warmup: 0,
            prompt_len: (5, 9),
            max_tokens: 3,
            stream: true,
            endpoint: Endpoint::Completions,
            model: Some("m".into()),
            ignore_eos: true,
            api_key: None,
            timeout: Duration::from_secs(1),
            seed: 7,
            slo: None,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for i in 0..20 {
            let (b, n) = request_body(&cfg, 0, i, &mut rng);
            let req =
                crate::serve::openai::parse_request(Endpoint::Completions, &b, 100).expect("valid request");
            assert!((5..=9).contains(&req.prompt_tokens));
            assert_eq!(req.prompt_tokens, n);
            assert_eq!(
                (req.max_tokens, req.stream, req.include_usage, req.ignore_eos),
                (3, true, true, true)
            );
        }
    }
}
