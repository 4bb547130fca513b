//! `kvx bench`: the flags (clap), handed to `settings::bench` as plain data; the run chosen
//! there (one bench, `--serve`, `--compare-transports`, `--sweep`) is started and printed here.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;

use super::common::{Format, ModelArgs, PairArgs};
use super::compare::Compared;
use crate::diagnose::xfer::run_for_calibration;
use crate::pipeline::bench;
use crate::report::files::RunWriter;
use crate::report::summary::{new_run_id, now_rfc3339};
use crate::report::table::{Style, render_summary};
use crate::settings::bench::BenchFlags;
use crate::settings::env::ProcessEnv;
use crate::settings::parse::parse_duration;
use crate::settings::plan::{BenchPlan, resolve_plan};
use crate::{Outcome, output};

#[derive(Debug, Clone, Args)]
#[command(after_help = "Examples:\n  kvx bench --p-tp 8 --d-tp 2\n  \
    kvx bench --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --requests 50 --concurrency 4\n  \
    kvx bench --config bench-configs/p8d2.toml --repeat 5 --format json\n  \
    kvx bench --sweep bench-configs/layout-sweep.toml\n  \
    kvx bench --p-tp 2 --d-tp 2 --rate 20 --duration 30s --prompt-len 1024..32768 --alloc fragmented")]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub pair: PairArgs,
    /// A bench-config file (TOML; keys are the flag names with underscores). Flags override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Run a matrix: a bench-config file whose [sweep] table lists values per axis (tp = ["8:2", "4:4"],
    /// layout, prompt_len, alloc, block_size, model, concurrency, inflight, prefix_hit); one row per point.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub sweep: Option<PathBuf>,
    /// Measured requests per repeat [default: 20 unless --duration].
    #[arg(long, help_heading = "Workload")]
    pub requests: Option<u64>,
    /// Measure for this long per repeat instead of a request count (e.g. 30s).
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Workload")]
    pub duration: Option<Duration>,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency", allow_negative_numbers = true, help_heading = "Workload")]
    pub rate: Option<f64>,
    /// Closed loop: requests kept in flight [default: 2].
    #[arg(long, help_heading = "Workload")]
    pub concurrency: Option<u32>,
    /// Prompt length in tokens, fixed (8192) or uniform over a range (1024..32768) [default: 2048].
    #[arg(long, help_heading = "Workload")]
    pub prompt_len: Option<String>,
    /// File of prompt lengths, one per line, cycled.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt_len", help_heading = "Workload")]
    pub prompt_lens: Option<PathBuf>,
    /// Unmeasured requests before measuring [default: 2].
    #[arg(long, help_heading = "Workload")]
    pub warmup: Option<u64>,
    /// Fraction of each prompt already cached on decode; only the rest is read.
    #[arg(long, allow_negative_numbers = true, help_heading = "Workload")]
    pub prefix_hit: Option<f64>,
    /// Block allocation pattern: contiguous, fragmented, random [default: contiguous].
    #[arg(long, help_heading = "Workload")]
    pub alloc: Option<String>,
    /// Blocks in each engine's pool [default: enough for the concurrency].
    #[arg(long, help_heading = "Workload")]
    pub pool_blocks: Option<u32>,
    /// Seed of prompt lengths, allocations and byte patterns [default: 0].
    #[arg(long, help_heading = "Workload")]
    pub seed: Option<u64>,
    /// Run the measured part this many times (for noise-aware gates) [default: 1].
    #[arg(long, help_heading = "Workload")]
    pub repeat: Option<u32>,
    /// Check received bytes: full, sample, off [default: full for runs under 2 GiB, else sample].
    #[arg(long, help_heading = "Checks")]
    pub verify: Option<String>,
    /// When a load fails: fail, or recompute (vLLM's kv_load_failure_policy) [default: fail].
    #[arg(long, help_heading = "Checks")]
    pub on_load_failure: Option<String>,
    /// Lease prefill ranks hold blocks under (vLLM kv_lease_duration) [default: 30s].
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Checks")]
    pub lease: Option<Duration>,
    /// Deadline of every wait: handshake, reads, notifications [default: 5s].
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, help_heading = "Checks")]
    pub timeout: Option<Duration>,
    /// Transport: ucx, storage, multi, cuda-batch (GPUs of one machine, --mem cuda) [default: ucx].
    #[arg(long, help_heading = "Transport")]
    pub transport: Option<String>,
    /// For --transport multi: the order to try, e.g. ucx,storage.
    #[arg(long, value_delimiter = ',', help_heading = "Transport")]
    pub transports: Option<Vec<String>>,
    /// Shared directory of the storage transport [default: kvx-storage in the temp dir].
    #[arg(long, help_heading = "Transport")]
    pub storage_dir: Option<PathBuf>,
    /// Storage transport: bypass the page cache (O_DIRECT).
    #[arg(long, help_heading = "Transport")]
    pub storage_direct_io: bool,
    /// Storage transport: fdatasync every file before it becomes visible.
    #[arg(long, help_heading = "Transport")]
    pub storage_fsync: bool,
    /// Run the same workload on each transport and print one comparison table, e.g. ucx,storage,multi
    /// (or ucx,cuda-batch with --mem cuda).
    #[arg(long, value_delimiter = ',', help_heading = "Transport", conflicts_with = "compare_modes")]
    pub compare_transports: Option<Vec<String>>,
    /// Run the same workload in each transfer mode and print one comparison table: pull,push.
    #[arg(long, value_delimiter = ',', help_heading = "Transport", conflicts_with = "mode")]
    pub compare_modes: Option<Vec<String>>,
    /// Inject a fault to test resilience: kill-ucx:pR@N (tear down prefill rank R's UCX side after N
    /// measured requests) or exit:pR@N / exit:dR@N (the worker exits). The run exits 0 when the
    /// failure policy held: only requests after the fault failed, as a lost peer fails; no wrong
    /// bytes, no leaked block.
    #[arg(long, value_name = "FAULT", help_heading = "Checks")]
    pub fault: Option<String>,
    /// Who moves the bytes: pull (the decode side reads, as vLLM's NixlConnector) or push (the
    /// prefill side writes, as vLLM's NixlPushConnector) [default: pull].
    #[arg(long, help_heading = "Transport")]
    pub mode: Option<String>,
    /// Simulated prefill compute per model layer on each prefill rank, e.g. 200us (wall time a
    /// GPU would take; the rank's CPU stays free to move bytes) [default: 0].
    #[arg(long, value_parser = parse_duration, allow_hyphen_values = true, value_name = "DURATION", help_heading = "Transport")]
    pub prefill_time_per_layer: Option<Duration>,
    /// Push mode: WRITE each layer as soon as it is computed (layers) or after the whole
    /// prefill (none); the report shows the transfer time hidden behind prefill [default: none].
    #[arg(long, value_name = "none|layers", help_heading = "Transport")]
    pub overlap: Option<String>,
    /// How a request's legs are sent: sequential (prefill, then decode) or concurrent (both at
    /// once; push mode, where decode registers while prefill computes) [default: sequential,
    /// concurrent with --overlap layers].
    #[arg(long, value_name = "sequential|concurrent", help_heading = "Transport")]
    pub dispatch: Option<String>,
    /// Memory of the KV pools: host or cuda [default: host].
    #[arg(long, help_heading = "Transport")]
    pub mem: Option<String>,
    /// GPUs of --mem cuda, e.g. 0,1,2,3: prefill ranks then decode ranks, round-robin [default: 0].
    #[arg(long, value_delimiter = ',', help_heading = "Transport")]
    pub devices: Option<Vec<u32>>,
    /// One GPU for every rank of --mem cuda (--devices N).
    #[arg(long, value_name = "N", conflicts_with = "devices", help_heading = "Transport")]
    pub device: Option<u32>,
    /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
    #[arg(long, help_heading = "Transport")]
    pub ucx_lib: Option<PathBuf>,
    /// UCX_TLS for the workers, e.g. posix,cma,self or tcp.
    #[arg(long, help_heading = "Transport")]
    pub ucx_tls: Option<String>,
    /// UCX error-handling mode: none or peer (peer excludes shared-memory transports) [default: none].
    #[arg(long, help_heading = "Transport")]
    pub err_mode: Option<String>,
    /// UCX progress: busy, wait, hybrid [default: hybrid].
    #[arg(long, help_heading = "Transport")]
    pub progress: Option<String>,
    /// Back the KV pools with huge pages.
    #[arg(long, help_heading = "Transport")]
    pub huge_pages: bool,
    /// GETs in flight per source rank [default: 64].
    #[arg(long, help_heading = "Transport")]
    pub inflight: Option<u32>,
    /// Post coalesced descriptors instead of vLLM's one per block and region.
    #[arg(long, help_heading = "Transport")]
    pub coalesce: bool,
    /// Stage a regression to test a gate: every read waits F times its own duration after it
    /// completes (0.15 makes transfers 15% slower). Recorded in the scenario.
    #[arg(long, value_name = "F", help_heading = "Testing")]
    pub slowdown: Option<f64>,
    /// How decode ranks notify prefill ranks with the UCX transport: ucx (active messages
    /// on the read endpoint, as NIXL does) or zmq [default: ucx].
    #[arg(long, value_enum, help_heading = "Transport")]
    pub notify: Option<crate::transfer::notify::NotifyTransport>,
    // The help names the default from `BatchCopy::default()` (the flag stays an Option so
    // that giving it where no cuda-batch run uses it can be refused).
    #[arg(long, value_enum, help_heading = "Transport", help = crate::transfer::cuda_batch::BatchCopy::help())]
    pub batch_copy: Option<crate::transfer::cuda_batch::BatchCopy>,
    /// Wait for external `kvx worker --connect` processes: prefill on this endpoint's port, decode on port + 1.
    #[arg(long, value_name = "tcp://HOST:PORT", help_heading = "Across hosts")]
    pub listen: Option<String>,
    /// Host other hosts reach this one at [default: 127.0.0.1, or the --listen host].
    #[arg(long, help_heading = "Across hosts")]
    pub advertise_host: Option<String>,
    /// Directory runs are written under [default: results/, or KVX_RESULTS_DIR].
    #[arg(long, help_heading = "Output")]
    pub results_dir: Option<PathBuf>,
    /// Name of the run (the scenario name in reports) [default: the config file's name or "bench"].
    #[arg(long, help_heading = "Output")]
    pub name: Option<String>,
    /// Skip the same-run calibration (memcpy and UCX loopback read).
    #[arg(long, help_heading = "Output")]
    pub no_calibrate: bool,
    /// Output format; json prints the summary to stdout as well.
    #[arg(long, value_enum, default_value_t = Format::Table, help_heading = "Output")]
    pub format: Format,
    /// Serve the workload over HTTP: a prefill engine, a decode engine and the P/D proxy,
    /// driven through the proxy by `kvx load`'s generator (TTFT, ITL, TPOT, e2el, the KV stages
    /// and the TTFT waterfall).
    #[arg(long, help_heading = "Workload")]
    pub serve: bool,
    /// With --serve: objectives for goodput, e.g. ttft=200ms,tpot=50ms (also itl, e2el).
    #[arg(long, requires = "serve", value_name = "NAME=LIMIT,...", help_heading = "Workload")]
    pub slo: Option<String>,
    /// With --serve: serve the engines' and proxy's Prometheus metrics (vLLM's families) on this
    /// port while the run goes; 0 picks a free one (its address is printed on stderr).
    #[arg(long, requires = "serve", value_name = "PORT", help_heading = "Output")]
    pub metrics_port: Option<u16>,
}

