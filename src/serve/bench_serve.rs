//! `kvx bench --serve`: the whole serving path in one command. A prefill engine, a decode
//! engine (each with one worker process per TP rank, real UCX reads verified underneath)
//! and the P/D proxy, driven through the proxy by the `kvx load` generator; the run is
//! written and printed through the report machinery.
//!
//! The HTTP servers run in this process, on loopback port 0, rather than as
//! `kvx serve-engine` / `kvx serve-proxy` child processes: the KV path still crosses real
//! process boundaries (the ranks are separate `kvx worker` processes, exactly as behind
//! `kvx serve-engine`), and in-process servers let the report carry the decode ranks' own
//! per-stage hdrhistograms, bytes, verification counts and the engines' final block
//! accounting (leaks, expired leases) instead of Prometheus buckets scraped over HTTP; there
//! are no ports to discover and no child servers to orphan. The servers get their own
//! runtime so the load generator's clock never waits behind their tasks.
//!
//! The engines pace their tokens as `kvx serve-engine` does by default ([`DEFAULT_ITL`]), so
//! ITL, TPOT and the first decode step are those of a real decode step; the report splits
//! each request's TTFT into the stages of the path (the waterfall), and with `--slo` judges
//! every request against the objectives (goodput). With `--metrics-port` the run serves the
//! engines' and the proxy's Prometheus families (vLLM's `vllm:*` and kvx's own) while it
//! goes, labelled `engine="prefill"` and `engine="decode"`.
//!
//! Owns the orchestration and the mapping of its figures into a [`Summary`]. Must not
//! change what the engines, proxy or generator do: it only wires them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::http_engine::{self, EngineState};
use super::load::{self, LoadProgress, LoadRun, ProgressDisplay};
use super::load_report;
use super::metrics::{Exposition, PROMETHEUS_CONTENT_TYPE};
use super::proxy::{self, ProxyState};
use super::workers::{KvRequestRecord, KvStats, WorkerKv};
use crate::config::arrival::Arrival;
use crate::config::bench::BenchSettings;
use crate::config::bench::PromptLens;
use crate::config::bench::ServeOptions;
use crate::config::load::Slo;
use crate::config::load::{LoadConfig, Target};
use crate::config::serve::{BackendAddr, ProxyConfig};
use crate::config::serve::{DEFAULT_ITL, HttpEngineConfig};
use crate::error::Outcome;
use crate::pipeline::engine::{EngineError, EngineFinal};
use crate::report::ReportError;
use crate::report::files::{RunWriter, write_atomic};
use crate::report::recorder::StageRecorder;
use crate::report::summary::{
    DescriptorsPerRequest, RankList, RankThroughput, RequestOutcome, RequestRow, Summary, UcxInfo,
    new_run_id, now_rfc3339, ratio, vllm_metrics_line,
};
use crate::report::table::{
    Style, failures_table, per_rank_table, scenario_table, section, stage_table, throughput_table,
};
use crate::vocab::kinds::Endpoint;
use crate::vocab::kinds::Role as HttpRole;
use crate::vocab::kinds::Role;

/// Tokens generated per request: enough for ITL and TPOT to mean something.
pub const MAX_TOKENS: u64 = 16;

/// The HTTP side of one engine: the bench's model, block size and TP, a context that fits the
/// longest prompt and its generated tokens.
fn http_config(s: &BenchSettings, role: HttpRole) -> HttpEngineConfig {
    let pair = s.pair();
    let spec = if role == HttpRole::Prefill { &pair.p } else { &pair.d };
    let mut c = HttpEngineConfig::new(role, pair.model.name.clone());
    c.max_model_len = u64::from(s.lens.max()) + MAX_TOKENS + 1;
    c.block_size_tokens = spec.block_tokens;
    c.tp_size = spec.tp;
    c.itl = DEFAULT_ITL;
    c
}

