//! `kvx serve-engine`: a vLLM-shaped OpenAI-compatible engine (prefill or decode role) with
//! no model behind it. Prefill time comes from a cost model, tokens are synthetic and emitted
//! at a fixed inter-token latency, and the KV side is whatever
//! [`KvBackend`](super::kv::KvBackend) it is given.
//!
//! Owns the engine's HTTP surface (`router`), request lifecycle (admission, prefill/load,
//! generation, abort on disconnect or by X-Request-Id), its `/metrics` (vLLM's families with vLLM's names, types,
//! labels and buckets, plus kvx's own `kvx:*`) and the `Server-Timing` stages of every answer
//! (`serve::timing`). Must not know how KV moves: all of that is behind the backend. Wire
//! shapes come from `serve::openai`.
//!
//! # Token pacing
//! A decode step of a real engine takes 10-30 ms (an 8B model on one H100 at moderate batch
//! sizes is near the low end, 70B at TP 4-8 near the high end), so `kvx serve-engine`
//! emits tokens [`DEFAULT_ITL`] apart by default: clients such as `vllm bench serve` or
//! aiperf then report an inter-token latency and TPOT of that size rather than the zero of a
//! response written in one piece. The first token of a decode engine that loaded its KV from
//! a prefill engine also takes one step (vLLM recomputes the last prompt token on D to get
//! its logits); after a local prefill it follows the prefill directly. `--itl-ms 0` turns
//! pacing off, and the engine says so in its `Server-Timing` (`itl;dur=0`).
//!
//! # Layout
//! ```text
//! mod.rs         router(state), serve(listener, state, shutdown), serve_router
//! config.rs      HttpEngineConfig, Role, DEFAULT_ITL, DEFAULT_BODY_LIMIT
//! answers.rs     vLLM's error bodies and request checks, shared with the proxy
//! api.rs         the routes shared with the proxy (OpenAiServer, api_router)
//! state.rs       EngineState: backend, admission, counters, abort-by-id bookkeeping
//! exposition.rs  /metrics: vLLM's families and kvx's own
//! routes.rs      the engine's OpenAiServer (/health, /metrics, /v1/models, /tokenize,
//!                /detokenize) and /abort_requests
//! inflight.rs    a running request's permit and gauges (abort on drop), token sleeps
//! generate.rs    /v1/completions and /v1/chat/completions: admission, KV phase, answer
//! stream.rs      the SSE body of a streaming answer, paced token by token
//! ```

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::routing::post;
use tokio::net::TcpListener;

use super::conn;
use crate::config::serve::ConnLimits;

mod answers;
mod api;
mod checks;
mod config;
mod exposition;
mod generate;
mod inflight;
mod routes;
mod state;
mod stream;

pub use answers::{
    authorized, check_json_content_type, error_response, json_body_limit, method_not_allowed, not_found,
    unauthorized,
};

pub use api::{OpenAiServer, TokenizerRoute, api_router};
pub use state::EngineState;

use routes::abort_requests;

/// The engine's routes: the shared ones ([`api_router`]) and `/abort_requests`. Pure: no
/// sockets, testable with `tower::ServiceExt::oneshot`.
pub fn router(state: Arc<EngineState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    api_router(state, limit, Router::new().route("/abort_requests", post(abort_requests)))
}

/// Serves `router` on `listener` with the default [`ConnLimits`] until `shutdown` resolves,
/// then drains open requests (`serve::conn`).
pub async fn serve_router(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    conn::serve(listener, router, ConnLimits::default(), shutdown).await
}

