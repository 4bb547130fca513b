//! The comparison ([`evaluate`]): each rule's samples taken from both runs (the repeats', or
//! the one top-level value), normalised by the runs' calibration, compared median to median,
//! and judged by the threshold and the noise rule (the module docs say why); the whole run's
//! checks (same work, plausible calibration) first, its notes after.

use serde_json::Value;

use super::calibration::{calibration_scalar, check_calibration, figure};
use super::doc::{Doc, lookup_f64};
use super::runs::{context_notes, work_differences};
use super::thresholds::{Better, Kind, MetricRule, Thresholds};
use super::verdict::{CalibrationFigure, CalibrationView, GateReport, MetricResult, MetricVerdict, Verdict};
use crate::report::ReportError;
use crate::report::stats::{Robust, rel_se_of_median};
use crate::report::table::fmt_ratio;

/// A metric's samples in one run, with the machine-speed scalar of each.
struct Samples {
    raw: Vec<f64>,
    cal: Option<Vec<f64>>,
    per_repeat_cal: bool,
}

fn samples(doc: &Value, metric: &str, figures: &[String], from_repeats: bool) -> Option<Samples> {
    let run_cal = calibration_scalar(doc.get("calibration"), figures);
    if from_repeats && let Some(reps) = doc.get("repeats").and_then(Value::as_array).filter(|r| !r.is_empty())
    {
        let vals: Option<Vec<f64>> = reps.iter().map(|r| lookup_f64(r, metric)).collect();
        if let Some(raw) = vals {
            let rep_cal: Option<Vec<f64>> =
                reps.iter().map(|r| calibration_scalar(r.get("calibration"), figures)).collect();
            return Some(match rep_cal {
                Some(c) => Samples { raw, cal: Some(c), per_repeat_cal: true },
                None => {
                    let n = raw.len();
                    Samples { raw, cal: run_cal.map(|c| vec![c; n]), per_repeat_cal: false }
                }
            });
        }
    }
    let v = lookup_f64(doc, metric)?;
    Some(Samples { raw: vec![v], cal: run_cal.map(|c| vec![c]), per_repeat_cal: false })
}

fn normalised(s: &Samples, better: Better) -> Option<Vec<f64>> {
    let cal = s.cal.as_ref()?;
    Some(
        s.raw
            .iter()
            .zip(cal)
            .map(|(v, c)| match better {
                Better::Higher => v / c,
                Better::Lower => v * c,
            })
            .collect(),
    )
}

fn ratio_of(cur: f64, base: f64) -> Option<f64> {
    if base != 0.0 {
        Some(cur / base)
    } else if cur == 0.0 {
        Some(1.0)
    } else {
        None
    }
}

