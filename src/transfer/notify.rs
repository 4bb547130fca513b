//! Transfer notifications: how a decode rank tells a prefill rank that it may free a
//! request's blocks, and how it keeps the blocks alive while it waits.
//!
//! Messages are vLLM's strings: `"<p_request_id>:<n>"` after a D rank's reads for a
//! request complete (P frees after `n` of them), and `"HB:" + ",".join(ids)` heartbeats
//! that extend leases. [`LeaseTable`] is P's bookkeeping (pure; time is passed in).
//!
//! Two transports carry the same bytes ([`NotifyTransport`]):
//!
//! - **UCX active messages** (the default, what NIXL does for vLLM): the D rank sends on
//!   the UCX endpoint it already reads through ([`UcxNotifySender`]); the P rank's worker
//!   runs a handler for [`NOTIFY_AM_ID`] ([`UcxNotifyReceiver`]) and drains it after each
//!   progress round. The send happens inside the calling thread, with no hand-off to an
//!   I/O thread, and the arrival wakes the P rank's UCX event fd.
//! - **ZMQ** (fallback, and the storage transport's channel): a PULL socket per P rank
//!   ([`NotifyListener`]), advertised in that rank's kvx metadata (`notify_endpoint`), and
//!   a PUSH socket per (D rank, P rank) ([`NotifySender`]). Not the handshake ROUTER,
//!   because that ROUTER is one per engine and may live in another process than the rank
//!   that owns the blocks, and because REQ/REP's lockstep would add a round trip to a
//!   one-way message; PUSH/PULL keeps per-connection order and needs no reply.
//!
//! Owns: the notification format, its channels and lease accounting. Must not free
//! memory itself (callers act on what the table says) or know about layouts.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::transfer::handshake::{ZmqFailure, zmq_context};
use crate::transfer::ucx::{AmReceiver, AmStats, Endpoint, UcxError, Worker};

/// Prefix of heartbeat messages.
pub const HEARTBEAT_PREFIX: &str = "HB:";
/// Largest notification accepted (a heartbeat lists every waiting request).
pub const MAX_NOTIFY_BYTES: usize = 1 << 20;

/// The active-message id kvx notifications travel under (`"KN"`). Every kvx P rank
/// registers it; a D rank sends nothing else with it.
pub const NOTIFY_AM_ID: u16 = 0x4b4e;

/// Which channel carries notifications from D ranks to P ranks.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum NotifyTransport {
    /// UCX active messages on the endpoint the reads use (as NIXL does).
    #[default]
    Ucx,
    /// A ZMQ PUSH socket to the P rank's PULL socket.
    Zmq,
}

impl std::fmt::Display for NotifyTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NotifyTransport::Ucx => "ucx",
            NotifyTransport::Zmq => "zmq",
        })
    }
}

/// One message on the notification channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notification {
    /// A D rank finished reading `p_request_id`; P frees after `count` of these.
    Notif { p_request_id: String, count: u32 },
    /// Requests a D rank is still waiting to read: extend their leases.
    Heartbeat { ids: Vec<String> },
    /// kvx's multi-transport fallback: the first transport failed for these requests;
    /// publish them through the next one (shared storage). Not a vLLM message.
    Fallback { ids: Vec<String> },
    /// Push mode, D rank to P rank: vLLM's `PUSH_REG:` + msgpack registration of the decode
    /// blocks prefill is to WRITE into.
    PushReg(Box<PushRegistration>),
    /// Push mode, P rank to D rank: a WRITE failed to post or complete. Counted like a
    /// completion notification, so the decode rank reaches its count and fails the request
    /// (vllm-project/vllm#50754's fix) instead of waiting for one that never comes.
    PushFailed { d_request_id: String, count: u32 },
}

/// vLLM's push registration (`push_worker._do_send_reg_notif`), with the field names of
/// vLLM's msgpack map.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushRegistration {
    /// The decode engine's request id (what WRITE notifications name).
    pub request_id: String,
    pub decode_engine_id: String,
    /// The decode engine's side channel, which the prefill rank handshakes with.
    pub decode_host: String,
    pub decode_port: u16,
    pub decode_tp_size: u32,
    /// Decode block ids per KV-cache group (kvx models one group).
    pub local_block_ids: Vec<Vec<u64>>,
    pub remote_engine_id: String,
    pub remote_host: String,
    pub remote_port: u16,
    pub remote_tp_size: u32,
    pub remote_pp_size: u32,
    /// kvx: the prefill request id from `kv_transfer_params`, matched exactly (vLLM matches
    /// the two legs' ids with their random suffixes stripped; kvx's ids are its own).
    #[serde(default)]
    pub remote_request_id: Option<String>,
}

