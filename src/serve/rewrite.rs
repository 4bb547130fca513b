//! The toy proxy's request rewriting, reproduced on raw JSON so key order and every value the
//! client sent survive untouched (Python dicts keep insertion order; assigning an existing key
//! keeps its position, a new key goes last).
//!
//! Owns only byte-level body transforms: no HTTP, no policy. Values are never re-encoded:
//! each top-level value is carried as the exact text the client (or P) sent. Whitespace
//! between top-level tokens is not preserved (the toy's `httpx` re-serialises with Python's
//! `json.dumps` separators; kvx writes compact JSON), which no JSON reader can observe.

use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The six-key object the toy proxy sends to P (vLLM reads only `do_remote_decode`).
pub const PREFILL_KV_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// A JSON object as an ordered list of `(key, raw value text)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawObject<'a> {
    entries: Vec<(String, &'a str)>,
}

/// Why a body is not a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotAnObject(pub String);

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Vec<(String, &'de str)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(map.size_hint().unwrap_or(8));
        while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
            out.push((k, v.get()));
        }
        Ok(out)
    }
}

struct Entries<'a>(Vec<(String, &'a str)>);

impl<'de> de::Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(EntriesVisitor).map(Entries)
    }
}

impl<'a> RawObject<'a> {
    /// Parses a body that must be one JSON object.
    pub fn parse(body: &'a [u8]) -> Result<Self, NotAnObject> {
        let text = std::str::from_utf8(body).map_err(|e| NotAnObject(format!("body is not UTF-8: {e}")))?;
        let entries: Entries<'a> = serde_json::from_str(text).map_err(|e| {
            if e.is_data() {
                NotAnObject(format!("request body must be a JSON object: {e}"))
            } else {
                NotAnObject(format!("Invalid JSON body: {e}"))
            }
        })?;
        Ok(Self { entries: entries.0 })
    }

    /// Raw text of a top-level value.
    pub fn get(&self, key: &str) -> Option<&'a str> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// `d[key] = raw`: replaces in place, or appends.
    pub fn set(&mut self, key: &str, raw: &'a str) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = raw,
            None => self.entries.push((key.to_string(), raw)),
        }
    }

    /// `d.pop(key, None)`.
    pub fn remove(&mut self, key: &str) {
        self.entries.retain(|(k, _)| k != key);
    }

    /// Compact serialisation in entry order.
    pub fn to_vec(&self) -> Vec<u8> {
        let cap = self.entries.iter().map(|(k, v)| k.len() + v.len() + 4).sum::<usize>() + 2;
        let mut out = Vec::with_capacity(cap);
        out.push(b'{');
        for (i, (k, v)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut out, k);
            out.push(b':');
            out.extend_from_slice(v.as_bytes());
        }
        out.push(b'}');
        out
    }
}

/// The body of the prefill leg, exactly as `toy_proxy_server.send_request_to_service`
/// builds it: `kv_transfer_params` = [`PREFILL_KV_PARAMS`], `stream=false`, `max_tokens=1`,
/// `max_completion_tokens=1` only if present, and no `stream_options`, `min_tokens`,
/// `min_completion_tokens`.
pub fn prefill_body(client: &RawObject<'_>) -> Vec<u8> {
    let mut p = client.clone();
    p.set("kv_transfer_params", PREFILL_KV_PARAMS);
    p.set("stream", "false");
    p.set("max_tokens", "1");
    if p.contains("max_completion_tokens") {
        p.set("max_completion_tokens", "1");
    }
    p.remove("stream_options");
    p.remove("min_tokens");
    p.remove("min_completion_tokens");
    p.to_vec()
}

/// Python truthiness of a raw JSON value (`if kv_transfer_params:` in the toy proxy).
pub fn is_truthy(raw: &str) -> bool {
    let compact: String = raw.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    !matches!(compact.as_str(), "null" | "false" | "0" | "0.0" | "\"\"" | "[]" | "{}")
}

/// The body of the decode leg: the client's body, with `kv_transfer_params` set to P's
/// object verbatim when P returned a non-empty one. With `None` the body is the client's,
/// unchanged, and D will prefill locally (the toy proxy's silent fallback).
pub fn decode_body(client: &RawObject<'_>, original: &[u8], p_params: Option<&str>) -> Vec<u8> {
    match p_params {
        Some(params) => {
            let mut d = client.clone();
            d.set("kv_transfer_params", params);
            d.to_vec()
        }
        None => original.to_vec(),
    }
}

