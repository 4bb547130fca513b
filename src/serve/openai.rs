//! The OpenAI-compatible wire format as vLLM 0.32/0.33 speaks it: request parsing and
//! validation (with vLLM's messages and status codes), the synthetic tokenizer, and the
//! byte-exact JSON bodies and SSE chunks the engine emits.
//!
//! Owns shapes and field order only; it never sleeps, never talks to a backend and never
//! touches sockets. Field order follows vLLM's pydantic classes: non-streaming bodies carry
//! every field (nulls included), streaming chunks only the fields vLLM's serving code sets
//! (`exclude_unset=True`), the usage chunk drops nulls (`exclude_none=True`).
//!
//! # Synthetic tokenizer
//! kvx has no vocabulary. A text prompt has one token per whitespace-separated word; a
//! token-id prompt (`[1, 2, 3]` or `[[1, 2, 3]]`) has one token per id; a chat request has one
//! token per word of every message's text content (no chat-template overhead). So
//! `kvx load --prompt-len N` produces prompts of exactly N tokens. Generated token `k` is the
//! text `" t<k>"`.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::kv::{KvIntent, KvTransferParams};
use crate::vocab::kinds::Endpoint;

impl Endpoint {
    /// Prefix of the response id (`cmpl-<X-Request-Id>` / `chatcmpl-<X-Request-Id>`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Completions => "cmpl-",
            Endpoint::Chat => "chatcmpl-",
        }
    }
}

/// An error answered in vLLM's body shape `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: u16,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        let kind = match status {
            400 => "BadRequestError",
            401 => "UnauthorizedError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            502 => "BadGatewayError",
            503 => "ServiceUnavailableError",
            504 => "GatewayTimeoutError",
            _ => "InternalServerError",
        };
        Self { status, kind, message: message.into(), param: None }
    }
    /// An error raised the way FastAPI's `HTTPException` is, which vLLM answers with the HTTP
    /// status phrase as the type (`{"message":"Not Found","type":"Not Found",...}`): unknown
    /// routes, wrong methods, bodies that are not `application/json`.
    pub fn http(status: u16, message: impl Into<String>) -> Self {
        let kind = http::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Internal Server Error");
        Self { status, kind, message: message.into(), param: None }
    }
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self { param: param.map(str::to_string), ..Self::new(400, message) }
    }
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    fn info(&self) -> ErrorInfo<'_> {
        ErrorInfo { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.status }
    }

    /// Compact body as vLLM's `JSONResponse` writes it.
    pub fn body(&self) -> Vec<u8> {
        serde_json::to_vec(&ErrorBody { error: self.info() }).unwrap_or_default()
    }

    /// The in-stream error event: vLLM builds it with Python's `json.dumps`, whose default
    /// separators put a space after `:` and `,`, then the `[DONE]` terminator.
    pub fn sse_event(&self) -> Vec<u8> {
        let s = |v: &str| serde_json::to_string(v).unwrap_or_default();
        let param = self.param.as_deref().map_or_else(|| "null".to_string(), s);
        format!(
            "data: {{\"error\": {{\"message\": {}, \"type\": {}, \"param\": {}, \"code\": {}}}}}\n\n{}",
            s(&self.message),
            s(self.kind),
            param,
            self.status,
            std::str::from_utf8(DONE).unwrap_or_default()
        )
        .into_bytes()
    }
}

/// The SSE terminator vLLM always sends.
pub const DONE: &[u8] = b"data: [DONE]\n\n";
/// Content type of vLLM's streaming responses.
pub const SSE_CONTENT_TYPE: &str = "text/event-stream; charset=utf-8";

/// Fields of a completion or chat request the engine acts on; everything else is ignored,
/// as vLLM ignores (and logs) unknown fields.
#[derive(Debug, Default, serde::Deserialize)]
struct RawRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    min_tokens: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    #[serde(default)]
    request_id: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

/// A validated generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt_tokens: u64,
    /// Resolved limit: `max_tokens` (chat: `max_completion_tokens` first), else what is
    /// left of the context.
    pub max_tokens: u64,
    pub min_tokens: u64,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Usage on every chunk (`stream_options.continuous_usage_stats`, needs `include_usage`).
    pub continuous_usage: bool,
    pub kv: KvIntent,
    /// Body `request_id`, used for the response id when there is no `X-Request-Id`.
    pub body_request_id: Option<String>,
}