/// Prefix of vLLM's push registrations.
pub const PUSH_REG_PREFIX: &[u8] = b"PUSH_REG:";

/// Prefix of kvx's push failure notifications (`"PUSH_FAIL:<d id>:<count>"`).
pub const PUSH_FAIL_PREFIX: &str = "PUSH_FAIL:";

/// Prefix of kvx's fallback requests (`"FB:<id>,<id>"`).
pub const FALLBACK_PREFIX: &str = "FB:";

/// A notification that could not be sent, received or parsed.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("malformed notification ({len} bytes): {reason}")]
    Malformed { len: usize, reason: String },
    #[error("cannot encode notification: {reason}")]
    Encode { reason: String },
    #[error(
        "notification to {endpoint} not delivered within {timeout:?}: is the prefill rank's notification listener up?"
    )]
    NotDelivered { endpoint: String, timeout: Duration },
    #[error(transparent)]
    Zmq(#[from] ZmqFailure),
    #[error("UCX notification {op} ({peer}) failed: {source}")]
    Ucx {
        op: &'static str,
        peer: String,
        #[source]
        source: UcxError,
    },
    #[error("NIXL notification to agent {peer} failed: {source}")]
    Nixl {
        peer: String,
        #[source]
        source: crate::transfer::nixl::NixlError,
    },
}

impl Notification {
    /// vLLM's bytes for this message. A message over [`MAX_NOTIFY_BYTES`] is refused here,
    /// since every receiver would refuse it.
    pub fn encode(&self) -> Result<Vec<u8>, NotifyError> {
        let bytes = self.encode_unchecked()?;
        if bytes.len() > MAX_NOTIFY_BYTES {
            return Err(NotifyError::Encode {
                reason: format!("{} bytes is over the {MAX_NOTIFY_BYTES}-byte limit", bytes.len()),
            });
        }
        Ok(bytes)
    }

    fn encode_unchecked(&self) -> Result<Vec<u8>, NotifyError> {
        let enc = |reason: String| NotifyError::Encode { reason };
        match self {
            Notification::Notif { p_request_id, count } => {
                if p_request_id.is_empty() {
                    return Err(enc("empty request id".into()));
                }
                if p_request_id.starts_with(HEARTBEAT_PREFIX) || p_request_id.starts_with(FALLBACK_PREFIX) {
                    return Err(enc(format!(
                        "request id {p_request_id:?} would be read as a heartbeat or fallback"
                    )));
                }
                if *count == 0 {
                    return Err(enc(format!("count 0 for {p_request_id:?}: P would never free it")));
                }
                Ok(format!("{p_request_id}:{count}").into_bytes())
            }
            Notification::Heartbeat { ids } => {
                if let Some(bad) = ids.iter().find(|id| id.is_empty() || id.contains(',')) {
                    return Err(enc(format!(
                        "request id {bad:?} cannot travel in a heartbeat (empty or has ',')"
                    )));
                }
                Ok(format!("{HEARTBEAT_PREFIX}{}", ids.join(",")).into_bytes())
            }
            Notification::Fallback { ids } => {
                if let Some(bad) = ids.iter().find(|id| id.is_empty() || id.contains(',')) {
                    return Err(enc(format!(
                        "request id {bad:?} cannot travel in a fallback (empty or has ',')"
                    )));
                }
                Ok(format!("{FALLBACK_PREFIX}{}", ids.join(",")).into_bytes())
            }
            Notification::PushReg(reg) => {
                let mut out = PUSH_REG_PREFIX.to_vec();
                out.extend(rmp_serde::to_vec_named(reg.as_ref()).map_err(|e| enc(e.to_string()))?);
                Ok(out)
            }
            Notification::PushFailed { d_request_id, count } => {
                if d_request_id.is_empty() || *count == 0 {
                    return Err(enc(format!("push failure for {d_request_id:?} with count {count}")));
                }
                Ok(format!("{PUSH_FAIL_PREFIX}{d_request_id}:{count}").into_bytes())
            }
        }
    }

