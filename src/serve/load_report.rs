//! A load run through the report machinery `kvx bench` uses: a schema-versioned
//! [`Summary`] whose stages map holds the client-side latencies under vLLM
//! benchmark_serving's names (`ttft`, `itl`, `tpot`, `e2el`; a baseline target's as
//! `<target>.<name>`), request rows for `requests.csv`, tables built from `report::table`,
//! and the run directory written through `report::files` (`summary.json`, `requests.csv`,
//! `stages.csv`, `latency.svg`, `ttft-waterfall.svg`, plus `load.json` with every target,
//! `http_requests.csv` with each request's client-side timings and `ttft_waterfall.csv` with
//! each request's TTFT by stage).
//!
//! Owns the mapping from load figures to report figures. Must not measure (that is
//! `load.rs`) and does file I/O only through `report::files`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use comfy_table::Table;

use super::load::{LoadRun, LoadSummary, prompt_len_label};
use crate::config::arrival::Arrival;
use crate::config::load::LoadConfig;
use crate::report::ReportError;
use crate::report::files::{RunWriter, write_atomic};
use crate::report::summary::{RequestOutcome, RequestRow, Scenario, StageStats, Summary, now_rfc3339};
use crate::report::table::goodput_table;
use crate::report::table::{Style, align_numbers, fmt_f, new_table, scenario_table, section, stage_table};
use crate::report::table::{waterfall_note, waterfall_table};

/// Marks a serving run's summary partial when Ctrl-C or SIGTERM ended it, saying so in its
/// notes; returns the signal.
pub fn mark_interrupted(summary: &mut Summary) -> Option<crate::error::Signal> {
    let sig = crate::interrupt::requested()?;
    summary.partial = true;
    summary
        .notes
        .push(format!("interrupted by {}: the figures cover the requests that finished", sig.name()));
    Some(sig)
}
use crate::report::waterfall;

/// Every target's figures as `kvx.load/v1` JSON.
pub const LOAD_JSON: &str = "load.json";
/// One line per measured request with its client-side timings.
pub const HTTP_REQUESTS_CSV: &str = "http_requests.csv";
/// One line per measured request a kvx engine timed: its TTFT by stage.
pub const WATERFALL_CSV: &str = "ttft_waterfall.csv";

/// Said in every report of a run whose engines did not pace their tokens.
pub const PACING_OFF_NOTE: &str = "pacing off: the engine sent all tokens at once (--itl-ms 0), so ITL/TPOT are \
     not meaningful";

/// Says what the client-side stage names mean, next to the figures.
pub const STAGES_NOTE: &str = "ttft, itl, tpot, e2el: client-side latencies (time to first token, inter-token \
     latency, time per output token, end-to-end latency; vLLM benchmark_serving's names); \
     <target>.<name>: the same for a baseline target";

/// The scenario of a load run.
pub fn scenario(cfg: &LoadConfig, name: &str) -> Scenario {
    let mut s = Scenario {
        name: Some(name.to_string()),
        model: cfg.model.clone(),
        prompt_len: Some(prompt_len_label(cfg.prompt_len)),
        requests: cfg.requests,
        duration_s: cfg.duration.map(|d| d.as_secs_f64()),
        warmup: Some(cfg.warmup),
        seed: Some(cfg.seed),
        ..Scenario::default()
    };
    match cfg.arrival {
        Arrival::Poisson { rate: r } => s.rate_rps = Some(r),
        Arrival::Closed { concurrency: c } => s.concurrency = Some(c),
    }
    let x = &mut s.extra;
    x.endpoint = Some(cfg.endpoint);
    x.stream = Some(cfg.stream);
    x.max_tokens = Some(cfg.max_tokens);
    x.ignore_eos = Some(cfg.ignore_eos);
    x.slo = cfg.slo.as_ref().map(|slo| slo.describe());
    for t in &cfg.targets {
        let url = match &t.prefill_url {
            Some(p) => format!("P {p} -> D {}", t.url),
            None => t.url.to_string(),
        };
        x.other.insert(format!("target.{}", t.name), serde_json::json!(url));
    }
    s
}

/// The stages map: the first target's latencies under their own names, every other
/// target's as `<target>.<name>`.
pub fn stages(run: &LoadRun) -> BTreeMap<String, StageStats> {
    let mut out = BTreeMap::new();
    for (i, (rec, t)) in run.recorders.iter().zip(&run.summary.targets).enumerate() {
        for (name, st) in rec.stats() {
            let key = if i == 0 { name } else { format!("{}.{name}", t.name) };
            out.insert(key, st);
        }
    }
    out
}

