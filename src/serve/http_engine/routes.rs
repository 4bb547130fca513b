//! The engine's answers to the routes it shares with the proxy ([`OpenAiServer`]: `/health`,
//! `/metrics`, `/v1/models`, `/tokenize`, `/detokenize`; generation is `generate.rs`), its own
//! `/abort_requests`. The checks every JSON route shares are `checks.rs`; the router is
//! `mod.rs`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::answers::{authorized, error_response, json_response, unauthorized};
use super::api::{OpenAiServer, TokenizerRoute};
use super::checks::{check_model, rejected};
use super::generate::generate;
use super::state::EngineState;
use crate::serve::openai::{self, ApiError};
use crate::vocab::kinds::Endpoint;

impl OpenAiServer for EngineState {
    async fn generate(self: Arc<Self>, ep: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        generate(self, ep, headers, body).await
    }

    /// vLLM's tokenizer routes with vLLM's request and response fields (kvx's synthetic
    /// tokenizer: one token per whitespace-separated word; detokenizing gives text that
    /// tokenizes to the same count).
    async fn tokenizer(self: Arc<Self>, route: TokenizerRoute, headers: HeaderMap, body: Bytes) -> Response {
        if let Some(r) = rejected(&self, &headers) {
            return r;
        }
        let out = match route {
            TokenizerRoute::Tokenize => openai::tokenize(&body, self.cfg.max_model_len),
            TokenizerRoute::Detokenize => openai::detokenize(&body),
        };
        answer(&self, out)
    }

    async fn models(self: Arc<Self>, headers: HeaderMap) -> Response {
        models(&self, &headers)
    }

    /// 200 with an empty body while the engine can serve; 503 (empty body, as vLLM answers
    /// when its engine core is dead) once the KV backend cannot.
    fn health(&self) -> Response {
        match self.backend.health() {
            Ok(()) => StatusCode::OK.into_response(),
            Err(why) => {
                tracing::debug!(%why, "health check: unhealthy");
                StatusCode::SERVICE_UNAVAILABLE.into_response()
            }
        }
    }

    fn metrics_text(&self) -> String {
        self.render_metrics()
    }
}

fn models(st: &EngineState, headers: &HeaderMap) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), headers) {
        return unauthorized();
    }
    let m = st.cfg.model_name.as_str();
    let t = st.started_unix_s;
    let perm_id = format!("modelperm-{}", uuid::Uuid::new_v4().simple());
    let list = ModelList {
        object: "list",
        data: [ModelCard {
            id: m,
            object: "model",
            created: t,
            owned_by: "kvx",
            root: m,
            parent: (),
            max_model_len: st.cfg.max_model_len,
            permission: [ModelPermission {
                id: &perm_id,
                object: "model_permission",
                created: t,
                allow_create_engine: false,
                allow_sampling: true,
                allow_logprobs: true,
                allow_search_indices: false,
                allow_view: true,
                allow_fine_tuning: false,
                organization: "*",
                group: (),
                is_blocking: false,
            }],
        }],
    };
    axum::Json(list).into_response()
}

/// `/v1/models` in vLLM's field order.
#[derive(serde::Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: [ModelCard<'a>; 1],
}

#[derive(serde::Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    root: &'a str,
    parent: (),
    max_model_len: u64,
    permission: [ModelPermission<'a>; 1],
}

#[derive(serde::Serialize)]
struct ModelPermission<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    allow_create_engine: bool,
    allow_sampling: bool,
    allow_logprobs: bool,
    allow_search_indices: bool,
    allow_view: bool,
    allow_fine_tuning: bool,
    organization: &'static str,
    group: (),
    is_blocking: bool,
}

/// A tokenizer route's answer: its JSON once the request named this engine's model, else the
/// error (counted).
fn answer(st: &EngineState, out: Result<(Option<String>, Vec<u8>), ApiError>) -> Response {
    match out.and_then(|(model, out)| check_model(st, model.as_deref()).map(|()| out)) {
        Ok(b) => json_response(b),
        Err(e) => {
            st.metrics.errors.inc();
            error_response(&e)
        }
    }
}

/// `POST /abort_requests` `{"request_ids": [...]}` as vLLM's disaggregated setups use it: the
/// ids are engine-internal ids (a prefill handoff's `remote_request_id`). A prefill engine
/// frees their held KV blocks now rather than at lease expiry; the proxy sends this when a
/// request's decode leg failed, or its client left. kvx also takes the X-Request-Id a prefill
/// leg came with (a proxy whose client left before prefill answered knows no other), and that
/// of any generation request in progress, which then ends where stopping is safe
/// ([`LiveRequest`](super::state::LiveRequest)): a proxy whose client left before the decode
/// leg answered sends it.
/// Answers 200 with an empty body; unknown ids are ignored.
pub(super) async fn abort_requests(
    State(st): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(st.cfg.api_key.as_deref(), &headers) {
        return unauthorized();
    }
    #[derive(serde::Deserialize)]
    struct Abort {
        request_ids: Option<Vec<String>>,
    }
    match serde_json::from_slice::<Abort>(&body) {
        Ok(Abort { request_ids: Some(ids) }) => {
            for id in &ids {
                let was_live = st.abort_live(id);
                // An X-Request-Id names its leg's internal id; one already aborted (its
                // handler ended when the proxy left) has nothing left to free.
                let internal = match st.handoff_ids().by_x.get_mut(id) {
                    Some(h) if h.aborted => continue,
                    Some(h) => {
                        h.aborted = true;
                        h.internal_id.clone()
                    }
                    // A request in progress tells the backend itself as it ends.
                    None if was_live => continue,
                    None => id.clone(),
                };
                st.backend.abort(&internal);
            }
            tracing::debug!(count = ids.len(), "requests aborted by id");
            StatusCode::OK.into_response()
        }
        Ok(Abort { request_ids: None }) => {
            error_response(&ApiError::http(400, "Missing 'request_ids' in request body"))
        }
        Err(e) => error_response(&ApiError::http(400, format!("JSON decode error: {e}"))),
    }
}
