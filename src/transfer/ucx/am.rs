//! UCX active messages: small one-way messages on the same worker and endpoint as the
//! one-sided reads, as NIXL sends vLLM's notifications.
//!
//! Owns: the receive handler ([`AmReceiver`], one per (worker, id), whose UCX callback
//! copies each message into a queue the receiver owns) and the send
//! ([`Endpoint::am_send`], which returns once UCX no longer needs the bytes). Must not
//! know what the bytes mean: the notification format lives in `transfer::notify`.
//!
//! Delivery happens inside `ucp_worker_progress` on the receiving worker's thread, so a
//! receiver calls [`AmReceiver::drain`] after progressing. An active message arriving at
//! an armed worker makes its event fd readable (the sender signals shared-memory and TCP
//! peers alike), so a loop that sleeps on the event fd wakes for it. One exception, seen
//! with UCX 1.13: a message that had to wait for room in the receiver's full
//! shared-memory FIFO can land without the signal, so such a loop must still bound its
//! sleep (the prefill loop does, at 100 ms).
//!
//! Sends use UCX's eager protocol only (`UCP_AM_SEND_FLAG_EAGER`): the receiver gets the
//! whole message in one callback with the data in hand, never a rendezvous descriptor it
//! would have to fetch. A small message on shared memory or TCP goes out inside the
//! `ucp_am_send_nbx` call, with no progress call and no thread hop.

use std::cell::{Cell, RefCell};
use std::ffi::{c_uint, c_void};
use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use serde::Serialize;

use super::context::Worker;
use super::endpoint::Endpoint;
use super::error::{Result, UcxError};
use super::sys::{self, UcsStatus};

/// What a receiver has seen since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AmStats {
    /// Messages queued for [`AmReceiver::drain`].
    pub received: u64,
    /// Messages longer than the receiver's limit, dropped unread.
    pub oversized: u64,
    /// Rendezvous announcements (a sender not using kvx's eager sends), refused: the
    /// sender's request completes with `UCS_ERR_UNSUPPORTED`.
    pub rendezvous: u64,
    /// Messages dropped because the queue could not be reached (a bug, never expected).
    pub dropped: u64,
}

/// The receiver's state UCX's callback writes into. Boxed so its address is stable for
/// as long as the handler is registered.
struct AmQueue {
    messages: RefCell<Vec<Vec<u8>>>,
    max_len: usize,
    received: Cell<u64>,
    oversized: Cell<u64>,
    rendezvous: Cell<u64>,
    dropped: Cell<u64>,
}

fn bump(c: &Cell<u64>) {
    c.set(c.get().wrapping_add(1));
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::UcpAmRecvParam,
) -> UcsStatus {
    // Nothing below is expected to panic; if something did, unwinding into UCX's C frames
    // would abort the process, so the message is counted as dropped instead.
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the `AmQueue` registered with this handler; the receiver keeps
        // it alive until the handler is cleared (or leaks it if clearing fails), and UCX
        // calls handlers only inside ucp_worker_progress on the worker's own thread.
        let q = unsafe { &*(arg as *const AmQueue) };
        // SAFETY: when non-null, `param` points to UCX's receive parameters for this call.
        let attr = if param.is_null() { 0 } else { unsafe { (*param).recv_attr } };
        if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
            bump(&q.rendezvous);
            // Drops the descriptor; the sender's request completes with this status.
            return sys::UCS_ERR_UNSUPPORTED;
        }
        if length > q.max_len {
            bump(&q.oversized);
            return sys::UCS_OK;
        }
        let bytes = if length == 0 || data.is_null() {
            Vec::new()
        } else {
            // SAFETY: for an eager message UCX passes `length` readable bytes at `data`,
            // valid until this callback returns; they are copied before returning UCS_OK.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec()
        };
        match q.messages.try_borrow_mut() {
            Ok(mut m) => {
                m.push(bytes);
                bump(&q.received);
            }
            Err(_) => bump(&q.dropped),
        }
        sys::UCS_OK
    }))
    .unwrap_or(sys::UCS_OK)
}

/// Receives the active messages with one id on one worker into a queue, drained by the
/// owner after progressing the worker. Dropping the receiver unregisters the handler.
pub struct AmReceiver {
    id: u16,
    queue: ManuallyDrop<Box<AmQueue>>,
    worker: Worker,
}

impl std::fmt::Debug for AmReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmReceiver").field("id", &self.id).field("stats", &self.stats()).finish()
    }
}

