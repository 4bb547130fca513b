//! The ZMQ side channel: how a decode rank learns what a prefill rank registered.
//!
//! Framing follows vLLM's NixlConnector so that kvx can also talk to (and `kvx probe`)
//! a live vLLM engine: the prefill side binds a ROUTER, the decode side sends
//! `msgpack([b"get_meta_msg", pp_rank, tp_rank])` on a REQ socket (0.19:
//! `[b"get_meta_msg", tp_rank]`), and the reply is the msgpack map
//! `{compatibility_hash, agent_metadata_bytes}` (plus a clock frame in 0.33).
//!
//! - [`wire`]: request/reply frames and the payload map (pure).
//! - [`scan`]: bounded structural check every untrusted frame passes before decoding.
//! - [`meta`]: kvx's own tagged metadata and vLLM's `NixlAgentMetadata`.
//! - [`compat`]: the compatibility hash, byte-exact with vLLM's, and factor diffs.
//! - [`server`]: the prefill-side listener thread.
//! - [`client`]: the decode-side fetch with retries, hash check and validation.
//!
//! Owns: the side-channel protocol. Must not call UCX: worker addresses and packed rkeys
//! are opaque bytes here, unpacked by `transfer::ucx`.
#![forbid(unsafe_code)]

pub mod client;
pub mod compat;
pub mod meta;
pub mod scan;
pub mod server;
pub mod vllm_meta;
pub mod wire;

use std::time::Duration;

pub use client::{FetchOptions, HandshakeClient, PeerMetadata, RawReply, RetryEvent, RetryHook};
pub use compat::{
    CompatFactors, FactorDiff, KvxFactors, VllmFactorsV019, VllmFactorsV033, VllmModelFactors, diff,
};
pub use meta::{
    AgentMetadata, KVX_METADATA_FORMAT, KVX_METADATA_TAG, KvxMetadata, KvxRegion, VllmAgentMetadata,
};
pub use server::{HandshakeServer, PayloadTable, ServerStats};
pub use wire::{Framing, MetaRequest, Payload, Reply, WireError};

use crate::error::ConfigError;

/// Everything that can go wrong in a handshake, with the peer and what to change.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("bad frame from {endpoint}: {source}")]
    Wire {
        endpoint: String,
        #[source]
        source: WireError,
    },
    #[error(transparent)]
    Zmq(#[from] ZmqFailure),
    #[error(
        "no connection to {endpoint} after {waited:?} ({attempts} attempts): is the prefill engine up, and are the side-channel host and port right? (raise the timeout to wait longer)"
    )]
    NotConnected { endpoint: String, waited: Duration, attempts: u32 },
    #[error(
        "{endpoint} accepted the connection but sent no reply for (pp_rank {pp_rank}, tp_rank {tp_rank}) within {waited:?} ({attempts} attempts); a vLLM 0.19 engine does not answer 0.33 requests for ranks it lacks: check the rank and the framing"
    )]
    NoReply { endpoint: String, pp_rank: u32, tp_rank: u32, waited: Duration, attempts: u32 },
    #[error(
        "{endpoint} cannot be reached: {why} (no reply after {waited:?}, {attempts} attempts): is the address right, and is there a route to it?"
    )]
    Unreachable { endpoint: String, why: String, waited: Duration, attempts: u32 },
    #[error("{endpoint} refused the request: {message}")]
    PeerError { endpoint: String, message: String },
    #[error("{}", mismatch_message(.endpoint, .local, .remote, .diffs.as_deref()))]
    HashMismatch {
        endpoint: String,
        local: String,
        remote: String,
        /// `None` when the peer does not advertise its factors (it is not kvx).
        diffs: Option<Vec<FactorDiff>>,
    },
    #[error(
        "{endpoint} advertises factors that hash to {computed}, but claims hash {claimed}: the peer is inconsistent"
    )]
    InconsistentHash { endpoint: String, claimed: String, computed: String },
    #[error("{endpoint} advertises {kind} metadata, not kvx's: use `kvx probe {endpoint}` to see what it is")]
    NotKvx { endpoint: String, kind: &'static str },
    #[error("{endpoint} (pp_rank {pp_rank}, tp_rank {tp_rank}) is incompatible: {message}")]
    Rejected { endpoint: String, pp_rank: u32, tp_rank: u32, message: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
}

fn mismatch_message(endpoint: &str, local: &str, remote: &str, diffs: Option<&[FactorDiff]>) -> String {
    let mut msg = format!("compatibility hash mismatch with {endpoint}: local {local}, remote {remote}; ");
    match diffs {
        Some([]) => msg.push_str("the factors are equal but the hashes differ (the peer is inconsistent)"),
        Some(d) => {
            let list: Vec<String> = d.iter().map(ToString::to_string).collect();
            msg.push_str(&format!("differing factors: {}", list.join(", ")));
        }
        None => msg.push_str(
            "the peer does not advertise its factors; compare model, dtype, KV heads, head size, layers, cache dtype and versions on both sides",
        ),
    }
    msg
}

/// How side-channel ports are assigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PortScheme {
    /// vLLM ≥ 0.11: one ROUTER per engine at `base + dp_rank`, serving every (pp, tp) rank.
    #[default]
    PerEngine,
    /// Older vLLM: one listener per worker at `base + dp_rank * tp_size + tp_rank`.
    PerWorker,
}

