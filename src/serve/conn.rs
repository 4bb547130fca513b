//! The HTTP/1.1 server loop the engine and the proxy run their routers on: an accept loop
//! over hyper's connection builder, so that no client holds a connection, and what it
//! buffers, without sending a request. A client has `--header-read-timeout` to send a
//! request's headers (and an idle kept-alive connection as long for its next request),
//! `--body-read-timeout` to send the whole body (else a JSON 408, and the connection is
//! closed), and at most `--max-connections` are open at once: one more is answered a JSON 503
//! and closed, without reading its request.
//!
//! Graceful shutdown as axum's: no new connection once `shutdown` resolves, and every request
//! in progress is answered; a connection with none in progress (a client stuck in its headers)
//! is closed after [`SHUTDOWN_GRACE`], so it cannot hold the process up.
//!
//! Owns connection lifetimes only (accept, read deadlines, the cap, shutdown); what a request
//! is answered belongs to the routers (`http_engine`, `proxy`).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse as _;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::openai::ApiError;
use crate::config::serve::{ConnLimits, MAX_CONNECTIONS};

/// After shutdown, how long a connection with no request in progress is given to end on its
/// own (a client reading the last bytes of an answer) before it is closed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);

/// How long a refused connection is given to read its 503 before it is closed.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// Refused connections lingering at once; past this a refused connection is closed at once,
/// so a flood of refusals holds no more than this many sockets beyond the cap.
const MAX_LINGERING_REFUSALS: usize = 256;

/// At most one warning per this while connections are being refused.
const REFUSAL_WARN_EVERY: Duration = Duration::from_secs(10);

/// How long accepting pauses after an error that is not about one connection (`EMFILE`: out
/// of file descriptors; closing connections frees some).
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then stops
/// accepting and waits for the open connections as the module docs say. Sets `TCP_NODELAY`
/// on every connection: SSE chunks must not wait for Nagle.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.clamp(1, MAX_CONNECTIONS)));
    let lingering = Arc::new(Semaphore::new(MAX_LINGERING_REFUSALS));
    let refusal = Bytes::from(refusal_answer(limits.max_connections));
    // Every connection holds a receiver: the sender's `closed()` is "all connections ended".
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut refused: u64 = 0;
    let mut warned: Option<Instant> = None;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                tracing::error!("accepting a connection failed: {e}; pausing {ACCEPT_BACKOFF:?}");
                tokio::select! {
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    () = &mut shutdown => break,
                }
            }
        };
        let _ = tcp.set_nodelay(true);
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tokio::spawn(connection(tcp, router.clone(), limits, slot, stop_rx.clone()));
            }
            Err(_) => {
                refused += 1;
                if warned.is_none_or(|t| t.elapsed() >= REFUSAL_WARN_EVERY) {
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        refused,
                        "connections at --max-connections: new ones are answered 503 until some close"
                    );
                    warned = Some(Instant::now());
                    refused = 0;
                }
                // Past the lingering cap the socket is dropped here: closed at once.
                if let Ok(linger) = lingering.clone().try_acquire_owned() {
                    tokio::spawn(refuse(tcp, refusal.clone(), linger));
                }
            }
        }
    }
    drop(listener);
    drop(stop_rx);
    let _ = stop_tx.send(true);
    stop_tx.closed().await;
    Ok(())
}

/// Errors that concern one connection only (the client gave up before it was accepted).
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

/// The raw answer to a connection past the cap: vLLM's JSON 503, and `connection: close`.
fn refusal_answer(max_connections: usize) -> Vec<u8> {
    let body = ApiError::new(
        503,
        format!(
            "too many connections: this server holds at most {max_connections} at once \
             (--max-connections); retry shortly"
        ),
    )
    .body();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// Answers a connection past the cap without reading its request, then reads (and drops)
/// what the client sent until it closes, for at most [`REFUSAL_LINGER`]: closing a socket with
/// unread data resets the connection, which could lose the answer on its way.
async fn refuse(mut tcp: TcpStream, answer: Bytes, _linger: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        tcp.write_all(&answer).await?;
        tcp.shutdown().await?;
        let mut sink = [0u8; 1024];
        while tcp.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// Serves one connection until it ends, or until shutdown as the module docs say.
async fn connection(
    tcp: TcpStream,
    router: Router,
    limits: ConnLimits,
    _slot: OwnedSemaphorePermit,
    mut stop: watch::Receiver<bool>,
) {
    let in_progress = Arc::new(AtomicUsize::new(0));
    let service = {
        let router = TowerToHyperService::new(router);
        let in_progress = in_progress.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let busy = Busy::new(&in_progress);
            let timed_out = Arc::new(AtomicBool::new(false));
            let req =
                req.map(|b| Body::new(ReadDeadline::new(b, limits.body_read_timeout, timed_out.clone())));
            let answer = hyper::service::Service::call(&router, req);
            async move {
                let resp = match answer.await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
                // The router answered a body that broke off at the deadline as a bad body:
                // say what happened, and close (the rest of the body would be read as a request).
                let resp = if timed_out.load(Ordering::Acquire) {
                    body_timeout_answer(limits.body_read_timeout)
                } else {
                    resp
                };
                Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, _busy: busy }))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    let conn = builder.serve_connection(TokioIo::new(tcp), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!("connection ended: {e}");
            }
            return;
        }
        // A dropped sender (the server's future dropped) stops the connection too.
        _ = stop.wait_for(|stop| *stop) => {}
    }
    // Answers the request in progress, if any, then closes; closes an idle connection now.
    conn.as_mut().graceful_shutdown();
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = tokio::time::sleep(SHUTDOWN_GRACE) => {
                if in_progress.load(Ordering::Acquire) == 0 {
                    return;
                }
            }
        }
    }
}

/// JSON 408 for a body that did not arrive within `limit`, closing the connection.
fn body_timeout_answer(limit: Duration) -> Response<Body> {
    let e = ApiError::http(
        408,
        format!("the request body did not arrive within {limit:?} of its headers (--body-read-timeout)"),
    );
    let mut r = (StatusCode::REQUEST_TIMEOUT, e.body()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Counts a request in progress on its connection, from its headers until its answer's body
/// is done (or dropped).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request counted in progress while it is sent.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request body ran past `--body-read-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?} (--body-read-timeout)")]
struct BodyReadTimeout(Duration);

/// A request body that fails once its deadline passes before its end has arrived, and says
/// so in `timed_out`.
struct ReadDeadline {
    inner: Incoming,
    limit: Duration,
    deadline: tokio::time::Instant,
    /// Made on the first wait only: most bodies are already whole when the handler reads them.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl ReadDeadline {
    fn new(inner: Incoming, limit: Duration, timed_out: Arc<AtomicBool>) -> Self {
        Self { inner, limit, deadline: tokio::time::Instant::now() + limit, sleep: None, timed_out }
    }
}

impl http_body::Body for ReadDeadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = &mut *self;
        if this.timed_out.load(Ordering::Acquire) {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            this.timed_out.store(true, Ordering::Release);
            return Poll::Ready(Some(Err(BodyReadTimeout(this.limit).into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
