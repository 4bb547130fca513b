//! Charts that put runs beside each other (plotters, SVG backend only), for the pages of a
//! comparison (`kvx bench --compare-*`, `kvx report A B`), a sweep and a gate verdict:
//!
//! - [`stage_cdfs`] drawn by `run_charts::cdf_svg`: one stage's latency CDF per run, overlaid.
//! - [`median_timelines`] drawn by `run_charts::timelines_svg`: each run's median request on
//!   one shared time axis.
//! - [`range_bars_svg`]: one bar per run (throughput), whiskers over its rounds or repeats.
//! - [`gate_change_svg`]: how much worse each metric got, its threshold and noise marked.
//! - [`sweep_setting_svg`]: a sweep's measured figures against the swept setting, with the
//!   prediction beside them where the summary has one.
//!
//! Also which requests belong to which run in a directory that holds several ([`split_runs`]).
//! Pure: summaries and rows in, SVG text out (`None` where there is nothing to draw).

use std::collections::BTreeMap;

use plotters::prelude::*;

use super::ReportError;
use super::chart::colour;
use super::gate::{GateReport, Kind, MetricVerdict};
use super::numbers::fmt_f;
use super::run_charts::{Cdf, MAX_SERIES, Timeline, pick_requests, sample_cdf};
use super::summary::{RequestOutcome, RequestRow, Stage, Summary, SweepPoint};

const WIDTH: u32 = 960;

fn err(chart: &'static str) -> impl Fn(String) -> ReportError {
    move |reason| ReportError::Chart { chart, reason }
}

/// One run among those drawn side by side: its name and its requests.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedRun {
    pub name: String,
    pub rows: Vec<RequestRow>,
}

// ---- Which run a request belongs to. ----

/// The run a request of a sweep's or a comparison's directory belongs to. Its id is
/// `cmpl-<run>-<n>-0`, where `<run>` is `<parent>-<name>` (a comparison's run; `<name>-r<k>` in
/// round k) or `<parent>-p<i>` (a sweep's point i). `None` for a request of another run.
pub fn sub_run<'a>(parent: &str, request_id: &'a str) -> Option<&'a str> {
    let rest = request_id.strip_prefix("cmpl-")?.strip_prefix(parent)?.strip_prefix('-')?;
    let mut parts = rest.rsplitn(3, '-');
    let (_, n, sub) = (parts.next()?, parts.next()?, parts.next()?);
    n.parse::<u64>().is_ok().then_some(sub)
}

/// A comparison's run name without its round: `ucx-r2` -> `ucx`.
fn without_round(sub: &str) -> &str {
    match sub.rsplit_once("-r") {
        Some((name, k)) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => sub,
    }
}

/// The requests of each run of a comparison or sweep summary, in the order of its points
/// (every round of a comparison's run together). A sweep's points are matched to its runs
/// `p<i>` in order (rejected points ran nothing); where they do not match one to one, or the
/// summary has no points, nothing is returned.
pub fn split_runs(summary: &Summary, rows: &[RequestRow]) -> Vec<NamedRun> {
    let Some(points) = summary.sweep.as_deref().filter(|p| !p.is_empty()) else { return Vec::new() };
    let mut by_sub: BTreeMap<&str, Vec<RequestRow>> = BTreeMap::new();
    for r in rows {
        if let Some(sub) = sub_run(&summary.run_id, &r.request_id) {
            by_sub.entry(sub).or_default().push(r.clone());
        }
    }
    let sweep_index = |sub: &str| sub.strip_prefix('p').and_then(|i| i.parse::<usize>().ok());
    if !by_sub.is_empty() && by_sub.keys().all(|k| sweep_index(k).is_some()) {
        let mut subs: Vec<(usize, Vec<RequestRow>)> =
            by_sub.into_iter().filter_map(|(k, v)| Some((sweep_index(k)?, v))).collect();
        subs.sort_by_key(|s| s.0);
        if subs.len() != points.len() {
            return Vec::new();
        }
        return points
            .iter()
            .zip(subs)
            .map(|(p, (_, rows))| NamedRun { name: p.label.clone(), rows })
            .collect();
    }
    points
        .iter()
        .map(|p| NamedRun {
            name: p.label.clone(),
            rows: by_sub
                .iter()
                .filter(|(k, _)| without_round(k) == p.label)
                .flat_map(|(_, v)| v.iter().cloned())
                .collect(),
        })
        .collect()
}

