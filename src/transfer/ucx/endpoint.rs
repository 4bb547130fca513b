//! Endpoints, unpacked remote keys and the batches of one-sided GETs the pipeline posts
//! (from one remote region, or interleaved over several).
//!
//! Ownership: an [`Endpoint`] holds its [`Worker`]; a [`RemoteRegion`] (unpacked rkey +
//! the peer's base address and length) holds its endpoint, because rkeys are per
//! endpoint. A batch read borrows the local region mutably for as long as any GET of the
//! batch may still write into it; if the wait times out, the region is poisoned instead
//! (see `region.rs`).

use std::cell::Cell;
use std::ffi::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::context::Worker;
use super::error::{Result, UcxError};
use super::protocols::Rma;
use super::region::{MemRegion, PackedRkey, Registrable};
use super::sys::{self, UcpEpH, UcpRkeyH, UcsStatus};

/// UCX's error-handling mode for an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ErrMode {
    /// No peer-failure handling: all transports, shared memory included (UCX's default).
    #[default]
    None,
    /// Peer failures complete requests with an error; UCX then excludes the shared-memory
    /// transports (posix, sysv, self), which cannot detect a dead peer.
    Peer,
}

impl std::fmt::Display for ErrMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ErrMode::None => "none",
            ErrMode::Peer => "peer",
        })
    }
}

/// How long dropping an endpoint waits for UCX to close it gracefully.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection to a peer worker (`ucp_ep_h`).
#[derive(Clone)]
pub struct Endpoint {
    inner: Rc<EpInner>,
}

struct EpInner {
    h: UcpEpH,
    err_mode: ErrMode,
    /// Status reported by UCX's error handler (peer mode); boxed so its address is stable.
    failure: Box<Cell<UcsStatus>>,
    worker: Worker,
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: UcpEpH, status: UcsStatus) {
    // SAFETY: `arg` is the `Box<Cell<UcsStatus>>` of the endpoint, which outlives the
    // endpoint handle (it is freed after ucp_ep_close_nbx in Drop); called on the worker's thread.
    let cell = unsafe { &*(arg as *const Cell<UcsStatus>) };
    if cell.get() == sys::UCS_OK {
        cell.set(status);
    }
}

impl Endpoint {
    /// Connects to the worker whose address a peer sent (`ucp_ep_create`).
    pub fn connect(worker: &Worker, remote_address: &[u8], err_mode: ErrMode) -> Result<Endpoint> {
        if remote_address.is_empty() {
            return Err(UcxError::Invalid("empty remote worker address".into()));
        }
        let failure = Box::new(Cell::new(sys::UCS_OK));
        let mut params: sys::UcpEpParams = sys::zeroed();
        params.field_mask =
            sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        params.address = remote_address.as_ptr().cast();
        params.err_mode = match err_mode {
            ErrMode::None => sys::UCP_ERR_HANDLING_MODE_NONE,
            ErrMode::Peer => sys::UCP_ERR_HANDLING_MODE_PEER,
        };
        if err_mode == ErrMode::Peer {
            params.field_mask |= sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
            params.err_handler = sys::UcpErrHandler {
                cb: Some(on_ep_error),
                arg: (&*failure as *const Cell<UcsStatus>).cast_mut().cast(),
            };
        }
        let mut h: UcpEpH = std::ptr::null_mut();
        // SAFETY: live worker; the address bytes are read during the call only; the error
        // handler argument lives as long as the endpoint (see `on_ep_error`).
        let st = unsafe { (worker.ucx().api().ucp_ep_create)(worker.handle(), &params, &mut h) };
        worker.ucx().check("ucp_ep_create", st)?;
        Ok(Endpoint { inner: Rc::new(EpInner { h, err_mode, failure, worker: worker.clone() }) })
    }

    pub fn worker(&self) -> &Worker {
        &self.inner.worker
    }

    pub fn err_mode(&self) -> ErrMode {
        self.inner.err_mode
    }

    /// The peer failure UCX reported on this endpoint, if any (peer mode only).
    pub fn failure(&self) -> Option<UcxError> {
        let st = self.inner.failure.get();
        (st != sys::UCS_OK).then(|| self.worker().ucx().status_error("endpoint (peer failure)", st))
    }

