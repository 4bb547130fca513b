//! UCP context and worker, and how kvx progresses a worker without starving a small
//! machine: spin briefly, then block on the worker's event fd.
//!
//! Ownership encodes teardown: a [`Worker`] holds its [`Context`], so `ucp_cleanup` can
//! only run after the last worker (and everything holding a worker) is gone. Handles are
//! `!Send` (`Rc`): workers are created in `UCS_THREAD_MODE_SINGLE`, so every call on one
//! must come from the thread that made it.

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::error::{Result, UcxError};
use super::library::Ucx;
use super::protocols::{self, ProtoReport};
use super::sys::{self, UcpContextH, UcpWorkerH};
use crate::transfer::cuda::CudaDevice;

/// UCX's switch for zero-copy GETs over cuda_ipc. Its default (`auto`) turns them off
/// where UCX sees no NVLink (PCIe machines, one GPU), which leaves a pull (READ) design
/// on a slow path; kvx sets it to `y` for device memory unless the user set it.
pub const CUDA_IPC_GET_ZCOPY_ENV: &str = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";
const CUDA_IPC_GET_ZCOPY_KEY: &str = "CUDA_IPC_ENABLE_GET_ZCOPY";

/// How a waiting kvx thread progresses UCX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ProgressMode {
    /// Call `ucp_worker_progress` in a tight loop (lowest latency, burns a core).
    Busy,
    /// Block on the worker's event fd whenever a progress call finds nothing to do.
    Wait,
    /// Spin for a short while, then block on the event fd (the default).
    #[default]
    Hybrid,
}

impl std::fmt::Display for ProgressMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProgressMode::Busy => "busy",
            ProgressMode::Wait => "wait",
            ProgressMode::Hybrid => "hybrid",
        })
    }
}

/// How long `Hybrid` keeps spinning after the last useful progress call before blocking.
/// A transfer in flight produces events far more often than this, so an active worker
/// keeps spinning (UCX does not signal the event fd for sends it parked on its pending
/// queues, such as the replies of a software-emulated GET); an idle one sleeps after a
/// millisecond, which is what lets ten processes share two cores.
pub const HYBRID_SPIN: Duration = Duration::from_millis(1);
/// Upper bound of one blocking poll. UCX does not signal the event fd for work it left
/// on its own pending queues (e.g. a reply to a software-emulated GET that did not fit
/// the shared-memory FIFO), so a sleeping worker re-progresses at least this often;
/// 1000 wake-ups a second cost an idle process well under 1% of a core.
const WAIT_BLOCK: Duration = Duration::from_millis(1);

/// Options of a UCP context.
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    pub progress: ProgressMode,
    /// `ucp_config_modify` pairs applied on top of the `UCX_*` environment, e.g.
    /// `("TLS", "posix,cma,self")`.
    pub config: Vec<(String, String)>,
    /// Also request active messages (notifications over UCX).
    pub active_messages: bool,
    /// Register device memory of this CUDA device: its primary context is made current
    /// *before* `ucp_init` (UCX's CUDA transports look for it when they open; without it
    /// they fall back to software emulation) and held by the context until after
    /// `ucp_cleanup`. Also sets `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y` unless the user set it.
    pub cuda_device: Option<u32>,
}

/// A UCP context (`ucp_context_h`): the library's per-application state, which owns
/// memory registrations.
#[derive(Clone)]
pub struct Context {
    inner: Rc<ContextInner>,
}

struct ContextInner {
    ucx: Ucx,
    h: UcpContextH,
    progress: ProgressMode,
    active_messages: bool,
    /// Settings kvx chose on the user's behalf, for reports (`NAME=value (why)`).
    env_notes: Vec<String>,
    // Released after `ucp_cleanup` (Drop runs first): UCX's CUDA transports use the
    // context until then.
    cuda: Option<Arc<CudaDevice>>,
}