    /// Parses vLLM's format; the request id may itself contain `:` (the count is last).
    pub fn parse(bytes: &[u8]) -> Result<Self, NotifyError> {
        let bad = |reason: &str| NotifyError::Malformed { len: bytes.len(), reason: reason.to_owned() };
        if bytes.len() > MAX_NOTIFY_BYTES {
            return Err(bad("over the 1 MiB limit"));
        }
        if let Some(body) = bytes.strip_prefix(PUSH_REG_PREFIX) {
            let reg: PushRegistration =
                rmp_serde::from_slice(body).map_err(|e| bad(&format!("push registration: {e}")))?;
            return Ok(Notification::PushReg(Box::new(reg)));
        }
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8"))?;
        if let Some(rest) = text.strip_prefix(PUSH_FAIL_PREFIX) {
            let (id, count) =
                rest.rsplit_once(':').ok_or_else(|| bad("expected \"PUSH_FAIL:<id>:<count>\""))?;
            let count: u32 = count.parse().map_err(|_| bad("count is not an unsigned integer"))?;
            if id.is_empty() || count == 0 {
                return Err(bad("empty request id or count 0"));
            }
            return Ok(Notification::PushFailed { d_request_id: id.to_owned(), count });
        }
        if let Some(rest) = text.strip_prefix(HEARTBEAT_PREFIX) {
            let ids = rest.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect();
            return Ok(Notification::Heartbeat { ids });
        }
        if let Some(rest) = text.strip_prefix(FALLBACK_PREFIX) {
            let ids = rest.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect();
            return Ok(Notification::Fallback { ids });
        }
        let (id, count) = text.rsplit_once(':').ok_or_else(|| bad("expected \"<request id>:<count>\""))?;
        if id.is_empty() {
            return Err(bad("empty request id"));
        }
        let count: u32 = count.parse().map_err(|_| bad("count is not an unsigned integer"))?;
        if count == 0 {
            return Err(bad("count is 0"));
        }
        Ok(Notification::Notif { p_request_id: id.to_owned(), count })
    }
}

/// P side: a PULL socket receiving notifications and heartbeats for one P rank.
pub struct NotifyListener {
    sock: zmq::Socket,
    endpoint: String,
}

impl std::fmt::Debug for NotifyListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifyListener").field("endpoint", &self.endpoint).finish()
    }
}

impl NotifyListener {
    /// Binds at `bind` (`tcp://127.0.0.1:0` style: see [`NotifyListener::endpoint`]).
    pub fn bind(bind: &str) -> Result<Self, NotifyError> {
        let zerr = |op| ZmqFailure::of(op, bind);
        let sock = zmq_context().socket(zmq::PULL).map_err(zerr("socket"))?;
        sock.set_linger(0).map_err(zerr("setsockopt LINGER"))?;
        // Twice the parse limit: oversized messages below it get a precise error; beyond
        // it libzmq drops the sender before buffering.
        sock.set_maxmsgsize(2 * MAX_NOTIFY_BYTES as i64).map_err(zerr("setsockopt MAXMSGSIZE"))?;
        sock.bind(bind).map_err(zerr("bind"))?;
        let endpoint = match sock.get_last_endpoint().map_err(zerr("getsockopt LAST_ENDPOINT"))? {
            Ok(s) => s,
            Err(_) => bind.to_owned(),
        };
        Ok(NotifyListener { sock, endpoint })
    }

    /// The endpoint actually bound (advertise this in the rank's metadata).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The socket, for waiting on it together with other sockets (`zmq::poll`).
    pub fn socket(&self) -> &zmq::Socket {
        &self.sock
    }