impl BenchArgs {
    /// The flags as plain data, for `settings::bench`.
    pub fn flags(&self) -> BenchFlags {
        BenchFlags {
            model: self.model.flags(),
            pair: self.pair.flags(),
            config: self.config.clone(),
            sweep: self.sweep.clone(),
            requests: self.requests,
            duration: self.duration,
            rate: self.rate,
            concurrency: self.concurrency,
            prompt_len: self.prompt_len.clone(),
            prompt_lens: self.prompt_lens.clone(),
            warmup: self.warmup,
            prefix_hit: self.prefix_hit,
            alloc: self.alloc.clone(),
            pool_blocks: self.pool_blocks,
            seed: self.seed,
            repeat: self.repeat,
            verify: self.verify.clone(),
            on_load_failure: self.on_load_failure.clone(),
            lease: self.lease,
            timeout: self.timeout,
            transport: self.transport.clone(),
            transports: self.transports.clone(),
            storage_dir: self.storage_dir.clone(),
            storage_direct_io: self.storage_direct_io,
            storage_fsync: self.storage_fsync,
            compare_transports: self.compare_transports.clone(),
            compare_modes: self.compare_modes.clone(),
            fault: self.fault.clone(),
            mode: self.mode.clone(),
            mem: self.mem.clone(),
            devices: self.devices.clone().or(self.device.map(|d| vec![d])),
            ucx_lib: self.ucx_lib.clone(),
            ucx_tls: self.ucx_tls.clone(),
            err_mode: self.err_mode.clone(),
            progress: self.progress.clone(),
            huge_pages: self.huge_pages,
            inflight: self.inflight,
            coalesce: self.coalesce,
            slowdown: self.slowdown,
            notify: self.notify,
            batch_copy: self.batch_copy,
            listen: self.listen.clone(),
            advertise_host: self.advertise_host.clone(),
            results_dir: self.results_dir.clone(),
            name: self.name.clone(),
            no_calibrate: self.no_calibrate,
            serve: self.serve,
            prefill_time_per_layer: self.prefill_time_per_layer,
            overlap: self.overlap.clone(),
            dispatch: self.dispatch.clone(),
            in_mode_comparison: false,
        }
    }
}

