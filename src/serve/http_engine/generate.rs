//! `/v1/completions` and `/v1/chat/completions`: a request admitted (or aborted by id while
//! it waits), its KV phase (a simulated prefill, a handoff to a decode engine, or a load from
//! a prefill engine, [`kv_phase`]) and its answer, whole or streamed (`stream.rs`), with its
//! `Server-Timing` stages.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::answers::{error_response, json_response};
use super::checks::{check_model, rejected};
use super::inflight::{GaugeGuard, InFlight, sleep_until};
use super::state::{EngineState, unix_now_s};
use super::stream::TokenStream;
use crate::serve::kv::{KvIntent, KvTransferParams, LoadJob, PrefillJob};
use crate::serve::openai::{self, ApiError, GenRequest, ResponseCtx, SSE_CONTENT_TYPE, Usage};
use crate::serve::timing::{self, ServerTiming};
use crate::vocab::kinds::Endpoint;
use crate::vocab::kinds::Role;

/// The answer to a generation request `/abort_requests` named (its client, a proxy, left).
fn aborted_by_id() -> ApiError {
    ApiError::new(499, "the request was aborted (POST /abort_requests)")
}

/// `/v1/completions` (`ep` `Completions`) or `/v1/chat/completions` (`Chat`).
pub(super) async fn generate(
    st: Arc<EngineState>,
    ep: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let arrived = Instant::now();
    if let Some(r) = rejected(&st, &headers) {
        return r;
    }
    let req = match openai::parse_request(ep, &body, st.cfg.max_model_len) {
        Ok(r) => r,
        Err(e) => {
            st.metrics.errors.inc();
            return error_response(&e);
        }
    };
    if let Err(e) = check_model(&st, req.model.as_deref()) {
        st.metrics.errors.inc();
        return error_response(&e);
    }
    let x_request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.body_request_id.clone())
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let id = format!("{}{}", ep.id_prefix(), x_request_id);
    // vLLM 0.32+ makes the engine-internal id unique with 8 random hex chars, so D cannot
    // derive P's id from the shared header: P's `remote_request_id` must be forwarded.
    let rand8 = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let internal_id = match ep {
        Endpoint::Completions => format!("{id}-0-{rand8}"),
        Endpoint::Chat => format!("{id}-{rand8}"),
    };

    let mut live = st.register_live(&x_request_id);
    let permit = {
        let _waiting = GaugeGuard::new(&st.metrics.waiting);
        tokio::select! {
            p = st.seqs.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return error_response(&ApiError::new(503, "engine is shutting down")),
            },
            () = live.aborted() => {
                st.metrics.aborted.inc();
                return error_response(&aborted_by_id());
            }
        }
    };
    let admitted = Instant::now();
    st.metrics.running.inc();
    let inflight = InFlight {
        st: st.clone(),
        internal_id,
        x_request_id: x_request_id.clone(),
        _permit: permit,
        started: arrived,
        finished: false,
    };
    st.metrics.prompt_tokens.add(req.prompt_tokens);

    let (kv_out, mut timing) = match kv_phase(&st, &req, &x_request_id, &inflight.internal_id).await {
        Ok(p) => p,
        Err(e) => {
            inflight.fail();
            return error_response(&e);
        }
    };
    if live.is_aborted() {
        // Dropping `inflight` counts the abort (and releases a prefill handoff, if any).
        drop(inflight);
        return error_response(&aborted_by_id());
    }
    let kv_done = Instant::now();
    let (queue_name, total_name) = match timing.kind {
        PhaseKind::Prefill => (timing::PREFILL_QUEUE, timing::PREFILL_TOTAL),
        PhaseKind::Load => (timing::DECODE_ADMISSION, timing::DECODE_TOTAL),
        PhaseKind::Local => (timing::LOCAL_QUEUE, timing::LOCAL_TOTAL),
    };
    timing.st.push(queue_name, admitted - arrived);
    // After a KV load the first token takes one decode step (the last prompt token is
    // recomputed for its logits); after a prefill it comes with the prefill.
    let first_token_at = match timing.kind {
        PhaseKind::Load => kv_done + st.cfg.itl,
        _ => kv_done,
    };
    if timing.kind != PhaseKind::Prefill {
        timing.st.push(timing::ITL, st.cfg.itl);
    }
    let ttft = first_token_at - arrived;
    st.metrics.ttft.observe(ttft);

    let (n, finish) = openai::plan_generation(&req, st.cfg.eos_at);
    let created = unix_now_s();
    if !req.stream {
        let last = first_token_at + st.cfg.itl * u32::try_from(n.saturating_sub(1)).unwrap_or(u32::MAX);
        tokio::select! {
            () = sleep_until(last) => {}
            () = live.aborted() => {
                drop(inflight);
                return error_response(&aborted_by_id());
            }
        }
        if n > 1 {
            let step = first_token_at.elapsed() / u32::try_from(n - 1).unwrap_or(u32::MAX);
            for _ in 1..n {
                st.metrics.itl.observe(step);
            }
        }
        let mut text = String::with_capacity(n as usize * 6);
        for k in 0..n {
            openai::token_text(k, n, finish, &mut text);
        }
        let ctx = ResponseCtx {
            id: &id,
            created,
            model: &st.cfg.model_name,
            system_fingerprint: &st.system_fingerprint,
        };
        let usage = Usage::new(req.prompt_tokens, n);
        let body = openai::response_body(&ctx, ep, &text, finish, usage, kv_out.as_ref());
        st.metrics.generation_tokens.add(n);
        inflight.finish(finish, n, ttft);
        timing.st.push(total_name, arrived.elapsed());
        let mut resp = json_response(body);
        if let Some(h) = timing.st.header() {
            resp.headers_mut().insert(timing::SERVER_TIMING, h);
        }
        return resp;
    }

    timing.st.push(total_name, arrived.elapsed());
    let stream = TokenStream {
        st: st.clone(),
        req,
        id,
        created,
        n,
        finish,
        next: 0,
        next_due: first_token_at,
        last_emit: None,
        ttft,
        ended: false,
        inflight: Some(inflight),
    };
    let body = Body::from_stream(futures::stream::unfold(stream, TokenStream::step));
    let mut resp =
        ([(header::CONTENT_TYPE, HeaderValue::from_static(SSE_CONTENT_TYPE))], body).into_response();
    if let Some(h) = timing.st.header() {
        resp.headers_mut().insert(timing::SERVER_TIMING, h);
    }
    resp
}