/// Deserializes with the failing field's path in the error, for the `param` of the 400.
fn from_slice_with_path<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::bad_request(format!("Invalid JSON body: {inner}"), None)
        } else if path == "." {
            ApiError::bad_request(format!("Request body must be a JSON object: {inner}"), None)
        } else {
            ApiError::bad_request(format!("Invalid value for `{path}`: {inner}"), Some(&path))
        }
    })
}

/// Counts the tokens of a completions `prompt`.
fn prompt_tokens(prompt: &Value) -> Result<u64, ApiError> {
    let bad = |m: &str| ApiError::bad_request(m, Some("prompt"));
    let ids = |a: &[Value]| -> Result<u64, ApiError> {
        if a.iter().all(|v| v.as_u64().is_some()) {
            Ok(a.len() as u64)
        } else {
            Err(bad("`prompt` token ids must be non-negative integers"))
        }
    };
    match prompt {
        Value::String(s) => Ok(words(s)),
        Value::Array(a) if a.is_empty() => Err(bad("Prompt cannot be empty")),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => Ok(a[0].as_str().map_or(0, words)),
        Value::Array(a) if a.len() == 1 && a[0].is_array() => ids(a[0].as_array().map_or(&[], Vec::as_slice)),
        Value::Array(a) if a.iter().all(|v| v.is_number()) => ids(a),
        Value::Array(_) => Err(bad(
            "kvx serve-engine takes one prompt per request; send a string, a list of token ids, or a one-element list",
        )),
        _ => Err(bad("`prompt` must be a string or a list of token ids")),
    }
}

fn words(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

/// The message roles of OpenAI's chat API (vLLM renders others only through a model's own
/// chat template; kvx has none, so it refuses them).
const CHAT_ROLES: [&str; 6] = ["system", "user", "assistant", "tool", "developer", "function"];

/// Counts the tokens of a chat `messages` list (words of every text content).
fn chat_tokens(messages: &Value) -> Result<u64, ApiError> {
    let bad = |m: &str| ApiError::bad_request(m, Some("messages"));
    let Value::Array(list) = messages else {
        return Err(bad("`messages` must be a list of message objects"));
    };
    if list.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    let mut n = 0;
    for (i, m) in list.iter().enumerate() {
        let at = |field: &str, message: String| {
            ApiError::bad_request(message, Some(&format!("messages.{i}.{field}")))
        };
        let Value::Object(m) = m else {
            return Err(bad("each message must be an object with `role` and `content`"));
        };
        match m.get("role").and_then(Value::as_str) {
            Some(r) if CHAT_ROLES.contains(&r) => {}
            Some(r) => {
                return Err(at(
                    "role",
                    format!("unknown message role {r:?}; kvx knows {}", CHAT_ROLES.join(", ")),
                ));
            }
            None => return Err(at("role", "each message needs a string `role`".to_string())),
        }
        match m.get("content") {
            Some(Value::String(s)) => n += words(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        n += words(t);
                    }
                }
            }
            None | Some(Value::Null) => {}
            Some(other) => {
                return Err(at(
                    "content",
                    format!("`content` must be a string or a list of content parts, got {other}"),
                ));
            }
        }
    }
    Ok(n)
}

/// Vocabulary size the synthetic tokenizer hashes words other than `w<id>` into.
const SYNTHETIC_VOCAB: u64 = 128_000;

/// The synthetic token id of one word: `w<n>` is token `n` (what [`detokenize`] writes, so
/// ids survive a round trip), any other word a stable hash into the vocabulary.
pub fn word_token_id(word: &str) -> u64 {
    if let Some(n) = word.strip_prefix('w').and_then(|d| d.parse::<u64>().ok()) {
        return n;
    }
    // FNV-1a: stable across builds and platforms.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in word.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h % SYNTHETIC_VOCAB
}

#[derive(Debug, serde::Deserialize)]
struct TokenizeIn {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default)]
    return_token_strs: Option<bool>,
}

#[derive(Serialize)]
struct TokenizeOut<'a> {
    count: usize,
    max_model_len: u64,
    tokens: Vec<u64>,
    token_strs: Option<Vec<&'a str>>,
}

