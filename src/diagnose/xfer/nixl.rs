//! `kvx xfer --transport nixl`: the same cases, moved by NIXL (the library vLLM's
//! NixlConnector uses) through its C API, as vLLM's worker drives it.
//!
//! The target registers its region with a NIXL agent (UCX backend, progress thread, as vLLM
//! creates one) and sends the agent's metadata; the initiator loads it, prepares one list of
//! its local slots and one of the target's slots per case (vLLM prepares per region and
//! block at registration and handshake), and runs each batch as one transfer request made
//! from descriptor ids (`make_xfer_req`), posted, polled to completion and released, which
//! is vLLM's per-request path; `--nixl-requests reuse` makes each distinct batch's request
//! once, before the timed batches, and posts it again (NIXL's own benchmark's way), which
//! leaves NIXL's transfer without its per-request set-up. kvx's clock around `make_xfer_req`
//! and the release says what the set-up costs. NIXL is asked not to merge descriptors, so each
//! read stays one GET as with `--transport ucx`; the report says so. Verification is the UCX
//! cases' own.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::buffers::{BufferAccess, region_len};
use super::control::{
    Control, LocalTarget, NixlHello, PATTERN_SEED, TARGET_START_TIMEOUT, TargetReply, TargetRequest,
    connect_target, read_frame, write_frame,
};
use super::measure::{
    BatchTimes, CaseRunner, Ceiling, ReadLayout, check_destinations, clear_destinations, timed_batches,
};
use super::{Result, XferError, end_local_target, estimate_secs};
use crate::config::xfer::{NixlOptions, NixlRequests, TargetOptions, TargetSpec, XferConfig};
use crate::report::xfer::{
    CeilingKind, MemoryReport, Residency, UcxReport, XferMemory, XferNixlReport, XferReport, XferResult,
    verification_rule,
};
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::memory::{HostBuffer, MemPlace, PageSize};
use crate::transfer::nixl::{Agent, AgentOptions, Desc, Nixl, Op, Prepped, Region, Xfer, XferState};
use crate::transfer::ucx::{ErrMode, MemType, ProtoReport};

/// The target's registered region (kept until the initiator says stop).
pub(super) enum Served {
    Host(Region<HostBuffer>),
    Cuda(Region<CudaBuffer>),
}

impl Served {
    fn len(&self) -> usize {
        match self {
            Served::Host(r) => r.len(),
            Served::Cuda(r) => r.len(),
        }
    }
}

fn pages(huge: bool) -> PageSize {
    if huge { PageSize::Huge } else { PageSize::Normal }
}

/// The target side: an agent, a region filled with the pattern, its metadata.
pub(super) fn prepare_target(req: &TargetRequest) -> Result<(NixlHello, Agent, Served)> {
    let nixl = Nixl::load()?;
    let agent = Agent::new(
        &nixl,
        &format!("kvx-xfer-target-{}", std::process::id()),
        &agent_options(req.nixl_progress_thread, req.nixl_err_mode),
    )?;
    let len = region_len(req)?;
    let (served, base, dev) = match req.mem {
        MemPlace::Host => {
            let mut buf = HostBuffer::alloc(len, pages(req.huge_pages))?;
            buf.fill_with_pattern(PATTERN_SEED)?;
            let r = agent.register(buf, 0)?;
            let base = r.addr();
            (Served::Host(r), base, 0)
        }
        MemPlace::Cuda { device } => {
            let d = CudaDevice::open(device)?;
            let mut buf = CudaBuffer::alloc(&d, len)?;
            buf.fill_with_pattern(PATTERN_SEED)?;
            let r = agent.register(buf, u64::from(device))?;
            let base = r.addr();
            (Served::Cuda(r), base, u64::from(device))
        }
    };
    let hello = NixlHello {
        agent_metadata: agent.local_metadata()?,
        base,
        len: len as u64,
        dev,
        pid: std::process::id(),
        pattern_seed: PATTERN_SEED,
        nixl: nixl.info().clone(),
    };
    Ok((hello, agent, served))
}

