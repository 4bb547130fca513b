//! The pooled HTTP/1.1 client the proxy and the load generator use (hyper-util's pooled
//! client directly: no URL re-parsing or middleware on the hot path).
//!
//! Owns connection settings only (keep-alive pool, `TCP_NODELAY`, connect timeout).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Keep-alive pooled client sending fully buffered bodies.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How long a pooled connection may sit idle and still be used: shorter than the idle close
/// of the servers it talks to (uvicorn's 5 s keep-alive under vLLM, kvx's
/// `--header-read-timeout`, 10 s by default), so a request is never written to a connection
/// the server is closing at that moment (which fails it, unretried).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// A client with an unlimited keep-alive pool per backend (as the toy proxy's httpx
/// `Limits(max_connections=None, max_keepalive_connections=None)`).
pub fn http_client(connect_timeout: Option<Duration>) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(connect_timeout);
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(usize::MAX)
        .build(connector)
}
