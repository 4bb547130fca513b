//! The charts of one run that a person reads at a glance (plotters, SVG backend only):
//!
//! - [`waterfall_svg`]: where one request spent its time, its stages laid end to end on its own
//!   timeline (the median and the p99 request by end-to-end latency, or any request by id),
//!   each decode rank's reads a lane of their own, verification apart.
//! - [`latency_svg`]: the end-to-end and transfer latencies as CDFs on an axis spread over the
//!   samples; stages that coincide are drawn once.
//! - [`rank_bandwidth_svg`]: each decode rank's own bandwidth per request, a box and its
//!   samples per rank, beside the request's bandwidth over its wall span.
//! - [`throughput_svg`]: completions and bandwidth over the run in buckets sized to it, with
//!   the warm-up, faults and lease expiries marked.
//!
//! Pure functions of the summary and the request rows: each returns the SVG text, or `None`
//! where the run has no data for the chart. No file I/O (`files.rs` writes them).

use plotters::prelude::*;

use super::ReportError;
use super::chart::colour;
use super::numbers::fmt_f;
use super::summary::{RequestOutcome, RequestRow, RunEvent, Stage, Summary};

/// At most this many series in one chart.
pub const MAX_SERIES: usize = 6;

const WIDTH: u32 = 960;

fn err(chart: &'static str) -> impl Fn(String) -> ReportError {
    move |reason| ReportError::Chart { chart, reason }
}

/// A duration in microseconds as a person reads it: `812 us`, `1.25 ms`, `2.50 s`.
pub fn fmt_us(us: f64) -> String {
    if us >= 1e6 {
        format!("{} s", fmt_f(us / 1e6))
    } else if us >= 1e3 {
        format!("{} ms", fmt_f(us / 1e3))
    } else {
        format!("{} us", fmt_f(us))
    }
}

// ---- The stage waterfall of one request. ----

/// One bar of a request's timeline: a lane, where it starts and how long it lasts (us from
/// the request's arrival).
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub lane: String,
    pub start_us: f64,
    pub dur_us: f64,
}

/// A request's stages laid end to end: queue, handshake (if it had one), plan, then the
/// transfer (post, the wall span, each decode rank's reads from their own start), then
/// notify. Each stage is the slowest rank's. `apart`: verification, outside the timed path.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// What picked it: `median request`, `p99 request`, `request <id>`.
    pub label: String,
    pub request_id: String,
    pub e2e_us: Option<f64>,
    pub bars: Vec<Bar>,
    pub apart: Vec<Bar>,
}

/// The timeline of one request row.
pub fn timeline(label: &str, row: &RequestRow) -> Timeline {
    let mut bars = Vec::new();
    let mut t = 0.0;
    let push = |bars: &mut Vec<Bar>, lane: &str, start: f64, dur: Option<f64>| {
        let dur = dur.filter(|d| d.is_finite() && *d >= 0.0)?;
        bars.push(Bar { lane: lane.to_string(), start_us: start, dur_us: dur });
        Some(dur)
    };
    t += push(&mut bars, "queue", t, row.queue_us).unwrap_or(0.0);
    t += push(&mut bars, "handshake", t, row.handshake_us.filter(|h| *h > 0.0)).unwrap_or(0.0);
    t += push(&mut bars, "plan", t, row.plan_us).unwrap_or(0.0);
    // The transfer runs from posting to the last read; posting is its first part.
    push(&mut bars, "post", t, row.post_us);
    let span = match row.transfer_span_us {
        Some(s) => push(&mut bars, "transfer span", t, Some(s)),
        None => push(&mut bars, "transfer", t, row.transfer_us),
    };
    for r in &row.rank_reads.0 {
        push(&mut bars, &format!("read d{}", r.rank), t + r.start_us.unwrap_or(0.0), Some(r.read_us));
    }
    t += span.unwrap_or(0.0);
    t += push(&mut bars, "notify", t, row.notify_us).unwrap_or(0.0);
    let mut apart = Vec::new();
    push(&mut apart, "verify (not timed)", t, row.verify_us);
    Timeline { label: label.to_string(), request_id: row.request_id.clone(), e2e_us: row.e2e_us, bars, apart }
}

/// Whether a request id names this row: the whole id, or the request's number in it
/// (`cmpl-<run>-17-0` is request 17).
fn id_matches(row: &RequestRow, id: &str) -> bool {
    row.request_id == id || row.request_id.rsplit('-').nth(1) == Some(id)
}

