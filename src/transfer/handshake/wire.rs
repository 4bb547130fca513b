//! Side-channel frames as vLLM puts them on the wire: the metadata request, the reply
//! frames and the `{compatibility_hash, agent_metadata_bytes}` payload map.
//!
//! Pure: bytes in, values out. Every decoder runs the bounded structural check in
//! [`super::scan`] first and returns a [`WireError`]; none panics on any input.
//!
//! Owns: framing of vLLM 0.19 and 0.33. Must not open sockets or interpret metadata.

use rmpv::Value;

use super::scan::{self, Limits};

/// The first element of every metadata request (`GET_META_MSG` in vLLM, a msgpack bin).
pub const GET_META_MSG: &[u8] = b"get_meta_msg";

/// Largest request frame decoded. vLLM's is 17 bytes; anything near this is hostile.
pub const MAX_REQUEST_FRAME_BYTES: usize = 1024;
/// Largest reply payload frame decoded: generous for thousands of regions with rkeys.
pub const MAX_REPLY_FRAME_BYTES: usize = 16 << 20;
/// Most elements in any one msgpack array or map of a reply.
pub const MAX_COLLECTION_LEN: usize = 1 << 20;
/// Deepest msgpack nesting accepted in any frame.
pub const MAX_DEPTH: usize = 32;

/// Key of the error reply kvx's server sends for a request it cannot serve.
pub const ERROR_KEY: &str = "kvx_error";

const REQUEST_LIMITS: Limits =
    Limits { max_bytes: MAX_REQUEST_FRAME_BYTES, max_depth: 4, max_collection_len: 16 };
const REPLY_LIMITS: Limits =
    Limits { max_bytes: MAX_REPLY_FRAME_BYTES, max_depth: MAX_DEPTH, max_collection_len: MAX_COLLECTION_LEN };

/// Which vLLM release's framing a request or reply uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Framing {
    /// `[get_meta_msg, tp_rank]`, one reply frame.
    #[serde(rename = "0.19")]
    V0_19,
    /// `[get_meta_msg, pp_rank, tp_rank]`, reply frames payload + msgpack float timestamp.
    #[serde(rename = "0.33")]
    V0_33,
}

impl std::fmt::Display for Framing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Framing::V0_19 => "vLLM 0.19 (tp_rank only, 1 reply frame)",
            Framing::V0_33 => "vLLM 0.33 (pp_rank, tp_rank, 2 reply frames)",
        })
    }
}

/// A bad frame, with the part that was wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("{what}: {source}")]
    Structure {
        what: &'static str,
        #[source]
        source: scan::ScanError,
    },
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error("expected 1 reply frame (vLLM 0.19) or 2 (vLLM 0.33), got {count}")]
    FrameCount { count: usize },
}

impl WireError {
    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        WireError::Invalid { what, reason: reason.into() }
    }
}

/// A decoded metadata request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaRequest {
    pub framing: Framing,
    /// Always 0 under 0.19 framing, which has no pipeline parallelism.
    pub pp_rank: u32,
    pub tp_rank: u32,
}

impl MetaRequest {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24);
        let ranks: &[u32] = match self.framing {
            Framing::V0_19 => &[self.tp_rank],
            Framing::V0_33 => &[self.pp_rank, self.tp_rank],
        };
        // Writes into a Vec cannot fail; the results are ignored for that reason.
        let _ = rmp::encode::write_array_len(&mut out, 1 + ranks.len() as u32);
        let _ = rmp::encode::write_bin(&mut out, GET_META_MSG);
        for r in ranks {
            let _ = rmp::encode::write_uint(&mut out, u64::from(*r));
        }
        out
    }

    pub fn decode(frame: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "metadata request";
        let v = decode_value(WHAT, frame, &REQUEST_LIMITS)?;
        let Value::Array(items) = v else {
            return Err(WireError::invalid(WHAT, format!("expected an array, got {}", kind(&v))));
        };
        let tag_ok = match items.first() {
            Some(Value::Binary(b)) => b.as_slice() == GET_META_MSG,
            Some(Value::String(s)) => s.as_bytes() == GET_META_MSG,
            _ => false,
        };
        if !tag_ok {
            return Err(WireError::invalid(WHAT, "first element is not b\"get_meta_msg\""));
        }
        let rank =
            |i: usize, name: &str| -> Result<u32, WireError> {
                items.get(i).and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok()).ok_or_else(|| {
                    WireError::invalid(WHAT, format!("{name} is not an unsigned 32-bit integer"))
                })
            };
        match items.len() {
            2 => Ok(MetaRequest { framing: Framing::V0_19, pp_rank: 0, tp_rank: rank(1, "tp_rank")? }),
            3 => Ok(MetaRequest {
                framing: Framing::V0_33,
                pp_rank: rank(1, "pp_rank")?,
                tp_rank: rank(2, "tp_rank")?,
            }),
            n => Err(WireError::invalid(WHAT, format!("expected 2 or 3 elements, got {n}"))),
        }
    }
}

