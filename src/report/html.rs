//! `report.html`: one run on one page, the charts inline (SVG) beside the tables, the scenario
//! and the environment.
//!
//! Self-contained: no script, no stylesheet, font or image from elsewhere, so the page opens
//! offline and prints. The page is well-formed XML (void elements closed, text escaped), so a
//! plain XML parser checks it. Pure: a function of the summary and the request rows; `files.rs`
//! writes it. The HTML itself (escaping, tables, figures, the document) is `page`'s.

use super::ReportError;
use super::page::{
    LATENCY_QUESTION, Page, RANK_QUESTION, TIME_QUESTION, WATERFALL_QUESTION, escape, table_html,
};
use super::run_charts;
use super::summary::{RequestRow, Summary, vllm_metrics_line};
use super::table::{
    Style, bandwidth_table, failures_table, goodput_table, hybrid_parts_table, per_rank_table, repeats_table,
    scenario_table, stage_table, throughput_table, waterfall_table,
};

/// The whole page of one run. `request`: a request id (or its number) whose waterfall to draw
/// instead of the median and p99 requests'. A comparison (`--compare-*`) has a page of its own
/// ([`super::pages::compare_page`]); a sweep's page leads with its figures against the swept
/// setting and its points side by side.
pub fn page(summary: &Summary, rows: &[RequestRow], request: Option<&str>) -> Result<String, ReportError> {
    if super::pages::comparison_flag(summary).is_some() {
        return super::pages::compare_page(summary, rows, request);
    }
    let s = summary;
    let st = Style::Markdown;
    let mut p = Page::default();
    let kind = if s.sweep.is_some() { "kvx bench --sweep" } else { s.run_kind() };
    p.h1(&format!("{kind} run {}", s.run_id));
    let mut head = format!(
        "Started {}, {} s measured, {} requests ok, {} failed, {} recomputed.",
        s.started_at,
        super::numbers::fmt_f(s.duration_s),
        s.requests_ok,
        s.requests_failed,
        s.requests_recomputed
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
    if s.sweep.is_some() {
        super::pages::sweep_sections(&mut p, s, rows, request)?;
    } else {
        run_sections(&mut p, s, rows, request)?;
    }
    p.h2("Figures");
    if s.measured_kv() {
        p.table("Throughput, bytes, descriptors", &throughput_table(s, st));
        if let (Some(t), Some(b)) = (bandwidth_table(s, st), &s.transfer_bandwidth) {
            p.table("Transfer bandwidth", &t);
            p.p(&format!("clock: {}", b.clock));
        }
    }
    p.table("Outcomes and verification", &failures_table(s, st));
    if let Some(t) = hybrid_parts_table(s, st) {
        p.table("KV cache groups and parts (per request, every decode rank)", &t);
    }
    if let Some(t) = per_rank_table(s, st) {
        p.table("Per rank", &t);
    }
    if let Some(t) = repeats_table(s, st) {
        p.table("Repeats", &t);
    }
    if let Some(line) = vllm_metrics_line(s).filter(|_| s.measured_kv()) {
        p.body.push_str(&format!("<p><code>{}</code></p>\n", escape(&line)));
    }
    p.h2("Scenario and environment");
    p.body.push_str(&table_html(&scenario_table(s, st)));
    Ok(p.finish(&format!("kvx {}", s.run_id)))
}

/// One run's charts: a request stage by stage, the distributions, the run over time.
fn run_sections(
    p: &mut Page,
    s: &Summary,
    rows: &[RequestRow],
    request: Option<&str>,
) -> Result<(), ReportError> {
    let st = Style::Markdown;
    p.h2("One request, stage by stage");
    p.figure("waterfall", WATERFALL_QUESTION, run_charts::waterfall_svg(rows, request)?);
    p.h2("Distributions");
    p.figure("latency", LATENCY_QUESTION, run_charts::latency_svg(s, rows)?);
    p.figure("rank-bandwidth", RANK_QUESTION, run_charts::rank_bandwidth_svg(rows)?);
    if !s.stages.is_empty() {
        p.table("Latency by stage", &stage_table(s, st));
    }
    if let Some(w) = &s.waterfall {
        p.figure("ttft-waterfall", "Where did the time to first token go?", super::chart::waterfall_svg(s)?);
        p.table("TTFT waterfall", &waterfall_table(w, st));
    }
    if let Some(g) = &s.goodput {
        p.table("Goodput", &goodput_table(g, st));
    }
    p.h2("The run over time");
    p.figure("over-time", TIME_QUESTION, run_charts::throughput_svg(s, rows)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::{RankRead, RankReads, Scenario, StageStats};

    fn rows() -> Vec<RequestRow> {
        (0..40u32)
            .map(|i| {
                let k = 1.0 + f64::from(i % 7) / 7.0;
                RequestRow {
                    request_id: format!("cmpl-r-{i}-0"),
                    start_offset_us: f64::from(i) * 80_000.0,
                    bytes: 1 << 20,
                    queue_us: Some(3.0),
                    plan_us: Some(2.0),
                    post_us: Some(9.0),
                    transfer_us: Some(200.0 * k),
                    transfer_span_us: Some(230.0 * k),
                    notify_us: Some(11.0),
                    e2e_us: Some(260.0 * k),
                    rank_reads: RankReads(vec![
                        RankRead { rank: 0, start_us: Some(0.0), read_us: 200.0 * k, bytes: 1 << 19 },
                        RankRead { rank: 1, start_us: Some(30.0), read_us: 190.0 * k, bytes: 1 << 19 },
                    ]),
                    ..Default::default()
                }
            })
            .collect()
    }

    /// What a reader finds on the page: headings, figure captions and table headers.
    fn outline(html: &str) -> String {
        let doc = roxmltree::Document::parse_with_options(
            html,
            roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() },
        )
        .expect("the page is well-formed");
        let text = |n: roxmltree::Node<'_, '_>| {
            n.descendants()
                .filter(|d| d.is_text())
                .filter_map(|d| d.text())
                .flat_map(str::split_whitespace)
                .collect::<Vec<_>>()
                .join(" ")
        };
        doc.descendants()
            .filter(|n| n.is_element())
            .filter_map(|n| match n.tag_name().name() {
                t @ ("h1" | "h2" | "h3") => Some(format!("{t}: {}", text(n))),
                "figure" => Some(format!("figure #{}", n.attribute("id").unwrap_or(""))),
                "thead" => Some(format!("  table: {}", text(n))),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn the_page_holds_every_chart_inline_and_nothing_from_elsewhere() {
        let mut s = Summary::new("r1", "2026-01-02T03:04:05Z", Scenario::default());
        s.duration_s = 3.2;
        s.requests_ok = 40;
        s.bytes_read = 40 << 20;
        s.stages.insert("e2e".into(), StageStats { count: 40, p50_us: 300.0, ..Default::default() });
        s.warnings.push("a <warning> & more".into());
        let html = page(&s, &rows(), None).expect("page");
        crate::report::page::check_page(&html);
        assert!(html.len() < 2_000_000, "{} bytes", html.len());
        let lower = html.to_lowercase();
        for banned in ["<script", "<link", "<img", "<iframe", "@import", "url(", "src=", "href="] {
            assert!(!lower.contains(banned), "{banned} in the page");
        }
        // The only addresses are the SVG namespace names.
        let external = lower.matches("http").count();
        assert_eq!(
            external,
            lower.matches("http://www.w3.org/2000/svg").count(),
            "addresses other than xmlns"
        );
        assert!(html.contains("a &lt;warning&gt; &amp; more"));
        insta::assert_snapshot!("report_page_outline", outline(&html));
    }

    #[test]
    fn an_unknown_request_is_an_error_that_names_one() {
        let s = Summary::new("r1", "t", Scenario::default());
        let e = page(&s, &rows(), Some("999")).expect_err("unknown");
        assert!(e.to_string().contains("cmpl-r-0-0"), "{e}");
        assert!(page(&s, &rows(), Some("3")).expect("by number").contains("request cmpl-r-3-0"));
    }
}