/// The requests a waterfall shows: the one asked for by id, else the median and the p99
/// request by end-to-end latency (nearest rank; one when they are the same request).
pub fn pick_requests(rows: &[RequestRow], request: Option<&str>) -> Result<Vec<Timeline>, ReportError> {
    if let Some(id) = request {
        let row = rows.iter().find(|r| id_matches(r, id)).ok_or_else(|| ReportError::UnknownRequest {
            id: id.to_string(),
            example: rows
                .first()
                .map_or_else(|| "(the run has no request rows)".into(), |r| r.request_id.clone()),
        })?;
        return Ok(vec![timeline(&format!("request {}", row.request_id), row)]);
    }
    let mut ok: Vec<&RequestRow> = rows
        .iter()
        .filter(|r| r.outcome == RequestOutcome::Ok && r.e2e_us.is_some_and(f64::is_finite))
        .collect();
    ok.sort_by(|a, b| a.e2e_us.unwrap_or(0.0).total_cmp(&b.e2e_us.unwrap_or(0.0)));
    let n = ok.len();
    let mut out: Vec<Timeline> = Vec::new();
    let mut seen: Vec<usize> = Vec::new();
    for (label, q) in [("median request", 0.5), ("p99 request", 0.99)] {
        if n == 0 {
            break;
        }
        let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
        if !seen.contains(&i) {
            seen.push(i);
            out.push(timeline(label, ok[i]));
        }
    }
    Ok(out.into_iter().filter(|t| !t.bars.is_empty()).collect())
}

/// The lane's colour: stages keep theirs, every rank's reads share one.
fn lane_colour(lane: &str) -> RGBColor {
    match lane {
        "queue" => RGBColor(127, 127, 127),
        "handshake" => RGBColor(148, 103, 189),
        "plan" => RGBColor(140, 86, 75),
        "post" => RGBColor(255, 127, 14),
        "transfer span" | "transfer" => RGBColor(31, 119, 180),
        "notify" => RGBColor(44, 160, 44),
        l if l.starts_with("read") => RGBColor(23, 190, 207),
        _ => RGBColor(188, 189, 34),
    }
}

/// The stage waterfall: one panel per picked request (see [`pick_requests`]).
pub fn waterfall_svg(rows: &[RequestRow], request: Option<&str>) -> Result<Option<String>, ReportError> {
    timelines_svg(&pick_requests(rows, request)?, false)
}

/// Where a timeline ends: its last bar, or its end to end where that is later (us).
fn timeline_end(t: &Timeline) -> f64 {
    t.bars.iter().chain(&t.apart).map(|b| b.start_us + b.dur_us).fold(t.e2e_us.unwrap_or(0.0), f64::max)
}

/// One waterfall panel per timeline, top to bottom. `shared`: every panel on the same time
/// axis (requests of runs compared, read against each other), else each on its own.
pub fn timelines_svg(picked: &[Timeline], shared: bool) -> Result<Option<String>, ReportError> {
    if picked.is_empty() {
        return Ok(None);
    }
    let err = err("request waterfall");
    const LANE_PX: u32 = 26;
    let panel_h = |t: &Timeline| 110 + LANE_PX * (t.bars.len() + t.apart.len()) as u32;
    let height: u32 = picked.iter().map(panel_h).sum();
    let shared_end = picked.iter().map(timeline_end).fold(0.0, f64::max);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut rest = root.clone();
        for t in picked {
            let (area, below) = rest.split_vertically(panel_h(t));
            rest = below;
            let lanes: Vec<&Bar> = t.bars.iter().chain(&t.apart).collect();
            let n = lanes.len();
            let end = if shared { shared_end } else { timeline_end(t) };
            let (scale, unit) = if end >= 2e3 { (1e3, "ms") } else { (1.0, "us") };
            let xmax = (end / scale).max(1e-3) * 1.22;
            let title = match t.e2e_us {
                Some(e) => format!("{}: {} end to end ({})", t.label, fmt_us(e), t.request_id),
                None => format!("{} ({})", t.label, t.request_id),
            };
            let mut chart = ChartBuilder::on(&area)
                .caption(title, ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(36)
                .y_label_area_size(140)
                .build_cartesian_2d(0f64..xmax, 0f64..n as f64)
                .map_err(|e| err(e.to_string()))?;
            chart
                .configure_mesh()
                .disable_y_mesh()
                .y_labels(0)
                .x_desc(format!("{unit} since the request arrived (each stage: the slowest rank's)"))
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(|e| err(e.to_string()))?;
            // Lane i from the top.
            let row = |i: usize| (n - 1 - i) as f64;
            for (i, b) in lanes.iter().enumerate() {
                let apart = i >= t.bars.len();
                let c = lane_colour(&b.lane);
                let (x0, x1) = (b.start_us / scale, (b.start_us + b.dur_us) / scale);
                let style = if apart { c.mix(0.45).filled() } else { c.filled() };
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x0, row(i) + 0.18), (x1, row(i) + 0.82)],
                        style,
                    )))
                    .map_err(|e| err(e.to_string()))?;
                let (lx, ly) = chart.backend_coord(&(0.0, row(i) + 0.5));
                root.draw(&Text::new(b.lane.clone(), (lx - 134, ly - 7), ("sans-serif", 13)))
                    .map_err(|e| err(e.to_string()))?;
                let (vx, vy) = chart.backend_coord(&(x1, row(i) + 0.5));
                root.draw(&Text::new(fmt_us(b.dur_us), (vx + 4, vy - 6), ("sans-serif", 12)))
                    .map_err(|e| err(e.to_string()))?;
            }
            if !t.apart.is_empty() {
                let y = row(t.bars.len() - 1);
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(0.0, y), (xmax, y)],
                        BLACK.mix(0.3).stroke_width(1),
                    )))
                    .map_err(|e| err(e.to_string()))?;
            }
            if let Some(e2e) = t.e2e_us {
                let x = e2e / scale;
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x, 0.0), (x, n as f64)],
                        RGBColor(214, 39, 40).stroke_width(2),
                    )))
                    .map_err(|e| err(e.to_string()))?;
                let (ex, ey) = chart.backend_coord(&(x, n as f64));
                root.draw(&Text::new(format!("e2e {}", fmt_us(e2e)), (ex + 4, ey + 2), ("sans-serif", 12)))
                    .map_err(|e| err(e.to_string()))?;
            }
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(out))
}