impl Context {
    pub fn new(ucx: &Ucx, opts: &ContextOptions) -> Result<Context> {
        let cuda = match opts.cuda_device {
            Some(device) => {
                let dev = CudaDevice::open(device)?;
                dev.make_current()?;
                Some(dev)
            }
            None => None,
        };
        let mut settings = opts.config.clone();
        let mut env_notes = Vec::new();
        if cuda.is_some() {
            let in_config = opts.config.iter().any(|(k, _)| k == CUDA_IPC_GET_ZCOPY_KEY);
            match std::env::var(CUDA_IPC_GET_ZCOPY_ENV) {
                Ok(v) => env_notes.push(format!("{CUDA_IPC_GET_ZCOPY_ENV}={v} (from the environment)")),
                Err(_) if in_config => {}
                Err(_) => {
                    settings.push((CUDA_IPC_GET_ZCOPY_KEY.into(), "y".into()));
                    env_notes.push(format!(
                        "{CUDA_IPC_GET_ZCOPY_ENV}=y (set by kvx for device memory; UCX's auto turns cuda_ipc \
                         GET zero-copy off without NVLink)"
                    ));
                }
            }
        }
        let api = ucx.api();
        let mut config: sys::UcpConfigH = std::ptr::null_mut();
        // SAFETY: NULL prefix/file mean "UCX_ environment, no file"; `config` is a valid out pointer.
        ucx.check("ucp_config_read", unsafe {
            (api.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        let config = ConfigGuard { ucx, h: config };
        for (k, v) in &settings {
            let (ck, cv) = (cstring(k)?, cstring(v)?);
            // SAFETY: config is live; both strings are NUL-terminated and outlive the call.
            let st = unsafe { (api.ucp_config_modify)(config.h, ck.as_ptr(), cv.as_ptr()) };
            ucx.check("ucp_config_modify", st)
                .map_err(|e| UcxError::Invalid(format!("UCX rejected config {k}={v}: {e}")))?;
        }
        let mut params: sys::UcpParams = sys::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED;
        params.features = sys::UCP_FEATURE_RMA;
        if opts.progress != ProgressMode::Busy {
            params.features |= sys::UCP_FEATURE_WAKEUP;
        }
        if opts.active_messages {
            params.features |= sys::UCP_FEATURE_AM;
        }
        params.mt_workers_shared = 0;
        let mut h: UcpContextH = std::ptr::null_mut();
        // SAFETY: params is fully initialised with an explicit field mask, config is live,
        // `h` is a valid out pointer. API version 1.13 is what `sys` declares.
        let st = unsafe { (api.ucp_init_version)(1, 13, &params, config.h, &mut h) };
        ucx.check("ucp_init", st)?;
        drop(config);
        let has_cuda = cuda.is_some();
        let ctx = Context {
            inner: Rc::new(ContextInner {
                ucx: ucx.clone(),
                h,
                progress: opts.progress,
                active_messages: opts.active_messages,
                env_notes,
                cuda,
            }),
        };
        if has_cuda {
            let types = ctx.memory_types()?;
            if !types.contains(&"cuda") {
                let info = ucx.info();
                return Err(UcxError::NoCudaSupport {
                    library: info.library.display().to_string(),
                    version: info.version,
                    memory_types: types.join(", "),
                });
            }
        }
        Ok(ctx)
    }

    /// The CUDA device whose memory this context registers, if any.
    pub fn cuda_device(&self) -> Option<&Arc<CudaDevice>> {
        self.inner.cuda.as_ref()
    }

    /// Makes the context's CUDA context current on the calling thread (a no-op for a
    /// host-memory context). Every thread that calls UCX on device memory needs it.
    pub fn bind_cuda(&self) -> Result<()> {
        if let Some(dev) = &self.inner.cuda {
            dev.make_current()?;
        }
        Ok(())
    }

    /// Settings kvx chose for UCX on the user's behalf, as `NAME=value (why)`.
    pub fn env_notes(&self) -> &[String] {
        &self.inner.env_notes
    }

    /// The protocols this process's UCX selected so far (call it after the operations of
    /// interest ran), or why they are unknown. They are recorded only in processes started
    /// with [`protocols::capture_env`] (or by a user who set `UCX_PROTO_INFO` and
    /// `UCX_PROTO_INFO_DIR`).
    pub fn protocols(&self) -> ProtoReport {
        match protocols::capture_dir() {
            Some(dir) => {
                let uses = protocols::summarize(&protocols::read_dir(&dir));
                let note = uses.is_empty().then(|| {
                    format!(
                        "UCX {} reported no protocol selection (UCX 1.13's protocol layer does not report them)",
                        self.inner.ucx.info().version
                    )
                });
                ProtoReport { uses, note }
            }
            None => ProtoReport {
                uses: Vec::new(),
                note: Some(format!(
                    "not recorded: this process was not started with {} and {} set",
                    protocols::PROTO_INFO_ENV,
                    protocols::PROTO_INFO_DIR_ENV
                )),
            },
        }
    }

    pub fn ucx(&self) -> &Ucx {
        &self.inner.ucx
    }

    pub(super) fn handle(&self) -> UcpContextH {
        self.inner.h
    }

    pub fn progress_mode(&self) -> ProgressMode {
        self.inner.progress
    }

    /// Whether the context was created with `UCP_FEATURE_AM`
    /// ([`ContextOptions::active_messages`]), which sending or receiving active messages needs.
    pub fn has_active_messages(&self) -> bool {
        self.inner.active_messages
    }

    /// Memory types this context can register (`ucp_context_query`), e.g. `["host"]`.
    pub fn memory_types(&self) -> Result<Vec<&'static str>> {
        let mut attr: sys::UcpContextAttr = sys::zeroed();
        attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES;
        // SAFETY: live context, attr zeroed with an explicit mask; UCX writes only masked fields.
        let st = unsafe { (self.ucx().api().ucp_context_query)(self.inner.h, &mut attr) };
        self.ucx().check("ucp_context_query", st)?;
        const NAMES: [&str; 10] = [
            "host",
            "cuda",
            "cuda-managed",
            "rocm",
            "rocm-managed",
            "rdma",
            "ze-host",
            "ze-device",
            "ze-managed",
            "gaudi",
        ];
        Ok(NAMES
            .iter()
            .enumerate()
            .filter(|(i, _)| attr.memory_types & (1 << i) != 0)
            .map(|(_, n)| *n)
            .collect())
    }

    /// `ucp_context_print_info` as text (resources, transports, devices).
    pub fn print_info(&self) -> Result<String> {
        // SAFETY: live context; the stream is valid for the duration of the call.
        capture(|f| unsafe { (self.ucx().api().ucp_context_print_info)(self.inner.h, f) })
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: the last owner of the context; workers hold a `Context`, so none is left.
        unsafe { (self.ucx.api().ucp_cleanup)(self.h) };
    }
}

struct ConfigGuard<'a> {
    ucx: &'a Ucx,
    h: sys::UcpConfigH,
}

impl Drop for ConfigGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_config_read and is released exactly once.
        unsafe { (self.ucx.api().ucp_config_release)(self.h) };
    }
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| UcxError::Invalid(format!("{s:?} contains a NUL byte")))
}

