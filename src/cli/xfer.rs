//! `kvx xfer`: its flags (`settings::xfer`, which checks them and says what this process
//! does), the run, and rendering of the report.
use anyhow::Context as _;
use clap::Args;

use crate::config::xfer::TargetSpec;
use crate::diagnose::xfer::{self, XferError};
use crate::error::AlreadyReported;
use crate::error::Outcome;
use crate::output;
use crate::report::xfer::render_table;
pub use crate::settings::parse::{parse_duration, parse_size};
pub use crate::settings::xfer::Format;
use crate::settings::xfer::{XferFlags, XferRun, resolve};
use crate::transfer::ucx::{proto_capture_dir, proto_capture_env, ucx_log_messages};

/// One-sided UCX reads between two processes: GB/s, latency, ratio to memcpy.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  kvx xfer                                   # local target process, cold host memory, default sweep
  kvx xfer --sizes 64KiB,1MiB --inflight 1,32 --format json
  kvx xfer --hot --ucx-alloc --sizes 64KiB   # cache-hot, UCX-allocated: compare with ucx_perftest
  kvx xfer --listen 0.0.0.0:5700             # host A: serve a region
  kvx xfer --connect hostA:5700              # host B: read it
  kvx xfer --mem cuda --device 0 --sizes 64KiB,1MiB,16MiB --inflight 1,32
  kvx xfer --transport cuda-batch --mem cuda --sizes 8KiB,64KiB,1MiB,16MiB --inflight 64
  kvx xfer --transport cuda-batch --batch-copy api-v2 --mem cuda --sizes 8KiB --inflight 1024
  kvx xfer --transport cuda-batch --mem cuda --sizes 8KiB --inflight 1024 --misalign 3

Numbers are GB/s = 1e9 B/s. The ceiling is measured in the same run over the same working set:
for host memory a single-thread memcpy (memcpy_gbps; ratio = kvx / memcpy), for device memory a
device-to-device copy of the same size and batch (\"vs device copy\"). Reports name the protocol
UCX chose for the reads; a device-memory run that gets software emulation warns with the fix.
With --transport cuda-batch each batch of --inflight reads is one batched copy from the target
process's GPU memory (CUDA IPC: two processes on one machine): one launch of kvx's gather-copy
kernel, or with --batch-copy api one cuMemcpyBatchAsync; post us is one batch's posting.
Verification checks what the timed reads wrote: 1 timed batch in 16 (the first included) has its
destinations cleared before and every byte checked after (outside the measured time), and the
last timed batch's destinations are checked at the end (\"verified batches\": N of M timed).")]
#[command(allow_negative_numbers = true)]
pub struct XferArgs {
    #[command(flatten)]
    pub settings: XferFlags,
}

pub fn run(args: &XferArgs) -> anyhow::Result<Outcome> {
    let format = args.settings.format;
    let (cfg, connect) = match resolve(&args.settings)? {
        XferRun::Target { addr, peer_timeout, opts } => {
            // The initiator that started this process stops it; Ctrl-C at a terminal signals both.
            if let Err(e) = crate::transfer::ucx::ignore_sigint() {
                tracing::debug!("cannot ignore SIGINT: {e}");
            }
            let stream = xfer::connect_target(&addr, peer_timeout)?;
            // This process is the initiator's child and shares its stderr: what the initiator
            // reports (its own failure, or ours that we sent it) is not printed twice.
            return match xfer::run_target(stream, &opts) {
                Ok(()) => Ok(Outcome::Ok),
                Err(e @ (XferError::InitiatorGone | XferError::ReportedToInitiator(_))) => {
                    Err(AlreadyReported(e.to_string()).into())
                }
                Err(e) => Err(e.into()),
            };
        }
        XferRun::Listen { addr, peer_timeout, opts } => {
            xfer::listen_and_serve(&addr, peer_timeout, &opts)?;
            return Ok(Outcome::Ok);
        }
        XferRun::Measure { cfg, connect } => (cfg, connect),
        XferRun::Compare { runs, rounds } => return compare(&runs, rounds, format),
    };
    // Ctrl-C stops measuring; the cases measured so far are printed (exit 130/143).
    crate::interrupt::arm();
    if proto_capture_dir().is_some() {
        // The measuring child of `rerun_recording_protocols` (its own process group): it stops
        // on the signal its parent passes on, or when that parent is gone.
        crate::interrupt::follow_parent();
    } else if cfg.cuda_batch.is_none() {
        // UCX reports the protocols it selects only through settings read when it loads:
        // run the measurement in a child started with them (see `ucx::protocols`).
        match tempfile::Builder::new().prefix("kvx-xfer-").tempdir() {
            Ok(dir) => match proto_capture_env(dir.path()) {
                Ok(env) => return rerun_recording_protocols(env, dir.path()),
                Err(why) => tracing::info!("UCX protocols not recorded: {why}"),
            },
            Err(e) => tracing::info!("UCX protocols not recorded: no temporary directory ({e})"),
        }
    }
    let target = match connect {
        Some(addr) => TargetSpec::Remote { addr },
        None => TargetSpec::Local {
            exe: std::env::current_exe().context("finding the kvx executable to start the target process")?,
        },
    };
    let report = match xfer::run(&cfg, &target, |_| {}) {
        Ok(r) => r,
        // Wrong bytes are a failed run (exit 1), not a failure to run.
        Err(XferError::Verify(why)) => return Ok(Outcome::Failed(format!("kvx xfer: {why}"))),
        Err(e) if cfg.cuda_batch.is_some() => {
            return Err(anyhow::Error::from(e).context(
                "--transport cuda-batch copies device memory between two processes with the CUDA driver",
            ));
        }
        Err(e) => return Err(e.into()),
    };
    for w in &report.warnings {
        output::note!("kvx xfer: warning: {w}");
    }
    let interrupted = crate::interrupt::requested();
    if let Some(sig) = interrupted {
        let planned = cfg.sizes.len() * cfg.inflight.len();
        output::note!(
            "kvx xfer: interrupted by {}: {} of {planned} cases measured (the last one may be short)",
            sig.name(),
            report.results.len()
        );
    }
    match format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render_table(&report))?,
    }
    Ok(interrupted.map_or(Outcome::Ok, Outcome::Interrupted))
}