/// `POST /tokenize` as vLLM shapes it: `{"prompt": ...}` (TokenizeCompletionRequest) or
/// `{"messages": [...]}` (TokenizeChatRequest), optional `return_token_strs`; the answer is
/// `{"count","max_model_len","tokens","token_strs"}`. Returns the requested model and the body.
pub fn tokenize(body: &[u8], max_model_len: u64) -> Result<(Option<String>, Vec<u8>), ApiError> {
    let req: TokenizeIn = from_slice_with_path(body)?;
    let mut words: Vec<&str> = Vec::new();
    match (&req.prompt, &req.messages) {
        (Some(p), _) => words.extend(p.split_whitespace()),
        (None, Some(m)) => {
            chat_tokens(m)?;
            for msg in m.as_array().map(Vec::as_slice).unwrap_or_default() {
                match msg.get("content") {
                    Some(Value::String(t)) => words.extend(t.split_whitespace()),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                words.extend(t.split_whitespace());
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        (None, None) => {
            return Err(ApiError::bad_request("Field required: `prompt` (or `messages`)", Some("prompt")));
        }
    }
    let out = TokenizeOut {
        count: words.len(),
        max_model_len,
        tokens: words.iter().map(|w| word_token_id(w)).collect(),
        token_strs: req.return_token_strs.unwrap_or(false).then(|| words.clone()),
    };
    Ok((req.model, serde_json::to_vec(&out).unwrap_or_default()))
}

#[derive(Debug, serde::Deserialize)]
struct DetokenizeIn {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u64>,
}

#[derive(Serialize)]
struct DetokenizeOut {
    prompt: String,
}

/// `POST /detokenize` `{"tokens": [...]}` -> `{"prompt": "w<id> w<id> ..."}`: text that
/// [`tokenize`] turns back into the same ids, one token per id.
pub fn detokenize(body: &[u8]) -> Result<(Option<String>, Vec<u8>), ApiError> {
    let req: DetokenizeIn = from_slice_with_path(body)?;
    let prompt = req.tokens.iter().map(|t| format!("w{t}")).collect::<Vec<_>>().join(" ");
    Ok((req.model, serde_json::to_vec(&DetokenizeOut { prompt }).unwrap_or_default()))
}

/// Parses and validates one request the way vLLM's protocol classes do.
pub fn parse_request(endpoint: Endpoint, body: &[u8], max_model_len: u64) -> Result<GenRequest, ApiError> {
    let raw: RawRequest = from_slice_with_path(body)?;
    let prompt_tokens = match endpoint {
        Endpoint::Completions => match &raw.prompt {
            Some(p) => prompt_tokens(p)?,
            None => return Err(ApiError::bad_request("Field required: `prompt`", Some("prompt"))),
        },
        Endpoint::Chat => match &raw.messages {
            Some(m) => chat_tokens(m)?,
            None => return Err(ApiError::bad_request("Field required: `messages`", Some("messages"))),
        },
    };
    if prompt_tokens == 0 {
        return Err(ApiError::bad_request(
            "Prompt cannot be empty (kvx's synthetic tokenizer counts whitespace-separated words)",
            Some("prompt"),
        ));
    }
    if let Some(n) = raw.n
        && n != 1
    {
        return Err(ApiError::bad_request(
            format!("kvx serve-engine generates one choice per request; got n={n}"),
            Some("n"),
        ));
    }
    let stream = raw.stream.unwrap_or(false);
    if raw.stream_options.is_some() && !stream {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        ));
    }
    if prompt_tokens >= max_model_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has \
                 {prompt_tokens} input tokens. Please reduce the length of the input messages."
            ),
            None,
        ));
    }
    let requested = match endpoint {
        Endpoint::Chat => raw.max_completion_tokens.or(raw.max_tokens),
        Endpoint::Completions => raw.max_tokens,
    };
    let max_tokens = match requested {
        Some(m) if m < 1 => {
            let p = if raw.max_completion_tokens.is_some() && endpoint == Endpoint::Chat {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(ApiError::bad_request(format!("max_tokens must be at least 1, got {m}."), Some(p)));
        }
        Some(m) => m as u64,
        None => max_model_len - prompt_tokens,
    };
    if prompt_tokens + max_tokens > max_model_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} \
                 tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the \
                 length of the messages or completion.",
                prompt_tokens + max_tokens
            ),
            Some("max_tokens"),
        ));
    }
    let min_tokens = match raw.min_tokens {
        Some(m) if m < 0 => {
            return Err(ApiError::bad_request(
                format!("min_tokens must be greater than or equal to 0, got {m}."),
                Some("min_tokens"),
            ));
        }
        Some(m) => m as u64,
        None => 0,
    };
    if min_tokens > max_tokens {
        return Err(ApiError::bad_request(
            format!("min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."),
            Some("min_tokens"),
        ));
    }
    let kv = KvIntent::from_json(raw.kv_transfer_params.as_ref())
        .map_err(|e| ApiError::bad_request(e.message, Some(&e.param)))?;
    let opts = raw.stream_options.unwrap_or_default();
    let include_usage = stream && opts.include_usage.unwrap_or(false);
    Ok(GenRequest {
        endpoint,
        model: raw.model,
        prompt_tokens,
        max_tokens,
        min_tokens,
        ignore_eos: raw.ignore_eos.unwrap_or(false),
        stream,
        include_usage,
        continuous_usage: include_usage && opts.continuous_usage_stats.unwrap_or(false),
        kv,
        body_request_id: raw.request_id,
    })
}

