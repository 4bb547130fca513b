//! `kvx xfer`: the transport microbenchmark. A *target* process registers a buffer and
//! serves it; an *initiator* process reads from it with one-sided GETs, sweeping message
//! size and GETs in flight, verifies the bytes, and measures a ceiling over the same
//! working set in the same run: a single-thread memcpy for host memory, a
//! device-to-device copy of the same size and batch for device memory. Reports name the
//! protocol UCX chose for the reads and warn when device memory is software-emulated.
//!
//! With `--transport cuda-batch` the same two processes run without UCX: the target exports
//! its device buffer for CUDA IPC, the initiator maps it and moves each batch of `inflight`
//! reads with one batched copy (`cuda_batch`); two processes because CUDA refuses to open an
//! IPC handle in the process that exported it. The verification and the device-copy ceiling
//! are the same.
//!
//! The files, by concern: `control` (the TCP control connection between the two processes and
//! its length-prefixed msgpack frames, starting a local target, kvx re-executing itself with a
//! hidden role, or reaching a remote one, and the initiator's UCX [`Session`]), `target` (the
//! target role), `buffers` (the registered memory and its byte pattern, `layouts::pattern`),
//! `measure` (the timed cases, the same-run ceiling, the in-place verification); this file runs
//! them as one measurement ([`run`]). What is asked and what comes back ([`XferConfig`],
//! [`XferReport`]) and the report's table are `report::xfer`'s.
//!
//! A layer above the transports: uses `transfer` through its safe types and holds no `unsafe`;
//! nothing but `cli` imports it (`pipeline::bench` is handed [`run_for_calibration`]). Must not
//! print: `cli::xfer` prints the report, `report::xfer` renders it.
#![forbid(unsafe_code)]

mod buffers;
mod control;
mod measure;
mod nixl;
mod target;

use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

pub use self::control::{
    BatchHello, Control, LocalTarget, PATTERN_SEED, Session, TargetHello, TargetRequest, connect_target, reap,
};
pub use self::target::{listen_and_serve, run_target};
use crate::config::xfer::{TargetOptions, TargetSpec, XferConfig};
pub use crate::report::xfer::{
    CeilingKind, MemoryReport, Residency, UcxReport, XferBatchReport, XferMemory, XferReport, XferResult,
    verification_rule,
};

use self::buffers::check_mem;
use self::control::{TARGET_START_TIMEOUT, TargetReply, read_frame, write_frame};
use self::measure::{BatchMeasure, Ceiling, measure};
use crate::transfer::cuda::{CudaBuffer, CudaDevice, CudaError};
use crate::transfer::cuda_batch::{BatchCopier, BatchCopy, CopyBatch, CudaBatchError, PeerMapping};
use crate::transfer::memory::{MemPlace, MemoryError, PageSize};
use crate::transfer::ucx::{ErrMode, ProtoReport, Ucx, UcxError};

