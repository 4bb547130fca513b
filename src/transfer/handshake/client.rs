//! The decode-side fetch: ask a prefill engine's side channel for one or more ranks'
//! metadata, as vLLM's `_nixl_handshake` does, with kvx's checks.
//!
//! One REQ socket per endpoint serves all requested ranks. REQ is a strict
//! send/receive state machine: after a timeout it can neither send nor receive again, so
//! the socket is dropped and recreated before a retry. Sockets set `IMMEDIATE`, so a send
//! to a peer that is not up times out as "no connection" instead of queueing silently,
//! which lets the error say whether the peer was unreachable or reachable but silent.
//! Retries back off exponentially within a total deadline.
//!
//! Order of checks (vLLM's two-phase decode, then kvx's): payload map, compatibility
//! hash (a mismatch names the differing factors when the peer is kvx), kvx tag and
//! metadata, consistency of the advertised factors with the hash, the rank answered, and
//! finally the caller's `validate` hook (the planning core's TP/block/layout rules).
//!
//! Owns: REQ sockets and the retry policy. Must not call UCX or interpret layouts.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::debug;

use super::compat::{self, CompatFactors};
use super::meta::{self, AgentMetadata, KvxMetadata};
use super::wire::{self, Framing, MetaRequest, Payload, Reply};
use super::{HandshakeError, ZmqFailure, zmq_context};

/// Largest message libzmq accepts on the REQ socket. Twice the codec's limit, so a frame
/// moderately over the limit reaches the codec and gets a precise error, while a peer
/// streaming gigabytes is cut off by libzmq before it is buffered.
const REQ_MAX_MSG_BYTES: i64 = 2 * wire::MAX_REPLY_FRAME_BYTES as i64;

/// Reported before each retry (for logs, progress and tests that synchronise on it).
#[derive(Debug, Clone)]
pub struct RetryEvent {
    pub endpoint: String,
    /// Attempts made so far (1 after the first failure).
    pub attempt: u32,
    /// Why the attempt failed.
    pub reason: String,
    /// Wait before the next attempt.
    pub backoff: Duration,
}

/// Called before each retry of a fetch.
pub type RetryHook = Arc<dyn Fn(&RetryEvent) + Send + Sync>;

/// Timeouts, retry policy and framing of a fetch.
#[derive(Clone)]
pub struct FetchOptions {
    /// Longest wait for one attempt (connect and reply); vLLM's `RCVTIMEO` is 5 s.
    pub attempt_timeout: Duration,
    /// Longest wait overall, retries included.
    pub deadline: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub framing: Framing,
    /// Called before each retry.
    pub on_retry: Option<RetryHook>,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            attempt_timeout: Duration::from_secs(5),
            deadline: Duration::from_secs(15),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(1),
            framing: Framing::V0_33,
            on_retry: None,
        }
    }
}

impl fmt::Debug for FetchOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FetchOptions")
            .field("attempt_timeout", &self.attempt_timeout)
            .field("deadline", &self.deadline)
            .field("backoff_initial", &self.backoff_initial)
            .field("backoff_max", &self.backoff_max)
            .field("framing", &self.framing)
            .field("on_retry", &self.on_retry.is_some())
            .finish()
    }
}

/// One rank's reply, before any interpretation of the metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct RawReply {
    pub pp_rank: u32,
    pub tp_rank: u32,
    pub reply: Reply,
    /// Socket setup (first rank only), connect, request and reply frames.
    pub latency: Duration,
    /// Attempts this rank took (1 when the first succeeded).
    pub attempts: u32,
}

/// A kvx peer's metadata for one rank, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerMetadata {
    pub endpoint: String,
    pub pp_rank: u32,
    pub tp_rank: u32,
    pub compat_hash: String,
    pub metadata: KvxMetadata,
    pub factors: CompatFactors,
    pub framing: Framing,
    pub peer_clock_s: Option<f64>,
    /// Connect + request + decode and checks (excluding the caller's rkey unpacking).
    pub latency: Duration,
    pub attempts: u32,
}