/// How many tokens the synthetic model generates and why it stops. With `eos_at = Some(e)`
/// the model samples EOS as its `e`-th token, but never before `min_tokens` are out and never
/// with `ignore_eos`; without it the model runs to `max_tokens`.
pub fn plan_generation(req: &GenRequest, eos_at: Option<u64>) -> (u64, FinishReason) {
    if let Some(e) = eos_at
        && !req.ignore_eos
    {
        let eos_pos = e.max(req.min_tokens + 1).max(1);
        if eos_pos <= req.max_tokens {
            return (eos_pos, FinishReason::Stop);
        }
    }
    (req.max_tokens, FinishReason::Length)
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// Text of generated token `k` of `n`: EOS (the last token of a `stop` finish) is a special
/// token and decodes to nothing.
pub fn token_text(k: u64, n: u64, finish: FinishReason, out: &mut String) {
    if finish == FinishReason::Stop && k + 1 == n {
        return;
    }
    use std::fmt::Write as _;
    let _ = write!(out, " t{k}");
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self { prompt_tokens, total_tokens: prompt_tokens + completion_tokens, completion_tokens }
    }
}

#[derive(Serialize, Default)]
struct UsageFull {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u64,
    prompt_tokens_details: (),
    completion_tokens_details: (),
}

impl From<Usage> for UsageFull {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            total_tokens: u.total_tokens,
            completion_tokens: u.completion_tokens,
            ..Default::default()
        }
    }
}

/// What every body and chunk of one response shares.
#[derive(Debug, Clone, Copy)]
pub struct ResponseCtx<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: &'a str,
}

// The wire structs below list vLLM's fields in vLLM's order; a `()` field is one vLLM sends as
// `null`. They derive `Default` so that a body names only the fields it sets.

#[derive(Serialize, Default)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: (),
    finish_reason: &'a str,
    stop_reason: (),
    token_ids: (),
    prompt_logprobs: (),
    prompt_token_ids: (),
    routed_experts: (),
    weight_versions: (),
}

/// vLLM's non-streaming envelope around one choice (`C`). `P` holds the prompt fields only
/// chat sends ([`ChatPrompt`]; `()` for completions: none).
#[derive(Serialize)]
struct ResponseBody<'a, C, P> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [C; 1],
    service_tier: (),
    system_fingerprint: &'a str,
    usage: UsageFull,
    #[serde(flatten)]
    prompt: P,
    kv_transfer_params: Option<&'a KvTransferParams>,
    ec_transfer_params: (),
    metrics: (),
}