// ---- Latency distributions. ----

/// One CDF: its name and its sorted samples (us), or percentiles where only those are known.
#[derive(Debug, Clone, PartialEq)]
pub struct Cdf {
    pub name: String,
    /// (latency us, fraction of requests at or below it), ascending.
    pub points: Vec<(f64, f64)>,
    /// The points are percentiles (joined by straight lines), not samples (a step at each).
    pub percentiles: bool,
}

/// A CDF through a stage's percentiles, where its samples are not at hand (a summary alone).
pub fn percentile_cdf(name: &str, s: &super::summary::StageStats) -> Cdf {
    let points = vec![(s.min_us, 0.0), (s.p50_us, 0.5), (s.p90_us, 0.9), (s.p99_us, 0.99), (s.max_us, 1.0)];
    Cdf { name: name.into(), points, percentiles: true }
}

/// A CDF of latency samples (us), thinned to evenly spaced quantiles past a few hundred.
pub fn sample_cdf(name: &str, samples: Vec<f64>) -> Cdf {
    Cdf { name: name.into(), points: cdf_of(samples), percentiles: false }
}

/// Most points a CDF keeps (evenly spaced quantiles beyond that).
const CDF_POINTS: usize = 400;

fn cdf_of(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n <= CDF_POINTS {
        return v.iter().enumerate().map(|(i, x)| (*x, (i + 1) as f64 / n as f64)).collect();
    }
    (0..=CDF_POINTS)
        .map(|k| {
            let i = ((k as f64 / CDF_POINTS as f64) * (n - 1) as f64).round() as usize;
            (v[i], (i + 1) as f64 / n as f64)
        })
        .collect()
}

/// The latency at quantile `q` of a CDF (its points ascending).
fn quantile(points: &[(f64, f64)], q: f64) -> f64 {
    points.iter().find(|p| p.1 >= q).or(points.last()).map_or(0.0, |p| p.0)
}

/// Whether two CDFs lie on top of each other: within 2% at most of nineteen quantiles.
pub(crate) fn coincide(a: &[(f64, f64)], b: &[(f64, f64)]) -> bool {
    let close = (1..20)
        .filter(|k| {
            let q = f64::from(*k) / 20.0;
            let (x, y) = (quantile(a, q), quantile(b, q));
            (x - y).abs() <= 0.02 * x.abs().max(y.abs()).max(1e-9)
        })
        .count();
    close >= 15
}

/// The stages whose distribution the latency chart shows, in order: what a request costs end
/// to end, and its transfer (the wall span over its ranks, and the slowest rank's own).
const CDF_STAGES: [Stage; 3] = [Stage::E2e, Stage::TransferSpan, Stage::Transfer];

