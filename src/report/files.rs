//! The one place in `report` that touches the file system.
//!
//! [`RunWriter`] owns a run directory `results/<run_id>/` while the run goes: it appends each
//! request to `requests.csv` and flushes it (a run killed half-way keeps every finished
//! request), replaces `summary.json` atomically with in-progress summaries, and at the end
//! writes the final summary, `stages.csv`, `sweep.csv`, the SVG charts and `report.html`. Loading saved runs
//! and summaries (with the schema check) and atomic writes for the gate's baseline live here
//! too. What the files contain is decided by the pure exporters; this module only moves bytes.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::summary::{RequestRow, SCHEMA_VERSION, Summary};
use super::{ReportError, chart, export, html, pages, run_charts};

pub const SUMMARY_FILE: &str = "summary.json";
pub const REQUESTS_FILE: &str = "requests.csv";
pub const STAGES_FILE: &str = "stages.csv";
pub const SWEEP_FILE: &str = "sweep.csv";
pub const LATENCY_SVG: &str = "latency.svg";
pub const THROUGHPUT_SVG: &str = "throughput-over-time.svg";
pub const SWEEP_SVG: &str = "bandwidth-vs-size.svg";
/// The TTFT waterfall of a serving run (`kvx load`, `kvx bench --serve`).
pub const WATERFALL_SVG: &str = "ttft-waterfall.svg";
/// The stage waterfall of the median and the p99 request.
pub const REQUEST_WATERFALL_SVG: &str = "request-waterfall.svg";
pub const RANK_BANDWIDTH_SVG: &str = "rank-bandwidth.svg";
/// A comparison's throughput per run, its rounds' range as whiskers.
pub const COMPARE_THROUGHPUT_SVG: &str = "compare-throughput.svg";
/// A sweep's figures against the swept setting.
pub const SWEEP_SETTING_SVG: &str = "sweep.svg";
/// A comparison's or sweep's transfer spans, one line per run.
pub const TRANSFER_SPAN_SVG: &str = "transfer-span.svg";
/// The one-page report: tables and every chart inline.
pub const REPORT_HTML: &str = "report.html";

fn write_err(path: &Path) -> impl Fn(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Write { path: path.to_path_buf(), source }
}

/// Writes `bytes` to `path` so a reader sees the old file or the new one, never half of one:
/// a temporary file in the same directory, synced, then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".kvx-tmp-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        // tempfile's 0600 would make results unreadable to the rest of a CI job's users.
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let mut tmp = builder.tempfile_in(parent).map_err(write_err(path))?;
    tmp.write_all(bytes).map_err(write_err(path))?;
    tmp.as_file().sync_all().map_err(write_err(path))?;
    tmp.persist(path).map_err(|e| ReportError::Write { path: path.to_path_buf(), source: e.error })?;
    Ok(())
}

/// Writes a run directory as the run goes. See the module docs.
///
/// A write that fails (a full disk) does not end the run: `requests.csv` is cut back to its
/// last whole row, the rows that follow are kept in memory ([`MAX_HELD_ROWS`] at most), and
/// [`finish`](Self::finish) writes every other file it can, then says what was kept and where
/// and prints the rows not written on stderr, as CSV with its header.
#[derive(Debug)]
pub struct RunWriter {
    dir: PathBuf,
    requests: csv::Writer<File>,
    rows_written: u64,
    /// `requests.csv`'s length after the last row written whole.
    good_len: u64,
    /// The first write of `requests.csv` that failed, and the rows since.
    failed: Option<std::io::Error>,
    held: Vec<RequestRow>,
    dropped: u64,
}

/// Rows a writer keeps in memory once `requests.csv` cannot be written (about 200 bytes
/// each); more are counted, not kept.
pub const MAX_HELD_ROWS: usize = 1_000_000;