/// The reply payload: vLLM's `NixlHandshakePayload`, or kvx's error reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    Meta {
        compatibility_hash: String,
        agent_metadata_bytes: Vec<u8>,
    },
    /// The server could not serve the request (e.g. an unknown rank); the text says why.
    Error(String),
}

impl Payload {
    /// Encodes as msgspec encodes `NixlHandshakePayload` (field order as declared).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Payload::Meta { compatibility_hash, agent_metadata_bytes } => {
                out.reserve(agent_metadata_bytes.len() + 128);
                let _ = rmp::encode::write_map_len(&mut out, 2);
                let _ = rmp::encode::write_str(&mut out, "compatibility_hash");
                let _ = rmp::encode::write_str(&mut out, compatibility_hash);
                let _ = rmp::encode::write_str(&mut out, "agent_metadata_bytes");
                let _ = rmp::encode::write_bin(&mut out, agent_metadata_bytes);
            }
            Payload::Error(msg) => {
                let _ = rmp::encode::write_map_len(&mut out, 1);
                let _ = rmp::encode::write_str(&mut out, ERROR_KEY);
                let _ = rmp::encode::write_str(&mut out, msg);
            }
        }
        out
    }

    /// First phase of vLLM's two-phase decode: the map, not yet the metadata inside.
    pub fn decode(frame: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "reply payload";
        let v = decode_value(WHAT, frame, &REPLY_LIMITS)?;
        let Value::Map(entries) = v else {
            return Err(WireError::invalid(WHAT, format!("expected a map, got {}", kind(&v))));
        };
        let mut hash = None;
        let mut meta = None;
        for (k, v) in entries {
            match (k.as_str(), v) {
                (Some(ERROR_KEY), Value::String(s)) => {
                    return Ok(Payload::Error(s.into_str().unwrap_or_else(|| "(not UTF-8)".to_owned())));
                }
                (Some("compatibility_hash"), Value::String(s)) => {
                    hash = Some(
                        s.into_str()
                            .ok_or_else(|| WireError::invalid(WHAT, "compatibility_hash is not UTF-8"))?,
                    )
                }
                (Some("compatibility_hash"), other) => {
                    return Err(WireError::invalid(
                        WHAT,
                        format!("compatibility_hash is {}, expected a string", kind(&other)),
                    ));
                }
                (Some("agent_metadata_bytes"), Value::Binary(b)) => meta = Some(b),
                (Some("agent_metadata_bytes"), other) => {
                    return Err(WireError::invalid(
                        WHAT,
                        format!("agent_metadata_bytes is {}, expected bytes", kind(&other)),
                    ));
                }
                _ => {}
            }
        }
        match (hash, meta) {
            (Some(compatibility_hash), Some(agent_metadata_bytes)) => {
                Ok(Payload::Meta { compatibility_hash, agent_metadata_bytes })
            }
            (None, _) => Err(WireError::invalid(WHAT, "missing key compatibility_hash")),
            (_, None) => Err(WireError::invalid(WHAT, "missing key agent_metadata_bytes")),
        }
    }
}

/// The frames a REQ socket sees for one reply (the ROUTER's envelope already removed).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub framing: Framing,
    pub payload: Payload,
    /// The server's clock when it replied (0.33's `perf_counter`; kvx sends Unix seconds).
    pub peer_clock_s: Option<f64>,
}

impl Reply {
    /// The frames to send after the envelope: `[payload]` (0.19) or `[payload, clock]`.
    pub fn encode_frames(framing: Framing, payload: &[u8], clock_s: f64) -> Vec<Vec<u8>> {
        match framing {
            Framing::V0_19 => vec![payload.to_vec()],
            Framing::V0_33 => {
                let mut ts = Vec::with_capacity(9);
                let _ = rmp::encode::write_f64(&mut ts, clock_s);
                vec![payload.to_vec(), ts]
            }
        }
    }