// ---- Distributions and waterfalls, one per run. ----

/// One CDF per run of `stage`'s latency over its requests that ended ok, named by the run
/// (`prefix` before the name where given); at most [`MAX_SERIES`].
pub fn stage_cdfs(runs: &[NamedRun], stage: Stage, prefix: &str) -> Vec<Cdf> {
    runs.iter()
        .filter_map(|run| {
            let v: Vec<f64> = run
                .rows
                .iter()
                .filter(|r| r.outcome == RequestOutcome::Ok)
                .filter_map(|r| r.stage_us(stage))
                .filter(|v| v.is_finite() && *v >= 0.0)
                .collect();
            (!v.is_empty()).then(|| sample_cdf(&format!("{prefix}{}", run.name), v))
        })
        .take(MAX_SERIES)
        .collect()
}

/// Each run's median request by end to end, labelled with the run's name.
pub fn median_timelines(runs: &[NamedRun]) -> Vec<Timeline> {
    runs.iter()
        .filter_map(|run| {
            let mut t = pick_requests(&run.rows, None).ok()?.into_iter().next()?;
            t.label = format!("{}: median request", run.name);
            Some(t)
        })
        .collect()
}

// ---- Bars with their rounds' range. ----

/// One bar: a run's figure and the values it is the median of (its rounds or repeats).
#[derive(Debug, Clone, PartialEq)]
pub struct RangeBar {
    pub name: String,
    pub value: f64,
    /// The rounds' (or repeats') values: a whisker spans them and a dot marks each; empty or
    /// one value draws no whisker.
    pub samples: Vec<f64>,
}

/// The throughput of each run of a comparison summary: the median over its rounds, and each
/// round's (`round_gbps`) where `--rounds` gave several.
pub fn compare_bars(summary: &Summary) -> Vec<RangeBar> {
    summary
        .sweep
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|p: &SweepPoint| RangeBar {
            name: p.label.clone(),
            value: p.throughput_gbps,
            samples: p
                .params
                .get("round_gbps")
                .and_then(|v| v.as_array())
                .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
                .unwrap_or_default(),
        })
        .collect()
}

/// A run's throughput, with its repeats' where it has several.
pub fn run_bar(name: &str, s: &Summary) -> RangeBar {
    RangeBar {
        name: name.to_string(),
        value: s.throughput_gbps,
        samples: if s.repeats.len() > 1 {
            s.repeats.iter().map(|r| r.throughput_gbps).collect()
        } else {
            vec![]
        },
    }
}

/// One vertical bar per run, its value on top; where it has several rounds, a whisker from the
/// lowest to the highest and a dot per round.
pub fn range_bars_svg(title: &str, y_desc: &str, bars: &[RangeBar]) -> Result<Option<String>, ReportError> {
    let bars: Vec<&RangeBar> = bars.iter().filter(|b| b.value.is_finite()).take(MAX_SERIES).collect();
    if bars.is_empty() {
        return Ok(None);
    }
    let err = err("bars");
    let top = bars
        .iter()
        .flat_map(|b| b.samples.iter().copied().chain([b.value]))
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let ymax = if top > 0.0 { top * 1.25 } else { 1.0 };
    let n = bars.len();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n as f64, 0f64..ymax)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(y_desc)
            .y_label_formatter(&|v: &f64| fmt_f(*v))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, b) in bars.iter().enumerate() {
            let x = i as f64;
            let c = colour(i);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x + 0.25, 0.0), (x + 0.75, b.value)],
                    c.mix(0.75).filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
            let spread = b.samples.len() > 1;
            let (lo, hi) =
                b.samples.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(*v), h.max(*v)));
            if spread {
                let black = BLACK.stroke_width(2);
                chart
                    .draw_series([
                        PathElement::new(vec![(x + 0.5, lo), (x + 0.5, hi)], black),
                        PathElement::new(vec![(x + 0.42, lo), (x + 0.58, lo)], black),
                        PathElement::new(vec![(x + 0.42, hi), (x + 0.58, hi)], black),
                    ])
                    .map_err(|e| err(e.to_string()))?;
                chart
                    .draw_series(b.samples.iter().map(|v| Circle::new((x + 0.5, *v), 3, BLACK.filled())))
                    .map_err(|e| err(e.to_string()))?;
            }
            let (nx, ny) = chart.backend_coord(&(x + 0.5, 0.0));
            root.draw(&Text::new(b.name.clone(), (nx - 4 * b.name.len() as i32, ny + 8), ("sans-serif", 14)))
                .map_err(|e| err(e.to_string()))?;
            let label = if spread {
                format!("{} ({}-{}, {} rounds)", fmt_f(b.value), fmt_f(lo), fmt_f(hi), b.samples.len())
            } else {
                fmt_f(b.value)
            };
            let (tx, ty) = chart.backend_coord(&(x + 0.25, if spread { hi.max(b.value) } else { b.value }));
            root.draw(&Text::new(label, (tx, ty - 18), ("sans-serif", 13)))
                .map_err(|e| err(e.to_string()))?;
        }
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