/// Resolves the flags (every run of the plan, before anything starts), runs, prints.
pub fn run(args: &BenchArgs) -> anyhow::Result<Outcome> {
    let plan = resolve_plan(&args.flags(), &ProcessEnv::read())?;
    // From here on Ctrl-C (or SIGTERM) ends the run cleanly with its partial results.
    crate::interrupt::arm();
    let json = args.format == Format::Json;
    let root = plan.results_root().to_path_buf();
    let run_id = new_run_id(&now_rfc3339());
    match plan {
        BenchPlan::Serve(settings) => {
            check_ucx(&settings)?;
            let opts = crate::serve::bench_serve::ServeOptions {
                slo: super::load::parse_slo(args.slo.as_deref())?,
                metrics_port: args.metrics_port,
            };
            Ok(crate::serve::bench_serve::run(&settings, json, &opts)?)
        }
        BenchPlan::CompareTransports(runs) => compare(args, Compared::Transports, &runs, &root, &run_id),
        BenchPlan::CompareModes(runs) => compare(args, Compared::Modes, &runs, &root, &run_id),
        BenchPlan::Sweep(sweep) => {
            let mut writer = RunWriter::create(&root, &run_id)?;
            let summary = super::sweep::run(&sweep, &mut writer, &run_id)?;
            let files = writer.finish(&summary)?;
            output::keep_verdict(output::stdout(summary_text(args.format, &summary, &files)?))?;
            Ok(verdict("kvx bench --sweep", &summary))
        }
        BenchPlan::Single(settings) => {
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
            let files = writer.finish(&summary)?;
            // The run is over and written; a closed stdout does not hide its failures from the
            // exit code.
            output::keep_verdict(output::stdout(summary_text(args.format, &summary, &files)?))?;
            Ok(verdict("kvx bench", &summary))
        }
    }
}

