//! The pages that put runs beside each other, in the shape of a run's `report.html` (see
//! `html`): a comparison (`kvx bench --compare-*`, [`compare_page`]), two saved runs
//! (`kvx report A B --html`, [`pair_page`]), a gate verdict (`kvx gate --html-file`, [`gate_page`])
//! and the sections of a sweep's page ([`sweep_sections`]); also the charts a comparison's or
//! a sweep's directory holds ([`side_charts`]).
//!
//! Pure: summaries, request rows and verdicts in, HTML text out; `files.rs` and the CLI write
//! the pages. Charts come from `side_charts` and `run_charts`.

use super::ReportError;
use super::chart;
use super::compare::Comparison;
use super::gate::{GateReport, Verdict, metric_table, summary_lines};
use super::numbers::fmt_f;
use super::page::{Page, WATERFALL_QUESTION, table_html};
use super::run_charts::{self, Cdf, MAX_SERIES, percentile_cdf, sample_cdf};
use super::side_charts::{
    NamedRun, RangeBar, compare_bars, gate_change_svg, median_timelines, range_bars_svg, run_bar, split_runs,
    stage_cdfs, sweep_setting_svg,
};
use super::summary::{RequestOutcome, RequestRow, Stage, Summary};
use super::table::{Style, failures_table, new_table, scenario_table, sweep_table};

/// The comparisons `kvx bench` runs: their scenario name and the setting their runs differ in.
const COMPARISONS: [(&str, &str); 3] = [
    ("compare-transports", "transport"),
    ("compare-modes", "mode"),
    ("compare-kv-buffer-device", "kv_buffer_device"),
];

/// `compare-transports` (`--compare-modes`, `--compare-kv-buffer-device`) where the summary
/// is a comparison's: its name says so and every point carries the setting compared.
pub fn comparison_flag(s: &Summary) -> Option<&'static str> {
    let name = s.scenario.name.as_deref()?;
    let points = s.sweep.as_deref().filter(|p| !p.is_empty())?;
    COMPARISONS
        .iter()
        .find(|(n, key)| *n == name && points.iter().all(|p| p.params.contains_key(*key)))
        .map(|(n, _)| *n)
}

/// The questions the side-by-side charts answer, as the pages (and docs/charts.md) word them.
pub const BARS_QUESTION: &str = "Which run moves the KV fastest, and do its rounds agree? Throughput per run: the median \
     of its rounds, whiskers from the slowest round to the fastest, a dot per round.";
/// The questions of the charts per run (`what`: run or point).
fn e2e_question(what: &str) -> String {
    format!(
        "How do the {what}s' requests compare end to end? One line per {what} (all its requests), rising at each request."
    )
}
fn span_question(what: &str) -> String {
    format!(
        "Is the difference in the transfer? The transfer's wall span over the decode ranks, one line per {what}."
    )
}
fn e2e_span_question(what: &str) -> String {
    format!(
        "How do the {what}s' requests compare end to end? One line per {what} (all its requests); each {what}'s \
         transfer span lies on its end to end, so it is drawn once."
    )
}
fn medians_question(what: &str) -> String {
    format!(
        "Where does each {what}'s median request spend its time? One panel per {what}, all on the same time axis, \
         so the longer bar is the slower stage."
    )
}
pub const SWEEP_QUESTION: &str = "How do bandwidth and transfer latency follow the swept setting? One line per series; \
     dashed crosses: the time the --rates model predicted.";
pub const SIZE_QUESTION: &str = "How does bandwidth follow the message size UCX sees (bytes per descriptor)?";
pub const GATE_QUESTION: &str = "Which metric moved, and did it cross its threshold? Each relative metric's change \
     against the baseline (right = worse), its threshold a red tick, the noise the gate cannot see through grey.";
pub const GATE_CDF_QUESTION: &str = "Did the whole distribution move, or only its middle? Baseline and current \
     latencies through their percentiles (min, p50, p90, p99, max).";
pub const GATE_BARS_QUESTION: &str = "How fast was each run, raw (before normalising by the machine's speed)? \
     Throughput, whiskers over the repeats.";