impl PortScheme {
    /// The port a peer's side channel listens on, or an error naming the flag when it
    /// does not fit in 16 bits.
    pub fn port(self, base_port: u16, dp_rank: u32, tp_size: u32, tp_rank: u32) -> Result<u16, ConfigError> {
        let offset = match self {
            PortScheme::PerEngine => u64::from(dp_rank),
            PortScheme::PerWorker => u64::from(dp_rank) * u64::from(tp_size) + u64::from(tp_rank),
        };
        u16::try_from(u64::from(base_port) + offset).map_err(|_| {
            ConfigError::new(
                "--side-channel-port",
                format!("base port {base_port} + rank offset {offset} is above 65535"),
            )
        })
    }
}

/// The process-wide ZMQ context kvx's sockets share (one I/O thread, created lazily).
/// A ZMQ call that failed: which, on which endpoint, and why.
#[derive(Debug, thiserror::Error)]
#[error("ZMQ {op} on {endpoint} failed: {source}")]
pub struct ZmqFailure {
    pub op: &'static str,
    pub endpoint: String,
    #[source]
    pub source: zmq::Error,
}

impl ZmqFailure {
    /// For `map_err`: the failure of call `op` on `endpoint`.
    pub fn of(op: &'static str, endpoint: &str) -> impl FnOnce(zmq::Error) -> ZmqFailure {
        let endpoint = endpoint.to_owned();
        move |source| ZmqFailure { op, endpoint, source }
    }
}