// ---- The gate's verdict. ----

/// How much worse each relative metric of a gate verdict got (percent, positive = worse, after
/// normalisation), one row per metric: the bar coloured by its verdict, its threshold a red
/// tick (dashed where the metric is shown but not gated), its noise band grey. Failure counts
/// (absolute metrics) are left to the table. `None` where no metric has a change.
pub fn gate_change_svg(report: &GateReport) -> Result<Option<String>, ReportError> {
    let rows: Vec<_> = report
        .metrics
        .iter()
        .filter(|m| m.kind == Kind::Relative && m.change.is_some_and(f64::is_finite))
        .collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let err = err("gate");
    let pct = |v: f64| v * 100.0;
    let reach = rows
        .iter()
        .map(|m| pct(m.change.unwrap_or(0.0)).abs().max(pct(m.threshold)).max(pct(m.noise.unwrap_or(0.0))))
        .fold(1.0, f64::max)
        * 1.35;
    let n = rows.len();
    let height = 130 + 44 * n as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Change against the baseline, per metric (right = worse)", ("sans-serif", 20))
            .margin(16)
            .margin_right(250)
            .x_label_area_size(44)
            .y_label_area_size(230)
            .build_cartesian_2d(-reach..reach, 0f64..n as f64)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("% worse than the baseline (normalised by the machine's speed where the gate did)")
            .x_label_formatter(&|v: &f64| if v.abs() < 0.5 { "0%".into() } else { format!("{v:+.0}%") })
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        let row = |i: usize| (n - 1 - i) as f64;
        for (i, m) in rows.iter().enumerate() {
            let y = row(i);
            if let Some(noise) = m.noise.filter(|v| v.is_finite() && *v > 0.0) {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(-pct(noise), y + 0.1), (pct(noise), y + 0.9)],
                        BLACK.mix(0.08).filled(),
                    )))
                    .map_err(|e| err(e.to_string()))?;
            }
            let change = pct(m.change.unwrap_or(0.0));
            let c = match m.verdict {
                MetricVerdict::Regression => RGBColor(214, 39, 40),
                MetricVerdict::WithinNoise => RGBColor(255, 127, 14),
                MetricVerdict::Improved => RGBColor(44, 160, 44),
                _ => RGBColor(31, 119, 180),
            };
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, y + 0.28), (change, y + 0.72)],
                    c.filled(),
                )))
                .map_err(|e| err(e.to_string()))?;
            let t = pct(m.threshold);
            let red = RGBColor(214, 39, 40);
            if m.enforced {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(t, y + 0.05), (t, y + 0.95)],
                        red.stroke_width(3),
                    )))
                    .map_err(|e| err(e.to_string()))?;
            } else {
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(t, y + 0.05), (t, y + 0.95)],
                        4,
                        4,
                        red.stroke_width(2),
                    ))
                    .map_err(|e| err(e.to_string()))?;
            }
            let (lx, ly) = chart.backend_coord(&(-reach, y + 0.5));
            let gated = if m.enforced { "" } else { " (not gated)" };
            root.draw(&Text::new(format!("{}{gated}", m.metric), (lx - 224, ly - 7), ("sans-serif", 13)))
                .map_err(|e| err(e.to_string()))?;
            let verdict = match m.verdict {
                MetricVerdict::Regression => "REGRESSION",
                MetricVerdict::WithinNoise => "within noise",
                MetricVerdict::Improved => "improved",
                MetricVerdict::Pass => "pass",
                MetricVerdict::Skipped => "skipped",
            };
            // In words, so a faster throughput does not read as "+8%" on a worse-is-right axis.
            let moved = if change.abs() < 0.05 {
                "no change".to_string()
            } else {
                format!("{:.1}% {}", change.abs(), if change < 0.0 { "better" } else { "worse" })
            };
            let label = format!("{moved} ({verdict}; threshold {t:.0}%)");
            // In a column of their own right of the plot: never over a bar or a tick.
            let (right_edge, ly) = chart.backend_coord(&(reach, y + 0.5));
            let at = (right_edge + 10, ly - 6);
            root.draw(&Text::new(label, at, ("sans-serif", 12))).map_err(|e| err(e.to_string()))?;
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, 0.0), (0.0, n as f64)],
                BLACK.stroke_width(1),
            )))
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

