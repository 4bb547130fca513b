//! `kvx xfer`: flags, resolution into an `XferConfig`, and printing of the report
//! (`diagnose::xfer` measures, `report::xfer` renders).
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use crate::diagnose::xfer::{
    self, Misalign, SessionOptions, TargetOptions, TargetSpec, XferConfig, XferError,
};
use crate::error::{AlreadyReported, ConfigError};
use crate::report::xfer::render_table;
pub use crate::settings::parse::parse_duration;
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{ErrMode, ProgressMode, proto_capture_dir, proto_capture_env, ucx_log_messages};
use crate::{Outcome, output};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Format {
    #[default]
    Table,
    Json,
}

/// `--mem`: which memory the buffers live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum MemArg {
    /// The user's own host allocation (what a KV cache is without GPUs).
    #[default]
    Host,
    /// CUDA device memory (cuMemAlloc) on --device: needs libcuda, a GPU and a UCX built with CUDA.
    Cuda,
}

/// `--transport`: what moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransportArg {
    /// One-sided UCX GETs, one per read.
    #[default]
    Ucx,
    /// GPUs of one machine: the target's device buffer mapped with CUDA IPC, each batch of
    /// reads one batched copy (see --batch-copy). Needs --mem cuda; no UCX.
    CudaBatch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Initiator,
    Target,
}

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
    /// Message sizes to sweep (suffixes KiB/MiB/GiB or K/M/G = powers of 1024, kB/MB/GB = powers of 1000).
    #[arg(long, value_delimiter = ',', default_value = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// GETs in flight per batch (each sample is one batch of this many reads).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub inflight: Vec<usize>,
    /// Bytes each side registers; reads rotate over it so they come from DRAM (cold mode).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// Read the same offset every time (cache-resident); labelled `hot` in reports.
    #[arg(long)]
    pub hot: bool,
    /// Let UCX allocate the buffers (UCP_MEM_MAP_ALLOCATE): flattering, not what a KV cache is.
    #[arg(long)]
    pub ucx_alloc: bool,
    /// Back host buffers with huge pages (MAP_HUGETLB; fails with a hint if none are reserved).
    #[arg(long)]
    pub huge_pages: bool,
    /// Memory the buffers live in.
    #[arg(long, value_enum, default_value_t = MemArg::Host)]
    pub mem: MemArg,
    /// What moves the bytes: ucx, or cuda-batch (device memory, one machine).
    #[arg(long, value_enum, default_value_t = TransportArg::Ucx)]
    pub transport: TransportArg,
    // The help names the default from `BatchCopy::default()` (the flag stays an Option so
    // that giving it without --transport cuda-batch can be refused).
    #[arg(long, value_enum, help = crate::transfer::cuda_batch::BatchCopy::help())]
    pub batch_copy: Option<crate::transfer::cuda_batch::BatchCopy>,
    /// Shift every read's local and remote offset by BYTES (one value: both sides; two: local,
    /// remote), so that descriptors are not 16-byte aligned: e.g. 3 (both sides agree modulo
    /// 16: the gather kernel's byte head and tail) or 0,1 (they differ: its narrow units).
    #[arg(long, value_name = "BYTES[,BYTES]", value_delimiter = ',', num_args = 1)]
    pub misalign: Vec<u64>,
    /// CUDA device for --mem cuda [default: 0].
    #[arg(long)]
    pub device: Option<u32>,
    /// UCX error-handling mode (peer excludes the shared-memory transports).
    #[arg(long, value_enum, default_value_t = ErrMode::None)]
    pub err_mode: ErrMode,
    /// How waiting processes progress UCX.
    #[arg(long, value_enum, default_value_t = ProgressMode::Hybrid)]
    pub progress: ProgressMode,
    /// libucp.so to load (default: KVX_UCX_LIB, then .ucx/, then the system's).
    #[arg(long)]
    pub ucx_lib: Option<PathBuf>,
    /// Restrict UCX transports (UCX_TLS), e.g. `posix,cma,self`.
    #[arg(long)]
    pub ucx_tls: Option<String>,
    /// Minimum measuring time per case, e.g. 200ms, 1s.
    #[arg(long, default_value = "200ms", value_parser = parse_duration, allow_hyphen_values = true)]
    pub duration: Duration,
    /// Measure exactly this many batches per case (overrides --duration).
    #[arg(long)]
    pub iters: Option<u64>,
    /// Deadline of one batch of reads.
    #[arg(long, default_value = "10s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub timeout: Duration,
    /// How long --listen waits for an initiator and --connect for a target.
    #[arg(long, default_value = "120s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub peer_timeout: Duration,
    /// Serve a region to one initiator on ADDR (two-host mode, target side).
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    pub listen: Option<String>,
    /// Read from a target started with --listen at ADDR (two-host mode, initiator side).
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Internal: the role of this process.
    #[arg(long, value_enum, default_value_t = Role::Initiator, hide = true)]
    pub role: Role,
    /// Internal: where a spawned target connects back to.
    #[arg(long, hide = true)]
    pub connect_back: Option<String>,
}

