//! The HTTP surface the engine and the proxy share: vLLM's OpenAI-compatible routes, `/health`
//! and `/metrics`, routed to any [`OpenAiServer`] by [`api_router`], with vLLM's answers to an
//! unknown path or method and a JSON 413 past the body limit. Each server adds its own routes
//! (the engine `/abort_requests`, the proxy `/healthcheck`) and answers the shared ones its way.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use super::answers::{json_body_limit, method_not_allowed, not_found};
use crate::serve::metrics::PROMETHEUS_CONTENT_TYPE;
use crate::vocab::kinds::Endpoint;

/// The two tokenizer routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerRoute {
    Tokenize,
    Detokenize,
}

impl TokenizerRoute {
    pub fn path(self) -> &'static str {
        match self {
            TokenizerRoute::Tokenize => "/tokenize",
            TokenizerRoute::Detokenize => "/detokenize",
        }
    }
}

/// A server that answers vLLM's OpenAI-compatible routes: the engine and the proxy.
pub trait OpenAiServer: Send + Sync + 'static {
    /// `POST /v1/completions` and `POST /v1/chat/completions`.
    fn generate(
        self: Arc<Self>,
        ep: Endpoint,
        headers: HeaderMap,
        body: Bytes,
    ) -> impl Future<Output = Response> + Send;

    /// `POST /tokenize` and `POST /detokenize`.
    fn tokenizer(
        self: Arc<Self>,
        route: TokenizerRoute,
        headers: HeaderMap,
        body: Bytes,
    ) -> impl Future<Output = Response> + Send;

    /// `GET /v1/models`.
    fn models(self: Arc<Self>, headers: HeaderMap) -> impl Future<Output = Response> + Send;

    /// `GET /health`.
    fn health(&self) -> Response;

    /// The Prometheus exposition `GET /metrics` answers.
    fn metrics_text(&self) -> String;
}

/// `own`, the server's own routes, with the shared ones, vLLM's 404 and 405 answers, and a
/// JSON 413 for a body over `limit` bytes (`--max-body-size`). Pure: no sockets, testable with
/// `tower::ServiceExt::oneshot`.
pub fn api_router<S: OpenAiServer>(state: Arc<S>, limit: usize, own: Router<Arc<S>>) -> Router {
    let generate = |ep: Endpoint| {
        post(move |State(s): State<Arc<S>>, headers: HeaderMap, body: Bytes| s.generate(ep, headers, body))
    };
    let tokenizer = |route: TokenizerRoute| {
        post(move |State(s): State<Arc<S>>, headers: HeaderMap, body: Bytes| {
            s.tokenizer(route, headers, body)
        })
    };
    own.route(Endpoint::Completions.path(), generate(Endpoint::Completions))
        .route(Endpoint::Chat.path(), generate(Endpoint::Chat))
        .route("/v1/models", get(|State(s): State<Arc<S>>, headers: HeaderMap| s.models(headers)))
        .route(TokenizerRoute::Tokenize.path(), tokenizer(TokenizerRoute::Tokenize))
        .route(TokenizerRoute::Detokenize.path(), tokenizer(TokenizerRoute::Detokenize))
        .route("/health", get(|State(s): State<Arc<S>>| async move { s.health() }))
        .route(
            "/metrics",
            get(|State(s): State<Arc<S>>| async move {
                ([(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)], s.metrics_text()).into_response()
            }),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::map_response(json_body_limit(limit)))
        .with_state(state)
}
