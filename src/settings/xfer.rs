//! `kvx xfer`: its flags ([`XferFlags`]) resolved into what the process does ([`XferRun`]):
//! serve as the target of an initiator, serve a region to a remote initiator (`--listen`), or
//! measure (`transfer::xfer::XferConfig`). Every rule between its flags is checked here, before
//! anything starts; the transport and memory rules it shares with `kvx bench` are
//! `settings::workers`'s. Must not start anything.

use std::time::Duration;

use clap::{Args, ValueEnum};

use super::parse::{parse_duration, parse_size};
use super::workers::check_mem_transport;
use crate::config::xfer::TargetOptions;
use crate::config::xfer::{Misalign, NixlOptions, NixlRequests, SessionOptions, XferConfig};
use crate::error::ConfigError;
use crate::transfer::cuda_batch::BatchCopy;
use crate::transfer::memory::{MemKind, MemPlace};
use crate::vocab::kinds::TransportKind;

/// Output format of `kvx xfer` (and `kvx doctor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Format {
    #[default]
    Table,
    Json,
}

/// `--transport`: what moves the bytes (the transports of [`TransportKind`] that measure
/// reads between two processes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TransportArg {
    /// One-sided UCX GETs, one per read.
    #[default]
    Ucx,
    /// GPUs of one machine: the target's device buffer mapped with CUDA IPC, each batch of
    /// reads one batched copy (see --batch-copy). Needs --mem cuda; no UCX.
    CudaBatch,
    /// NIXL (what vLLM's NixlConnector uses), from its wheel's C API: prepared lists, one
    /// transfer request per batch; host or device memory (NIXL's own UCX).
    Nixl,
}

impl TransportArg {
    pub fn as_str(self) -> &'static str {
        self.kind().as_str()
    }

    /// The transport.
    pub fn kind(self) -> TransportKind {
        match self {
            TransportArg::Ucx => TransportKind::Ucx,
            TransportArg::CudaBatch => TransportKind::CudaBatch,
            TransportArg::Nixl => TransportKind::Nixl,
        }
    }
}

/// Which side of a measurement this process is (`--role`, internal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum XferRole {
    Initiator,
    Target,
}

/// `kvx xfer`'s flags.
#[derive(Debug, Clone, Args)]
pub struct XferFlags {
    /// Message sizes to sweep (suffixes KiB/MiB/GiB or K/M/G = powers of 1024, kB/MB/GB = powers of 1000).
    #[arg(long, value_delimiter = ',', default_value = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    #[arg(long, value_delimiter = ',', help = super::flags::INFLIGHT_HELP)]
    pub inflight: Option<Vec<usize>>,
    /// Bytes each side registers; reads rotate over it so they come from DRAM (cold mode).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub working_set: u64,
    /// Read the same offset every time (cache-resident); labelled `hot` in reports.
    #[arg(long)]
    pub hot: bool,
    /// Let UCX allocate the buffers (UCP_MEM_MAP_ALLOCATE): flattering, not what a KV cache is.
    #[arg(long)]
    pub ucx_alloc: bool,
    #[command(flatten)]
    pub mem: super::flags::MemFlags,
    #[arg(long, value_enum, help = super::flags::TRANSPORT_HELP)]
    pub transport: Option<TransportArg>,
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        conflicts_with = "transport",
        help = super::flags::COMPARE_TRANSPORTS_HELP
    )]
    pub compare_transports: Option<Vec<TransportArg>>,
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100), help = super::flags::ROUNDS_HELP)]
    pub rounds: Option<u32>,
    // The help names the default from `BatchCopy::default()` (the flag stays an Option so
    // that giving it without --transport cuda-batch can be refused).
    #[arg(long, value_enum, help = BatchCopy::help())]
    pub batch_copy: Option<BatchCopy>,
    /// Shift every read's local and remote offset by BYTES (one value: both sides; two: local,
    /// remote), so that descriptors are not 16-byte aligned: e.g. 3 (both sides agree modulo
    /// 16: the gather kernel's byte head and tail) or 0,1 (they differ: its narrow units).
    #[arg(long, value_name = "BYTES[,BYTES]", value_delimiter = ',', num_args = 1)]
    pub misalign: Vec<u64>,
    #[command(flatten)]
    pub ucx_lib: super::flags::UcxLibFlags,
    #[command(flatten)]
    pub nixl: super::flags::NixlFlags,
    /// With --transport nixl: make one transfer request per batch and release it after
    /// (per-batch: as vLLM's worker makes one per READ), or make each distinct batch's request
    /// once before timing and post it again (reuse: as NIXL's own benchmark does, NIXL's
    /// transfer without its per-request set-up) [default: per-batch]
    #[arg(long, value_enum)]
    pub nixl_requests: Option<NixlRequests>,
    #[command(flatten)]
    pub ucx_mode: super::flags::UcxModeFlags,
    #[command(flatten)]
    pub duration: super::flags::DurationFlags,
    /// Measure exactly this many batches per case (overrides --duration).
    #[arg(long)]
    pub iters: Option<u64>,
    #[command(flatten)]
    pub timeout: super::flags::TimeoutFlags,
    /// How long --listen waits for an initiator and --connect for a target.
    #[arg(long, default_value = "120s", value_parser = parse_duration, allow_hyphen_values = true)]
    pub peer_timeout: Duration,
    #[command(flatten)]
    pub listen: super::flags::ListenFlags,
    #[command(flatten)]
    pub connect: super::flags::ConnectFlags,
    #[arg(long, value_enum, default_value_t = Format::Table, help = super::flags::FORMAT_HELP)]
    pub format: Format,
    /// Internal: the role of this process (one of the two that measure).
    #[arg(long = "xfer-role", value_enum, default_value_t = XferRole::Initiator, hide = true)]
    pub role: XferRole,
    /// Internal: where a spawned target connects back to.
    #[arg(long, hide = true)]
    pub connect_back: Option<String>,
}