/// Fetches metadata from side channels.
#[derive(Debug, Clone, Default)]
pub struct HandshakeClient {
    opts: FetchOptions,
}

enum Failure {
    /// Worth a retry with a fresh socket.
    Transient(Transient),
    Fatal(HandshakeError),
}

#[derive(Debug, Clone, Copy)]
enum Transient {
    NotConnected,
    NoReply,
}

impl HandshakeClient {
    pub fn new(opts: FetchOptions) -> Self {
        HandshakeClient { opts }
    }

    pub fn options(&self) -> &FetchOptions {
        &self.opts
    }

    /// Fetches and checks one rank's metadata from a kvx peer.
    ///
    /// `local` is this side's compatibility factors (`None` skips the hash check, like
    /// vLLM's `enforce_handshake_compat=false`); `validate` is the caller's rule check,
    /// whose message is surfaced in [`HandshakeError::Rejected`].
    pub fn fetch_metadata<E, F>(
        &self,
        endpoint: &str,
        pp_rank: u32,
        tp_rank: u32,
        local: Option<&CompatFactors>,
        validate: F,
    ) -> Result<PeerMetadata, HandshakeError>
    where
        E: fmt::Display,
        F: Fn(&KvxMetadata) -> Result<(), E>,
    {
        let mut all = self.fetch_metadata_many(endpoint, &[(pp_rank, tp_rank)], local, validate)?;
        all.pop().ok_or_else(|| HandshakeError::PeerError {
            endpoint: endpoint.to_owned(),
            message: "no reply".to_owned(),
        })
    }

    /// [`HandshakeClient::fetch_metadata`] for several `(pp_rank, tp_rank)` of one
    /// engine over one connection, as vLLM does for the ranks a decode rank reads from.
    pub fn fetch_metadata_many<E, F>(
        &self,
        endpoint: &str,
        ranks: &[(u32, u32)],
        local: Option<&CompatFactors>,
        validate: F,
    ) -> Result<Vec<PeerMetadata>, HandshakeError>
    where
        E: fmt::Display,
        F: Fn(&KvxMetadata) -> Result<(), E>,
    {
        let local_hash = local.map(CompatFactors::hash_hex);
        let raws = self.fetch_raw_many(endpoint, ranks)?;
        raws.into_iter()
            .map(|raw| {
                let t0 = Instant::now();
                let mut peer = check_reply(endpoint, &raw, local, local_hash.as_deref())?;
                validate(&peer.metadata).map_err(|e| HandshakeError::Rejected {
                    endpoint: endpoint.to_owned(),
                    pp_rank: raw.pp_rank,
                    tp_rank: raw.tp_rank,
                    message: e.to_string(),
                })?;
                peer.latency = raw.latency + t0.elapsed();
                Ok(peer)
            })
            .collect()
    }

    /// One rank's reply frames, decoded only as far as the payload map.
    pub fn fetch_raw(&self, endpoint: &str, pp_rank: u32, tp_rank: u32) -> Result<RawReply, HandshakeError> {
        let mut all = self.fetch_raw_many(endpoint, &[(pp_rank, tp_rank)])?;
        all.pop().ok_or_else(|| HandshakeError::PeerError {
            endpoint: endpoint.to_owned(),
            message: "no reply".to_owned(),
        })
    }