/// Why `kvx bench --serve` could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchServeError {
    #[error("starting the {role} engine's workers: {source}")]
    Engine { role: &'static str, source: EngineError },
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Load(#[from] load::LoadError),
    #[error("{0}")]
    Io(String),
    #[error("no request through the proxy succeeded; errors by cause: {0:?}")]
    NothingSucceeded(std::collections::BTreeMap<String, u64>),
    #[error(transparent)]
    Output(#[from] crate::output::OutputError),
}

/// The load generator's settings: the bench's workload, through the proxy.
fn load_config(
    s: &BenchSettings,
    proxy: SocketAddr,
    slo: Option<Slo>,
) -> Result<LoadConfig, BenchServeError> {
    let url =
        format!("http://{proxy}").parse().map_err(|e| BenchServeError::Io(format!("proxy URL: {e}")))?;
    let prompt_len = match &s.lens {
        PromptLens::Fixed(n) => (u64::from(*n), u64::from(*n)),
        PromptLens::Uniform(a, b) => (u64::from(*a), u64::from(*b)),
        PromptLens::List(v) => {
            (u64::from(v.iter().copied().min().unwrap_or(1)), u64::from(v.iter().copied().max().unwrap_or(1)))
        }
    };
    Ok(LoadConfig {
        targets: vec![Target { name: "proxy".into(), url, prefill_url: None }],
        arrival: match s.arrival {
            Arrival::Closed { concurrency } => Arrival::Closed { concurrency: concurrency.max(1) },
            poisson @ Arrival::Poisson { .. } => poisson,
        },
        requests: s.requests,
        duration: s.duration,
        warmup: s.warmup,
        prompt_len,
        max_tokens: MAX_TOKENS,
        stream: true,
        endpoint: Endpoint::Completions,
        model: Some(s.workers.pair.model.name.clone()),
        ignore_eos: true,
        api_key: None,
        timeout: (s.workers.timeout * 8).max(Duration::from_secs(60)),
        seed: s.workers.seed,
        slo,
    })
}

/// Binds 127.0.0.1:0 and serves `f(listener, shutdown)` on the current runtime.
async fn spawn_server<F, Fut>(
    stop: &watch::Receiver<bool>,
    f: F,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), BenchServeError>
where
    F: FnOnce(tokio::net::TcpListener, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    Fut: Future<Output = std::io::Result<()>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| BenchServeError::Io(format!("bind 127.0.0.1:0: {e}")))?;
    let addr = listener.local_addr().map_err(|e| BenchServeError::Io(e.to_string()))?;
    let mut rx = stop.clone();
    let shutdown = Box::pin(async move {
        let _ = rx.wait_for(|v| *v).await;
    });
    let fut = f(listener, shutdown);
    let task = tokio::spawn(async move {
        if let Err(e) = fut.await {
            tracing::warn!("server on {addr}: {e}");
        }
    });
    Ok((addr, task))
}

/// What the run measured, ready for the summary.
struct Measured {
    run: LoadRun,
    load_cfg: LoadConfig,
    p_stats: KvStats,
    d_stats: KvStats,
    records: Vec<KvRequestRecord>,
    p_fin: EngineFinal,
    d_fin: EngineFinal,
    ucx: (String, String),
}

/// Runs the serving path and writes the run; prints tables (or the summary JSON).
pub fn run(s: &BenchSettings, json: bool, opts: &ServeOptions) -> Result<Outcome, BenchServeError> {
    let root = &s.results_root;
    let started_at = now_rfc3339();
    let run_id = new_run_id(&started_at);
    let writer = RunWriter::create(root, &run_id)?;
    crate::output::note!(
        "kvx bench --serve: P tp {} -> D tp {} | {} | {} requests of {} tokens through the proxy | writing {}",
        s.workers.pair.p.tp,
        s.workers.pair.d.tp,
        s.workers.pair.model.name,
        s.requests.map_or_else(|| "timed".to_string(), |r| r.to_string()),
        s.lens,
        writer.dir().display()
    );
    let m = measure(s, opts)?;
    let mut summary = build_summary(s, &m, &run_id, &started_at);
    let interrupted = load_report::mark_interrupted(&mut summary);
    let rows = request_rows(&m.run, &m.records);
    let files = write(writer, &summary, &rows, &m.run)?;
    let out = if json {
        String::from_utf8_lossy(&crate::report::export::summary_json(&summary)?).into_owned()
    } else {
        let dir =
            files.first().and_then(|f| f.parent()).map_or_else(String::new, |d| d.display().to_string());
        format!("{}results: {dir}\n", render(&summary, &m.run))
    };
    crate::output::keep_verdict(crate::output::stdout(out))?;
    if let Some(sig) = interrupted {
        return Ok(Outcome::Interrupted(sig));
    }
    if summary.requests_ok == 0 {
        return Err(BenchServeError::NothingSucceeded(summary.failures_by_cause));
    }
    Ok(crate::report::verdict::outcome("kvx bench --serve", &summary))
}

/// Serves the engines' and the proxy's metrics in one exposition.
fn metrics_router(p: Arc<EngineState>, d: Arc<EngineState>, x: Arc<ProxyState>) -> axum::Router {
    use axum::response::IntoResponse as _;
    let render = move || {
        let mut e = Exposition::new();
        p.render_into(&mut e, Some("prefill"));
        d.render_into(&mut e, Some("decode"));
        x.render_into(&mut e);
        ([(axum::http::header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)], e.finish()).into_response()
    };
    axum::Router::new()
        .route("/metrics", axum::routing::get(move || std::future::ready(render())))
        .fallback(http_engine::not_found)
}

/// Starts everything, drives the load, stops everything.
fn measure(s: &BenchSettings, opts: &ServeOptions) -> Result<Measured, BenchServeError> {
    let p_kv = Arc::new(
        WorkerKv::start(s.engine(Role::Prefill))
            .map_err(|source| BenchServeError::Engine { role: "prefill", source })?,
    );
    let d_kv = Arc::new(
        WorkerKv::start(s.engine(Role::Decode))
            .map_err(|source| BenchServeError::Engine { role: "decode", source })?,
    );
    d_kv.record_requests();
    let ucx = (d_kv.info().ucx_library.clone(), d_kv.info().ucx_version.clone());
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvx-serve")
        .enable_all()
        .build()
        .map_err(|e| BenchServeError::Io(format!("async runtime: {e}")))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let p_state = EngineState::new(http_config(s, HttpRole::Prefill), p_kv.clone());
    let d_state = EngineState::new(http_config(s, HttpRole::Decode), d_kv.clone());
    let (p_st, d_st) = (p_state.clone(), d_state.clone());
    let metrics_bind = opts.metrics_port.map(|port| (s.workers.bind_host.clone(), port));
    let started = servers.block_on(async {
        let (p_addr, p_task) = spawn_server(&stop_rx, |l, stop| http_engine::serve(l, p_state, stop)).await?;
        let (d_addr, d_task) = spawn_server(&stop_rx, |l, stop| http_engine::serve(l, d_state, stop)).await?;
        let mut pcfg = ProxyConfig::new(
            vec![BackendAddr { host: "127.0.0.1".into(), port: p_addr.port() }],
            vec![BackendAddr { host: "127.0.0.1".into(), port: d_addr.port() }],
        );
        pcfg.request_timeout = (s.workers.timeout * 8).max(Duration::from_secs(60));
        pcfg.dispatch = s.dispatch;
        let pst = ProxyState::new(pcfg).map_err(|e| BenchServeError::Io(e.message))?;
        let x_st = pst.clone();
        let (x_addr, x_task) = spawn_server(&stop_rx, |l, stop| proxy::serve(l, pst, stop)).await?;
        let mut tasks = vec![p_task, d_task, x_task];
        if let Some((host, port)) = metrics_bind {
            let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await.map_err(|e| {
                BenchServeError::Io(format!("--metrics-port: cannot bind {host}:{port}: {e}"))
            })?;
            let addr = listener.local_addr().map_err(|e| BenchServeError::Io(e.to_string()))?;
            let mut rx = stop_rx.clone();
            let router = metrics_router(p_st, d_st, x_st);
            tasks.push(tokio::spawn(async move {
                let shutdown = async move {
                    let _ = rx.wait_for(|v| *v).await;
                };
                if let Err(e) = http_engine::serve_router(listener, router, shutdown).await {
                    tracing::warn!("metrics server on {addr}: {e}");
                }
            }));
            crate::output::note!("kvx bench --serve: metrics on http://{addr}/metrics");
        }
        Ok::<_, BenchServeError>((x_addr, tasks))
    });
    let result = match started {
        Ok((x_addr, tasks)) => {
            let cfg = load_config(s, x_addr, opts.slo);
            let run = match cfg {
                Ok(cfg) => {
                    let driver = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| BenchServeError::Io(format!("async runtime: {e}")));
                    let progress = LoadProgress::new();
                    let total = cfg.requests.map(|n| n + cfg.warmup);
                    let display = s.progress_bar.then(|| ProgressDisplay::start(progress.clone(), total));
                    let r = driver.and_then(|rt| {
                        rt.block_on(load::run_with_progress(cfg.clone(), Some(progress)))
                            .map(|r| (r, cfg))
                            .map_err(BenchServeError::from)
                    });
                    drop(display);
                    r
                }
                Err(e) => Err(e),
            };
            let _ = stop_tx.send(true);
            servers.block_on(async {
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
                }
            });
            run
        }
        Err(e) => Err(e),
    };
    servers.shutdown_timeout(Duration::from_secs(2));
    let d_fin = d_kv.shutdown().unwrap_or_default();
    let p_fin = p_kv.shutdown().unwrap_or_default();
    let (run, load_cfg) = result?;
    Ok(Measured {
        run,
        load_cfg,
        p_stats: p_kv.stats(),
        d_stats: d_kv.stats(),
        records: d_kv.take_records(),
        p_fin,
        d_fin,
        ucx,
    })
}