    pub fn decode(frames: &[Vec<u8>]) -> Result<Self, WireError> {
        let (framing, payload, clock) = match frames {
            [payload] => (Framing::V0_19, payload, None),
            [payload, clock] => (Framing::V0_33, payload, Some(clock)),
            _ => return Err(WireError::FrameCount { count: frames.len() }),
        };
        let payload = Payload::decode(payload)?;
        let peer_clock_s =
            match clock {
                None => None,
                Some(frame) => {
                    const WHAT: &str = "reply timestamp";
                    let limits = Limits { max_bytes: 16, max_depth: 1, max_collection_len: 0 };
                    let v = decode_value(WHAT, frame, &limits)?;
                    Some(v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)).ok_or_else(|| {
                        WireError::invalid(WHAT, format!("expected a float, got {}", kind(&v)))
                    })?)
                }
            };
        Ok(Reply { framing, payload, peer_clock_s })
    }
}

/// Structural check, then a full decode into an `rmpv::Value`.
pub(crate) fn decode_value(what: &'static str, bytes: &[u8], limits: &Limits) -> Result<Value, WireError> {
    scan::check(bytes, limits).map_err(|source| WireError::Structure { what, source })?;
    let mut rd = bytes;
    rmpv::decode::read_value(&mut rd).map_err(|e| WireError::invalid(what, format!("msgpack: {e}")))
}

pub(crate) fn reply_limits() -> &'static Limits {
    &REPLY_LIMITS
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Nil => "nil",
        Value::Boolean(_) => "a boolean",
        Value::Integer(_) => "an integer",
        Value::F32(_) | Value::F64(_) => "a float",
        Value::String(_) => "a string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext(..) => "an extension value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_match_vllm_bytes() {
        let r33 = MetaRequest { framing: Framing::V0_33, pp_rank: 0, tp_rank: 1 };
        assert_eq!(hex::encode(r33.encode()), "93c40c6765745f6d6574615f6d73670001");
        let r19 = MetaRequest { framing: Framing::V0_19, pp_rank: 0, tp_rank: 1 };
        assert_eq!(hex::encode(r19.encode()), "92c40c6765745f6d6574615f6d736701");
        assert_eq!(MetaRequest::decode(&r33.encode()), Ok(r33));
        assert_eq!(MetaRequest::decode(&r19.encode()), Ok(r19));
        let big = MetaRequest { framing: Framing::V0_33, pp_rank: 70000, tp_rank: u32::MAX };
        assert_eq!(MetaRequest::decode(&big.encode()), Ok(big));
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        for bad in [
            &b""[..],
            &[0x90],
            &[0x92, 0xa3, b'f', b'o', b'o', 0x01],
            &[0x91, 0xc4, 0x0c],
            &[0x94, 0xc4, 0x01, b'g', 0, 0, 0],
            &[0x92, 0xc4, 0x0c, b'g', b'e', b't', b'_', b'm', b'e', b't', b'a', b'_', b'm', b's', b'g', 0xff],
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
        ] {
            assert!(MetaRequest::decode(bad).is_err(), "{bad:02x?} accepted");
        }
        let mut oversized = MetaRequest { framing: Framing::V0_33, pp_rank: 0, tp_rank: 0 }.encode();
        oversized.resize(MAX_REQUEST_FRAME_BYTES + 1, 0);
        assert!(matches!(
            MetaRequest::decode(&oversized),
            Err(WireError::Structure { source: scan::ScanError::TooLarge { .. }, .. })
        ));
    }

    #[test]
    fn payload_round_trips_and_errors_are_named() {
        let p = Payload::Meta { compatibility_hash: "ab".repeat(32), agent_metadata_bytes: vec![7; 517] };
        assert_eq!(Payload::decode(&p.encode()), Ok(p.clone()));
        let e = Payload::Error("no rank (0, 9)".into());
        assert_eq!(Payload::decode(&e.encode()), Ok(e));
        let frames = Reply::encode_frames(Framing::V0_33, &p.encode(), 12.5);
        let reply = Reply::decode(&frames).expect("decodes");
        assert_eq!((reply.framing, reply.peer_clock_s), (Framing::V0_33, Some(12.5)));
        let reply = Reply::decode(&Reply::encode_frames(Framing::V0_19, &p.encode(), 0.0)).expect("decodes");
        assert_eq!((reply.framing, reply.peer_clock_s), (Framing::V0_19, None));
        assert!(matches!(Reply::decode(&[]), Err(WireError::FrameCount { count: 0 })));
        let missing = {
            let mut out = Vec::new();
            let _ = rmp::encode::write_map_len(&mut out, 1);
            let _ = rmp::encode::write_str(&mut out, "compatibility_hash");
            let _ = rmp::encode::write_str(&mut out, "x");
            out
        };
        let err = Payload::decode(&missing).expect_err("missing metadata");
        assert!(err.to_string().contains("agent_metadata_bytes"), "{err}");
    }
}