    /// Replies for several ranks over one REQ socket, retrying within the deadline.
    pub fn fetch_raw_many(
        &self,
        endpoint: &str,
        ranks: &[(u32, u32)],
    ) -> Result<Vec<RawReply>, HandshakeError> {
        let start = Instant::now();
        let deadline = start + self.opts.deadline;
        let mut backoff = self.opts.backoff_initial;
        let mut total_attempts = 0u32;
        let mut out = Vec::with_capacity(ranks.len());
        let mut sock: Option<zmq::Socket> = None;
        for &(pp_rank, tp_rank) in ranks {
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                total_attempts += 1;
                let t0 = Instant::now();
                let s = match &sock {
                    Some(s) => s,
                    None => sock.insert(self.open(endpoint)?),
                };
                let request = MetaRequest { framing: self.opts.framing, pp_rank, tp_rank }.encode();
                let attempt_end = (t0 + self.opts.attempt_timeout).min(deadline);
                match exchange(s, endpoint, &request, attempt_end) {
                    Ok(frames) => {
                        let reply = Reply::decode(&frames).map_err(|source| HandshakeError::Wire {
                            endpoint: endpoint.to_owned(),
                            source,
                        })?;
                        out.push(RawReply { pp_rank, tp_rank, reply, latency: t0.elapsed(), attempts });
                        break;
                    }
                    Err(Failure::Fatal(e)) => return Err(e),
                    Err(Failure::Transient(kind)) => {
                        // REQ cannot recover from a missed reply: start over with a new socket.
                        sock = None;
                        let now = Instant::now();
                        if now + backoff >= deadline {
                            let waited = now - start;
                            return Err(match kind {
                                Transient::NotConnected => HandshakeError::NotConnected {
                                    endpoint: endpoint.to_owned(),
                                    waited,
                                    attempts: total_attempts,
                                },
                                // ZMQ queues a request for a peer it never reached as it does
                                // for one that stays silent: a TCP connect tells them apart.
                                Transient::NoReply => match tcp_unreachable(endpoint) {
                                    Some(why) => HandshakeError::Unreachable {
                                        endpoint: endpoint.to_owned(),
                                        why,
                                        waited,
                                        attempts: total_attempts,
                                    },
                                    None => HandshakeError::NoReply {
                                        endpoint: endpoint.to_owned(),
                                        pp_rank,
                                        tp_rank,
                                        waited,
                                        attempts: total_attempts,
                                    },
                                },
                            });
                        }
                        let event = RetryEvent {
                            endpoint: endpoint.to_owned(),
                            attempt: total_attempts,
                            reason: match kind {
                                Transient::NotConnected => "not connected".to_owned(),
                                Transient::NoReply => "no reply".to_owned(),
                            },
                            backoff,
                        };
                        debug!(?event, "handshake retry");
                        if let Some(cb) = &self.opts.on_retry {
                            cb(&event);
                        }
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(self.opts.backoff_max);
                    }
                }
            }
        }
        Ok(out)
    }

    fn open(&self, endpoint: &str) -> Result<zmq::Socket, HandshakeError> {
        let zerr = |op| ZmqFailure::of(op, endpoint);
        let s = zmq_context().socket(zmq::REQ).map_err(zerr("socket"))?;
        s.set_linger(0).map_err(zerr("setsockopt LINGER"))?;
        s.set_immediate(true).map_err(zerr("setsockopt IMMEDIATE"))?;
        s.set_maxmsgsize(REQ_MAX_MSG_BYTES).map_err(zerr("setsockopt MAXMSGSIZE"))?;
        s.connect(endpoint).map_err(zerr("connect"))?;
        Ok(s)
    }
}

fn remaining_ms(until: Instant) -> i32 {
    let left = until.saturating_duration_since(Instant::now());
    // 0 would mean "don't wait" for SNDTIMEO/RCVTIMEO; wait at least 1 ms.
    i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)
}

fn exchange(
    s: &zmq::Socket,
    endpoint: &str,
    request: &[u8],
    until: Instant,
) -> Result<Vec<Vec<u8>>, Failure> {
    let fatal = |op| {
        let failure = ZmqFailure::of(op, endpoint);
        move |source| Failure::Fatal(failure(source).into())
    };
    s.set_sndtimeo(remaining_ms(until)).map_err(fatal("setsockopt SNDTIMEO"))?;
    match s.send(request, 0) {
        Ok(()) => {}
        Err(zmq::Error::EAGAIN) => return Err(Failure::Transient(Transient::NotConnected)),
        Err(e) => return Err(fatal("send")(e)),
    }
    s.set_rcvtimeo(remaining_ms(until)).map_err(fatal("setsockopt RCVTIMEO"))?;
    match s.recv_multipart(0) {
        Ok(frames) => Ok(frames),
        Err(zmq::Error::EAGAIN) => Err(Failure::Transient(Transient::NoReply)),
        Err(e) => Err(fatal("recv")(e)),
    }
}

