//! Report machinery end to end: `RunWriter` writing a run directory (also when the run never
//! finishes), the exporters' output read back, SVG charts parsed as XML, and `kvx report` run
//! as a real process on fixture runs (tests/fixtures/report/).

use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use kvx::report::export::parse_requests_csv;
use kvx::report::files::{self, RunWriter};
use kvx::report::{
    Calibration, RankList, RankRead, RankReads, RepeatMetrics, RequestOutcome, RequestRow, RequestTotals,
    Scenario, Stage, StageRecorder, Summary, SweepPoint, chart, export, run_charts,
};

fn fixture_run(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/report").join(name)
}

fn kvx() -> Command {
    let mut c = Command::cargo_bin("kvx").expect("kvx binary");
    c.timeout(Duration::from_secs(60));
    c
}

fn stdout(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stdout).into_owned()
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

fn row(i: u32) -> RequestRow {
    RequestRow {
        request_id: format!("req-{i}"),
        start_offset_us: f64::from(i) * 500.0,
        prompt_tokens: 4096,
        blocks: 256,
        bytes: 4 << 20,
        descriptors_raw: 2048,
        descriptors_coalesced: 128,
        queue_us: Some(2.0),
        plan_us: Some(1.0),
        post_us: Some(10.0),
        transfer_us: Some(900.0 + f64::from(i % 7) * 50.0),
        // One rank, so the wall span is its transfer: the latency chart draws them once.
        transfer_span_us: Some(900.0 + f64::from(i % 7) * 50.0),
        notify_us: Some(12.0),
        e2e_us: Some(950.0 + f64::from(i % 7) * 50.0),
        verify_us: Some(400.25),
        rank_reads: RankReads(vec![RankRead {
            rank: i % 2,
            start_us: Some(0.0),
            read_us: 900.0 + f64::from(i % 7) * 50.0,
            bytes: 4 << 20,
        }]),
        outcome: if i % 13 == 12 { RequestOutcome::Failed } else { RequestOutcome::Ok },
        failure_cause: (i % 13 == 12).then(|| "timeout".to_string()),
        d_ranks: RankList(vec![i % 2]),
        ..Default::default()
    }
}

/// A summary as bench would build it from rows and recorded samples.
fn built_summary(rows: &[RequestRow]) -> Summary {
    let mut s = Summary::new(
        "20250101T000000Z-test00",
        "2025-01-01T00:00:00Z",
        Scenario { model: Some("llama-3.1-8b".into()), p_tp: Some(2), d_tp: Some(1), ..Default::default() },
    );
    let mut totals = RequestTotals::default();
    let mut rec = StageRecorder::new();
    for r in rows {
        totals.add(r);
        for st in Stage::ALL {
            if let Some(us) = r.stage_us(st) {
                rec.record(st, Duration::from_nanos((us * 1e3) as u64));
            }
        }
    }
    totals.apply(&mut s, 0.05);
    s.set_stages(rec.stats());
    s.calibration =
        Some(Calibration { memcpy_gbps: Some(10.0), ucx_loopback_gbps: Some(7.5), ..Default::default() });
    s
}

#[test]
fn run_writer_keeps_rows_of_a_run_that_never_finishes() {
    let root = tempfile::tempdir().expect("tmp");
    let rows: Vec<RequestRow> = (0..25).map(row).collect();
    let dir;
    {
        let mut w = RunWriter::create(root.path(), "killed").expect("create");
        dir = w.dir().to_path_buf();
        let csv_path = dir.join(files::REQUESTS_FILE);
        for (i, r) in rows.iter().enumerate() {
            w.write_request(r).expect("row");
            // Each row is on disk as soon as it is written, not when the writer goes away.
            let on_disk = std::fs::read(&csv_path).expect("read");
            assert_eq!(parse_requests_csv(&on_disk).expect("parse").len(), i + 1);
        }
        w.write_partial(&built_summary(&rows[..10])).expect("partial");
        w.write_partial(&built_summary(&rows)).expect("partial again");
        assert_eq!(w.rows_written(), 25);
        // Dropped here without `finish`, as a killed run would leave it.
    }
    let run = files::load_run(&dir).expect("load the unfinished run");
    assert!(run.summary.partial);
    assert_eq!(run.summary.requests_total(), 25);
    assert_eq!(run.rows, rows);
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".kvx-tmp")), "no temp files left: {names:?}");
    // `kvx report` renders it and says it is partial.
    let a = kvx().arg("report").arg(&dir).arg("--no-charts").assert().code(0);
    assert!(stdout(&a).contains("PARTIAL"), "{}", stdout(&a));
}

