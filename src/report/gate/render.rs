//! The verdict for people: a table for a terminal ([`render_table`]), Markdown for a CI job
//! summary or a PR comment ([`render_markdown`]), JSON ([`to_json`]), and the answers of a gate
//! that could not decide. Pure: strings out, no I/O.

use serde_json::Value;

use super::thresholds::{Better, Kind};
use super::verdict::{GateReport, MetricResult, MetricVerdict, Verdict};
use crate::report::table::{Style, fmt_f, fmt_ratio, new_table};

fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

fn threshold_text(m: &MetricResult) -> String {
    match m.kind {
        Kind::Relative => format!("{:.0}%", m.threshold * 100.0),
        Kind::Absolute => format!("+{}", fmt_f(m.threshold)),
    }
}

fn verdict_text(m: &MetricResult) -> String {
    let v = match m.verdict {
        MetricVerdict::Pass => "pass",
        MetricVerdict::Improved => "improved",
        MetricVerdict::WithinNoise => "pass (within noise)",
        MetricVerdict::Regression => "REGRESSION",
        MetricVerdict::Skipped => "skipped (missing)",
    };
    if m.enforced || m.verdict == MetricVerdict::Skipped {
        v.to_string()
    } else {
        format!("{} (not gated)", v.to_lowercase())
    }
}

fn change_text(m: &MetricResult) -> String {
    let Some(c) = m.change else { return "-".into() };
    // Shown in the metric's own direction: throughput -12%, latency +12%.
    let signed = match m.better {
        Better::Higher => -c,
        Better::Lower => c,
    };
    match m.kind {
        // Rounded first, and + 0.0 turns a -0.0 into 0.0, so no change never reads "-0.0%".
        Kind::Relative => format!("{:+.1}%", (signed * 1000.0).round() / 10.0 + 0.0),
        Kind::Absolute => format!("{:+}", signed + 0.0),
    }
}

/// A metric value: counts (absolute metrics) as integers when they are.
fn value_text(m: &MetricResult, v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if m.kind == Kind::Absolute && x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.0}"),
        Some(x) => fmt_f(x),
    }
}

fn samples_text(n: usize) -> String {
    if n > 1 { format!(" (median of {n})") } else { String::new() }
}

/// The metric table in `style`.
pub fn metric_table(r: &GateReport, style: Style) -> comfy_table::Table {
    let mut t = new_table(
        style,
        &[
            "metric",
            "baseline",
            "current",
            "ratio",
            "normalised",
            "change",
            "threshold",
            "noise ±",
            "verdict",
        ],
    );
    for m in &r.metrics {
        t.add_row(vec![
            m.metric.clone(),
            format!("{}{}", value_text(m, m.baseline), samples_text(m.baseline_samples)),
            format!("{}{}", value_text(m, m.current), samples_text(m.current_samples)),
            m.ratio_raw.map_or_else(|| "-".into(), fmt_ratio),
            if m.normalized { m.ratio.map_or_else(|| "-".into(), fmt_ratio) } else { "-".into() },
            change_text(m),
            threshold_text(m),
            m.noise.map_or_else(|| "-".into(), pct),
            verdict_text(m),
        ]);
    }
    crate::report::table::align_numbers(&mut t, 1);
    t
}

fn calibration_lines(r: &GateReport) -> Vec<String> {
    let c = &r.calibration;
    let mut lines = Vec::new();
    let figs: Vec<String> = c
        .figures
        .iter()
        .map(|f| {
            let opt = |v: Option<f64>| v.map_or_else(|| "missing".into(), fmt_f);
            format!(
                "{} {} -> {}{}",
                f.name,
                opt(f.baseline),
                opt(f.current),
                f.ratio.map_or_else(String::new, |x| format!(" ({})", fmt_ratio(x)))
            )
        })
        .collect();
    if !figs.is_empty() {
        lines.push(format!("calibration: {}", figs.join(", ")));
    }
    match c.factor {
        Some(f) => lines.push(format!(
            "machine speed, current over baseline: {} (relative metrics normalised by {}{})",
            fmt_ratio(f),
            c.used.join(" and "),
            if c.per_repeat { ", per repeat" } else { "" }
        )),
        None => lines.push("machine speed: unknown (metrics compared raw)".into()),
    }
    lines
}

/// The widest repeat-to-repeat spread of the gated relative metrics, per run: what a
/// preset must keep near 3% for the gate to see a 15% slowdown (module docs).
fn spread_line(r: &GateReport) -> Option<String> {
    let gated = || r.metrics.iter().filter(|m| m.enforced && m.kind == Kind::Relative);
    let widest = |f: fn(&MetricResult) -> Option<f64>| {
        gated().filter_map(f).fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))))
    };
    let samples = |f: fn(&MetricResult) -> usize| gated().map(f).max().unwrap_or(0);
    let (b, c) = (widest(|m| m.baseline_spread), widest(|m| m.current_spread));
    if b.is_none() && c.is_none() {
        return None;
    }
    let show =
        |v: Option<f64>, n: usize| v.map_or_else(|| format!("- (n={n})"), |v| format!("±{} (n={n})", pct(v)));
    Some(format!(
        "spread of repeats (robust sd, widest gated metric): baseline {}, current {}",
        show(b, samples(|m| m.baseline_samples)),
        show(c, samples(|m| m.current_samples))
    ))
}