/// Compares `current` with `baseline` under `th`. Both documents must have passed the schema
/// check. Errors only for a required metric missing from either.
pub fn evaluate(baseline: Doc<'_>, current: Doc<'_>, th: &Thresholds) -> Result<GateReport, ReportError> {
    let differences = work_differences(baseline.value, current.value);
    if !differences.is_empty() {
        return Err(ReportError::ScenarioMismatch { differences: differences.join(", ") });
    }
    for (side, doc) in [("baseline", &baseline), ("current", &current)] {
        check_calibration(side, doc, &th.calibration)?;
    }
    let mut notes = context_notes(baseline.value, current.value);
    let used: Vec<String> = th
        .calibration
        .iter()
        .filter(|f| figure(baseline.value, f).is_some() && figure(current.value, f).is_some())
        .cloned()
        .collect();
    let figures: Vec<CalibrationFigure> = th
        .calibration
        .iter()
        .map(|f| {
            let (b, c) = (figure(baseline.value, f), figure(current.value, f));
            CalibrationFigure {
                name: f.clone(),
                baseline: b,
                current: c,
                ratio: b.zip(c).and_then(|(b, c)| ratio_of(c, b)),
            }
        })
        .collect();
    let factor = calibration_scalar(current.value.get("calibration"), &used)
        .zip(calibration_scalar(baseline.value.get("calibration"), &used))
        .map(|(c, b)| c / b);
    if used.is_empty() && !th.calibration.is_empty() {
        notes.push(format!(
            "no calibration figure ({}) is in both runs: metrics are compared raw, so a slower machine \
             reads as a slower kvx",
            th.calibration.join(", ")
        ));
    }
    if let Some(f) = factor.filter(|f| !(0.5..=2.0).contains(f)) {
        notes.push(format!(
            "the machines differ by {} in calibration: normalisation assumes kvx scales with it; \
             compare runs from similar machines where you can",
            fmt_ratio(f)
        ));
    }

    let mut metrics = Vec::new();
    let mut per_repeat_all = true;
    for rule in &th.rules {
        let from_repeats = rule.kind == Kind::Relative;
        let figs: &[String] = if rule.normalize { &used } else { &[] };
        let b = samples(baseline.value, &rule.name, figs, from_repeats);
        let c = samples(current.value, &rule.name, figs, from_repeats);
        let (b, c) = match (b, c) {
            (Some(b), Some(c)) => (b, c),
            (b, _) => {
                let (side, path) =
                    if b.is_none() { ("baseline", baseline.path) } else { ("current", current.path) };
                if rule.required {
                    return Err(ReportError::MissingMetric {
                        metric: rule.name.clone(),
                        side,
                        path: path.to_path_buf(),
                    });
                }
                metrics.push(skipped(rule));
                continue;
            }
        };
        if rule.normalize && !used.is_empty() {
            per_repeat_all &= b.per_repeat_cal && c.per_repeat_cal;
        }
        metrics.push(compare_metric(rule, &b, &c, th));
    }

    let noise_floor = metrics
        .iter()
        .filter(|m| m.enforced && m.kind == Kind::Relative)
        .filter_map(|m| m.noise)
        .fold(None, |acc: Option<f64>, n| Some(acc.map_or(n, |a| a.max(n))));
    for m in metrics.iter().filter(|m| m.enforced && m.verdict == MetricVerdict::WithinNoise) {
        notes.push(format!(
            "{} is worse by {:.1}%, beyond its {:.0}% threshold but within the noise ({:.1}%): not counted; \
             run more repeats to decide",
            m.metric,
            m.change.unwrap_or(0.0) * 100.0,
            m.threshold * 100.0,
            m.noise.unwrap_or(0.0) * 100.0
        ));
    }
    let verdict = if metrics.iter().any(MetricResult::fails) { Verdict::Regression } else { Verdict::Pass };
    let run_id = |v: &Value| v.get("run_id").and_then(Value::as_str).unwrap_or("?").to_string();
    Ok(GateReport {
        verdict,
        baseline: baseline.path.display().to_string(),
        current: current.path.display().to_string(),
        baseline_run: run_id(baseline.value),
        current_run: run_id(current.value),
        metrics,
        noise_floor,
        noise_z: th.noise_z,
        calibration: CalibrationView {
            figures,
            factor,
            per_repeat: !used.is_empty() && per_repeat_all,
            used,
        },
        notes,
    })
}

fn skipped(rule: &MetricRule) -> MetricResult {
    MetricResult {
        metric: rule.name.clone(),
        better: rule.better,
        kind: rule.kind,
        enforced: rule.enforce,
        baseline: None,
        current: None,
        ratio_raw: None,
        ratio: None,
        change: None,
        threshold: rule.threshold,
        noise: None,
        normalized: false,
        baseline_samples: 0,
        current_samples: 0,
        baseline_spread: None,
        current_spread: None,
        verdict: MetricVerdict::Skipped,
    }
}