/// KV figures of the measured requests only (warm-up loads left out), from the decode
/// engine's per-request records.
#[derive(Default)]
struct KvFigures {
    recorder: StageRecorder,
    loads_ok: u64,
    bytes_read: u64,
    bytes_verified: u64,
    verify_failures: u64,
    descriptors_raw: u64,
    descriptors_coalesced: u64,
    per_rank: BTreeMap<u32, (u64, u64)>,
    bandwidth: crate::report::bandwidth::BandwidthTally,
}

fn kv_figures(run: &LoadRun, records: &[KvRequestRecord]) -> KvFigures {
    let measured: HashSet<&str> = run.requests.iter().map(|r| r.request_id.as_str()).collect();
    let mut f = KvFigures::default();
    for k in records.iter().filter(|k| measured.contains(k.x_request_id.as_str())) {
        f.verify_failures += k.verify_failures;
        if let Some(ns) = k.handshake_ns {
            f.recorder.record_ns("handshake", ns);
        }
        if k.failure.is_some() {
            continue;
        }
        f.loads_ok += 1;
        f.bytes_read += k.bytes;
        f.bytes_verified += k.bytes_verified;
        f.descriptors_raw += k.descriptors_raw;
        f.descriptors_coalesced += k.descriptors_coalesced;
        for (stage, ns) in [
            ("queue", k.queue_ns),
            ("plan", k.plan_ns),
            ("post", k.post_ns),
            ("transfer", k.transfer_ns),
            ("notify", k.notify_ns),
            ("e2e", k.e2e_ns),
            ("verify", k.verify_ns),
            (crate::pipeline::bench::SYNC_TO_DEVICE, k.sync_ns),
        ] {
            // Stages some runs have: recorded where they happened.
            if !matches!(stage, "verify" | crate::pipeline::bench::SYNC_TO_DEVICE) || ns > 0 {
                f.recorder.record_ns(stage, ns);
            }
        }
        if let Some(ns) = f.bandwidth.add(&k.transfers) {
            f.recorder.record_ns(crate::report::Stage::TransferSpan.as_str(), ns);
        }
        for &(rank, bytes) in &k.rank_bytes {
            let e = f.per_rank.entry(rank).or_default();
            e.0 += bytes;
            e.1 += 1;
        }
    }
    f
}

