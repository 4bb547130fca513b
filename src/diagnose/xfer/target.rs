//! The target role of `kvx xfer`: registers a region filled with the byte pattern and serves
//! it to one initiator (over UCX, or exported for CUDA IPC with `--transport cuda-batch`) until
//! told to stop, the control connection closes, or its serve time runs out; `--listen` waits
//! for that initiator on an address.
#![forbid(unsafe_code)]

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::buffers::{AnyRegion, BufferAccess, check_mem, make_region, region_len};
use super::control::{
    BatchHello, Control, PATTERN_SEED, TARGET_START_TIMEOUT, TargetHello, TargetReply, TargetRequest,
    accept_with_timeout, context, read_frame, write_frame,
};
use super::{Result, XferError};
use crate::config::xfer::TargetOptions;
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{Context, ServeEnd, Ucx, Worker};

/// What a target serves until it is told to stop.
enum Served {
    Ucx(TargetState),
    /// A NIXL agent and its registered region.
    Nixl(crate::transfer::nixl::Agent, super::nixl::Served),
    /// The exported device buffer (freed after the initiator closed its mapping and said stop).
    Batch(CudaBuffer),
}

/// Runs the target role on an established control stream until told to stop, the stream
/// closes, or the requested maximum serve time passes.
pub fn run_target(mut stream: TcpStream, opts: &TargetOptions) -> Result<()> {
    let req: TargetRequest = match read_frame(&mut stream, "target: read request", TARGET_START_TIMEOUT) {
        Err(XferError::Control { source, .. }) if source.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(XferError::InitiatorGone);
        }
        other => other?,
    };
    let prepared = if req.cuda_batch {
        prepare_batch_target(&req).map(|(h, buf)| (TargetReply::ReadyBatch(Box::new(h)), Served::Batch(buf)))
    } else if req.nixl {
        super::nixl::prepare_target(&req)
            .map(|(h, agent, served)| (TargetReply::ReadyNixl(Box::new(h)), Served::Nixl(agent, served)))
    } else {
        prepare_target(&req, opts).map(|(h, state)| (TargetReply::Ready(Box::new(h)), Served::Ucx(state)))
    };
    match prepared {
        Ok((hello, served)) => {
            write_frame(&mut stream, "target: send hello", &hello)?;
            match served {
                Served::Ucx(state) => serve_target(&mut stream, &req, state),
                Served::Batch(buf) => serve_batch_target(&mut stream, &req, buf),
                Served::Nixl(agent, served) => super::nixl::serve_target(&mut stream, &req, agent, served),
            }
        }
        Err(e) => {
            let msg = e.to_string();
            match write_frame(&mut stream, "target: send failure", &TargetReply::Failed(msg.clone())) {
                Ok(()) => Err(XferError::ReportedToInitiator(msg)),
                Err(_) => Err(e),
            }
        }
    }
}

struct TargetState {
    // Field order is drop order: region before worker before context.
    region: AnyRegion,
    worker: Worker,
    _ctx: Context,
}

fn prepare_target(req: &TargetRequest, opts: &TargetOptions) -> Result<(TargetHello, TargetState)> {
    check_mem(req.mem)?;
    let len = region_len(req)?;
    let ucx = Ucx::load(opts.ucx_lib.as_deref())?;
    let ctx = context(&ucx, opts.progress, &opts.ucx_config, req.mem)?;
    let worker = Worker::new(&ctx)?;
    let mut region = make_region(&ctx, len, req)?;
    region.fill(PATTERN_SEED)?;
    let hello = TargetHello {
        worker_address: worker.address()?,
        base: region.addr(),
        len: region.len() as u64,
        rkey: region.pack_rkey()?.into_bytes(),
        ucx: ucx.info(),
        pid: std::process::id(),
        pattern_seed: PATTERN_SEED,
    };
    Ok((hello, TargetState { region, worker, _ctx: ctx }))
}

/// A cuda-batch target: device memory filled with the pattern and exported for CUDA IPC.
fn prepare_batch_target(req: &TargetRequest) -> Result<(BatchHello, CudaBuffer)> {
    check_mem(req.mem)?;
    let MemPlace::Cuda { device } = req.mem else {
        return Err(XferError::Protocol {
            stage: "target: request",
            reason: "a cuda-batch request names host memory".into(),
        });
    };
    let len = region_len(req)?;
    let dev = CudaDevice::open(device)?;
    let mut buf = CudaBuffer::alloc(&dev, len)?;
    buf.fill_with_pattern(PATTERN_SEED)?;
    let export = crate::transfer::cuda_batch::export(&buf)?;
    Ok((BatchHello { export, pid: std::process::id(), pattern_seed: PATTERN_SEED }, buf))
}

/// Keeps the exported buffer (`_buf`, freed on return) until the initiator says stop (after
/// closing its mapping), the stream closes, or the serve time runs out.
fn serve_batch_target(stream: &mut TcpStream, req: &TargetRequest, _buf: CudaBuffer) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(req.max_serve_secs.max(1));
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        match read_frame::<Control>(stream, "target: read control", remaining) {
            Ok(Control::Stop) => break,
            Ok(Control::Resume) => {}
            Err(XferError::Control { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serve_target(stream: &mut TcpStream, req: &TargetRequest, state: TargetState) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(req.max_serve_secs.max(1));
    let mut progressing = req.progress;
    loop {
        if progressing {
            match state.worker.serve(stream.as_raw_fd(), Some(deadline))? {
                ServeEnd::TimedOut => break,
                ServeEnd::Stopped => {}
            }
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        match read_frame::<Control>(stream, "target: read control", remaining) {
            Ok(Control::Resume) => progressing = true,
            Ok(Control::Stop) => break,
            // EOF or a reset: the initiator is gone.
            Err(XferError::Control { source, .. })
                if !matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break;
            }
            Err(XferError::Control { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    tracing::debug!(region = state.region.len(), "target done");
    drop(state);
    Ok(())
}

/// Listens on `addr` for one initiator and serves it (`kvx xfer --listen`).
pub fn listen_and_serve(addr: &str, accept_timeout: Duration, opts: &TargetOptions) -> Result<()> {
    let listener =
        TcpListener::bind(addr).map_err(|source| XferError::Control { stage: "listen", source })?;
    let local = listener.local_addr().map_err(|source| XferError::Control { stage: "listen", source })?;
    tracing::info!("kvx xfer target listening on {local}");
    crate::output::note!(
        "kvx xfer: target listening on {local}; run `kvx xfer --connect {local}` on the initiator host"
    );
    let stream = accept_with_timeout(&listener, accept_timeout, || Ok(()))?;
    run_target(stream, opts)
}