/// Serves until the initiator says stop, the stream closes, or the serve time runs out. The
/// agent's progress thread answers the initiator; draining notifications progresses it too.
pub(super) fn serve_target(
    stream: &mut TcpStream,
    req: &TargetRequest,
    agent: Agent,
    served: Served,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(req.max_serve_secs.max(1));
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            break;
        }
        match read_frame::<Control>(stream, "target: read control", remaining.min(Duration::from_millis(100)))
        {
            Ok(Control::Stop) => break,
            Ok(Control::Resume) => {}
            Err(XferError::Control { source, .. })
                if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                let _ = agent.notifs();
            }
            Err(XferError::Control { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    tracing::debug!(region = served.len(), "NIXL target done");
    drop(served);
    drop(agent);
    Ok(())
}

/// The initiator: starts or reaches the target, measures every case through NIXL.
pub(super) fn run(
    cfg: &XferConfig,
    opts: NixlOptions,
    target: &TargetSpec,
    on_result: impl FnMut(&XferResult),
) -> Result<XferReport> {
    // A host without NIXL is told so before a target process starts.
    let nixl = Nixl::load()?;
    let max_size = cfg.sizes.iter().copied().max().unwrap_or(4096);
    let ws = if cfg.hot { max_size } else { cfg.working_set_bytes.max(max_size) };
    let req = TargetRequest {
        region_bytes: ws + cfg.misalign.remote_bytes,
        ucx_alloc: false,
        huge_pages: cfg.huge_pages,
        mem: cfg.mem,
        progress: true,
        max_serve_secs: estimate_secs(cfg) + 600,
        cuda_batch: false,
        nixl: true,
        nixl_progress_thread: opts.progress_thread,
        nixl_err_mode: cfg.session.err_mode,
    };
    let (mut child, mut stream) = match target {
        TargetSpec::Local { exe } => {
            let t = LocalTarget::spawn(
                exe,
                &TargetOptions { ucx_lib: None, progress: cfg.session.progress, ucx_config: vec![] },
                &[],
            )?;
            (Some(t.child), t.stream)
        }
        TargetSpec::Remote { addr } => (None, connect_target(addr, cfg.peer_timeout)?),
    };
    let outcome = (|| {
        write_frame(&mut stream, "initiator: send request", &req)?;
        let hello = match read_frame(&mut stream, "initiator: read hello", TARGET_START_TIMEOUT)? {
            TargetReply::ReadyNixl(h) => *h,
            TargetReply::Failed(msg) => return Err(XferError::Target(msg)),
            _ => {
                return Err(XferError::Protocol {
                    stage: "initiator: read hello",
                    reason: "the target did not serve NIXL".into(),
                });
            }
        };
        let report = measure(&nixl, cfg, opts, &hello, ws, on_result);
        let _ = write_frame(&mut stream, "initiator: stop", &Control::Stop);
        report
    })();
    match child.as_mut() {
        Some(c) => end_local_target(c, outcome),
        None => outcome,
    }
}

/// The agent's options in kvx xfer: vLLM's (progress thread, telemetry, UCX backend).
fn agent_options(progress_thread: bool, err_mode: ErrMode) -> AgentOptions {
    AgentOptions { progress_thread, err_mode, ..AgentOptions::default() }
}

fn measure(
    nixl: &Nixl,
    cfg: &XferConfig,
    nixl_opts: NixlOptions,
    hello: &NixlHello,
    ws: u64,
    on_result: impl FnMut(&XferResult),
) -> Result<XferReport> {
    let opts = agent_options(nixl_opts.progress_thread, cfg.session.err_mode);
    let agent = Agent::new(nixl, &format!("kvx-xfer-initiator-{}", std::process::id()), &opts)?;
    let remote = agent.load_remote(&hello.agent_metadata)?;
    let local_len = (ws + cfg.misalign.local_bytes) as usize;
    let mut ceiling = Ceiling::new(cfg.mem, ws, pages(cfg.huge_pages))?;
    let (results, page_size) = match cfg.mem {
        MemPlace::Host => {
            let mut buf = HostBuffer::alloc(local_len, pages(cfg.huge_pages))?;
            // As `--transport ucx`'s destination: page faults happen now, not inside the
            // timed reads (a cold run's reads would otherwise each fault in fresh pages).
            buf.prefault();
            let got = buf.page_size();
            let mut region = agent.register(buf, 0)?;
            (
                cases(
                    &agent,
                    &remote,
                    &mut region,
                    hello,
                    cfg,
                    nixl_opts.requests,
                    ws,
                    &mut ceiling,
                    on_result,
                )?,
                got,
            )
        }
        MemPlace::Cuda { device } => {
            let d = CudaDevice::open(device)?;
            let mut region = agent.register(CudaBuffer::alloc(&d, local_len)?, u64::from(device))?;
            let got = cases(
                &agent,
                &remote,
                &mut region,
                hello,
                cfg,
                nixl_opts.requests,
                ws,
                &mut ceiling,
                on_result,
            )?;
            (got, PageSize::Normal)
        }
    };
    let backend = agent.backend_info()?;
    let info = nixl.info();
    let bundled_ucx = info.bundled_ucx.as_ref().map(|p| p.display().to_string());
    Ok(XferReport {
        ucx: UcxReport {
            library: bundled_ucx.clone().unwrap_or_else(|| "(NIXL's own UCX, not found)".into()),
            version: String::new(),
            transports: format!("nixl/{}", opts.backend),
            source: "NIXL wheel".into(),
            err_mode: cfg.session.err_mode,
            progress: cfg.session.progress,
            target_library: hello.nixl.library.display().to_string(),
            target_version: hello.nixl.version.clone().unwrap_or_default(),
            protocols: ProtoReport {
                uses: Vec::new(),
                note: Some("NIXL's UCX chooses its own protocols; kvx does not record them".into()),
            },
            env: Vec::new(),
        },
        memory: MemoryReport {
            kind: XferMemory::of(cfg.mem, false),
            device: cfg.mem.device(),
            huge_pages: cfg.huge_pages,
            pages: page_size.to_string(),
            working_set_bytes: ws,
            residency: Residency::of(cfg.hot),
        },
        ceiling: CeilingKind::over(cfg.mem),
        warnings: Vec::new(),
        results,
        transport: "nixl".into(),
        cuda_batch: None,
        nixl: Some(XferNixlReport {
            library: info.library.display().to_string(),
            version: info.version.clone(),
            bundled_ucx,
            bundled_ucx_version: nixl.bundled_ucx_version(),
            backend: opts.backend.clone(),
            backend_params: backend.params,
            progress_thread: opts.progress_thread,
            desc_merge: false,
            requests: nixl_opts.requests,
            per_batch: match nixl_opts.requests {
                NixlRequests::PerBatch => {
                    "make_xfer_req on two prepared lists (descriptor ids), post, poll get_xfer_status to DONE, \
                     release (--nixl-requests per-batch, as vLLM's worker per READ)"
                }
                NixlRequests::Reuse => {
                    "post a request made before the timed batches (make_xfer_req once per distinct batch, \
                     --nixl-requests reuse, as NIXL's own benchmark), poll get_xfer_status to DONE"
                }
            }
            .into(),
        }),
        verification: verification_rule(),
        misalign: cfg.misalign,
    })
}

#[expect(clippy::too_many_arguments, reason = "one measurement's parts, all needed")]
fn cases<M: BufferAccess>(
    agent: &Agent,
    remote: &str,
    region: &mut Region<M>,
    hello: &NixlHello,
    cfg: &XferConfig,
    requests: NixlRequests,
    ws: u64,
    ceiling: &mut Ceiling,
    mut on_result: impl FnMut(&XferResult),
) -> Result<Vec<XferResult>> {
    let mem = if region.is_device() { MemType::Cuda } else { MemType::Host };
    let remote_ws = ws.min(hello.len.saturating_sub(cfg.misalign.remote_bytes));
    let mut results = Vec::new();
    for &size in &cfg.sizes {
        for &inflight in &cfg.inflight {
            if crate::interrupt::requested().is_some() {
                return Ok(results);
            }
            let ceiling_gbps = ceiling.measure(size, inflight, ws, cfg)?;
            let layout = ReadLayout::of_case(cfg, size, remote_ws, region.len() as u64, false);
            let slots = |n: u64, base: u64, shift: u64, dev: u64| {
                let n = if cfg.hot { 1 } else { n };
                (0..n).map(|i| Desc { addr: base + shift + i * size, len: size, dev }).collect::<Vec<_>>()
            };
            let lp = agent.prep_local(
                &slots(layout.local_slots, region.addr(), cfg.misalign.local_bytes, region.dev()),
                mem,
            )?;
            let rp = agent.prep_remote(
                remote,
                &slots(layout.remote_slots, hello.base, cfg.misalign.remote_bytes, hello.dev),
                mem,
            )?;
            let mut case = NixlCase {
                agent,
                region: &mut *region,
                layout,
                per_batch: inflight as u64,
                local: lp,
                remote: rp,
                seed: hello.pattern_seed,
                timeout: cfg.timeout,
                scratch: Vec::new(),
                ids: (Vec::new(), Vec::new()),
                reused: (requests == NixlRequests::Reuse).then(HashMap::new),
            };
            case.make_ahead(layout.remote_slots)?;
            let timed = timed_batches(cfg, inflight as u64, layout.remote_slots, &mut case)?;
            let mut r = timed.result(size, inflight, ceiling_gbps);
            r.set_bulk(ceiling.bulk(size * inflight as u64, ws, cfg)?);
            on_result(&r);
            results.push(r);
        }
    }
    Ok(results)
}

/// A NIXL case: each batch one transfer request of `per_batch` descriptor ids.
struct NixlCase<'a, M: BufferAccess> {
    agent: &'a Agent,
    region: &'a mut Region<M>,
    layout: ReadLayout,
    per_batch: u64,
    local: Prepped,
    remote: Prepped,
    seed: u64,
    timeout: Duration,
    scratch: Vec<u8>,
    ids: (Vec<i32>, Vec<i32>),
    /// `--nixl-requests reuse`: each distinct batch's request, by its first read's local and
    /// remote slot (which fix the whole batch: reads are consecutive and wrap together).
    reused: Option<HashMap<(i32, i32), Xfer>>,
}