/// The summary: the client-side latencies and outcomes from the load generator, the KV
/// figures of the same requests from the decode ranks, block accounting from both engines.
fn build_summary(s: &BenchSettings, m: &Measured, run_id: &str, started_at: &str) -> Summary {
    let mut sum = load_report::summary(&m.run, &m.load_cfg, run_id, started_at, &s.name);
    let mut scenario = crate::report::scenario::bench_scenario(s);
    scenario.extra.extend(sum.scenario.extra.clone());
    scenario.extra.serve = Some(true);
    sum.scenario = scenario;
    let k = kv_figures(&m.run, &m.records);
    let mut kv = k.recorder.clone();
    let _ = kv.merge(&m.p_stats.recorder);
    let http = std::mem::take(&mut sum.stages);
    sum.stages = kv.stats();
    sum.stages.extend(http);
    sum.bytes_read = k.bytes_read;
    sum.bytes_verified = k.bytes_verified;
    sum.verify_failures = k.verify_failures;
    sum.throughput_gbps = ratio(k.bytes_read as f64, sum.duration_s) / 1e9;
    sum.bytes_per_request = ratio(k.bytes_read as f64, k.loads_ok as f64);
    sum.descriptors_per_request = DescriptorsPerRequest {
        raw: ratio(k.descriptors_raw as f64, k.loads_ok as f64),
        coalesced: ratio(k.descriptors_coalesced as f64, k.loads_ok as f64),
    };
    sum.transfer_bandwidth = k.bandwidth.summary();
    sum.per_rank = k
        .per_rank
        .iter()
        .map(|(&rank, &(bytes, requests))| RankThroughput {
            role: "decode".into(),
            rank,
            throughput_gbps: ratio(bytes as f64, sum.duration_s) / 1e9,
            bytes,
            requests,
        })
        .collect();
    sum.blocks_leaked = u64::from(m.p_fin.blocks_leaked + m.d_fin.blocks_leaked);
    sum.blocks_expired = m.p_fin.leases_expired;
    let d = &m.d_stats;
    sum.ucx = UcxInfo {
        library: m.ucx.0.clone(),
        version: m.ucx.1.clone(),
        err_mode: Some(s.workers.transport.err_mode.to_string()),
        ..UcxInfo::default()
    };
    d.ucx.clone().report(&s.workers, &mut sum);
    sum.notes.insert(
        1,
        "queue, handshake, plan, post, transfer, notify, e2e, verify: the decode ranks' KV load stages \
         (slowest rank per request, measured requests only); fill: the prefill ranks' pattern fill \
         (warm-up included)"
            .to_string(),
    );
    let kv_path = match (s.workers.transport.mode, s.dispatch) {
        (crate::topology::TransferMode::Pull, _) => {
            "client -> proxy -> prefill engine (fill, hold) -> proxy -> decode engine (handshake, UCX reads, \
             verify {verify}, notify)"
        }
        (_, crate::config::worker::Dispatch::Sequential) => {
            "client -> proxy -> prefill engine (fill, hold) -> proxy -> decode engine (registers its blocks; \
             prefill ranks WRITE, flush, notify; verify {verify})"
        }
        (_, crate::config::worker::Dispatch::Concurrent) => {
            "client -> proxy -> both engines at once (the first request leg after leg, to learn the prefill \
             engine's identity): decode registers its blocks while prefill fills; prefill ranks WRITE, flush, \
             notify; verify {verify}"
        }
    };
    sum.notes.push(format!(
        "serving path: {} -> {MAX_TOKENS} streamed tokens {} ms apart (a decode step; the first token after \
         the KV load takes one step too); prefill compute is 0, so TTFT is HTTP, KV and one decode step",
        kv_path.replace("{verify}", s.workers.verify.as_str()),
        DEFAULT_ITL.as_millis()
    ));
    if let Some(v) = sum.stages.get("verify").filter(|v| v.count > 0) {
        sum.notes.push(format!(
            "ttft includes the decode ranks' verification of what they read (p50 {:.3} ms); pass --verify off \
             for TTFT without it",
            v.p50_us / 1e3
        ));
    }
    if d.loads_failed > 0 {
        sum.notes.push(format!("KV loads failed by cause (warm-up included): {:?}", d.failures_by_cause));
        if let Some(first) = &d.first_failure {
            sum.notes.push(format!("first KV load failure: {first}"));
        }
    }
    if s.prefix_hit > 0.0 {
        sum.notes
            .push("--prefix-hit is ignored with --serve: the reference engine has no prefix cache".into());
    }
    if s.repeat > 1 {
        sum.notes.push("--repeat is ignored with --serve: one measured pass".into());
    }
    if matches!(s.lens, PromptLens::List(_)) {
        sum.notes.push("prompt lengths from a file are drawn uniformly between their min and max".into());
    }
    for (role, fin) in [("prefill", &m.p_fin), ("decode", &m.d_fin)] {
        if !fin.dead_ranks.is_empty() {
            sum.notes.push(format!("{role} ranks that died: {:?}", fin.dead_ranks));
        }
    }
    if m.p_fin.unrecognized_notifs > 0 {
        sum.notes.push(format!("{} notifications for unrecognized requests", m.p_fin.unrecognized_notifs));
    }
    sum.finished_at = Some(now_rfc3339());
    sum.partial = false;
    sum
}