/// The page's head: started, requests, partial; warnings and notes.
fn head(p: &mut Page, s: &Summary, what: &str) {
    let mut head = format!(
        "Started {}, {what}: {} requests ok, {} failed, {} s measured.",
        s.started_at,
        s.requests_ok,
        s.requests_failed,
        fmt_f(s.duration_s)
    );
    if s.partial {
        head.push_str(" PARTIAL: the run did not finish.");
    }
    p.p(&head);
    for w in &s.warnings {
        p.warn(&format!("WARNING: {w}"));
    }
    for n in &s.notes {
        p.p(&format!("Note: {n}"));
    }
}

/// The comparison's table from its summary: each run's figures (medians over its rounds), its
/// rounds' throughputs, and its throughput against the first run's.
fn compare_table(s: &Summary) -> comfy_table::Table {
    let mut t = new_table(
        Style::Markdown,
        &[
            "run",
            "GB/s",
            "rounds' GB/s",
            "vs first",
            "transfer p50 ms",
            "e2e p50 ms",
            "KV ready p50 ms",
            "descriptors/request",
            "CPU s per GB",
            "requests ok",
            "failed",
        ],
    );
    let points = s.sweep.as_deref().unwrap_or_default();
    let first = points.first().map_or(0.0, |p| p.throughput_gbps);
    let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |us| format!("{:.3}", us / 1e3));
    for p in points {
        let num = |k: &str| p.params.get(k).and_then(serde_json::Value::as_f64);
        let vs = match (num("ratio_to_first"), num("ratio_to_first_min"), num("ratio_to_first_max")) {
            (Some(m), Some(lo), Some(hi)) => format!("{m:.2}x ({lo:.2}-{hi:.2})"),
            (Some(m), _, _) => format!("{m:.2}x"),
            _ if first > 0.0 => format!("{:.2}x", p.throughput_gbps / first),
            _ => "-".into(),
        };
        let rounds = p
            .params
            .get("round_gbps")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).map(fmt_f).collect::<Vec<_>>().join(", "))
            .unwrap_or_else(|| "-".into());
        t.add_row(vec![
            p.label.clone(),
            format!("{:.3}", p.throughput_gbps),
            rounds,
            vs,
            ms(p.transfer_p50_us),
            ms(p.e2e_p50_us),
            ms(p.kv_ready_p50_us),
            p.descriptors_per_request.map_or_else(|| "-".into(), |d| format!("{:.0}", d.raw)),
            num("cpu_s_per_gb").map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            p.requests_ok.to_string(),
            p.requests_failed.to_string(),
        ]);
    }
    t
}