/// The run's summary: counts, rate and errors of the first target (`--url`), latencies of
/// every target, token throughput and overheads as notes.
pub fn summary(run: &LoadRun, cfg: &LoadConfig, run_id: &str, started_at: &str, name: &str) -> Summary {
    let mut s = Summary::new(run_id, started_at, scenario(cfg, name));
    s.environment = crate::host::Environment::detect();
    s.stages = stages(run);
    if let Some(t) = run.summary.targets.first() {
        s.requests_ok = t.ok;
        s.requests_failed = t.requests - t.ok;
        s.failures_by_cause = t.errors.clone();
        s.requests_per_s = t.requests_per_s;
        s.duration_s = t.duration_s;
        s.waterfall = t.waterfall.clone();
        s.goodput = t.goodput.clone();
    }
    s.notes.push(STAGES_NOTE.to_string());
    for t in run.summary.targets.iter().filter(|t| t.pacing_off()) {
        s.notes.push(format!("{}: {PACING_OFF_NOTE}", t.name));
    }
    if let Some(w) = &s.waterfall {
        s.notes.push(format!("ttft waterfall: {}", waterfall_note(w)));
    }
    for t in run.summary.targets.iter().skip(1) {
        if let Some(g) = &t.goodput {
            s.notes.push(format!(
                "{}: goodput {} req/s, {:.1}% of requests within {}",
                t.name,
                fmt_f(g.requests_per_s),
                g.share * 100.0,
                g.describe()
            ));
        }
    }
    for t in &run.summary.targets {
        s.notes.push(format!(
            "{}: {} output tokens, {} tokens/s, {} requests/s",
            t.name,
            t.output_tokens,
            fmt_f(t.output_tokens_per_s),
            fmt_f(t.requests_per_s)
        ));
    }
    s.notes.extend(overhead_lines(&run.summary));
    s.notes.extend(backoff_line(&run.summary));
    s.finished_at = Some(now_rfc3339());
    s
}

/// How often closed-loop workers waited after failed requests, if they did.
pub fn backoff_line(load: &LoadSummary) -> Option<String> {
    (load.backoffs > 0).then(|| {
        format!(
            "backed off {} times after failed requests (a closed-loop worker waits 10 ms, doubling up to 1 s, \
             until a request succeeds again)",
            load.backoffs
        )
    })
}

/// One line per overhead: the first target minus a baseline, percentile by percentile.
pub fn overhead_lines(load: &LoadSummary) -> Vec<String> {
    load.overhead
        .iter()
        .map(|o| {
            format!(
                "overhead {} - {}: e2el p50 {:+.3} ms, p90 {:+.3} ms, p99 {:+.3} ms; ttft p50 {:+.3} ms, p99 {:+.3} ms",
                o.target, o.baseline, o.e2e_p50_ms, o.e2e_p90_ms, o.e2e_p99_ms, o.ttft_p50_ms, o.ttft_p99_ms
            )
        })
        .collect()
}

/// `requests.csv` rows: outcome and start of each measured request (its client-side
/// timings are in `http_requests.csv`; the KV stage columns stay empty).
pub fn request_rows(run: &LoadRun) -> Vec<RequestRow> {
    run.requests
        .iter()
        .map(|r| RequestRow {
            request_id: r.request_id.clone(),
            start_offset_us: r.start_offset_us,
            prompt_tokens: r.prompt_tokens,
            outcome: if r.error.is_some() { RequestOutcome::Failed } else { RequestOutcome::Ok },
            failure_cause: r.error.clone(),
            ..RequestRow::default()
        })
        .collect()
}

/// `http_requests.csv`: each measured request's client-side timings.
pub fn http_requests_csv(run: &LoadRun) -> Result<Vec<u8>, ReportError> {
    let err = |e: csv::Error| ReportError::Encode { what: "HTTP requests CSV", reason: e.to_string() };
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in &run.requests {
        w.serialize(r).map_err(err)?;
    }
    w.into_inner().map_err(|e| ReportError::Encode { what: "HTTP requests CSV", reason: e.to_string() })
}

/// `ttft_waterfall.csv`: each timed request's TTFT and stages, in microseconds.
pub fn waterfall_csv(run: &LoadRun) -> Result<Vec<u8>, ReportError> {
    let err = |e: csv::Error| ReportError::Encode { what: "TTFT waterfall CSV", reason: e.to_string() };
    let mut w = csv::Writer::from_writer(Vec::new());
    let mut header = vec!["request_id".to_string(), "target".to_string(), "ttft_us".to_string()];
    header.extend(waterfall::STAGES.iter().map(|(n, _)| format!("{n}_us")));
    w.write_record(&header).map_err(err)?;
    for r in &run.waterfalls {
        let mut rec = vec![r.request_id.clone(), r.target.clone(), format!("{:.1}", r.ttft_us)];
        rec.extend(r.stages_ns.iter().map(|v| format!("{:.1}", *v as f64 / 1e3)));
        w.write_record(&rec).map_err(err)?;
    }
    w.into_inner().map_err(|e| ReportError::Encode { what: "TTFT waterfall CSV", reason: e.to_string() })
}