/// Parses `64KiB`, `1MiB`, `4096`, `1M`, `2GB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size like 64KiB, 1MiB or 4096"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "k" | "KiB" | "Ki" => 1 << 10,
        "M" | "MiB" | "Mi" => 1 << 20,
        "G" | "GiB" | "Gi" => 1 << 30,
        "kB" | "KB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("unknown size unit {other:?} in {s:?} (use KiB, MiB, GiB)")),
    };
    n.checked_mul(mult).filter(|&v| v > 0).ok_or_else(|| format!("{s:?} must be between 1 byte and 16 EiB"))
}

fn ucx_config(args: &XferArgs) -> Vec<(String, String)> {
    args.ucx_tls.iter().map(|t| ("TLS".to_string(), t.clone())).collect()
}

pub fn run(args: &XferArgs) -> anyhow::Result<Outcome> {
    let target_opts = TargetOptions {
        ucx_lib: args.ucx_lib.clone(),
        progress: args.progress,
        ucx_config: ucx_config(args),
    };
    if args.role == Role::Target {
        let addr = args.connect_back.as_deref().ok_or_else(|| {
            ConfigError::new("--connect-back", "the target role needs the initiator's address")
        })?;
        // The initiator that started this process stops it; Ctrl-C at a terminal signals both.
        if let Err(e) = crate::transfer::ucx::ignore_sigint() {
            tracing::debug!("cannot ignore SIGINT: {e}");
        }
        let stream = xfer::connect_target(addr, args.peer_timeout)?;
        // This process is the initiator's child and shares its stderr: what the initiator
        // reports (its own failure, or ours that we sent it) is not printed twice.
        return match xfer::run_target(stream, &target_opts) {
            Ok(()) => Ok(Outcome::Ok),
            Err(e @ (XferError::InitiatorGone | XferError::ReportedToInitiator(_))) => {
                Err(AlreadyReported(e.to_string()).into())
            }
            Err(e) => Err(e.into()),
        };
    }
    if let Some(addr) = &args.listen {
        if args.transport == TransportArg::CudaBatch {
            return Err(ConfigError::new(
                "--listen",
                "--transport cuda-batch needs both processes on one machine (CUDA IPC): drop --listen, kvx xfer \
                 starts its own target",
            )
            .into());
        }
        xfer::listen_and_serve(addr, args.peer_timeout, &target_opts)?;
        return Ok(Outcome::Ok);
    }
    let cfg = resolve(args)?;
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
    let target = match &args.connect {
        Some(addr) => TargetSpec::Remote { addr: addr.clone() },
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
    match args.format {
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

fn resolve(args: &XferArgs) -> Result<XferConfig, ConfigError> {
    if args.sizes.is_empty() {
        return Err(ConfigError::new("--sizes", "give at least one message size"));
    }
    if args.inflight.is_empty() || args.inflight.contains(&0) {
        return Err(ConfigError::new("--inflight", "in-flight counts must be at least 1"));
    }
    if args.inflight.iter().any(|&n| n > 65_536) {
        return Err(ConfigError::new("--inflight", "at most 65536 GETs in flight"));
    }
    let max = args.sizes.iter().copied().max().unwrap_or(0);
    if max > 1 << 34 {
        return Err(ConfigError::new("--sizes", "messages above 16 GiB are not supported"));
    }
    if !args.hot && args.working_set > 64 << 30 {
        return Err(ConfigError::new("--working-set", "at most 64 GiB"));
    }
    if args.iters == Some(0) {
        return Err(ConfigError::new("--iters", "must be at least 1"));
    }
    if args.timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be positive"));
    }
    if args.mem == MemArg::Cuda && (args.ucx_alloc || args.huge_pages) {
        return Err(ConfigError::new("--mem", "--ucx-alloc and --huge-pages apply to host memory only"));
    }
    let mem = match (args.mem, args.device) {
        (MemArg::Host, Some(_)) => {
            return Err(ConfigError::new("--device", "--device applies to --mem cuda only"));
        }
        (MemArg::Host, None) => MemPlace::Host,
        (MemArg::Cuda, device) => MemPlace::Cuda { device: device.unwrap_or(0) },
    };
    let cuda_batch = (args.transport == TransportArg::CudaBatch).then(|| args.batch_copy.unwrap_or_default());
    if cuda_batch.is_none() && args.batch_copy.is_some() {
        return Err(ConfigError::new("--batch-copy", "--batch-copy applies to --transport cuda-batch"));
    }
    if cuda_batch.is_some() {
        if !cfg!(feature = "cuda") {
            return Err(ConfigError::new(
                "--transport",
                "cuda-batch needs CUDA support, but this kvx was built without the `cuda` feature: rebuild with \
                 `cargo build --release` (cuda is a default feature), or use --transport ucx",
            ));
        }
        if args.mem != MemArg::Cuda {
            return Err(ConfigError::new(
                "--mem",
                "--transport cuda-batch copies device memory between GPUs of one machine: pass --mem cuda",
            ));
        }
        if args.connect.is_some() {
            return Err(ConfigError::new(
                "--connect",
                "--transport cuda-batch maps the target's GPU memory with CUDA IPC, which works only between \
                 processes of one machine: drop --connect (kvx xfer starts its own target process)",
            ));
        }
    }
    let misalign = match args.misalign.as_slice() {
        [] => Misalign::default(),
        &[both] => Misalign { local_bytes: both, remote_bytes: both },
        &[local_bytes, remote_bytes] => Misalign { local_bytes, remote_bytes },
        _ => return Err(ConfigError::new("--misalign", "give one shift (both sides) or two (local,remote)")),
    };
    if misalign.local_bytes.max(misalign.remote_bytes) >= MAX_MISALIGN {
        return Err(ConfigError::new(
            "--misalign",
            format!("shifts are below {MAX_MISALIGN} bytes (0-15 cover every alignment)"),
        ));
    }
    Ok(XferConfig {
        sizes: args.sizes.clone(),
        inflight: args.inflight.clone(),
        working_set_bytes: args.working_set,
        hot: args.hot,
        ucx_alloc: args.ucx_alloc,
        huge_pages: args.huge_pages,
        mem,
        duration: args.duration,
        iters: args.iters,
        timeout: args.timeout,
        peer_timeout: args.peer_timeout,
        session: SessionOptions {
            ucx_lib: args.ucx_lib.clone(),
            progress: args.progress,
            err_mode: args.err_mode,
            ucx_config: ucx_config(args),
        },
        cuda_batch,
        misalign,
    })
}

/// `--misalign` shifts above this are refused (an offset's alignment repeats every 4096 bytes
/// for any unit a transport copies in).
const MAX_MISALIGN: u64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }

    fn parse(args: &[&str]) -> Result<XferConfig, String> {
        use clap::Parser as _;
        let cli =
            crate::cli::Cli::try_parse_from(["kvx", "xfer"].iter().chain(args)).map_err(|e| e.to_string())?;
        match cli.command {
            crate::cli::Command::Xfer(a) => resolve(&a).map_err(|e| e.to_string()),
            _ => Err("not xfer".into()),
        }
    }

    #[test]
    fn misalign_shifts_both_sides_or_each_and_stays_small() {
        let one = parse(&["--misalign", "3"]).expect("one shift");
        assert_eq!(one.misalign, Misalign { local_bytes: 3, remote_bytes: 3 });
        let two = parse(&["--misalign", "0,1"]).expect("two shifts");
        assert_eq!(two.misalign, Misalign { local_bytes: 0, remote_bytes: 1 });
        assert!(parse(&[]).expect("none").misalign.is_none());
        let e = parse(&["--misalign", "1,2,3"]).expect_err("three");
        assert!(e.contains("--misalign"), "{e}");
        let e = parse(&["--misalign", "4096"]).expect_err("too far");
        assert!(e.contains("--misalign"), "{e}");
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
}
