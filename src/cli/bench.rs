//! `kvx bench`: its settings (`settings::bench::BenchFlags`, flags and config-file keys) plus
//! how the result is printed; the run chosen there (one bench, `--serve`,
//! `--compare-transports`, `--sweep`) is started and printed here.

use anyhow::Context as _;
use clap::Args;

use super::common::Format;
use crate::diagnose::xfer::run_for_calibration;
use crate::error::Outcome;
use crate::output;
use crate::pipeline::bench;
use crate::pipeline::bench::compare::{self, Compared};
use crate::report::files::RunWriter;
use crate::report::summary::{new_run_id, now_rfc3339};
use crate::report::table::{Style, render_summary};
use crate::settings::bench::BenchFlags;
use crate::settings::env::ProcessEnv;
use crate::settings::plan::{BenchJob, resolve_bench_job};

#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  kvx bench --p-tp 8 --d-tp 2\n  \
    kvx bench --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --requests 50 --concurrency 4\n  \
    kvx bench --config bench-configs/p8d2.toml --repeat 5 --format json\n  \
    kvx bench --sweep bench-configs/layout-sweep.toml\n  \
    kvx bench --p-tp 2 --d-tp 2 --rate 20 --duration 30s --prompt-len 1024..32768 --alloc fragmented")]
#[command(allow_negative_numbers = true)]
pub struct BenchArgs {
    // The settings: flags and config-file keys (`settings::bench`).
    #[command(flatten)]
    pub settings: BenchFlags,
}

/// Resolves the flags (every run of the plan, before anything starts), runs, prints.
pub fn run(args: &BenchArgs) -> anyhow::Result<Outcome> {
    let plan = resolve_bench_job(&args.settings, &ProcessEnv::read())?;
    // From here on Ctrl-C (or SIGTERM) ends the run cleanly with its partial results.
    crate::interrupt::arm();
    let format = args.settings.format.unwrap_or_default();
    let json = format == Format::Json;
    let root = plan.results_root().to_path_buf();
    let run_id = new_run_id(&now_rfc3339());
    match plan {
        BenchJob::Serve(settings, opts) => {
            check_ucx(&settings)?;
            Ok(crate::serve::bench_serve::run(&settings, json, &opts)?)
        }
        BenchJob::CompareTransports(runs) => compare(format, Compared::Transports, &runs, &root, &run_id),
        BenchJob::CompareModes(runs) => compare(format, Compared::Modes, &runs, &root, &run_id),
        BenchJob::CompareKvBuffer(runs) => compare(format, Compared::KvBuffer, &runs, &root, &run_id),
        BenchJob::Sweep(sweep) => {
            let mut writer = RunWriter::create(&root, &run_id)?;
            let summary =
                crate::pipeline::bench::sweep::run(&sweep, &mut writer, &run_id, run_for_calibration)?;
            // Printed before any file is written: a full disk does not hide what was measured.
            output::keep_verdict(output::stdout(summary_text(format, &summary, writer.dir())?))?;
            writer.finish(&summary)?;
            Ok(verdict("kvx bench --sweep", &summary))
        }
        BenchJob::Single(settings) => {
            check_ucx(&settings)?;
            let mut writer = RunWriter::create(&root, &run_id)?;
            let pair = settings.pair();
            output::note!(
                "kvx bench: P tp {} -> D tp {} | {} | {} requests of {} tokens | writing {}",
                pair.p.tp,
                pair.d.tp,
                pair.model.name,
                settings.requests.map_or_else(|| "timed".to_string(), |r| r.to_string()),
                settings.lens,
                writer.dir().display()
            );
            let summary = bench::run(&settings, &mut writer, &run_id, run_for_calibration)?;
            for w in &summary.warnings {
                output::note!("kvx bench: WARNING: {w}");
            }
            // The run is over: printed first (a full disk does not hide what was measured), then
            // written; a closed stdout does not hide its failures from the exit code.
            output::keep_verdict(output::stdout(summary_text(format, &summary, writer.dir())?))?;
            writer.finish(&summary)?;
            Ok(verdict("kvx bench", &summary))
        }
    }
}

/// Runs a comparison and prints its summary and table.
fn compare(
    format: Format,
    what: Compared,
    runs: &[crate::config::bench::BenchSettings],
    root: &std::path::Path,
    run_id: &str,
) -> anyhow::Result<Outcome> {
    // What one run cannot have (device memory, a UCX, the CUDA driver) is said before any starts.
    runs.iter().try_for_each(check_ucx)?;
    let mut writer = RunWriter::create(root, run_id)?;
    let (summary, table) = compare::run(what, runs, &mut writer, run_id, run_for_calibration)?;
    let mut text = summary_text(format, &summary, writer.dir())?;
    if format != Format::Json {
        text.push_str(&table);
    }
    output::keep_verdict(output::stdout(text))?;
    writer.finish(&summary)?;
    Ok(verdict(&format!("kvx bench {}", what.flag()), &summary))
}

/// The run's exit: interrupted (130/143) when a signal stopped it, else what its summary says.
fn verdict(what: &str, summary: &crate::report::Summary) -> Outcome {
    match crate::interrupt::requested() {
        Some(sig) => Outcome::Interrupted(sig),
        None => crate::report::verdict::outcome(what, summary),
    }
}

/// Device memory this host cannot have (no cuda feature, no libcuda, no such device) and a
/// UCX that cannot be loaded (a bad `--ucx-lib`) are said once, first, before any worker or
/// run directory exists (every worker would fail the same way, and say so in its own words).
/// The storage and cuda-batch transports load no UCX.
fn check_ucx(s: &crate::config::bench::BenchSettings) -> anyhow::Result<()> {
    use crate::vocab::kinds::TransportKind;
    let kind = s.workers.transport.kind;
    if kind == TransportKind::CudaBatch {
        s.workers.mem.check_available().context(
            "--transport cuda-batch copies the KV pools between GPUs of this machine with the CUDA driver",
        )?;
        return Ok(());
    }
    s.workers.mem.check_available()?;
    if kind != TransportKind::Storage {
        let ucx = crate::transfer::ucx::Ucx::load(s.workers.transport.ucx_lib.as_deref())?;
        // A UCX_TLS that leaves UCX no transport fails every worker's ucp_init: said once,
        // here, naming the flag.
        if let Some((_, tls)) = s.workers.worker_env.iter().find(|(k, _)| k == "UCX_TLS") {
            let opts = crate::transfer::ucx::ContextOptions {
                config: vec![("TLS".into(), tls.clone())],
                ..Default::default()
            };
            if let Err(e) = crate::transfer::ucx::Context::new(&ucx, &opts) {
                return Err(crate::error::ConfigError::new(
                    "--ucx-tls",
                    format!("UCX cannot start with transports {tls:?}: {e} (`kvx doctor` lists this host's)"),
                )
                .into());
            }
        }
    }
    Ok(())
}

/// The summary as the user asked for it: its JSON, or the tables and where the run was written.
fn summary_text(
    format: Format,
    summary: &crate::report::Summary,
    dir: &std::path::Path,
) -> anyhow::Result<String> {
    Ok(match format {
        Format::Json => {
            format!("{}\n", String::from_utf8_lossy(&crate::report::export::summary_json(summary)?))
        }
        Format::Table => {
            format!("{}results: {}\n", render_summary(summary, Style::Terminal), dir.display())
        }
    })
}
