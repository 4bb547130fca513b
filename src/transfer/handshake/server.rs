//! The prefill-side listener: one thread owning a ZMQ ROUTER that answers metadata
//! requests from a table of `(pp_rank, tp_rank) -> payload bytes`.
//!
//! It speaks 0.33 framing to 3-element requests and 0.19 framing to 2-element ones. A bad
//! request is logged, counted and answered with a `{kvx_error: ...}` payload so a REQ
//! client is not left waiting; frames without a REQ envelope are dropped. Nothing a peer
//! sends stops the thread. Stopping is prompt: the thread polls the ROUTER together with
//! an inproc control socket, so `stop()` wakes it at once instead of waiting out a
//! receive timeout as vLLM's 1 s `RCVTIMEO` loop does.
//!
//! Owns: the ROUTER socket and its thread. Must not build metadata (callers publish it).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{debug, warn};

use super::wire::{Framing, MetaRequest, Payload, Reply};
use super::{HandshakeError, ZmqFailure, zmq_context};

/// Largest inbound message libzmq accepts on the ROUTER before it drops the peer; the
/// codec's own limit (`wire::MAX_REQUEST_FRAME_BYTES`) is far below this and answers with
/// an error, this is the backstop against a peer streaming gigabytes.
const ROUTER_MAX_MSG_BYTES: i64 = 64 << 10;
/// How often the thread re-checks for a dropped handle if no control message arrives.
const POLL_MS: i64 = 1000;

/// Payloads served per (pp_rank, tp_rank). Cheap to clone; publish before or while serving.
#[derive(Debug, Clone, Default)]
pub struct PayloadTable(Arc<RwLock<RankPayloads>>);

type RankPayloads = HashMap<(u32, u32), Arc<Vec<u8>>>;

impl PayloadTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves `payload` (an encoded [`Payload`]) for `(pp_rank, tp_rank)`.
    pub fn publish(&self, pp_rank: u32, tp_rank: u32, payload: Vec<u8>) {
        self.0.write().unwrap_or_else(PoisonError::into_inner).insert((pp_rank, tp_rank), Arc::new(payload));
    }

    pub fn remove(&self, pp_rank: u32, tp_rank: u32) {
        self.0.write().unwrap_or_else(PoisonError::into_inner).remove(&(pp_rank, tp_rank));
    }

    fn get(&self, pp_rank: u32, tp_rank: u32) -> Option<Arc<Vec<u8>>> {
        self.0.read().unwrap_or_else(PoisonError::into_inner).get(&(pp_rank, tp_rank)).cloned()
    }

    fn ranks(&self) -> Vec<(u32, u32)> {
        let mut r: Vec<_> = self.0.read().unwrap_or_else(PoisonError::into_inner).keys().copied().collect();
        r.sort_unstable();
        r
    }
}

/// Counters of what the listener has seen.
#[derive(Debug, Default)]
struct Counters {
    served: AtomicU64,
    refused: AtomicU64,
    dropped: AtomicU64,
}

/// A snapshot of the listener's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ServerStats {
    /// Requests answered with metadata.
    pub served: u64,
    /// Requests answered with an error payload (bad frame, unknown rank).
    pub refused: u64,
    /// Messages dropped without a reply (no REQ envelope).
    pub dropped: u64,
}

/// A running handshake listener. Dropping it stops the thread.
pub struct HandshakeServer {
    endpoint: String,
    control: zmq::Socket,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    table: PayloadTable,
}

impl HandshakeServer {
    /// Binds a ROUTER at `bind` (e.g. `tcp://127.0.0.1:0` or `ipc:///path`) and serves
    /// `table` from a new thread. Bind errors are returned here, not from the thread.
    pub fn start(bind: &str, table: PayloadTable) -> Result<Self, HandshakeError> {
        let ctx = zmq_context();
        let zerr = |op| ZmqFailure::of(op, bind);
        let router = ctx.socket(zmq::ROUTER).map_err(zerr("socket"))?;
        router.set_linger(0).map_err(zerr("setsockopt LINGER"))?;
        router.set_maxmsgsize(ROUTER_MAX_MSG_BYTES).map_err(zerr("setsockopt MAXMSGSIZE"))?;
        router.bind(bind).map_err(zerr("bind"))?;
        let endpoint = match router.get_last_endpoint().map_err(zerr("getsockopt LAST_ENDPOINT"))? {
            Ok(s) => s,
            Err(_) => bind.to_owned(),
        };
        let control_addr = format!("inproc://kvx-handshake-control-{}", uuid::Uuid::new_v4());
        let control_rx = ctx.socket(zmq::PAIR).map_err(zerr("socket"))?;
        control_rx.bind(&control_addr).map_err(zerr("bind control"))?;
        let control = ctx.socket(zmq::PAIR).map_err(zerr("socket"))?;
        control.set_linger(0).map_err(zerr("setsockopt LINGER"))?;
        control.set_sndtimeo(1000).map_err(zerr("setsockopt SNDTIMEO"))?;
        control.connect(&control_addr).map_err(zerr("connect control"))?;

        let counters = Arc::new(Counters::default());
        let thread = {
            let (counters, table, endpoint) = (counters.clone(), table.clone(), endpoint.clone());
            std::thread::Builder::new()
                .name("kvx-handshake".into())
                .spawn(move || serve(&router, &control_rx, &table, &counters, &endpoint))
                .map_err(|e| {
                    HandshakeError::Config(crate::error::ConfigError::new(
                        "(system)",
                        format!("cannot start the handshake thread: {e}"),
                    ))
                })?
        };
        debug!(%endpoint, "handshake listener up");
        Ok(HandshakeServer { endpoint, control, thread: Some(thread), counters, table })
    }