/// What a `kvx xfer` process does.
#[derive(Debug, Clone)]
pub enum XferRun {
    /// The target an initiator started (`--role target`): connect back to it at `addr` and
    /// serve what it asks.
    Target { addr: String, peer_timeout: Duration, opts: TargetOptions },
    /// `--listen ADDR`: serve a region to one initiator of another host.
    Listen { addr: String, peer_timeout: Duration, opts: TargetOptions },
    /// Measure: against a target process this one starts, or a remote one (`--connect`).
    Measure { cfg: Box<XferConfig>, connect: Option<String> },
    /// `--compare-transports`: the same measurement on each transport, in order (reversed
    /// every other of `rounds`), against target processes this one starts.
    Compare { runs: Vec<(TransportArg, XferConfig)>, rounds: u32 },
}

/// `--misalign` shifts above this are refused (an offset's alignment repeats every 4096 bytes
/// for any unit a transport copies in).
const MAX_MISALIGN: u64 = 4096;

/// What UCX is configured with (`--ucx-tls`).
fn ucx_config(args: &XferFlags) -> Vec<(String, String)> {
    args.ucx_mode.ucx_tls.iter().map(|t| ("TLS".to_string(), t.clone())).collect()
}

/// Checks `kvx xfer`'s flags and says what this process does.
pub fn resolve(args: &XferFlags) -> Result<XferRun, ConfigError> {
    let opts = TargetOptions {
        ucx_lib: args.ucx_lib.ucx_lib.clone(),
        progress: args.ucx_mode.progress(),
        ucx_config: ucx_config(args),
    };
    if args.role == XferRole::Target {
        let addr = args.connect_back.clone().ok_or_else(|| {
            ConfigError::new("--connect-back", "the target role needs the initiator's address")
        })?;
        return Ok(XferRun::Target { addr, peer_timeout: args.peer_timeout, opts });
    }
    let nixl_measured = args.transport() == TransportArg::Nixl
        || args.compare_transports.as_ref().is_some_and(|l| l.contains(&TransportArg::Nixl));
    if let (Some(r), false) = (args.nixl_requests, nixl_measured) {
        return Err(ConfigError::new(
            "--nixl-requests",
            format!(
                "applies to --transport nixl: add --transport nixl (or nixl to --compare-transports), or drop --nixl-requests {}",
                r.as_str()
            ),
        ));
    }
    if let (Some(n), None) = (args.rounds, &args.compare_transports) {
        return Err(ConfigError::new(
            "--rounds",
            format!(
                "rounds interleave a comparison's transports: add --compare-transports, or drop --rounds {n}"
            ),
        ));
    }
    if let Some(addr) = &args.listen.listen {
        if args.connect.connect.is_some() {
            return Err(ConfigError::new(
                "--listen",
                "a process either listens (the target) or connects (the initiator): drop --listen or --connect",
            ));
        }
        if args.transport() == TransportArg::CudaBatch {
            return Err(ConfigError::new(
                "--listen",
                "--transport cuda-batch needs both processes on one machine (CUDA IPC): drop --listen, kvx xfer \
                 starts its own target",
            ));
        }
        return Ok(XferRun::Listen { addr: addr.clone(), peer_timeout: args.peer_timeout, opts });
    }
    if let Some(list) = &args.compare_transports {
        if list.len() < 2 {
            return Err(ConfigError::new(
                "--compare-transports",
                "name at least two transports, e.g. ucx,nixl",
            ));
        }
        if args.connect.connect.is_some() {
            return Err(ConfigError::new(
                "--compare-transports",
                "a remote target serves one measurement: drop --connect (kvx xfer starts a target per transport)",
            ));
        }
        let runs = list
            .iter()
            .map(|&t| {
                let mut one = args.clone();
                one.transport = Some(t);
                one.compare_transports = None;
                measurement(&one).map(|cfg| (t, cfg))
            })
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(XferRun::Compare { runs, rounds: args.rounds.unwrap_or(1) });
    }
    Ok(XferRun::Measure { cfg: Box::new(measurement(args)?), connect: args.connect.connect.clone() })
}

/// `--inflight` of `kvx xfer` when not given: the depths it measures.
pub const DEFAULT_XFER_INFLIGHT: [usize; 3] = [1, 8, 32];