    /// `ucp_ep_print_info` as text.
    pub fn print_info(&self) -> Result<String> {
        // SAFETY: live endpoint; the stream is valid for the call.
        super::context::capture(|f| unsafe { (self.worker().ucx().api().ucp_ep_print_info)(self.inner.h, f) })
    }

    /// The transports UCX selected for this endpoint, e.g. `"posix/memory, cma/memory"`.
    pub fn transports(&self) -> Result<String> {
        Ok(parse_transports(&self.print_info()?))
    }

    /// Unpacks a peer's remote key for this endpoint; `base`/`len` describe the peer's
    /// registered region, which every read is checked against.
    pub fn unpack_rkey(&self, packed: &PackedRkey, base: u64, len: u64) -> Result<RemoteRegion> {
        let mut h: UcpRkeyH = std::ptr::null_mut();
        let raw = packed.raw();
        // SAFETY: live endpoint; `raw` passed kvx's envelope checks (length, checksum), so
        // it is a buffer produced by ucp_rkey_pack; valid out pointer.
        let st = unsafe {
            (self.worker().ucx().api().ucp_ep_rkey_unpack)(self.inner.h, raw.as_ptr().cast(), &mut h)
        };
        self.worker().ucx().check("ucp_ep_rkey_unpack", st)?;
        if base.checked_add(len).is_none() {
            // SAFETY: h was just unpacked and is not used again.
            unsafe { (self.worker().ucx().api().ucp_rkey_destroy)(h) };
            return Err(UcxError::Invalid(format!("remote region {base:#x}+{len} overflows")));
        }
        Ok(RemoteRegion { h, base, len, ep: self.clone() })
    }

    /// Flushes outstanding operations on this endpoint (`ucp_ep_flush_nbx`).
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        let param: sys::UcpRequestParam = sys::zeroed();
        // SAFETY: live endpoint; param zeroed with an empty mask.
        let p = unsafe { (self.worker().ucx().api().ucp_ep_flush_nbx)(self.inner.h, &param) };
        self.wait_request("ucp_ep_flush_nbx", p, timeout)
    }

    pub(super) fn handle(&self) -> UcpEpH {
        self.inner.h
    }

    /// Waits for a request returned by a `*_nbx` call and frees it.
    pub(super) fn wait_request(
        &self,
        op: &'static str,
        p: sys::UcsStatusPtr,
        timeout: Duration,
    ) -> Result<()> {
        let ucx = self.worker().ucx();
        if !sys::ptr_is_ptr(p) {
            return ucx.check(op, sys::ptr_status(p));
        }
        let api = ucx.api();
        let mut status = sys::UCS_INPROGRESS;
        let done = self.worker().wait_until(Instant::now() + timeout, || {
            // SAFETY: `p` is a live request until freed below.
            status = unsafe { (api.ucp_request_check_status)(p) };
            status != sys::UCS_INPROGRESS
        })?;
        // SAFETY: `p` is a request from this worker, freed once; if it has not completed
        // UCX releases it on completion.
        unsafe { (api.ucp_request_free)(p) };
        if !done {
            return Err(UcxError::Timeout { op, timeout, outstanding: 1, hint: "" });
        }
        ucx.check(op, status)
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        let ucx = self.worker.ucx();
        let mut param: sys::UcpRequestParam = sys::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        // A forced close needs peer error handling on both sides; without it, close
        // gracefully (the peer keeps progressing until told to stop, so this completes).
        param.flags = if self.err_mode == ErrMode::Peer { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: the last owner of a live endpoint; it is not used after this call.
        let p = unsafe { (ucx.api().ucp_ep_close_nbx)(self.h, &param) };
        if sys::ptr_is_err(p) {
            tracing::debug!("ucp_ep_close_nbx: {}", ucx.status_error("ucp_ep_close_nbx", sys::ptr_status(p)));
            return;
        }
        if sys::ptr_is_ptr(p) {
            let api = ucx.api();
            let done = self.worker.wait_until(Instant::now() + CLOSE_TIMEOUT, || {
                // SAFETY: `p` is a live request until freed below.
                unsafe { (api.ucp_request_check_status)(p) != sys::UCS_INPROGRESS }
            });
            if !matches!(done, Ok(true)) {
                tracing::warn!(
                    "closing a UCX endpoint did not finish within {CLOSE_TIMEOUT:?}; the worker will reclaim it"
                );
            }
            // SAFETY: request from ucp_ep_close_nbx, freed once (released on completion if pending).
            unsafe { (api.ucp_request_free)(p) };
        }
    }
}