impl<'a, C: Serialize, P: Serialize> ResponseBody<'a, C, P> {
    fn json(
        ctx: &ResponseCtx<'a>,
        object: &'static str,
        choice: C,
        prompt: P,
        usage: Usage,
        kv: Option<&'a KvTransferParams>,
    ) -> Vec<u8> {
        let body = ResponseBody {
            id: ctx.id,
            object,
            created: ctx.created,
            model: ctx.model,
            choices: [choice],
            service_tier: (),
            system_fingerprint: ctx.system_fingerprint,
            usage: usage.into(),
            prompt,
            kv_transfer_params: kv,
            ec_transfer_params: (),
            metrics: (),
        };
        serde_json::to_vec(&body).unwrap_or_default()
    }
}

#[derive(Serialize, Default)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
    refusal: (),
    annotations: (),
    audio: (),
    function_call: (),
    reasoning: (),
}

#[derive(Serialize, Default)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: (),
    finish_reason: &'a str,
    stop_reason: (),
    token_ids: (),
    routed_experts: (),
    weight_versions: (),
}

#[derive(Serialize, Default)]
struct ChatPrompt {
    prompt_logprobs: (),
    prompt_token_ids: (),
    prompt_text: (),
}

/// The non-streaming body of `endpoint`: vLLM's `CompletionResponse.model_dump()` (0.33 adds
/// `weight_versions` to each choice) or its chat completion (empty `tool_calls` omitted, as
/// vLLM does), with `text` as the generated text.
pub fn response_body<'a>(
    ctx: &ResponseCtx<'a>,
    endpoint: Endpoint,
    text: &'a str,
    finish: FinishReason,
    usage: Usage,
    kv: Option<&'a KvTransferParams>,
) -> Vec<u8> {
    let finish_reason = finish.as_str();
    match endpoint {
        Endpoint::Completions => {
            let choice = CompletionChoice { text, finish_reason, ..Default::default() };
            ResponseBody::json(ctx, "text_completion", choice, (), usage, kv)
        }
        Endpoint::Chat => {
            let message = ChatMessage { role: "assistant", content: text, ..Default::default() };
            let choice = ChatChoice { message, finish_reason, ..Default::default() };
            ResponseBody::json(ctx, "chat.completion", choice, ChatPrompt::default(), usage, kv)
        }
    }
}

#[derive(Serialize, Default)]
struct CompletionStreamChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: (),
    finish_reason: Option<&'a str>,
    stop_reason: (),
    prompt_token_ids: (),
    token_ids: (),
}

#[derive(Serialize)]
struct StreamChunk<'a, C: Serialize> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<&'a str>,
}

impl<'a, C: Serialize> StreamChunk<'a, C> {
    /// A chunk of the response `ctx` describes; `fingerprint` adds its system fingerprint.
    fn new(
        ctx: &ResponseCtx<'a>,
        object: &'static str,
        choices: C,
        usage: Option<Usage>,
        fingerprint: bool,
    ) -> Self {
        StreamChunk {
            id: ctx.id,
            object,
            created: ctx.created,
            model: ctx.model,
            choices,
            usage,
            system_fingerprint: fingerprint.then_some(ctx.system_fingerprint),
        }
    }
}

fn push_event<T: Serialize>(out: &mut Vec<u8>, v: &T) {
    out.extend_from_slice(b"data: ");
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}

/// One `/v1/completions` text chunk. `usage` is the running usage (continuous stats);
/// `fingerprint` marks the terminal chunk of a stream with no usage chunk after it.
pub fn push_completion_chunk(
    out: &mut Vec<u8>,
    ctx: &ResponseCtx<'_>,
    text: &str,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    fingerprint: bool,
) {
    let choice = CompletionStreamChoice {
        text,
        finish_reason: finish.map(FinishReason::as_str),
        ..Default::default()
    };
    push_event(out, &StreamChunk::new(ctx, "text_completion", [choice], usage, fingerprint));
}

/// The final usage chunk (`choices: []`), for either endpoint.
pub fn push_usage_chunk(out: &mut Vec<u8>, ctx: &ResponseCtx<'_>, endpoint: Endpoint, usage: Usage) {
    let object = match endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    push_event(out, &StreamChunk::new(ctx, object, [(); 0], Some(usage), true));
}

#[derive(Serialize)]
struct RoleDelta {
    role: &'static str,
    content: &'static str,
}

#[derive(Serialize, Default)]
struct ContentDelta<'a> {
    content: &'a str,
}