/// Latency CDFs: from the request rows' samples, else (a run without them) from the
/// summary's percentiles; serving runs add their client-side TTFT and end-to-end latency.
/// Series that coincide are drawn once, named together (`transfer_span = transfer`).
pub fn latency_series(summary: &Summary, rows: &[RequestRow]) -> Vec<Cdf> {
    let mut out: Vec<Cdf> = Vec::new();
    for stage in CDF_STAGES {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.outcome == RequestOutcome::Ok)
            .filter_map(|r| r.stage_us(stage))
            .filter(|v| v.is_finite() && *v >= 0.0)
            .collect();
        if !v.is_empty() {
            out.push(sample_cdf(stage.as_str(), v));
        }
    }
    let names: Vec<&str> = CDF_STAGES.iter().map(|s| s.as_str()).chain(["ttft", "e2el"]).collect();
    for name in names {
        if out.iter().any(|c| c.name == name) {
            continue;
        }
        if let Some(s) = summary.stages.get(name).filter(|s| s.count > 0) {
            out.push(percentile_cdf(name, s));
        }
    }
    // Draw once what coincides.
    let mut merged: Vec<Cdf> = Vec::new();
    for c in out {
        match merged.iter_mut().find(|m| coincide(&m.points, &c.points)) {
            Some(m) => m.name = format!("{} = {}", m.name, c.name),
            None => merged.push(c),
        }
    }
    merged.truncate(MAX_SERIES);
    merged
}

/// Latency CDFs (see [`latency_series`]) on an axis spread over the samples: linear from the
/// fastest to the slowest where they are within a factor of 20, logarithmic beyond.
pub fn latency_svg(summary: &Summary, rows: &[RequestRow]) -> Result<Option<String>, ReportError> {
    cdf_svg(&format!("Latency distribution: {}", summary.run_id), &latency_series(summary, rows))
}

