//! The checks every JSON route of the engine shares, generation's and the tokenizer's: the API
//! key, the content type and the model name.

use axum::http::HeaderMap;
use axum::response::Response;

use super::answers::{authorized, check_json_content_type, error_response, unauthorized};
use super::state::EngineState;
use crate::serve::openai::ApiError;

/// The checks every POST route with a JSON body shares (API key, content type): the answer
/// to a request that fails them.
pub(super) fn rejected(st: &EngineState, headers: &HeaderMap) -> Option<Response> {
    if !authorized(st.cfg.api_key.as_deref(), headers) {
        return Some(unauthorized());
    }
    check_json_content_type(headers).err().map(|e| {
        st.metrics.errors.inc();
        error_response(&e)
    })
}

pub(super) fn check_model(st: &EngineState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.cfg.model_name => {
            Err(ApiError::new(404, format!("The model `{m}` does not exist.")).with_param("model"))
        }
        _ => Ok(()),
    }
}
