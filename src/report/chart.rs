//! Pure SVG charts (plotters, SVG backend only): bandwidth against message size for sweeps,
//! a serving run's TTFT waterfall, grouped bars; the shared line-chart drawer. The charts of
//! one run's requests are in `run_charts`.
//!
//! Each function returns the SVG text, or `None` when the run has no data for that chart. Must
//! not touch the file system (`files.rs` writes the charts).

use std::collections::BTreeMap;

use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;

use super::ReportError;
use super::summary::Summary;
use super::table::fmt_bytes;

const SIZE: (u32, u32) = (960, 560);

/// Fixed colours so a stage keeps its colour from chart to chart and run to run.
const COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

pub(crate) fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

fn chart_err(chart: &'static str) -> impl Fn(String) -> ReportError {
    move |reason| ReportError::Chart { chart, reason }
}

/// One named line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

// The run's own charts (latency CDFs, the run over time) live in `run_charts`.

/// Sweep points as bandwidth against bytes per descriptor (or block size), one line per series.
pub fn sweep_series(summary: &Summary) -> (Vec<Series>, &'static str) {
    let Some(points) = summary.sweep.as_deref() else { return (Vec::new(), "") };
    let by_desc = points.iter().any(|p| p.bytes_per_descriptor.is_some_and(|b| b > 0.0));
    let x_of = |p: &super::summary::SweepPoint| {
        if by_desc { p.bytes_per_descriptor } else { p.block_size.map(f64::from) }.filter(|x| *x > 0.0)
    };
    let mut groups: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for p in points {
        if let Some(x) = x_of(p) {
            groups
                .entry(p.series.clone().unwrap_or_else(|| "all".into()))
                .or_default()
                .push((x, p.throughput_gbps));
        }
    }
    let series = groups
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name, points }
        })
        .collect();
    (series, if by_desc { "bytes per descriptor" } else { "block size (tokens)" })
}

/// Bandwidth against message size for a sweep.
pub fn sweep_svg(summary: &Summary) -> Result<Option<String>, ReportError> {
    let (series, x_desc) = sweep_series(summary);
    if series.is_empty() {
        return Ok(None);
    }
    let x_axis = if x_desc.starts_with("bytes") { Axis::LogBytes } else { Axis::Log };
    let plot = Plot {
        title: "Bandwidth against message size",
        x_desc,
        y_desc: "GB/s",
        series: &series,
        x_axis,
        y_axis: Axis::LinearFromZero,
        chart: "sweep",
    };
    draw(&plot).map(Some)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Axis {
    LinearFromZero,
    Log,
    LogBytes,
}

fn range(axis: Axis, values: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match axis {
        Axis::Log | Axis::LogBytes => {
            let lo = v.iter().copied().filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
            let lo = if lo.is_finite() { lo } else { 1.0 };
            let hi = if hi > lo { hi } else { lo * 10.0 };
            (lo / 1.5, hi * 1.5)
        }
        Axis::LinearFromZero => (0.0, if hi > 0.0 { hi * 1.1 } else { 1.0 }),
    }
}

fn label(axis: Axis, v: f64) -> String {
    match axis {
        Axis::LogBytes => fmt_bytes(v).replace(".00 ", " "),
        _ if v.abs() >= 100.0 || v == v.trunc() => format!("{v:.0}"),
        _ if v.abs() >= 1.0 => format!("{v:.1}"),
        _ => format!("{v:.3}"),
    }
}

/// One line chart: its words, its series and its axes.
struct Plot<'s> {
    title: &'s str,
    x_desc: &'s str,
    y_desc: &'s str,
    series: &'s [Series],
    x_axis: Axis,
    y_axis: Axis,
    /// The chart's name in errors.
    chart: &'static str,
}