/// `requests.csv`: each measured request's outcome joined with its KV load (by X-Request-Id).
fn request_rows(run: &LoadRun, records: &[KvRequestRecord]) -> Vec<RequestRow> {
    let by_id: HashMap<&str, &KvRequestRecord> =
        records.iter().map(|r| (r.x_request_id.as_str(), r)).collect();
    let us = |ns: u64| ns as f64 / 1e3;
    load_report::request_rows(run)
        .into_iter()
        .map(|mut row| {
            if let Some(k) = by_id.get(row.request_id.as_str()) {
                row.blocks = k.blocks;
                row.bytes = k.bytes;
                row.descriptors_raw = k.descriptors_raw;
                row.descriptors_coalesced = k.descriptors_coalesced;
                if k.failure.is_none() {
                    row.queue_us = Some(us(k.queue_ns));
                    row.handshake_us = k.handshake_ns.map(us);
                    row.plan_us = Some(us(k.plan_ns));
                    row.post_us = Some(us(k.post_ns));
                    row.transfer_us = Some(us(k.transfer_ns));
                    row.transfer_span_us =
                        crate::clock::wall_span_ns(k.transfers.iter().map(|t| t.span)).map(us);
                    row.notify_us = Some(us(k.notify_ns));
                    row.e2e_us = Some(us(k.e2e_ns));
                } else if row.outcome == RequestOutcome::Ok {
                    row.outcome = RequestOutcome::Failed;
                    row.failure_cause = k.failure.clone();
                }
                row.d_ranks = RankList(k.rank_bytes.iter().map(|&(r, _)| r).collect());
            }
            row
        })
        .collect()
}