/// What the phase before the first token was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PhaseKind {
    /// Prefill engine handing its KV off to a decode engine.
    Prefill,
    /// Decode engine loading the KV from a prefill engine.
    Load,
    /// An engine prefilling on its own (no P/D, or the decode side's fallback).
    Local,
}

/// The phase's kind and its `Server-Timing` entries so far.
struct PhaseTiming {
    kind: PhaseKind,
    st: ServerTiming,
}

/// Everything before the first token: prefill (simulated), or the KV load from P.
/// Returns the `kv_transfer_params` to answer with (prefill role handing off to D) and the
/// phase's stage timings.
async fn kv_phase(
    st: &EngineState,
    req: &GenRequest,
    x_request_id: &str,
    internal_id: &str,
) -> Result<(Option<KvTransferParams>, PhaseTiming), ApiError> {
    let m = &st.metrics;
    let cfg = &st.cfg;
    let t0 = Instant::now();
    // A zero sleep is not free: tokio rounds timers up to its 1 ms tick.
    let local_prefill = || sleep_until(Instant::now() + cfg.prefill_time(req.prompt_tokens));
    let local = |t0: Instant| {
        let mut s = ServerTiming::new();
        s.push(timing::LOCAL_PREFILL, t0.elapsed());
        PhaseTiming { kind: PhaseKind::Local, st: s }
    };
    match (cfg.role, &req.kv) {
        (Role::Prefill, KvIntent::RemoteDecode) => {
            st.remember_handoff(x_request_id, internal_id);
            local_prefill().await;
            let job = PrefillJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
            };
            let aborted =
                || ApiError::new(499, "the request was aborted (POST /abort_requests) before its handoff");
            if st.handoff_aborted(x_request_id) {
                return Err(aborted());
            }
            let params = st
                .backend
                .prefill(job)
                .await
                .map_err(|e| ApiError::new(e.http_status(), format!("KV prefill handoff failed: {e}")))?;
            // An abort that came while the blocks were filled finds them held only now.
            if st.handoff_aborted(x_request_id) {
                st.backend.abort(internal_id);
                return Err(aborted());
            }
            m.kv_handoffs.inc();
            let mut s = ServerTiming::new();
            s.push(timing::PREFILL_COMPUTE, t0.elapsed());
            Ok((Some(params), PhaseTiming { kind: PhaseKind::Prefill, st: s }))
        }
        (Role::Prefill, intent) => {
            if !matches!(intent, KvIntent::None) {
                tracing::warn!(
                    ?intent,
                    "prefill engine got decode-side kv_transfer_params; prefilling locally"
                );
            }
            local_prefill().await;
            Ok((None, local(t0)))
        }
        (Role::Decode, KvIntent::RemotePrefill(params)) => {
            let job = LoadJob {
                request_id: internal_id.to_string(),
                x_request_id: x_request_id.to_string(),
                prompt_tokens: req.prompt_tokens,
                block_size_tokens: cfg.block_size_tokens,
                params: (**params).clone(),
            };
            match st.backend.load(job).await {
                Ok(r) => {
                    let elapsed = t0.elapsed();
                    m.kv_load_seconds.observe(elapsed);
                    m.kv_loads.inc();
                    let handshake = r.handshake.unwrap_or_default();
                    let transfer = elapsed.saturating_sub(handshake + r.notify + r.verify);
                    let mut s = ServerTiming::new();
                    s.push(timing::KV_HANDSHAKE, handshake)
                        .push(timing::KV_TRANSFER, transfer)
                        .push(timing::KV_NOTIFY, r.notify)
                        .push(timing::KV_VERIFY, r.verify);
                    Ok((None, PhaseTiming { kind: PhaseKind::Load, st: s }))
                }
                Err(e) => {
                    m.kv_load_failures.inc();
                    // vLLM's default kv_load_failure_policy is "fail".
                    Err(ApiError::new(e.http_status(), format!("KV load failed: {e}")))
                }
            }
        }
        (Role::Decode, intent) => {
            let counter = match intent {
                KvIntent::Incomplete { reason } => {
                    tracing::warn!(%reason, "decode engine got incomplete kv_transfer_params; prefilling locally");
                    &m.fallback_incomplete
                }
                KvIntent::RemoteDecode => &m.fallback_wrong_direction,
                _ => &m.fallback_missing,
            };
            counter.inc();
            local_prefill().await;
            Ok((None, local(t0)))
        }
    }
}