#[derive(Serialize)]
struct ChatRoleChoice {
    index: u32,
    delta: RoleDelta,
    logprobs: (),
    finish_reason: (),
}

#[derive(Serialize)]
struct ChatFirstChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatRoleChoice; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    prompt_token_ids: (),
    prompt_text: (),
}

/// The first chat chunk: role only, `content: ""`, plus the prompt fields vLLM sets on it.
pub fn push_chat_role_chunk(out: &mut Vec<u8>, ctx: &ResponseCtx<'_>, usage: Option<Usage>) {
    let chunk = ChatFirstChunk {
        id: ctx.id,
        object: "chat.completion.chunk",
        created: ctx.created,
        model: ctx.model,
        choices: [ChatRoleChoice {
            index: 0,
            delta: RoleDelta { role: "assistant", content: "" },
            logprobs: (),
            finish_reason: (),
        }],
        usage,
        prompt_token_ids: (),
        prompt_text: (),
    };
    push_event(out, &chunk);
}

#[derive(Serialize, Default)]
struct ChatContentChoice<'a> {
    index: u32,
    delta: ContentDelta<'a>,
    logprobs: (),
    finish_reason: (),
    token_ids: (),
}

#[derive(Serialize, Default)]
struct ChatFinalChoice<'a> {
    index: u32,
    delta: ContentDelta<'a>,
    logprobs: (),
    finish_reason: &'a str,
    stop_reason: (),
    token_ids: (),
}