/// Hash first, then metadata, as vLLM decodes; then kvx's own consistency checks.
fn check_reply(
    endpoint: &str,
    raw: &RawReply,
    local: Option<&CompatFactors>,
    local_hash: Option<&str>,
) -> Result<PeerMetadata, HandshakeError> {
    let (compat_hash, bytes) = match &raw.reply.payload {
        Payload::Error(message) => {
            return Err(HandshakeError::PeerError {
                endpoint: endpoint.to_owned(),
                message: message.clone(),
            });
        }
        Payload::Meta { compatibility_hash, agent_metadata_bytes } => {
            (compatibility_hash, agent_metadata_bytes)
        }
    };
    let is_kvx = meta::is_kvx(bytes);
    if let (Some(local), Some(local_hash)) = (local, local_hash)
        && compat_hash != local_hash
    {
        let diffs = is_kvx
            .then(|| KvxMetadata::decode(bytes).ok()?.factors().ok())
            .flatten()
            .map(|remote| compat::diff(local, &remote));
        return Err(HandshakeError::HashMismatch {
            endpoint: endpoint.to_owned(),
            local: local_hash.to_owned(),
            remote: compat_hash.clone(),
            diffs,
        });
    }
    if !is_kvx {
        let kind = AgentMetadata::decode(bytes).map_or("undecodable", |m| m.kind());
        return Err(HandshakeError::NotKvx { endpoint: endpoint.to_owned(), kind });
    }
    let wire_err = |source| HandshakeError::Wire { endpoint: endpoint.to_owned(), source };
    let metadata = KvxMetadata::decode(bytes).map_err(wire_err)?;
    let factors = metadata.factors().map_err(wire_err)?;
    let computed = factors.hash_hex();
    if &computed != compat_hash {
        return Err(HandshakeError::InconsistentHash {
            endpoint: endpoint.to_owned(),
            claimed: compat_hash.clone(),
            computed,
        });
    }
    if (metadata.pp_rank, metadata.tp_rank) != (raw.pp_rank, raw.tp_rank) {
        return Err(HandshakeError::Rejected {
            endpoint: endpoint.to_owned(),
            pp_rank: raw.pp_rank,
            tp_rank: raw.tp_rank,
            message: format!(
                "the peer answered with the metadata of (pp_rank {}, tp_rank {})",
                metadata.pp_rank, metadata.tp_rank
            ),
        });
    }
    Ok(PeerMetadata {
        endpoint: endpoint.to_owned(),
        pp_rank: raw.pp_rank,
        tp_rank: raw.tp_rank,
        compat_hash: compat_hash.clone(),
        metadata,
        factors,
        framing: raw.reply.framing,
        peer_clock_s: raw.reply.peer_clock_s,
        latency: raw.latency,
        attempts: raw.attempts,
    })
}

/// Why a `tcp://HOST:PORT` endpoint cannot be reached by TCP (`connect timed out`, `no route
/// to host`, `connection refused`, a name that does not resolve), or `None` when a connection
/// opens (or the endpoint is not TCP).
fn tcp_unreachable(endpoint: &str) -> Option<String> {
    let addr = endpoint.strip_prefix("tcp://")?;
    let addrs: Vec<std::net::SocketAddr> = match std::net::ToSocketAddrs::to_socket_addrs(addr) {
        Ok(a) => a.collect(),
        Err(e) => return Some(format!("{addr} does not resolve: {e}")),
    };
    let mut last = None;
    for a in &addrs {
        match std::net::TcpStream::connect_timeout(a, Duration::from_secs(1)) {
            Ok(_) => return None,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => last = Some("connect timed out".to_owned()),
            Err(e) => last = Some(e.to_string()),
        }
    }
    last
}