impl AmReceiver {
    /// Registers a handler for `id` on `worker`. Messages longer than `max_len` bytes are
    /// counted ([`AmStats::oversized`]) and dropped.
    pub fn new(worker: &Worker, id: u16, max_len: usize) -> Result<AmReceiver> {
        if !worker.context().has_active_messages() {
            return Err(UcxError::Invalid(
                "the UCX context was created without active messages (ContextOptions::active_messages)"
                    .into(),
            ));
        }
        if !worker.claim_am_id(id) {
            return Err(UcxError::Invalid(format!(
                "active-message id {id} already has a receiver on this worker"
            )));
        }
        let queue = Box::new(AmQueue {
            messages: RefCell::new(Vec::new()),
            max_len,
            received: Cell::new(0),
            oversized: Cell::new(0),
            rendezvous: Cell::new(0),
            dropped: Cell::new(0),
        });
        let mut param: sys::UcpAmHandlerParam = sys::zeroed();
        param.field_mask = sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG;
        param.id = c_uint::from(id);
        param.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        param.cb = Some(on_am);
        param.arg = (&*queue as *const AmQueue).cast_mut().cast();
        let ucx = worker.ucx();
        // SAFETY: live worker with UCP_FEATURE_AM, on its owning thread (Worker is !Send);
        // param zeroed with an explicit mask; `arg` stays valid until the handler is
        // cleared in Drop (see `on_am`).
        let st = unsafe { (ucx.api().ucp_worker_set_am_recv_handler)(worker.handle(), &param) };
        if let Err(e) = ucx.check("ucp_worker_set_am_recv_handler", st) {
            worker.release_am_id(id);
            return Err(e);
        }
        Ok(AmReceiver { id, queue: ManuallyDrop::new(queue), worker: worker.clone() })
    }

    pub fn id(&self) -> u16 {
        self.id
    }

    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// The messages received by progress calls since the last drain, in arrival order.
    pub fn drain(&self) -> Vec<Vec<u8>> {
        self.queue.messages.try_borrow_mut().map(|mut m| std::mem::take(&mut *m)).unwrap_or_default()
    }

    /// Messages waiting to be drained.
    pub fn pending(&self) -> usize {
        self.queue.messages.try_borrow().map_or(0, |m| m.len())
    }

    pub fn stats(&self) -> AmStats {
        let q = &self.queue;
        AmStats {
            received: q.received.get(),
            oversized: q.oversized.get(),
            rendezvous: q.rendezvous.get(),
            dropped: q.dropped.get(),
        }
    }
}

impl Drop for AmReceiver {
    fn drop(&mut self) {
        let ucx = self.worker.ucx();
        let mut param: sys::UcpAmHandlerParam = sys::zeroed();
        param.field_mask = sys::UCP_AM_HANDLER_PARAM_FIELD_ID | sys::UCP_AM_HANDLER_PARAM_FIELD_CB;
        param.id = c_uint::from(self.id);
        param.cb = None;
        // SAFETY: live worker (a field), on its owning thread; a NULL callback clears the
        // handler, after which UCX no longer refers to the queue.
        let st = unsafe { (ucx.api().ucp_worker_set_am_recv_handler)(self.worker.handle(), &param) };
        match ucx.check("ucp_worker_set_am_recv_handler (clear)", st) {
            Ok(()) => {
                self.worker.release_am_id(self.id);
                // SAFETY: the handler is cleared, so nothing refers to the queue any more;
                // dropped exactly once, here.
                unsafe { ManuallyDrop::drop(&mut self.queue) };
            }
            Err(e) => {
                // The handler may still fire: leave the queue (and the id) to it.
                tracing::warn!("{e}; leaking the active-message queue of id {}", self.id);
            }
        }
    }
}

impl Endpoint {
    /// Sends one active message with `id` to the peer and returns once UCX is done with
    /// `data`: at once for a small message (UCX sends it inside the call), else after
    /// progressing this endpoint's worker for at most `timeout`.
    ///
    /// Messages on one endpoint arrive in the order they were sent. A peer that is gone
    /// shows up as an error status, or (shared memory without peer error handling, where
    /// the sender cannot tell) as [`UcxError::Timeout`] once its queue is full; after a
    /// timeout the bytes are leaked, because UCX may still read them.
    pub fn am_send(&self, id: u16, data: Vec<u8>, timeout: Duration) -> Result<()> {
        let worker = self.worker();
        if !worker.context().has_active_messages() {
            return Err(UcxError::Invalid(
                "the UCX context was created without active messages (ContextOptions::active_messages)"
                    .into(),
            ));
        }
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let ucx = worker.ucx();
        let mut param: sys::UcpRequestParam = sys::zeroed();
        param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: live endpoint on its worker's thread; no header; `data` stays allocated
        // until UCX is done with it (returned below on completion, leaked on timeout);
        // without a datatype field the count is in bytes.
        let p = unsafe {
            (ucx.api().ucp_am_send_nbx)(
                self.handle(),
                c_uint::from(id),
                std::ptr::null(),
                0,
                data.as_ptr().cast(),
                data.len(),
                &param,
            )
        };
        if !sys::ptr_is_ptr(p) {
            return ucx.check("ucp_am_send_nbx", sys::ptr_status(p));
        }
        match self.wait_request("ucp_am_send_nbx", p, timeout) {
            Err(UcxError::Timeout { .. }) => {
                std::mem::forget(data);
                Err(self.failure().unwrap_or(UcxError::Timeout {
                    op: "active message send",
                    timeout,
                    outstanding: 1,
                    hint: " (is the receiving worker alive and progressing?)",
                }))
            }
            other => other,
        }
    }
}
