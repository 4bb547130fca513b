//! Two runs side by side (`kvx report A B`): metric, A, B, ratio B/A, plus what differs in
//! their scenarios and machines. Pure: takes loaded summaries, returns text or JSON. Passing
//! judgement is the gate's job, not this module's.

use serde::Serialize;
use serde_json::Value;

use super::summary::{Stage, Summary, ordered_stage_names, ratio};
use super::table::{Style, align_numbers, fmt_f, fmt_ratio, new_table, section};

/// Reads one figure out of a `T`.
type Getter<T> = fn(&T) -> f64;

/// One compared figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareRow {
    pub metric: String,
    pub a: Option<f64>,
    pub b: Option<f64>,
    /// `b / a`.
    pub ratio: Option<f64>,
    /// A count or byte total, shown without decimals.
    #[serde(skip)]
    pub integer: bool,
}

/// Two runs compared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub a_run: String,
    pub b_run: String,
    pub rows: Vec<CompareRow>,
    pub notes: Vec<String>,
}

fn row(metric: impl Into<String>, a: Option<f64>, b: Option<f64>) -> CompareRow {
    let r = match (a, b) {
        (Some(a), Some(b)) if a != 0.0 => Some(ratio(b, a)),
        (Some(a), Some(b)) if a == b => Some(1.0),
        _ => None,
    };
    CompareRow { metric: metric.into(), a, b, ratio: r, integer: false }
}

/// Compares the headline figures, every stage's percentiles and the calibrations.
pub fn compare(a: &Summary, b: &Summary) -> Comparison {
    let mut rows = Vec::new();
    let both = |f: fn(&Summary) -> f64| (Some(f(a)), Some(f(b)));
    let headline: [(&str, Getter<Summary>); 12] = [
        ("throughput_gbps", |s| s.throughput_gbps),
        ("requests_per_s", |s| s.requests_per_s),
        ("bytes_per_request", |s| s.bytes_per_request),
        ("descriptors_per_request.raw", |s| s.descriptors_per_request.raw),
        ("descriptors_per_request.coalesced", |s| s.descriptors_per_request.coalesced),
        ("requests_ok", |s| s.requests_ok as f64),
        ("requests_failed", |s| s.requests_failed as f64),
        ("requests_recomputed", |s| s.requests_recomputed as f64),
        ("verify_failures", |s| s.verify_failures as f64),
        ("blocks_leaked", |s| s.blocks_leaked as f64),
        ("blocks_expired", |s| s.blocks_expired as f64),
        ("duration_s", |s| s.duration_s),
    ];
    for (name, f) in headline {
        let (x, y) = both(f);
        let integer = name.starts_with("requests_") && name != "requests_per_s"
            || name.starts_with("blocks_")
            || name == "verify_failures"
            || name == "bytes_per_request";
        rows.push(CompareRow { integer, ..row(name, x, y) });
    }
    let mut stages: Vec<&str> = ordered_stage_names(&a.stages);
    for s in ordered_stage_names(&b.stages) {
        if !stages.contains(&s) {
            stages.push(s);
        }
    }
    // Known stages first even when only B has them.
    stages.sort_by_key(|s| Stage::from_name(s).map_or(usize::MAX, |k| k as usize));
    for stage in stages {
        let (sa, sb) = (a.stages.get(stage), b.stages.get(stage));
        let stats: [(&str, Getter<super::StageStats>); 5] = [
            ("p50_us", |s| s.p50_us),
            ("p90_us", |s| s.p90_us),
            ("p99_us", |s| s.p99_us),
            ("p999_us", |s| s.p999_us),
            ("max_us", |s| s.max_us),
        ];
        for (stat, f) in stats {
            rows.push(row(format!("stages.{stage}.{stat}"), sa.map(f), sb.map(f)));
        }
    }
    let cal = |s: &Summary, name: &str| s.calibration.as_ref().and_then(|c| c.figure(name));
    for name in ["memcpy_gbps", "ucx_loopback_gbps"] {
        let (x, y) = (cal(a, name), cal(b, name));
        if x.is_some() || y.is_some() {
            rows.push(row(format!("calibration.{name}"), x, y));
        }
    }
    let to_value = |s: &Summary| serde_json::to_value(s).unwrap_or(Value::Null);
    let mut notes = Vec::new();
    if a.run_kind() != b.run_kind() {
        notes.push(format!(
            "A is a {} run and B a {} run: they measure different things (kvx bench: KV reads \
             between ranks; kvx load: HTTP requests end to end), so their ratios mean little",
            a.run_kind(),
            b.run_kind()
        ));
    }
    notes.extend(super::gate::context_notes(&to_value(a), &to_value(b)));
    Comparison { a_run: a.run_id.clone(), b_run: b.run_id.clone(), rows, notes }
}