    /// Waits up to `timeout` for one message. `Ok(None)`: nothing arrived. A
    /// [`NotifyError::Malformed`] leaves the listener usable: log it and call again.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Notification>, NotifyError> {
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        let zerr = |op| ZmqFailure::of(op, &self.endpoint);
        if self.sock.poll(zmq::POLLIN, ms).map_err(zerr("poll"))? == 0 {
            return Ok(None);
        }
        match self.sock.recv_multipart(zmq::DONTWAIT) {
            Ok(frames) => match frames.as_slice() {
                [one] => Notification::parse(one).map(Some),
                _ => Err(NotifyError::Malformed {
                    len: frames.iter().map(Vec::len).sum(),
                    reason: format!("{} frames, expected 1", frames.len()),
                }),
            },
            Err(zmq::Error::EAGAIN) => Ok(None),
            Err(e) => Err(zerr("recv")(e).into()),
        }
    }

    /// Everything already queued, without waiting; malformed messages are logged and skipped.
    pub fn drain(&self) -> Result<Vec<Notification>, NotifyError> {
        let mut out = Vec::new();
        loop {
            match self.recv(Duration::ZERO) {
                Ok(Some(n)) => out.push(n),
                Ok(None) => return Ok(out),
                Err(e @ NotifyError::Malformed { .. }) => {
                    warn!(endpoint = %self.endpoint, error = %e, "skipping")
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// D side: a PUSH socket to one P rank's listener.
pub struct NotifySender {
    sock: zmq::Socket,
    endpoint: String,
    timeout: Duration,
}

impl std::fmt::Debug for NotifySender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotifySender")
            .field("endpoint", &self.endpoint)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl NotifySender {
    /// Connects to a listener. Sends wait up to `timeout` for the connection, then fail
    /// with [`NotifyError::NotDelivered`] rather than queue for a peer that is not there.
    pub fn connect(endpoint: &str, timeout: Duration) -> Result<Self, NotifyError> {
        let zerr = |op| ZmqFailure::of(op, endpoint);
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let sock = zmq_context().socket(zmq::PUSH).map_err(zerr("socket"))?;
        sock.set_immediate(true).map_err(zerr("setsockopt IMMEDIATE"))?;
        sock.set_sndtimeo(ms).map_err(zerr("setsockopt SNDTIMEO"))?;
        // A notification accepted by send must still leave if the sender is dropped next.
        sock.set_linger(ms).map_err(zerr("setsockopt LINGER"))?;
        sock.connect(endpoint).map_err(zerr("connect"))?;
        Ok(NotifySender { sock, endpoint: endpoint.to_owned(), timeout })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn send(&self, n: &Notification) -> Result<(), NotifyError> {
        let bytes = n.encode()?;
        match self.sock.send(bytes, 0) {
            Ok(()) => Ok(()),
            Err(zmq::Error::EAGAIN) => {
                Err(NotifyError::NotDelivered { endpoint: self.endpoint.clone(), timeout: self.timeout })
            }
            Err(source) => Err(ZmqFailure::of("send", &self.endpoint)(source).into()),
        }
    }

    /// `"<p_request_id>:<count>"`.
    pub fn send_done(&self, p_request_id: &str, count: u32) -> Result<(), NotifyError> {
        self.send(&Notification::Notif { p_request_id: p_request_id.to_owned(), count })
    }

    /// `"HB:<id>,<id>,..."`.
    pub fn send_heartbeat(&self, ids: &[String]) -> Result<(), NotifyError> {
        self.send(&Notification::Heartbeat { ids: ids.to_vec() })
    }
}

/// D side over UCX: active messages on the endpoint this D rank reads one P rank through.
#[derive(Clone)]
pub struct UcxNotifySender {
    ep: Endpoint,
    peer: String,
    timeout: Duration,
}

impl std::fmt::Debug for UcxNotifySender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxNotifySender").field("peer", &self.peer).field("timeout", &self.timeout).finish()
    }
}

impl UcxNotifySender {
    /// Sends on `ep`, whose context must have active messages enabled. `peer` names the
    /// receiving rank in errors; a send that cannot finish within `timeout` fails.
    pub fn new(ep: Endpoint, peer: impl Into<String>, timeout: Duration) -> Self {
        UcxNotifySender { ep, peer: peer.into(), timeout }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// Sends one message; returns once UCX is done with it (at once for a short one).
    pub fn send(&self, n: &Notification) -> Result<(), NotifyError> {
        self.send_raw(n.encode()?)
    }

    /// Sends bytes as they are, valid or not (tests use it to check what receivers skip).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), NotifyError> {
        self.ep.am_send(NOTIFY_AM_ID, bytes, self.timeout).map_err(|source| NotifyError::Ucx {
            op: "send",
            peer: self.peer.clone(),
            source,
        })
    }

    /// `"<p_request_id>:<count>"`.
    pub fn send_done(&self, p_request_id: &str, count: u32) -> Result<(), NotifyError> {
        self.send(&Notification::Notif { p_request_id: p_request_id.to_owned(), count })
    }

    /// `"HB:<id>,<id>,..."`.
    pub fn send_heartbeat(&self, ids: &[String]) -> Result<(), NotifyError> {
        self.send(&Notification::Heartbeat { ids: ids.to_vec() })
    }
}

/// P side over UCX: the [`NOTIFY_AM_ID`] handler on this rank's worker. Call
/// [`UcxNotifyReceiver::drain`] after progressing the worker.
#[derive(Debug)]
pub struct UcxNotifyReceiver {
    am: AmReceiver,
    malformed: u64,
}

impl UcxNotifyReceiver {
    /// Registers the handler; the worker's context needs active messages enabled.
    pub fn new(worker: &Worker) -> Result<Self, NotifyError> {
        let am = AmReceiver::new(worker, NOTIFY_AM_ID, MAX_NOTIFY_BYTES).map_err(|source| {
            NotifyError::Ucx { op: "register the receive handler", peer: "this worker".into(), source }
        })?;
        Ok(UcxNotifyReceiver { am, malformed: 0 })
    }

    /// The notifications received since the last drain, in arrival order. Malformed
    /// messages are logged, counted ([`UcxNotifyReceiver::malformed`]) and skipped.
    pub fn drain(&mut self) -> Vec<Notification> {
        let raw = self.am.drain();
        let mut out = Vec::with_capacity(raw.len());
        for bytes in raw {
            match Notification::parse(&bytes) {
                Ok(n) => out.push(n),
                Err(e) => {
                    self.malformed += 1;
                    warn!(error = %e, "skipping a UCX notification");
                }
            }
        }
        out
    }

    /// Messages skipped: unparseable, over the size limit, or not sent eagerly.
    pub fn malformed(&self) -> u64 {
        let s = self.am.stats();
        self.malformed + s.oversized + s.rendezvous + s.dropped
    }

    pub fn am_stats(&self) -> AmStats {
        self.am.stats()
    }
}

/// A D rank's sender to one P rank, over whichever [`NotifyTransport`] the run uses.
#[derive(Debug)]
pub enum AnyNotifySender {
    Zmq(NotifySender),
    Ucx(UcxNotifySender),
}

impl AnyNotifySender {
    pub fn transport(&self) -> NotifyTransport {
        match self {
            AnyNotifySender::Zmq(_) => NotifyTransport::Zmq,
            AnyNotifySender::Ucx(_) => NotifyTransport::Ucx,
        }
    }

    pub fn send(&self, n: &Notification) -> Result<(), NotifyError> {
        match self {
            AnyNotifySender::Zmq(s) => s.send(n),
            AnyNotifySender::Ucx(s) => s.send(n),
        }
    }

    /// `"<p_request_id>:<count>"`.
    pub fn send_done(&self, p_request_id: &str, count: u32) -> Result<(), NotifyError> {
        self.send(&Notification::Notif { p_request_id: p_request_id.to_owned(), count })
    }

    /// `"HB:<id>,<id>,..."`.
    pub fn send_heartbeat(&self, ids: &[String]) -> Result<(), NotifyError> {
        self.send(&Notification::Heartbeat { ids: ids.to_vec() })
    }
}

/// How often D sends heartbeats for a lease of `lease` (vLLM: `kv_lease_duration // 6`).
pub fn heartbeat_interval(lease: Duration) -> Duration {
    lease / 6
}

/// How far a heartbeat pushes a lease (vLLM: `kv_lease_duration * 2 // 3`; kvx keeps
/// sub-second precision where vLLM's integer seconds would round a 1 s lease to 0).
pub fn heartbeat_extension(lease: Duration) -> Duration {
    lease * 2 / 3
}

/// Counters of a [`LeaseTable`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    pub registered: u64,
    /// Freed because every expected notification arrived.
    pub freed_complete: u64,
    /// Freed because the lease ran out ("Releasing expired KV blocks").
    pub freed_expired: u64,
    /// Notifications for a request not (or no longer) held ("Potentially invalid KV
    /// blocks for unrecognized request").
    pub unrecognized: u64,
    /// Leases a heartbeat extended.
    pub heartbeat_extended: u64,
    /// Heartbeat ids for requests not held.
    pub heartbeat_unknown: u64,
    /// Notifications whose count disagreed with the expected consumers.
    pub count_mismatches: u64,
}

/// What a notification did to the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifOutcome {
    /// Counted; more are expected.
    Pending { received: u32, expected: u32 },
    /// The last expected notification: free the request's blocks now.
    Freed,
    /// The request is not held (never registered, already freed or expired).
    Unrecognized,
}

/// A request that is already held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request {0:?} is already held")]
pub struct AlreadyHeld(pub String);

#[derive(Debug, Clone)]
struct Lease {
    expected: Option<u32>,
    received: u32,
    deadline: Instant,
}

/// P's per-request bookkeeping: expected consumers, notifications received and lease
/// deadlines. Pure: every method takes `now`; nothing reads the clock.
#[derive(Debug, Clone)]
pub struct LeaseTable {
    lease: Duration,
    held: HashMap<String, Lease>,
    stats: LeaseStats,
}

impl LeaseTable {
    /// `lease` is vLLM's `kv_lease_duration` (30 s by default there).
    pub fn new(lease: Duration) -> Self {
        LeaseTable { lease, held: HashMap::new(), stats: LeaseStats::default() }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Holds a request's blocks until `expected` notifications (or, when `None`, the
    /// count the first notification names) or until `now + lease`. Returns the deadline.
    pub fn register(
        &mut self,
        id: &str,
        expected: Option<u32>,
        now: Instant,
    ) -> Result<Instant, AlreadyHeld> {
        if self.held.contains_key(id) {
            return Err(AlreadyHeld(id.to_owned()));
        }
        let deadline = now + self.lease;
        self.held.insert(id.to_owned(), Lease { expected, received: 0, deadline });
        self.stats.registered += 1;
        Ok(deadline)
    }

    /// Counts one `"<id>:<count>"`. A request past its deadline but not yet swept by
    /// [`LeaseTable::expire`] still counts: its blocks were still held when it was read.
    pub fn on_notif(&mut self, id: &str, count: u32, _now: Instant) -> NotifOutcome {
        let Some(lease) = self.held.get_mut(id) else {
            self.stats.unrecognized += 1;
            warn!(request = id, "Potentially invalid KV blocks for unrecognized request");
            return NotifOutcome::Unrecognized;
        };
        let expected = *lease.expected.get_or_insert(count);
        if count != expected {
            self.stats.count_mismatches += 1;
            warn!(request = id, expected, named = count, "notification names a different consumer count");
        }
        lease.received += 1;
        if lease.received >= expected {
            self.held.remove(id);
            self.stats.freed_complete += 1;
            NotifOutcome::Freed
        } else {
            NotifOutcome::Pending { received: lease.received, expected }
        }
    }

    /// Extends each held id's lease to `max(deadline, now + 2/3 lease)`; returns how
    /// many were extended.
    pub fn on_heartbeat(&mut self, ids: &[String], now: Instant) -> usize {
        let target = now + heartbeat_extension(self.lease);
        let mut extended = 0;
        for id in ids {
            match self.held.get_mut(id) {
                Some(lease) => {
                    lease.deadline = lease.deadline.max(target);
                    extended += 1;
                }
                None => self.stats.heartbeat_unknown += 1,
            }
        }
        self.stats.heartbeat_extended += extended as u64;
        extended
    }

    /// Applies one message; returns the ids freed by it (at most one, for a notif).
    pub fn apply(&mut self, n: &Notification, now: Instant) -> Vec<String> {
        match n {
            Notification::Notif { p_request_id, count } => match self.on_notif(p_request_id, *count, now) {
                NotifOutcome::Freed => vec![p_request_id.clone()],
                _ => Vec::new(),
            },
            Notification::Heartbeat { ids } => {
                self.on_heartbeat(ids, now);
                Vec::new()
            }
            // A fallback request changes no lease; the caller publishes the requests. Push
            // messages are the push loop's to match.
            Notification::Fallback { .. } | Notification::PushReg(_) | Notification::PushFailed { .. } => {
                Vec::new()
            }
        }
    }

    /// Releases every request whose lease ended at or before `now`; returns their ids,
    /// sorted.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let mut gone: Vec<String> =
            self.held.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| id.clone()).collect();
        gone.sort();
        for id in &gone {
            self.held.remove(id);
            warn!(request = %id, "Releasing expired KV blocks");
        }
        self.stats.freed_expired += gone.len() as u64;
        gone
    }

    /// Stops holding a request at once (the decode side gave up on it: its blocks can go now
    /// rather than at lease expiry). Returns whether it was held.
    pub fn release(&mut self, id: &str) -> bool {
        self.held.remove(id).is_some()
    }

    /// The earliest deadline of any held request (when to call `expire` next).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.held.values().map(|l| l.deadline).min()
    }

    pub fn deadline(&self, id: &str) -> Option<Instant> {
        self.held.get(id).map(|l| l.deadline)
    }

    /// Notifications received so far for a held request.
    pub fn received(&self, id: &str) -> Option<u32> {
        self.held.get(id).map(|l| l.received)
    }

    pub fn is_held(&self, id: &str) -> bool {
        self.held.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn stats(&self) -> LeaseStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn s(x: u64) -> Duration {
        Duration::from_secs(x)
    }

    #[test]
    fn messages_match_vllm_strings() {
        let n = Notification::Notif { p_request_id: "cmpl-abc-0".into(), count: 2 };
        assert_eq!(n.encode().expect("encodes"), b"cmpl-abc-0:2");
        assert_eq!(Notification::parse(b"cmpl-abc-0:2").expect("parses"), n);
        // The id may contain ':'; the count is after the last one.
        let odd = Notification::parse(b"a:b:3").expect("parses");
        assert_eq!(odd, Notification::Notif { p_request_id: "a:b".into(), count: 3 });
        let hb = Notification::Heartbeat { ids: vec!["r1".into(), "r2".into()] };
        assert_eq!(hb.encode().expect("encodes"), b"HB:r1,r2");
        assert_eq!(Notification::parse(b"HB:r1,r2").expect("parses"), hb);
        assert_eq!(Notification::parse(b"HB:").expect("parses"), Notification::Heartbeat { ids: vec![] });
    }

    #[test]
    fn bad_messages_are_typed_errors() {
        for bad in [&b"no-count"[..], b":3", b"r:0", b"r:-1", b"r:x", b"\xff\xfe:1", b""] {
            assert!(
                matches!(Notification::parse(bad), Err(NotifyError::Malformed { .. })),
                "{:?} accepted",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(Notification::parse(&vec![b'a'; MAX_NOTIFY_BYTES + 1]).is_err());
        let enc_err = |n: Notification| matches!(n.encode(), Err(NotifyError::Encode { .. }));
        assert!(enc_err(Notification::Notif { p_request_id: "HB:x".into(), count: 1 }));
        // Push messages round-trip: the registration as msgpack behind vLLM's prefix.
        let reg = PushRegistration {
            request_id: "cmpl-1-d".into(),
            decode_engine_id: "d-engine".into(),
            decode_host: "127.0.0.1".into(),
            decode_port: 5601,
            decode_tp_size: 2,
            local_block_ids: vec![vec![3, 4, 5]],
            remote_engine_id: "p-engine".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5600,
            remote_tp_size: 8,
            remote_pp_size: 1,
            remote_request_id: Some("cmpl-1-0".into()),
        };
        let bytes = Notification::PushReg(Box::new(reg.clone())).encode().expect("encode");
        assert!(bytes.starts_with(b"PUSH_REG:"));
        assert_eq!(Notification::parse(&bytes).expect("parse"), Notification::PushReg(Box::new(reg)));
        let fail = Notification::PushFailed { d_request_id: "a:b".into(), count: 8 };
        assert_eq!(Notification::parse(&fail.encode().expect("encode")).expect("parse"), fail);
        assert!(Notification::parse(b"PUSH_REG:\xff").is_err(), "a broken registration is malformed");
        assert!(enc_err(Notification::Notif { p_request_id: String::new(), count: 1 }));
        assert!(enc_err(Notification::Notif { p_request_id: "r".into(), count: 0 }));
        assert!(enc_err(Notification::Heartbeat { ids: vec!["a,b".into()] }));
        // Nothing a receiver would refuse for its size leaves the sender.
        assert!(enc_err(Notification::Heartbeat { ids: vec!["x".repeat(MAX_NOTIFY_BYTES)] }));
        let at_limit = Notification::Heartbeat { ids: vec!["x".repeat(MAX_NOTIFY_BYTES - 3)] };
        assert_eq!(at_limit.encode().expect("exactly at the limit").len(), MAX_NOTIFY_BYTES);
        assert_eq!(NotifyTransport::default(), NotifyTransport::Ucx);
    }

    #[test]
    fn frees_after_the_named_count() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(LEASE);
        assert_eq!(t.register("r", None, t0), Ok(t0 + LEASE));
        assert_eq!(t.on_notif("r", 2, t0 + s(1)), NotifOutcome::Pending { received: 1, expected: 2 });
        assert_eq!(t.received("r"), Some(1));
        assert_eq!(t.on_notif("r", 2, t0 + s(2)), NotifOutcome::Freed);
        assert!(!t.is_held("r"));
        // A late duplicate is unrecognized, as in vLLM.
        assert_eq!(t.on_notif("r", 2, t0 + s(3)), NotifOutcome::Unrecognized);
        let st = t.stats();
        assert_eq!((st.registered, st.freed_complete, st.unrecognized, st.freed_expired), (1, 1, 1, 0));
    }

    #[test]
    fn registered_consumers_win_and_mismatches_are_counted() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(LEASE);
        t.register("r", Some(3), t0).expect("new");
        assert_eq!(t.on_notif("r", 2, t0), NotifOutcome::Pending { received: 1, expected: 3 });
        assert_eq!(t.on_notif("r", 3, t0), NotifOutcome::Pending { received: 2, expected: 3 });
        assert_eq!(t.on_notif("r", 3, t0), NotifOutcome::Freed);
        assert_eq!(t.stats().count_mismatches, 1);
        assert_eq!(t.register("r", None, t0), Ok(t0 + LEASE), "freed ids may be reused");
        assert_eq!(t.register("r", None, t0), Err(AlreadyHeld("r".into())));
    }

    #[test]
    fn leases_expire_and_heartbeats_extend_them() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(LEASE);
        t.register("a", None, t0).expect("new");
        t.register("b", None, t0).expect("new");
        assert_eq!(t.next_deadline(), Some(t0 + s(30)));
        assert!(t.expire(t0 + s(29)).is_empty());
        // At 25 s a heartbeat for `a` moves its deadline to 25 + 20 = 45 s.
        assert_eq!(t.on_heartbeat(&["a".into(), "ghost".into()], t0 + s(25)), 1);
        assert_eq!(t.deadline("a"), Some(t0 + s(45)));
        // A heartbeat never shortens a lease: max(45, 5 + 20) = 45.
        t.on_heartbeat(&["a".into()], t0 + s(5));
        assert_eq!(t.deadline("a"), Some(t0 + s(45)));
        assert_eq!(t.expire(t0 + s(30)), vec!["b".to_owned()], "deadline is inclusive");
        assert_eq!(t.on_notif("b", 1, t0 + s(31)), NotifOutcome::Unrecognized);
        assert_eq!(t.expire(t0 + s(44)), Vec::<String>::new());
        assert_eq!(t.expire(t0 + s(45)), vec!["a".to_owned()]);
        assert!(t.is_empty());
        let st = t.stats();
        assert_eq!(
            (st.freed_expired, st.unrecognized, st.heartbeat_extended, st.heartbeat_unknown),
            (2, 1, 2, 1)
        );
        assert_eq!(heartbeat_interval(LEASE), s(5));
        assert_eq!(heartbeat_extension(Duration::from_secs(1)), Duration::from_nanos(666_666_666));
    }

    #[test]
    fn a_notification_past_the_deadline_but_before_the_sweep_still_counts() {
        let t0 = Instant::now();
        let mut t = LeaseTable::new(LEASE);
        t.register("r", Some(1), t0).expect("new");
        assert_eq!(t.on_notif("r", 1, t0 + s(31)), NotifOutcome::Freed);
        assert!(t.expire(t0 + s(31)).is_empty());
    }

    proptest! {
        /// Every registered request ends freed exactly once (complete or expired),
        /// whatever the interleaving of notifications, heartbeats and sweeps.
        #[test]
        fn every_request_is_freed_exactly_once(
            ops in prop::collection::vec((0u8..4, 0usize..6, 1u32..4, 0u64..40), 1..200)
        ) {
            let t0 = Instant::now();
            let mut t = LeaseTable::new(LEASE);
            let mut now = t0;
            let mut registered = 0u64;
            let mut freed = 0u64;
            for (op, id, count, dt) in ops {
                now += Duration::from_millis(dt * 100);
                let id = format!("r{id}");
                match op {
                    0 => { if t.register(&id, None, now).is_ok() { registered += 1; } }
                    1 => { if t.on_notif(&id, count, now) == NotifOutcome::Freed { freed += 1; } }
                    2 => { t.on_heartbeat(&[id], now); }
                    _ => { freed += t.expire(now).len() as u64; }
                }
                prop_assert_eq!(registered, freed + t.len() as u64);
            }
            freed += t.expire(now + LEASE * 2).len() as u64;
            prop_assert_eq!(registered, freed);
            let st = t.stats();
            prop_assert_eq!(st.freed_complete + st.freed_expired, freed);
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = Notification::parse(&bytes);
        }

        #[test]
        fn notifs_round_trip(id in "[a-zA-Z0-9:_-]{1,40}", count in 1u32..) {
            prop_assume!(!id.starts_with(HEARTBEAT_PREFIX));
            let n = Notification::Notif { p_request_id: id, count };
            prop_assert_eq!(Notification::parse(&n.encode().expect("encodes")).expect("parses"), n);
        }
    }
}