fn draw(plot: &Plot<'_>) -> Result<String, ReportError> {
    let Plot { title, series, x_axis, y_axis, chart, .. } = *plot;
    let (x0, x1) = range(x_axis, series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = range(y_axis, series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let x_log = matches!(x_axis, Axis::Log | Axis::LogBytes);
    // Sizes are powers of two: ticks at 1 KiB, 4 KiB, 16 KiB... read better than 9.77 KiB.
    let x_base = if x_axis == Axis::LogBytes { 4.0 } else { 2.0 };
    let y_log = matches!(y_axis, Axis::Log | Axis::LogBytes);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| chart_err(chart)(e.to_string()))?;
        // Four combinations of linear and log axes are four chart types in plotters.
        match (x_log, y_log) {
            (false, false) => {
                let c = base(&root, title)
                    .build_cartesian_2d(x0..x1, y0..y1)
                    .map_err(|e| chart_err(chart)(e.to_string()))?;
                finish(c, plot)?
            }
            (false, true) => {
                let c = base(&root, title)
                    .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                    .map_err(|e| chart_err(chart)(e.to_string()))?;
                finish(c, plot)?
            }
            (true, false) => {
                let c = base(&root, title)
                    .build_cartesian_2d((x0..x1).log_scale().base(x_base), y0..y1)
                    .map_err(|e| chart_err(chart)(e.to_string()))?;
                finish(c, plot)?
            }
            (true, true) => {
                let c = base(&root, title)
                    .build_cartesian_2d((x0..x1).log_scale().base(x_base), (y0..y1).log_scale())
                    .map_err(|e| chart_err(chart)(e.to_string()))?;
                finish(c, plot)?
            }
        }
        root.present().map_err(|e| chart_err(chart)(e.to_string()))?;
    }
    Ok(svg)
}

fn base<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    title: &str,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut b = ChartBuilder::on(root);
    b.caption(title, ("sans-serif", 22))
        .margin(16)
        .margin_right(40)
        .x_label_area_size(48)
        .y_label_area_size(72);
    b
}

fn finish<'a, X, Y>(
    mut c: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    plot: &Plot<'_>,
) -> Result<(), ReportError>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let Plot { x_desc, y_desc, series, x_axis, y_axis, chart, .. } = *plot;
    let err = chart_err(chart);
    let xf = move |v: &f64| label(x_axis, *v);
    let yf = move |v: &f64| label(y_axis, *v);
    let x_labels = 10;
    c.configure_mesh()
        .x_labels(x_labels)
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&xf)
        .y_label_formatter(&yf)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, s) in series.iter().enumerate() {
        let col = colour(i);
        c.draw_series(LineSeries::new(s.points.iter().copied(), col.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
        c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, col.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// The TTFT waterfall: one stacked horizontal bar per row of [`super::waterfall::Waterfall`]
/// (the mean request, then the requests at the TTFT p50, p90 and p99), one colour per stage.
/// `None` when the run has no waterfall.
pub fn waterfall_svg(summary: &Summary) -> Result<Option<String>, ReportError> {
    let Some(w) = summary.waterfall.as_ref().filter(|w| !w.bars.is_empty()) else { return Ok(None) };
    let err = chart_err("waterfall");
    let n = w.bars.len();
    let max_ms = w.bars.iter().map(|b| b.ttft_us / 1e3).fold(0.0, f64::max).max(1e-3) * 1.08;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT waterfall: where the time to first token went", ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(110)
            .build_cartesian_2d(0f64..max_ms, 0f64..n as f64)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc("milliseconds (client-side TTFT, split by stage)")
            .draw()
            .map_err(|e| err(e.to_string()))?;
        // Row i from the top: the mean first.
        let row = |i: usize| (n - 1 - i) as f64;
        for (i, bar) in w.bars.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(0.0, row(i) + 0.55));
            root.draw(&Text::new(bar.label.clone(), (x - 105, y - 7), ("sans-serif", 14)))
                .map_err(|e| err(e.to_string()))?;
            let (x, y) = chart.backend_coord(&(bar.ttft_us / 1e3, row(i) + 0.55));
            root.draw(&Text::new(format!("{:.2} ms", bar.ttft_us / 1e3), (x + 4, y - 7), ("sans-serif", 12)))
                .map_err(|e| err(e.to_string()))?;
        }
        for (s, stage) in w.stages.iter().enumerate() {
            let c = colour(s);
            let mut rects = Vec::new();
            for (i, bar) in w.bars.iter().enumerate() {
                let start: f64 = bar.stages_us[..s].iter().sum::<f64>() / 1e3;
                let v = bar.stages_us.get(s).copied().unwrap_or(0.0) / 1e3;
                if v > 0.0 {
                    rects
                        .push(Rectangle::new([(start, row(i) + 0.2), (start + v, row(i) + 0.9)], c.filled()));
                }
            }
            chart
                .draw_series(rects)
                .map_err(|e| err(e.to_string()))?
                .label(stage.name.clone())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.85))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))?;
    }
    Ok(Some(out))
}

