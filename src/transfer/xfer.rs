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
/// Seed of the byte pattern the target fills its region with.
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
// Byte pattern

/// The 8-byte word at `word_index` of the pattern (splitmix64 of seed and index).
#[inline]
pub fn pattern_word(seed: u64, word_index: u64) -> u64 {
    let mut z = seed ^ word_index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` (which starts at pattern offset 0) with the pattern.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&pattern_word(seed, i as u64).to_le_bytes());
    }
    let tail_start = buf.len() / 8 * 8;
    let w = pattern_word(seed, (buf.len() / 8) as u64).to_le_bytes();
    for (j, b) in buf[tail_start..].iter_mut().enumerate() {
        *b = w[j];
    }
}

/// Fills `buf` with the pattern as it is at offset `pattern_off` (a multiple of 8).
pub fn fill_pattern_at(buf: &mut [u8], pattern_off: u64, seed: u64) {
    debug_assert!(pattern_off.is_multiple_of(8));
    let first = pattern_off / 8;
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let w = pattern_word(seed, first + i as u64).to_le_bytes();
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// Checks that `got` equals the pattern at offset `pattern_off`; returns the first
/// mismatching offset.
pub fn check_pattern(got: &[u8], pattern_off: u64, seed: u64) -> Result<(), u64> {
    if pattern_off.is_multiple_of(8) && got.len().is_multiple_of(8) {
        let first = pattern_off / 8;
        for (i, c) in got.chunks_exact(8).enumerate() {
            if c != pattern_word(seed, first + i as u64).to_le_bytes() {
                return Err(pattern_off + 8 * i as u64);
            }
        }
        return Ok(());
    }
    for (i, &b) in got.iter().enumerate() {
        let off = pattern_off + i as u64;
        if b != pattern_word(seed, off / 8).to_le_bytes()[(off % 8) as usize] {
            return Err(off);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Memory both roles use

/// What `kvx xfer` needs of a registered buffer besides its registration: filling it
/// with the pattern, clearing a range, and reading a range back to check it. Host
/// buffers do this in place; device buffers copy through the host.
pub trait BufferAccess: Registrable {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()>;
    fn zero(&mut self, off: usize, len: usize) -> Result<()>;
    fn read(&self, off: usize, len: usize) -> Result<std::borrow::Cow<'_, [u8]>>;
}

macro_rules! host_access {
    ($t:ty) => {
        impl BufferAccess for $t {
            fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
                fill_pattern(self.as_mut_slice(), seed);
                Ok(())
            }
            fn zero(&mut self, off: usize, len: usize) -> Result<()> {
                self.as_mut_slice()[off..off + len].fill(0);
                Ok(())
            }
            fn read(&self, off: usize, len: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
                Ok(std::borrow::Cow::Borrowed(&self.as_slice()[off..off + len]))
            }
        }
    };
}
host_access!(HostBuffer);
host_access!(UcxAllocated);

impl BufferAccess for CudaBuffer {
    fn fill_with_pattern(&mut self, seed: u64) -> Result<()> {
        // Staged in 64 MiB pieces (multiples of 8, so the pattern's words line up at
        // every piece boundary).
        const PIECE: u64 = 64 << 20;
        let len = CudaBuffer::len(self) as u64;
        let ranges: Vec<std::ops::Range<u64>> =
            (0..len.div_ceil(PIECE)).map(|i| i * PIECE..((i + 1) * PIECE).min(len)).collect();
        self.write_ranges(&ranges, |i, bytes| fill_pattern_at(bytes, ranges[i].start, seed))?;
        Ok(())
    }
    fn zero(&mut self, off: usize, len: usize) -> Result<()> {
        self.write_ranges(&[std::ops::Range { start: off as u64, end: (off + len) as u64 }], |_, bytes| {
            bytes.fill(0)
        })?;
        Ok(())
    }
    fn read(&self, off: usize, len: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
        let mut out = Vec::with_capacity(len);
        let range = std::ops::Range { start: off as u64, end: (off + len) as u64 };
        self.read_ranges(&[range], |_, bytes| out.extend_from_slice(bytes))?;
        Ok(std::borrow::Cow::Owned(out))
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
    pub verified_bytes: u64,
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
        region_bytes: ws,
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
        region_bytes: ws,
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
            let mut local = CudaBuffer::alloc(&dev, ws as usize)?;
            let mut ceiling = Ceiling::new(cfg.mem, ws, PageSize::Normal)?;
            let seed = hello.pattern_seed;
            let mut m =
                BatchMeasure { cfg, copier: &mut copier, peer: &peer, batch: CopyBatch::default(), seed };
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
        for &size in &cfg.sizes {
            for &inflight in &cfg.inflight {
                if crate::interrupt::requested().is_some() {
                    return Ok(results);
                }
                let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
                let mut r = self.case(local, size, inflight, ws.min(self.peer.span().len), ceiling_gbps)?;
                r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
                on_result(&r);
                results.push(r);
            }
        }
        Ok(results)
    }

    /// Packs and copies reads `k0..k0 + n` of `size` bytes: remote offsets rotate forward over
    /// the working set as a UCX case's do, local ones backward, so no two reads of a batch are
    /// contiguous on both sides and the batch keeps `n` copies (vLLM's descriptors are strided
    /// too); coalesced, a cold batch would be one large copy and measure nothing of posting.
    fn one(
        &mut self,
        local: &mut CudaBuffer,
        k0: u64,
        n: u64,
        size: u64,
        slots: (u64, u64),
    ) -> Result<super::cuda_batch::BatchStats> {
        let (remote_slots, local_slots) = slots;
        let hot = self.cfg.hot;
        let pairs = (k0..k0 + n).map(|i| crate::layouts::plan::Pair {
            local: if hot { 0 } else { (local_slots - 1 - i % local_slots) * size },
            remote: slot_offset(i, size, remote_slots, hot),
            len: size,
        });
        let span = Span { base: Registrable::addr(&*local), len: local.len() as u64 };
        self.batch.pack(pairs, span, self.peer.span())?;
        Ok(self.copier.copy(local, self.peer, &mut self.batch, self.cfg.timeout)?)
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
        let slots = ((ws / size).max(1), (local.len() as u64 / size).max(1));
        let per_batch = inflight as u64;
        let timed = timed_batches(cfg, per_batch, slots.0, |k| {
            self.one(local, k, per_batch, size, slots).map(|st| (st.bytes, st.post_ns, st.complete_ns))
        })?;
        let verified_bytes = self.verify(local, size, slots, inflight)?;
        Ok(timed.result(size, inflight, ceiling_gbps, verified_bytes))
    }

    /// Clears the local slots of one batch, copies them again from remote slots starting
    /// mid-way (so local and remote offsets differ), and checks every byte against the pattern.
    fn verify(
        &mut self,
        local: &mut CudaBuffer,
        size: u64,
        slots: (u64, u64),
        inflight: usize,
    ) -> Result<u64> {
        let (remote_slots, local_slots) = slots;
        let n = if self.cfg.hot { 1 } else { (inflight as u64).min(remote_slots).min(local_slots) };
        let pairs: Vec<crate::layouts::plan::Pair> = (0..n)
            .map(|i| crate::layouts::plan::Pair {
                local: (n - 1 - i) * size,
                remote: ((i + remote_slots / 2 + 1) % remote_slots) * size,
                len: size,
            })
            .collect();
        let ranges: Vec<std::ops::Range<u64>> = pairs.iter().map(|p| p.local..p.local + p.len).collect();
        local.write_ranges(&ranges, |_, bytes| bytes.fill(0))?;
        let span = Span { base: Registrable::addr(&*local), len: local.len() as u64 };
        self.batch.pack(pairs.iter().copied(), span, self.peer.span())?;
        self.copier.copy(local, self.peer, &mut self.batch, self.cfg.timeout)?;
        let mut bad = None;
        local.read_ranges(&ranges, |i, got| {
            if bad.is_none()
                && let Err(off) = check_pattern(got, pairs[i].remote, self.seed)
            {
                bad = Some((i, off));
            }
        })?;
        if let Some((i, off)) = bad {
            return Err(XferError::Verify(format!(
                "{size}-byte cuda-batch copy from remote offset {} into local offset {}: first wrong byte at \
                 remote offset {off}",
                pairs[i].remote, pairs[i].local
            )));
        }
        Ok(n * size)
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
    let local_len = ws as usize;
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
                fill_pattern(src.as_mut_slice(), PATTERN_SEED);
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
    let remote_len = s.remote.len();
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
    let local_slots = (local.len() as u64 / size).max(1);
    let opts = ReadOptions { max_inflight: inflight, timeout: cfg.timeout };
    let per_batch = inflight as u64;
    let timed = timed_batches(cfg, per_batch, slots, |k0| {
        let descs = (k0..k0 + per_batch).map(|i| ReadDesc {
            local_off: slot_offset(i, size, local_slots, cfg.hot),
            remote_off: slot_offset(i, size, slots, cfg.hot),
            len: size,
        });
        let st = s.remote.read_batch(local, descs, &opts)?;
        Ok((st.bytes, st.post_ns, st.complete_ns))
    })?;
    let verified_bytes = verify_case(s, cfg, local, size, slots, local_slots, inflight)?;
    Ok(timed.result(size, inflight, ceiling_gbps, verified_bytes))
}

/// What the timed batches of one case measured.
struct Timed {
    hist: hdrhistogram::Histogram<u64>,
    post_ns: u64,
    complete_ns: u64,
    bytes: u64,
    batches: u64,
    per_batch: u64,
    secs: f64,
}

/// Runs `batch(k)` (batch `k` of `per_batch` reads, returning its bytes, post and completion
/// times) as one case does on every transport: a warm-up (connection set-up, registration
/// caches, page faults: 3 batches, or 20 ms up to one pass over `slots`), then timed batches
/// until `--iters` or `--duration`, or an interrupt (the batches done so far still count).
fn timed_batches(
    cfg: &XferConfig,
    per_batch: u64,
    slots: u64,
    mut batch: impl FnMut(u64) -> Result<(u64, u64, u64)>,
) -> Result<Timed> {
    let mut k: u64 = 0;
    let warm_start = Instant::now();
    while k < per_batch * 3 || (warm_start.elapsed() < Duration::from_millis(20) && k < slots.max(per_batch))
    {
        batch(k)?;
        k += per_batch;
    }
    let hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
        .map_err(|e| XferError::Protocol { stage: "histogram", reason: e.to_string() })?;
    let mut t = Timed { hist, post_ns: 0, complete_ns: 0, bytes: 0, batches: 0, per_batch, secs: 0.0 };
    let start = Instant::now();
    loop {
        let (bytes, post_ns, complete_ns) = batch(k)?;
        k += per_batch;
        t.batches += 1;
        t.bytes += bytes;
        t.post_ns += post_ns;
        t.complete_ns += complete_ns;
        t.hist.saturating_record(complete_ns.max(1));
        let done = match cfg.iters {
            Some(n) => t.batches >= n,
            None => t.batches >= 3 && start.elapsed() >= cfg.duration,
        };
        if done || crate::interrupt::requested().is_some() {
            break;
        }
    }
    t.secs = start.elapsed().as_secs_f64();
    Ok(t)
}

impl Timed {
    fn result(&self, size: u64, inflight: usize, ceiling_gbps: f64, verified_bytes: u64) -> XferResult {
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
            verified_bytes,
        }
    }
}

/// Clears the local slots of one batch, reads them again, and checks every byte against
/// the pattern at the remote offsets they came from.
fn verify_case<M: BufferAccess>(
    s: &Session,
    cfg: &XferConfig,
    local: &mut MemRegion<M>,
    size: u64,
    slots: u64,
    local_slots: u64,
    inflight: usize,
) -> Result<u64> {
    let n = if cfg.hot { 1 } else { (inflight as u64).min(slots).min(local_slots) };
    // Remote slots start mid-way so local and remote offsets differ (catches swapped offsets).
    let descs: Vec<ReadDesc> = (0..n)
        .map(|i| ReadDesc {
            local_off: i * size,
            remote_off: ((i + slots / 2 + 1) % slots) * size,
            len: size,
        })
        .collect();
    for d in &descs {
        local.memory_mut()?.zero(d.local_off as usize, d.len as usize)?;
    }
    s.remote.read_batch(
        local,
        descs.iter().copied(),
        &ReadOptions { max_inflight: inflight, timeout: cfg.timeout },
    )?;
    let mem = local.memory()?;
    for d in &descs {
        let got = mem.read(d.local_off as usize, d.len as usize)?;
        if let Err(off) = check_pattern(&got, d.remote_off, s.hello.pattern_seed) {
            return Err(XferError::Verify(format!(
                "{size}-byte read from remote offset {} into local offset {}: first wrong byte at remote offset {off}",
                d.remote_off, d.local_off
            )));
        }
    }
    Ok(n * size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_checks_catch_shifted_and_damaged_bytes() {
        let mut buf = vec![0u8; 4096 + 13];
        fill_pattern(&mut buf, 7);
        assert_eq!(check_pattern(&buf, 0, 7), Ok(()));
        assert_eq!(check_pattern(&buf[64..128], 64, 7), Ok(()));
        assert_eq!(check_pattern(&buf[3..1000], 3, 7), Ok(()));
        assert_eq!(check_pattern(&buf[64..128], 72, 7), Err(72));
        assert!(check_pattern(&buf[0..64], 0, 8).is_err());
        buf[100] ^= 1;
        assert_eq!(check_pattern(&buf[96..200], 96, 7), Err(96));
        assert_eq!(check_pattern(&buf[97..200], 97, 7), Err(100));
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