/// Requests `--nixl-requests reuse` makes before the timed batches, at most; a batch beyond
/// them makes its own the first time it runs (its make time counted).
const MAKE_AHEAD_MAX: u64 = 1 << 16;

impl<M: BufferAccess> NixlCase<'_, M> {
    fn slot(&self, off: u64, shift: u64) -> i32 {
        if self.layout.hot { 0 } else { ((off - shift) / self.layout.size) as i32 }
    }

    /// Batch `k`'s descriptor ids, into `l` and `r` (cleared first); its bytes.
    fn ids_of(&self, k: u64, l: &mut Vec<i32>, r: &mut Vec<i32>) -> u64 {
        l.clear();
        r.clear();
        let mut bytes = 0;
        for d in self.layout.batch(k, self.per_batch) {
            l.push(self.slot(d.local_off, self.layout.shift.local_bytes));
            r.push(self.slot(d.remote_off, self.layout.shift.remote_bytes));
            bytes += d.len;
        }
        bytes
    }

    /// `--nixl-requests reuse`: makes the requests of one pass over `slots` reads (at most
    /// [`MAKE_AHEAD_MAX`]), outside the measured time.
    fn make_ahead(&mut self, slots: u64) -> Result<()> {
        let Some(mut made) = self.reused.take() else { return Ok(()) };
        let (mut l, mut r) = (Vec::new(), Vec::new());
        let batches = slots.div_ceil(self.per_batch).min(MAKE_AHEAD_MAX);
        for b in 0..batches {
            self.ids_of(b * self.per_batch, &mut l, &mut r);
            if let std::collections::hash_map::Entry::Vacant(v) = made.entry((l[0], r[0])) {
                v.insert(self.agent.make_xfer(Op::Read, &self.local, &l, &self.remote, &r, None, false)?);
            }
        }
        self.reused = Some(made);
        Ok(())
    }
}