/// `--compare-transports`: each transport's measurement in turn (a local target each), each
/// report as it would print alone, then one table of every case's GB/s on each transport and
/// its ratio to the first transport's. UCX's protocols are not recorded in this mode.
fn compare(
    runs: &[(crate::settings::xfer::TransportArg, crate::config::xfer::XferConfig)],
    rounds: u32,
    format: Format,
) -> anyhow::Result<Outcome> {
    crate::interrupt::arm();
    let exe = std::env::current_exe().context("finding the kvx executable to start the target process")?;
    let target = TargetSpec::Local { exe };
    // Each round's reports, in the order given (whatever order the round ran them in).
    let mut done: Vec<Vec<(crate::settings::xfer::TransportArg, crate::report::xfer::XferReport)>> =
        Vec::new();
    'rounds: for round in 0..rounds as usize {
        let order: Vec<usize> =
            if round % 2 == 0 { (0..runs.len()).collect() } else { (0..runs.len()).rev().collect() };
        let mut reports = Vec::new();
        for i in order {
            let (t, cfg) = &runs[i];
            if crate::interrupt::requested().is_some() {
                break 'rounds;
            }
            if rounds > 1 {
                output::note!("kvx xfer --compare-transports: round {}/{rounds}: {}", round + 1, t.as_str());
            }
            let report = match xfer::run(cfg, &target, |_| {}) {
                Ok(r) => r,
                Err(XferError::Verify(why)) => {
                    return Ok(Outcome::Failed(format!("kvx xfer ({}): {why}", t.as_str())));
                }
                Err(e) => {
                    return Err(anyhow::Error::from(e)
                        .context(format!("--compare-transports: the {} run", t.as_str())));
                }
            };
            reports.push((i, *t, report));
        }
        reports.sort_by_key(|(i, _, _)| *i);
        done.push(reports.into_iter().map(|(_, t, r)| (t, r)).collect());
    }
    // A round an interrupt cut short is left out of the comparison (the first is kept whole
    // or as far as it went, for its tables).
    let whole: Vec<&Vec<_>> = done.iter().filter(|r| r.len() == runs.len()).collect();
    let per_round: Vec<Vec<crate::report::xfer::ComparisonRow>> = if whole.is_empty() {
        done.iter().take(1).map(|r| comparison_of(r)).collect()
    } else {
        whole.iter().map(|r| comparison_of(r)).collect()
    };
    let rows = crate::report::xfer::merge_rounds(&per_round);
    let empty = Vec::new();
    let reports = done.first().unwrap_or(&empty);
    match format {
        Format::Json => {
            let rounds_json: Vec<Vec<serde_json::Value>> = done
                .iter()
                .map(|round| {
                    round
                        .iter()
                        .map(|(t, r)| serde_json::json!({ "transport": t.as_str(), "report": r }))
                        .collect()
                })
                .collect();
            let first = rounds_json.first().cloned().unwrap_or_default();
            let mut v = serde_json::json!({ "runs": first, "comparison": rows });
            if rounds > 1 {
                v["rounds"] = serde_json::json!(rounds_json);
            }
            output::stdout_json(&v)?;
        }
        Format::Table => {
            let mut text = String::new();
            for (t, r) in reports {
                let of = if done.len() > 1 { format!(" (round 1 of {})", done.len()) } else { String::new() };
                text.push_str(&format!("== --transport {}{of} ==\n", t.as_str()));
                text.push_str(&render_table(r));
                text.push('\n');
            }
            text.push_str(&crate::report::xfer::render_comparison(&rows));
            output::stdout(text)?;
        }
    }
    Ok(crate::interrupt::requested().map_or(Outcome::Ok, Outcome::Interrupted))
}

