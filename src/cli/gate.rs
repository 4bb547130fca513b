//! `kvx gate`: compare a run with a baseline; exit 0 on pass, 1 on a regression, 2 when it
//! cannot decide (or must not: a partial run without `--allow-partial`). `--update` makes the
//! current run the new baseline, on purpose only. The policy lives in `report::gate`; this file
//! loads, prints and writes.
//!
//! The verdict is the exit code whatever happens to stdout: a closed stdout (`kvx gate ... |
//! head`) does not turn a regression into a pass or a pass into an error.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::error::Outcome;
use crate::output::{self, OutputError, note};
use crate::report::gate::{self, Doc, GateReport, Thresholds, Verdict};
use crate::report::{ReportError, files, pages};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GateFormat {
    /// A table for a terminal or a CI log.
    Table,
    /// The verdict as JSON: {verdict: pass|regression|error, metrics, noise_floor, ...}.
    Json,
}

#[derive(Debug, Args)]
#[command(after_help = "Exit status: 0 pass, 1 regression, 2 error (unreadable file, schema mismatch, \
missing metric, implausible calibration figure, a partial run without --allow-partial).\n\n\
Examples:\n  kvx gate --baseline results/baseline.json --current results/<run>/summary.json\n  \
kvx gate --baseline results/baseline.json --current results/<run> --html-file gate.html\n  \
kvx gate --baseline results/baseline.json --current results/<run> --update   # accept this run as the baseline")]
#[command(allow_negative_numbers = true)]
pub struct GateArgs {
    /// The baseline summary (a summary.json, usually committed as results/baseline.json).
    #[arg(long, value_name = "FILE")]
    pub baseline: PathBuf,
    /// The run to judge: its summary.json or its directory.
    #[arg(long, value_name = "SUMMARY")]
    pub current: PathBuf,
    /// Thresholds laid over the built-in ones (format: bench-configs/gates.toml).
    #[arg(long, value_name = "FILE")]
    pub thresholds: Option<PathBuf>,
    /// Also write the verdict as Markdown to FILE (for a CI job summary or a PR comment).
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Also write the verdict as one self-contained HTML page to FILE: the metric table, each
    /// metric's change against its threshold, baseline and current latency and throughput side
    /// by side (a gate that cannot decide writes the reason).
    // Not `--html`: on `kvx report` that flag writes report.html into a run's directory, and a
    // flag means one thing in every command; the gate owns no directory, so it takes a file,
    // as --markdown does.
    #[arg(long, value_name = "FILE", conflicts_with = "update")]
    pub html_file: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = GateFormat::Table, help = crate::settings::flags::FORMAT_HELP)]
    pub format: GateFormat,
    /// Write the current run as the new baseline (prints what changed). Refused for a run with
    /// failures, verification failures, leaked blocks or no successful request, unless --force;
    /// for a partial run, unless --allow-partial.
    #[arg(long)]
    pub update: bool,
    /// With --update: accept a run that is not clean (a partial run needs --allow-partial).
    #[arg(long, requires = "update")]
    pub force: bool,
    /// Judge a partial run (its summary says "partial": true: it was interrupted or failed
    /// half-way, so it measured fewer requests than its scenario asks for) as if it were whole,
    /// with a note, instead of refusing it (exit 2). Applies to the baseline and the current
    /// run, and with --update to the run that becomes the baseline.
    #[arg(long)]
    pub allow_partial: bool,
}

pub fn run(args: &GateArgs) -> anyhow::Result<Outcome> {
    match judge(args) {
        Ok(outcome) => Ok(outcome),
        Err(err) => {
            let message = format!("{err:#}");
            if args.format == GateFormat::Json {
                verdict_stands(output::stdout_json(&gate::error_json(&message)));
            }
            if let Some(md) = &args.markdown {
                // The CI summary should say the gate could not decide; the error itself is
                // what the caller reports, so a failure to write this is secondary.
                if let Err(e) = files::write_atomic(md, gate::error_markdown(&message).as_bytes()) {
                    note!("warning: {e}");
                }
            }
            if let Some(page) = &args.html_file
                && let Err(e) = files::write_atomic(page, pages::gate_error_page(&message).as_bytes())
            {
                note!("warning: {e}");
            }
            Err(err)
        }
    }
}

/// What happens to stdout does not change the verdict: a closed stdout is quietly ignored,
/// another write error becomes a warning on stderr.
fn verdict_stands(r: Result<(), OutputError>) {
    match r {
        Ok(()) | Err(OutputError::Closed) => {}
        Err(e) => note!("warning: {e}"),
    }
}

/// A run directory stands for its summary.json.
fn summary_path(p: &Path) -> PathBuf {
    if p.is_dir() { p.join(files::SUMMARY_FILE) } else { p.to_path_buf() }
}

fn thresholds(args: &GateArgs) -> Result<Thresholds, ReportError> {
    match &args.thresholds {
        None => Thresholds::builtin(),
        Some(p) => {
            let text =
                crate::input::read_text(p).map_err(|source| ReportError::Read { path: p.clone(), source })?;
            Thresholds::with_file(&text, &p.display().to_string())
        }
    }
}