pub fn zmq_context() -> &'static zmq::Context {
    static CTX: std::sync::OnceLock<zmq::Context> = std::sync::OnceLock::new();
    CTX.get_or_init(zmq::Context::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_schemes() {
        assert_eq!(PortScheme::PerEngine.port(5600, 3, 8, 5), Ok(5603));
        assert_eq!(PortScheme::PerWorker.port(5600, 3, 8, 5), Ok(5629));
        let err = PortScheme::PerWorker.port(65530, 1, 8, 0).expect_err("overflow");
        assert_eq!(err.flag, "--side-channel-port");
    }

    #[test]
    fn mismatch_message_names_factors_or_says_why_not() {
        let e = HandshakeError::HashMismatch {
            endpoint: "tcp://h:1".into(),
            local: "aa".into(),
            remote: "bb".into(),
            diffs: Some(vec![FactorDiff {
                name: "dtype".into(),
                local: Some("a".into()),
                remote: Some("b".into()),
            }]),
        };
        assert!(e.to_string().contains(r#"differing factors: dtype (local "a", remote "b")"#), "{e}");
        let e = HandshakeError::HashMismatch {
            endpoint: "tcp://h:1".into(),
            local: "aa".into(),
            remote: "bb".into(),
            diffs: None,
        };
        assert!(e.to_string().contains("does not advertise its factors"), "{e}");
    }
}

/// Checks against the vectors captured from vLLM itself (`shared/oracle/`, beside the
/// project root). A missing oracle fails these tests: they must not pass vacuously.
#[cfg(test)]
mod oracle_tests {
    use serde_json::Value;

    use super::*;

    fn oracle() -> Value {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let shared = root.join("../shared/oracle");
        let dir = std::env::var_os(crate::vocab::env::KVX_ORACLE_DIR).map_or_else(
            || {
                if shared.join("descriptors.json").exists() {
                    shared
                } else {
                    root.join("tests/fixtures/oracle")
                }
            },
            std::path::PathBuf::from,
        );
        let path = dir.join("descriptors.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("oracle {} is required for these tests: {e}", path.display()));
        serde_json::from_str(&text).expect("oracle is JSON")
    }

    fn hex_field(v: &Value) -> Vec<u8> {
        hex::decode(v.as_str().expect("hex string")).expect("valid hex")
    }

    fn factors_from(v: &Value) -> CompatFactors {
        CompatFactors::from_json(&v.to_string()).expect("factors object")
    }

    /// The factors every version hashes, from an oracle case's `factors`.
    fn common_factors(f: &serde_json::Value) -> VllmModelFactors {
        VllmModelFactors {
            vllm_version: f["vllm_version"].as_str().expect("str").into(),
            nixl_connector_version: f["nixl_connector_version"].as_u64().expect("int"),
            model: f["model"].as_str().expect("str").into(),
            dtype: f["dtype"].as_str().expect("str").into(),
            num_kv_heads: f["num_kv_heads"].as_u64().expect("int"),
            head_size: f["head_size"].as_u64().expect("int"),
            num_hidden_layers: f["num_hidden_layers"].as_u64().expect("int"),
            attn_backend_name: f["attn_backend_name"].as_str().expect("str").into(),
            cache_dtype: f["cache_dtype"].as_str().expect("str").into(),
        }
    }

    #[test]
    fn v0_33_hash_and_canonical_json() {
        let o = oracle();
        let h = &o["handshake_and_lifecycle"]["vllm_0.33.0"]["handshake"]["compat_hash"];
        let f = &h["factors"];
        let typed = CompatFactors::vllm_v0_33(&VllmFactorsV033 {
            common: common_factors(f),
            is_hma_enabled: f["is_hma_enabled"].as_bool().expect("bool"),
            speculative_config: None,
            transfer_mode: f["transfer_mode"].as_str().expect("str").into(),
        });
        assert_eq!(typed, factors_from(f));
        assert_eq!(typed.canonical_json(), h["json_canonical"].as_str().expect("str"));
        assert_eq!(typed.hash_hex(), h["compute_nixl_compatibility_hash_executed"].as_str().expect("str"));
    }

    #[test]
    fn v0_19_hash() {
        let o = oracle();
        let h = &o["handshake_and_lifecycle"]["vllm_0.19.1"]["compat_hash"];
        let f = &h["factors"];
        let typed = CompatFactors::vllm_v0_19(&VllmFactorsV019 {
            common: common_factors(f),
            cross_layers_blocks: f["cross_layers_blocks"].as_bool().expect("bool"),
            is_hma_enabled: f["is_hma_enabled"].as_bool().expect("bool"),
        });
        assert_eq!(typed, factors_from(f));
        assert_eq!(typed.hash_hex(), h["executed"].as_str().expect("str"));
    }

    #[test]
    fn captured_frames_decode_and_reencode_byte_for_byte() {
        let o = oracle();
        let hs = &o["handshake_and_lifecycle"]["vllm_0.33.0"]["handshake"];
        let req = hex_field(&hs["request_frame_hex"]);
        let parsed = MetaRequest::decode(&req).expect("0.33 request");
        assert_eq!(parsed, MetaRequest { framing: Framing::V0_33, pp_rank: 0, tp_rank: 1 });
        assert_eq!(parsed.encode(), req);

        let payload = hex_field(&hs["reply_frames"]["frame0_payload_hex"]);
        let decoded = Payload::decode(&payload).expect("0.33 payload");
        assert_eq!(decoded.encode(), payload, "kvx encodes the payload map as msgspec does");
        let Payload::Meta { compatibility_hash, agent_metadata_bytes } = decoded else {
            panic!("not a metadata payload")
        };
        assert_eq!(compatibility_hash, hs["reply_frames"]["frame0_decoded"]["compatibility_hash"]);
        let AgentMetadata::Vllm(m) = AgentMetadata::decode(&agent_metadata_bytes).expect("decodes") else {
            panic!("not recognised as vLLM metadata")
        };
        let want = &hs["reply_frames"]["frame0_agent_metadata_decoded"];
        assert_eq!(m.engine_id.as_deref(), Some("P-engine"));
        assert_eq!(
            hex::encode(&m.agent_metadata),
            want["agent_metadata"]["bytes_hex"].as_str().expect("hex")
        );
        assert_eq!(serde_json::json!(m.kv_caches_base_addr), want["kv_caches_base_addr"]);
        assert_eq!(serde_json::json!(m.block_lens), want["block_lens"]);
        assert_eq!(serde_json::json!(m.block_strides), want["block_strides"]);
        assert_eq!(serde_json::json!(m.num_blocks), want["num_blocks"]);
        assert_eq!(serde_json::json!(m.region_names), want["region_names"]);
        assert_eq!(m.kv_cache_layout.as_deref(), Some("LBHNC"));
        assert_eq!(m.other_fields["ple_block_len"], Value::Null);
        assert_eq!(m.other_fields["dcp_size"], want["dcp_size"]);
        assert!(m.undecodable.is_empty(), "{:?}", m.undecodable);

        let v19 = &o["handshake_and_lifecycle"]["vllm_0.19.1"];
        let req = hex_field(&v19["request_frame_hex"]);
        assert_eq!(
            MetaRequest::decode(&req).expect("0.19 request"),
            MetaRequest { framing: Framing::V0_19, pp_rank: 0, tp_rank: 1 }
        );
        let payload = hex_field(&v19["frame0_payload_hex"]);
        let reply = Reply::decode(&[payload]).expect("0.19 reply");
        assert_eq!(reply.framing, Framing::V0_19);
        let Payload::Meta { agent_metadata_bytes, .. } = reply.payload else { panic!("not metadata") };
        let AgentMetadata::Vllm(m) = AgentMetadata::decode(&agent_metadata_bytes).expect("decodes") else {
            panic!("not vLLM metadata")
        };
        assert_eq!(m.kv_cache_layout.as_deref(), Some("HND"));
        assert_eq!(
            serde_json::json!(m.kv_caches_base_addr),
            v19["agent_metadata_decoded"]["kv_caches_base_addr"]
        );
        assert_eq!(m.block_strides, None);
    }
}

/// Decoders must return, never panic, on any bytes: random frames and mutations of
/// valid ones (bit flips, truncations, splices, length-field corruption).
#[cfg(test)]
mod fuzz_tests {
    use proptest::prelude::*;

    use super::*;

    fn vllm_like_metadata() -> Vec<u8> {
        use rmpv::Value as V;
        let v = V::Map(vec![
            (V::from("engine_id"), V::from("P-engine")),
            (V::from("agent_metadata"), V::Binary(vec![0x61; 45])),
            (V::from("kv_caches_base_addr"), V::Array(vec![V::from(8589934592u64), V::from(8589950976u64)])),
            (V::from("num_blocks"), V::from(4)),
            (V::from("block_lens"), V::Array(vec![V::from(4096), V::from(4096)])),
            (V::from("kv_cache_layout"), V::from("LBHNC")),
            (V::from("ple_block_len"), V::Nil),
            (V::from("packed_member_layouts"), V::Map(vec![])),
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).expect("encode to vec");
        out
    }

    fn seeds() -> Vec<Vec<u8>> {
        let kvx = meta::tests::sample(1).encode().expect("encodes");
        let vllm = vllm_like_metadata();
        vec![
            MetaRequest { framing: Framing::V0_33, pp_rank: 0, tp_rank: 1 }.encode(),
            MetaRequest { framing: Framing::V0_19, pp_rank: 0, tp_rank: 3 }.encode(),
            Payload::Meta { compatibility_hash: "ab".repeat(32), agent_metadata_bytes: kvx.clone() }.encode(),
            Payload::Meta { compatibility_hash: "cd".repeat(32), agent_metadata_bytes: vllm.clone() }
                .encode(),
            Payload::Error("no such rank".into()).encode(),
            kvx,
            vllm,
        ]
    }

    #[derive(Debug, Clone)]
    enum Mutation {
        Flip(usize, u8),
        Set(usize, u8),
        Truncate(usize),
        Insert(usize, Vec<u8>),
        Remove(usize, usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), 1u8..).prop_map(|(i, b)| Mutation::Flip(i, b)),
            // Length and marker bytes are where hostile frames hurt.
            (
                any::<usize>(),
                prop_oneof![Just(0xffu8), Just(0xdd), Just(0xdf), Just(0xc6), Just(0xdb), any::<u8>()]
            )
                .prop_map(|(i, b)| Mutation::Set(i, b)),
            any::<usize>().prop_map(Mutation::Truncate),
            (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
                .prop_map(|(i, b)| Mutation::Insert(i, b)),
            (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
        ]
    }

    fn apply(mut bytes: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
        for m in muts {
            let len = bytes.len().max(1);
            match m {
                Mutation::Flip(i, b) => {
                    if let Some(x) = bytes.get_mut(i % len) {
                        *x ^= b;
                    }
                }
                Mutation::Set(i, b) => {
                    if let Some(x) = bytes.get_mut(i % len) {
                        *x = *b;
                    }
                }
                Mutation::Truncate(i) => bytes.truncate(i % len),
                Mutation::Insert(i, b) => {
                    let at = i % (bytes.len() + 1);
                    bytes.splice(at..at, b.iter().copied());
                }
                Mutation::Remove(i, n) => {
                    let at = i % len;
                    let end = (at + n).min(bytes.len());
                    if at < end {
                        bytes.drain(at..end);
                    }
                }
            }
        }
        bytes
    }

    fn decode_everything(bytes: &[u8]) {
        let _ = scan::check(bytes, wire::reply_limits());
        let _ = MetaRequest::decode(bytes);
        let _ = Payload::decode(bytes);
        let _ = Reply::decode(&[bytes.to_vec()]);
        let _ = Reply::decode(&[bytes.to_vec(), bytes.to_vec()]);
        let _ = KvxMetadata::decode(bytes);
        let _ = VllmAgentMetadata::decode(bytes);
        let _ = AgentMetadata::decode(bytes);
        if let Ok(Payload::Meta { agent_metadata_bytes, .. }) = Payload::decode(bytes) {
            let _ = AgentMetadata::decode(&agent_metadata_bytes);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            decode_everything(&bytes);
        }

        #[test]
        fn mutated_frames_never_panic(seed in 0usize..7, muts in prop::collection::vec(mutation(), 1..6)) {
            let seeds = seeds();
            let bytes = apply(seeds[seed % seeds.len()].clone(), &muts);
            decode_everything(&bytes);
        }

        #[test]
        fn a_scan_pass_means_rmpv_decodes(seed in 0usize..7, muts in prop::collection::vec(mutation(), 1..4)) {
            let seeds = seeds();
            let bytes = apply(seeds[seed % seeds.len()].clone(), &muts);
            if scan::check(&bytes, wire::reply_limits()).is_ok() {
                let mut rd = bytes.as_slice();
                prop_assert!(rmpv::decode::read_value(&mut rd).is_ok());
                prop_assert!(rd.is_empty());
            }
        }

        #[test]
        fn requests_round_trip(pp in any::<u32>(), tp in any::<u32>(), v033 in any::<bool>()) {
            let framing = if v033 { Framing::V0_33 } else { Framing::V0_19 };
            let pp = if v033 { pp } else { 0 };
            let r = MetaRequest { framing, pp_rank: pp, tp_rank: tp };
            prop_assert_eq!(MetaRequest::decode(&r.encode()), Ok(r));
        }
    }
}