/// One round's reports side by side.
fn comparison_of(
    round: &[(crate::settings::xfer::TransportArg, crate::report::xfer::XferReport)],
) -> Vec<crate::report::xfer::ComparisonRow> {
    crate::report::xfer::comparison(&round.iter().map(|(t, r)| (t.as_str(), r)).collect::<Vec<_>>())
}

/// Runs this same `kvx xfer` command line again in a child process whose environment makes
/// UCX record its protocols into `dir`, passes its stdout and stderr through, shows UCX's
/// own log messages (redirected to `dir`) on stderr, and exits with the child's status.
///
/// The child runs in a process group of its own, so a terminal's Ctrl-C (or a signal to this
/// process's group) reaches this process only, and the first SIGINT or SIGTERM is passed on
/// to the child once: it stops measuring, stops its target and prints what it measured
/// (exit 130/143, which this process returns). Sent to the whole group, the child would get
/// the signal twice, and a second signal ends a run at once, without its clean-up.
fn rerun_recording_protocols(env: Vec<(String, String)>, dir: &std::path::Path) -> anyhow::Result<Outcome> {
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().context("finding the kvx executable to run the measurement")?;
    let mut child = std::process::Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .envs(env)
        .process_group(0)
        .spawn()
        .with_context(|| format!("running {}", exe.display()))?;
    let status =
        wait_passing_signals_on(&mut child).with_context(|| format!("waiting for {}", exe.display()))?;
    for line in ucx_log_messages(dir) {
        output::note!("{line}");
    }
    Ok(match status.code() {
        Some(0) => Outcome::Ok,
        Some(code) => Outcome::Exit(u8::try_from(code).unwrap_or(2)),
        None => {
            output::note!("error: the kvx xfer process was killed ({status})");
            Outcome::Exit(2)
        }
    })
}

/// How long a child that was passed a signal has to end before it is killed (it stops within
/// 2 s: this bounds a child that cannot).
const CHILD_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits for `child`, passing the first SIGINT or SIGTERM this process gets on to it, and
/// killing it should it not end within [`CHILD_STOP_GRACE`] of that.
fn wait_passing_signals_on(child: &mut std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    use nix::sys::signal::{Signal as Sig, kill};
    use nix::unistd::Pid;
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    let mut passed_at = None;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        match (passed_at, crate::interrupt::requested()) {
            (None, Some(sig)) => {
                let sig = match sig {
                    crate::error::Signal::Interrupt => Sig::SIGINT,
                    crate::error::Signal::Terminate => Sig::SIGTERM,
                };
                if let Err(e) = kill(pid, sig) {
                    tracing::debug!("cannot pass {sig} on to the kvx xfer process: {e}");
                }
                passed_at = Some(std::time::Instant::now());
            }
            (Some(at), _) if at.elapsed() > CHILD_STOP_GRACE => {
                output::note!(
                    "error: the kvx xfer process did not stop within {CHILD_STOP_GRACE:?} of the signal; killing it"
                );
                child.kill()?;
                return child.wait();
            }
            _ => {}
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
