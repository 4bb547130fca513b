//! The machine-speed yardstick: the calibration figures a run carries, checked before any
//! is divided by (present, a normal number within [`CALIBRATION_MIN_GBPS`]`..=`
//! [`CALIBRATION_MAX_GBPS`], in the run and in each repeat that has its own), and their
//! geometric mean, the scalar relative metrics are normalised by.

use serde_json::Value;

use super::doc::Doc;
use crate::report::ReportError;
use crate::report::stats::geomean;

/// The slowest calibration figure the gate believes, in GB/s. Calibration figures are
/// bandwidths (`*_gbps`: a UCX loopback read, a memcpy, a device copy); a 2-core VM's loopback
/// read is a few GB/s, and 10 MB/s is far below any machine kvx runs on, so a figure under it is
/// a broken measurement or a unit error, and dividing by it would call any run a huge
/// improvement.
pub const CALIBRATION_MIN_GBPS: f64 = 0.01;
/// The fastest calibration figure the gate believes, in GB/s: 20x the HBM bandwidth of the
/// fastest GPU measured here (an H200's device copy read about 2 TB/s, its HBM is rated at
/// 4.8 TB/s). Above it a figure is corrupt, and dividing by it would call any run a regression.
pub const CALIBRATION_MAX_GBPS: f64 = 100_000.0;

pub(super) fn calibration_scalar(cal: Option<&Value>, figures: &[String]) -> Option<f64> {
    if figures.is_empty() {
        return None;
    }
    let cal = cal?;
    let vals: Vec<f64> =
        figures.iter().map(|f| cal.get(f.as_str()).and_then(Value::as_f64).unwrap_or(f64::NAN)).collect();
    geomean(&vals)
}

pub(super) fn figure(doc: &Value, name: &str) -> Option<f64> {
    doc.get("calibration")?.get(name)?.as_f64().filter(|v| v.is_finite() && *v > 0.0)
}

/// Every calibration figure the gate divides by must be in the run (and in each repeat that
/// carries its own calibration), a normal number (finite, not zero, not subnormal) and within
/// [`CALIBRATION_MIN_GBPS`]`..=`[`CALIBRATION_MAX_GBPS`].
pub(super) fn check_calibration(
    side: &'static str,
    doc: &Doc<'_>,
    figures: &[String],
) -> Result<(), ReportError> {
    let bad = |cal: Option<&Value>, name: &str| -> Option<String> {
        match cal.and_then(|c| c.get(name)) {
            None | Some(Value::Null) => Some("missing".into()),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_normal() && (CALIBRATION_MIN_GBPS..=CALIBRATION_MAX_GBPS).contains(&x) => {
                    None
                }
                // `{:?}` keeps 1e-320 and 1e308 short; `{}` would print every digit.
                Some(x) => Some(format!(
                    "{x:?}, outside the plausible range {CALIBRATION_MIN_GBPS}..={CALIBRATION_MAX_GBPS} GB/s"
                )),
                None => Some(format!("{v} (not a number)")),
            },
        }
    };
    for name in figures {
        let mut problem = bad(doc.value.get("calibration"), name);
        if problem.is_none()
            && let Some(reps) = doc.value.get("repeats").and_then(Value::as_array)
        {
            problem = reps.iter().filter(|r| r.get("calibration").is_some()).find_map(|r| {
                bad(r.get("calibration"), name).map(|p| format!("{p} in repeat {}", r["index"]))
            });
        }
        if let Some(problem) = problem {
            return Err(ReportError::BadCalibration {
                figure: name.clone(),
                side,
                path: doc.path.to_path_buf(),
                problem,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::report::gate::evaluate;
    use crate::report::gate::fixtures::{doc, th};

    #[test]
    fn invalid_calibration_figures_are_refused_not_read_as_none() {
        let b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        for bad in [
            json!(0.0),
            json!(-1.0),
            json!("fast"),
            Value::Null,
            json!(1e-320),
            json!(f64::MIN_POSITIVE),
            json!(0.009),
            json!(100_000.5),
            json!(1e308),
        ] {
            for side in ["baseline", "current"] {
                let (mut b, mut c) = (b.clone(), doc(&[7.8, 7.9, 7.7, 8.0, 7.8], 10.0));
                let target = if side == "current" { &mut c } else { &mut b };
                target["calibration"]["ucx_loopback_gbps"] = bad.clone();
                let e = evaluate(
                    Doc { path: Path::new("b"), value: &b },
                    Doc { path: Path::new("c"), value: &c },
                    &th(),
                )
                .expect_err("invalid calibration");
                assert!(
                    matches!(&e, ReportError::BadCalibration { side: s, figure, .. }
                        if *s == side && figure == "ucx_loopback_gbps"),
                    "{bad}: {e}"
                );
                if bad.is_number() {
                    assert!(e.to_string().contains("0.01..=100000 GB/s"), "{bad}: {e}");
                }
            }
        }
        let mut c = doc(&[7.8, 7.9, 7.7, 8.0, 7.8], 10.0);
        c["calibration"]["ucx_loopback_gbps"] = json!(1e-320);
        let e =
            evaluate(Doc { path: Path::new("b"), value: &b }, Doc { path: Path::new("c"), value: &c }, &th())
                .expect_err("subnormal");
        assert!(e.to_string().contains("is 1e-320, outside the plausible range"), "{e}");
        // A repeat's own calibration is checked too.
        let mut c = doc(&[7.8, 7.9, 7.7, 8.0, 7.8], 10.0);
        c["repeats"][2]["calibration"] = json!({"ucx_loopback_gbps": 0.0});
        let e =
            evaluate(Doc { path: Path::new("b"), value: &b }, Doc { path: Path::new("c"), value: &c }, &th())
                .expect_err("invalid repeat calibration");
        assert!(e.to_string().contains("in repeat 2"), "{e}");
    }

    #[test]
    fn the_calibration_range_is_inclusive_and_plausible() {
        assert!(CALIBRATION_MIN_GBPS.is_normal() && CALIBRATION_MIN_GBPS < CALIBRATION_MAX_GBPS);
        let b = doc(&[10.0, 10.2, 9.9], 10.0);
        for ok in [CALIBRATION_MIN_GBPS, 4.48, 1959.8, CALIBRATION_MAX_GBPS] {
            let mut c = doc(&[10.0, 10.2, 9.9], 10.0);
            c["calibration"]["ucx_loopback_gbps"] = json!(ok);
            evaluate(Doc { path: Path::new("b"), value: &b }, Doc { path: Path::new("c"), value: &c }, &th())
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
    }
}