impl<M: BufferAccess> CaseRunner for NixlCase<'_, M> {
    fn batch(&mut self, k: u64) -> Result<BatchTimes> {
        let (mut l, mut r) = std::mem::take(&mut self.ids);
        let bytes = self.ids_of(k, &mut l, &mut r);
        let t0 = Instant::now();
        let mut fresh: Option<Xfer> = None;
        let make = |agent: &Agent, local: &Prepped, remote: &Prepped| {
            agent.make_xfer(Op::Read, local, &l, remote, &r, None, false)
        };
        let mut made = true;
        let x: &mut Xfer = match self.reused.as_mut() {
            Some(reused) => match reused.entry((l[0], r[0])) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    made = false;
                    e.into_mut()
                }
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(make(self.agent, &self.local, &self.remote)?)
                }
            },
            None => fresh.insert(make(self.agent, &self.local, &self.remote)?),
        };
        // At least 1 ns where a request was made, so that a NIXL case always says.
        let make_ns = if made { (t0.elapsed().as_nanos() as u64).max(1) } else { 0 };
        let mut st = x.post()?;
        let post_ns = t0.elapsed().as_nanos() as u64;
        while st == XferState::InProgress {
            if t0.elapsed() > self.timeout {
                return Err(XferError::Verify(format!(
                    "a NIXL transfer of {} reads did not complete within {:?}",
                    self.per_batch, self.timeout
                )));
            }
            st = x.status()?;
        }
        let complete_ns = t0.elapsed().as_nanos() as u64;
        let tel = x.telemetry().unwrap_or_default();
        let t_release = Instant::now();
        drop(fresh);
        let release_ns = if self.reused.is_some() { 0 } else { t_release.elapsed().as_nanos() as u64 };
        self.ids = (l, r);
        Ok(BatchTimes {
            bytes,
            post_ns,
            complete_ns,
            nixl_post_ns: tel.post_us * 1000,
            nixl_xfer_ns: tel.xfer_us * 1000,
            nixl_make_ns: make_ns,
            nixl_release_ns: release_ns,
            ..BatchTimes::default()
        })
    }
    fn clear(&mut self, k: u64) -> Result<()> {
        clear_destinations(self.region.memory_mut(), &self.layout.checks(k, self.per_batch))
    }
    fn check(&mut self, k: u64) -> Result<u64> {
        let checks = self.layout.checks(k, self.per_batch);
        check_destinations(self.region.memory(), &checks, self.seed, "NIXL read", &mut self.scratch)
    }
}