/// Runs a UCX print function into an in-memory stream and returns what it wrote.
pub(super) fn capture(print: impl FnOnce(*mut sys::CFile)) -> Result<String> {
    let mut buf: *mut c_char = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: both out pointers are valid; the stream owns `buf` until fclose.
    let f = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if f.is_null() {
        return Err(UcxError::Io { op: "open_memstream", source: std::io::Error::last_os_error() });
    }
    print(f);
    // SAFETY: `f` is the open stream from above, closed exactly once; afterwards `buf`
    // holds `size` bytes allocated with malloc, which we copy and free.
    let text = unsafe {
        libc::fclose(f);
        let bytes = if buf.is_null() {
            Vec::new()
        } else {
            std::slice::from_raw_parts(buf.cast::<u8>(), size).to_vec()
        };
        libc::free(buf.cast());
        bytes
    };
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// A UCP worker (`ucp_worker_h`): one progress engine, single-threaded.
#[derive(Clone)]
pub struct Worker {
    inner: Rc<WorkerInner>,
}

struct WorkerInner {
    h: UcpWorkerH,
    efd: Option<RawFd>,
    progress: ProgressMode,
    /// Active-message ids with a live [`super::AmReceiver`]: UCX keeps one handler per
    /// id, so a second receiver would silently steal the first one's messages.
    am_ids: RefCell<Vec<u16>>,
    // Dropped after `h` is destroyed (see Drop): keeps ucp_cleanup after ucp_worker_destroy.
    ctx: Context,
}

/// Why [`Worker::serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeEnd {
    /// The stop fd became readable (or hung up).
    Stopped,
    /// The deadline passed.
    TimedOut,
}

