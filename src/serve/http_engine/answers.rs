//! vLLM's HTTP answers and request checks that the engine and the proxy share: JSON error
//! bodies, the 404/405/413 answers, the API key and the JSON content type. Know nothing of an
//! engine's state.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::serve::openai::ApiError;

/// Turns an [`ApiError`] into vLLM's JSON error response.
pub fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], e.body()).into_response()
}

/// Turns axum's plain-text 413 (a body over `--max-body-size`) into a JSON error naming the
/// limit and the flag that raises it; every other response passes unchanged.
pub fn json_body_limit(limit: usize) -> impl Fn(Response) -> std::future::Ready<Response> + Clone {
    move |r: Response| {
        std::future::ready(if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            error_response(&ApiError::http(
                413,
                format!("Request body is larger than {limit} bytes (raise it with --max-body-size)"),
            ))
        } else {
            r
        })
    }
}

/// vLLM's answer to a route that does not exist (its `HTTPException` handler: the status
/// phrase as both message and type).
pub async fn not_found() -> Response {
    error_response(&ApiError::http(404, "Not Found"))
}

/// vLLM's answer to a known route called with the wrong method.
pub async fn method_not_allowed() -> Response {
    error_response(&ApiError::http(405, "Method Not Allowed"))
}

/// vLLM's `validate_json_request` on the generation and tokenizer routes: a body that is not
/// declared `application/json` (whatever it holds) is refused with a 400 before it is read.
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let media = ct.split(';').next().unwrap_or("").trim();
    if media.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ApiError::http(400, "Unsupported Media Type: Only 'application/json' is allowed"))
    }
}

/// Whether `Authorization: Bearer <key>` matches, as vLLM's auth middleware checks it.
pub fn authorized(expected: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(key) = expected else { return true };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|v| v == key)
}

/// vLLM's answer to a missing or wrong API key.
pub fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        r#"{"error":"Unauthorized"}"#,
    )
        .into_response()
}

pub(super) fn json_response(body: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response()
}