#[test]
fn run_writer_finish_writes_every_file() {
    let root = tempfile::tempdir().expect("tmp");
    let rows: Vec<RequestRow> = (0..40).map(row).collect();
    let mut w = RunWriter::create(root.path(), "done").expect("create");
    let dir = w.dir().to_path_buf();
    for r in &rows {
        w.write_request(r).expect("row");
    }
    let summary = built_summary(&rows);
    let written = w.finish(&summary).expect("finish");
    let names: Vec<&str> = written.iter().filter_map(|p| p.file_name()?.to_str()).collect();
    assert_eq!(
        names,
        vec![
            "summary.json",
            "requests.csv",
            "stages.csv",
            "request-waterfall.svg",
            "latency.svg",
            "rank-bandwidth.svg",
            "throughput-over-time.svg",
            "report.html"
        ]
    );
    let run = files::load_run(&dir).expect("load");
    assert!(!run.summary.partial);
    assert_eq!(run.summary, summary);
    assert_eq!(run.rows, rows);
    assert_eq!(run.summary.requests_ok, 37);
    assert_eq!(run.summary.failures_by_cause.get("timeout"), Some(&3));
    let stages = std::fs::read_to_string(dir.join(files::STAGES_FILE)).expect("stages");
    let first_col: Vec<&str> = stages.lines().map(|l| l.split(',').next().unwrap_or("")).collect();
    assert_eq!(
        first_col,
        vec!["stage", "queue", "plan", "post", "transfer", "transfer_span", "notify", "e2e"]
    );
    for svg in ["request-waterfall.svg", "latency.svg", "rank-bandwidth.svg", "throughput-over-time.svg"] {
        let text = std::fs::read_to_string(dir.join(svg)).expect("svg");
        roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{svg} is not well-formed: {e}"));
    }
    let figures = check_page(&std::fs::read_to_string(dir.join(files::REPORT_HTML)).expect("report.html"));
    assert_eq!(figures, vec!["waterfall", "latency", "rank-bandwidth", "over-time"]);
}

/// A page as a browser reads it (HTML5 parsing with scraper): it parses without an error, is
/// under 2 MB, has one title, loads nothing (no script, no element that loads, no `src`/`href`,
/// no CSS `url(` or `@import`) and holds each figure's chart inline; returns its figures' ids.
pub(crate) fn check_html(html: &str) -> Vec<String> {
    use scraper::{Html, Selector};
    let sel = |s: &str| Selector::parse(s).expect("selector");
    assert!(html.len() < 2_000_000, "the page is {} bytes", html.len());
    let doc = Html::parse_document(html);
    assert!(doc.errors.is_empty(), "HTML parse errors: {:?}", doc.errors);
    assert_eq!(doc.select(&sel("h1")).count(), 1, "one title");
    for e in doc.select(&sel("*")) {
        let tag = e.value().name().to_ascii_lowercase();
        assert!(
            !["script", "link", "img", "iframe", "object", "embed", "image", "use"].contains(&tag.as_str()),
            "<{tag}> in the page"
        );
        for (name, value) in e.value().attrs() {
            assert!(
                !["src", "href", "xlink:href", "srcset", "action", "data"].contains(&name),
                "{name}={value}"
            );
        }
    }
    let css: String = doc.select(&sel("style")).flat_map(|s| s.text()).collect();
    assert!(!css.contains("url(") && !css.contains("@import"), "CSS from elsewhere");
    doc.select(&sel("figure"))
        .map(|f| {
            assert!(f.select(&sel("svg")).next().is_some(), "a figure without its chart inline");
            f.value().attr("id").unwrap_or_default().to_string()
        })
        .collect()
}

/// `report.html` parses (as HTML and as XML), holds its charts inline and asks nothing of the
/// network; returns its figures' ids.
fn check_page(html: &str) -> Vec<String> {
    let figures = check_html(html);
    assert!(html.len() < 2_000_000, "report.html is {} bytes", html.len());
    let doc = roxmltree::Document::parse_with_options(
        html,
        roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() },
    )
    .unwrap_or_else(|e| panic!("report.html is not well-formed: {e}"));
    assert_eq!(doc.root_element().tag_name().name(), "html");
    for n in doc.descendants().filter(|n| n.is_element()) {
        let tag = n.tag_name().name();
        assert!(
            !["script", "link", "img", "iframe", "object", "embed"].contains(&tag),
            "<{tag}> in the page"
        );
        for a in n.attributes() {
            assert!(!["src", "href"].contains(&a.name()), "{}= on <{tag}>", a.name());
        }
    }
    assert!(!html.contains("url(") && !html.contains("@import"), "CSS from elsewhere");
    let xml: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("figure"))
        .map(|f| {
            assert!(f.children().any(|c| c.tag_name().name() == "svg"), "a figure without its chart inline");
            f.attribute("id").unwrap_or_default().to_string()
        })
        .collect();
    assert_eq!(xml, figures, "the HTML and the XML parser see the same figures");
    figures
}

