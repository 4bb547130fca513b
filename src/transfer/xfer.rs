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
//! Owns: the control connection between the two processes (a TCP stream carrying
//! length-prefixed msgpack frames: worker address, region base, packed rkey), spawning a
//! local target (kvx re-executes itself with a hidden role), the measurement loop and the
//! report it returns. Must not print: `cli::xfer` renders the [`XferReport`].
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::cuda::{self, CudaBuffer, CudaDevice, CudaError};
use super::cuda_batch::{BatchCopier, BatchCopy, BatchPath, CopyBatch, CudaBatchError, PeerMapping, Span};
use super::handshake::meta::CudaIpcExport;
use super::memory::{HostBuffer, MemPlace, MemoryError, PageSize};
use super::ucx::{
    Context, ContextOptions, Endpoint, ErrMode, LibInfo, MemRegion, PROTO_INFO_DIR_ENV, PROTO_INFO_ENV,
    PackedRkey, ProgressMode, ProtoReport, ReadDesc, ReadOptions, Registrable, RemoteRegion, Rma, ServeEnd,
    Ucx, UcxAllocated, UcxError, Worker, wait_readable,
};
use crate::layouts::pattern::{check_at, fill_at};

/// Errors of `kvx xfer` and of the target/initiator pair behind it.
#[derive(Debug, thiserror::Error)]
pub enum XferError {
    #[error(transparent)]
    Ucx(#[from] UcxError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
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
}

pub type Result<T, E = XferError> = std::result::Result<T, E>;

/// Largest control frame accepted (worker addresses and rkeys are a few hundred bytes).
const MAX_FRAME: usize = 1 << 20;
/// How long a spawned target may take to start, load UCX and connect back.
const TARGET_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Key of the byte pattern the target fills its region with (`layouts::pattern`: one run of
/// words over the whole region, so that any read can be checked at its remote offset).
pub const PATTERN_SEED: u64 = 0x6b76_7820_7866_6572;

/// What the initiator asks the target to set up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetRequest {
    pub region_bytes: u64,
    pub ucx_alloc: bool,
    pub huge_pages: bool,
    /// Where both sides' buffers live (the target's and the initiator's).
    pub mem: MemPlace,
    /// Progress the worker while serving (false: only for the doctor's zero-copy check,
    /// which needs a target that does *not* progress until told to resume).
    pub progress: bool,
    /// Upper bound on how long the target serves, seconds.
    pub max_serve_secs: u64,
    /// `--transport cuda-batch`: export the region for CUDA IPC instead of serving it over UCX
    /// (the target then loads no UCX).
    #[serde(default)]
    pub cuda_batch: bool,
}

/// What the target sends back: everything an initiator needs to read its region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetHello {
    #[serde(with = "serde_bytes")]
    pub worker_address: Vec<u8>,
    pub base: u64,
    pub len: u64,
    #[serde(with = "serde_bytes")]
    pub rkey: Vec<u8>,
    pub ucx: LibInfo,
    pub pid: u32,
    pub pattern_seed: u64,
}

/// What a cuda-batch target sends back: its device buffer exported for CUDA IPC.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchHello {
    pub export: CudaIpcExport,
    pub pid: u32,
    pub pattern_seed: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum TargetReply {
    Ready(Box<TargetHello>),
    ReadyBatch(Box<BatchHello>),
    Failed(String),
}

/// What a target serves until it is told to stop.
enum Served {
    Ucx(TargetState),
    /// The exported device buffer (freed after the initiator closed its mapping and said stop).
    Batch(CudaBuffer),
}

/// Initiator to target, after the hello.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum Control {
    /// Start progressing (after a non-progressing start).
    Resume,
    /// Tear down and exit.
    Stop,
}

fn write_frame<T: Serialize>(s: &mut TcpStream, stage: &'static str, msg: &T) -> Result<()> {
    let body =
        rmp_serde::to_vec_named(msg).map_err(|e| XferError::Protocol { stage, reason: e.to_string() })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    s.write_all(&frame).map_err(|source| XferError::Control { stage, source })
}

fn read_frame<T: for<'de> Deserialize<'de>>(
    s: &mut TcpStream,
    stage: &'static str,
    timeout: Duration,
) -> Result<T> {
    s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
        .map_err(|source| XferError::Control { stage, source })?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|source| XferError::Control { stage, source })?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(XferError::Protocol {
            stage,
            reason: format!("frame of {len} bytes exceeds {MAX_FRAME}"),
        });
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(|source| XferError::Control { stage, source })?;
    rmp_serde::from_slice(&body).map_err(|e| XferError::Protocol { stage, reason: e.to_string() })
}

// ---------------------------------------------------------------------------------------
// Memory both roles use

/// What `kvx xfer` needs of a registered buffer besides its registration: filling it
/// with the pattern, clearing ranges before a sampled batch writes them, and checking them
/// after. Host buffers do this in place; device buffers copy through the host.
pub trait BufferAccess: Registrable {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()>;
    /// Sets every byte of `ranges` (offsets into the buffer) to 0.
    fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()>;
    /// Runs `check(i, bytes of ranges[i])` over every range (in parallel where there is much to
    /// check) and returns the failure of the lowest `i`, if any: `(i, what check returned)`.
    /// `scratch` is reused between calls (device buffers stage their bytes in it).
    fn check_ranges(
        &self,
        ranges: &[Range<u64>],
        scratch: &mut Vec<u8>,
        check: &RangeCheck<'_>,
    ) -> Result<Option<(usize, u64)>>;
}

/// Checks one range's bytes (its index, its bytes): `Some(offset)` of the first wrong byte.
pub type RangeCheck<'a> = dyn Fn(usize, &[u8]) -> Option<u64> + Sync + 'a;

/// Below this many bytes a check runs on this thread: rayon would cost more than it saves.
const PARALLEL_CHECK_BYTES: usize = 1 << 20;

/// `check` over `(index, bytes)` items, in parallel when they are many bytes; the failure of
/// the first item (in order) that fails.
fn first_failure(items: &[(usize, &[u8])], check: &RangeCheck<'_>) -> Option<(usize, u64)> {
    use rayon::prelude::*;
    let total: usize = items.iter().map(|(_, b)| b.len()).sum();
    if total < PARALLEL_CHECK_BYTES {
        items.iter().find_map(|&(i, b)| check(i, b).map(|off| (i, off)))
    } else {
        items.par_iter().find_map_first(|&(i, b)| check(i, b).map(|off| (i, off)))
    }
}

macro_rules! host_access {
    ($t:ty) => {
        impl BufferAccess for $t {
            fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
                fill_at(self.as_mut_slice(), seed, 0);
                Ok(())
            }
            fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()> {
                let buf = self.as_mut_slice();
                for r in ranges {
                    buf[r.start as usize..r.end as usize].fill(0);
                }
                Ok(())
            }
            fn check_ranges(
                &self,
                ranges: &[Range<u64>],
                _scratch: &mut Vec<u8>,
                check: &RangeCheck<'_>,
            ) -> Result<Option<(usize, u64)>> {
                let buf = self.as_slice();
                let items: Vec<(usize, &[u8])> = ranges
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i, &buf[r.start as usize..r.end as usize]))
                    .collect();
                Ok(first_failure(&items, check))
            }
        }
    };
}
host_access!(HostBuffer);
host_access!(UcxAllocated);

/// Device bytes staged on the host per parallel check (bounds the scratch buffer).
const CHECK_STAGING_BYTES: usize = 64 << 20;