/// The comparison as a table (terminal or Markdown), with its notes.
pub fn render(c: &Comparison, style: Style) -> String {
    let t = table(c, style);
    let mut out = section("Comparison", &t, style);
    for n in &c.notes {
        out.push_str(&match style {
            Style::Terminal => format!("note: {n}\n"),
            Style::Markdown => format!("\n- {n}"),
        });
    }
    if style == Style::Markdown && !c.notes.is_empty() {
        out.push('\n');
    }
    out
}

/// The comparison's table: metric, A, B, B/A.
pub fn table(c: &Comparison, style: Style) -> comfy_table::Table {
    let a = format!("A: {}", c.a_run);
    let b = format!("B: {}", c.b_run);
    let mut t = new_table(style, &["metric", &a, &b, "B/A"]);
    for r in &c.rows {
        let opt = |v: Option<f64>| match v {
            None => "-".into(),
            Some(x) if r.integer => format!("{x:.0}"),
            Some(x) => fmt_f(x),
        };
        t.add_row(vec![r.metric.clone(), opt(r.a), opt(r.b), r.ratio.map_or_else(|| "-".into(), fmt_ratio)]);
    }
    align_numbers(&mut t, 1);
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::summary::{Scenario, StageStats};

    #[test]
    fn ratios_are_b_over_a_and_stages_are_unioned() {
        let mut a = Summary::new("a", "t", Scenario { p_tp: Some(8), ..Default::default() });
        let mut b = Summary::new("b", "t", Scenario { p_tp: Some(4), ..Default::default() });
        a.throughput_gbps = 10.0;
        b.throughput_gbps = 5.0;
        a.stages.insert("e2e".into(), StageStats { p50_us: 100.0, ..Default::default() });
        b.stages.insert("e2e".into(), StageStats { p50_us: 150.0, ..Default::default() });
        b.stages.insert("queue".into(), StageStats { p50_us: 1.0, ..Default::default() });
        let c = compare(&a, &b);
        let get = |m: &str| c.rows.iter().find(|r| r.metric == m).cloned().expect(m);
        assert_eq!(get("throughput_gbps").ratio, Some(0.5));
        assert_eq!(get("stages.e2e.p50_us").ratio, Some(1.5));
        assert_eq!(get("stages.queue.p50_us").a, None);
        assert_eq!(get("requests_failed").ratio, Some(1.0));
        let queue_pos = c.rows.iter().position(|r| r.metric == "stages.queue.p50_us");
        let e2e_pos = c.rows.iter().position(|r| r.metric == "stages.e2e.p50_us");
        assert!(queue_pos < e2e_pos);
        assert!(c.notes.iter().any(|n| n.contains("p_tp 8 -> 4")), "{:?}", c.notes);
        let text = render(&c, Style::Terminal);
        assert!(text.contains("A: a") && text.contains("B: b") && text.contains("0.500x"), "{text}");
    }

    #[test]
    fn a_bench_run_against_a_load_run_says_so() {
        let bench = Summary::new("a", "t", Scenario { p_tp: Some(8), ..Default::default() });
        let mut load = Summary::new("b", "t", Scenario::default());
        load.scenario.extra.endpoint = Some(crate::vocab::kinds::Endpoint::Completions);
        assert_eq!((bench.run_kind(), load.run_kind()), ("kvx bench", "kvx load"));
        let c = compare(&bench, &load);
        assert!(
            c.notes.first().is_some_and(|n| n.contains("A is a kvx bench run and B a kvx load run")),
            "{:?}",
            c.notes
        );
        assert!(!compare(&bench, &bench).notes.iter().any(|n| n.contains("kvx load")));
    }
}