impl RunWriter {
    /// Creates `results_root/run_id/` (and `results_root` if needed) and `requests.csv` with its
    /// header. Refuses a directory that already exists rather than mixing two runs.
    pub fn create(results_root: &Path, run_id: &str) -> Result<Self, ReportError> {
        if run_id.is_empty() || run_id.contains(['/', '\\']) || run_id == "." || run_id == ".." {
            return Err(ReportError::Write {
                path: results_root.join(run_id),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a run id must be a single non-empty path component",
                ),
            });
        }
        std::fs::create_dir_all(results_root).map_err(write_err(results_root))?;
        let dir = results_root.join(run_id);
        std::fs::create_dir(&dir).map_err(write_err(&dir))?;
        let path = dir.join(REQUESTS_FILE);
        let file = File::create(&path).map_err(write_err(&path))?;
        let mut requests = export::requests_csv_writer(file).map_err(|e| csv_write_err(&path, e))?;
        requests.flush().map_err(write_err(&path))?;
        let good_len = requests.get_ref().metadata().map_err(write_err(&path))?.len();
        Ok(RunWriter { dir, requests, rows_written: 0, good_len, failed: None, held: Vec::new(), dropped: 0 })
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn rows_written(&self) -> u64 {
        self.rows_written
    }

    /// Appends one request to `requests.csv` and flushes it to the OS. Once a write has
    /// failed, the row is held in memory instead (see the type's docs); this does not fail.
    pub fn write_request(&mut self, row: &RequestRow) -> Result<(), ReportError> {
        if self.failed.is_none() {
            let written = self
                .requests
                .serialize(row)
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|()| self.requests.flush())
                .and_then(|()| self.requests.get_ref().metadata().map(|m| m.len()));
            match written {
                Ok(len) => {
                    self.good_len = len;
                    self.rows_written += 1;
                    return Ok(());
                }
                Err(e) => {
                    // What a failed flush left of the row (and the csv buffer) is cut off: the
                    // file keeps whole rows only.
                    let _ = self.requests.get_ref().set_len(self.good_len);
                    self.failed = Some(e);
                }
            }
        }
        if self.held.len() < MAX_HELD_ROWS {
            self.held.push(row.clone());
        } else {
            self.dropped += 1;
        }
        Ok(())
    }

    /// Replaces `summary.json` with an in-progress summary (marked `partial`).
    pub fn write_partial(&self, summary: &Summary) -> Result<(), ReportError> {
        let mut partial = summary.clone();
        partial.partial = true;
        write_atomic(&self.dir.join(SUMMARY_FILE), &export::summary_json(&partial)?)
    }

    /// Writes the final `summary.json` (not partial), `stages.csv`, `sweep.csv` for sweeps and
    /// the charts (drawn from the rows written so far), and syncs `requests.csv`. Returns the
    /// files written. Each file is tried whatever happened to the others; when any could not
    /// be written (or rows of `requests.csv` were not), the error names each, says what was
    /// kept, and the rows not written have been printed on stderr.
    pub fn finish(mut self, summary: &Summary) -> Result<Vec<PathBuf>, ReportError> {
        let req_path = self.dir.join(REQUESTS_FILE);
        if self.failed.is_none()
            && let Err(e) = self.requests.flush().and_then(|()| self.requests.get_ref().sync_all())
        {
            self.failed = Some(e);
        }
        // A run that was interrupted stays marked partial; a finished one says so itself.
        let done = summary;
        let mut written = Vec::new();
        let mut failed: Vec<String> = Vec::new();
        let mut attempt = |path: PathBuf, bytes: Result<Option<Vec<u8>>, ReportError>| match bytes
            .and_then(|b| b.map_or(Ok(false), |b| write_atomic(&path, &b).map(|()| true)))
        {
            Ok(true) => written.push(path),
            Ok(false) => {}
            Err(e) => failed.push(format!("{} ({})", file_name(&path), error_chain(&e))),
        };
        attempt(self.dir.join(SUMMARY_FILE), export::summary_json(done).map(Some));
        attempt(self.dir.join(STAGES_FILE), export::stages_csv(done).map(Some));
        if done.sweep.is_some() {
            attempt(self.dir.join(SWEEP_FILE), export::sweep_csv(done).map(Some));
        }
        let mut rows = read_requests(&req_path).ok().flatten().unwrap_or_default();
        rows.extend(self.held.iter().cloned());
        for (name, svg) in charts(done, &rows, None) {
            attempt(self.dir.join(name), svg.map(|s| s.map(String::into_bytes)));
        }
        attempt(self.dir.join(REPORT_HTML), html::page(done, &rows, None).map(|p| Some(p.into_bytes())));
        written.insert(1.min(written.len()), req_path.clone());
        let unwritten = self.held.len() as u64 + self.dropped;
        if let Some(e) = &self.failed {
            failed.insert(0, format!("{unwritten} rows of {REQUESTS_FILE} ({e})"));
        }
        if failed.is_empty() {
            return Ok(written);
        }
        let mut kept: Vec<String> =
            written.iter().filter(|p| **p != req_path).map(|p| file_name(p)).collect();
        kept.push(format!(
            "{REQUESTS_FILE} ({} of {} rows)",
            self.rows_written,
            self.rows_written + unwritten
        ));
        if !self.held.is_empty() {
            crate::output::note!(
                "kvx: the {} rows of {REQUESTS_FILE} that could not be written follow, as CSV:",
                self.held.len()
            );
            if let Ok(csv) = export::requests_csv(&self.held) {
                crate::output::note!("{}", String::from_utf8_lossy(&csv).trim_end());
            }
        }
        if self.dropped > 0 {
            crate::output::note!(
                "kvx: {} more rows were measured but neither written nor kept (past {MAX_HELD_ROWS} held)",
                self.dropped
            );
        }
        Err(ReportError::Incomplete {
            dir: self.dir.clone(),
            failed: failed.join(", "),
            kept: kept.join(", "),
        })
    }
}