impl Worker {
    pub fn new(ctx: &Context) -> Result<Worker> {
        ctx.bind_cuda()?;
        let ucx = ctx.ucx();
        let mut params: sys::UcpWorkerParams = sys::zeroed();
        params.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut h: UcpWorkerH = std::ptr::null_mut();
        // SAFETY: live context, params zeroed with an explicit mask, valid out pointer.
        ucx.check("ucp_worker_create", unsafe {
            (ucx.api().ucp_worker_create)(ctx.handle(), &params, &mut h)
        })?;
        let mut worker = WorkerInner {
            h,
            efd: None,
            progress: ctx.progress_mode(),
            am_ids: RefCell::new(Vec::new()),
            ctx: ctx.clone(),
        };
        if worker.progress != ProgressMode::Busy {
            let mut fd: c_int = -1;
            // SAFETY: live worker created with UCP_FEATURE_WAKEUP; valid out pointer.
            let st = unsafe { (ucx.api().ucp_worker_get_efd)(h, &mut fd) };
            ucx.check("ucp_worker_get_efd", st)?;
            worker.efd = Some(fd);
        }
        Ok(Worker { inner: Rc::new(worker) })
    }

    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub fn ucx(&self) -> &Ucx {
        self.inner.ctx.ucx()
    }

    pub(super) fn handle(&self) -> UcpWorkerH {
        self.inner.h
    }

    pub fn progress_mode(&self) -> ProgressMode {
        self.inner.progress
    }

    /// Reserves an active-message id for one receiver; `false` if it is taken.
    pub(super) fn claim_am_id(&self, id: u16) -> bool {
        let mut ids = self.inner.am_ids.borrow_mut();
        if ids.contains(&id) {
            return false;
        }
        ids.push(id);
        true
    }

    pub(super) fn release_am_id(&self, id: u16) {
        self.inner.am_ids.borrow_mut().retain(|&i| i != id);
    }

