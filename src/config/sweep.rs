//! A resolved `kvx bench --sweep FILE`: every point with its settings, or why they were
//! rejected (a rejected point is reported, not fatal).

use std::path::PathBuf;

use serde_json::Value;

use super::bench::BenchSettings;
use crate::error::ConfigError;

/// One point: axis name to value.
pub type Point = Vec<(String, Value)>;

/// A sweep, every point resolved.
#[derive(Debug, Clone)]
pub struct SweepJob {
    /// The file's stem: the name of the run.
    pub name: String,
    /// The axis that names chart series (`series = "tp"`).
    pub series_axis: Option<String>,
    pub points: Vec<SweepPoint>,
    /// Directory the run is written under.
    pub results_root: PathBuf,
}

/// One point of a sweep and its settings, or why they were rejected.
#[derive(Debug, Clone)]
pub struct SweepPoint {
    pub point: Point,
    pub settings: Result<BenchSettings, ConfigError>,
}

impl SweepPoint {
    /// `tp=8:2 alloc=random`.
    pub fn label(&self) -> String {
        self.point.iter().map(|(k, v)| format!("{k}={}", text(v))).collect::<Vec<_>>().join(" ")
    }
}

/// A point's value as text (strings without quotes).
pub fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}