fn file_name(p: &Path) -> String {
    p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// An error with its causes, on one line (`cannot write X: No space left on device`).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

fn csv_write_err(path: &Path, e: csv::Error) -> ReportError {
    ReportError::Write { path: path.to_path_buf(), source: std::io::Error::other(e.to_string()) }
}

/// The charts of a run: each file name and its SVG, `None` where the run has no data for it.
/// `request`: the request whose stage waterfall to draw (else the median and p99 requests').
/// A comparison's or a sweep's directory holds its runs' charts side by side instead (see
/// [`pages::side_charts`]): their requests pooled would read as one run.
fn charts(
    summary: &Summary,
    rows: &[RequestRow],
    request: Option<&str>,
) -> Vec<(&'static str, Result<Option<String>, ReportError>)> {
    if summary.sweep.is_some() {
        let mut out: Vec<(&'static str, Result<Option<String>, ReportError>)> =
            pages::side_charts(summary, rows)
                .into_iter()
                .map(|(id, svg)| {
                    let file = match id {
                        "compare-throughput" => COMPARE_THROUGHPUT_SVG,
                        "sweep" => SWEEP_SETTING_SVG,
                        "bandwidth-vs-size" => SWEEP_SVG,
                        "latency" => LATENCY_SVG,
                        "transfer-span" => TRANSFER_SPAN_SVG,
                        _ => REQUEST_WATERFALL_SVG,
                    };
                    (file, svg)
                })
                .collect();
        if request.is_some() {
            // The request asked for, in place of the runs' median requests.
            out.retain(|(name, _)| *name != REQUEST_WATERFALL_SVG);
            out.push((REQUEST_WATERFALL_SVG, run_charts::waterfall_svg(rows, request)));
        }
        return out;
    }
    vec![
        (REQUEST_WATERFALL_SVG, run_charts::waterfall_svg(rows, request)),
        (LATENCY_SVG, run_charts::latency_svg(summary, rows)),
        (RANK_BANDWIDTH_SVG, run_charts::rank_bandwidth_svg(rows)),
        (THROUGHPUT_SVG, run_charts::throughput_svg(summary, rows)),
        (WATERFALL_SVG, chart::waterfall_svg(summary)),
    ]
}

/// Draws the charts a run has data for into `dir`; returns the files written.
pub fn write_charts(
    dir: &Path,
    summary: &Summary,
    rows: &[RequestRow],
    request: Option<&str>,
) -> Result<Vec<PathBuf>, ReportError> {
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let mut written = Vec::new();
    for (name, svg) in charts(summary, rows, request) {
        if let Some(svg) = svg? {
            let p = dir.join(name);
            write_atomic(&p, svg.as_bytes())?;
            written.push(p);
        }
    }
    Ok(written)
}

/// Writes `report.html` (see [`html::page`]) into `dir`; returns its path.
pub fn write_html(
    dir: &Path,
    summary: &Summary,
    rows: &[RequestRow],
    request: Option<&str>,
) -> Result<PathBuf, ReportError> {
    let page = html::page(summary, rows, request)?;
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let p = dir.join(REPORT_HTML);
    write_atomic(&p, page.as_bytes())?;
    Ok(p)
}

/// The page comparing run B with run A, written in B's directory: `compare-<A's run id>.html`.
pub fn pair_page_name(a_run_id: &str) -> String {
    let safe: String = a_run_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' })
        .collect();
    format!("compare-{safe}.html")
}

/// Writes a page made elsewhere (a comparison of two runs) into `dir` as `name`; returns its path.
pub fn write_page(dir: &Path, name: &str, page: &str) -> Result<PathBuf, ReportError> {
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let p = dir.join(name);
    write_atomic(&p, page.as_bytes())?;
    Ok(p)
}

fn read_err(path: &Path) -> impl Fn(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Read { path: path.to_path_buf(), source }
}

/// Reads a summary file as JSON and checks its schema version and the type of every field it
/// has (as [`load_summary`] does: `"requests_ok": -5` is refused by both), without requiring
/// every field: the gate looks metrics up in the raw document first so a missing one is named
/// precisely.
pub fn read_summary_value(path: &Path) -> Result<serde_json::Value, ReportError> {
    let bytes = crate::input::read_bounded(path, crate::input::MAX_INPUT_BYTES).map_err(read_err(path))?;
    let value: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|source| ReportError::Json { path: path.to_path_buf(), source })?;
    check_schema(path, &value)?;
    check_fields(path, &value)?;
    Ok(value)
}

/// Checks the fields a summary document has against the schema: the document laid over an
/// empty summary must read as a [`Summary`].
fn check_fields(path: &Path, value: &serde_json::Value) -> Result<(), ReportError> {
    summary_with_defaults(path, value).map(|_| ())
}

/// A summary document read as a [`Summary`], the fields it lacks at their defaults (a baseline
/// written before a field existed still draws).
pub fn summary_with_defaults(path: &Path, value: &serde_json::Value) -> Result<Summary, ReportError> {
    let empty = Summary::new("", "", Default::default());
    let mut merged = serde_json::to_value(&empty)
        .map_err(|e| ReportError::NotASummary { path: path.to_path_buf(), reason: e.to_string() })?;
    if let (serde_json::Value::Object(base), serde_json::Value::Object(doc)) = (&mut merged, value) {
        for (k, v) in doc {
            base.insert(k.clone(), v.clone());
        }
    }
    summary_from_value(path, merged)
}

/// Checks `schema_version` of a parsed summary.
pub fn check_schema(path: &Path, value: &serde_json::Value) -> Result<(), ReportError> {
    let serde_json::Value::Object(map) = value else {
        return Err(ReportError::NotASummary {
            path: path.to_path_buf(),
            reason: "the top level is not a JSON object".into(),
        });
    };
    match map.get("schema_version") {
        None => Err(ReportError::NotASummary {
            path: path.to_path_buf(),
            reason: "it has no schema_version".into(),
        }),
        Some(v) if v.as_u64() == Some(u64::from(SCHEMA_VERSION)) => Ok(()),
        Some(v) => Err(ReportError::SchemaMismatch {
            path: path.to_path_buf(),
            found: v.to_string(),
            expected: SCHEMA_VERSION,
        }),
    }
}

/// Turns a schema-checked document into a [`Summary`].
pub fn summary_from_value(path: &Path, value: serde_json::Value) -> Result<Summary, ReportError> {
    let s: Summary = serde_json::from_value(value)
        .map_err(|e| ReportError::NotASummary { path: path.to_path_buf(), reason: e.to_string() })?;
    // Measured figures are never negative: such a file was edited or is not kvx's.
    let mut figures = vec![
        ("throughput_gbps".to_string(), s.throughput_gbps),
        ("requests_per_s".to_string(), s.requests_per_s),
        ("duration_s".to_string(), s.duration_s),
        ("bytes_per_request".to_string(), s.bytes_per_request),
    ];
    for (name, st) in &s.stages {
        for (stat, v) in
            [("mean_us", st.mean_us), ("p50_us", st.p50_us), ("p99_us", st.p99_us), ("max_us", st.max_us)]
        {
            figures.push((format!("stages.{name}.{stat}"), v));
        }
    }
    if let Some((name, v)) = figures.into_iter().find(|(_, v)| *v < 0.0) {
        return Err(ReportError::NotASummary {
            path: path.to_path_buf(),
            reason: format!("`{name}` is {v}, and a measured figure cannot be negative"),
        });
    }
    Ok(s)
}

/// Reads and checks a `summary.json`.
pub fn load_summary(path: &Path) -> Result<Summary, ReportError> {
    summary_from_value(path, read_summary_value(path)?)
}

/// `requests.csv` at `path`, or `None` when the run has none.
fn read_requests(path: &Path) -> Result<Option<Vec<RequestRow>>, ReportError> {
    match crate::input::read_bounded(path, crate::input::MAX_INPUT_BYTES) {
        Ok(bytes) => export::parse_requests_csv(&bytes)
            .map(Some)
            .map_err(|source| ReportError::Csv { path: path.to_path_buf(), source }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ReportError::Read { path: path.to_path_buf(), source }),
    }
}

/// A saved run: its summary and, when present, its request rows.
#[derive(Debug, Clone)]
pub struct RunData {
    /// The run directory.
    pub dir: PathBuf,
    pub summary: Summary,
    /// Empty when the run has no `requests.csv`.
    pub rows: Vec<RequestRow>,
    pub has_requests_csv: bool,
}

/// Loads a run from its directory, or from its `summary.json` (rows are then read from the
/// same directory).
pub fn load_run(path: &Path) -> Result<RunData, ReportError> {
    let meta = std::fs::metadata(path).map_err(read_err(path))?;
    let (dir, summary_path) = if meta.is_dir() {
        let p = path.join(SUMMARY_FILE);
        if !p.exists() {
            return Err(ReportError::NotARun { path: path.to_path_buf() });
        }
        (path.to_path_buf(), p)
    } else {
        let dir = path.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        (dir, path.to_path_buf())
    };
    let summary = load_summary(&summary_path)?;
    let rows = read_requests(&dir.join(REQUESTS_FILE))?;
    Ok(RunData { dir, summary, has_requests_csv: rows.is_some(), rows: rows.unwrap_or_default() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_run_ids_are_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        for id in ["", "..", "a/b"] {
            assert!(RunWriter::create(tmp.path(), id).is_err(), "{id:?}");
        }
        RunWriter::create(tmp.path(), "x").expect("first");
        let again = RunWriter::create(tmp.path(), "x").expect_err("second");
        assert!(again.to_string().contains("cannot write"), "{again}");
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let tmp = tempfile::tempdir().expect("tmp");
        let p = tmp.path().join("f.json");
        write_atomic(&p, b"one").expect("1");
        write_atomic(&p, b"two").expect("2");
        assert_eq!(std::fs::read(&p).expect("read"), b"two");
        let names: Vec<_> =
            std::fs::read_dir(tmp.path()).expect("ls").map(|e| e.expect("e").file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("f.json")]);
    }

    #[test]
    fn negative_figures_are_refused_by_name() {
        let mut s = Summary::new("r", "t", Default::default());
        s.throughput_gbps = -3.5;
        let v = serde_json::to_value(&s).expect("json");
        let e = summary_from_value(Path::new("s.json"), v).expect_err("negative");
        assert!(e.to_string().contains("`throughput_gbps` is -3.5"), "{e}");
        s.throughput_gbps = 3.5;
        summary_from_value(Path::new("s.json"), serde_json::to_value(&s).expect("json")).expect("positive");
    }

    #[test]
    fn schema_checks() {
        let p = Path::new("s.json");
        assert!(check_schema(p, &serde_json::json!({"schema_version": 1})).is_ok());
        let e = check_schema(p, &serde_json::json!({"schema_version": 2})).expect_err("v2");
        assert!(matches!(e, ReportError::SchemaMismatch { .. }), "{e}");
        assert!(e.to_string().contains("schema_version 2"), "{e}");
        let e = check_schema(p, &serde_json::json!({"x": 1})).expect_err("none");
        assert!(e.to_string().contains("no schema_version"), "{e}");
        assert!(check_schema(p, &serde_json::json!([1])).is_err());
    }
}