    /// The worker's address, to hand to a peer out of band.
    pub fn address(&self) -> Result<Vec<u8>> {
        let api = self.ucx().api();
        let mut addr: *mut sys::UcpAddress = std::ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: live worker; valid out pointers.
        let st = unsafe { (api.ucp_worker_get_address)(self.inner.h, &mut addr, &mut len) };
        self.ucx().check("ucp_worker_get_address", st)?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len).to_vec() };
        // SAFETY: `addr` came from ucp_worker_get_address on this worker.
        unsafe { (api.ucp_worker_release_address)(self.inner.h, addr) };
        Ok(bytes)
    }

    /// `ucp_worker_print_info` as text.
    pub fn print_info(&self) -> Result<String> {
        // SAFETY: live worker; the stream is valid for the call.
        capture(|f| unsafe { (self.ucx().api().ucp_worker_print_info)(self.inner.h, f) })
    }

    /// One `ucp_worker_progress` call; returns the number of events processed.
    #[inline]
    pub fn progress(&self) -> u32 {
        // SAFETY: live worker, called from its owning thread (the handle is !Send).
        unsafe { (self.ucx().api().ucp_worker_progress)(self.inner.h) }
    }

    /// Progresses until `done()` is true or `deadline` passes (`Ok(false)`), spinning
    /// and blocking as the progress mode says.
    pub fn wait_until(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> Result<bool> {
        let mut idle = IdleClock::default();
        loop {
            if done() {
                return Ok(true);
            }
            if self.progress() > 0 {
                idle.reset();
                continue;
            }
            if done() {
                return Ok(true);
            }
            let Some(now) = idle.tick() else { continue };
            if now >= deadline {
                return Ok(false);
            }
            if idle.should_block(self.inner.progress, now) {
                self.block(None, deadline.saturating_duration_since(now).min(WAIT_BLOCK))?;
            }
        }
    }

    /// Keeps the worker progressing (serving one-sided reads that UCX emulates in
    /// software) until `stop` is readable or `deadline` passes.
    pub fn serve(&self, stop: RawFd, deadline: Option<Instant>) -> Result<ServeEnd> {
        let mut idle = IdleClock::default();
        let mut checks: u32 = 0;
        loop {
            if self.progress() > 0 {
                idle.reset();
                continue;
            }
            let Some(now) = idle.tick() else { continue };
            if deadline.is_some_and(|d| now >= d) {
                return Ok(ServeEnd::TimedOut);
            }
            let remaining = deadline.map_or(WAIT_BLOCK, |d| d.saturating_duration_since(now).min(WAIT_BLOCK));
            if idle.should_block(self.inner.progress, now) {
                if self.block(Some(stop), remaining)? {
                    return Ok(ServeEnd::Stopped);
                }
            } else {
                checks = checks.wrapping_add(1);
                if checks.is_multiple_of(64) && poll_fds(&mut [pollfd(stop)], Duration::ZERO)? > 0 {
                    return Ok(ServeEnd::Stopped);
                }
            }
        }
    }

    /// The worker's event fd (absent in busy progress mode), for callers that wait on it
    /// together with their own sockets; call [`Worker::arm`] before every wait.
    pub fn event_fd(&self) -> Option<RawFd> {
        self.inner.efd
    }

    /// Arms the event fd for the next wait. `Ok(false)`: events are already pending, so
    /// progress again instead of waiting (`UCS_ERR_BUSY`).
    pub fn arm(&self) -> Result<bool> {
        if self.inner.efd.is_none() {
            return Ok(false);
        }
        // SAFETY: live worker with an event fd, called from its owning thread.
        let st = unsafe { (self.ucx().api().ucp_worker_arm)(self.inner.h) };
        if st == sys::UCS_ERR_BUSY {
            return Ok(false);
        }
        self.ucx().check("ucp_worker_arm", st)?;
        Ok(true)
    }

    /// Arms the worker and sleeps on its event fd (and `extra`) for at most `timeout`.
    /// Returns whether `extra` is readable.
    fn block(&self, extra: Option<RawFd>, timeout: Duration) -> Result<bool> {
        let Some(efd) = self.inner.efd else {
            return match extra {
                Some(fd) => Ok(poll_fds(&mut [pollfd(fd)], Duration::ZERO)? > 0),
                None => Ok(false),
            };
        };
        // SAFETY: live worker with an event fd.
        let st = unsafe { (self.ucx().api().ucp_worker_arm)(self.inner.h) };
        if st == sys::UCS_ERR_BUSY {
            // Events arrived between the last progress call and arming: progress again.
            return match extra {
                Some(fd) => Ok(poll_fds(&mut [pollfd(fd)], Duration::ZERO)? > 0),
                None => Ok(false),
            };
        }
        self.ucx().check("ucp_worker_arm", st)?;
        let mut fds = [pollfd(efd), pollfd(extra.unwrap_or(-1))];
        let n = if extra.is_some() { 2 } else { 1 };
        poll_fds(&mut fds[..n], timeout)?;
        Ok(extra.is_some() && fds[1].revents != 0)
    }
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: last owner of the worker; endpoints and requests hold a `Worker`, so none
        // is left. The context (a field) is dropped after this, so it is still live here.
        unsafe { (self.ctx.ucx().api().ucp_worker_destroy)(self.h) };
    }
}