/// The texts of an SVG and how many rectangles, lines, circles and polygons it draws: what a
/// chart says, without the pixels (for snapshots).
#[cfg(test)]
pub(crate) fn svg_skeleton(svg: &str) -> String {
    let doc = roxmltree::Document::parse(svg).expect("well-formed SVG");
    let count = |tag: &str| doc.descendants().filter(|n| n.has_tag_name(tag)).count();
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text().map(|t| t.trim().to_string()))
        .filter(|t| !t.is_empty())
        .collect();
    format!(
        "rect {} polyline {} circle {} polygon {}\n{}",
        count("rect"),
        count("polyline"),
        count("circle"),
        count("polygon"),
        texts.join("\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::{Scenario, SweepPoint};

    #[test]
    fn sweep_groups_by_series_and_sorts() {
        let mut s = Summary::new("r", "t", Scenario::default());
        let p = |series: &str, x: f64, y: f64| SweepPoint {
            series: Some(series.into()),
            bytes_per_descriptor: Some(x),
            throughput_gbps: y,
            ..Default::default()
        };
        s.sweep = Some(vec![p("nhd", 4096.0, 2.0), p("hnd", 512.0, 1.0), p("nhd", 1024.0, 1.5)]);
        let (series, x) = sweep_series(&s);
        assert_eq!(x, "bytes per descriptor");
        assert_eq!(series[0], Series { name: "hnd".into(), points: vec![(512.0, 1.0)] });
        assert_eq!(series[1], Series { name: "nhd".into(), points: vec![(1024.0, 1.5), (4096.0, 2.0)] });
    }

    #[test]
    fn waterfall_chart_draws_every_bar_and_stage() {
        use crate::report::waterfall::{Breakdown, N, WaterfallBuilder};
        let mut b = WaterfallBuilder::new();
        for i in 1..=10u64 {
            let mut x: Breakdown = [0; N];
            x[0] = 100_000 * i;
            x[5] = 2_000_000;
            x[8] = 15_000_000;
            b.add(std::time::Duration::from_nanos(x.iter().sum()), x);
        }
        let mut s = Summary::new("r", "t", Scenario::default());
        s.waterfall = b.finish();
        let svg = waterfall_svg(&s).expect("chart").expect("a waterfall");
        let doc = roxmltree::Document::parse(&svg).expect("valid SVG");
        let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
        for want in ["mean", "p50 request", "p99 request", "kv_transfer", "first_decode_step"] {
            assert!(texts.iter().any(|t| t.contains(want)), "{want} missing");
        }
        assert_eq!(waterfall_svg(&Summary::new("r", "t", Scenario::default())).expect("ok"), None);
    }

    #[test]
    fn no_data_no_chart() {
        let s = Summary::new("r", "t", Scenario::default());
        assert_eq!(sweep_svg(&s).expect("ok"), None);
    }
}

/// One bar group of a transport comparison: label and (name, value) per measure.
#[derive(Debug, Clone)]
pub struct Bars {
    pub label: String,
    pub values: Vec<(String, f64)>,
}

/// Grouped bars, one group per label (e.g. transports), one bar per measure; each measure is
/// scaled to its own maximum so throughput and latency share one chart (value on the bar).
pub fn bars_svg(title: &str, groups: &[Bars]) -> Result<String, ReportError> {
    use plotters::prelude::*;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
        let measures: Vec<String> =
            groups.first().map(|g| g.values.iter().map(|(n, _)| n.clone()).collect()).unwrap_or_default();
        let maxes: Vec<f64> = (0..measures.len())
            .map(|m| {
                groups.iter().filter_map(|g| g.values.get(m).map(|v| v.1)).fold(0.0, f64::max).max(1e-12)
            })
            .collect();
        let n = groups.len().max(1) as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(40)
            .build_cartesian_2d(0f64..n, 0f64..1.15f64)
            .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc("relative to the best")
            .draw()
            .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
        let width = 0.8 / measures.len().max(1) as f64;
        for (gi, g) in groups.iter().enumerate() {
            root.draw(&Text::new(
                g.label.clone(),
                chart.backend_coord(&(gi as f64 + 0.35, 0.0)),
                ("sans-serif", 14),
            ))
            .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
            for (mi, (_, v)) in g.values.iter().enumerate() {
                let x0 = gi as f64 + 0.1 + mi as f64 * width;
                let h = v / maxes[mi];
                let color = Palette99::pick(mi).to_rgba();
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x0, 0.0), (x0 + width * 0.9, h)],
                        color.filled(),
                    )))
                    .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?
                    .label(measures[mi].clone())
                    .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!("{v:.3}"),
                        (x0, h + 0.03),
                        ("sans-serif", 11),
                    )))
                    .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
            }
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
        root.present().map_err(|e| ReportError::Chart { chart: "transports", reason: e.to_string() })?;
    }
    Ok(out)
}