/// Runs a comparison and prints its summary and table.
fn compare(
    args: &BenchArgs,
    what: Compared,
    runs: &[bench::BenchSettings],
    root: &std::path::Path,
    run_id: &str,
) -> anyhow::Result<Outcome> {
    // What one run cannot have (device memory, a UCX, the CUDA driver) is said before any starts.
    runs.iter().try_for_each(check_ucx)?;
    let mut writer = RunWriter::create(root, run_id)?;
    let (summary, table) = super::compare::run(what, runs, &mut writer, run_id)?;
    let files = writer.finish(&summary)?;
    let mut text = summary_text(args.format, &summary, &files)?;
    if args.format != Format::Json {
        text.push_str(&table);
    }
    output::keep_verdict(output::stdout(text))?;
    Ok(verdict(&format!("kvx bench {}", what.flag()), &summary))
}

/// The run's exit: interrupted (130/143) when a signal stopped it, else what its summary says.
fn verdict(what: &str, summary: &crate::report::Summary) -> Outcome {
    match crate::interrupt::requested() {
        Some(sig) => Outcome::Interrupted(sig),
        None => Outcome::of_run(what, summary),
    }
}

/// Device memory this host cannot have (no cuda feature, no libcuda, no such device) and a
/// UCX that cannot be loaded (a bad `--ucx-lib`) are said once, first, before any worker or
/// run directory exists (every worker would fail the same way, and say so in its own words).
/// The storage and cuda-batch transports load no UCX.
fn check_ucx(s: &bench::BenchSettings) -> anyhow::Result<()> {
    use crate::pipeline::proto::TransportKind;
    let kind = s.workers.transport.kind;
    if kind == TransportKind::CudaBatch {
        s.workers.mem.check_available().context(
            "--transport cuda-batch copies the KV pools between GPUs of this machine with the CUDA driver",
        )?;
        return Ok(());
    }
    s.workers.mem.check_available()?;
    if kind != TransportKind::Storage {
        crate::transfer::ucx::Ucx::load(s.workers.transport.ucx_lib.as_deref())?;
    }
    Ok(())
}

/// The summary as the user asked for it: its JSON, or the tables and where the run was written.
fn summary_text(
    format: Format,
    summary: &crate::report::Summary,
    files: &[PathBuf],
) -> anyhow::Result<String> {
    Ok(match format {
        Format::Json => {
            format!("{}\n", String::from_utf8_lossy(&crate::report::export::summary_json(summary)?))
        }
        Format::Table => {
            let dir = files.first().and_then(|f| f.parent());
            format!(
                "{}results: {}\n",
                render_summary(summary, Style::Terminal),
                dir.map_or_else(String::new, |d| d.display().to_string())
            )
        }
    })
}