/// Summarises `ucp_ep_print_info` output as the distinct `transport/device` pairs of the
/// endpoint's lanes, in lane order, e.g. `"posix/memory, cma/memory"`.
pub fn parse_transports(info: &str) -> String {
    let mut seen: Vec<String> = Vec::new();
    for line in info.lines() {
        let Some(rest) = line.trim_start_matches(['#', ' ']).strip_prefix("lane[") else { continue };
        // "lane[0]:  1:posix/memory.0 md1 ..."  (1.13) or "lane[0]:  8:cma/memory.0 md4 ..." (1.2x)
        let Some((_, after)) = rest.split_once(':') else { continue };
        let Some(tok) = after.split_whitespace().next() else { continue };
        let tl = tok.split_once(':').map_or(tok, |(_, t)| t);
        let tl = tl.rsplit_once('.').map_or(tl, |(t, _)| t);
        if !tl.is_empty() && !seen.iter().any(|s| s == tl) {
            seen.push(tl.to_string());
        }
    }
    if seen.is_empty() { "unknown".into() } else { seen.join(", ") }
}

/// A peer's registered region as seen from one endpoint: unpacked rkey, base, length.
pub struct RemoteRegion {
    h: UcpRkeyH,
    base: u64,
    len: u64,
    // Dropped after the rkey is destroyed (Drop below runs first).
    ep: Endpoint,
}

impl Drop for RemoteRegion {
    fn drop(&mut self) {
        // SAFETY: rkey unpacked on `ep`, which is still live (a field), destroyed once.
        unsafe { (self.ep.worker().ucx().api().ucp_rkey_destroy)(self.h) };
    }
}

/// One GET: `len` bytes from `remote_off` (relative to the peer's registration base) to
/// `local_off` (relative to the local registration base).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDesc {
    pub local_off: u64,
    pub remote_off: u64,
    pub len: u64,
}

impl From<(u64, u64, u64)> for ReadDesc {
    fn from((local_off, remote_off, len): (u64, u64, u64)) -> Self {
        Self { local_off, remote_off, len }
    }
}

/// Options of a batch read.
#[derive(Debug, Clone, Copy)]
pub struct ReadOptions {
    /// Most operations posted and not yet completed at any time (>= 1), over all peers of an
    /// [`rma_batch`].
    pub max_inflight: usize,
    /// Deadline for the whole batch, posting included.
    pub timeout: Duration,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self { max_inflight: 64, timeout: Duration::from_secs(5) }
    }
}

/// What a batch read did and how long it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReadStats {
    pub descriptors: u64,
    pub bytes: u64,
    /// From the call to the last GET posted.
    pub post_ns: u64,
    /// From the call to the last GET completed.
    pub complete_ns: u64,
}

/// Completion state shared with UCX's callback. Boxed so its address is stable; leaked
/// if the batch is abandoned with GETs in flight (their callbacks may still fire).
struct Completion {
    done: Cell<u64>,
    error: Cell<UcsStatus>,
    free: unsafe extern "C" fn(*mut c_void),
}

unsafe extern "C" fn on_get_done(request: *mut c_void, status: UcsStatus, user_data: *mut c_void) {
    // SAFETY: `user_data` is the batch's `Completion`, alive (or leaked) until every GET
    // completed; callbacks run inside ucp_worker_progress on the batch's thread.
    let c = unsafe { &*(user_data as *const Completion) };
    c.done.set(c.done.get() + 1);
    if status != sys::UCS_OK && c.error.get() == sys::UCS_OK {
        c.error.set(status);
    }
    // SAFETY: `request` is the completed request this callback reports, freed once.
    unsafe { (c.free)(request) };
}

