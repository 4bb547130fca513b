//! The two processes of `kvx xfer` meeting: the control connection (a TCP stream carrying
//! length-prefixed msgpack frames: the request, the target's hello with its worker address,
//! region base and packed rkey, then stop/resume), starting a local target (kvx re-executes
//! itself with a hidden role) or reaching a remote one, and the initiator's UCX [`Session`]
//! on the target's region.
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{Result, XferError};
use crate::config::xfer::SessionOptions;
use crate::config::xfer::TargetOptions;
use crate::transfer::handshake::meta::CudaIpcExport;
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{
    Context, ContextOptions, Endpoint, ErrMode, LibInfo, PROTO_INFO_DIR_ENV, PROTO_INFO_ENV, PackedRkey,
    ProgressMode, RemoteRegion, Ucx, Worker, wait_readable,
};

/// Largest control frame accepted (worker addresses and rkeys are a few hundred bytes).
pub(super) const MAX_FRAME: usize = 1 << 20;
/// How long a spawned target may take to start, load UCX and connect back.
pub(super) const TARGET_START_TIMEOUT: Duration = Duration::from_secs(30);
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
    /// `--transport nixl`: register the region with a NIXL agent and send its metadata (the
    /// target then loads NIXL, not kvx's UCX).
    #[serde(default)]
    pub nixl: bool,
    /// `--nixl-progress-thread`, for the target's agent.
    #[serde(default)]
    pub nixl_progress_thread: bool,
    /// `--err-mode`, for the target's NIXL agent.
    #[serde(default)]
    pub nixl_err_mode: ErrMode,
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

/// What a NIXL target sends back: its agent's metadata and where its region is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NixlHello {
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    pub base: u64,
    pub len: u64,
    pub dev: u64,
    pub pid: u32,
    pub pattern_seed: u64,
    pub nixl: crate::transfer::nixl::NixlInfo,
}

/// What a cuda-batch target sends back: its device buffer exported for CUDA IPC.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchHello {
    pub export: CudaIpcExport,
    pub pid: u32,
    pub pattern_seed: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum TargetReply {
    Ready(Box<TargetHello>),
    ReadyBatch(Box<BatchHello>),
    ReadyNixl(Box<NixlHello>),
    Failed(String),
}

/// Initiator to target, after the hello.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum Control {
    /// Start progressing (after a non-progressing start).
    Resume,
    /// Tear down and exit.
    Stop,
}

pub(super) fn write_frame<T: Serialize>(s: &mut TcpStream, stage: &'static str, msg: &T) -> Result<()> {
    let body =
        rmp_serde::to_vec_named(msg).map_err(|e| XferError::Protocol { stage, reason: e.to_string() })?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    s.write_all(&frame).map_err(|source| XferError::Control { stage, source })
}

pub(super) fn read_frame<T: for<'de> Deserialize<'de>>(
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

pub(super) fn accept_with_timeout(
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

/// The UCX context of either role: its progress mode and settings, with the device's CUDA
/// context current when the memory is a GPU's.
pub(super) fn context(
    ucx: &Ucx,
    progress: ProgressMode,
    config: &[(String, String)],
    mem: MemPlace,
) -> Result<Context> {
    let opts =
        ContextOptions { progress, config: config.to_vec(), cuda_device: mem.device(), ..Default::default() };
    Ok(Context::new(ucx, &opts)?)
}

/// A target process this process started, with its control stream.
pub struct LocalTarget {
    pub child: Child,
    pub stream: TcpStream,
}

impl LocalTarget {
    /// Starts `exe xfer --xfer-role target` connected back over loopback.
    pub fn spawn(exe: &Path, opts: &TargetOptions, env: &[(String, String)]) -> Result<LocalTarget> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .map_err(|source| XferError::Control { stage: "bind loopback", source })?;
        let addr =
            listener.local_addr().map_err(|source| XferError::Control { stage: "bind loopback", source })?;
        let mut cmd = Command::new(exe);
        cmd.arg("xfer").arg("--xfer-role").arg("target").arg("--connect-back").arg(addr.to_string());
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
        // A process group of its own: a terminal's Ctrl-C (or a signal to the initiator's
        // group) reaches the initiator only, which stops measuring and then stops the target;
        // killed first, the target would fail the reads in flight.
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::inherit()).process_group(0);
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

impl Session {
    /// Sends `req` over `stream`, receives the target's hello, connects and unpacks its key.
    pub fn establish(mut stream: TcpStream, req: &TargetRequest, opts: &SessionOptions) -> Result<Session> {
        let ucx = Ucx::load(opts.ucx_lib.as_deref())?;
        write_frame(&mut stream, "initiator: send request", req)?;
        let hello = match read_frame(&mut stream, "initiator: read hello", TARGET_START_TIMEOUT)? {
            TargetReply::Ready(h) => *h,
            TargetReply::Failed(msg) => return Err(XferError::Target(msg)),
            TargetReply::ReadyBatch(_) | TargetReply::ReadyNixl(_) => {
                return Err(XferError::Protocol {
                    stage: "initiator: read hello",
                    reason: "the target served CUDA IPC memory or a NIXL agent, not a UCX region".into(),
                });
            }
        };
        let ctx = context(&ucx, opts.progress, &opts.ucx_config, req.mem)?;
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