/// `--duration` of `kvx xfer` when not given: the least measuring time of a case.
pub const DEFAULT_XFER_DURATION: Duration = Duration::from_millis(200);

/// `--timeout` of `kvx xfer` when not given: the deadline of one batch of reads.
pub const DEFAULT_XFER_TIMEOUT: Duration = Duration::from_secs(10);

impl XferFlags {
    /// `--transport`, or ucx.
    pub fn transport(&self) -> TransportArg {
        self.transport.unwrap_or_default()
    }
}

/// The measurement the flags ask for.
fn measurement(args: &XferFlags) -> Result<XferConfig, ConfigError> {
    if args.sizes.is_empty() {
        return Err(ConfigError::new("--sizes", "give at least one message size"));
    }
    let inflight = args.inflight.clone().unwrap_or_else(|| DEFAULT_XFER_INFLIGHT.to_vec());
    if inflight.is_empty() || inflight.contains(&0) {
        return Err(ConfigError::new("--inflight", "in-flight counts must be at least 1"));
    }
    if inflight.iter().any(|&n| n > 65_536) {
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
    let timeout = args.timeout.or(DEFAULT_XFER_TIMEOUT);
    if timeout.is_zero() {
        return Err(ConfigError::new("--timeout", "must be positive"));
    }
    if args.mem.mem() == MemKind::Cuda && (args.ucx_alloc || args.mem.huge_pages) {
        return Err(ConfigError::new("--mem", "--ucx-alloc and --huge-pages apply to host memory only"));
    }
    let mem = match (args.mem.mem(), args.mem.device) {
        (MemKind::Host, Some(_)) => {
            return Err(ConfigError::new("--device", "--device applies to --mem cuda only"));
        }
        (MemKind::Host, None) => MemPlace::Host,
        (MemKind::Cuda, device) => MemPlace::Cuda { device: device.unwrap_or(0) },
    };
    let cuda_batch =
        (args.transport() == TransportArg::CudaBatch).then(|| args.batch_copy.unwrap_or_default());
    if cuda_batch.is_none() && args.batch_copy.is_some() {
        return Err(ConfigError::new("--batch-copy", "--batch-copy applies to --transport cuda-batch"));
    }
    check_mem_transport(args.mem.mem(), args.transport().kind())?;
    if cuda_batch.is_some() && args.connect.connect.is_some() {
        return Err(ConfigError::new(
            "--connect",
            "--transport cuda-batch maps the target's GPU memory with CUDA IPC, which works only between \
             processes of one machine: drop --connect (kvx xfer starts its own target process)",
        ));
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
        inflight,
        working_set_bytes: args.working_set,
        hot: args.hot,
        ucx_alloc: args.ucx_alloc,
        huge_pages: args.mem.huge_pages,
        mem,
        duration: args.duration.duration.unwrap_or(DEFAULT_XFER_DURATION),
        iters: args.iters,
        timeout,
        peer_timeout: args.peer_timeout,
        session: SessionOptions {
            ucx_lib: args.ucx_lib.ucx_lib.clone(),
            progress: args.ucx_mode.progress(),
            err_mode: args.ucx_mode.err_mode(args.transport() == TransportArg::Nixl),
            ucx_config: ucx_config(args),
        },
        cuda_batch,
        nixl: (args.transport() == TransportArg::Nixl).then_some(NixlOptions {
            progress_thread: args.nixl.nixl_progress_thread,
            requests: args.nixl_requests.unwrap_or_default(),
        }),
        misalign,
    })
}

#[cfg(test)]
mod tests {
    use clap::{Args as _, FromArgMatches as _};

    use super::*;

    fn parse(args: &[&str]) -> Result<XferConfig, String> {
        let cmd = XferFlags::augment_args(clap::Command::new("xfer"));
        let m = cmd
            .try_get_matches_from(std::iter::once("xfer").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        let flags = XferFlags::from_arg_matches(&m).map_err(|e| e.to_string())?;
        match resolve(&flags).map_err(|e| e.to_string())? {
            XferRun::Measure { cfg, .. } => Ok(*cfg),
            other => Err(format!("not a measurement: {other:?}")),
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
    fn each_rule_names_its_flag() {
        for (args, flag) in [
            (&["--device", "1"][..], "--device"),
            (&["--mem", "cuda", "--ucx-alloc"], "--mem"),
            (&["--batch-copy", "kernel"], "--batch-copy"),
            (&["--inflight", "0"], "--inflight"),
            (&["--iters", "0"], "--iters"),
            (&["--mem", "gpu"], "--mem"),
        ] {
            let e = parse(args).expect_err(flag);
            assert!(e.contains(flag), "{args:?}: {e}");
        }
        // cuda-batch: the rule `kvx bench` has too (settings::workers), then its own.
        let e = parse(&["--transport", "cuda-batch"]).expect_err("host memory");
        assert!(e.contains("(change --mem)") || e.contains("`cuda` feature"), "{e}");
        if cfg!(feature = "cuda") {
            let e = parse(&["--transport", "cuda-batch", "--mem", "cuda", "--connect", "h:1"])
                .expect_err("remote");
            assert!(e.contains("(change --connect)"), "{e}");
        }
    }
}