/// Errors of `kvx xfer` and of the target/initiator pair behind it.
#[derive(Debug, thiserror::Error)]
pub enum XferError {
    #[error(transparent)]
    Ucx(#[from] UcxError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Nixl(#[from] crate::transfer::nixl::NixlError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    CudaBatch(#[from] CudaBatchError),
    #[error("control connection ({stage}): {source}")]
    Control { stage: &'static str, source: std::io::Error },
    #[error("control connection ({stage}): {reason}")]
    Protocol { stage: &'static str, reason: String },
    #[error("the target reported: {0}")]
    Target(String),
    #[error("could not start the local target process {exe}: {source}")]
    Spawn { exe: PathBuf, source: std::io::Error },
    #[error("the local target process exited before connecting back ({status})")]
    TargetDied { status: String },
    #[error("data verification failed: {0}")]
    Verify(String),
    /// The initiator closed the control connection before sending its request: it failed
    /// first and reports its own error, so the target has nothing to add.
    #[error("the initiator closed the control connection before sending a request")]
    InitiatorGone,
    /// The target failed and told the initiator, which reports it.
    #[error("{0}")]
    ReportedToInitiator(String),
    /// The local target process ended while the initiator still needed it (the initiator saw
    /// its control connection break at `stage`): its own error, if it could print one, is
    /// above on the shared stderr.
    #[error(
        "the local target process ended ({status}) during {stage}; its own error, if any, is printed above"
    )]
    TargetEnded { status: String, stage: &'static str },
    #[error("{0}")]
    Config(#[from] crate::error::ConfigError),
    /// A configuration `settings::xfer` refuses reached the measurement (a bug).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

pub type Result<T, E = XferError> = std::result::Result<T, E>;

/// Runs the whole benchmark: starts or reaches the target, measures every case, stops
/// the target. Cases are reported through `on_result` as they finish.
pub fn run(
    cfg: &XferConfig,
    target: &TargetSpec,
    mut on_result: impl FnMut(&XferResult),
) -> Result<XferReport> {
    check_mem(cfg.mem)?;
    if let Some(copy) = cfg.cuda_batch {
        return run_batch(cfg, copy, target, on_result);
    }
    if let Some(opts) = cfg.nixl {
        return nixl::run(cfg, opts, target, on_result);
    }
    // A UCX the initiator cannot load is reported once, before a target process starts (which
    // would fail the same way, or see its initiator vanish, and say so first).
    Ucx::load(cfg.session.ucx_lib.as_deref())?;
    let max_size = cfg.sizes.iter().copied().max().unwrap_or(4096);
    let ws = if cfg.hot { max_size } else { cfg.working_set_bytes.max(max_size) };
    let req = TargetRequest {
        region_bytes: ws + cfg.misalign.remote_bytes,
        ucx_alloc: cfg.ucx_alloc,
        huge_pages: cfg.huge_pages,
        mem: cfg.mem,
        progress: true,
        max_serve_secs: estimate_secs(cfg) + 600,
        cuda_batch: false,
        nixl: false,
        nixl_progress_thread: false,
        nixl_err_mode: ErrMode::None,
    };
    let (mut child, stream) = match target {
        TargetSpec::Local { exe } => {
            let t = LocalTarget::spawn(
                exe,
                &TargetOptions {
                    ucx_lib: cfg.session.ucx_lib.clone(),
                    progress: cfg.session.progress,
                    ucx_config: cfg.session.ucx_config.clone(),
                },
                &[],
            )?;
            (Some(t.child), t.stream)
        }
        TargetSpec::Remote { addr } => (None, connect_target(addr, cfg.peer_timeout)?),
    };
    let outcome = (|| {
        let session = Session::establish(stream, &req, &cfg.session)?;
        let report = measure(&session, cfg, &req, ws, &mut on_result);
        let _ = session.finish();
        report
    })();
    let Some(c) = child.as_mut() else { return outcome };
    end_local_target(c, outcome)
}

/// Reaps a local target after the measurement, and blames a broken control connection on the
/// target's own end when it ended with an error.
fn end_local_target<T>(c: &mut Child, outcome: Result<T>) -> Result<T> {
    reap(c, Duration::from_secs(10));
    match outcome {
        // A broken control connection to a local target that has ended: the cause is the
        // target's end (its own error is already on the shared stderr), not the connection.
        Err(e @ XferError::Control { stage, .. }) => match c.try_wait() {
            Ok(Some(status)) if !status.success() => {
                tracing::debug!("control connection to the ended target: {e}");
                Err(XferError::TargetEnded { status: status.to_string(), stage })
            }
            _ => Err(e),
        },
        other => other,
    }
}

/// `--transport cuda-batch`: a local target exports its device buffer, this process maps it
/// and measures every case as batches of one batched copy each, against the same-run device
/// copy; the mapping is closed before the target is told to stop (and frees its buffer).
fn run_batch(
    cfg: &XferConfig,
    copy: BatchCopy,
    target: &TargetSpec,
    on_result: impl FnMut(&XferResult),
) -> Result<XferReport> {
    // `settings::xfer` refuses cuda-batch over host memory or to a remote target.
    let MemPlace::Cuda { device } = cfg.mem else {
        return Err(XferError::Internal("cuda-batch measures device memory, not host memory"));
    };
    let TargetSpec::Local { exe } = target else {
        return Err(XferError::Internal("cuda-batch needs a target process of this machine"));
    };
    let max_size = cfg.sizes.iter().copied().max().unwrap_or(4096);
    let ws = if cfg.hot { max_size } else { cfg.working_set_bytes.max(max_size) };
    let req = TargetRequest {
        region_bytes: ws + cfg.misalign.remote_bytes,
        ucx_alloc: false,
        huge_pages: false,
        mem: cfg.mem,
        progress: true,
        max_serve_secs: estimate_secs(cfg) + 600,
        cuda_batch: true,
        nixl: false,
        nixl_progress_thread: false,
        nixl_err_mode: ErrMode::None,
    };
    // The target loads no UCX either; its options only name the flags it was started with.
    let t = LocalTarget::spawn(
        exe,
        &TargetOptions {
            ucx_lib: cfg.session.ucx_lib.clone(),
            progress: cfg.session.progress,
            ucx_config: vec![],
        },
        &[],
    )?;
    let (mut child, mut stream) = (t.child, t.stream);
    let outcome = (|| {
        write_frame(&mut stream, "initiator: send request", &req)?;
        let hello = match read_frame(&mut stream, "initiator: read hello", TARGET_START_TIMEOUT)? {
            TargetReply::ReadyBatch(h) => *h,
            TargetReply::Failed(msg) => return Err(XferError::Target(msg)),
            TargetReply::Ready(_) | TargetReply::ReadyNixl(_) => {
                return Err(XferError::Protocol {
                    stage: "initiator: read hello",
                    reason: "the target served UCX or NIXL, not a CUDA IPC export".into(),
                });
            }
        };
        let dev = CudaDevice::open(device)?;
        // Locals drop in reverse order: the local buffers, then the copier (its stream
        // drained), then the mapping, all before the target is told to stop.
        let (results, path) = {
            let who = format!("the target process (pid {})", hello.pid);
            let peer = PeerMapping::open(&dev, &who, Some(&hello.export))?;
            let mut copier = BatchCopier::new(&dev, copy)?;
            let mut local = CudaBuffer::alloc(&dev, (ws + cfg.misalign.local_bytes) as usize)?;
            let mut ceiling = Ceiling::new(cfg.mem, ws, PageSize::Normal)?;
            let seed = hello.pattern_seed;
            let mut m = BatchMeasure {
                cfg,
                copier: &mut copier,
                peer: &peer,
                batch: CopyBatch::default(),
                seed,
                scratch: Vec::new(),
            };
            let results = m.cases(&mut local, ws, &mut ceiling, on_result);
            (results, copier.path())
        };
        let _ = write_frame(&mut stream, "initiator: stop", &Control::Stop);
        let results = results?;
        let calls: u64 = results.iter().map(|r| path.calls(r.inflight) * r.batches).sum();
        let batches: u64 = results.iter().map(|r| r.batches).sum();
        Ok(XferReport {
            ucx: UcxReport {
                library: "(not loaded: cuda-batch transport)".into(),
                version: String::new(),
                transports: format!("cuda-batch/{path}"),
                source: String::new(),
                err_mode: cfg.session.err_mode,
                progress: cfg.session.progress,
                target_library: "(not loaded: cuda-batch transport)".into(),
                target_version: String::new(),
                protocols: ProtoReport { uses: Vec::new(), note: Some("cuda-batch does not use UCX".into()) },
                env: Vec::new(),
            },
            memory: MemoryReport {
                kind: XferMemory::Cuda,
                device: Some(device),
                huge_pages: false,
                pages: PageSize::Normal.to_string(),
                working_set_bytes: ws,
                residency: Residency::of(cfg.hot),
            },
            ceiling: CeilingKind::DeviceCopy,
            warnings: Vec::new(),
            results,
            transport: "cuda-batch".into(),
            cuda_batch: Some(XferBatchReport {
                path,
                driver_call: path.driver_call().into(),
                calls_per_batch: if batches > 0 { calls as f64 / batches as f64 } else { 0.0 },
            }),
            nixl: None,
            verification: verification_rule(),
            misalign: cfg.misalign,
        })
    })();
    end_local_target(&mut child, outcome)
}

fn estimate_secs(cfg: &XferConfig) -> u64 {
    let cases = (cfg.sizes.len() * cfg.inflight.len().max(1)) as u64;
    cases * (cfg.duration.as_secs() + 2) + cfg.timeout.as_secs()
}

/// [`run`] as `pipeline::bench` takes it for its calibration (`pipeline::bench::XferRunner`):
/// no per-case callback, the error as a message.
pub fn run_for_calibration(cfg: &XferConfig, target: &TargetSpec) -> std::result::Result<XferReport, String> {
    run(cfg, target, |_| {}).map_err(|e| e.to_string())
}