/// One chat content chunk; the terminal one carries `finish_reason` and `stop_reason`.
pub fn push_chat_chunk(
    out: &mut Vec<u8>,
    ctx: &ResponseCtx<'_>,
    content: &str,
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    fingerprint: bool,
) {
    const OBJECT: &str = "chat.completion.chunk";
    let delta = ContentDelta { content };
    match finish {
        None => {
            let choice = ChatContentChoice { delta, ..Default::default() };
            push_event(out, &StreamChunk::new(ctx, OBJECT, [choice], usage, fingerprint));
        }
        Some(f) => {
            let choice = ChatFinalChoice { delta, finish_reason: f.as_str(), ..Default::default() };
            push_event(out, &StreamChunk::new(ctx, OBJECT, [choice], usage, fingerprint));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "vllm-0.32.0-abcd1234";

    fn ctx(id: &str) -> ResponseCtx<'_> {
        ResponseCtx { id, created: 1795300000, model: "stub-model", system_fingerprint: FP }
    }

    /// The golden vectors from vLLM 0.32.0's own classes (reference wire samples).
    #[test]
    fn completion_stream_matches_vllm_bytes() {
        let c = ctx("cmpl-0123456789abcdef");
        let mut out = Vec::new();
        push_completion_chunk(&mut out, &c, " Hello", None, None, false);
        push_completion_chunk(&mut out, &c, " world", Some(FinishReason::Length), None, false);
        push_usage_chunk(&mut out, &c, Endpoint::Completions, Usage::new(5, 2));
        out.extend_from_slice(DONE);
        let want = concat!(
            r#"data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795300000,"model":"stub-model","choices":[{"index":0,"text":" Hello","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}"#,
            "\n\n",
            r#"data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795300000,"model":"stub-model","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}"#,
            "\n\n",
            r#"data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795300000,"model":"stub-model","choices":[],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2},"system_fingerprint":"vllm-0.32.0-abcd1234"}"#,
            "\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(String::from_utf8(out).expect("utf8"), want);

        let mut last = Vec::new();
        push_completion_chunk(&mut last, &c, " world", Some(FinishReason::Length), None, true);
        let want_last = r#"data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795300000,"model":"stub-model","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}],"system_fingerprint":"vllm-0.32.0-abcd1234"}"#;
        assert_eq!(String::from_utf8(last).expect("utf8"), format!("{want_last}\n\n"));
    }

    #[test]
    fn chat_stream_matches_vllm_bytes() {
        let c = ctx("chatcmpl-0123456789abcdef");
        let mut out = Vec::new();
        push_chat_role_chunk(&mut out, &c, None);
        push_chat_chunk(&mut out, &c, " Hello", None, None, false);
        push_chat_chunk(&mut out, &c, " world", Some(FinishReason::Length), None, false);
        push_usage_chunk(&mut out, &c, Endpoint::Chat, Usage::new(9, 2));
        out.extend_from_slice(DONE);
        let want = concat!(
            r#"data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1795300000,"model":"stub-model","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}"#,
            "\n\n",
            r#"data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1795300000,"model":"stub-model","choices":[{"index":0,"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null,"token_ids":null}]}"#,
            "\n\n",
            r#"data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1795300000,"model":"stub-model","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}"#,
            "\n\n",
            r#"data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1795300000,"model":"stub-model","choices":[],"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2},"system_fingerprint":"vllm-0.32.0-abcd1234"}"#,
            "\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(String::from_utf8(out).expect("utf8"), want);
    }

    #[test]
    fn non_stream_bodies_match_vllm_bytes() {
        let kv = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: vec![vec![0, 1]],
            remote_engine_id: "e1".into(),
            remote_request_id: "cmpl-0123456789abcdef-0".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5600,
            tp_size: 1,
            dcp_size: 1,
            pp_size: 1,
            remote_num_tokens: 17,
            remote_blocks_expiry_time: None,
            remote_registration_generation: 0,
            transfer_mode: crate::topology::TransferMode::Pull,
        };
        let got = response_body(
            &ctx("cmpl-0123456789abcdef"),
            Endpoint::Completions,
            " Hello",
            FinishReason::Length,
            Usage::new(17, 1),
            Some(&kv),
        );
        // The 0.32 sample, with kv_transfer_params in 0.33's longer shape and 0.33's
        // `weight_versions` in the choice.
        let want = r#"{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1795300000,"model":"stub-model","choices":[{"index":0,"text":" Hello","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null,"weight_versions":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-abcd1234","usage":{"prompt_tokens":17,"total_tokens":18,"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[0,1]],"remote_engine_id":"e1","remote_request_id":"cmpl-0123456789abcdef-0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":17,"remote_blocks_expiry_time":null,"remote_registration_generation":0,"transfer_mode":"pull"},"ec_transfer_params":null,"metrics":null}"#;
        assert_eq!(String::from_utf8(got).expect("utf8"), want);

        let chat = response_body(
            &ctx("chatcmpl-0123456789abcdef"),
            Endpoint::Chat,
            " Hello world",
            FinishReason::Length,
            Usage::new(9, 2),
            None,
        );
        let want = r#"{"id":"chatcmpl-0123456789abcdef","object":"chat.completion","created":1795300000,"model":"stub-model","choices":[{"index":0,"message":{"role":"assistant","content":" Hello world","refusal":null,"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,"routed_experts":null,"weight_versions":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-abcd1234","usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#;
        assert_eq!(String::from_utf8(chat).expect("utf8"), want);
    }

    #[test]
    fn error_bodies_match_vllm_bytes() {
        let e = ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
            Some("stream_options"),
        );
        assert_eq!(
            String::from_utf8(e.body()).expect("utf8"),
            r#"{"error":{"message":"Stream options can only be defined when `stream=True`.","type":"BadRequestError","param":"stream_options","code":400}}"#
        );
        assert_eq!(
            String::from_utf8(e.sse_event()).expect("utf8"),
            "data: {\"error\": {\"message\": \"Stream options can only be defined when `stream=True`.\", \"type\": \"BadRequestError\", \"param\": \"stream_options\", \"code\": 400}}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn parse_validates_like_vllm() {
        let p = |b: &str| parse_request(Endpoint::Completions, b.as_bytes(), 4096);
        let e = p(r#"{"prompt":"a b","stream_options":{"include_usage":true}}"#).expect_err("must fail");
        assert_eq!((e.status, e.param.as_deref()), (400, Some("stream_options")));
        let e = p(r#"{"prompt":"a b","max_tokens":2,"min_tokens":3}"#).expect_err("must fail");
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
        let e = p(r#"{"prompt":"a b","max_tokens":"x"}"#).expect_err("must fail");
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = p(r#"{"prompt": "a b""#).expect_err("must fail");
        assert!(e.message.starts_with("Invalid JSON body"), "{}", e.message);
        let e = p(r#"[1,2]"#).expect_err("must fail");
        assert_eq!(e.status, 400);
        let e = p(r#"{"prompt":"   "}"#).expect_err("must fail");
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = p(r#"{"prompt":"a","max_tokens":4096}"#).expect_err("must fail");
        assert!(e.message.contains("maximum context length"));

        let r = p(r#"{"prompt":"hello world how are you","max_tokens":4,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"unknown":1}"#)
            .expect("valid");
        assert_eq!(
            (r.prompt_tokens, r.max_tokens, r.stream, r.include_usage, r.continuous_usage),
            (5, 4, true, true, true)
        );
        assert_eq!(p(r#"{"prompt":[1,2,3]}"#).expect("ids").prompt_tokens, 3);
        assert_eq!(p(r#"{"prompt":[[1,2]]}"#).expect("ids").max_tokens, 4094);

        let chat = parse_request(
            Endpoint::Chat,
            br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi there you"}]}],"max_tokens":9,"max_completion_tokens":3}"#,
            4096,
        )
        .expect("chat");
        assert_eq!((chat.prompt_tokens, chat.max_tokens), (5, 3));
    }

    #[test]
    fn tokenize_and_detokenize_keep_the_count_and_the_ids() {
        let (model, out) =
            tokenize(br#"{"model":"m","prompt":"w7 hello  w12","return_token_strs":true}"#, 4096)
                .expect("ok");
        assert_eq!(model.as_deref(), Some("m"));
        let v: Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["count"], 3);
        assert_eq!(v["max_model_len"], 4096);
        assert_eq!(v["tokens"][0], 7);
        assert_eq!(v["tokens"][2], 12);
        assert_eq!(v["token_strs"], serde_json::json!(["w7", "hello", "w12"]));
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.starts_with(r#"{"count":3,"max_model_len":4096,"tokens":[7,"#),
            "vLLM's field order: {text}"
        );
        let (_, out) = tokenize(br#"{"prompt":"a b"}"#, 10).expect("ok");
        assert!(String::from_utf8(out).expect("utf8").ends_with(r#""token_strs":null}"#));
        let (_, out) =
            tokenize(br#"{"messages":[{"role":"user","content":"one two three"}]}"#, 10).expect("chat");
        assert_eq!(serde_json::from_slice::<Value>(&out).expect("json")["count"], 3);
        let (_, out) = detokenize(br#"{"tokens":[5,0,99999]}"#).expect("ok");
        assert_eq!(String::from_utf8(out).expect("utf8"), r#"{"prompt":"w5 w0 w99999"}"#);
        // detokenize then tokenize: the same ids, one token per id.
        let (_, out) = tokenize(br#"{"prompt":"w5 w0 w99999"}"#, 10).expect("ok");
        assert_eq!(
            serde_json::from_slice::<Value>(&out).expect("json")["tokens"],
            serde_json::json!([5, 0, 99999])
        );
        let e = detokenize(br#"{"tokens":[-1]}"#).expect_err("negative ids are refused");
        assert_eq!((e.status, e.param.as_deref()), (400, Some("tokens[0]")));
        assert_eq!(tokenize(br#"{}"#, 10).expect_err("needs a prompt").status, 400);
    }

    #[test]
    fn http_errors_use_the_status_phrase_as_type() {
        assert_eq!(
            String::from_utf8(ApiError::http(404, "Not Found").body()).expect("utf8"),
            r#"{"error":{"message":"Not Found","type":"Not Found","param":null,"code":404}}"#
        );
        assert_eq!(ApiError::http(400, "x").kind, "Bad Request");
    }

    #[test]
    fn eos_honours_ignore_eos_and_min_tokens() {
        let mut r =
            parse_request(Endpoint::Completions, br#"{"prompt":"a","max_tokens":10}"#, 100).expect("ok");
        assert_eq!(plan_generation(&r, None), (10, FinishReason::Length));
        assert_eq!(plan_generation(&r, Some(3)), (3, FinishReason::Stop));
        r.min_tokens = 5;
        assert_eq!(plan_generation(&r, Some(3)), (6, FinishReason::Stop));
        r.ignore_eos = true;
        assert_eq!(plan_generation(&r, Some(3)), (10, FinishReason::Length));
        let mut s = String::new();
        token_text(2, 3, FinishReason::Stop, &mut s);
        token_text(1, 3, FinishReason::Stop, &mut s);
        assert_eq!(s, " t1");
    }
}