/// Polylines (one per series) and the texts of an SVG document.
fn svg_parts(svg: &str) -> (usize, Vec<String>) {
    let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let lines = doc.descendants().filter(|n| n.has_tag_name("polyline")).count();
    let texts = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .collect();
    (lines, texts)
}

#[test]
fn latency_chart_draws_cdfs_and_what_coincides_once() {
    let rows: Vec<RequestRow> = (0..200).map(row).collect();
    let s = built_summary(&rows);
    let svg = run_charts::latency_svg(&s, &rows).expect("draw").expect("has data");
    let (lines, texts) = svg_parts(&svg);
    let legend: Vec<&String> = texts.iter().filter(|t| t.contains("(p50 ")).collect();
    assert_eq!(legend.len(), 2, "e2e, and the span drawn once with the transfer it equals: {texts:?}");
    assert!(
        legend[0].starts_with("e2e (p50") && legend[1].starts_with("transfer_span = transfer (p50"),
        "{legend:?}"
    );
    // Each series draws its line and its legend sample.
    assert!(lines >= 4, "{lines} polylines");
    assert!(legend.len() <= run_charts::MAX_SERIES);
    assert!(texts.iter().any(|t| t == "requests at or below"), "{texts:?}");
    assert!(texts.iter().any(|t| t == "50%"), "a fraction axis: {texts:?}");
}

#[test]
fn the_run_over_time_lays_repeats_end_to_end() {
    let mut rows: Vec<RequestRow> = (0..40).map(row).collect();
    rows.extend((0..40).map(|i| RequestRow { repeat: 1, ..row(i) }));
    let s = built_summary(&rows);
    let svg = run_charts::throughput_svg(&s, &rows).expect("draw").expect("has data");
    let (_, texts) = svg_parts(&svg);
    for want in ["ok", "failed", "bandwidth", "GB/s read", "requests completed per s"] {
        assert!(texts.iter().any(|t| t == want), "{want}: {texts:?}");
    }
    // 74 completions in two repeats: one bucket per two; a line each for ok, failed, GB/s.
    assert!(texts.iter().any(|t| t.contains("37 buckets")), "{texts:?}");
    let circles = roxmltree::Document::parse(&svg)
        .expect("svg")
        .descendants()
        .filter(|n| n.has_tag_name("circle"))
        .count();
    assert!(circles >= 3 * 30, "{circles} points");
}

#[test]
fn the_request_waterfall_shows_the_median_and_p99_requests() {
    let rows: Vec<RequestRow> = (0..200).map(row).collect();
    let svg = run_charts::waterfall_svg(&rows, None).expect("draw").expect("has data");
    let (_, texts) = svg_parts(&svg);
    for want in ["queue", "plan", "post", "transfer span", "notify", "verify (not timed)"] {
        assert!(texts.iter().any(|t| t == want), "{want}: {texts:?}");
    }
    assert!(texts.iter().any(|t| t.starts_with("read d")), "{texts:?}");
    assert!(texts.iter().any(|t| t.starts_with("median request: ")), "{texts:?}");
    assert!(texts.iter().any(|t| t.starts_with("p99 request: ")), "{texts:?}");
}