fn write(
    mut writer: RunWriter,
    summary: &Summary,
    rows: &[RequestRow],
    run: &LoadRun,
) -> Result<Vec<PathBuf>, ReportError> {
    for row in rows {
        writer.write_request(row)?;
    }
    let dir = writer.dir().to_path_buf();
    let mut files = writer.finish(summary)?;
    let p = dir.join(load_report::LOAD_JSON);
    write_atomic(&p, &load_report::load_json(&run.summary)?)?;
    files.push(p);
    let p = dir.join(load_report::HTTP_REQUESTS_CSV);
    write_atomic(&p, &load_report::http_requests_csv(run)?)?;
    files.push(p);
    if !run.waterfalls.is_empty() {
        let p = dir.join(load_report::WATERFALL_CSV);
        write_atomic(&p, &load_report::waterfall_csv(run)?)?;
        files.push(p);
    }
    Ok(files)
}

/// The terminal report: scenario, every stage (KV and client-side), KV throughput,
/// outcomes and verification, per rank, the proxy target, the vLLM metrics line.
fn render(s: &Summary, run: &LoadRun) -> String {
    let style = Style::Terminal;
    let mut out = String::new();
    out.push_str(&section("Scenario", &scenario_table(s, style), style));
    out.push('\n');
    out.push_str(&section("Latency by stage (KV and client-side)", &stage_table(s, style), style));
    out.push('\n');
    out.push_str(&section("KV throughput, bytes, descriptors", &throughput_table(s, style), style));
    out.push('\n');
    out.push_str(&section("Outcomes and verification", &failures_table(s, style), style));
    if let Some(t) = per_rank_table(s, style) {
        out.push('\n');
        out.push_str(&section("Per rank", &t, style));
    }
    out.push('\n');
    out.push_str(&section("Through the proxy", &load_report::targets_table(&run.summary, style), style));
    out.push_str(&load_report::serving_sections(s, &run.summary, style));
    if let Some(line) = vllm_metrics_line(s) {
        out.push('\n');
        out.push_str(&line);
        out.push('\n');
    }
    out
}