fn compare_metric(rule: &MetricRule, b: &Samples, c: &Samples, th: &Thresholds) -> MetricResult {
    let rb_raw = Robust::of(&b.raw);
    let rc_raw = Robust::of(&c.raw);
    let base = rb_raw.map(|r| r.median);
    let cur = rc_raw.map(|r| r.median);
    let ratio_raw = base.zip(cur).and_then(|(b, c)| ratio_of(c, b));
    let mut out = MetricResult {
        metric: rule.name.clone(),
        better: rule.better,
        kind: rule.kind,
        enforced: rule.enforce,
        baseline: base,
        current: cur,
        ratio_raw,
        ratio: ratio_raw,
        change: None,
        threshold: rule.threshold,
        noise: None,
        normalized: false,
        baseline_samples: b.raw.len(),
        current_samples: c.raw.len(),
        baseline_spread: None,
        current_spread: None,
        verdict: MetricVerdict::Pass,
    };
    if rule.kind == Kind::Absolute {
        if let (Some(bv), Some(cv)) = (base, cur) {
            let change = match rule.better {
                Better::Lower => cv - bv,
                Better::Higher => bv - cv,
            };
            out.change = Some(change);
            out.verdict = if change > rule.threshold {
                MetricVerdict::Regression
            } else if -change > rule.threshold {
                MetricVerdict::Improved
            } else {
                MetricVerdict::Pass
            };
        }
        return out;
    }

    let (nb, nc) = match (normalised(b, rule.better), normalised(c, rule.better)) {
        (Some(nb), Some(nc)) if rule.normalize => {
            out.normalized = true;
            (nb, nc)
        }
        _ => (b.raw.clone(), c.raw.clone()),
    };
    let (Some(rb), Some(rc)) = (Robust::of(&nb), Robust::of(&nc)) else { return out };
    out.baseline_spread = rb.rel_sd();
    out.current_spread = rc.rel_sd();
    out.ratio = ratio_of(rc.median, rb.median);
    let Some(ratio) = out.ratio else { return out };
    let change = match rule.better {
        Better::Higher => 1.0 - ratio,
        Better::Lower => ratio - 1.0,
    };
    out.change = Some(change);
    // A side with one sample has shown no spread; its error is the other side's spread.
    let spreads = match (out.baseline_spread, out.current_spread) {
        (Some(sb), Some(sc)) => Some((sb, sc)),
        (Some(s), None) | (None, Some(s)) => Some((s, s)),
        (None, None) => None,
    };
    let noise = spreads
        .map(|(sb, sc)| {
            let se = rel_se_of_median(sb, rb.n).hypot(rel_se_of_median(sc, rc.n));
            (th.noise_z * se).max(th.min_noise)
        })
        .or((th.min_noise > 0.0).then_some(th.min_noise));
    out.noise = noise;
    let beyond_noise = |x: f64| noise.is_none_or(|n| x > n);
    out.verdict = if change > rule.threshold {
        if beyond_noise(change) { MetricVerdict::Regression } else { MetricVerdict::WithinNoise }
    } else if -change > rule.threshold && beyond_noise(-change) {
        MetricVerdict::Improved
    } else {
        MetricVerdict::Pass
    };
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::report::gate::fixtures::{doc, gate, th};
    use crate::report::gate::render_table;

    #[test]
    fn a_three_percent_wobble_passes() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        let c = doc(&[9.7, 9.9, 9.6, 10.0, 9.75], 10.0);
        let r = gate(&b, &c);
        assert_eq!(r.verdict, Verdict::Pass, "{}", render_table(&r));
        let t = &r.metrics[0];
        assert_eq!(t.baseline_samples, 5);
        assert!(t.change.expect("change") > 0.02 && t.change.expect("change") < 0.04);
        assert!(r.noise_floor.is_some());
    }

    #[test]
    fn a_twenty_percent_drop_fails() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        let c = doc(&[8.0, 8.1, 7.9, 8.05, 7.95], 10.0);
        let r = gate(&b, &c);
        assert_eq!(r.verdict, Verdict::Regression, "{}", render_table(&r));
        let failed: Vec<&str> = r.regressions().map(|m| m.metric.as_str()).collect();
        assert_eq!(failed, vec!["throughput_gbps", "stages.transfer.p50_us", "stages.e2e.p50_us"]);
    }

    #[test]
    fn a_slower_machine_with_a_proportionally_slower_kvx_passes() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        let c = doc(&[5.0, 5.1, 4.95, 5.05, 4.9], 5.0);
        let r = gate(&b, &c);
        assert_eq!(r.verdict, Verdict::Pass, "{}", render_table(&r));
        let t = &r.metrics[0];
        assert!((t.ratio_raw.expect("raw") - 0.5).abs() < 1e-9, "raw shown too");
        assert!((t.ratio.expect("norm") - 1.0).abs() < 1e-9);
        assert!((r.calibration.factor.expect("factor") - 0.5).abs() < 1e-9);
        // Without calibration the same figures would be a regression: the gate refuses instead.
        let mut c2 = c.clone();
        c2.as_object_mut().expect("obj").remove("calibration");
        let e = evaluate(
            Doc { path: Path::new("b"), value: &b },
            Doc { path: Path::new("c"), value: &c2 },
            &th(),
        )
        .expect_err("missing calibration");
        assert!(e.to_string().contains("`ucx_loopback_gbps` of the current summary c is missing"), "{e}");
        // Compared raw only when the thresholds say so.
        let mut raw = th();
        raw.calibration.clear();
        let r2 =
            evaluate(Doc { path: Path::new("b"), value: &b }, Doc { path: Path::new("c"), value: &c2 }, &raw)
                .expect("raw");
        assert_eq!(r2.verdict, Verdict::Regression);
    }

    #[test]
    fn a_slower_machine_does_not_hide_a_slower_kvx() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        let c = doc(&[4.0, 4.1, 3.95, 4.05, 3.9], 5.0);
        assert_eq!(gate(&b, &c).verdict, Verdict::Regression);
    }

    #[test]
    fn noise_wider_than_the_change_is_not_a_regression() {
        let b = doc(&[10.0, 13.0, 7.0, 11.5, 8.5], 10.0);
        let c = doc(&[8.8, 11.5, 6.0, 10.0, 7.5], 10.0);
        let r = gate(&b, &c);
        let t = &r.metrics[0];
        assert!(t.change.expect("change") > t.threshold, "{t:?}");
        assert_eq!(t.verdict, MetricVerdict::WithinNoise, "{t:?}");
        assert_eq!(r.verdict, Verdict::Pass);
        assert!(r.notes.iter().any(|n| n.contains("within the noise")));
    }

    #[test]
    fn improvements_are_reported_not_failed() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        let c = doc(&[12.0, 12.1, 11.9, 12.2, 12.0], 10.0);
        let r = gate(&b, &c);
        assert_eq!(r.verdict, Verdict::Pass);
        assert_eq!(r.metrics[0].verdict, MetricVerdict::Improved);
    }

    #[test]
    fn per_repeat_calibration_is_used_when_every_repeat_has_one() {
        let mut b = doc(&[10.0, 10.0, 10.0], 10.0);
        let mut c = doc(&[10.0, 5.0, 10.0], 10.0);
        // The middle repeat ran on a machine twice as slow: normalised per repeat it matches.
        for (d, cals) in [(&mut b, [10.0, 10.0, 10.0]), (&mut c, [10.0, 5.0, 10.0])] {
            for (rep, cal) in d["repeats"].as_array_mut().expect("reps").iter_mut().zip(cals) {
                rep["calibration"] = json!({"memcpy_gbps": cal, "ucx_loopback_gbps": cal});
            }
        }
        let r = gate(&b, &c);
        assert!(r.calibration.per_repeat);
        assert_eq!(r.metrics[0].current_spread, Some(0.0));
        assert_eq!(r.verdict, Verdict::Pass);
    }

    #[test]
    fn new_failures_are_an_absolute_regression() {
        let b = doc(&[10.0], 10.0);
        let mut c = doc(&[10.0], 10.0);
        c["verify_failures"] = json!(3);
        let r = gate(&b, &c);
        assert_eq!(r.verdict, Verdict::Regression);
        let v = r.metrics.iter().find(|m| m.metric == "verify_failures").expect("metric");
        assert_eq!(v.change, Some(3.0));
        assert!(render_table(&r).contains("verify_failures +3"), "{}", render_table(&r));
    }

    #[test]
    fn single_samples_have_unknown_noise_and_the_threshold_decides() {
        let b = doc(&[10.0], 10.0);
        let c = doc(&[8.5], 10.0);
        let r = gate(&b, &c);
        assert_eq!(r.metrics[0].noise, None);
        assert_eq!(r.noise_floor, None);
        assert_eq!(r.verdict, Verdict::Regression);
        assert!(render_table(&r).contains("noise floor: unknown"));
    }

    #[test]
    fn missing_metrics() {
        let b = doc(&[10.0], 10.0);
        let mut c = doc(&[10.0], 10.0);
        c["stages"].as_object_mut().expect("stages").remove("e2e");
        for rep in c["repeats"].as_array_mut().expect("reps") {
            rep["stages"].as_object_mut().expect("stages").remove("e2e");
        }
        let e = evaluate(
            Doc { path: Path::new("b.json"), value: &b },
            Doc { path: Path::new("c.json"), value: &c },
            &th(),
        )
        .expect_err("missing");
        assert!(
            matches!(&e, ReportError::MissingMetric { metric, side: "current", .. } if metric == "stages.e2e.p50_us"),
            "{e}"
        );
        // The optional handshake metric is skipped instead.
        let r = gate(&b, &b);
        let h = r.metrics.iter().find(|m| m.metric == "stages.handshake.p50_us").expect("handshake");
        assert_eq!(h.verdict, MetricVerdict::Skipped);
    }

    /// The noise model the module docs reason about, simulated: a per-repeat spread of 3%, one
    /// repeat in ten hit by a neighbour (15-40% slower), the whole run on a machine whose speed
    /// wanders by 5% (seen by the calibration too, which has 2% noise of its own).
    fn simulated_run(rng: &mut rand::rngs::StdRng, repeats: usize, slowdown: f64) -> Value {
        use rand::RngExt as _;
        fn gauss(rng: &mut rand::rngs::StdRng, sd: f64) -> f64 {
            // Box-Muller: rand has no normal distribution without rand_distr.
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            sd * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        }
        let machine = 1.0 + gauss(rng, 0.05);
        let mut out = Vec::new();
        for i in 0..repeats {
            let now = machine * (1.0 + gauss(rng, 0.025));
            let t = 10.0 * (1.0 - slowdown) * now * (1.0 + gauss(rng, 0.03));
            let cal = 8.0 * now * (1.0 + gauss(rng, 0.02));
            let t = if rng.random::<f64>() < 0.1 { t * rng.random_range(0.6..0.85) } else { t };
            out.push(json!({"index": i, "throughput_gbps": t,
                "calibration": {"memcpy_gbps": cal * 1.6, "ucx_loopback_gbps": cal}}));
        }
        json!({"schema_version": 1, "run_id": "sim", "throughput_gbps": 0.0,
               "calibration": {"memcpy_gbps": 12.8, "ucx_loopback_gbps": 8.0}, "repeats": out})
    }

    #[test]
    fn simulated_noise_no_false_alarms_and_fifteen_percent_caught() {
        use rand::SeedableRng;
        let th = Thresholds::with_file(
            "[settings]\nreplace_defaults = true\n[[metric]]\nname = \"throughput_gbps\"\nbetter = \"higher\"\nthreshold = 0.10\n",
            "sim",
        )
        .expect("thresholds");
        let mut rng = rand::rngs::StdRng::seed_from_u64(20);
        let (mut runs, mut false_alarms, mut caught) = (0u32, 0u32, 0u32);
        let regressed = |b: &Value, c: &Value| {
            let r =
                evaluate(Doc { path: Path::new("b"), value: b }, Doc { path: Path::new("c"), value: c }, &th)
                    .expect("evaluate");
            r.verdict == Verdict::Regression
        };
        // 50 baselines of 10 repeats, each judged against 20 unchanged and 20 slower runs of 7.
        for _ in 0..50 {
            let base = simulated_run(&mut rng, 10, 0.0);
            for _ in 0..20 {
                runs += 1;
                false_alarms += u32::from(regressed(&base, &simulated_run(&mut rng, 7, 0.0)));
                caught += u32::from(regressed(&base, &simulated_run(&mut rng, 7, 0.15)));
            }
        }
        let fa = f64::from(false_alarms) / f64::from(runs);
        let det = f64::from(caught) / f64::from(runs);
        assert!(fa < 0.005, "false alarms per run {fa} ({false_alarms} of {runs})");
        assert!(det > 0.97, "15% slowdowns caught {det} ({caught} of {runs})");
        crate::output::note!(
            "simulated: {false_alarms} false alarms and {caught} of {runs} slowdowns caught"
        );
    }
}