fn noise_line(r: &GateReport) -> String {
    match r.noise_floor {
        Some(n) => format!(
            "noise floor: ±{} ({} standard errors of the median ratio, widest gated metric); \
             smaller changes cannot be told from noise",
            pct(n),
            fmt_f(r.noise_z)
        ),
        None => "noise floor: unknown (one sample per run; run `kvx bench --repeat N` to measure it)".into(),
    }
}

fn verdict_line(r: &GateReport) -> String {
    match r.verdict {
        Verdict::Pass => "verdict: PASS".into(),
        Verdict::Regression => {
            let which: Vec<String> =
                r.regressions().map(|m| format!("{} {}", m.metric, change_text(m))).collect();
            format!("verdict: REGRESSION ({})", which.join(", "))
        }
    }
}

/// What the verdict rests on, a line each: the calibration and the machine's speed, the
/// spread of repeats, the noise floor, the verdict.
pub fn summary_lines(r: &GateReport) -> Vec<String> {
    let mut lines = calibration_lines(r);
    lines.extend(spread_line(r));
    lines.push(noise_line(r));
    lines.push(verdict_line(r));
    lines
}

/// The verdict for a terminal.
pub fn render_table(r: &GateReport) -> String {
    let mut out = format!(
        "kvx gate: current {} ({}) against baseline {} ({})\n",
        r.current_run, r.current, r.baseline_run, r.baseline
    );
    for l in calibration_lines(r) {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str(&metric_table(r, Style::Terminal).to_string());
    out.push('\n');
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    if let Some(l) = spread_line(r) {
        out.push_str(&l);
        out.push('\n');
    }
    out.push_str(&noise_line(r));
    out.push('\n');
    out.push_str(&verdict_line(r));
    out.push('\n');
    out
}

/// The verdict as Markdown, for a CI job summary or a PR comment.
pub fn render_markdown(r: &GateReport) -> String {
    let head = match r.verdict {
        Verdict::Pass => "## kvx gate: ✅ pass",
        Verdict::Regression => "## kvx gate: ❌ regression",
    };
    let mut out =
        format!("{head}\n\nCurrent run `{}` against baseline `{}`.\n\n", r.current_run, r.baseline_run);
    for l in calibration_lines(r) {
        out.push_str(&format!("- {l}\n"));
    }
    if let Some(l) = spread_line(r) {
        out.push_str(&format!("- {l}\n"));
    }
    out.push_str(&format!("- {}\n\n", noise_line(r)));
    out.push_str(&metric_table(r, Style::Markdown).to_string());
    out.push_str("\n\n");
    if !r.notes.is_empty() {
        out.push_str("**Notes**\n\n");
        for n in &r.notes {
            out.push_str(&format!("- {n}\n"));
        }
        out.push('\n');
    }
    out.push_str(&format!("**{}**\n", verdict_line(r)));
    out
}

/// The verdict as JSON: `{verdict, metrics, noise_floor, calibration, notes, ...}`.
pub fn to_json(r: &GateReport) -> Value {
    serde_json::to_value(r).unwrap_or_else(|e| error_json(&format!("encoding the verdict: {e}")))
}

/// The JSON verdict of a gate that could not decide.
pub fn error_json(message: &str) -> Value {
    serde_json::json!({ "verdict": "error", "error": message })
}

/// The Markdown of a gate that could not decide.
pub fn error_markdown(message: &str) -> String {
    format!("## kvx gate: ⚠️ error\n\n{message}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::gate::fixtures::{doc, gate};

    #[test]
    fn json_and_markdown_carry_the_verdict() {
        let b = doc(&[10.0, 10.1, 9.9], 10.0);
        let c = doc(&[8.0, 8.1, 7.9], 10.0);
        let r = gate(&b, &c);
        let j = to_json(&r);
        assert_eq!(j["verdict"], "regression");
        assert_eq!(j["metrics"][0]["metric"], "throughput_gbps");
        assert_eq!(j["metrics"][0]["verdict"], "regression");
        assert!(j["noise_floor"].is_number());
        let md = render_markdown(&r);
        assert!(md.starts_with("## kvx gate: ❌ regression"));
        assert!(md.contains("| throughput_gbps "), "{md}");
        assert_eq!(error_json("x")["verdict"], "error");
    }
}