// ---- A sweep against its setting. ----

/// The x axis of a sweep chart: the setting swept (the axes that vary across points, less the
/// one naming the series), each point's position on it, and its tick labels.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepAxis {
    pub name: String,
    /// Each point's x.
    pub x: Vec<f64>,
    /// A numeric setting (block size, concurrency) keeps its values; others are categories.
    pub numeric: bool,
    /// Logarithmic: numeric values that span a factor of 8 or more.
    pub log: bool,
    pub ticks: Vec<(f64, String)>,
}

fn value_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Figures a comparison records beside its setting: not axes.
const NOT_AXES: [&str; 8] = [
    "cpu_s_per_gb",
    "rounds",
    "round_gbps",
    "ratio_to_first",
    "ratio_to_first_min",
    "ratio_to_first_max",
    "cuda_batch_paths",
    "save_to_host_p50_us",
];

/// The swept setting of a sweep's points (see [`SweepAxis`]); `None` without points.
pub fn sweep_axis(points: &[SweepPoint]) -> Option<SweepAxis> {
    if points.is_empty() {
        return None;
    }
    let keys: std::collections::BTreeSet<&str> = points
        .iter()
        .flat_map(|p| p.params.keys().map(String::as_str))
        .filter(|k| !NOT_AXES.contains(k) && !k.ends_with("_p50_us"))
        .collect();
    let text = |p: &SweepPoint, k: &str| p.params.get(k).map(value_text).unwrap_or_default();
    let varying: Vec<&str> =
        keys.iter().copied().filter(|k| points.iter().any(|p| text(p, k) != text(&points[0], k))).collect();
    let series_key = keys
        .iter()
        .copied()
        .find(|k| points.iter().all(|p| p.series.as_deref() == Some(text(p, k).as_str())));
    let mut swept: Vec<&str> = varying.iter().copied().filter(|k| Some(*k) != series_key).collect();
    if swept.is_empty() {
        swept = varying.clone();
    }
    if swept.is_empty() {
        swept = keys.iter().copied().take(1).collect();
    }
    let numbers: Option<Vec<f64>> = (swept.len() == 1)
        .then(|| points.iter().map(|p| text(p, swept[0]).parse::<f64>().ok()).collect::<Option<Vec<f64>>>())
        .flatten();
    let name = swept.join(", ");
    if let Some(x) = numbers {
        let lo = x.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut distinct = x.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        // Settings are mostly whole numbers (block sizes, concurrency): written as such.
        let tick = |v: f64| if v.fract() == 0.0 && v.abs() < 1e15 { format!("{v:.0}") } else { fmt_f(v) };
        let ticks = distinct.iter().map(|v| (*v, tick(*v))).collect();
        return Some(SweepAxis { name, log: lo > 0.0 && hi / lo >= 8.0, x, numeric: true, ticks });
    }
    let mut labels: Vec<String> = Vec::new();
    let x = points
        .iter()
        .map(|p| {
            let l = swept.iter().map(|k| text(p, k)).collect::<Vec<_>>().join(" ");
            let i = labels.iter().position(|x| *x == l).unwrap_or_else(|| {
                labels.push(l);
                labels.len() - 1
            });
            i as f64
        })
        .collect();
    let ticks = labels.into_iter().enumerate().map(|(i, l)| (i as f64, l)).collect();
    Some(SweepAxis { name, x, numeric: false, log: false, ticks })
}

