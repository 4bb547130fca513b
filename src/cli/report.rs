//! `kvx report`: re-render a saved run's tables and charts, or compare two runs side by side.
//! Reads runs with `report::files`, renders with the pure exporters, prints. Never measures.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use crate::error::Outcome;
use crate::output::{self, note};
use crate::report::table::{Style, render_summary};
use crate::report::{compare, export, files, pages};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    /// Tables for a terminal.
    Table,
    /// The summary (or the comparison) as JSON.
    Json,
    /// Markdown tables.
    Markdown,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  kvx report results/20250102T030405Z-1a2b3c\n  kvx report results/20250102T030405Z-1a2b3c --html --request 17\n  kvx report results/A results/B --format markdown\n  kvx report results/A results/B --html"
)]
#[command(allow_negative_numbers = true)]
pub struct ReportArgs {
    /// A run directory written by `kvx bench` (results/<run>) or its summary.json. Give two runs,
    /// A then B, to compare them side by side (ratio B/A).
    #[arg(required = true, num_args = 1..=2, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = ReportFormat::Table, help = crate::settings::flags::FORMAT_HELP)]
    pub format: ReportFormat,
    /// Write the re-rendered SVG charts (and with --html the page) here instead of into the
    /// run's own directory.
    #[arg(long, value_name = "DIR", conflicts_with = "no_charts")]
    pub charts_dir: Option<PathBuf>,
    /// Do not write charts.
    #[arg(long)]
    pub no_charts: bool,
    /// Also write report.html: the tables, every chart inline, the scenario and the
    /// environment on one self-contained page (beside the charts: the run's directory or
    /// --charts-dir). With two runs: compare-<A's run id>.html in B's directory (or
    /// --charts-dir), the two runs' charts side by side.
    #[arg(long)]
    pub html: bool,
    /// Draw the stage waterfall of this request (its id in requests.csv, or its number)
    /// instead of the median and p99 requests'.
    #[arg(long, value_name = "ID")]
    pub request: Option<String>,
}

pub fn run(args: &ReportArgs) -> anyhow::Result<Outcome> {
    if args.runs.len() == 2 {
        let refused = if args.request.is_some() {
            Some((
                "--request",
                "a comparison of two runs draws each run's median request: give one run, or drop the flag",
            ))
        } else if args.no_charts {
            Some(("--no-charts", "a comparison of two runs writes no SVG files: drop the flag"))
        } else if args.charts_dir.is_some() && !args.html {
            Some((
                "--charts-dir",
                "a comparison of two runs writes its charts only inside its page: add --html, or drop the flag",
            ))
        } else {
            None
        };
        if let Some((flag, why)) = refused {
            return Err(crate::error::ConfigError::new(flag, why).into());
        }
    }
    if let Some(dir) = &args.charts_dir
        && dir.exists()
        && !dir.is_dir()
    {
        return Err(crate::error::ConfigError::new(
            "--charts-dir",
            format!("{} is a file; give a directory (it is created when missing)", dir.display()),
        )
        .into());
    }
    let runs = args
        .runs
        .iter()
        .map(|p| files::load_run(p).with_context(|| format!("cannot load run {}", p.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    match runs.as_slice() {
        [one] => {
            match args.format {
                ReportFormat::Table => output::stdout(render_summary(&one.summary, Style::Terminal))?,
                ReportFormat::Markdown => output::stdout(render_summary(&one.summary, Style::Markdown))?,
                ReportFormat::Json => output::stdout(export::summary_json(&one.summary)?)?,
            }
            let dir = args.charts_dir.clone().unwrap_or_else(|| one.dir.clone());
            let request = args.request.as_deref();
            if args.html {
                note!("report: {}", files::write_html(&dir, &one.summary, &one.rows, request)?.display());
            }
            if !args.no_charts {
                let written = files::write_charts(&dir, &one.summary, &one.rows, request)?;
                if !one.has_requests_csv {
                    note!(
                        "note: no {} in {}: latency chart drawn from the summary's percentiles",
                        files::REQUESTS_FILE,
                        one.dir.display()
                    );
                }
                for p in written {
                    note!("chart: {}", p.display());
                }
            }
        }
        [a, b] => {
            let c = compare::compare(&a.summary, &b.summary);
            match args.format {
                ReportFormat::Table => output::stdout(compare::render(&c, Style::Terminal))?,
                ReportFormat::Markdown => output::stdout(compare::render(&c, Style::Markdown))?,
                ReportFormat::Json => output::stdout_json(&c)?,
            }
            if args.html {
                let page = pages::pair_page((&a.summary, &a.rows), (&b.summary, &b.rows), &c)?;
                let dir = args.charts_dir.clone().unwrap_or_else(|| b.dir.clone());
                let path = files::write_page(&dir, &files::pair_page_name(&a.summary.run_id), &page)?;
                note!("report: {}", path.display());
            }
        }
        _ => anyhow::bail!("give one run to show or two runs to compare"),
    }
    Ok(Outcome::Ok)
}