/// Tracks how long a worker has been idle while reading the clock only every
/// [`IdleClock::EVERY`] idle progress calls: a clock read costs as much as an empty
/// progress call, and the spin loop is on the path of every completion.
#[derive(Default)]
struct IdleClock {
    idle_calls: u32,
    since: Option<Instant>,
}

impl IdleClock {
    const EVERY: u32 = 32;

    fn reset(&mut self) {
        self.idle_calls = 0;
        self.since = None;
    }

    /// `Some(now)` on every `EVERY`-th idle call.
    fn tick(&mut self) -> Option<Instant> {
        self.idle_calls = self.idle_calls.wrapping_add(1);
        if !self.idle_calls.is_multiple_of(Self::EVERY) {
            return None;
        }
        let now = Instant::now();
        self.since.get_or_insert(now);
        Some(now)
    }

    fn should_block(&self, mode: ProgressMode, now: Instant) -> bool {
        match mode {
            ProgressMode::Busy => false,
            ProgressMode::Wait => true,
            ProgressMode::Hybrid => self.since.is_some_and(|s| now.duration_since(s) >= HYBRID_SPIN),
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// `poll(2)` over `fds`, retrying on EINTR; returns the number of ready fds.
pub(crate) fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> Result<usize> {
    let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
    // Round sub-millisecond waits up so a short remaining time still sleeps.
    let ms = if ms == 0 && !timeout.is_zero() { 1 } else { ms };
    loop {
        // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(UcxError::Io { op: "poll on the UCX event fd", source: err });
        }
    }
}

/// Waits until `fd` is readable (or hung up) or `timeout` passes; returns whether it is.
/// A safe `poll(2)` for the socket loops around UCX (accepting a control connection).
pub fn wait_readable(fd: RawFd, timeout: Duration) -> Result<bool> {
    Ok(poll_fds(&mut [pollfd(fd)], timeout)? > 0)
}

/// Asks the kernel not to let the calling thread preempt the one that woke it (`SCHED_BATCH`),
/// for a process that sleeps on its worker's event fd and is woken by every notification.
///
/// On a host where the waker and the sleeper share cores, a normal wakeup runs the sleeper at
/// once, in the middle of the waker's loop; with `SCHED_BATCH` the sleeper's work can wait for
/// the waker's time slice, and its share of the CPU is unchanged. No crate kvx uses wraps
/// `sched_setscheduler(2)`, so it lives here, behind this safe function.
pub fn defer_wakeups() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 names the calling thread; `param` is a valid sched_param (priority 0, as
    // SCHED_BATCH requires) that outlives the call, which only reads it.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Makes SIGINT do nothing in this process (`SIG_IGN`: no handler runs, so no system call of
/// UCX, ZMQ or kvx is interrupted with `EINTR`). Worker processes call it: Ctrl-C at a
/// terminal signals the whole process group, and the engine that started a worker stops it.
/// A handler that only sets a flag would still interrupt every blocking wait, and no crate
/// kvx uses sets `SIG_IGN` without `unsafe`, so it lives here, behind this safe function.
pub fn ignore_sigint() -> std::io::Result<()> {
    // SAFETY: SIG_IGN installs no handler code, so nothing can run in signal context; the
    // previous disposition is not needed.
    let prev = unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    if prev == libc::SIG_ERR { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}
