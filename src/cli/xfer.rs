//! `kvx xfer`: its flags (`settings::xfer`, which checks them and says what this process
//! does), the run, and rendering of the report.
use anyhow::Context as _;
use clap::Args;

use crate::error::AlreadyReported;
pub use crate::settings::parse::{parse_duration, parse_size};
pub use crate::settings::xfer::Format;
use crate::settings::xfer::{XferFlags, XferRun, resolve};
use crate::transfer::ucx::{proto_capture_dir, proto_capture_env, ucx_log_messages};
use crate::transfer::xfer::{self, TargetSpec, XferError, XferReport};
use crate::{Outcome, output};

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
    };
    // Ctrl-C stops measuring; the cases measured so far are printed (exit 130/143).
    crate::interrupt::arm();
    if proto_capture_dir().is_none() && cfg.cuda_batch.is_none() {
        // UCX reports the protocols it selects only through settings read when it loads:
        // run the measurement in a child started with them (see `ucx::proto`).
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

/// Runs this same `kvx xfer` command line again in a child process whose environment makes
/// UCX record its protocols into `dir`, passes its stdout and stderr through, shows UCX's
/// own log messages (redirected to `dir`) on stderr, and exits with the child's status.
fn rerun_recording_protocols(env: Vec<(String, String)>, dir: &std::path::Path) -> anyhow::Result<Outcome> {
    let exe = std::env::current_exe().context("finding the kvx executable to run the measurement")?;
    let status = std::process::Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .envs(env)
        .status()
        .with_context(|| format!("running {}", exe.display()))?;
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

/// Human-readable size: 4KiB, 64MiB.
pub fn fmt_size(b: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (m, u) in UNITS {
        if b >= m && b.is_multiple_of(m) {
            return format!("{}{u}", b / m);
        }
    }
    format!("{b}B")
}

fn render_table(r: &XferReport) -> String {
    let mut out = String::new();
    let memory = match r.memory.device {
        Some(d) => format!("{} (device {d})", r.memory.kind),
        None => format!("{} ({})", r.memory.kind, r.memory.pages),
    };
    if let Some(b) = &r.cuda_batch {
        out.push_str(&format!(
            "cuda-batch: {} ({}), {:.0} driver call(s) per batch, CUDA IPC between two processes\n\
             memory {memory}  {}  working set {}\n",
            b.driver_call,
            b.path,
            b.calls_per_batch,
            r.memory.residency,
            fmt_size(r.memory.working_set_bytes),
        ));
        return out + &misalign_line(r) + &results_table(r) + &verification_line(r);
    }
    out.push_str(&format!(
        "UCX {} ({}, {})  transports: {}\nerr-mode {}  progress {}  memory {memory}  {}  working set {}\n",
        r.ucx.version,
        r.ucx.library,
        r.ucx.source,
        r.ucx.transports,
        r.ucx.err_mode,
        r.ucx.progress,
        r.memory.residency,
        fmt_size(r.memory.working_set_bytes),
    ));
    out.push_str(&format!("protocols: {}\n", r.ucx.protocols.summary()));
    for e in &r.ucx.env {
        out.push_str(&format!("ucx setting: {e}\n"));
    }
    for w in &r.warnings {
        out.push_str(&format!("warning: {w}\n"));
    }
    if r.memory.kind == "ucx-alloc" || r.memory.residency == "hot" {
        out.push_str(
            "note: hot and/or UCX-allocated buffers flatter the numbers; a KV cache is cold user memory\n",
        );
    }
    out + &misalign_line(r) + &results_table(r) + &verification_line(r)
}

/// `--misalign`'s shift, when there is one.
fn misalign_line(r: &XferReport) -> String {
    if r.misalign.is_none() {
        return String::new();
    }
    format!(
        "misaligned: every read's local offset +{} B, remote offset +{} B\n",
        r.misalign.local_bytes, r.misalign.remote_bytes
    )
}

/// What the `verified` columns mean.
fn verification_line(r: &XferReport) -> String {
    format!("verified: {}\n", r.verification)
}

/// The per-case rows.
fn results_table(r: &XferReport) -> String {
    let mut out = String::new();
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::ASCII_BORDERS_ONLY_CONDENSED);
    let (ceiling, ratio) = if r.ceiling == "device_copy" {
        ("device copy GB/s", "vs device copy")
    } else {
        ("memcpy GB/s", "ratio")
    };
    // Device memory also names the GPU's bandwidth for each batch's bytes (one copy).
    let bulk = r.results.iter().any(|x| x.bulk_copy_gbps.is_some());
    let mut header = vec!["size", "inflight", "GB/s", ceiling, ratio];
    if bulk {
        header.extend(["bulk copy GB/s", "vs bulk"]);
    }
    header.extend(["p50 us", "p99 us", "post us", "done us", "msgs/s"]);
    // Unaligned descriptors per batch: always with cuda-batch (the kernel's path depends on
    // it), elsewhere when there are any.
    let unaligned = r.cuda_batch.is_some() || r.results.iter().any(|x| x.unaligned_descriptors > 0);
    if unaligned {
        header.push("unaligned/batch");
    }
    header.extend(["verified batches", "verified"]);
    t.set_header(header);
    for x in &r.results {
        let mut row = vec![fmt_size(x.size_bytes), x.inflight.to_string(), format!("{:.2}", x.gbps)];
        row.extend([format!("{:.2}", x.ceiling_gbps), format!("{:.2}", x.ratio_to_ceiling)]);
        if bulk {
            let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
            row.extend([f(x.bulk_copy_gbps), f(x.ratio_to_bulk_copy)]);
        }
        row.extend([
            format!("{:.1}", x.p50_us),
            format!("{:.1}", x.p99_us),
            format!("{:.1}", x.post_us),
            format!("{:.1}", x.complete_us),
            format!("{:.0}", x.msgs_per_sec),
        ]);
        if unaligned {
            row.push(format!("{:.0}", x.unaligned_descriptors as f64 / x.timed_batches.max(1) as f64));
        }
        row.extend([format!("{} of {}", x.verified_batches, x.timed_batches), fmt_size(x.verified_bytes)]);
        t.add_row(row);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::ucx::{ErrMode, ProgressMode};
    use crate::transfer::xfer::{Misalign, XferResult};

    fn result(size: u64, inflight: usize, gbps: f64, bulk: Option<f64>) -> XferResult {
        XferResult {
            size_bytes: size,
            inflight,
            gbps,
            ceiling_gbps: 2.0,
            ratio_to_ceiling: gbps / 2.0,
            memcpy_gbps: None,
            ratio_to_memcpy: None,
            bulk_copy_gbps: bulk,
            ratio_to_bulk_copy: bulk.map(|b| gbps / b),
            p50_us: 100.0,
            p99_us: 110.0,
            max_us: 120.0,
            post_us: 25.0,
            complete_us: 104.0,
            msgs_per_sec: 1e6,
            batches: 3,
            bytes: size * inflight as u64 * 3,
            verified_bytes: size * inflight as u64,
            verified_batches: 1,
            timed_batches: 3,
            unaligned_descriptors: 0,
        }
    }

    fn report(memory: &str, ceiling: &str, results: Vec<XferResult>) -> XferReport {
        XferReport {
            ucx: crate::transfer::xfer::UcxReport {
                library: "libucp.so.0".into(),
                version: "1.22.0".into(),
                transports: "cuda_ipc/cuda".into(),
                source: "--ucx-lib".into(),
                err_mode: ErrMode::None,
                progress: ProgressMode::default(),
                target_library: "libucp.so.0".into(),
                target_version: "1.22.0".into(),
                protocols: crate::transfer::ucx::ProtoReport { uses: Vec::new(), note: Some("test".into()) },
                env: Vec::new(),
            },
            memory: crate::transfer::xfer::MemoryReport {
                kind: memory.into(),
                device: (memory == "cuda").then_some(0),
                huge_pages: false,
                pages: "4KiB".into(),
                working_set_bytes: 1 << 30,
                residency: "cold".into(),
            },
            ceiling: ceiling.into(),
            warnings: Vec::new(),
            results,
            transport: "ucx".into(),
            cuda_batch: None,
            verification: crate::transfer::xfer::verification_rule(),
            misalign: Misalign::default(),
        }
    }

    #[test]
    fn device_memory_tables_add_the_bulk_copy_and_host_tables_do_not() {
        let cuda = render_table(&report(
            "cuda",
            "device_copy",
            vec![result(8192, 10_240, 497.0, Some(1277.0)), result(8192, 1, 0.7, None)],
        ));
        let header = cuda.lines().find(|l| l.contains("inflight")).expect("a header");
        for col in ["device copy GB/s", "vs device copy", "bulk copy GB/s", "vs bulk"] {
            assert!(header.contains(col), "{col} missing from {header}");
        }
        let row = cuda.lines().find(|l| l.contains("10240")).expect("the 10,240 row");
        assert!(row.contains("1277.00") && row.contains("0.39"), "{row}");
        // A case without the figure shows a dash, not a zero.
        let one = cuda.lines().find(|l| l.contains("0.70")).expect("the batch-of-1 row");
        assert!(one.contains(" - "), "{one}");
        let host = render_table(&report("host", "memcpy", vec![result(65536, 32, 5.0, None)]));
        assert!(!host.contains("bulk"), "{host}");
        assert!(host.contains("memcpy GB/s"), "{host}");
    }

    #[test]
    fn batch_copy_help_shows_the_default_the_code_has() {
        use clap::CommandFactory as _;
        let want = format!("[default: {}]", crate::transfer::cuda_batch::BatchCopy::default().as_str());
        let cmd = crate::cli::Cli::command();
        for sub in ["xfer", "bench"] {
            let c = cmd.find_subcommand(sub).expect("the subcommand");
            let arg = c.get_arguments().find(|a| a.get_id() == "batch_copy").expect("--batch-copy");
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(help.contains(&want), "kvx {sub} --batch-copy: {help}");
            let values: Vec<String> =
                arg.get_possible_values().iter().map(|v| v.get_name().to_string()).collect();
            assert_eq!(values, ["api", "api-v2", "api-v1", "per-copy", "kernel"], "kvx {sub}");
        }
    }

    #[test]
    fn tables_say_how_many_timed_batches_were_verified_and_how() {
        let mut r = result(8192, 64, 5.0, None);
        (r.verified_batches, r.timed_batches, r.unaligned_descriptors) = (5, 70, 0);
        let host = render_table(&report("host", "memcpy", vec![r.clone()]));
        assert!(host.contains("verified batches") && host.contains("5 of 70"), "{host}");
        assert!(host.contains("verified: in place, on the timed reads: 1 timed batch in 16"), "{host}");
        assert!(!host.contains("unaligned"), "no column without unaligned reads: {host}");
        r.unaligned_descriptors = 70 * 64;
        let mut rep = report("host", "memcpy", vec![r]);
        rep.misalign = Misalign { local_bytes: 3, remote_bytes: 3 };
        let shifted = render_table(&rep);
        assert!(shifted.contains("unaligned/batch"), "{shifted}");
        assert!(
            shifted.contains("misaligned: every read's local offset +3 B, remote offset +3 B"),
            "{shifted}"
        );
        let row = shifted.lines().find(|l| l.contains("8KiB")).expect("the row");
        assert!(row.contains(" 64 "), "64 unaligned reads per batch: {row}");
    }

    #[test]
    fn sizes_format_back() {
        assert_eq!(fmt_size(64 << 10), "64KiB");
        assert_eq!(fmt_size(3 << 30), "3GiB");
        assert_eq!(fmt_size(1000), "1000B");
    }
}