/// `load.json`: every target's figures.
pub fn load_json(load: &LoadSummary) -> Result<Vec<u8>, ReportError> {
    let mut out = serde_json::to_vec_pretty(load)
        .map_err(|e| ReportError::Encode { what: "load JSON", reason: e.to_string() })?;
    out.push(b'\n');
    Ok(out)
}

/// Requests, errors and rates per target.
pub fn targets_table(load: &LoadSummary, style: Style) -> Table {
    let mut t = new_table(
        style,
        &["target", "url", "ok", "errors", "requests/s", "out tokens/s", "ttft p50 ms", "e2el p50 ms"],
    );
    for x in &load.targets {
        let errs = if x.errors.is_empty() {
            "0".to_string()
        } else {
            x.errors.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
        };
        let url = match &x.prefill_url {
            Some(p) => format!("P {p} -> D {}", x.url),
            None => x.url.clone(),
        };
        t.add_row(vec![
            x.name.clone(),
            url,
            format!("{}/{}", x.ok, x.requests),
            errs,
            fmt_f(x.requests_per_s),
            fmt_f(x.output_tokens_per_s),
            if x.ttft_ms.count > 0 { fmt_f(x.ttft_ms.p50) } else { "-".into() },
            if x.e2e_ms.count > 0 { fmt_f(x.e2e_ms.p50) } else { "-".into() },
        ]);
    }
    align_numbers(&mut t, 4);
    t
}