    /// The endpoint actually bound, with the real port when bound to port 0.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The table being served (publish more ranks through it at any time).
    pub fn table(&self) -> &PayloadTable {
        &self.table
    }

    pub fn stats(&self) -> ServerStats {
        ServerStats {
            served: self.counters.served.load(Ordering::Relaxed),
            refused: self.counters.refused.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
        }
    }

    /// Stops the thread and waits for it; returns the final counters.
    pub fn stop(mut self) -> ServerStats {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        if let Some(thread) = self.thread.take() {
            if let Err(e) = self.control.send("stop", 0) {
                // The thread also exits on its own once the control peer is gone; this
                // only delays the stop by one poll period.
                warn!(error = %e, "could not signal the handshake thread");
            }
            if thread.join().is_err() {
                warn!(endpoint = %self.endpoint, "handshake thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for HandshakeServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeServer")
            .field("endpoint", &self.endpoint)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Drop for HandshakeServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn serve(
    router: &zmq::Socket,
    control: &zmq::Socket,
    table: &PayloadTable,
    counters: &Counters,
    endpoint: &str,
) {
    loop {
        let mut items = [router.as_poll_item(zmq::POLLIN), control.as_poll_item(zmq::POLLIN)];
        if let Err(e) = zmq::poll(&mut items, POLL_MS) {
            warn!(%endpoint, error = %e, "handshake poll failed; stopping");
            return;
        }
        if items[1].is_readable() {
            debug!(%endpoint, "handshake listener stopping");
            return;
        }
        if !items[0].is_readable() {
            continue;
        }
        // Drain everything queued before polling again.
        loop {
            match router.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => handle(router, frames, table, counters, endpoint),
                Err(zmq::Error::EAGAIN) => break,
                Err(zmq::Error::EINTR) => continue,
                Err(e) => {
                    warn!(%endpoint, error = %e, "handshake receive failed");
                    break;
                }
            }
        }
    }
}

fn handle(
    router: &zmq::Socket,
    frames: Vec<Vec<u8>>,
    table: &PayloadTable,
    counters: &Counters,
    endpoint: &str,
) {
    // A REQ peer's message is [identity, "", body]; the envelope ends at the first empty frame.
    let Some(delim) = frames.iter().position(Vec::is_empty) else {
        counters.dropped.fetch_add(1, Ordering::Relaxed);
        warn!(%endpoint, frames = frames.len(), "dropping a message without a REQ envelope");
        return;
    };
    let (envelope, body) = frames.split_at(delim + 1);
    // Refusals keep the request's framing when it could be read, so a client that infers
    // the peer's version from the frame count is not misled by an error.
    let answer = match body {
        [frame] => match MetaRequest::decode(frame) {
            Ok(req) => match table.get(req.pp_rank, req.tp_rank) {
                Some(payload) => Ok((req.framing, payload)),
                None => Err((
                    req.framing,
                    format!(
                        "no metadata for (pp_rank {}, tp_rank {}); this engine serves {:?}",
                        req.pp_rank,
                        req.tp_rank,
                        table.ranks()
                    ),
                )),
            },
            Err(e) => Err((Framing::V0_19, e.to_string())),
        },
        _ => Err((Framing::V0_19, format!("expected one request frame, got {}", body.len()))),
    };
    let mut out: Vec<Vec<u8>> = envelope.to_vec();
    match answer {
        Ok((framing, payload)) => {
            counters.served.fetch_add(1, Ordering::Relaxed);
            out.extend(Reply::encode_frames(framing, &payload, unix_seconds()));
        }
        Err((framing, reason)) => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            warn!(%endpoint, %reason, "refusing a handshake request");
            out.extend(Reply::encode_frames(framing, &Payload::Error(reason).encode(), unix_seconds()));
        }
    }
    if let Err(e) = router.send_multipart(out, zmq::DONTWAIT) {
        // The peer may have gone; ROUTER drops unroutable replies, nothing else to do.
        debug!(%endpoint, error = %e, "handshake reply not sent");
    }
}

/// The clock frame of 0.33 replies. vLLM sends `perf_counter()`, used only to estimate
/// a clock offset; kvx sends Unix time, which peers on other hosts can compare too.
fn unix_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_errors_are_returned_not_panicked() {
        let err = HandshakeServer::start("tcp://256.1.1.1:0", PayloadTable::new()).expect_err("bad address");
        assert!(matches!(err, HandshakeError::Zmq(ZmqFailure { op: "bind", .. })), "{err}");
        let ok = HandshakeServer::start("tcp://127.0.0.1:0", PayloadTable::new()).expect("binds");
        assert!(ok.endpoint().starts_with("tcp://127.0.0.1:"));
        assert!(!ok.endpoint().ends_with(":0"), "{}", ok.endpoint());
        assert_eq!(ok.stop(), ServerStats::default());
    }

    #[test]
    fn ranks_are_listed_sorted() {
        let t = PayloadTable::new();
        t.publish(0, 1, vec![1]);
        t.publish(0, 0, vec![0]);
        assert_eq!(t.ranks(), vec![(0, 0), (0, 1)]);
        t.remove(0, 0);
        assert_eq!(t.ranks(), vec![(0, 1)]);
    }
}