impl BufferAccess for CudaBuffer {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
        // Staged in 64 MiB pieces (multiples of 8, so the pattern's words line up at
        // every piece boundary).
        const PIECE: u64 = 64 << 20;
        let len = CudaBuffer::len(self) as u64;
        let ranges: Vec<std::ops::Range<u64>> =
            (0..len.div_ceil(PIECE)).map(|i| i * PIECE..((i + 1) * PIECE).min(len)).collect();
        self.write_ranges(&ranges, |i, bytes| fill_at(bytes, seed, ranges[i].start))?;
        Ok(())
    }
    fn zero_ranges(&mut self, ranges: &[Range<u64>]) -> Result<()> {
        self.write_ranges(ranges, |_, bytes| bytes.fill(0))?;
        Ok(())
    }
    fn check_ranges(
        &self,
        ranges: &[Range<u64>],
        scratch: &mut Vec<u8>,
        check: &RangeCheck<'_>,
    ) -> Result<Option<(usize, u64)>> {
        // Staged into `scratch` a group at a time, each group checked in parallel.
        let mut first = None;
        let mut start = 0;
        while start < ranges.len() && first.is_none() {
            let mut end = start;
            let mut bytes = 0usize;
            while end < ranges.len() && (end == start || bytes < CHECK_STAGING_BYTES) {
                bytes += (ranges[end].end - ranges[end].start) as usize;
                end += 1;
            }
            scratch.clear();
            scratch.reserve(bytes);
            self.read_ranges(&ranges[start..end], |_, got| scratch.extend_from_slice(got))?;
            let mut items = Vec::with_capacity(end - start);
            let mut at = 0usize;
            for (i, r) in ranges.iter().enumerate().take(end).skip(start) {
                let n = (r.end - r.start) as usize;
                items.push((i, &scratch[at..at + n]));
                at += n;
            }
            first = first_failure(&items, check);
            start = end;
        }
        Ok(first)
    }
}

fn make_region(ctx: &Context, len: usize, req: &TargetRequest) -> Result<AnyRegion> {
    Ok(match req.mem {
        MemPlace::Cuda { device } => {
            let dev = CudaDevice::open(device)?;
            AnyRegion::Cuda(MemRegion::register(ctx, CudaBuffer::alloc(&dev, len)?)?)
        }
        MemPlace::Host if req.ucx_alloc => {
            let mut r = MemRegion::allocate(ctx, len)?;
            for page in r.memory_mut()?.as_mut_slice().chunks_mut(4096) {
                page[0] = 0;
            }
            AnyRegion::UcxAlloc(r)
        }
        MemPlace::Host => {
            let pages = if req.huge_pages { PageSize::Huge } else { PageSize::Normal };
            let mut buf = HostBuffer::alloc(len, pages)?;
            buf.prefault();
            AnyRegion::Host(MemRegion::register(ctx, buf)?)
        }
    })
}

/// A registered region of any of the memory kinds `kvx xfer` uses.
enum AnyRegion {
    Host(MemRegion<HostBuffer>),
    UcxAlloc(MemRegion<UcxAllocated>),
    Cuda(MemRegion<CudaBuffer>),
}

/// Runs `$body` with `$r` bound to the `MemRegion` inside any variant.
macro_rules! with_region {
    ($region:expr, $r:ident => $body:expr) => {
        match $region {
            AnyRegion::Host($r) => $body,
            AnyRegion::UcxAlloc($r) => $body,
            AnyRegion::Cuda($r) => $body,
        }
    };
}

impl AnyRegion {
    fn fill(&mut self, seed: u64) -> Result<()> {
        with_region!(self, r => r.memory_mut()?.fill_with_pattern(seed))
    }
    /// The pages the buffer got (UCX-allocated and device memory report normal pages).
    fn page_size(&self) -> PageSize {
        match self {
            AnyRegion::Host(r) => r.memory().map_or(PageSize::Normal, HostBuffer::page_size),
            _ => PageSize::Normal,
        }
    }
    fn addr(&self) -> u64 {
        with_region!(self, r => r.addr())
    }
    fn len(&self) -> usize {
        with_region!(self, r => r.len())
    }
    fn pack_rkey(&self) -> Result<PackedRkey> {
        with_region!(self, r => Ok(r.pack_rkey()?))
    }
}

/// Fails before any process starts when this host cannot have the memory asked for
/// (the cuda feature, libcuda, the device).
fn check_mem(mem: MemPlace) -> Result<()> {
    Ok(mem.check_available()?)
}

// ---------------------------------------------------------------------------------------
// Target role

/// Settings of the target process that are its own (not asked for by the initiator).
#[derive(Debug, Clone, Default)]
pub struct TargetOptions {
    pub ucx_lib: Option<PathBuf>,
    pub progress: ProgressMode,
    pub ucx_config: Vec<(String, String)>,
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
    } else {
        prepare_target(&req, opts).map(|(h, state)| (TargetReply::Ready(Box::new(h)), Served::Ucx(state)))
    };
    match prepared {
        Ok((hello, served)) => {
            write_frame(&mut stream, "target: send hello", &hello)?;
            match served {
                Served::Ucx(state) => serve_target(&mut stream, &req, state),
                Served::Batch(buf) => serve_batch_target(&mut stream, &req, buf),
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
    let len =
        usize::try_from(req.region_bytes).ok().filter(|&l| l > 0).ok_or_else(|| XferError::Protocol {
            stage: "target: request",
            reason: format!("bad region size {}", req.region_bytes),
        })?;
    let ucx = Ucx::load(opts.ucx_lib.as_deref())?;
    let ctx = Context::new(
        &ucx,
        &ContextOptions {
            progress: opts.progress,
            config: opts.ucx_config.clone(),
            cuda_device: req.mem.device(),
            ..Default::default()
        },
    )?;
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
        return Err(crate::error::ConfigError::new("--mem", "--transport cuda-batch needs --mem cuda").into());
    };
    let len =
        usize::try_from(req.region_bytes).ok().filter(|&l| l > 0).ok_or_else(|| XferError::Protocol {
            stage: "target: request",
            reason: format!("bad region size {}", req.region_bytes),
        })?;
    let dev = CudaDevice::open(device)?;
    let mut buf = CudaBuffer::alloc(&dev, len)?;
    buf.fill_with_pattern(PATTERN_SEED)?;
    let export = super::cuda_batch::export(&buf)?;
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

fn accept_with_timeout(
    listener: &TcpListener,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<TcpStream> {
    listener.set_nonblocking(true).map_err(|source| XferError::Control { stage: "accept", source })?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|source| XferError::Control { stage: "accept", source })?;
                s.set_nodelay(true).ok();
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                alive()?;
                if Instant::now() >= deadline {
                    return Err(XferError::Control {
                        stage: "accept",
                        source: std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("no peer within {timeout:?}"),
                        ),
                    });
                }
                // Wakes on a connection, or after 50 ms to re-check the deadline and the child.
                let left = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
                wait_readable(listener.as_raw_fd(), left)
                    .map_err(|e| XferError::Protocol { stage: "accept", reason: e.to_string() })?;
            }
            Err(source) => return Err(XferError::Control { stage: "accept", source }),
        }
    }
}

/// A target process this process started, with its control stream.
pub struct LocalTarget {
    pub child: Child,
    pub stream: TcpStream,
}