/// The terminal (or Markdown) report of a load run.
pub fn render(s: &Summary, load: &LoadSummary, style: Style) -> String {
    let mut out = String::new();
    out.push_str(&section("Scenario", &scenario_table(s, style), style));
    out.push('\n');
    if !s.stages.is_empty() {
        out.push_str(&section("Latency by stage", &stage_table(s, style), style));
        out.push('\n');
    }
    out.push_str(&section("Targets", &targets_table(load, style), style));
    for line in overhead_lines(load).into_iter().chain(backoff_line(load)) {
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str(&serving_sections(s, load, style));
    out
}

/// The TTFT waterfall and goodput sections, and the pacing warning, of a serving run.
pub fn serving_sections(s: &Summary, load: &LoadSummary, style: Style) -> String {
    let mut out = String::new();
    if let Some(w) = &s.waterfall {
        out.push('\n');
        out.push_str(&section("TTFT waterfall", &waterfall_table(w, style), style));
        out.push_str(&waterfall_note(w));
        out.push('\n');
    }
    if let Some(g) = &s.goodput {
        out.push('\n');
        out.push_str(&section("Goodput", &goodput_table(g, style), style));
    }
    for t in load.targets.iter().filter(|t| t.pacing_off()) {
        out.push_str(&format!("{}: {PACING_OFF_NOTE}\n", t.name));
    }
    out
}

/// Writes the run directory: request rows, the final summary, stage CSV and charts, then
/// `load.json` and `http_requests.csv`. Returns the files written.
pub fn write_run(mut writer: RunWriter, s: &Summary, run: &LoadRun) -> Result<Vec<PathBuf>, ReportError> {
    for row in request_rows(run) {
        writer.write_request(&row)?;
    }
    let dir = writer.dir().to_path_buf();
    let mut files = writer.finish(s)?;
    let p = dir.join(LOAD_JSON);
    write_atomic(&p, &load_json(&run.summary)?)?;
    files.push(p);
    let p = dir.join(HTTP_REQUESTS_CSV);
    write_atomic(&p, &http_requests_csv(run)?)?;
    files.push(p);
    if !run.waterfalls.is_empty() {
        let p = dir.join(WATERFALL_CSV);
        write_atomic(&p, &waterfall_csv(run)?)?;
        files.push(p);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::load::Target;
    use crate::report::recorder::StageRecorder;
    use crate::serve::load::{E2EL, ITL, LatencyMs, RequestRecord, TPOT, TTFT, TargetSummary};
    use crate::vocab::kinds::Endpoint;

    fn target(name: &str, ok: u64) -> TargetSummary {
        TargetSummary {
            name: name.into(),
            url: "http://h:1/".into(),
            prefill_url: None,
            requests: 4,
            ok,
            errors: if ok < 4 { BTreeMap::from([("timeout".to_string(), 4 - ok)]) } else { BTreeMap::new() },
            duration_s: 2.0,
            requests_per_s: ok as f64 / 2.0,
            output_tokens_per_s: 8.0,
            output_tokens: 16,
            ttft_ms: LatencyMs { count: ok, p50: 1.5, ..LatencyMs::default() },
            itl_ms: LatencyMs::default(),
            tpot_ms: LatencyMs::default(),
            e2e_ms: LatencyMs::default(),
            send_lag_ms: LatencyMs::default(),
            engine_itl_ms: None,
            goodput: None,
            waterfall: None,
        }
    }

    fn cfg() -> LoadConfig {
        LoadConfig {
            targets: vec![
                Target { name: "url".into(), url: "http://h:1".parse().expect("uri"), prefill_url: None },
                Target {
                    name: "baseline".into(),
                    url: "http://h:2".parse().expect("uri"),
                    prefill_url: None,
                },
            ],
            arrival: Arrival::Closed { concurrency: 3 },
            requests: Some(4),
            duration: None,
            warmup: 1,
            prompt_len: (8, 24),
            max_tokens: 4,
            stream: true,
            endpoint: Endpoint::Chat,
            model: Some("m".into()),
            ignore_eos: true,
            api_key: None,
            timeout: Duration::from_secs(1),
            seed: 0,
            slo: None,
        }
    }

    fn run() -> LoadRun {
        let mut a = StageRecorder::new();
        a.record_ns(TTFT, 1_500_000);
        a.record_ns(E2EL, 3_000_000);
        let mut b = StageRecorder::new();
        b.record_ns(TTFT, 1_000_000);
        b.record_ns(ITL, 10_000);
        b.record_ns(TPOT, 10_000);
        let req = |target: &str, error: Option<&str>| RequestRecord {
            request_id: format!("load-x-{target}-1"),
            target: target.into(),
            index: 1,
            start_offset_us: 5.0,
            prompt_tokens: 9,
            output_tokens: 4,
            ttft_us: Some(1500.0),
            e2el_us: 3000.0,
            itl_mean_us: None,
            send_lag_us: 0.0,
            error: error.map(str::to_string),
        };
        LoadRun {
            summary: LoadSummary {
                schema: "kvx.load/v1",
                arrival: "closed".into(),
                endpoint: "/v1/chat/completions",
                stream: true,
                prompt_len: "8..24".into(),
                max_tokens: 4,
                model: Some("m".into()),
                targets: vec![target("url", 3), target("baseline", 4)],
                overhead: vec![],
                backoffs: 0,
            },
            recorders: vec![a, b],
            requests: vec![req("url", None), req("url", Some("timeout"))],
            waterfalls: vec![],
        }
    }

    #[test]
    fn summary_maps_targets_into_stages_and_counts() {
        let s = summary(&run(), &cfg(), "r", "t", "load");
        let keys: Vec<&str> = s.stages.keys().map(String::as_str).collect();
        assert_eq!(keys, ["baseline.itl", "baseline.tpot", "baseline.ttft", "e2el", "ttft"]);
        assert!((s.stages["ttft"].p50_us - 1500.0).abs() < 2.0, "{:?}", s.stages["ttft"]);
        assert_eq!((s.requests_ok, s.requests_failed), (3, 1));
        assert_eq!(s.failures_by_cause.get("timeout"), Some(&1));
        assert_eq!(s.scenario.concurrency, Some(3));
        assert_eq!(s.scenario.prompt_len.as_deref(), Some("8..24"));
        assert_eq!(s.scenario.extra.endpoint, Some(Endpoint::Chat));
        assert!(s.notes.iter().any(|n| n.starts_with("url: 16 output tokens")), "{:?}", s.notes);
        // It is a valid summary for every reader of summary.json.
        crate::report::export::summary_json(&s).expect("summary JSON reads back");
    }

    #[test]
    fn rows_and_csv_carry_each_request() {
        let r = run();
        let rows = request_rows(&r);
        assert_eq!(rows[0].request_id, "load-x-url-1");
        assert_eq!(rows[1].outcome, RequestOutcome::Failed);
        assert_eq!(rows[1].failure_cause.as_deref(), Some("timeout"));
        let csv = String::from_utf8(http_requests_csv(&r).expect("csv")).expect("utf8");
        let mut lines = csv.lines();
        assert_eq!(
            lines.next(),
            Some(
                "request_id,target,index,start_offset_us,prompt_tokens,output_tokens,ttft_us,e2el_us,itl_mean_us,send_lag_us,error"
            )
        );
        assert_eq!(lines.next(), Some("load-x-url-1,url,1,5.0,9,4,1500.0,3000.0,,0.0,"));
        assert_eq!(lines.next(), Some("load-x-url-1,url,1,5.0,9,4,1500.0,3000.0,,0.0,timeout"));
    }

    #[test]
    fn render_has_the_report_sections() {
        let r = run();
        let s = summary(&r, &cfg(), "r", "t", "load");
        let text = render(&s, &r.summary, Style::Terminal);
        for want in ["Scenario", "Latency by stage", "Targets", "baseline.ttft", "timeout: 1"] {
            assert!(text.contains(want), "missing {want}:\n{text}");
        }
    }
}
