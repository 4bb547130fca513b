//! Test documents for the gate's unit tests: the built-in thresholds, a summary with given
//! repeats and calibration, and one comparison of two summaries under the built-in rules.

use std::path::Path;

use serde_json::{Value, json};

use super::doc::Doc;
use super::evaluate::evaluate;
use super::thresholds::Thresholds;
use super::verdict::GateReport;

pub(crate) fn th() -> Thresholds {
    Thresholds::builtin().expect("built-in thresholds parse")
}

/// A summary document whose repeats have the given throughputs (GB/s) and whose latencies
/// are inversely proportional, with a calibration of `cal` GB/s for both figures.
pub(crate) fn doc(tputs: &[f64], cal: f64) -> Value {
    let stages = |t: f64| {
        json!({
            "transfer": {"count": 100, "mean_us": 1000.0 / t, "p50_us": 1000.0 / t, "p90_us": 1.0, "p99_us": 1.0, "p999_us": 1.0, "max_us": 1.0},
            "e2e": {"count": 100, "mean_us": 1200.0 / t, "p50_us": 1200.0 / t, "p90_us": 1.0, "p99_us": 3000.0 / t, "p999_us": 1.0, "max_us": 1.0},
            "post": {"count": 100, "mean_us": 10.0 / t, "p50_us": 10.0 / t, "p90_us": 1.0, "p99_us": 1.0, "p999_us": 1.0, "max_us": 1.0}
        })
    };
    let med = crate::report::stats::median(tputs).expect("median");
    json!({
        "schema_version": 1,
        "run_id": "r",
        "throughput_gbps": med,
        "requests_per_s": med * 10.0,
        "descriptors_per_request": {"raw": 100.0, "coalesced": 10.0},
        "requests_failed": 0, "verify_failures": 0, "blocks_leaked": 0,
        "stages": stages(med),
        "calibration": {"memcpy_gbps": cal, "ucx_loopback_gbps": cal},
        "repeats": tputs.iter().enumerate().map(|(i, t)| json!({
            "index": i, "throughput_gbps": t, "requests_per_s": t * 10.0, "stages": stages(*t)
        })).collect::<Vec<_>>(),
    })
}

pub(crate) fn gate(b: &Value, c: &Value) -> GateReport {
    evaluate(Doc { path: Path::new("b.json"), value: b }, Doc { path: Path::new("c.json"), value: c }, &th())
        .expect("evaluate")
}
