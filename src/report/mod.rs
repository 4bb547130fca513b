//! Reports: what a run measured, how it is shown, and whether it got slower.
//!
//! Measurement, statistics and presentation are kept apart (hyperfine's export design):
//!
//! - [`summary`]: the data model. [`Summary`] (schema-versioned, `summary.json`),
//!   [`RequestRow`] (`requests.csv`), [`RequestTotals`], the vLLM metrics line.
//! - [`recorder`]: [`StageRecorder`], raw nanosecond samples per stage in hdrhistogram,
//!   mergeable across workers and shippable between processes.
//! - [`bandwidth`]: per-request bandwidth by the wall-span rule, beside each rank's own.
//! - [`numbers`]: how figures read (precision, byte units, ratios); a leaf.
//! - [`export`], [`table`], [`chart`]: pure exporters from a summary (and rows) to bytes:
//!   JSON, CSV, comfy-table text or Markdown, SVG charts.
//! - [`waterfall`] and [`slo`]: a serving run's TTFT split into stages, and its goodput
//!   against SLOs (figures a summary carries).
//! - [`run_charts`]: the charts of one run read at a glance (a request's stage waterfall,
//!   latency CDFs, per-rank bandwidth, the run over time); [`html`]: the one-page report
//!   (`report.html`) holding them inline with the tables.
//! - [`page`]: the HTML of every page (escaping, tables, figures, the document).
//! - [`side_charts`] and [`pages`]: runs beside each other (a comparison's runs, two saved
//!   runs, a gate's baseline and current, a sweep's points) as charts and as pages.
//! - [`compare`]: two runs side by side (`kvx report A B`).
//! - [`gate`] and [`stats`]: the noise-aware regression gate (`kvx gate`).
//! - [`verdict`]: whether a finished run was clean (the rule behind exit code 1).
//! - [`topo`], [`plan`]: the rank map of a pair (`kvx topo`) and a request's descriptor plan
//!   and posting cost (`kvx plan`) as text tables; `cli` builds what they render.
//! - [`xfer`]: what `kvx xfer` is asked to measure and what it found (also bench's
//!   calibration), its table, and the advice for device memory UCX emulates.
//! - [`files`]: the one place that touches the file system: [`RunWriter`] (a run directory
//!   written as the run goes), loading saved runs and summaries, atomic writes.
//!
//! `report` never measures and never runs transfers; `kvx bench` measures and hands figures
//! over. Nothing here reads the environment (callers pass `KVX_RESULTS_DIR` in) or the system:
//! the machine and the time a summary carries come from `host` and `clock`.

#![forbid(unsafe_code)]

use std::path::PathBuf;

pub mod bandwidth;
pub mod chart;
pub mod compare;
pub mod compare_runs;
pub mod export;
pub mod files;
pub mod gate;
pub mod html;
pub mod layout;
pub mod numbers;
pub mod page;
pub mod pages;
pub mod plan;
pub mod plan_json;
pub mod prediction;
pub mod recorder;
pub mod run_charts;
pub mod scenario;
pub mod side_charts;
pub mod slo;
pub mod stats;
pub mod summary;
pub mod table;
pub mod topo;
pub mod verdict;
pub mod waterfall;
pub mod xfer;

pub use files::{RunData, RunWriter, load_run, load_summary};
pub use recorder::StageRecorder;
pub use summary::{
    Calibration, DescriptorsPerRequest, Environment, RankList, RankRead, RankReads, RankThroughput,
    RepeatMetrics, RequestOutcome, RequestRow, RequestTotals, RunEvent, SCHEMA_VERSION, Scenario, Stage,
    StageStats, Summary, SweepPoint, UcxInfo, vllm_metrics_line,
};

/// Everything that can go wrong while writing, reading or judging a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot read {}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write {}", path.display())]
    Write { path: PathBuf, source: std::io::Error },
    #[error(
        "the run was measured, but not all of it could be written to {}: {failed}; kept there: {kept}",
        dir.display()
    )]
    Incomplete { dir: PathBuf, failed: String, kept: String },
    #[error("{} is not valid JSON", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
    #[error(
        "{} has schema_version {found}, but this kvx reads schema_version {expected}; \
         produce it again with this kvx (or use the kvx that wrote it)",
        path.display()
    )]
    SchemaMismatch { path: PathBuf, found: String, expected: u32 },
    #[error("{} is not a kvx run summary: {reason}", path.display())]
    NotASummary { path: PathBuf, reason: String },
    #[error(
        "{} is not a kvx run: it holds no summary.json (pass a directory written by `kvx bench`, \
         e.g. results/<run>, or the summary.json itself)",
        path.display()
    )]
    NotARun { path: PathBuf },
    #[error("{} is not a valid requests CSV", path.display())]
    Csv { path: PathBuf, source: csv::Error },
    #[error(
        "metric `{metric}` is missing from the {side} summary {}; \
         fix the summary or drop the metric from the thresholds file (--thresholds)",
        path.display()
    )]
    MissingMetric { metric: String, side: &'static str, path: PathBuf },
    #[error("thresholds {source_name}: {reason} (fix the file given with --thresholds)")]
    Thresholds { source_name: String, reason: String },
    #[error(
        "the current run is not the baseline's scenario: {differences}; gate a run of the baseline's \
         scenario (its preset), or make this run the baseline on purpose with --update"
    )]
    ScenarioMismatch { differences: String },
    #[error(
        "calibration figure `{figure}` of the {side} summary {} is {problem}: the gate cannot tell a \
         slower machine from a slower kvx without it; measure it again (without --no-calibrate), or \
         compare raw figures with `calibration = []` under [settings] in a --thresholds file",
        path.display()
    )]
    BadCalibration { figure: String, side: &'static str, path: PathBuf, problem: String },
    #[error("refusing to update the baseline: {reason}; pass --force to accept this run anyway")]
    UpdateRefused { reason: String },
    #[error("histogram: {0}")]
    Histogram(String),
    #[error("encoding {what}: {reason}")]
    Encode { what: &'static str, reason: String },
    #[error(
        "no request `{id}` in the run's {}: give a request id as written there (e.g. `{example}`) or \
         its number",
        files::REQUESTS_FILE
    )]
    UnknownRequest { id: String, example: String },
    #[error("chart {chart}: {reason}")]
    Chart { chart: &'static str, reason: String },
}