impl RemoteRegion {
    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Posts one `ucp_get_nbx` per descriptor, at most `opts.max_inflight` outstanding,
    /// and waits until all completed. Every descriptor is bounds-checked against both
    /// regions before it is posted; a bad one stops posting, and the call returns its
    /// error after the GETs already posted have completed.
    pub fn read_batch<M, I>(
        &self,
        local: &mut MemRegion<M>,
        descs: I,
        opts: &ReadOptions,
    ) -> Result<ReadStats>
    where
        M: Registrable,
        I: IntoIterator<Item = ReadDesc>,
    {
        rma_batch(Rma::Get, local, [(self, descs)], opts)
    }
}

/// One batch of `op` between `local` and several remote regions, each with its descriptors:
/// GETs read them into `local` (the prefill ranks one decode rank pulls from), PUTs write
/// `local` into them (push mode: the decode ranks one prefill rank writes into). Each
/// descriptor's `local_off` is its place in `local`, `remote_off` in its remote region.
///
/// Operations are posted round-robin, one descriptor per peer in turn, under a single window
/// of `opts.max_inflight` outstanding, and the call returns when all have completed. Peers
/// are not served one after the other, so a peer that must progress to answer (UCX builds
/// that emulate GET in software) works while the others do. Every peer must be reached
/// through the same worker. Checks and failures are as in [`RemoteRegion::read_batch`]; an
/// out-of-bounds descriptor names its peer's index.
///
/// A PUT's completion means its source may be reused, not that the bytes reached the peer:
/// flush each endpoint ([`Endpoint::flush`]) before telling the peer they are there.
pub fn rma_batch<'r, M, I>(
    op: Rma,
    local: &mut MemRegion<M>,
    peers: impl IntoIterator<Item = (&'r RemoteRegion, I)>,
    opts: &ReadOptions,
) -> Result<ReadStats>
where
    M: Registrable,
    I: IntoIterator<Item = ReadDesc>,
{
    if local.is_poisoned() {
        return Err(UcxError::Poisoned);
    }
    let mut srcs: Vec<(&RemoteRegion, I::IntoIter)> =
        peers.into_iter().map(|(r, d)| (r, d.into_iter())).collect();
    let Some(first) = srcs.first().map(|(r, _)| *r) else {
        return Ok(ReadStats::default());
    };
    let worker = first.ep.worker().clone();
    if let Some(k) = srcs.iter().position(|(r, _)| r.ep.worker().handle() != worker.handle()) {
        return Err(UcxError::Invalid(format!(
            "read source {k} is reached through another UCX worker than source 0; one batch \
             progresses a single worker"
        )));
    }
    let ucx = worker.ucx();
    let api = ucx.api();
    let window = opts.max_inflight.max(1) as u64;
    let start = Instant::now();
    let deadline = start + opts.timeout;
    let completion = Box::new(Completion {
        done: Cell::new(0),
        error: Cell::new(sys::UCS_OK),
        free: api.ucp_request_free,
    });
    let mut param: sys::UcpRequestParam = sys::zeroed();
    param.op_attr_mask =
        sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA | sys::UCP_OP_ATTR_FIELD_MEMH;
    param.cb = Some(on_get_done);
    param.user_data = (&*completion as *const Completion).cast_mut().cast();
    param.memh = local.memh();
    let (local_base, local_len) = (local.addr(), local.len() as u64);
    let (get, put) = (api.ucp_get_nbx, api.ucp_put_nbx);

    let mut posted: u64 = 0;
    let mut bytes: u64 = 0;
    let mut stop: Option<UcxError> = None;
    let mut timed_out = false;
    // Indices of the sources with descriptors left, served in turn.
    let mut live: Vec<usize> = (0..srcs.len()).collect();
    let mut turn = 0usize;
    while !live.is_empty() {
        let slot = turn % live.len();
        let k = live[slot];
        let (src, descs) = &mut srcs[k];
        let Some(d) = descs.find(|d| d.len != 0) else {
            live.remove(slot);
            continue;
        };
        turn = slot + 1;
        let in_bounds = d.local_off.checked_add(d.len).is_some_and(|e| e <= local_len)
            && d.remote_off.checked_add(d.len).is_some_and(|e| e <= src.len);
        if !in_bounds {
            stop = Some(UcxError::Invalid(format!(
                "descriptor (local_off {}, remote_off {}, len {}) of {} {k} is outside the local \
                 region ({local_len} bytes) or the remote region ({} bytes)",
                d.local_off,
                d.remote_off,
                d.len,
                if op == Rma::Get { "read source" } else { "write destination" },
                src.len
            )));
            break;
        }
        if posted - completion.done.get() >= window {
            let c = &*completion;
            if !worker
                .wait_until(deadline, || posted - c.done.get() < window || c.error.get() != sys::UCS_OK)?
            {
                timed_out = true;
                break;
            }
            if completion.error.get() != sys::UCS_OK {
                break;
            }
        }
        let local_addr = (local_base + d.local_off) as *mut c_void;
        let remote_addr = src.base + d.remote_off;
        // SAFETY: the local range was checked to lie inside `local`'s registered memory,
        // which stays registered and exclusively borrowed until every operation completed
        // (or the region is poisoned); the remote range was checked against the peer's
        // region; the rkey was unpacked on this endpoint, and every endpoint belongs to
        // `worker`, which is progressed below; `param` and `completion` outlive the
        // request (see `on_get_done`, which serves both operations).
        let p = unsafe {
            match op {
                Rma::Get => get(src.ep.inner.h, local_addr, d.len as usize, remote_addr, src.h, &param),
                Rma::Put => {
                    put(src.ep.inner.h, local_addr.cast_const(), d.len as usize, remote_addr, src.h, &param)
                }
            }
        };
        if p.is_null() {
            completion.done.set(completion.done.get() + 1);
        } else if sys::ptr_is_err(p) {
            stop = Some(ucx.status_error(op.call_name(), sys::ptr_status(p)));
            break;
        }
        posted += 1;
        bytes += d.len;
    }
    let post_ns = start.elapsed().as_nanos() as u64;
    if !timed_out {
        let c = &*completion;
        timed_out = !worker.wait_until(deadline, || c.done.get() >= posted)?;
    }
    let complete_ns = start.elapsed().as_nanos() as u64;
    if timed_out {
        let outstanding = posted - completion.done.get();
        local.poison();
        // Callbacks of the outstanding GETs may still run: keep their state alive, and
        // never tear down the endpoints, worker or context under them (UCX aborts when a
        // context is cleaned up with a registration still in use).
        Box::leak(completion);
        for (src, _) in &srcs {
            std::mem::forget(src.ep.clone());
        }
        let hint = if srcs.iter().any(|(src, _)| src.ep.err_mode() == ErrMode::None) {
            " (is the peer alive and progressing? --err-mode peer turns a dead peer into an error)"
        } else {
            ""
        };
        return Err(srcs.iter().find_map(|(src, _)| src.ep.failure()).unwrap_or(UcxError::Timeout {
            op: if op == Rma::Get { "batch read" } else { "batch write" },
            timeout: opts.timeout,
            outstanding,
            hint,
        }));
    }
    if let Some(e) = stop {
        return Err(e);
    }
    if completion.error.get() != sys::UCS_OK {
        let what = if op == Rma::Get { "ucp_get_nbx completion" } else { "ucp_put_nbx completion" };
        return Err(ucx.status_error(what, completion.error.get()));
    }
    Ok(ReadStats { descriptors: posted, bytes, post_ns, complete_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_are_parsed_from_both_print_formats() {
        let v113 = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n#                 lane[0]:  2:posix/memory.0 md1        rma_bw#0 am am_bw#0\n#                 lane[1]:  4:cma/memory.0 md3          rma_bw#1\n#\n";
        assert_eq!(parse_transports(v113), "posix/memory, cma/memory");
        let v122 = "#\n# UCP endpoint \n#               peer: \n#                 lane[0]:  8:posix/memory.0 md4          am am_bw#0\n#                 lane[1]:  10:cma/memory.0 md5          rma_bw#0\n#                 lane[2]:  8:posix/memory.0 md4          rma_bw#1\n";
        assert_eq!(parse_transports(v122), "posix/memory, cma/memory");
        assert_eq!(parse_transports("nothing here"), "unknown");
    }
}
