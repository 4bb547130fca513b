//! The SSE body of a streaming answer ([`TokenStream`]): tokens paced on a fixed ITL grid,
//! coalesced into one frame when several are due, and the request finished (or, dropped,
//! aborted) with the stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;

use super::inflight::{InFlight, sleep_until};
use super::state::EngineState;
use crate::serve::openai::{self, FinishReason, GenRequest, ResponseCtx, Usage};
use crate::vocab::kinds::Endpoint;

/// The SSE body of one streaming request, as an `unfold` state machine. Dropping it (the
/// client went away) drops the [`InFlight`] and so aborts the request.
pub(super) struct TokenStream {
    pub(super) st: Arc<EngineState>,
    pub(super) req: GenRequest,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) n: u64,
    pub(super) finish: FinishReason,
    pub(super) next: u64,
    /// When the next token is due. Tokens follow a fixed ITL grid, so timer rounding (tokio
    /// sleeps in 1 ms ticks) does not bias the mean ITL; after a stall longer than one ITL
    /// the grid restarts from now, so late tokens are not bunched to catch up (a slow
    /// decode step delays the ones after it).
    pub(super) next_due: Instant,
    /// When the previous frame went out (for `vllm:inter_token_latency_seconds`).
    pub(super) last_emit: Option<Instant>,
    pub(super) ttft: Duration,
    pub(super) ended: bool,
    pub(super) inflight: Option<InFlight>,
}

/// Upper bound of one body frame when several tokens are already due (ITL 0): coalescing
/// them saves syscalls without delaying any token.
const MAX_FRAME_BYTES: usize = 64 << 10;

impl TokenStream {
    pub(super) async fn step(mut self) -> Option<(Result<Bytes, std::convert::Infallible>, Self)> {
        if self.ended {
            return None;
        }
        let due = self.next_due;
        sleep_until(due).await;
        let emitted_at = Instant::now();
        let mut out = Vec::with_capacity(512);
        let st = self.st.clone();
        let ctx = ResponseCtx {
            id: &self.id,
            created: self.created,
            model: &st.cfg.model_name,
            system_fingerprint: &st.system_fingerprint,
        };
        let mut text = String::new();
        let start = self.next;
        loop {
            let k = self.next;
            let usage = self.req.continuous_usage.then(|| Usage::new(self.req.prompt_tokens, k + 1));
            if k == 0 && self.req.endpoint == Endpoint::Chat {
                let u = self.req.continuous_usage.then(|| Usage::new(self.req.prompt_tokens, 0));
                openai::push_chat_role_chunk(&mut out, &ctx, u);
            }
            text.clear();
            openai::token_text(k, self.n, self.finish, &mut text);
            let last = k + 1 == self.n;
            let finish = last.then_some(self.finish);
            let fingerprint = last && !self.req.include_usage;
            match self.req.endpoint {
                Endpoint::Completions => {
                    openai::push_completion_chunk(&mut out, &ctx, &text, finish, usage, fingerprint)
                }
                Endpoint::Chat => openai::push_chat_chunk(&mut out, &ctx, &text, finish, usage, fingerprint),
            }
            self.next += 1;
            if last {
                if self.req.include_usage {
                    let u = Usage::new(self.req.prompt_tokens, self.n);
                    openai::push_usage_chunk(&mut out, &ctx, self.req.endpoint, u);
                }
                out.extend_from_slice(openai::DONE);
                self.ended = true;
                break;
            }
            let itl = self.st.cfg.itl;
            self.next_due = if emitted_at > due + itl { emitted_at + itl } else { due + itl };
            if out.len() >= MAX_FRAME_BYTES || !self.st.cfg.itl.is_zero() {
                break;
            }
        }
        let tokens = self.next - start;
        st.metrics.generation_tokens.add(tokens);
        // One gap per token: the frame's first token waited since the previous frame, the
        // others of a coalesced frame (pacing off) came with it.
        if let Some(prev) = self.last_emit {
            st.metrics.itl.observe(emitted_at - prev);
            for _ in 1..tokens {
                st.metrics.itl.observe(Duration::ZERO);
            }
        } else {
            for _ in 1..tokens {
                st.metrics.itl.observe(Duration::ZERO);
            }
        }
        self.last_emit = Some(emitted_at);
        if self.ended
            && let Some(f) = self.inflight.take()
        {
            f.finish(self.finish, self.n, self.ttft);
        }
        Some((Ok(Bytes::from(out)), self))
    }
}