fn judge(args: &GateArgs) -> anyhow::Result<Outcome> {
    let th = thresholds(args)?;
    let current_path = summary_path(&args.current);
    let current = files::read_summary_value(&current_path)?;
    if args.update {
        return update(args, &th, &current_path, current);
    }
    let baseline_path = summary_path(&args.baseline);
    let baseline = files::read_summary_value(&baseline_path)?;
    let (baseline, current) =
        (Doc { path: &baseline_path, value: &baseline }, Doc { path: &current_path, value: &current });
    if !args.allow_partial {
        gate::refuse_partial("baseline", baseline)?;
        gate::refuse_partial("current", current)?;
    }
    let report = gate::evaluate(baseline, current, &th)?;
    print(args, &report);
    if let Some(md) = &args.markdown {
        files::write_atomic(md, gate::render_markdown(&report).as_bytes())?;
    }
    if let Some(page) = &args.html_file {
        let b = files::summary_with_defaults(baseline.path, baseline.value)?;
        let c = files::summary_with_defaults(current.path, current.value)?;
        files::write_atomic(page, pages::gate_page(&report, &b, &c)?.as_bytes())?;
    }
    Ok(match report.verdict {
        Verdict::Pass => Outcome::Ok,
        Verdict::Regression => Outcome::Regression,
    })
}

fn print(args: &GateArgs, report: &GateReport) {
    verdict_stands(match args.format {
        GateFormat::Table => output::stdout(gate::render_table(report)),
        GateFormat::Json => output::stdout_json(&gate::to_json(report)),
    });
}

fn update(
    args: &GateArgs,
    th: &Thresholds,
    current_path: &Path,
    current: serde_json::Value,
) -> anyhow::Result<Outcome> {
    let summary = files::summary_from_value(current_path, current.clone())?;
    if !args.allow_partial {
        gate::refuse_partial("current", Doc { path: current_path, value: &current })?;
    }
    if let Some(reason) = gate::update_refusal(&summary)
        && !args.force
    {
        return Err(ReportError::UpdateRefused { reason }.into());
    }
    // A baseline without a gated metric would make every later gate fail with exit 2.
    if let Err(e) = gate::evaluate(
        Doc { path: current_path, value: &current },
        Doc { path: current_path, value: &current },
        th,
    ) && !args.force
    {
        return Err(
            ReportError::UpdateRefused { reason: format!("it cannot serve as a baseline: {e}") }.into()
        );
    }
    let baseline_path = &args.baseline;
    if baseline_path.is_dir() {
        anyhow::bail!(
            "--baseline {} is a directory; with --update it must name the file to write",
            baseline_path.display()
        );
    }
    let mut previous: Option<GateReport> = None;
    let mut notes = Vec::new();
    if baseline_path.exists() {
        match files::read_summary_value(baseline_path).and_then(|old| {
            gate::evaluate(
                Doc { path: baseline_path, value: &old },
                Doc { path: current_path, value: &current },
                th,
            )
        }) {
            Ok(r) => previous = Some(r),
            Err(e) => notes.push(format!("the old baseline cannot be compared ({e}); replacing it")),
        }
    } else {
        notes.push(format!("no baseline at {}: creating it", baseline_path.display()));
    }
    if gate::is_partial(&current) {
        notes.push("the new baseline is a partial run: gates against it need --allow-partial".into());
    }
    let mut bytes = serde_json::to_vec_pretty(&current)?;
    bytes.push(b'\n');
    files::write_atomic(baseline_path, &bytes)?;

    let done = format!(
        "baseline updated: {} now holds run {} (from {})",
        baseline_path.display(),
        summary.run_id,
        current_path.display()
    );
    let printed = match args.format {
        GateFormat::Table => {
            let mut text = String::new();
            for n in &notes {
                text.push_str(&format!("note: {n}\n"));
            }
            if let Some(r) = &previous {
                text.push_str("what changed (old baseline -> new baseline):\n");
                text.push_str(&gate::render_table(r));
            }
            text.push_str(&format!("{done}\n"));
            output::stdout(text)
        }
        GateFormat::Json => output::stdout_json(&serde_json::json!({
            "verdict": "updated",
            "baseline": baseline_path.display().to_string(),
            "run_id": summary.run_id,
            "notes": notes,
            "previous": previous.as_ref().map(gate::to_json),
        })),
    };
    // The baseline is written: the markdown below still follows a closed stdout.
    verdict_stands(printed);
    if let Some(md) = &args.markdown {
        let mut text = format!("## kvx gate: baseline updated\n\n{done}\n");
        for n in &notes {
            text.push_str(&format!("\n- {n}"));
        }
        if let Some(r) = &previous {
            text.push_str("\n\nWhat changed (old baseline -> new baseline):\n\n");
            text.push_str(&gate::render_markdown(r));
        }
        files::write_atomic(md, text.as_bytes())?;
    }
    Ok(Outcome::Ok)
}