/// One line of a sweep chart: (x, y) per point of its series.
type Line = (String, Vec<(f64, f64)>, bool);

/// A sweep's figures against the swept setting (see [`sweep_axis`]), one line per series:
/// GB/s above; below, the transfer span p50 measured and, dashed, predicted where the summary
/// has `--rates` predictions (else the transfer p50). `None` for a summary without points.
pub fn sweep_setting_svg(summary: &Summary) -> Result<Option<String>, ReportError> {
    let Some(points) = summary.sweep.as_deref() else { return Ok(None) };
    let Some(axis) = sweep_axis(points) else { return Ok(None) };
    let err = err("sweep");
    let mut series: Vec<String> = Vec::new();
    for p in points {
        let s = p.series.clone().unwrap_or_else(|| "all".into());
        if !series.contains(&s) {
            series.push(s);
        }
    }
    let predicted = points.iter().any(|p| p.predicted_span_p50_us.is_some());
    // Two lines a series below with predictions: at most MAX_SERIES lines in a panel.
    let per_panel = if predicted { MAX_SERIES / 2 } else { MAX_SERIES };
    series.truncate(per_panel);
    // One series: its lines are named by what they show alone.
    let named =
        |s: &str, what: &str| if series.len() == 1 { what.to_string() } else { format!("{s} {what}") };
    let line = |name: &str, f: &dyn Fn(&SweepPoint) -> Option<f64>| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = points
            .iter()
            .zip(&axis.x)
            .filter(|(p, _)| p.series.as_deref().unwrap_or("all") == name)
            .filter_map(|(p, x)| f(p).filter(|y| y.is_finite()).map(|y| (*x, y)))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let top: Vec<Line> = series
        .iter()
        .map(|s| {
            (
                if series.len() == 1 { "measured".into() } else { s.clone() },
                line(s, &|p| Some(p.throughput_gbps)),
                false,
            )
        })
        .collect();
    let lat_ms = |v: Option<f64>| v.map(|u| u / 1e3);
    let mut bottom: Vec<Line> = Vec::new();
    for s in &series {
        if predicted {
            bottom.push((named(s, "measured"), line(s, &|p| lat_ms(p.measured_span_p50_us)), false));
            bottom.push((named(s, "predicted"), line(s, &|p| lat_ms(p.predicted_span_p50_us)), true));
        } else {
            bottom.push((named(s, "measured"), line(s, &|p| lat_ms(p.transfer_p50_us)), false));
        }
    }
    let bottom_desc =
        if predicted { "transfer span p50, ms (dashed: predicted)" } else { "transfer p50, ms" };
    let (x0, x1) = {
        let lo = axis.x.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = axis.x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if axis.log {
            (lo / 1.4, hi * 1.4)
        } else if axis.numeric {
            let pad = ((hi - lo) * 0.08).max(hi.abs() * 0.05).max(0.5);
            (lo - pad, hi + pad)
        } else {
            (-0.5, hi + 0.5)
        }
    };
    let mut svg = String::new();
    {
        // Text placed by a chart's own coordinates goes on the whole canvas (they are the
        // canvas's, not the panel's).
        let canvas = SVGBackend::with_string(&mut svg, (WIDTH, 700)).into_drawing_area();
        canvas.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let title =
            format!("{} against {}", summary.scenario.name.as_deref().unwrap_or("the sweep"), axis.name);
        let root = canvas.titled(&title, ("sans-serif", 20)).map_err(|e| err(e.to_string()))?;
        let panels = root.split_evenly((2, 1));
        for (k, (panel, (lines, y_desc))) in
            panels.iter().zip([(&top, "GB/s"), (&bottom, bottom_desc)]).enumerate()
        {
            let ymax = lines.iter().flat_map(|l| l.1.iter().map(|p| p.1)).fold(0.0, f64::max);
            let ymax = if ymax > 0.0 { ymax * 1.2 } else { 1.0 };
            let mut b = ChartBuilder::on(panel);
            b.margin(12).margin_right(30).x_label_area_size(44).y_label_area_size(64);
            macro_rules! body {
                ($c:expr) => {{
                    let mut c = $c;
                    let mut mesh = c.configure_mesh();
                    mesh.y_desc(y_desc)
                        .y_label_formatter(&|v: &f64| fmt_f(*v))
                        .light_line_style(WHITE.mix(0.0))
                        .disable_x_mesh();
                    // Ticks at the values swept, not at round numbers between them.
                    // (A log axis draws a label even at x_labels(0): blanked.)
                    mesh.x_labels(0).x_label_formatter(&|_: &f64| String::new()).x_desc(axis.name.as_str());
                    mesh.draw().map_err(|e| err(e.to_string()))?;
                    for (i, (name, pts, dashed)) in lines.iter().enumerate() {
                        // A series keeps its colour in both panels; its prediction too.
                        let col = colour(if predicted && k == 1 { i / 2 } else { i });
                        let style = col.stroke_width(2);
                        if *dashed {
                            c.draw_series(DashedLineSeries::new(pts.iter().copied(), 8, 6, style))
                                .map_err(|e| err(e.to_string()))?
                                .label(name.clone())
                                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 8, y)], style));
                            c.draw_series(pts.iter().map(|p| Cross::new(*p, 4, style)))
                                .map_err(|e| err(e.to_string()))?;
                        } else {
                            c.draw_series(LineSeries::new(pts.iter().copied(), style))
                                .map_err(|e| err(e.to_string()))?
                                .label(name.clone())
                                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
                            c.draw_series(pts.iter().map(|p| Circle::new(*p, 4, col.filled())))
                                .map_err(|e| err(e.to_string()))?;
                        }
                    }
                    {
                        for (x, label) in &axis.ticks {
                            let (px, py) = c.backend_coord(&(*x, 0.0));
                            let w = 7 * label.chars().count().min(24) as i32 / 2;
                            canvas
                                .draw(&Text::new(label.clone(), (px - w, py + 8), ("sans-serif", 13)))
                                .map_err(|e| err(e.to_string()))?;
                        }
                    }
                    c.configure_series_labels()
                        .position(SeriesLabelPosition::UpperLeft)
                        .background_style(WHITE.mix(0.85))
                        .border_style(BLACK)
                        .draw()
                        .map_err(|e| err(e.to_string()))?;
                }};
            }
            if axis.log {
                body!(
                    b.build_cartesian_2d((x0..x1).log_scale().base(2.0), 0f64..ymax)
                        .map_err(|e| err(e.to_string()))?
                );
            } else {
                body!(b.build_cartesian_2d(x0..x1, 0f64..ymax).map_err(|e| err(e.to_string()))?);
            }
        }
        canvas.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(svg))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;
    use crate::report::chart::svg_skeleton;
    use crate::report::summary::{RankRead, RankReads, Scenario};

    /// A finished request of run `sub` under `parent`, its stages scaled by `k`.
    fn row(parent: &str, sub: &str, n: u32, k: f64) -> RequestRow {
        RequestRow {
            request_id: format!("cmpl-{parent}-{sub}-{n}-0"),
            bytes: 1_000_000,
            queue_us: Some(5.0),
            plan_us: Some(3.0),
            post_us: Some(10.0 * k),
            transfer_us: Some(300.0 * k),
            transfer_span_us: Some(320.0 * k),
            notify_us: Some(12.0),
            e2e_us: Some(350.0 * k),
            rank_reads: RankReads(vec![RankRead {
                rank: 0,
                start_us: Some(0.0),
                read_us: 300.0 * k,
                bytes: 1_000_000,
            }]),
            ..Default::default()
        }
    }

    fn point(label: &str, params: &[(&str, serde_json::Value)], gbps: f64) -> SweepPoint {
        SweepPoint {
            label: label.into(),
            params: params.iter().map(|(k, v)| ((*k).to_string(), v.clone())).collect::<BTreeMap<_, _>>(),
            throughput_gbps: gbps,
            transfer_p50_us: Some(1000.0 / gbps),
            ..Default::default()
        }
    }

    /// A comparison of pull and push over `rounds` rounds, 4 requests a round each.
    fn comparison(rounds: u32) -> (Summary, Vec<RequestRow>) {
        let mut s =
            Summary::new("P", "t", Scenario { name: Some("compare-modes".into()), ..Default::default() });
        let rg = |g: f64| json!((0..rounds).map(|r| g + f64::from(r) * 0.1).collect::<Vec<_>>());
        s.sweep = Some(vec![
            point("pull", &[("mode", json!("pull")), ("round_gbps", rg(2.0))], 2.1),
            point("push", &[("mode", json!("push")), ("round_gbps", rg(1.5))], 1.6),
        ]);
        let mut rows = Vec::new();
        for r in 1..=rounds {
            for (name, k) in [("pull", 1.0), ("push", 1.4)] {
                rows.extend((0..4).map(|n| row("P", &format!("{name}-r{r}"), n, k + f64::from(n) * 0.1)));
            }
        }
        (s, rows)
    }

    #[test]
    fn requests_are_told_apart_by_their_run() {
        assert_eq!(sub_run("20261207T1-ab", "cmpl-20261207T1-ab-ucx-r2-7-0"), Some("ucx-r2"));
        assert_eq!(sub_run("P", "cmpl-P-cuda-batch-3-0"), Some("cuda-batch"));
        assert_eq!(sub_run("P", "cmpl-P-p12-0-0"), Some("p12"));
        assert_eq!(sub_run("P", "cmpl-Q-ucx-1-0"), None, "another run's request");
        assert_eq!(sub_run("P", "cmpl-P-ucx-x-0"), None, "not a request number");
        assert_eq!(without_round("ucx-r2"), "ucx");
        assert_eq!(without_round("cuda-batch"), "cuda-batch");
        assert_eq!(without_round("x-r"), "x-r");

        let (s, rows) = comparison(2);
        let runs = split_runs(&s, &rows);
        let got: Vec<(&str, usize)> = runs.iter().map(|r| (r.name.as_str(), r.rows.len())).collect();
        assert_eq!(got, vec![("pull", 8), ("push", 8)], "every round of a run together");

        // A sweep whose second point was rejected: its runs are p0 and p2.
        let mut sweep = Summary::new("S", "t", Scenario::default());
        sweep.sweep = Some(vec![
            point("a", &[("concurrency", json!(1))], 1.0),
            point("b", &[("concurrency", json!(4))], 2.0),
        ]);
        let mut rows: Vec<RequestRow> = (0..3).map(|n| row("S", "p0", n, 1.0)).collect();
        rows.extend((0..5).map(|n| row("S", "p2", n, 1.0)));
        let got: Vec<(String, usize)> =
            split_runs(&sweep, &rows).into_iter().map(|r| (r.name, r.rows.len())).collect();
        assert_eq!(got, vec![("a".to_string(), 3), ("b".to_string(), 5)]);
        assert!(split_runs(&sweep, &rows[..3]).is_empty(), "one run for two points: no guess");
    }

    #[test]
    fn the_sweep_axis_is_the_setting_swept() {
        let conc: Vec<SweepPoint> =
            [1, 2, 4].iter().map(|c| point(&format!("c{c}"), &[("concurrency", json!(c))], 1.0)).collect();
        let a = sweep_axis(&conc).expect("axis");
        assert_eq!(
            (a.name.as_str(), a.numeric, a.log, a.x.clone()),
            ("concurrency", true, false, vec![1.0, 2.0, 4.0])
        );
        let blocks: Vec<SweepPoint> =
            [16, 32, 64, 128].iter().map(|b| point("b", &[("block_size", json!(b))], 1.0)).collect();
        assert!(sweep_axis(&blocks).expect("axis").log, "16 to 128 spreads on a log axis");
        // layout x tp, series tp: the layouts are the axis, in the order swept.
        let mut grid = Vec::new();
        for tp in ["2:2", "4:2"] {
            for layout in ["NHD", "HND"] {
                let mut p = point("p", &[("tp", json!(tp)), ("layout", json!(layout))], 1.0);
                p.series = Some(tp.into());
                grid.push(p);
            }
        }
        let a = sweep_axis(&grid).expect("axis");
        assert_eq!((a.name.as_str(), a.numeric), ("layout", false));
        assert_eq!(a.x, vec![0.0, 1.0, 0.0, 1.0]);
        assert_eq!(a.ticks, vec![(0.0, "NHD".to_string()), (1.0, "HND".to_string())]);
        // A comparison's own figures are not axes.
        let (s, _) = comparison(3);
        assert_eq!(sweep_axis(s.sweep.as_deref().unwrap_or_default()).expect("axis").name, "mode");
    }

    #[test]
    fn a_sweep_draws_measured_and_predicted_against_its_setting() {
        let mut s =
            Summary::new("S", "t", Scenario { name: Some("conc-sweep".into()), ..Default::default() });
        let mut points = Vec::new();
        for tp in ["2:2", "4:2"] {
            for c in [1, 2, 4] {
                let mut p = point(
                    &format!("tp={tp} c={c}"),
                    &[("tp", json!(tp)), ("concurrency", json!(c))],
                    f64::from(c),
                );
                p.series = Some(tp.into());
                p.predicted_span_p50_us = Some(900.0);
                p.measured_span_p50_us = Some(1000.0 * f64::from(c));
                points.push(p);
            }
        }
        s.sweep = Some(points);
        let svg = sweep_setting_svg(&s).expect("draw").expect("svg");
        let sk = svg_skeleton(&svg);
        for want in ["conc-sweep against concurrency", "2:2 measured", "4:2 predicted", "GB/s"] {
            assert!(sk.contains(want), "{want}:\n{sk}");
        }
        insta::assert_snapshot!("sweep_setting", sk);
        assert_eq!(sweep_setting_svg(&Summary::new("r", "t", Scenario::default())).expect("ok"), None);
    }

    #[test]
    fn a_comparison_draws_its_runs_side_by_side() {
        let (s, rows) = comparison(3);
        let runs = split_runs(&s, &rows);
        let bars = compare_bars(&s);
        assert_eq!(bars[1].samples, vec![1.5, 1.6, 1.7]);
        insta::assert_snapshot!(
            "compare_bars",
            svg_skeleton(&range_bars_svg("Throughput per run", "GB/s", &bars).expect("draw").expect("svg"))
        );
        let cdfs = stage_cdfs(&runs, Stage::E2e, "");
        assert_eq!(cdfs.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), vec!["pull", "push"]);
        let medians = median_timelines(&runs);
        assert_eq!(
            medians.iter().map(|t| t.label.as_str()).collect::<Vec<_>>(),
            vec!["pull: median request", "push: median request"]
        );
        let sk = svg_skeleton(
            &crate::report::run_charts::timelines_svg(&medians, true).expect("draw").expect("svg"),
        );
        // One time axis for both panels: the same ticks under each.
        let ticks: Vec<&str> = sk.lines().filter(|l| l.ends_with(".0") || l.ends_with("00")).collect();
        let half = ticks.len() / 2;
        assert!(half > 2 && ticks[..half] == ticks[half..], "{sk}");
        insta::assert_snapshot!("compare_medians", sk);
    }

    #[test]
    fn no_more_than_six_runs_are_overlaid() {
        let runs: Vec<NamedRun> = (0..8)
            .map(|i| NamedRun {
                name: format!("r{i}"),
                rows: (0..5).map(|n| row("P", "x", n, 1.0 + f64::from(i))).collect(),
            })
            .collect();
        assert_eq!(stage_cdfs(&runs, Stage::E2e, "").len(), MAX_SERIES);
        let bars: Vec<RangeBar> =
            (0..8).map(|i| RangeBar { name: format!("r{i}"), value: 1.0, samples: vec![] }).collect();
        let sk = svg_skeleton(&range_bars_svg("t", "GB/s", &bars).expect("draw").expect("svg"));
        assert!(sk.contains("r5") && !sk.contains("r6"), "{sk}");
    }

    #[test]
    fn the_gate_chart_marks_each_threshold() {
        use crate::report::gate::fixtures::{doc, gate};
        let r = gate(&doc(&[10.0, 10.1, 9.9], 10.0), &doc(&[8.0, 8.1, 7.9], 10.0));
        let sk = svg_skeleton(&gate_change_svg(&r).expect("draw").expect("svg"));
        assert!(sk.contains("throughput_gbps") && sk.contains("REGRESSION; threshold 10%"), "{sk}");
        insta::assert_snapshot!("gate_change", sk);
    }
}