/// The identity a push-mode decode leg needs, from a prefill answer's `kv_transfer_params`
/// (raw JSON): who the prefill engine is and where its side channel listens, without block ids
/// or request id (decode registers its own blocks; prefill matches the registration by the
/// request id both legs share). `None` for a pull answer, which decode can only act on with
/// the blocks it names.
pub fn push_identity(p_params: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(p_params).ok()?;
    let m = v.as_object()?;
    if m.get("transfer_mode").and_then(serde_json::Value::as_str) != Some("push") {
        return None;
    }
    let mut out = serde_json::Map::new();
    out.insert("do_remote_prefill".into(), true.into());
    out.insert("do_remote_decode".into(), false.into());
    for k in ["remote_engine_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size"] {
        out.insert(k.into(), m.get(k)?.clone());
    }
    out.insert("transfer_mode".into(), "push".into());
    serde_json::to_string(&serde_json::Value::Object(out)).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn push_identity_keeps_who_prefill_is_and_drops_the_blocks() {
        let push = r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],
            "remote_engine_id":"P","remote_request_id":"cmpl-x-0-1a2b3c4d","remote_host":"10.0.0.1",
            "remote_port":5600,"tp_size":8,"dcp_size":1,"pp_size":1,"transfer_mode":"push"}"#;
        let id: serde_json::Value =
            serde_json::from_str(&super::push_identity(push).expect("push")).expect("json");
        assert_eq!(id["remote_engine_id"], "P");
        assert_eq!(id["tp_size"], 8);
        assert_eq!(id["transfer_mode"], "push");
        assert!(id.get("remote_block_ids").is_none() && id.get("remote_request_id").is_none());
        assert_eq!(super::push_identity(&push.replace("\"push\"", "\"pull\"")), None);
        assert_eq!(super::push_identity("not json"), None);
    }

    use super::*;

    #[test]
    fn prefill_leg_matches_the_observed_toy_proxy_body() {
        // Protocol doc §2.1 -> §2.2 (observed on the wire from the toy proxy).
        let client =
            br#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":4,"stream":true,
 "stream_options":{"include_usage":true},"min_tokens":2}"#;
        let obj = RawObject::parse(client).expect("object");
        let p = String::from_utf8(prefill_body(&obj)).expect("utf8");
        let want = r#"{"model":"stub-model","prompt":"hello world how are you","max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#;
        assert_eq!(p, want);
        let parsed: serde_json::Value = serde_json::from_str(&p).expect("valid json");
        assert_eq!(parsed["kv_transfer_params"]["do_remote_decode"], true);
    }

    #[test]
    fn chat_prefill_leg_appends_max_tokens_last() {
        let client = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":9,"stream":true,"min_completion_tokens":3}"#;
        let obj = RawObject::parse(client).expect("object");
        let p = String::from_utf8(prefill_body(&obj)).expect("utf8");
        let want = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_completion_tokens":1,"stream":false,"kv_transfer_params":{PREFILL_KV_PARAMS},"max_tokens":1}}"#
        );
        assert_eq!(p, want);
    }

    #[test]
    fn decode_leg_is_the_original_body_plus_p_params_verbatim() {
        let client = br#"{"model":"m","prompt":"a \u00e9 b","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"min_tokens":2}"#;
        let obj = RawObject::parse(client).expect("object");
        let params = r#"{"do_remote_prefill":true,"remote_block_ids":[[1, 2]],"x":1.50}"#;
        let d = String::from_utf8(decode_body(&obj, client, Some(params))).expect("utf8");
        assert_eq!(
            d,
            r#"{"model":"m","prompt":"a \u00e9 b","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"min_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1, 2]],"x":1.50}}"#
        );
        assert_eq!(decode_body(&obj, client, None), client.to_vec());
        // A client-sent kv_transfer_params keeps its position and is replaced.
        let with = br#"{"kv_transfer_params":null,"prompt":"a"}"#;
        let obj = RawObject::parse(with).expect("object");
        assert_eq!(
            decode_body(&obj, with, Some("{\"a\":1}")),
            br#"{"kv_transfer_params":{"a":1},"prompt":"a"}"#
        );
    }

    #[test]
    fn rejects_non_objects_and_reads_truthiness() {
        assert!(RawObject::parse(b"[1]").expect_err("array").0.contains("JSON object"));
        assert!(RawObject::parse(b"{\"a\":").expect_err("eof").0.contains("Invalid JSON"));
        assert!(!is_truthy("null") && !is_truthy("{ }") && !is_truthy("{}"));
        assert!(is_truthy(r#"{"do_remote_prefill":true}"#));
    }
}