/// CDFs on one latency axis spread over their samples: linear from the fastest to the slowest
/// where they are within a factor of 20, logarithmic beyond; the legend gives each line's p50
/// and p99. Series keep their colour by position. `None` without a series.
pub fn cdf_svg(title: &str, series: &[Cdf]) -> Result<Option<String>, ReportError> {
    if series.is_empty() {
        return Ok(None);
    }
    let err = err("latency");
    let xs = || series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).filter(|x| x.is_finite());
    let lo = xs().fold(f64::INFINITY, f64::min);
    let hi = xs().fold(0.0, f64::max);
    let (scale, unit) = if hi >= 2e3 { (1e3, "ms") } else { (1.0, "us") };
    let log = lo > 0.0 && hi / lo > 20.0;
    let pad = (hi - lo).max(hi * 0.02).max(1e-3) * 0.04;
    let (x0, x1) = if log {
        (lo / 1.2 / scale, hi * 1.2 / scale)
    } else {
        ((lo - pad).max(0.0) / scale, (hi + pad) / scale)
    };
    let x_desc = format!("latency ({unit}{})", if log { ", log scale" } else { "" });
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let pct = |v: &f64| format!("{:.0}%", v * 100.0);
        let num = |v: &f64| fmt_f(*v);
        macro_rules! body {
            ($c:expr) => {{
                let mut c = $c;
                c.configure_mesh()
                    .x_desc(x_desc.as_str())
                    .y_desc("requests at or below")
                    .x_labels(12)
                    .y_labels(11)
                    .x_label_formatter(&num)
                    .y_label_formatter(&pct)
                    .light_line_style(WHITE.mix(0.0))
                    .draw()
                    .map_err(|e| err(e.to_string()))?;
                for (i, s) in series.iter().enumerate() {
                    let col = colour(i);
                    // A step per sample: the CDF rises at each one.
                    let mut pts = Vec::with_capacity(s.points.len() * 2);
                    let mut prev = 0.0;
                    for &(x, y) in &s.points {
                        if !s.percentiles {
                            pts.push((x / scale, prev));
                        }
                        pts.push((x / scale, y));
                        prev = y;
                    }
                    let p50 = quantile(&s.points, 0.5);
                    let p99 = quantile(&s.points, 0.99);
                    c.draw_series(LineSeries::new(pts, col.stroke_width(2)))
                        .map_err(|e| err(e.to_string()))?
                        .label(format!("{} (p50 {}, p99 {})", s.name, fmt_us(p50), fmt_us(p99)))
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2))
                        });
                }
                c.configure_series_labels()
                    .position(SeriesLabelPosition::LowerRight)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| err(e.to_string()))?;
            }};
        }
        let mut b = ChartBuilder::on(&root);
        b.caption(title, ("sans-serif", 20))
            .margin(16)
            .margin_right(30)
            .x_label_area_size(48)
            .y_label_area_size(64);
        if log {
            body!(b.build_cartesian_2d((x0..x1).log_scale(), 0f64..1.02).map_err(|e| err(e.to_string()))?);
        } else {
            body!(b.build_cartesian_2d(x0..x1, 0f64..1.02).map_err(|e| err(e.to_string()))?);
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

// ---- Per-rank bandwidth. ----

/// Bandwidth samples per column: each decode rank's own reads (`d0`, `d1`, ...), then the
/// request's over its wall span (`request`), GB/s.
pub fn rank_bandwidth_columns(rows: &[RequestRow]) -> Vec<(String, Vec<f64>)> {
    let mut by_rank: std::collections::BTreeMap<u32, Vec<f64>> = std::collections::BTreeMap::new();
    let mut span = Vec::new();
    for r in rows.iter().filter(|r| r.outcome == RequestOutcome::Ok) {
        for read in r.rank_reads.0.iter().filter(|x| x.read_us > 0.0) {
            by_rank.entry(read.rank).or_default().push(read.gbps());
        }
        if let Some(s) = r.transfer_span_us.filter(|s| *s > 0.0)
            && !r.rank_reads.0.is_empty()
        {
            span.push(r.bytes as f64 / s / 1e3);
        }
    }
    let mut out: Vec<(String, Vec<f64>)> = by_rank.into_iter().map(|(k, v)| (format!("d{k}"), v)).collect();
    if !span.is_empty() {
        out.push(("request".into(), span));
    }
    for (_, v) in &mut out {
        v.sort_by(f64::total_cmp);
    }
    out
}

/// Most samples drawn as dots per column; a box alone beyond.
const DOTS_PER_COLUMN: usize = 300;

/// Per-rank bandwidth: per column (see [`rank_bandwidth_columns`]) a box from p25 to p75, the
/// median marked and labelled, whiskers to the extremes, and the samples as dots.
pub fn rank_bandwidth_svg(rows: &[RequestRow]) -> Result<Option<String>, ReportError> {
    let cols = rank_bandwidth_columns(rows);
    if cols.is_empty() {
        return Ok(None);
    }
    let err = err("rank bandwidth");
    let q = |v: &[f64], q: f64| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
    let ymax = cols.iter().flat_map(|(_, v)| v.last().copied()).fold(0.0, f64::max).max(1e-6) * 1.15;
    let n = cols.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Bandwidth per decode rank, per request", ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n as f64, 0f64..ymax)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("decode rank (its own reads), then the request over its wall span")
            .y_desc("GB/s")
            .y_label_formatter(&|v: &f64| fmt_f(*v))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, (name, v)) in cols.iter().enumerate() {
            let c = if name == "request" { RGBColor(31, 119, 180) } else { RGBColor(23, 190, 207) };
            let x = i as f64;
            let (p25, p50, p75) = (q(v, 0.25), q(v, 0.5), q(v, 0.75));
            let (lo, hi) = (v[0], v[v.len() - 1]);
            chart
                .draw_series([
                    PathElement::new(vec![(x + 0.5, lo), (x + 0.5, hi)], BLACK.mix(0.5).stroke_width(1)),
                    PathElement::new(vec![(x + 0.25, p50), (x + 0.75, p50)], BLACK.stroke_width(3)),
                ])
                .map_err(|e| err(e.to_string()))?;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x + 0.3, p25), (x + 0.7, p75)],
                    c.mix(0.35).filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
            if v.len() <= DOTS_PER_COLUMN {
                // Spread sideways by the golden ratio so equal values do not hide each other.
                chart
                    .draw_series(v.iter().enumerate().map(|(k, y)| {
                        let j = ((k as f64 * 0.618_034).fract() - 0.5) * 0.36;
                        Circle::new((x + 0.5 + j, *y), 3, c.filled())
                    }))
                    .map_err(|e| err(e.to_string()))?;
            }
            let (nx, ny) = chart.backend_coord(&(x + 0.5, 0.0));
            root.draw(&Text::new(name.clone(), (nx - 10, ny + 6), ("sans-serif", 13)))
                .map_err(|e| err(e.to_string()))?;
            let (tx, ty) = chart.backend_coord(&(x + 0.5, hi));
            root.draw(&Text::new(format!("p50 {} GB/s", fmt_f(p50)), (tx - 40, ty - 18), ("sans-serif", 12)))
                .map_err(|e| err(e.to_string()))?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

// ---- The run over time. ----

/// Completions and bandwidth over the run, in buckets: repeats laid one after another.
#[derive(Debug, Clone, PartialEq)]
pub struct OverTime {
    pub bucket_s: f64,
    /// (bucket middle s, requests completed ok per s, failed per s, GB/s read).
    pub buckets: Vec<(f64, f64, f64, f64)>,
    /// Events on the joined timeline: (s, kind, detail).
    pub events: Vec<(f64, String, String)>,
    /// Where each repeat after the first begins.
    pub repeat_starts: Vec<f64>,
}

/// Buckets for a run of `span_s` with `done` completions: about two completions each, at
/// least ten, at least thirty for a run of three seconds or more, at most 120.
fn bucket_count(span_s: f64, done: usize) -> usize {
    let n = (done / 2).clamp(10, 120);
    if span_s >= 3.0 { n.max(30) } else { n }
}