#[test]
fn sweep_chart_plots_bandwidth_against_message_size() {
    let mut s = built_summary(&[]);
    let point = |series: &str, bytes: f64, gbps: f64| SweepPoint {
        label: format!("{series} {bytes}"),
        series: Some(series.into()),
        bytes_per_descriptor: Some(bytes),
        throughput_gbps: gbps,
        ..Default::default()
    };
    s.sweep = Some(vec![
        point("nhd", 2048.0, 1.0),
        point("nhd", 32768.0, 4.0),
        point("nhd", 524288.0, 6.0),
        point("hnd", 512.0, 0.5),
        point("hnd", 8192.0, 2.0),
    ]);
    let svg = chart::sweep_svg(&s).expect("draw").expect("has data");
    let (_, texts) = svg_parts(&svg);
    assert!(texts.iter().any(|t| t == "nhd") && texts.iter().any(|t| t == "hnd"), "{texts:?}");
    assert!(texts.iter().any(|t| t == "bytes per descriptor"));
    assert!(texts.iter().any(|t| t.ends_with("KiB")), "byte labels: {texts:?}");
    let csv = String::from_utf8(export::sweep_csv(&s).expect("csv")).expect("utf8");
    assert_eq!(csv.lines().count(), 6);
    // A sweep run also gets its sweep files.
    let root = tempfile::tempdir().expect("tmp");
    let w = RunWriter::create(root.path(), "sweep").expect("create");
    let written = w.finish(&s).expect("finish");
    assert!(written.iter().any(|p| p.ends_with(files::SWEEP_FILE)));
    assert!(written.iter().any(|p| p.ends_with(files::SWEEP_SVG)));
}

#[test]
fn summary_json_round_trips_with_every_section() {
    let rows: Vec<RequestRow> = (0..30).map(row).collect();
    let mut s = built_summary(&rows);
    s.repeats = vec![RepeatMetrics { index: 0, throughput_gbps: 1.0, ..Default::default() }];
    s.sweep = Some(vec![SweepPoint { label: "x".into(), ..Default::default() }]);
    s.scenario.extra.other.insert("new_knob".into(), serde_json::json!([1, 2]));
    s.notes.push("cache-hot".into());
    let bytes = export::summary_json(&s).expect("json");
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("value");
    for key in [
        "schema_version",
        "scenario",
        "ucx",
        "requests_ok",
        "requests_failed",
        "requests_recomputed",
        "bytes_read",
        "bytes_verified",
        "verify_failures",
        "blocks_leaked",
        "throughput_gbps",
        "descriptors_per_request",
        "stages",
        "calibration",
        "repeats",
        "sweep",
    ] {
        assert!(v.get(key).is_some(), "summary.json has {key}");
    }
    for stat in ["count", "mean_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
        assert!(v["stages"]["transfer"].get(stat).is_some(), "stages.transfer.{stat}");
    }
    assert_eq!(serde_json::from_slice::<Summary>(&bytes).expect("back"), s);
}

#[test]
fn report_renders_a_saved_run() {
    let charts = tempfile::tempdir().expect("tmp");
    let a =
        kvx().arg("report").arg(fixture_run("run-a")).arg("--charts-dir").arg(charts.path()).assert().code(0);
    let out = stdout(&a);
    assert!(out.contains("KV Transfer metrics: Num successful transfers=116"), "{out}");
    insta::assert_snapshot!("report_run_table", out);
    for svg in ["request-waterfall.svg", "latency.svg", "throughput-over-time.svg"] {
        let text = std::fs::read_to_string(charts.path().join(svg)).expect(svg);
        svg_parts(&text);
    }
    assert!(stderr(&a).contains("chart:"), "{}", stderr(&a));
}

/// `kvx report RUN --html` on a run written before per-rank reads were recorded: the page
/// holds what the run has; `--request` picks the waterfall's request, and an unknown one is
/// a usage error that names a real id.
#[test]
fn report_html_is_one_self_contained_page() {
    let out = tempfile::tempdir().expect("tmp");
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .args(["--html", "--request", "req-0007", "--charts-dir"])
        .arg(out.path())
        .assert()
        .code(0);
    assert!(stderr(&a).contains("report: "), "{}", stderr(&a));
    let html = std::fs::read_to_string(out.path().join(files::REPORT_HTML)).expect("report.html");
    let figures = check_page(&html);
    assert_eq!(figures, vec!["waterfall", "latency", "over-time"], "no per-rank reads in this run's CSV");
    assert!(html.contains("request req-0007"), "the waterfall of the request asked for");
    for want in ["Latency by stage", "Scenario and environment", "Outcomes and verification"] {
        assert!(html.contains(want), "{want}");
    }
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .args(["--html", "--request", "nope", "--charts-dir"])
        .arg(out.path())
        .assert()
        .code(2);
    assert!(stderr(&a).contains("req-0000"), "{}", stderr(&a));
}

#[test]
fn report_json_is_the_summary() {
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .args(["--format", "json", "--no-charts"])
        .assert()
        .code(0);
    let printed: Summary = serde_json::from_str(&stdout(&a)).expect("summary JSON");
    let saved = files::load_summary(&fixture_run("run-a").join("summary.json")).expect("fixture");
    assert_eq!(printed, saved);
}