/// Runs the engine on `listener`, within its configured [`ConnLimits`], until `shutdown`
/// resolves.
pub async fn serve(
    listener: TcpListener,
    state: Arc<EngineState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.cfg.conn;
    conn::serve(listener, router(state), limits, shutdown).await
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use axum::body::Body;
    use axum::http::{HeaderMap, StatusCode, header};
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::config::serve::EngineIdentity;
    use crate::config::serve::HttpEngineConfig;
    use crate::serve::kv::NullKv;
    use crate::serve::openai::SSE_CONTENT_TYPE;
    use crate::vocab::kinds::Role;

    fn engine(role: Role) -> Arc<EngineState> {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "P0".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 1,
        });
        EngineState::new(HttpEngineConfig::new(role, "m"), Arc::new(kv))
    }

    async fn call(
        st: &Arc<EngineState>,
        method: &str,
        path: &str,
        body: &str,
    ) -> (StatusCode, HeaderMap, String) {
        let mut req = axum::http::Request::builder().method(method).uri(path).header("x-request-id", "abc");
        if method == "POST" {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Body::from(body.to_string())).expect("request");
        let resp = router(st.clone()).oneshot(req).await.expect("infallible");
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.expect("body").to_bytes();
        (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).expect("utf8"))
    }

    #[tokio::test]
    async fn prefill_role_hands_off_with_kv_params() {
        let st = engine(Role::Prefill);
        let body = r#"{"model":"m","prompt":"a b c d e f g h i j k l m n o p q","max_tokens":1,"stream":false,
            "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}"#;
        let (status, _, text) = call(&st, "POST", "/v1/completions", body).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["id"], "cmpl-abc");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let kv = &v["kv_transfer_params"];
        assert_eq!(kv["remote_block_ids"], serde_json::json!([[0, 1]]));
        assert_eq!(kv["remote_num_tokens"], 17);
        let rid = kv["remote_request_id"].as_str().expect("id");
        assert!(rid.starts_with("cmpl-abc-0-") && rid.len() == "cmpl-abc-0-".len() + 8, "{rid}");
        assert!(st.render_metrics().contains("kvx:kv_prefill_handoffs_total{model_name=\"m\"} 1.0"));
    }

    #[tokio::test]
    async fn decode_without_params_counts_the_silent_fallback() {
        let st = engine(Role::Decode);
        let (status, _, _) = call(&st, "POST", "/v1/completions", r#"{"prompt":"x y","max_tokens":3}"#).await;
        assert_eq!(status, StatusCode::OK);
        let m = st.render_metrics();
        assert!(m.contains("kvx:decode_local_prefill_total{model_name=\"m\",reason=\"missing\"} 1.0"), "{m}");
        assert!(m.contains("vllm:generation_tokens_total{model_name=\"m\",engine=\"0\"} 3.0"), "{m}");
        assert!(
            m.contains("kvx:kv_backend_info{backend=\"null\",kv_transfer=\"none\",role=\"decode\"} 1.0"),
            "{m}"
        );
    }

    #[tokio::test]
    async fn routes_and_errors() {
        let st = engine(Role::Decode);
        let (s, _, body) = call(&st, "GET", "/health", "").await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, ""));
        let (s, _, body) = call(&st, "GET", "/nope", "").await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        // vLLM 0.33's HTTPException handler: the status phrase is the type.
        assert_eq!(body, r#"{"error":{"message":"Not Found","type":"Not Found","param":null,"code":404}}"#);
        let (s, _, body) = call(&st, "GET", "/v1/completions", "").await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            body,
            r#"{"error":{"message":"Method Not Allowed","type":"Method Not Allowed","param":null,"code":405}}"#
        );
        let (s, _, body) = call(&st, "POST", "/v1/completions", "{not json").await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        let (s, _, body) = call(&st, "POST", "/v1/completions", r#"{"model":"other","prompt":"a"}"#).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert!(body.contains("The model `other` does not exist."));
        let (s, h, body) = call(&st, "GET", "/v1/models", "").await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "application/json");
        assert!(
            body.starts_with(r#"{"object":"list","data":[{"id":"m","object":"model","created":"#),
            "{body}"
        );
    }

    #[tokio::test]
    async fn streaming_chat_with_continuous_usage() {
        let st = engine(Role::Decode);
        let body = r#"{"messages":[{"role":"user","content":"hi you"}],"max_completion_tokens":2,"stream":true,
            "stream_options":{"include_usage":true,"continuous_usage_stats":true}}"#;
        let (s, h, text) = call(&st, "POST", "/v1/chat/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], SSE_CONTENT_TYPE);
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 5, "{text}");
        assert!(events[0].contains(r#""usage":{"prompt_tokens":2,"total_tokens":2,"completion_tokens":0},"prompt_token_ids":null"#), "{}", events[0]);
        assert!(
            events[1].contains(
                r#""token_ids":null}],"usage":{"prompt_tokens":2,"total_tokens":3,"completion_tokens":1}}"#
            ),
            "{}",
            events[1]
        );
        assert!(
            events[3].contains(
                r#""choices":[],"usage":{"prompt_tokens":2,"total_tokens":4,"completion_tokens":2}"#
            )
        );
        assert_eq!(events[4], "data: [DONE]");
    }

    #[tokio::test]
    async fn json_bodies_must_say_so_like_vllm() {
        let st = engine(Role::Decode);
        for ct in [Some("text/plain"), None, Some("application/x-www-form-urlencoded")] {
            let mut req = axum::http::Request::builder().method("POST").uri("/v1/completions");
            if let Some(ct) = ct {
                req = req.header("content-type", ct);
            }
            let req = req.body(Body::from(r#"{"prompt":"a b"}"#)).expect("request");
            let resp = router(st.clone()).oneshot(req).await.expect("infallible");
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{ct:?}");
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(
                std::str::from_utf8(&body).expect("utf8"),
                r#"{"error":{"message":"Unsupported Media Type: Only 'application/json' is allowed","type":"Bad Request","param":null,"code":400}}"#
            );
        }
        // A parameter after the media type is fine.
        let req = axum::http::Request::builder()
            .method("POST")
            .uri("/v1/completions")
            .header("content-type", "Application/JSON; charset=utf-8")
            .body(Body::from(r#"{"prompt":"a b","max_tokens":1}"#))
            .expect("request");
        assert_eq!(router(st.clone()).oneshot(req).await.expect("infallible").status(), StatusCode::OK);
        assert_eq!(
            st.render_metrics().matches("kvx:request_errors_total{model_name=\"m\"} 3.0").count(),
            1,
            "{}",
            st.render_metrics()
        );
    }

    /// Sends one request under its own X-Request-Id and returns its status.
    async fn call_as(st: &Arc<EngineState>, x_request_id: &str, path: &str, body: &str) -> StatusCode {
        let req = axum::http::Request::post(path)
            .header("x-request-id", x_request_id)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        router(st.clone()).oneshot(req).await.expect("infallible").status()
    }

    /// Polls the engine's metrics (every 5 ms, 5 s at most) until `line` is in them.
    async fn metrics_show(st: &EngineState, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !st.render_metrics().lines().any(|l| l == line) {
            assert!(Instant::now() < deadline, "no {line:?} in:\n{}", st.render_metrics());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abort_by_x_request_id_ends_requests_in_progress() {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "D0".into(),
            side_channel_host: "localhost".into(),
            side_channel_port: 5600,
            tp_size: 1,
        });
        let mut cfg = HttpEngineConfig::new(Role::Decode, "m");
        cfg.itl = Duration::from_millis(50);
        cfg.max_num_seqs = 1;
        let st = EngineState::new(cfg, Arc::new(kv));
        // 1,000 tokens 50 ms apart: 50 s unless aborted.
        let body = r#"{"model":"m","prompt":"a b","max_tokens":1000}"#;
        let start = |xid: &'static str| {
            let st = st.clone();
            tokio::spawn(async move { call_as(&st, xid, "/v1/completions", body).await })
        };
        let generating = start("leg-1");
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 1.0"#).await;
        let queued = start("leg-2");
        metrics_show(&st, r#"vllm:num_requests_waiting{model_name="m",engine="0"} 1.0"#).await;
        let abort = |id: &str| format!(r#"{{"request_ids":["{id}"]}}"#);
        // Waiting for admission: answered at once; the one generating goes on.
        assert_eq!(call_as(&st, "x", "/abort_requests", &abort("leg-2")).await, StatusCode::OK);
        let s =
            tokio::time::timeout(Duration::from_secs(1), queued).await.expect("within 1 s").expect("join");
        assert_eq!(s.as_u16(), 499);
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 1.0"#).await;
        // Generating a non-streaming answer: ended between its tokens, counted as an abort.
        assert_eq!(call_as(&st, "x", "/abort_requests", &abort("leg-1")).await, StatusCode::OK);
        let s = tokio::time::timeout(Duration::from_secs(1), generating)
            .await
            .expect("within 1 s")
            .expect("join");
        assert_eq!(s.as_u16(), 499);
        metrics_show(&st, r#"vllm:num_requests_running{model_name="m",engine="0"} 0.0"#).await;
        let m = st.render_metrics();
        let aborted = r#"vllm:request_success_total{model_name="m",engine="0",finished_reason="abort"} 2.0"#;
        assert!(m.lines().any(|l| l == aborted), "{m}");
        assert!(st.live().is_empty(), "nothing left registered");
        // A later request under an aborted id runs as any other.
        let s =
            call_as(&st, "leg-1", "/v1/completions", r#"{"model":"m","prompt":"a b","max_tokens":1}"#).await;
        assert_eq!(s, StatusCode::OK);
    }

    #[tokio::test]
    async fn tokenizer_routes_and_abort_requests() {
        let st = engine(Role::Prefill);
        let (s, h, body) = call(&st, "POST", "/tokenize", r#"{"model":"m","prompt":"a b c"}"#).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            body,
            r#"{"count":3,"max_model_len":8192,"tokens":[121996,94629,18418],"token_strs":null}"#
        );
        let (s, _, body) = call(&st, "POST", "/detokenize", r#"{"tokens":[1,2]}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, r#"{"prompt":"w1 w2"}"#));
        let (s, _, body) = call(&st, "POST", "/tokenize", r#"{"model":"x","prompt":"a"}"#).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{body}");
        let (s, _, body) =
            call(&st, "POST", "/abort_requests", r#"{"request_ids":["cmpl-a-0-1234abcd"]}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::OK, ""));
        assert!(
            st.render_metrics()
                .contains("kvx:kv_aborts_total{backend=\"null\",kv_transfer=\"none\",role=\"prefill\"} 1.0")
        );
        let (s, _, body) = call(&st, "POST", "/abort_requests", r#"{}"#).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
        assert!(body.contains("Missing 'request_ids' in request body"), "{body}");
    }

    #[tokio::test]
    async fn answers_carry_their_stage_timings() {
        let p = engine(Role::Prefill);
        let body = r#"{"prompt":"a b c","max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}"#;
        let (s, h, _) = call(&p, "POST", "/v1/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        let names: Vec<String> = crate::serve::timing::from_headers(&h).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["prefill_compute", "prefill_queue", "prefill_total"]);
        let d = engine(Role::Decode);
        let body = r#"{"prompt":"a b c","max_tokens":2,"stream":true,"kv_transfer_params":{"do_remote_prefill":true,
            "remote_block_ids":[[0]],"remote_engine_id":"P0","remote_request_id":"r","remote_host":"h","remote_port":1}}"#;
        let (s, h, _) = call(&d, "POST", "/v1/completions", body).await;
        assert_eq!(s, StatusCode::OK);
        let names: Vec<String> = crate::serve::timing::from_headers(&h).into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "kv_handshake",
                "kv_transfer",
                "kv_notify",
                "kv_verify",
                "decode_admission",
                "itl",
                "decode_total"
            ]
        );
        let m = d.render_metrics();
        for family in [
            "vllm:inter_token_latency_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:request_time_per_output_token_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"0\"} 1.0",
            "vllm:nixl_num_failed_transfers_total{model_name=\"m\",engine=\"0\"} 0.0",
            "vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.0",
        ] {
            assert!(m.contains(family), "{family} missing in:\n{m}");
        }
    }

    #[tokio::test]
    async fn api_key_is_enforced_on_v1_only() {
        let kv = NullKv::new(EngineIdentity {
            engine_id: "e".into(),
            side_channel_host: "h".into(),
            side_channel_port: 1,
            tp_size: 1,
        });
        let mut cfg = HttpEngineConfig::new(Role::Decode, "m");
        cfg.api_key = Some("k".into());
        let st = EngineState::new(cfg, Arc::new(kv));
        let (s, _, body) = call(&st, "POST", "/v1/completions", r#"{"prompt":"a"}"#).await;
        assert_eq!((s, body.as_str()), (StatusCode::UNAUTHORIZED, r#"{"error":"Unauthorized"}"#));
        let (s, _, _) = call(&st, "GET", "/health", "").await;
        assert_eq!(s, StatusCode::OK);
    }
}