/// The run over time (see [`OverTime`]); `None` without a finished request.
pub fn over_time(summary: &Summary, rows: &[RequestRow]) -> Option<OverTime> {
    let end_of =
        |r: &RequestRow| (r.start_offset_us + r.e2e_us.filter(|v| v.is_finite()).unwrap_or(0.0)) / 1e6;
    let max_repeat = rows.iter().map(|r| r.repeat).max()?;
    // Each repeat's length: its measured duration, else its last completion.
    let mut origin = vec![0.0; max_repeat as usize + 2];
    for k in 0..=max_repeat {
        let len = summary
            .repeats
            .iter()
            .find(|m| m.index == k && m.duration_s > 0.0)
            .map(|m| m.duration_s)
            .or_else(|| (max_repeat == 0 && summary.duration_s > 0.0).then_some(summary.duration_s))
            .unwrap_or(0.0)
            .max(rows.iter().filter(|r| r.repeat == k).map(end_of).fold(0.0, f64::max));
        origin[k as usize + 1] = origin[k as usize] + len;
    }
    let span = origin[max_repeat as usize + 1];
    if span <= 0.0 {
        return None;
    }
    let at = |r: &RequestRow| origin[r.repeat as usize] + end_of(r);
    let ok: Vec<&RequestRow> = rows.iter().filter(|r| r.outcome == RequestOutcome::Ok).collect();
    let n = bucket_count(span, ok.len());
    let w = span / n as f64;
    let mut b = vec![(0.0, 0.0, 0.0, 0.0); n];
    for (i, x) in b.iter_mut().enumerate() {
        x.0 = (i as f64 + 0.5) * w;
    }
    let idx = |t: f64| ((t / w) as usize).min(n - 1);
    for r in rows {
        let i = idx(at(r).max(0.0));
        if r.outcome == RequestOutcome::Ok {
            b[i].1 += 1.0 / w;
            b[i].3 += r.bytes as f64 / w / 1e9;
        } else {
            b[i].2 += 1.0 / w;
        }
    }
    let events = summary
        .events
        .iter()
        .filter(|e: &&RunEvent| e.repeat <= max_repeat)
        .map(|e| (origin[e.repeat as usize] + e.t_s, e.kind.clone(), e.detail.clone()))
        .collect();
    Some(OverTime {
        bucket_s: w,
        buckets: b,
        events,
        repeat_starts: origin[1..=max_repeat as usize].to_vec(),
    })
}