/// A hybrid model's run through host buffers: the groups-and-parts table (with what clipping
/// kept off the wire), the two copies as stages, the host-buffer rules that ran, and what the
/// verification checked (the KV caches, not the bytes read).
#[test]
fn report_renders_a_hybrid_run() {
    let a = kvx().arg("report").arg(fixture_run("run-hybrid")).arg("--no-charts").assert().code(0);
    let out = stdout(&a);
    for want in [
        "KV cache groups and parts",
        "not sent (clipping)/request",
        "save_to_host",
        "sync_to_device",
        "host_copy",
        "every byte of the request's blocks in the KV caches",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    insta::assert_snapshot!("report_hybrid_table", out);
}

#[test]
fn report_markdown() {
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .args(["--format", "markdown", "--no-charts"])
        .assert()
        .code(0);
    let out = stdout(&a);
    assert!(out.starts_with("## kvx run 20250601T100000Z-aaaaaa"), "{out}");
    assert!(out.contains("| transfer  |"), "{out}");
}

#[test]
fn report_compares_two_runs() {
    let a = kvx().arg("report").arg(fixture_run("run-a")).arg(fixture_run("run-b")).assert().code(0);
    let out = stdout(&a);
    assert!(out.contains("0.850x"), "{out}");
    insta::assert_snapshot!("report_compare_table", out);
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .arg(fixture_run("run-b").join("summary.json"))
        .args(["--format", "json"])
        .assert()
        .code(0);
    let v: serde_json::Value = serde_json::from_str(&stdout(&a)).expect("json");
    let tput =
        v["rows"].as_array().and_then(|r| r.iter().find(|r| r["metric"] == "throughput_gbps")).expect("row");
    assert!((tput["ratio"].as_f64().expect("ratio") - 0.85).abs() < 1e-9);
}

/// `kvx report A B --html`: one page with both runs' charts side by side, written in B's
/// directory (here --charts-dir) as compare-<A's run id>.html; flags a comparison cannot use
/// are refused by name.
#[test]
fn report_html_puts_two_runs_side_by_side() {
    let out = tempfile::tempdir().expect("tmp");
    let a = kvx()
        .arg("report")
        .arg(fixture_run("run-a"))
        .arg(fixture_run("run-b"))
        .args(["--html", "--charts-dir"])
        .arg(out.path())
        .assert()
        .code(0);
    assert!(stdout(&a).contains("0.850x"), "the table is printed as before");
    let a_id = files::load_summary(&fixture_run("run-a").join("summary.json")).expect("a").run_id;
    let path = out.path().join(files::pair_page_name(&a_id));
    assert!(stderr(&a).contains(&path.display().to_string()), "{}", stderr(&a));
    let html = std::fs::read_to_string(&path).expect("the page");
    assert_eq!(check_page(&html), vec!["compare-throughput", "latency", "request-waterfall"]);
    for want in ["A: median request", "B: median request", "A e2e", "B e2e", "0.850x"] {
        assert!(html.contains(want), "{want}");
    }
    for (flags, named) in [
        (&["--request", "1"][..], "--request"),
        (&["--no-charts"][..], "--no-charts"),
        (&["--charts-dir", "x"][..], "--charts-dir"),
    ] {
        let a = kvx()
            .arg("report")
            .arg(fixture_run("run-a"))
            .arg(fixture_run("run-b"))
            .args(flags)
            .assert()
            .code(2);
        assert!(stderr(&a).contains(named), "{flags:?}: {}", stderr(&a));
    }
}

#[test]
fn report_errors_exit_2_with_a_clear_message() {
    let a = kvx().arg("report").arg("/nonexistent/kvx-run").assert().code(2);
    assert!(stderr(&a).contains("cannot read /nonexistent/kvx-run"), "{}", stderr(&a));
    let empty = tempfile::tempdir().expect("tmp");
    let a = kvx().arg("report").arg(empty.path()).assert().code(2);
    assert!(stderr(&a).contains("is not a kvx run"), "{}", stderr(&a));
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gate/wrong-schema.json");
    let a = kvx().arg("report").arg(schema).arg("--no-charts").assert().code(2);
    assert!(stderr(&a).contains("schema_version 2"), "{}", stderr(&a));
    kvx().arg("report").assert().code(2);
    kvx().arg("report").args(["a", "b", "c"]).assert().code(2);
}
