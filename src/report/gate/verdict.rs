//! The gate's verdict as data: per metric ([`MetricResult`], [`MetricVerdict`]), the
//! calibration it normalised by ([`CalibrationView`]) and the whole ([`GateReport`],
//! [`Verdict`]). Serialised as it stands for `--format json`; rendered by `render.rs`.

use serde::Serialize;

use super::thresholds::{Better, Kind};

/// Per-metric verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricVerdict {
    Pass,
    Improved,
    /// Worse than the threshold but not than the noise: passes, with a warning.
    WithinNoise,
    Regression,
    /// An optional metric missing from a summary.
    Skipped,
}

/// The gate's overall verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Regression,
}

/// The comparison of one metric.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricResult {
    pub metric: String,
    pub better: Better,
    pub kind: Kind,
    pub enforced: bool,
    /// Median of the baseline's raw samples.
    pub baseline: Option<f64>,
    /// Median of the current run's raw samples.
    pub current: Option<f64>,
    pub ratio_raw: Option<f64>,
    /// Ratio after normalisation (equal to `ratio_raw` when not normalised).
    pub ratio: Option<f64>,
    /// How much worse (positive) or better (negative): a fraction for relative metrics, units
    /// for absolute ones.
    pub change: Option<f64>,
    pub threshold: f64,
    /// `z` standard errors of the ratio, as a fraction (`None`: unknown, one sample each).
    pub noise: Option<f64>,
    pub normalized: bool,
    pub baseline_samples: usize,
    pub current_samples: usize,
    /// Run-to-run relative spread (MAD-based sd) of each run's samples.
    pub baseline_spread: Option<f64>,
    pub current_spread: Option<f64>,
    pub verdict: MetricVerdict,
}

impl MetricResult {
    /// True when this metric fails the gate.
    pub fn fails(&self) -> bool {
        self.enforced && self.verdict == MetricVerdict::Regression
    }
}

/// One calibration figure in both runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationFigure {
    pub name: String,
    pub baseline: Option<f64>,
    pub current: Option<f64>,
    pub ratio: Option<f64>,
}

/// What the normalisation used.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalibrationView {
    pub figures: Vec<CalibrationFigure>,
    /// Figures present in both runs, used for normalisation.
    pub used: Vec<String>,
    /// Current machine speed over the baseline's (geometric mean of the used figures).
    pub factor: Option<f64>,
    /// True when both runs' repeats carried their own calibration.
    pub per_repeat: bool,
}

/// The whole verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    pub verdict: Verdict,
    pub baseline: String,
    pub current: String,
    pub baseline_run: String,
    pub current_run: String,
    pub metrics: Vec<MetricResult>,
    /// The widest noise band over the gated relative metrics: changes smaller than this could
    /// not have been told from noise.
    pub noise_floor: Option<f64>,
    pub noise_z: f64,
    pub calibration: CalibrationView,
    pub notes: Vec<String>,
}

impl GateReport {
    pub fn regressions(&self) -> impl Iterator<Item = &MetricResult> {
        self.metrics.iter().filter(|m| m.fails())
    }
}