impl LocalTarget {
    /// Starts `exe xfer --role target` connected back over loopback.
    pub fn spawn(exe: &Path, opts: &TargetOptions, env: &[(String, String)]) -> Result<LocalTarget> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .map_err(|source| XferError::Control { stage: "bind loopback", source })?;
        let addr =
            listener.local_addr().map_err(|source| XferError::Control { stage: "bind loopback", source })?;
        let mut cmd = Command::new(exe);
        cmd.arg("xfer").arg("--role").arg("target").arg("--connect-back").arg(addr.to_string());
        cmd.arg("--progress").arg(opts.progress.to_string());
        if let Some(lib) = &opts.ucx_lib {
            cmd.arg("--ucx-lib").arg(lib);
        }
        for (k, v) in &opts.ucx_config {
            if k == "TLS" {
                cmd.arg("--ucx-tls").arg(v);
            }
        }
        // The target posts no reads: keep protocol files to the measuring process.
        cmd.env_remove(PROTO_INFO_ENV).env_remove(PROTO_INFO_DIR_ENV);
        cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().map_err(|source| XferError::Spawn { exe: exe.to_path_buf(), source })?;
        let stream = accept_with_timeout(&listener, TARGET_START_TIMEOUT, || match child.try_wait() {
            Ok(Some(status)) => Err(XferError::TargetDied { status: status.to_string() }),
            _ => Ok(()),
        });
        match stream {
            Ok(stream) => Ok(LocalTarget { child, stream }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

/// Connects to a target listening at `addr` (`kvx xfer --connect`), retrying with
/// backoff while it is not up yet.
pub fn connect_target(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .map_err(|source| XferError::Control { stage: "resolve --connect", source })?
        .collect();
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(10);
    loop {
        let mut last = None;
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            match TcpStream::connect_timeout(a, left) {
                Ok(s) => {
                    s.set_nodelay(true).ok();
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() + backoff >= deadline {
            let why = last.map_or_else(|| "it resolved to no address".to_string(), |e| e.to_string());
            return Err(XferError::Protocol {
                stage: "connect",
                reason: format!(
                    "no target at {addr} within {timeout:?} ({why}); start `kvx xfer --listen` there, or \
                     change --connect or --peer-timeout"
                ),
            });
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

// ---------------------------------------------------------------------------------------
// Initiator role

/// A connected initiator: the peer's region unpacked on a local endpoint.
pub struct Session {
    // Field order is drop order: rkey, endpoint, worker, context.
    pub remote: RemoteRegion,
    pub endpoint: Endpoint,
    pub worker: Worker,
    pub ctx: Context,
    pub ucx: Ucx,
    pub hello: TargetHello,
    pub stream: TcpStream,
    pub transports: String,
}

/// Initiator-side settings of a session.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    pub ucx_lib: Option<PathBuf>,
    pub progress: ProgressMode,
    pub err_mode: ErrMode,
    pub ucx_config: Vec<(String, String)>,
}

impl Session {
    /// Sends `req` over `stream`, receives the target's hello, connects and unpacks its key.
    pub fn establish(mut stream: TcpStream, req: &TargetRequest, opts: &SessionOptions) -> Result<Session> {
        let ucx = Ucx::load(opts.ucx_lib.as_deref())?;
        write_frame(&mut stream, "initiator: send request", req)?;
        let hello = match read_frame(&mut stream, "initiator: read hello", TARGET_START_TIMEOUT)? {
            TargetReply::Ready(h) => *h,
            TargetReply::Failed(msg) => return Err(XferError::Target(msg)),
            TargetReply::ReadyBatch(_) => {
                return Err(XferError::Protocol {
                    stage: "initiator: read hello",
                    reason: "the target exported CUDA IPC memory, not a UCX region".into(),
                });
            }
        };
        let ctx = Context::new(
            &ucx,
            &ContextOptions {
                progress: opts.progress,
                config: opts.ucx_config.clone(),
                cuda_device: req.mem.device(),
                ..Default::default()
            },
        )?;
        let worker = Worker::new(&ctx)?;
        let endpoint = Endpoint::connect(&worker, &hello.worker_address, opts.err_mode)?;
        let rkey = PackedRkey::from_bytes(&hello.rkey)?;
        let remote = endpoint.unpack_rkey(&rkey, hello.base, hello.len)?;
        let transports = endpoint.transports().unwrap_or_else(|e| format!("unknown ({e})"));
        Ok(Session { remote, endpoint, worker, ctx, ucx, hello, stream, transports })
    }

    /// Sends a control message to the target.
    pub fn control(&mut self, c: Control) -> Result<()> {
        write_frame(&mut self.stream, "initiator: control", &c)
    }

    /// Closes the UCX side first (while the target still progresses, so a graceful close
    /// completes), then tells the target to stop.
    pub fn finish(self) -> Result<()> {
        let Session { remote, endpoint, worker, ctx, mut stream, .. } = self;
        drop(remote);
        drop(endpoint);
        drop(worker);
        drop(ctx);
        write_frame(&mut stream, "initiator: stop", &Control::Stop)
    }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct XferConfig {
    pub sizes: Vec<u64>,
    pub inflight: Vec<usize>,
    pub working_set_bytes: u64,
    pub hot: bool,
    pub ucx_alloc: bool,
    pub huge_pages: bool,
    pub mem: MemPlace,
    pub duration: Duration,
    pub iters: Option<u64>,
    pub timeout: Duration,
    /// How long to keep trying to reach a remote target (`--connect`).
    pub peer_timeout: Duration,
    pub session: SessionOptions,
    /// `--transport cuda-batch`, and how it issues a batch (`--batch-copy`): each batch of
    /// reads is one batched copy from the target's pool mapped with CUDA IPC (local targets
    /// and device memory only). `None`: UCX.
    pub cuda_batch: Option<BatchCopy>,
    /// `--misalign`: bytes added to every local and remote offset.
    pub misalign: Misalign,
}

/// Where the target runs.
#[derive(Debug, Clone)]
pub enum TargetSpec {
    /// Spawn `exe xfer --role target` on this host.
    Local { exe: PathBuf },
    /// A target started with `kvx xfer --listen` elsewhere.
    Remote { addr: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct UcxReport {
    pub library: String,
    pub version: String,
    pub transports: String,
    pub source: String,
    pub err_mode: ErrMode,
    pub progress: ProgressMode,
    pub target_library: String,
    pub target_version: String,
    /// The protocols UCX selected for the reads (per memory-type pair), or why unknown.
    pub protocols: ProtoReport,
    /// UCX settings kvx chose on the user's behalf (`NAME=value (why)`).
    pub env: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// `host`, `ucx-alloc` (UCX-allocated, flattering: not what a KV cache is) or `cuda`.
    pub kind: String,
    /// The CUDA device of device memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    pub huge_pages: bool,
    /// The pages the initiator's buffers actually got.
    pub pages: String,
    pub working_set_bytes: u64,
    /// `cold` (rotating offsets over the working set, DRAM) or `hot` (cache-resident).
    pub residency: String,
}

/// One (size, in-flight) case.
#[derive(Debug, Clone, Serialize)]
pub struct XferResult {
    pub size_bytes: u64,
    pub inflight: usize,
    pub gbps: f64,
    /// The same-run ceiling ([`XferReport::ceiling`] says which): a host memcpy, or a
    /// device-to-device copy of the same size and batch for device memory.
    pub ceiling_gbps: f64,
    pub ratio_to_ceiling: f64,
    /// Host memory only: the memcpy ceiling under its historical names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_memcpy: Option<f64>,
    /// Device memory only: the GPU's bandwidth for the batch's bytes, the same run's one
    /// `cuMemcpyDtoDAsync` of `size * inflight` bytes (at most the working set). The ceiling
    /// a batched transport such as cuda-batch can approach; `ceiling_gbps` (one copy per read)
    /// is what a transport that posts one copy per descriptor can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bulk_copy_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_to_bulk_copy: Option<f64>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Mean time to post one batch of `inflight` GETs.
    pub post_us: f64,
    /// Mean time from the start of a batch to its last completion.
    pub complete_us: f64,
    pub msgs_per_sec: f64,
    pub batches: u64,
    pub bytes: u64,
    /// Bytes checked against the pattern: every destination byte of the verified batches.
    pub verified_bytes: u64,
    /// Timed batches whose destinations were checked, of `timed_batches` ([`VERIFY_EVERY`]:
    /// 1 in 16 cleared before and checked after, plus the last one).
    pub verified_batches: u64,
    /// The batches timed (the same as `batches`), so a reader sees "N of M verified".
    pub timed_batches: u64,
    /// Reads of the timed batches whose local or remote address or length is not a multiple
    /// of 16 (`--misalign`).
    pub unaligned_descriptors: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct XferReport {
    pub ucx: UcxReport,
    pub memory: MemoryReport,
    /// What `ceiling_gbps` measured: `memcpy` (host) or `device_copy`.
    pub ceiling: String,
    /// A slow path or an unknown protocol for device memory, with the fix.
    pub warnings: Vec<String>,
    pub results: Vec<XferResult>,
    /// `ucx` or `cuda-batch`.
    pub transport: String,
    /// `--transport cuda-batch`: the driver path that moved the batches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_batch: Option<XferBatchReport>,
    /// What `verified_bytes` and `verified_batches` mean: which timed batches were checked, and how.
    pub verification: String,
    /// `--misalign`: bytes added to every read's local and remote offset.
    #[serde(skip_serializing_if = "Misalign::is_none")]
    pub misalign: Misalign,
}

/// [`XferReport::verification`].
pub fn verification_rule() -> String {
    format!(
        "in place, on the timed reads: 1 timed batch in {VERIFY_EVERY} (the first included) has its \
         destinations cleared before it is posted and every byte of them checked against the target's \
         pattern after it completes, outside the measured time; the last timed batch's destinations are \
         checked after the loop"
    )
}

/// How `kvx xfer --transport cuda-batch` moved its batches.
#[derive(Debug, Clone, Serialize)]
pub struct XferBatchReport {
    /// `batch-v2`, `batch-v1` or `per-descriptor`.
    pub path: BatchPath,
    pub driver_call: String,
    /// Driver calls per batch of `inflight` reads (1 with the batch API).
    pub calls_per_batch: f64,
}

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
    let MemPlace::Cuda { device } = cfg.mem else {
        return Err(crate::error::ConfigError::new(
            "--mem",
            "--transport cuda-batch copies device memory: pass --mem cuda",
        )
        .into());
    };
    let TargetSpec::Local { exe } = target else {
        return Err(crate::error::ConfigError::new(
            "--connect",
            "--transport cuda-batch maps the target's GPU memory with CUDA IPC, which works only between \
             processes of one machine: drop --connect (kvx xfer starts its own target)",
        )
        .into());
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
            TargetReply::Ready(_) => {
                return Err(XferError::Protocol {
                    stage: "initiator: read hello",
                    reason: "the target served UCX, not a CUDA IPC export".into(),
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
                kind: "cuda".into(),
                device: Some(device),
                huge_pages: false,
                pages: PageSize::Normal.to_string(),
                working_set_bytes: ws,
                residency: if cfg.hot { "hot".into() } else { "cold".into() },
            },
            ceiling: "device_copy".into(),
            warnings: Vec::new(),
            results,
            transport: "cuda-batch".into(),
            cuda_batch: Some(XferBatchReport {
                path,
                driver_call: path.driver_call().into(),
                calls_per_batch: if batches > 0 { calls as f64 / batches as f64 } else { 0.0 },
            }),
            verification: verification_rule(),
            misalign: cfg.misalign,
        })
    })();
    end_local_target(&mut child, outcome)
}

/// The measurement loop of `kvx xfer --transport cuda-batch`.
struct BatchMeasure<'a> {
    cfg: &'a XferConfig,
    copier: &'a mut BatchCopier,
    peer: &'a std::sync::Arc<PeerMapping>,
    batch: CopyBatch,
    seed: u64,
    scratch: Vec<u8>,
}

impl BatchMeasure<'_> {
    fn cases(
        &mut self,
        local: &mut CudaBuffer,
        ws: u64,
        ceiling: &mut Ceiling,
        mut on_result: impl FnMut(&XferResult),
    ) -> Result<Vec<XferResult>> {
        let cfg = self.cfg;
        let mut results = Vec::new();
        let remote_len = self.peer.span().len.saturating_sub(cfg.misalign.remote_bytes);
        for &size in &cfg.sizes {
            for &inflight in &cfg.inflight {
                if crate::interrupt::requested().is_some() {
                    return Ok(results);
                }
                let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
                let mut r = self.case(local, size, inflight, ws.min(remote_len), ceiling_gbps)?;
                r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
                on_result(&r);
                results.push(r);
            }
        }
        Ok(results)
    }

    fn case(
        &mut self,
        local: &mut CudaBuffer,
        size: u64,
        inflight: usize,
        ws: u64,
        ceiling_gbps: f64,
    ) -> Result<XferResult> {
        let cfg = self.cfg;
        let slots = (ws / size).max(1);
        let local_slots = (local.len() as u64).saturating_sub(cfg.misalign.local_bytes) / size;
        // Remote offsets rotate forward over the working set as a UCX case's do, local ones
        // backward, so no two reads of a batch are contiguous on both sides and the batch
        // keeps `inflight` copies (vLLM's descriptors are strided too); coalesced, a cold batch
        // would be one large copy and measure nothing of posting.
        let layout = ReadLayout {
            size,
            remote_slots: slots,
            local_slots: local_slots.max(1),
            hot: cfg.hot,
            local_backward: true,
            shift: cfg.misalign,
        };
        let mut case = BatchCase { m: self, local, layout, per_batch: inflight as u64 };
        let timed = timed_batches(cfg, inflight as u64, slots, &mut case)?;
        Ok(timed.result(size, inflight, ceiling_gbps))
    }
}

/// A cuda-batch case: each batch one batched copy of `per_batch` reads.
struct BatchCase<'a, 'm> {
    m: &'a mut BatchMeasure<'m>,
    local: &'a mut CudaBuffer,
    layout: ReadLayout,
    per_batch: u64,
}

impl CaseRunner for BatchCase<'_, '_> {
    fn batch(&mut self, k: u64) -> Result<BatchTimes> {
        let pairs = self.layout.batch(k, self.per_batch).map(|d| crate::layouts::plan::Pair {
            local: d.local_off,
            remote: d.remote_off,
            len: d.len,
        });
        let span = Span { base: Registrable::addr(&*self.local), len: self.local.len() as u64 };
        self.m.batch.pack(pairs, span, self.m.peer.span())?;
        let st = self.m.copier.copy(self.local, self.m.peer, &mut self.m.batch, self.m.cfg.timeout)?;
        Ok(BatchTimes {
            bytes: st.bytes,
            post_ns: st.post_ns,
            complete_ns: st.complete_ns,
            unaligned: st.unaligned_descriptors,
        })
    }
    fn clear(&mut self, k: u64) -> Result<()> {
        clear_destinations(&mut *self.local, &self.layout.checks(k, self.per_batch))
    }
    fn check(&mut self, k: u64) -> Result<u64> {
        let checks = self.layout.checks(k, self.per_batch);
        check_destinations(&*self.local, &checks, self.m.seed, "cuda-batch copy", &mut self.m.scratch)
    }
}

fn estimate_secs(cfg: &XferConfig) -> u64 {
    let cases = (cfg.sizes.len() * cfg.inflight.len().max(1)) as u64;
    cases * (cfg.duration.as_secs() + 2) + cfg.timeout.as_secs()
}

/// Waits for a child to exit, killing it after `grace`.
pub fn reap(child: &mut Child, grace: Duration) {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn measure(
    s: &Session,
    cfg: &XferConfig,
    req: &TargetRequest,
    ws: u64,
    on_result: &mut impl FnMut(&XferResult),
) -> Result<XferReport> {
    let local_len = (ws + cfg.misalign.local_bytes) as usize;
    let mut local = make_region(&s.ctx, local_len, req)?;
    let pages = local.page_size();
    let mut ceiling = Ceiling::new(cfg.mem, ws, pages)?;
    let results = with_region!(&mut local, r => measure_cases(s, cfg, ws, &mut ceiling, r, on_result)?);
    let info = s.ucx.info();
    let protocols = s.ctx.protocols().only(Rma::Get);
    let env = s.ctx.env_notes().to_vec();
    let warnings = protocol_warnings(cfg.mem, Rma::Get, &protocols, &env, &s.transports);
    Ok(XferReport {
        ucx: UcxReport {
            library: info.library.display().to_string(),
            version: info.version,
            transports: s.transports.clone(),
            source: info.source.to_string(),
            err_mode: cfg.session.err_mode,
            progress: cfg.session.progress,
            target_library: s.hello.ucx.library.display().to_string(),
            target_version: s.hello.ucx.version.clone(),
            protocols,
            env,
        },
        memory: MemoryReport {
            kind: match cfg.mem {
                MemPlace::Cuda { .. } => "cuda".into(),
                MemPlace::Host if cfg.ucx_alloc => "ucx-alloc".into(),
                MemPlace::Host => "host".into(),
            },
            device: cfg.mem.device(),
            huge_pages: cfg.huge_pages,
            pages: pages.to_string(),
            working_set_bytes: ws,
            residency: if cfg.hot { "hot".into() } else { "cold".into() },
        },
        ceiling: ceiling.kind().into(),
        warnings,
        results,
        transport: "ucx".into(),
        cuda_batch: None,
        verification: verification_rule(),
        misalign: cfg.misalign,
    })
}

/// Warnings for a device-memory run whose `op`s (the GETs of a pull, the PUTs of a push)
/// UCX emulates in software, or whose protocol is unknown, each with the reason and the
/// fix. Host memory gets none here (`kvx doctor` explains host-memory emulation).
pub fn protocol_warnings(
    mem: MemPlace,
    op: Rma,
    protocols: &ProtoReport,
    env: &[String],
    transports: &str,
) -> Vec<String> {
    if !mem.is_device() {
        return Vec::new();
    }
    let verb = match op {
        Rma::Get => "read",
        Rma::Put => "write",
    };
    let uses: Vec<_> = protocols.device_uses(op).collect();
    if uses.is_empty() {
        return vec![format!(
            "the protocol UCX uses to {verb} device memory is unknown ({}); run with UCX_PROTO_INFO=y to see \
             whether it is `software emulation` (the slow path) or `zero-copy cuda_ipc`",
            protocols.summary()
        )];
    }
    // GET zero-copy over cuda_ipc is off by default where GPUs have no NVLink; PUT's is on.
    let zcopy = match op {
        Rma::Get => format!(
            "(3) UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y where GPUs have no NVLink (here: {}), ",
            if env.is_empty() { "not set".to_string() } else { env.join("; ") }
        ),
        Rma::Put => String::new(),
    };
    let library = if zcopy.is_empty() { "(3)" } else { "(4)" };
    uses.into_iter()
        .filter(|u| u.emulated)
        .map(|u| {
            format!(
                "UCX {verb}s device memory by software emulation ({u}): expect well under 1 GB/s. It needs (1) a \
                 CUDA context current before UCX starts and alive as long as UCX (kvx does this for its own \
                 processes; `kvx doctor` checks it), (2) device memory CUDA IPC can export (cuMemAlloc, not the \
                 stream-ordered pool), {zcopy}{library} a UCX built with CUDA (this one selected {transports}; use \
                 libucx/lib/libucp.so.0 of the PyPI wheel libucx-cu12 or libucx-cu13 with --ucx-lib)"
            )
        })
        .collect()
}

/// The same-run ceiling the transfer rates are divided by.
enum Ceiling {
    /// Single-thread memcpy between two more host buffers of the same size and pages.
    Memcpy { src: HostBuffer, dst: HostBuffer },
    /// Device-to-device copies between two more buffers on the same device.
    DeviceCopy { src: CudaBuffer, dst: CudaBuffer },
}

impl Ceiling {
    fn new(mem: MemPlace, ws: u64, pages: PageSize) -> Result<Ceiling> {
        Ok(match mem {
            MemPlace::Host => {
                let pages = if pages == PageSize::Normal { PageSize::Normal } else { PageSize::Huge };
                let mut src = HostBuffer::alloc(ws as usize, pages)?;
                fill_at(src.as_mut_slice(), PATTERN_SEED, 0);
                let mut dst = HostBuffer::alloc(ws as usize, pages)?;
                dst.prefault();
                Ceiling::Memcpy { src, dst }
            }
            MemPlace::Cuda { device } => {
                let dev = CudaDevice::open(device)?;
                Ceiling::DeviceCopy {
                    src: CudaBuffer::alloc(&dev, ws as usize)?,
                    dst: CudaBuffer::alloc(&dev, ws as usize)?,
                }
            }
        })
    }

    fn kind(&self) -> &'static str {
        match self {
            Ceiling::Memcpy { .. } => "memcpy",
            Ceiling::DeviceCopy { .. } => "device_copy",
        }
    }

    fn measure(&mut self, size: u64, inflight: usize, ws: u64, cfg: &XferConfig) -> Result<f64> {
        match self {
            Ceiling::Memcpy { src, dst } => Ok(memcpy_ceiling(src, dst.as_mut_slice(), size, ws, cfg)),
            Ceiling::DeviceCopy { src, dst } => {
                let min_time = if cfg.iters.is_some() { Duration::ZERO } else { cfg.duration };
                Ok(cuda::dtod_copy_gbps(src, dst, size, inflight, cfg.hot, min_time, cfg.iters.unwrap_or(3))?)
            }
        }
    }

    /// Device memory: `bytes` (at most the working set) moved by one device copy, GB/s.
    fn bulk(&mut self, bytes: u64, ws: u64, cfg: &XferConfig) -> Result<Option<f64>> {
        match self {
            Ceiling::Memcpy { .. } => Ok(None),
            Ceiling::DeviceCopy { src, dst } => {
                let min_time = if cfg.iters.is_some() { Duration::ZERO } else { cfg.duration };
                let bytes = bytes.clamp(1, ws);
                Ok(Some(cuda::dtod_copy_gbps(src, dst, bytes, 1, cfg.hot, min_time, cfg.iters.unwrap_or(3))?))
            }
        }
    }
}

impl XferResult {
    fn set_bulk(&mut self, bulk_gbps: Option<f64>) {
        self.bulk_copy_gbps = bulk_gbps;
        self.ratio_to_bulk_copy = bulk_gbps.filter(|&b| b > 0.0).map(|b| self.gbps / b);
    }
}

/// The bytes of [`device_bandwidth_gbps`]'s copy: well above an H100's or H200's L2 (50-60 MB),
/// so the copy measures device memory, not the cache.
pub const DEVICE_BANDWIDTH_BYTES: u64 = 256 << 20;

/// The device's copy bandwidth, GB/s: one `cuMemcpyDtoDAsync` of [`DEVICE_BANDWIDTH_BYTES`]
/// between two buffers on `device`, repeated for at least `min_time`. The ceiling of any
/// transport between ranks on that GPU, however it posts its copies.
pub fn device_bandwidth_gbps(device: u32, min_time: Duration) -> Result<f64> {
    let dev = CudaDevice::open(device)?;
    let len = DEVICE_BANDWIDTH_BYTES as usize;
    let src = CudaBuffer::alloc(&dev, len)?;
    let mut dst = CudaBuffer::alloc(&dev, len)?;
    Ok(cuda::dtod_copy_gbps(&src, &mut dst, DEVICE_BANDWIDTH_BYTES, 1, true, min_time, 3)?)
}

/// Offsets of the `k`-th GET of a run: rotating over the working set when cold, fixed
/// at 0 when hot.
#[inline]
fn slot_offset(k: u64, size: u64, slots: u64, hot: bool) -> u64 {
    if hot { 0 } else { (k % slots) * size }
}

fn measure_cases<M: BufferAccess>(
    s: &Session,
    cfg: &XferConfig,
    ws: u64,
    ceiling: &mut Ceiling,
    local: &mut MemRegion<M>,
    on_result: &mut impl FnMut(&XferResult),
) -> Result<Vec<XferResult>> {
    let remote_len = s.remote.len().saturating_sub(cfg.misalign.remote_bytes);
    let mut results = Vec::new();
    for &size in &cfg.sizes {
        for &inflight in &cfg.inflight {
            // An interrupted run keeps the cases it measured (its report says it is partial).
            if crate::interrupt::requested().is_some() {
                return Ok(results);
            }
            // Measured right before each case so both see the same machine (other load,
            // frequency), which is what makes their ratio meaningful on a shared host.
            let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
            let mut r = measure_case(s, cfg, local, size, inflight, ws.min(remote_len), ceiling_gbps)?;
            r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
            if matches!(ceiling, Ceiling::Memcpy { .. }) {
                r.memcpy_gbps = Some(r.ceiling_gbps);
                r.ratio_to_memcpy = Some(r.ratio_to_ceiling);
            }
            on_result(&r);
            results.push(r);
        }
    }
    Ok(results)
}

fn memcpy_ceiling(src: &HostBuffer, dst: &mut [u8], size: u64, ws: u64, cfg: &XferConfig) -> f64 {
    let slots = (ws / size).max(1);
    let src = src.as_slice();
    let size_us = size as usize;
    let mut k: u64 = 0;
    let copy = |k: u64, dst: &mut [u8]| {
        let off = slot_offset(k, size, slots, cfg.hot) as usize;
        // Different slots for source and destination, as a GET's local and remote offsets are.
        let doff = slot_offset(k + slots / 2, size, slots, cfg.hot) as usize;
        dst[doff..doff + size_us].copy_from_slice(&src[off..off + size_us]);
    };
    for _ in 0..slots.min(8) {
        copy(k, dst);
        k += 1;
    }
    let min_copies = cfg.iters.unwrap_or(0).max(3);
    let start = Instant::now();
    let mut n: u64 = 0;
    // The clock is read once per 16 copies, so tiny copies measure memcpy, not the clock.
    'outer: loop {
        for _ in 0..16 {
            copy(k, dst);
            k += 1;
            n += 1;
            if cfg.iters.is_some() && n >= min_copies {
                break 'outer;
            }
        }
        if n >= min_copies && start.elapsed() >= cfg.duration {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(&dst[..1]);
    (n * size) as f64 / secs / 1e9
}

fn measure_case<M: BufferAccess>(
    s: &Session,
    cfg: &XferConfig,
    local: &mut MemRegion<M>,
    size: u64,
    inflight: usize,
    ws: u64,
    ceiling_gbps: f64,
) -> Result<XferResult> {
    let slots = (ws / size).max(1);
    let local_slots = (local.len() as u64).saturating_sub(cfg.misalign.local_bytes) / size;
    let layout = ReadLayout {
        size,
        remote_slots: slots,
        local_slots: local_slots.max(1),
        hot: cfg.hot,
        local_backward: false,
        shift: cfg.misalign,
    };
    let (local_base, remote_base) = (local.addr(), s.remote.base());
    let mut case = UcxCase {
        s,
        local,
        layout,
        per_batch: inflight as u64,
        opts: ReadOptions { max_inflight: inflight, timeout: cfg.timeout },
        scratch: Vec::new(),
    };
    let mut timed = timed_batches(cfg, inflight as u64, slots, &mut case)?;
    timed.unaligned =
        layout.unaligned(timed.first_read, timed.batches * inflight as u64, local_base, remote_base);
    Ok(timed.result(size, inflight, ceiling_gbps))
}

/// One timed batch in this many has its destinations cleared before it is posted and every
/// byte of them checked after it completes (the first timed batch always, and the last one
/// when `--iters` says which it is); see [`timed_batches`].
pub const VERIFY_EVERY: u64 = 16;

/// Whether timed batch `j` (0-based) is one whose destinations are cleared and checked: one
/// in [`VERIFY_EVERY`] starting with the first, and `last` when the number of timed batches
/// is known beforehand (`--iters`), so that the last batch's check is also of bytes it wrote.
pub fn sampled(j: u64, last: Option<u64>) -> bool {
    j.is_multiple_of(VERIFY_EVERY) || last == Some(j)
}

/// `--misalign`: bytes added to every read's local and remote offset, so that descriptors
/// are not 16-byte aligned (the buffers are that much longer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Misalign {
    pub local_bytes: u64,
    pub remote_bytes: u64,
}

impl Misalign {
    pub fn is_none(&self) -> bool {
        self.local_bytes == 0 && self.remote_bytes == 0
    }
}

/// Where the reads of one case go: read `i` (counted over the whole case, warm-up included)
/// moves `size` bytes from remote slot `i` (rotating forward over `remote_slots`) to a local
/// slot (forward, or backward on cuda-batch so that no two reads of a batch are contiguous on
/// both sides and coalesce), both at offset 0 when hot, each offset shifted by `--misalign`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLayout {
    pub size: u64,
    pub remote_slots: u64,
    pub local_slots: u64,
    pub hot: bool,
    pub local_backward: bool,
    pub shift: Misalign,
}

impl ReadLayout {
    /// Read `i`.
    pub fn read(&self, i: u64) -> ReadDesc {
        let local = match (self.hot, self.local_backward) {
            (true, _) => 0,
            (false, false) => (i % self.local_slots) * self.size,
            (false, true) => (self.local_slots - 1 - i % self.local_slots) * self.size,
        };
        ReadDesc {
            local_off: local + self.shift.local_bytes,
            remote_off: slot_offset(i, self.size, self.remote_slots, self.hot) + self.shift.remote_bytes,
            len: self.size,
        }
    }

    /// Reads `k0..k0 + n`: one batch.
    pub fn batch(&self, k0: u64, n: u64) -> impl Iterator<Item = ReadDesc> + '_ {
        (k0..k0 + n).map(|i| self.read(i))
    }

    /// The destinations of reads `k0..k0 + n` to check once they completed, by local offset:
    /// each local range once (reads of a batch that land on one slot, as hot ones all do,
    /// are checked once). A slot two reads of the batch filled from different remote bytes is
    /// left out, since which of them landed last is not defined (no layout kvx uses makes one:
    /// local and remote slots wrap together).
    pub fn checks(&self, k0: u64, n: u64) -> Vec<ReadDesc> {
        let mut by_local: std::collections::BTreeMap<u64, Option<ReadDesc>> =
            std::collections::BTreeMap::new();
        for d in self.batch(k0, n) {
            by_local
                .entry(d.local_off)
                .and_modify(|seen| {
                    if seen.is_some_and(|s| s.remote_off != d.remote_off) {
                        *seen = None;
                    }
                })
                .or_insert(Some(d));
        }
        by_local.into_values().flatten().collect()
    }

    /// How many of reads `k0..k0 + n` have a local or remote address (registration bases
    /// `local_base`, `remote_base`) or a length that is not a multiple of 16.
    pub fn unaligned(&self, k0: u64, n: u64, local_base: u64, remote_base: u64) -> u64 {
        self.batch(k0, n)
            .filter(|d| {
                !((local_base + d.local_off) | (remote_base + d.remote_off) | d.len).is_multiple_of(16)
            })
            .count() as u64
    }
}

/// Clears `checks`' destinations in `mem` (before a sampled batch is posted).
fn clear_destinations<M: BufferAccess>(mem: &mut M, checks: &[ReadDesc]) -> Result<()> {
    let ranges: Vec<Range<u64>> = checks.iter().map(|d| d.local_off..d.local_off + d.len).collect();
    mem.zero_ranges(&ranges)
}

/// Checks every byte of `checks`' destinations in `mem` against the pattern at the remote
/// offsets they came from; the bytes checked, or an error naming the first wrong read.
fn check_destinations<M: BufferAccess>(
    mem: &M,
    checks: &[ReadDesc],
    seed: u64,
    what: &str,
    scratch: &mut Vec<u8>,
) -> Result<u64> {
    let ranges: Vec<Range<u64>> = checks.iter().map(|d| d.local_off..d.local_off + d.len).collect();
    let check = |i: usize, got: &[u8]| check_at(got, seed, checks[i].remote_off).err();
    match mem.check_ranges(&ranges, scratch, &check)? {
        None => Ok(checks.iter().map(|d| d.len).sum()),
        Some((i, off)) => {
            let d = checks[i];
            Err(XferError::Verify(format!(
                "{}-byte {what} from remote offset {} into local offset {}: first wrong byte at remote offset {off}",
                d.len, d.remote_off, d.local_off
            )))
        }
    }
}

/// What one batch did, as [`timed_batches`] records it.
#[derive(Debug, Clone, Copy, Default)]
struct BatchTimes {
    bytes: u64,
    post_ns: u64,
    complete_ns: u64,
    /// Descriptors of the batch that are not 16-byte aligned, where the transport counts them.
    unaligned: u64,
}

/// One case's batches on one transport, as [`timed_batches`] drives them.
trait CaseRunner {
    /// Runs batch `k` (reads `k..k + per_batch`).
    fn batch(&mut self, k: u64) -> Result<BatchTimes>;
    /// Clears batch `k`'s destinations.
    fn clear(&mut self, k: u64) -> Result<()>;
    /// Checks every byte of batch `k`'s destinations; the bytes checked.
    fn check(&mut self, k: u64) -> Result<u64>;
}

/// A UCX case: each batch one `read_batch` of `per_batch` GETs.
struct UcxCase<'a, M: BufferAccess> {
    s: &'a Session,
    local: &'a mut MemRegion<M>,
    layout: ReadLayout,
    per_batch: u64,
    opts: ReadOptions,
    scratch: Vec<u8>,
}

impl<M: BufferAccess> CaseRunner for UcxCase<'_, M> {
    fn batch(&mut self, k: u64) -> Result<BatchTimes> {
        let st = self.s.remote.read_batch(self.local, self.layout.batch(k, self.per_batch), &self.opts)?;
        Ok(BatchTimes { bytes: st.bytes, post_ns: st.post_ns, complete_ns: st.complete_ns, unaligned: 0 })
    }
    fn clear(&mut self, k: u64) -> Result<()> {
        clear_destinations(self.local.memory_mut()?, &self.layout.checks(k, self.per_batch))
    }
    fn check(&mut self, k: u64) -> Result<u64> {
        let checks = self.layout.checks(k, self.per_batch);
        check_destinations(
            self.local.memory()?,
            &checks,
            self.s.hello.pattern_seed,
            "read",
            &mut self.scratch,
        )
    }
}

/// What the timed batches of one case measured and verified.
struct Timed {
    hist: hdrhistogram::Histogram<u64>,
    post_ns: u64,
    complete_ns: u64,
    bytes: u64,
    batches: u64,
    per_batch: u64,
    /// Measured seconds: the timed loop's, less the time spent clearing and checking.
    secs: f64,
    /// The first read of the first timed batch (the warm-up's reads come before it).
    first_read: u64,
    verified_batches: u64,
    verified_bytes: u64,
    unaligned: u64,
}

/// Runs a case as it runs on every transport: a warm-up (connection set-up, registration
/// caches, page faults: 3 batches, or 20 ms up to one pass over `slots`), then timed batches
/// until `--iters` or `--duration`, or an interrupt (the batches done so far still count).
///
/// What the timed batches wrote is verified in place, not by an extra read: timed batch `j`
/// with [`sampled`]`(j, ..)` (1 in [`VERIFY_EVERY`], the first included) has its destinations
/// cleared before it is posted and every byte of them checked against the pattern at the
/// remote offsets they came from once it completed; the last timed batch's destinations are
/// checked after the loop if it was not sampled (without clearing: a sampled batch is what
/// proves they were written, this shows nothing overwrote them since). Clearing and checking
/// are not measured: their time is taken out of the case's seconds, and `--duration` counts
/// measured time. One bias stays: a cleared destination is cache-warm (host memory: in the
/// CPU's caches; device memory: just written by a host-to-device copy), which may make a
/// sampled batch a little faster, on 1 batch in 16.
fn timed_batches(cfg: &XferConfig, per_batch: u64, slots: u64, run: &mut impl CaseRunner) -> Result<Timed> {
    let mut k: u64 = 0;
    let warm_start = Instant::now();
    while k < per_batch * 3 || (warm_start.elapsed() < Duration::from_millis(20) && k < slots.max(per_batch))
    {
        run.batch(k)?;
        k += per_batch;
    }
    let hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
        .map_err(|e| XferError::Protocol { stage: "histogram", reason: e.to_string() })?;
    let mut t = Timed {
        hist,
        post_ns: 0,
        complete_ns: 0,
        bytes: 0,
        batches: 0,
        per_batch,
        secs: 0.0,
        first_read: k,
        verified_batches: 0,
        verified_bytes: 0,
        unaligned: 0,
    };
    let last = cfg.iters.map(|n| n.saturating_sub(1));
    let mut unmeasured = Duration::ZERO;
    let start = Instant::now();
    let last_checked = loop {
        let sample = sampled(t.batches, last);
        if sample {
            let c = Instant::now();
            run.clear(k)?;
            unmeasured += c.elapsed();
        }
        let b = run.batch(k)?;
        if sample {
            let c = Instant::now();
            t.verified_bytes += run.check(k)?;
            t.verified_batches += 1;
            unmeasured += c.elapsed();
        }
        k += per_batch;
        t.batches += 1;
        t.bytes += b.bytes;
        t.post_ns += b.post_ns;
        t.complete_ns += b.complete_ns;
        t.unaligned += b.unaligned;
        t.hist.saturating_record(b.complete_ns.max(1));
        let done = match cfg.iters {
            Some(n) => t.batches >= n,
            None => t.batches >= 3 && start.elapsed().saturating_sub(unmeasured) >= cfg.duration,
        };
        if done || crate::interrupt::requested().is_some() {
            break sample;
        }
    };
    t.secs = start.elapsed().saturating_sub(unmeasured).as_secs_f64();
    if !last_checked {
        t.verified_bytes += run.check(k - per_batch)?;
        t.verified_batches += 1;
    }
    Ok(t)
}

impl Timed {
    fn result(&self, size: u64, inflight: usize, ceiling_gbps: f64) -> XferResult {
        let gbps = self.bytes as f64 / self.secs / 1e9;
        let us = |ns: u64| ns as f64 / 1e3;
        let batches = self.batches.max(1);
        XferResult {
            size_bytes: size,
            inflight,
            gbps,
            ceiling_gbps,
            ratio_to_ceiling: if ceiling_gbps > 0.0 { gbps / ceiling_gbps } else { 0.0 },
            memcpy_gbps: None,
            ratio_to_memcpy: None,
            bulk_copy_gbps: None,
            ratio_to_bulk_copy: None,
            p50_us: us(self.hist.value_at_quantile(0.50)),
            p99_us: us(self.hist.value_at_quantile(0.99)),
            max_us: us(self.hist.max()),
            post_us: us(self.post_ns) / batches as f64,
            complete_us: us(self.complete_ns) / batches as f64,
            msgs_per_sec: (self.batches * self.per_batch) as f64 / self.secs,
            batches: self.batches,
            bytes: self.bytes,
            verified_bytes: self.verified_bytes,
            verified_batches: self.verified_batches,
            timed_batches: self.batches,
            unaligned_descriptors: self.unaligned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parallel_check_reports_the_first_failing_range() {
        // 64 ranges of 64 KiB (4 MiB: checked in parallel), two of them damaged.
        let mut buf = vec![0u8; 4 << 20];
        fill_at(&mut buf, 7, 0);
        buf[(40 << 16) + 9] ^= 1;
        buf[(9 << 16) + 100] ^= 1;
        let items: Vec<(usize, &[u8])> = buf.chunks(1 << 16).enumerate().collect();
        let check = |i: usize, got: &[u8]| check_at(got, 7, (i as u64) << 16).err();
        assert_eq!(first_failure(&items, &check), Some((9, (9 << 16) + 100)));
        assert_eq!(first_failure(&items[..9], &check), None, "small: on this thread");
    }

    #[test]
    fn one_timed_batch_in_16_is_sampled_starting_with_the_first_and_a_known_last() {
        let picked: Vec<u64> = (0..40).filter(|&j| sampled(j, None)).collect();
        assert_eq!(picked, [0, 16, 32]);
        let picked: Vec<u64> = (0..40).filter(|&j| sampled(j, Some(39))).collect();
        assert_eq!(picked, [0, 16, 32, 39], "--iters 40: the last batch is cleared and checked too");
        assert!(sampled(0, Some(0)), "a single timed batch");
    }

    fn layout(hot: bool, backward: bool, shift: Misalign) -> ReadLayout {
        ReadLayout { size: 4096, remote_slots: 8, local_slots: 8, hot, local_backward: backward, shift }
    }

    #[test]
    fn a_batch_s_checks_are_its_destinations_each_once_at_their_remote_offsets() {
        let none = Misalign::default();
        // Cold, forward (UCX): reads 6..10 wrap around 8 slots on both sides.
        let c = layout(false, false, none).checks(6, 4);
        let got: Vec<(u64, u64)> = c.iter().map(|d| (d.local_off / 4096, d.remote_off / 4096)).collect();
        assert_eq!(got, [(0, 0), (1, 1), (6, 6), (7, 7)]);
        assert!(c.iter().all(|d| d.len == 4096));
        // Backward local slots (cuda-batch): local 7 - i % 8 holds remote i % 8.
        let c = layout(false, true, none).checks(0, 3);
        let got: Vec<(u64, u64)> = c.iter().map(|d| (d.local_off / 4096, d.remote_off / 4096)).collect();
        assert_eq!(got, [(5, 2), (6, 1), (7, 0)]);
        // More reads than slots: each slot checked once (its reads brought the same bytes).
        assert_eq!(layout(false, true, none).checks(0, 20).len(), 8);
        // Hot: every read lands on local 0 from remote 0, checked once.
        let c = layout(true, false, none).checks(100, 64);
        assert_eq!(c, [ReadDesc { local_off: 0, remote_off: 0, len: 4096 }]);
        // --misalign moves both sides.
        let shift = Misalign { local_bytes: 3, remote_bytes: 5 };
        let c = layout(false, false, shift).checks(1, 1);
        assert_eq!(c, [ReadDesc { local_off: 4096 + 3, remote_off: 4096 + 5, len: 4096 }]);
        // A slot two reads filled from different remote bytes is not checked (either may be last).
        let odd = ReadLayout { local_slots: 3, ..layout(false, false, none) };
        let c = odd.checks(0, 4);
        assert_eq!(
            c.iter().map(|d| d.local_off / 4096).collect::<Vec<_>>(),
            [1, 2],
            "slot 0 got remote 0 and 3"
        );
    }

    #[test]
    fn misaligned_reads_are_counted_on_either_side_and_by_length() {
        let none = Misalign::default();
        assert_eq!(layout(false, false, none).unaligned(0, 10, 0x1000, 0x2000), 0);
        let one_side = Misalign { local_bytes: 0, remote_bytes: 1 };
        assert_eq!(layout(false, false, one_side).unaligned(0, 10, 0x1000, 0x2000), 10);
        assert_eq!(layout(false, false, none).unaligned(0, 10, 0x1008, 0x2000), 10, "the base counts");
        let odd = ReadLayout { size: 4100, ..layout(false, false, none) };
        assert_eq!(odd.unaligned(0, 10, 0x1000, 0x2000), 10, "a length not a multiple of 16");
    }

    /// Copies reads in this process from a pattern-filled buffer, as a transport would, and
    /// damages one byte of one chosen batch: drives [`timed_batches`]'s verification (the
    /// transports themselves are tested over real UCX and CUDA elsewhere).
    struct Copying {
        src: Vec<u8>,
        dst: HostBuffer,
        layout: ReadLayout,
        per_batch: u64,
        damage_batch: Option<u64>,
        scratch: Vec<u8>,
    }

    impl CaseRunner for Copying {
        fn batch(&mut self, k: u64) -> Result<BatchTimes> {
            let dst = self.dst.as_mut_slice();
            for d in self.layout.batch(k, self.per_batch) {
                let (l, r, n) = (d.local_off as usize, d.remote_off as usize, d.len as usize);
                dst[l..l + n].copy_from_slice(&self.src[r..r + n]);
            }
            if self.damage_batch == Some(k / self.per_batch) {
                let d = self.layout.read(k + self.per_batch - 1);
                dst[(d.local_off + d.len / 2) as usize] ^= 0x40;
            }
            Ok(BatchTimes { bytes: self.per_batch * self.layout.size, ..BatchTimes::default() })
        }
        fn clear(&mut self, k: u64) -> Result<()> {
            clear_destinations(&mut self.dst, &self.layout.checks(k, self.per_batch))
        }
        fn check(&mut self, k: u64) -> Result<u64> {
            let checks = self.layout.checks(k, self.per_batch);
            check_destinations(&self.dst, &checks, 7, "read", &mut self.scratch)
        }
    }

    fn xfer_cfg(iters: u64) -> XferConfig {
        XferConfig {
            sizes: vec![4096],
            inflight: vec![4],
            working_set_bytes: 1 << 20,
            hot: false,
            ucx_alloc: false,
            huge_pages: false,
            mem: MemPlace::Host,
            duration: Duration::ZERO,
            iters: Some(iters),
            timeout: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(1),
            session: SessionOptions::default(),
            cuda_batch: None,
            misalign: Misalign::default(),
        }
    }

    fn copying(damage_batch: Option<u64>, shift: Misalign) -> Copying {
        let mut src = vec![0u8; (64 << 10) + 64];
        fill_at(&mut src, 7, 0);
        let dst = HostBuffer::alloc((64 << 10) + 64, PageSize::Normal).expect("a host buffer");
        let layout = ReadLayout {
            size: 4096,
            remote_slots: 16,
            local_slots: 16,
            hot: false,
            local_backward: true,
            shift,
        };
        Copying { src, dst, layout, per_batch: 4, damage_batch, scratch: Vec::new() }
    }

    #[test]
    fn a_damaged_byte_in_a_sampled_timed_batch_fails_the_case_naming_the_read() {
        // 40 timed batches after 3 of warm-up (`slots` 4 ends the warm-up at 3 batches): timed
        // batch j is batch 3 + j.
        let cfg = xfer_cfg(40);
        let shift = Misalign { local_bytes: 3, remote_bytes: 11 };
        let t = timed_batches(&cfg, 4, 4, &mut copying(None, shift)).expect("clean copies verify");
        assert_eq!((t.verified_batches, t.batches), (4, 40), "0, 16, 32 and the last");
        assert_eq!(t.verified_bytes, 4 * 4 * 4096);
        for (j, caught) in [(0, true), (16, true), (39, true), (5, false)] {
            let out = timed_batches(&cfg, 4, 4, &mut copying(Some(3 + j), shift));
            match (out, caught) {
                (Err(XferError::Verify(why)), true) => {
                    assert!(why.starts_with("4096-byte read from remote offset "), "{why}");
                    assert!(why.contains("into local offset") && why.contains("first wrong byte"), "{why}");
                }
                (Ok(t), false) => assert_eq!(t.verified_batches, 4, "batch {j} is not sampled: not seen"),
                (other, _) => panic!("timed batch {j}: {:?}", other.map(|t| t.verified_batches)),
            }
        }
        // Without --iters the last batch is checked as it stands after the loop.
        let cfg = XferConfig { iters: None, duration: Duration::from_millis(1), ..xfer_cfg(1) };
        let t = timed_batches(&cfg, 4, 4, &mut copying(None, Misalign::default())).expect("verifies");
        assert!(
            t.verified_batches >= 1 && t.verified_batches <= t.batches.div_ceil(16) + 1,
            "{}",
            t.verified_batches
        );
    }

    #[test]
    fn cold_offsets_rotate_over_the_working_set_and_hot_ones_do_not() {
        let offs: Vec<u64> = (0..6).map(|k| slot_offset(k, 4096, 4, false)).collect();
        assert_eq!(offs, vec![0, 4096, 8192, 12288, 0, 4096]);
        assert!((0..6).all(|k| slot_offset(k, 4096, 4, true) == 0));
    }

    fn report(op: &str, description: &str, config: &str) -> ProtoReport {
        let sel = super::super::ucx::ProtoSelection {
            op: op.into(),
            local: "cuda/GPU0".into(),
            remote: "cuda/dev[0]".into(),
            range: "0..inf".into(),
            description: description.into(),
            config: config.into(),
        };
        ProtoReport { uses: super::super::ucx::summarize_protocols(&[sel]), note: None }
    }

    #[test]
    fn device_memory_moved_by_emulation_warns_with_the_fix_for_its_operation() {
        let dev = MemPlace::Cuda { device: 0 };
        let env = vec!["UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvx: device memory)".to_string()];
        let emulated_get = report("get", "software emulation", "sysv/memory");
        let w = protocol_warnings(dev, Rma::Get, &emulated_get, &env, "sysv/memory");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("UCX reads device memory by software emulation"), "{}", w[0]);
        assert!(w[0].contains("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (kvx"), "names the setting: {}", w[0]);
        // PUT zero-copy is on without any setting: a push's warning does not send the user there.
        let emulated_put = report("put", "software emulation", "sysv/memory");
        let w = protocol_warnings(dev, Rma::Put, &emulated_put, &env, "sysv/memory");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("UCX writes device memory by software emulation"), "{}", w[0]);
        assert!(!w[0].contains("GET_ZCOPY") && w[0].contains("(3) a UCX built with CUDA"), "{}", w[0]);
        // Zero-copy over cuda_ipc: nothing to say.
        let fast = report("put", "zero-copy", "cuda_ipc/cuda");
        assert!(protocol_warnings(dev, Rma::Put, &fast, &env, "cuda_ipc/cuda").is_empty());
        // The other operation's selection says nothing about this one's: unknown, by name.
        let w = protocol_warnings(dev, Rma::Get, &fast, &env, "cuda_ipc/cuda");
        assert!(w.len() == 1 && w[0].contains("to read device memory is unknown"), "{w:?}");
        // Host memory: no warning here (kvx doctor explains host-memory emulation).
        assert!(protocol_warnings(MemPlace::Host, Rma::Get, &emulated_get, &env, "").is_empty());
    }
}