/// Completions per second (ok, and failed where any failed) and GB/s read, over the run, with
/// the warm-up (a band before the measured start), faults (red) and lease expiries (orange)
/// marked, and where each repeat begins.
pub fn throughput_svg(summary: &Summary, rows: &[RequestRow]) -> Result<Option<String>, ReportError> {
    let Some(ot) = over_time(summary, rows) else { return Ok(None) };
    let err = err("throughput");
    let span = ot.bucket_s * ot.buckets.len() as f64;
    // The warm-up shows as a band before 0, at most a quarter of the axis wide.
    let warm = ot.events.iter().filter(|e| e.1 == "warm_up").map(|e| e.0).fold(0.0, f64::min);
    let x0 = warm.max(-0.25 * span);
    let any_failed = ot.buckets.iter().any(|b| b.2 > 0.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let title =
            format!("The run over time: {} buckets of {}", ot.buckets.len(), fmt_us(ot.bucket_s * 1e6));
        let root = root.titled(&title, ("sans-serif", 20)).map_err(|e| err(e.to_string()))?;
        let panels = root.split_evenly((2, 1));
        type Pick = fn(&(f64, f64, f64, f64)) -> f64;
        type Line = (&'static str, Pick, RGBColor);
        let specs: [(&str, Vec<Line>); 2] = [
            ("requests completed per s", {
                let mut v: Vec<Line> = vec![("ok", |b| b.1, RGBColor(44, 160, 44))];
                if any_failed {
                    v.push(("failed", |b| b.2, RGBColor(214, 39, 40)));
                }
                v
            }),
            ("GB/s read", vec![("bandwidth", |b| b.3, RGBColor(31, 119, 180))]),
        ];
        for (panel, (y_desc, lines)) in panels.iter().zip(specs) {
            let ymax =
                ot.buckets.iter().flat_map(|b| lines.iter().map(move |l| (l.1)(b))).fold(0.0, f64::max);
            let ymax = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };
            let mut c = ChartBuilder::on(panel)
                .margin(12)
                .margin_right(30)
                .x_label_area_size(36)
                .y_label_area_size(64)
                .build_cartesian_2d(x0..span * 1.01, 0f64..ymax)
                .map_err(|e| err(e.to_string()))?;
            c.configure_mesh()
                .x_desc("s since the measured start (repeats one after another)")
                .y_desc(y_desc)
                .x_label_formatter(&|v: &f64| fmt_f(*v))
                .y_label_formatter(&|v: &f64| fmt_f(*v))
                .light_line_style(WHITE.mix(0.0))
                .draw()
                .map_err(|e| err(e.to_string()))?;
            if x0 < 0.0 {
                c.draw_series(std::iter::once(Rectangle::new(
                    [(x0, 0.0), (0.0, ymax)],
                    BLACK.mix(0.08).filled(),
                )))
                .map_err(|e| err(e.to_string()))?
                .label("warm-up (not measured)")
                .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], BLACK.mix(0.08).filled()));
            }
            for s in &ot.repeat_starts {
                c.draw_series(std::iter::once(PathElement::new(vec![(*s, 0.0), (*s, ymax)], BLACK.mix(0.4))))
                    .map_err(|e| err(e.to_string()))?;
            }
            for (name, pick, col) in &lines {
                let col = *col;
                let pts: Vec<(f64, f64)> = ot.buckets.iter().map(|b| (b.0, pick(b))).collect();
                c.draw_series(LineSeries::new(pts.iter().copied(), col.stroke_width(2)))
                    .map_err(|e| err(e.to_string()))?
                    .label(*name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
                c.draw_series(pts.iter().map(|p| Circle::new(*p, 2, col.filled())))
                    .map_err(|e| err(e.to_string()))?;
            }
            let faults: Vec<f64> = ot.events.iter().filter(|e| e.1 == "fault").map(|e| e.0).collect();
            if !faults.is_empty() {
                let red = RGBColor(214, 39, 40);
                c.draw_series(
                    faults.iter().map(|t| PathElement::new(vec![(*t, 0.0), (*t, ymax)], red.stroke_width(2))),
                )
                .map_err(|e| err(e.to_string()))?
                .label("fault injected")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
            }
            let leases: Vec<f64> =
                ot.events.iter().filter(|e| e.1 == "lease_expired" && e.0 >= x0).map(|e| e.0).collect();
            if !leases.is_empty() {
                let orange = RGBColor(255, 127, 14);
                c.draw_series(
                    leases.iter().map(|t| TriangleMarker::new((*t, ymax * 0.03), 6, orange.filled())),
                )
                .map_err(|e| err(e.to_string()))?
                .label(format!("lease expired ({})", leases.len()))
                .legend(move |(x, y)| TriangleMarker::new((x + 10, y), 6, orange.filled()));
            }
            c.configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::{RankRead, RankReads, Scenario};

    /// A request of a two-rank pull run, its stages scaled by `k`.
    fn row(i: u32, k: f64) -> RequestRow {
        RequestRow {
            request_id: format!("cmpl-run-{i}-0"),
            start_offset_us: f64::from(i) * 100_000.0,
            bytes: 2_000_000,
            queue_us: Some(10.0 * k),
            plan_us: Some(5.0),
            post_us: Some(20.0),
            transfer_us: Some(400.0 * k),
            transfer_span_us: Some(410.0 * k),
            notify_us: Some(15.0),
            e2e_us: Some(455.0 * k),
            verify_us: Some(300.0),
            rank_reads: RankReads(vec![
                RankRead { rank: 0, start_us: Some(0.0), read_us: 400.0 * k, bytes: 1_000_000 },
                RankRead { rank: 1, start_us: Some(10.0), read_us: 380.0 * k, bytes: 1_000_000 },
            ]),
            ..Default::default()
        }
    }

    fn rows(n: u32) -> Vec<RequestRow> {
        (0..n).map(|i| row(i, 1.0 + f64::from(i % 10) / 10.0)).collect()
    }

    use crate::report::chart::svg_skeleton as skeleton;

    #[test]
    fn the_timeline_lays_stages_end_to_end() {
        let t = timeline("median request", &row(3, 1.0));
        let lanes: Vec<(&str, f64, f64)> =
            t.bars.iter().map(|b| (b.lane.as_str(), b.start_us, b.dur_us)).collect();
        assert_eq!(
            lanes,
            vec![
                ("queue", 0.0, 10.0),
                ("plan", 10.0, 5.0),
                ("post", 15.0, 20.0),
                ("transfer span", 15.0, 410.0),
                ("read d0", 15.0, 400.0),
                ("read d1", 25.0, 380.0),
                ("notify", 425.0, 15.0),
            ]
        );
        assert_eq!(t.apart, vec![Bar { lane: "verify (not timed)".into(), start_us: 440.0, dur_us: 300.0 }]);
    }

    #[test]
    fn the_waterfall_picks_the_median_and_the_p99_request_or_the_one_asked_for() {
        let rows = rows(100);
        let picked = pick_requests(&rows, None).expect("pick");
        let labels: Vec<(&str, Option<f64>)> = picked.iter().map(|t| (t.label.as_str(), t.e2e_us)).collect();
        let e2e = |i: u32| Some(455.0 * (1.0 + f64::from(i) / 10.0));
        assert_eq!(labels, vec![("median request", e2e(4)), ("p99 request", e2e(9))]);
        let one = pick_requests(&rows, Some("17")).expect("by number");
        assert_eq!(one[0].request_id, "cmpl-run-17-0");
        assert_eq!(pick_requests(&rows, Some("cmpl-run-17-0")).expect("by id"), one);
        let e = pick_requests(&rows, Some("nope")).expect_err("unknown");
        assert!(e.to_string().contains("cmpl-run-0-0"), "{e}");
        insta::assert_snapshot!(
            "request_waterfall",
            skeleton(&waterfall_svg(&rows, None).expect("draw").expect("svg"))
        );
    }

    #[test]
    fn latency_cdfs_draw_coinciding_stages_once() {
        let mut rows = rows(200);
        // The span equals the slowest rank's transfer: one line, both names.
        for r in &mut rows {
            r.transfer_span_us = r.transfer_us;
        }
        let s = Summary::new("r", "t", Scenario::default());
        let series = latency_series(&s, &rows);
        let names: Vec<&str> = series.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, vec!["e2e", "transfer_span = transfer"]);
        assert!(series.len() <= MAX_SERIES);
        assert!(series[0].points.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1), "a CDF rises");
        insta::assert_snapshot!(
            "latency_cdf",
            skeleton(&latency_svg(&s, &rows).expect("draw").expect("svg"))
        );
    }

    #[test]
    fn big_runs_keep_charts_small() {
        let rows: Vec<RequestRow> = (0..20_000).map(|i| row(i, 1.0 + f64::from(i % 97) / 50.0)).collect();
        let s = Summary::new("r", "t", Scenario::default());
        for svg in [
            latency_svg(&s, &rows).expect("draw").expect("svg"),
            rank_bandwidth_svg(&rows).expect("draw").expect("svg"),
            throughput_svg(&s, &rows).expect("draw").expect("svg"),
        ] {
            assert!(svg.len() < 300_000, "{} bytes", svg.len());
        }
    }

    #[test]
    fn rank_bandwidth_has_a_column_per_rank_and_the_request() {
        let rows = rows(20);
        let cols = rank_bandwidth_columns(&rows);
        let names: Vec<&str> = cols.iter().map(|c| c.0.as_str()).collect();
        assert_eq!(names, vec!["d0", "d1", "request"]);
        // 1 MB in 400 us is 2.5 GB/s.
        assert!((cols[0].1[0] - 1.0 / 0.4 / 1.9).abs() < 1e-9, "{:?}", cols[0].1);
        insta::assert_snapshot!(
            "rank_bandwidth",
            skeleton(&rank_bandwidth_svg(&rows).expect("draw").expect("svg"))
        );
    }

    #[test]
    fn the_run_over_time_has_thirty_points_for_three_seconds_and_marks_events() {
        // 40 requests over 4 s.
        let rows = rows(40);
        let mut s = Summary::new("r", "t", Scenario::default());
        s.duration_s = 4.0;
        s.events = vec![
            RunEvent { kind: "warm_up".into(), repeat: 0, t_s: -0.5, detail: "5 requests".into() },
            RunEvent { kind: "fault".into(), repeat: 0, t_s: 2.0, detail: "Kill into d rank 1".into() },
            RunEvent { kind: "lease_expired".into(), repeat: 0, t_s: 2.5, detail: String::new() },
        ];
        let ot = over_time(&s, &rows).expect("over time");
        assert_eq!(ot.buckets.len(), 30);
        let done: f64 = ot.buckets.iter().map(|b| b.1 * ot.bucket_s).sum();
        assert!((done - 40.0).abs() < 1e-9, "{done}");
        let gb: f64 = ot.buckets.iter().map(|b| b.3 * ot.bucket_s).sum();
        assert!((gb - 40.0 * 0.002).abs() < 1e-9, "{gb}");
        insta::assert_snapshot!(
            "over_time",
            skeleton(&throughput_svg(&s, &rows).expect("draw").expect("svg"))
        );
    }

    #[test]
    fn no_data_no_chart() {
        let s = Summary::new("r", "t", Scenario::default());
        assert_eq!(latency_svg(&s, &[]).expect("ok"), None);
        assert_eq!(throughput_svg(&s, &[]).expect("ok"), None);
        assert_eq!(rank_bandwidth_svg(&[]).expect("ok"), None);
        assert_eq!(waterfall_svg(&[], None).expect("ok"), None);
    }
}