/// A chart of a page: its figure id, the question it answers, its SVG (`None`: no data).
type Figure = (&'static str, String, Option<String>);

/// The charts of runs drawn side by side, as (figure id and file name, question, SVG):
/// latency CDFs of every run overlaid (end to end, transfer span), and each run's median
/// request on one time axis. Empty where there are no runs or more than [`MAX_SERIES`].
fn per_run_charts(runs: &[NamedRun], what: &str) -> Result<Vec<Figure>, ReportError> {
    if runs.is_empty() || runs.len() > MAX_SERIES {
        return Ok(Vec::new());
    }
    let e2e = stage_cdfs(runs, Stage::E2e, "");
    let span = stage_cdfs(runs, Stage::TransferSpan, "");
    let span = if span.is_empty() { stage_cdfs(runs, Stage::Transfer, "") } else { span };
    let medians = (
        "request-waterfall",
        medians_question(what),
        run_charts::timelines_svg(&median_timelines(runs), true)?,
    );
    // Where every run's transfer is its end to end, one chart says both.
    let same = e2e.len() == span.len()
        && e2e.iter().zip(&span).all(|(a, b)| run_charts::coincide(&a.points, &b.points));
    if same {
        let title = format!("End-to-end latency (= the transfer span), one line per {what}");
        return Ok(vec![("latency", e2e_span_question(what), run_charts::cdf_svg(&title, &e2e)?), medians]);
    }
    Ok(vec![
        (
            "latency",
            e2e_question(what),
            run_charts::cdf_svg(&format!("End-to-end latency, one line per {what}"), &e2e)?,
        ),
        (
            "transfer-span",
            span_question(what),
            run_charts::cdf_svg(&format!("Transfer span, one line per {what}"), &span)?,
        ),
        medians,
    ])
}

/// The charts a comparison's or a sweep's directory holds, the same its page draws, by figure
/// id (`files.rs` names their files): `compare-throughput` or `sweep` (and
/// `bandwidth-vs-size`), then `latency`, `transfer-span`, `request-waterfall` where drawn.
pub fn side_charts(
    s: &Summary,
    rows: &[RequestRow],
) -> Vec<(&'static str, Result<Option<String>, ReportError>)> {
    let mut out: Vec<(&'static str, Result<Option<String>, ReportError>)> = Vec::new();
    if comparison_flag(s).is_some() {
        out.push(("compare-throughput", range_bars_svg("Throughput per run", "GB/s", &compare_bars(s))));
    } else {
        out.push(("sweep", sweep_setting_svg(s)));
        if size_matters(s) {
            out.push(("bandwidth-vs-size", chart::sweep_svg(s)));
        }
    }
    let what = if comparison_flag(s).is_some() { "run" } else { "point" };
    match per_run_charts(&split_runs(s, rows), what) {
        Ok(charts) => out.extend(charts.into_iter().map(|(id, _, svg)| (id, Ok(svg)))),
        Err(e) => out.push(("latency", Err(e))),
    }
    out
}

/// Whether a sweep's points differ in the bytes per descriptor (the message size UCX sees):
/// then bandwidth against it is worth a chart of its own.
fn size_matters(s: &Summary) -> bool {
    let (series, x) = chart::sweep_series(s);
    let mut xs: Vec<f64> = series.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    x.starts_with("bytes") && xs.len() > 1
}

/// The page of a comparison (`kvx bench --compare-transports|--compare-modes|
/// --compare-kv-buffer-device`): its table, throughput per run with the rounds' range, the
/// runs' latency CDFs overlaid, each run's median request, outcomes, scenario and environment.
/// `request`: also draw this request's waterfall.
pub fn compare_page(s: &Summary, rows: &[RequestRow], request: Option<&str>) -> Result<String, ReportError> {
    let name = comparison_flag(s).unwrap_or("comparison");
    let mut p = Page::default();
    p.h1(&format!("kvx bench --{name} run {}", s.run_id));
    let points = s.sweep.as_deref().unwrap_or_default();
    let rounds = points
        .iter()
        .filter_map(|x| x.params.get("rounds").and_then(serde_json::Value::as_u64))
        .max()
        .unwrap_or(1);
    let names: Vec<&str> = points.iter().map(|x| x.label.as_str()).collect();
    let what = if rounds > 1 {
        format!(
            "{} runs ({}) on the same workload, {rounds} rounds (the runs interleaved, their order reversed every \
             other round; figures are medians over the rounds)",
            names.len(),
            names.join(", ")
        )
    } else {
        format!("{} runs ({}) on the same workload", names.len(), names.join(", "))
    };
    head(&mut p, s, &what);
    p.h2("The comparison");
    p.body.push_str(&table_html(&compare_table(s)));
    p.p(
        "vs first: the run's throughput over the first run's (with several rounds, the median of the rounds' \
         ratios and their range). Latencies are the medians over the rounds of each round's p50.",
    );
    p.h2("Throughput");
    p.figure(
        "compare-throughput",
        BARS_QUESTION,
        range_bars_svg("Throughput per run", "GB/s", &compare_bars(s))?,
    );
    let runs = split_runs(s, rows);
    side_by_side(&mut p, &runs, "run")?;
    if let Some(id) = request {
        p.figure("request", WATERFALL_QUESTION, run_charts::waterfall_svg(rows, Some(id))?);
    }
    p.h2("Outcomes and verification");
    p.body.push_str(&table_html(&failures_table(s, Style::Markdown)));
    p.h2("Scenario and environment");
    p.p("The first run's scenario; the runs differ only in the setting compared.");
    p.body.push_str(&table_html(&scenario_table(s, Style::Markdown)));
    Ok(p.finish(&format!("kvx {name} {}", s.run_id)))
}

/// The latency CDFs and median requests of runs side by side, or why they are not drawn.
fn side_by_side(p: &mut Page, runs: &[NamedRun], what: &str) -> Result<(), ReportError> {
    p.h2(&format!("Each {what} side by side"));
    if runs.iter().all(|r| r.rows.is_empty()) {
        p.p(&format!("No request rows: the directory's requests.csv holds no {what}'s requests."));
        return Ok(());
    }
    if runs.len() > MAX_SERIES {
        p.p(&format!(
            "{} {what}s: more than {MAX_SERIES} lines would hide each other, so no chart per {what}; the table and \
             the chart above hold every one.",
            runs.len()
        ));
        return Ok(());
    }
    for (id, question, svg) in per_run_charts(runs, what)? {
        p.figure(id, &question, svg);
    }
    Ok(())
}

/// The sweep's part of its page: its figures against the swept setting (and bandwidth against
/// the message size where that varies), its table, its points side by side.
pub(crate) fn sweep_sections(
    p: &mut Page,
    s: &Summary,
    rows: &[RequestRow],
    request: Option<&str>,
) -> Result<(), ReportError> {
    p.h2("The sweep");
    p.figure("sweep", SWEEP_QUESTION, sweep_setting_svg(s)?);
    if size_matters(s) {
        p.figure("bandwidth-vs-size", SIZE_QUESTION, chart::sweep_svg(s)?);
    }
    if let Some(t) = sweep_table(s, Style::Markdown) {
        p.table("Points", &t);
    }
    side_by_side(p, &split_runs(s, rows), "point")?;
    if let Some(id) = request {
        p.figure("request", WATERFALL_QUESTION, run_charts::waterfall_svg(rows, Some(id))?);
    }
    Ok(())
}

/// A run's latency CDFs for a comparison of two: from its requests where it has them, else its
/// summary's percentiles.
fn run_cdfs(tag: &str, s: &Summary, rows: &[RequestRow]) -> Vec<Cdf> {
    let mut out = Vec::new();
    for stage in [Stage::E2e, Stage::TransferSpan] {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.outcome == RequestOutcome::Ok)
            .filter_map(|r| r.stage_us(stage))
            .filter(|v| v.is_finite() && *v >= 0.0)
            .collect();
        let name = format!("{tag} {}", stage.as_str());
        if !v.is_empty() {
            out.push(sample_cdf(&name, v));
        } else if let Some(st) = s.stages.get(stage.as_str()).filter(|x| x.count > 0) {
            out.push(percentile_cdf(&name, st));
        }
    }
    out
}

/// Interleaves two runs' CDFs stage by stage: A's e2e, B's e2e, A's span, B's span.
fn interleave(a: Vec<Cdf>, b: Vec<Cdf>) -> Vec<Cdf> {
    let mut out = Vec::new();
    let (mut a, mut b) = (a.into_iter(), b.into_iter());
    loop {
        match (a.next(), b.next()) {
            (None, None) => break,
            (x, y) => out.extend(x.into_iter().chain(y)),
        }
    }
    out.truncate(MAX_SERIES);
    out
}

/// The page of two saved runs (`kvx report A B --html`): throughput, latency CDFs overlaid,
/// both median requests on one time axis, the comparison table, both scenarios.
pub fn pair_page(
    a: (&Summary, &[RequestRow]),
    b: (&Summary, &[RequestRow]),
    c: &Comparison,
) -> Result<String, ReportError> {
    let mut p = Page::default();
    p.h1(&format!("kvx report: B {} against A {}", b.0.run_id, a.0.run_id));
    for (tag, (s, rows)) in [("A", a), ("B", b)] {
        p.p(&format!(
            "{tag}: {} run {}, started {}, {} requests ok, {} failed{}.",
            s.run_kind(),
            s.run_id,
            s.started_at,
            s.requests_ok,
            s.requests_failed,
            if rows.is_empty() { " (no requests.csv: its percentiles are drawn)" } else { "" }
        ));
    }
    for n in &c.notes {
        p.p(&format!("Note: {n}"));
    }
    p.h2("Throughput");
    let bars: Vec<RangeBar> = vec![run_bar("A", a.0), run_bar("B", b.0)];
    p.figure(
        "compare-throughput",
        "Which run moved the KV faster? Throughput, whiskers over the repeats where a run has several.",
        range_bars_svg("Throughput, A and B", "GB/s", &bars)?,
    );
    p.h2("Distributions");
    let cdfs = interleave(run_cdfs("A", a.0, a.1), run_cdfs("B", b.0, b.1));
    p.figure(
        "latency",
        "How do the two runs' latencies compare? End to end and the transfer span, A and B, one line each.",
        run_charts::cdf_svg("Latency, A and B", &cdfs)?,
    );
    let runs = [
        NamedRun { name: "A".into(), rows: a.1.to_vec() },
        NamedRun { name: "B".into(), rows: b.1.to_vec() },
    ];
    p.figure(
        "request-waterfall",
        &medians_question("run"),
        run_charts::timelines_svg(&median_timelines(&runs), true)?,
    );
    p.h2("The comparison");
    p.body.push_str(&table_html(&super::compare::table(c, Style::Markdown)));
    p.h2("Scenario and environment");
    for (tag, (s, _)) in [("A", a), ("B", b)] {
        p.table(&format!("{tag}: {}", s.run_id), &scenario_table(s, Style::Markdown));
    }
    Ok(p.finish(&format!("kvx report {} vs {}", b.0.run_id, a.0.run_id)))
}

/// The page of a gate verdict (`kvx gate --html-file FILE`): the verdict and what it rests on, the
/// metric table, each metric's change with its threshold, the latency distributions and the
/// throughput of baseline and current, the current run's scenario.
pub fn gate_page(r: &GateReport, baseline: &Summary, current: &Summary) -> Result<String, ReportError> {
    let mut p = Page::default();
    let verdict = match r.verdict {
        Verdict::Pass => "PASS",
        Verdict::Regression => "REGRESSION",
    };
    p.h1(&format!("kvx gate: {verdict}"));
    p.p(&format!(
        "Current run {} ({}) against baseline {} ({}).",
        r.current_run, r.current, r.baseline_run, r.baseline
    ));
    let lines = summary_lines(r);
    for (i, l) in lines.iter().enumerate() {
        if i + 1 == lines.len() && r.verdict == Verdict::Regression {
            p.warn(l);
        } else {
            p.p(l);
        }
    }
    for n in &r.notes {
        p.p(&format!("Note: {n}"));
    }
    p.h2("The verdict");
    p.body.push_str(&table_html(&metric_table(r, Style::Markdown)));
    p.figure("gate-change", GATE_QUESTION, gate_change_svg(r)?);
    p.h2("Baseline and current side by side");
    let cdfs = |tag: &str, s: &Summary| -> Vec<Cdf> {
        [Stage::E2e, Stage::Transfer]
            .iter()
            .filter_map(|st| {
                s.stages
                    .get(st.as_str())
                    .filter(|x| x.count > 0)
                    .map(|x| percentile_cdf(&format!("{tag} {}", st.as_str()), x))
            })
            .collect()
    };
    let series = interleave(cdfs("baseline", baseline), cdfs("current", current));
    p.figure("latency", GATE_CDF_QUESTION, run_charts::cdf_svg("Latency, baseline and current", &series)?);
    let bars = vec![run_bar("baseline", baseline), run_bar("current", current)];
    p.figure("compare-throughput", GATE_BARS_QUESTION, range_bars_svg("Throughput, raw", "GB/s", &bars)?);
    p.h2("Scenario and environment (current run)");
    p.body.push_str(&table_html(&scenario_table(current, Style::Markdown)));
    Ok(p.finish(&format!("kvx gate {verdict} {}", r.current_run)))
}

/// The page of a gate that could not decide (exit 2): the reason, nothing else.
pub fn gate_error_page(message: &str) -> String {
    let mut p = Page::default();
    p.h1("kvx gate: error");
    p.warn("The gate could not decide (exit 2):");
    p.p(message);
    p.finish("kvx gate error")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::report::page::check_page;
    use crate::report::summary::{RankRead, RankReads, Scenario, StageStats, SweepPoint};

    fn figures(outline: &str) -> Vec<&str> {
        outline.lines().filter_map(|l| l.trim().strip_prefix("figure #")).collect()
    }

    fn row(parent: &str, sub: &str, n: u32, k: f64) -> RequestRow {
        RequestRow {
            request_id: format!("cmpl-{parent}-{sub}-{n}-0"),
            bytes: 1_000_000,
            queue_us: Some(5.0),
            plan_us: Some(3.0),
            post_us: Some(10.0 * k),
            transfer_us: Some(300.0 * k),
            transfer_span_us: Some(340.0 * k),
            notify_us: Some(12.0),
            e2e_us: Some(380.0 * k),
            verify_us: Some(100.0),
            rank_reads: RankReads(vec![RankRead {
                rank: 0,
                start_us: Some(0.0),
                read_us: 300.0 * k,
                bytes: 1_000_000,
            }]),
            ..Default::default()
        }
    }

    fn point(label: &str, params: serde_json::Value, gbps: f64) -> SweepPoint {
        let params: BTreeMap<String, serde_json::Value> =
            serde_json::from_value(params).expect("params are a map");
        SweepPoint {
            label: label.into(),
            params,
            throughput_gbps: gbps,
            transfer_p50_us: Some(1000.0 / gbps),
            e2e_p50_us: Some(1200.0 / gbps),
            requests_ok: 12,
            ..Default::default()
        }
    }

    #[test]
    fn a_comparison_has_its_own_page() {
        let mut s = Summary::new(
            "P",
            "t",
            Scenario { name: Some("compare-transports".into()), ..Default::default() },
        );
        s.sweep = Some(vec![
            point(
                "ucx",
                json!({"transport": "ucx", "rounds": 3, "round_gbps": [2.0, 2.2, 2.1], "ratio_to_first": 1.0,
                       "ratio_to_first_min": 1.0, "ratio_to_first_max": 1.0, "cpu_s_per_gb": 0.5}),
                2.1,
            ),
            point(
                "storage",
                json!({"transport": "storage", "rounds": 3, "round_gbps": [0.9, 1.1, 1.0], "ratio_to_first": 0.48,
                       "ratio_to_first_min": 0.45, "ratio_to_first_max": 0.5, "cpu_s_per_gb": 1.5}),
                1.0,
            ),
        ]);
        s.requests_ok = 24;
        let mut rows = Vec::new();
        for r in 1..=3 {
            for (name, k) in [("ucx", 1.0), ("storage", 2.0)] {
                rows.extend((0..4).map(|n| row("P", &format!("{name}-r{r}"), n, k + f64::from(n) * 0.2)));
            }
        }
        assert_eq!(comparison_flag(&s), Some("compare-transports"));
        let html = crate::report::html::page(&s, &rows, None).expect("page");
        let outline = check_page(&html);
        assert_eq!(
            figures(&outline),
            vec!["compare-throughput", "latency", "transfer-span", "request-waterfall"]
        );
        assert!(html.contains("0.48x (0.45-0.50)"), "the rounds' ratio and its range");
        assert!(html.contains("ucx: median request") && html.contains("storage: median request"));
        insta::assert_snapshot!("compare_page_outline", outline);
        // A sweep file that happens to be named like a comparison is still a sweep.
        let mut sweep = s.clone();
        for p in sweep.sweep.iter_mut().flatten() {
            p.params.remove("transport");
        }
        assert_eq!(comparison_flag(&sweep), None);
    }

    #[test]
    fn a_sweep_page_leads_with_its_setting_and_its_points_side_by_side() {
        let mut s = Summary::new("S", "t", Scenario { name: Some("conc".into()), ..Default::default() });
        let pts: Vec<SweepPoint> = [1, 2, 4]
            .iter()
            .map(|c| {
                let mut p = point(&format!("concurrency={c}"), json!({"concurrency": c}), f64::from(*c));
                p.predicted_span_p50_us = Some(300.0);
                p.measured_span_p50_us = Some(320.0 * f64::from(*c));
                p
            })
            .collect();
        s.sweep = Some(pts.clone());
        let rows: Vec<RequestRow> = (0..3)
            .flat_map(|i| (0..5).map(move |n| row("S", &format!("p{i}"), n, 1.0 + f64::from(i))))
            .collect();
        let html = crate::report::html::page(&s, &rows, None).expect("page");
        let outline = check_page(&html);
        assert_eq!(figures(&outline), vec!["sweep", "latency", "transfer-span", "request-waterfall"]);
        insta::assert_snapshot!("sweep_page_outline", outline);
        // Seven points: no chart per point (more than six lines), the sweep chart still.
        s.sweep = Some((0..7).map(|i| point(&format!("p{i}"), json!({"concurrency": i + 1}), 1.0)).collect());
        let rows: Vec<RequestRow> = (0..7).map(|i| row("S", &format!("p{i}"), 0, 1.0)).collect();
        let html = crate::report::html::page(&s, &rows, None).expect("page");
        assert_eq!(figures(&check_page(&html)), vec!["sweep"]);
        assert!(html.contains("7 points: more than 6 lines"), "says why");
    }

    #[test]
    fn two_runs_side_by_side() {
        let mut a = Summary::new("A1", "t", Scenario::default());
        let mut b = Summary::new("B1", "t", Scenario::default());
        a.throughput_gbps = 2.0;
        b.throughput_gbps = 1.5;
        // B has no requests.csv: its percentiles are drawn.
        b.stages.insert(
            "e2e".into(),
            StageStats {
                count: 9,
                min_us: 300.0,
                p50_us: 500.0,
                p90_us: 600.0,
                p99_us: 700.0,
                max_us: 800.0,
                ..Default::default()
            },
        );
        let rows: Vec<RequestRow> = (0..10).map(|n| row("A1", "x", n, 1.0 + f64::from(n) / 10.0)).collect();
        let c = crate::report::compare::compare(&a, &b);
        let html = pair_page((&a, &rows), (&b, &[]), &c).expect("page");
        let outline = check_page(&html);
        assert_eq!(figures(&outline), vec!["compare-throughput", "latency", "request-waterfall"]);
        for want in ["A e2e", "B e2e", "A transfer_span", "no requests.csv"] {
            assert!(html.contains(want), "{want}");
        }
        insta::assert_snapshot!("pair_page_outline", outline);
    }

    #[test]
    fn a_gate_verdict_has_a_page() {
        use crate::report::gate::fixtures::{doc, gate};
        let (bd, cd) = (doc(&[10.0, 10.1, 9.9], 10.0), doc(&[8.0, 8.1, 7.9], 10.0));
        let r = gate(&bd, &cd);
        // A gate fixture lacks most fields: laid over an empty summary's, as the CLI reads it.
        let read = |v: &serde_json::Value| {
            let mut all = serde_json::to_value(Summary::new("", "", Scenario::default())).expect("json");
            for (k, x) in v.as_object().expect("an object") {
                all[k] = x.clone();
            }
            serde_json::from_value::<Summary>(all).expect("summary")
        };
        let html = gate_page(&r, &read(&bd), &read(&cd)).expect("page");
        let outline = check_page(&html);
        assert_eq!(figures(&outline), vec!["gate-change", "latency", "compare-throughput"]);
        assert!(
            html.contains("<h1>kvx gate: REGRESSION</h1>")
                && html.contains("class=\"warn\">verdict: REGRESSION")
        );
        insta::assert_snapshot!("gate_page_outline", outline);
        let err = gate_error_page("metric `x` is <missing>");
        check_page(&err);
        assert!(err.contains("metric `x` is &lt;missing&gt;"));
    }
}
