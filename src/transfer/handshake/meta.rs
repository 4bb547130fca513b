//! What travels in `agent_metadata_bytes`: kvx's own metadata, or vLLM's
//! `NixlAgentMetadata`, told apart by a tag.
//!
//! kvx's metadata is a versioned msgpack map (rmp-serde, named fields) whose
//! `kvx_format` key holds [`KVX_METADATA_TAG`]; vLLM's is a msgspec map keyed by field
//! names whose `agent_metadata` entry is NIXL's opaque agent blob (UCX worker address and
//! packed rkeys in NIXL's own serialization), which kvx shows but cannot decode.
//! Worker addresses and rkeys are opaque bytes here too: only the UCX layer unpacks them.
//!
//! Owns: the metadata formats. Must not open sockets or call UCX.

use std::collections::BTreeMap;

use rmpv::Value;
use serde::{Deserialize, Serialize};

use super::compat::CompatFactors;
use super::wire::{self, WireError};

/// Value of the `kvx_format` key that marks kvx metadata.
pub const KVX_METADATA_TAG: &str = "kvx.agent-metadata";
/// Version of kvx's metadata format this build writes and reads.
pub const KVX_METADATA_FORMAT: u32 = 1;

/// Most regions one rank may advertise.
pub const MAX_REGIONS: usize = 1 << 16;
/// Largest worker address or packed rkey accepted.
pub const MAX_OPAQUE_BYTES: usize = 1 << 16;
/// Longest name, id or layout string accepted.
pub const MAX_STRING_BYTES: usize = 4096;

/// One registered region of a rank, as a peer needs it to read blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvxRegion {
    pub name: String,
    /// `host` or `cuda` (memory type is a property of a region).
    pub mem_type: String,
    pub device_id: u32,
    pub base_addr: u64,
    /// UCX packed remote key (opaque here).
    #[serde(with = "serde_bytes")]
    pub rkey: Vec<u8>,
    pub block_len_bytes: u64,
    /// Distance between consecutive blocks; at least `block_len_bytes`.
    pub block_stride_bytes: u64,
    pub num_blocks: u64,
}

/// kvx's `agent_metadata_bytes` for one (pp_rank, tp_rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvxMetadata {
    /// Always [`KVX_METADATA_TAG`]; set by [`KvxMetadata::encode`].
    pub kvx_format: String,
    /// Always [`KVX_METADATA_FORMAT`] when written by this build.
    pub format_version: u32,
    pub kvx_version: String,
    pub engine_id: String,
    /// UCX worker address (opaque here).
    #[serde(with = "serde_bytes")]
    pub worker_address: Vec<u8>,
    pub tp_size: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    pub dp_rank: u32,
    pub layout: String,
    pub block_size_tokens: u32,
    pub regions: Vec<KvxRegion>,
    /// Where this rank listens for `"<req>:<n>"` notifications and heartbeats, if anywhere.
    pub notify_endpoint: Option<String>,
    /// The factors behind the advertised compatibility hash, as canonical JSON, so a peer
    /// with a different hash can say which factors differ.
    pub compat_factors_json: String,
    /// `--transport cuda-batch`: the rank's KV pool exported for CUDA IPC. Absent (and not
    /// written) otherwise, so metadata without it reads and writes as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_ipc: Option<CudaIpcExport>,
}

/// A rank's device pool as CUDA IPC exports it (`cuIpcGetMemHandle` of the whole `cuMemAlloc`
/// allocation), with what a peer checks before opening it: the machine and process it came
/// from (IPC works only between processes of one machine, never within one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaIpcExport {
    /// The `CUipcMemHandle` (64 opaque bytes).
    #[serde(with = "serde_bytes")]
    pub handle: Vec<u8>,
    /// The allocation's device address in the exporting process (offsets are from it).
    pub base_addr: u64,
    pub len: u64,
    /// The CUDA device ordinal the memory lives on, in the exporting process.
    pub device: u32,
    /// The exporting machine's boot id (`/proc/sys/kernel/random/boot_id`).
    pub machine_id: String,
    pub pid: u32,
}

impl KvxMetadata {
    /// A metadata record with the tag, format version and kvx version filled in.
    #[expect(clippy::too_many_arguments, reason = "one argument per advertised field, all required")]
    pub fn new(
        engine_id: impl Into<String>,
        worker_address: Vec<u8>,
        (tp_size, tp_rank, pp_rank, dp_rank): (u32, u32, u32, u32),
        layout: impl Into<String>,
        block_size_tokens: u32,
        regions: Vec<KvxRegion>,
        notify_endpoint: Option<String>,
        factors: &CompatFactors,
    ) -> Self {
        KvxMetadata {
            kvx_format: KVX_METADATA_TAG.to_owned(),
            format_version: KVX_METADATA_FORMAT,
            kvx_version: env!("CARGO_PKG_VERSION").to_owned(),
            engine_id: engine_id.into(),
            worker_address,
            tp_size,
            tp_rank,
            pp_rank,
            dp_rank,
            layout: layout.into(),
            block_size_tokens,
            regions,
            notify_endpoint,
            compat_factors_json: factors.canonical_json(),
            cuda_ipc: None,
        }
    }

    pub fn factors(&self) -> Result<CompatFactors, WireError> {
        CompatFactors::from_json(&self.compat_factors_json)
            .map_err(|e| WireError::invalid("kvx metadata compat_factors_json", e.to_string()))
    }

    /// The hash of the carried factors: what this rank advertises.
    pub fn compat_hash(&self) -> Result<String, WireError> {
        Ok(self.factors()?.hash_hex())
    }

    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        self.check()?;
        rmp_serde::to_vec_named(self).map_err(|e| WireError::invalid("kvx metadata", e.to_string()))
    }

    /// The reply payload advertising this metadata under the hash of its own factors.
    pub fn to_payload(&self) -> Result<wire::Payload, WireError> {
        Ok(wire::Payload::Meta {
            compatibility_hash: self.compat_hash()?,
            agent_metadata_bytes: self.encode()?,
        })
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "kvx metadata";
        super::scan::check(bytes, wire::reply_limits())
            .map_err(|source| WireError::Structure { what: WHAT, source })?;
        // Read the version before the full struct so a newer peer gets a clear message
        // rather than a missing-field error.
        #[derive(Deserialize)]
        struct Head {
            kvx_format: Option<String>,
            format_version: Option<u32>,
            kvx_version: Option<String>,
        }
        let head: Head = rmp_serde::from_slice(bytes).map_err(|e| WireError::invalid(WHAT, e.to_string()))?;
        if head.kvx_format.as_deref() != Some(KVX_METADATA_TAG) {
            return Err(WireError::invalid(WHAT, "not kvx metadata (no kvx_format tag)"));
        }
        match head.format_version {
            Some(KVX_METADATA_FORMAT) => {}
            v => {
                return Err(WireError::invalid(
                    WHAT,
                    format!(
                        "peer kvx {} writes metadata format {}, this kvx reads format {KVX_METADATA_FORMAT}; run the same kvx version on both sides",
                        head.kvx_version.as_deref().unwrap_or("(unknown)"),
                        v.map_or("(none)".to_owned(), |v| v.to_string()),
                    ),
                ));
            }
        }
        let meta: KvxMetadata =
            rmp_serde::from_slice(bytes).map_err(|e| WireError::invalid(WHAT, e.to_string()))?;
        meta.check()?;
        Ok(meta)
    }

    /// Invariants a peer relies on; checked on both encode and decode.
    fn check(&self) -> Result<(), WireError> {
        const WHAT: &str = "kvx metadata";
        let long = |name: &str, s: &str| {
            (s.len() > MAX_STRING_BYTES).then(|| {
                WireError::invalid(WHAT, format!("{name} is {} bytes, over {MAX_STRING_BYTES}", s.len()))
            })
        };
        for (name, s) in
            [("engine_id", &self.engine_id), ("layout", &self.layout), ("kvx_version", &self.kvx_version)]
        {
            if let Some(e) = long(name, s) {
                return Err(e);
            }
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(WireError::invalid(
                WHAT,
                format!("tp_rank {} is not below tp_size {}", self.tp_rank, self.tp_size),
            ));
        }
        if self.worker_address.len() > MAX_OPAQUE_BYTES {
            return Err(WireError::invalid(WHAT, "worker_address over 64 KiB"));
        }
        if let Some(ipc) = &self.cuda_ipc {
            if ipc.handle.len() > MAX_OPAQUE_BYTES {
                return Err(WireError::invalid(WHAT, "cuda_ipc handle over 64 KiB"));
            }
            if let Some(e) = long("cuda_ipc machine_id", &ipc.machine_id) {
                return Err(e);
            }
        }
        if self.regions.len() > MAX_REGIONS {
            return Err(WireError::invalid(
                WHAT,
                format!("{} regions, over {MAX_REGIONS}", self.regions.len()),
            ));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if let Some(e) = long("region name", &r.name) {
                return Err(e);
            }
            if r.rkey.len() > MAX_OPAQUE_BYTES {
                return Err(WireError::invalid(WHAT, format!("region {i} rkey over 64 KiB")));
            }
            if r.block_stride_bytes < r.block_len_bytes {
                return Err(WireError::invalid(
                    WHAT,
                    format!(
                        "region {i} ({}): block_stride_bytes {} < block_len_bytes {}",
                        r.name, r.block_stride_bytes, r.block_len_bytes
                    ),
                ));
            }
            let span =
                r.block_stride_bytes.checked_mul(r.num_blocks).and_then(|s| s.checked_add(r.base_addr));
            if span.is_none() {
                return Err(WireError::invalid(
                    WHAT,
                    format!("region {i} ({}) overflows the address space", r.name),
                ));
            }
        }
        Ok(())
    }
}

/// vLLM's `NixlAgentMetadata`, decoded as far as kvx can: typed fields for what kvx
/// understands, everything else kept as JSON, NIXL's agent blob kept opaque.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct VllmAgentMetadata {
    pub engine_id: Option<String>,
    /// NIXL agent metadata (serialized nixlAgent: UCX worker address, packed rkeys).
    #[serde(skip)]
    pub agent_metadata: Vec<u8>,
    pub kv_caches_base_addr: Option<Vec<u64>>,
    pub device_id: Option<u64>,
    pub num_blocks: Option<u64>,
    pub block_lens: Option<Vec<u64>>,
    pub block_strides: Option<Vec<u64>>,
    pub kv_cache_layout: Option<String>,
    pub block_size: Option<u64>,
    pub attn_backend_name: Option<String>,
    pub region_num_blocks: Option<Vec<u64>>,
    pub region_names: Option<Vec<String>>,
    pub region_mem_types: Option<Vec<String>>,
    /// Every other field (known to vLLM, not interpreted by kvx), as JSON.
    pub other_fields: BTreeMap<String, serde_json::Value>,
    /// Known fields whose type was not what kvx expected: field name -> what was found.
    pub undecodable: BTreeMap<String, String>,
}

impl VllmAgentMetadata {
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "vLLM agent metadata";
        let v = wire::decode_value(WHAT, bytes, wire::reply_limits())?;
        let Value::Map(entries) = v else {
            return Err(WireError::invalid(WHAT, format!("expected a map, got {}", wire::kind(&v))));
        };
        let mut m = VllmAgentMetadata::default();
        for (k, v) in entries {
            let Some(key) = k.as_str().map(str::to_owned) else {
                continue;
            };
            let bad = |m: &mut VllmAgentMetadata, v: &Value| {
                m.undecodable.insert(key.clone(), wire::kind(v).to_owned());
            };
            match key.as_str() {
                "engine_id" => match v.as_str() {
                    Some(s) => m.engine_id = Some(s.to_owned()),
                    None => bad(&mut m, &v),
                },
                "agent_metadata" => match v {
                    Value::Binary(b) => m.agent_metadata = b,
                    other => bad(&mut m, &other),
                },
                "kv_caches_base_addr" => {
                    set(&mut m.kv_caches_base_addr, u64s(&v), &mut m.undecodable, &key, &v)
                }
                "device_id" => set(&mut m.device_id, v.as_u64(), &mut m.undecodable, &key, &v),
                "num_blocks" => set(&mut m.num_blocks, v.as_u64(), &mut m.undecodable, &key, &v),
                "block_lens" => set(&mut m.block_lens, u64s(&v), &mut m.undecodable, &key, &v),
                "block_strides" => set(&mut m.block_strides, u64s(&v), &mut m.undecodable, &key, &v),
                "kv_cache_layout" => set(&mut m.kv_cache_layout, strs1(&v), &mut m.undecodable, &key, &v),
                "block_size" => set(&mut m.block_size, v.as_u64(), &mut m.undecodable, &key, &v),
                "attn_backend_name" => set(&mut m.attn_backend_name, strs1(&v), &mut m.undecodable, &key, &v),
                "region_num_blocks" => set(&mut m.region_num_blocks, u64s(&v), &mut m.undecodable, &key, &v),
                "region_names" => set(&mut m.region_names, strs(&v), &mut m.undecodable, &key, &v),
                "region_mem_types" => set(&mut m.region_mem_types, strs(&v), &mut m.undecodable, &key, &v),
                _ => {
                    m.other_fields.insert(key, to_json(&v));
                }
            }
        }
        if m.engine_id.is_none() && m.kv_caches_base_addr.is_none() {
            return Err(WireError::invalid(WHAT, "neither engine_id nor kv_caches_base_addr present"));
        }
        Ok(m)
    }
}

fn set<T>(slot: &mut Option<T>, value: Option<T>, bad: &mut BTreeMap<String, String>, key: &str, v: &Value) {
    match value {
        Some(x) => *slot = Some(x),
        None => {
            bad.insert(key.to_owned(), wire::kind(v).to_owned());
        }
    }
}

fn u64s(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(Value::as_u64).collect()
}

fn strs(v: &Value) -> Option<Vec<String>> {
    v.as_array()?.iter().map(|x| x.as_str().map(str::to_owned)).collect()
}

fn strs1(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// msgpack → JSON for display; bytes become `"<N bytes: hex…>"`.
pub(crate) fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::Nil => J::Null,
        Value::Boolean(b) => J::Bool(*b),
        Value::Integer(i) => i.as_u64().map(J::from).or_else(|| i.as_i64().map(J::from)).unwrap_or(J::Null),
        Value::F32(f) => serde_json::Number::from_f64(f64::from(*f)).map_or(J::Null, J::Number),
        Value::F64(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        Value::String(s) => J::String(s.as_str().map_or_else(|| "(not UTF-8)".to_owned(), str::to_owned)),
        Value::Binary(b) => J::String(describe_bytes(b)),
        Value::Array(items) => J::Array(items.iter().map(to_json).collect()),
        Value::Map(entries) => J::Object(
            entries
                .iter()
                .map(|(k, v)| (k.as_str().map_or_else(|| k.to_string(), str::to_owned), to_json(v)))
                .collect(),
        ),
        Value::Ext(t, b) => J::String(format!("ext type {t}, {}", describe_bytes(b))),
    }
}

/// `"<45 bytes: 6167656e74…>"`: length and a short hex prefix of opaque data.
pub fn describe_bytes(b: &[u8]) -> String {
    const SHOWN: usize = 16;
    let more = if b.len() > SHOWN { "…" } else { "" };
    format!("<{} bytes: {}{more}>", b.len(), hex::encode(&b[..b.len().min(SHOWN)]))
}

/// What a peer put in `agent_metadata_bytes`.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentMetadata {
    Kvx(Box<KvxMetadata>),
    Vllm(Box<VllmAgentMetadata>),
    /// Neither format: kept for display.
    Unknown {
        len: usize,
        reason: String,
    },
}

impl AgentMetadata {
    /// Tells kvx from vLLM metadata by the `kvx_format` tag, then decodes.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        if is_kvx(bytes) {
            return Ok(AgentMetadata::Kvx(Box::new(KvxMetadata::decode(bytes)?)));
        }
        match VllmAgentMetadata::decode(bytes) {
            Ok(v) => Ok(AgentMetadata::Vllm(Box::new(v))),
            Err(e) => Ok(AgentMetadata::Unknown { len: bytes.len(), reason: e.to_string() }),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            AgentMetadata::Kvx(_) => "kvx",
            AgentMetadata::Vllm(_) => "vLLM NixlAgentMetadata",
            AgentMetadata::Unknown { .. } => "unknown",
        }
    }
}

/// True when `bytes` is a msgpack map carrying kvx's tag (cheap: no full decode).
pub fn is_kvx(bytes: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Tag {
        kvx_format: Option<String>,
    }
    super::scan::check(bytes, wire::reply_limits()).is_ok()
        && rmp_serde::from_slice::<Tag>(bytes)
            .is_ok_and(|t| t.kvx_format.as_deref() == Some(KVX_METADATA_TAG))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::transfer::handshake::compat::KvxFactors;

    pub(crate) fn sample_factors() -> CompatFactors {
        CompatFactors::kvx(&KvxFactors {
            kvx_format_version: KVX_METADATA_FORMAT,
            model: "toy/model".into(),
            dtype: "bfloat16".into(),
            num_kv_heads: 8,
            head_size: 128,
            num_hidden_layers: 2,
            cache_dtype: "auto".into(),
            layout_family: "v0.33".into(),
            transfer_mode: "pull".into(),
        })
    }

    pub(crate) fn sample(tp_rank: u32) -> KvxMetadata {
        let regions = (0..2)
            .map(|i| KvxRegion {
                name: format!("layer{i}"),
                mem_type: "host".into(),
                device_id: 0,
                base_addr: 0x7f00_0000_0000 + i * 0x10_0000,
                rkey: vec![i as u8; 40],
                block_len_bytes: 4096,
                block_stride_bytes: 4096,
                num_blocks: 16,
            })
            .collect();
        KvxMetadata::new(
            "P-engine",
            vec![0xab; 120],
            (2, tp_rank, 0, 0),
            "LBHNC",
            16,
            regions,
            Some("tcp://127.0.0.1:1".into()),
            &sample_factors(),
        )
    }

    #[test]
    fn kvx_metadata_round_trips_and_is_tagged() {
        let m = sample(1);
        let bytes = m.encode().expect("encodes");
        assert!(is_kvx(&bytes));
        assert_eq!(KvxMetadata::decode(&bytes).expect("decodes"), m);
        assert_eq!(AgentMetadata::decode(&bytes).expect("decodes"), AgentMetadata::Kvx(Box::new(m.clone())));
        assert_eq!(m.compat_hash().expect("hash"), sample_factors().hash_hex());
    }

    #[test]
    fn the_cuda_ipc_export_is_optional_both_ways() {
        // Without it, nothing is written: metadata reads as a kvx without the field wrote it.
        let plain = sample(0);
        let bytes = plain.encode().expect("encodes");
        let v = rmpv::decode::read_value(&mut &bytes[..]).expect("msgpack");
        let has_key = |v: &rmpv::Value, k: &str| {
            v.as_map().is_some_and(|m| m.iter().any(|(key, _)| key.as_str() == Some(k)))
        };
        assert!(!has_key(&v, "cuda_ipc"), "{v}");
        assert_eq!(KvxMetadata::decode(&bytes).expect("decodes").cuda_ipc, None);
        // With it, it round-trips; a reader that ignores it (serde skips unknown keys) still reads.
        let mut m = sample(1);
        m.cuda_ipc = Some(CudaIpcExport {
            handle: vec![3; 64],
            base_addr: 0x7f00_0000_0000,
            len: 1 << 20,
            device: 1,
            machine_id: "boot-id".into(),
            pid: 42,
        });
        let bytes = m.encode().expect("encodes");
        assert_eq!(KvxMetadata::decode(&bytes).expect("decodes"), m);
        #[derive(Deserialize)]
        struct Older {
            engine_id: String,
        }
        let older: Older = rmp_serde::from_slice(&bytes).expect("an older reader");
        assert_eq!(older.engine_id, "P-engine");
        if let Some(ipc) = m.cuda_ipc.as_mut() {
            ipc.machine_id = "x".repeat(MAX_STRING_BYTES + 1);
        }
        assert!(m.encode().is_err(), "an oversized machine id is refused");
    }

    #[test]
    fn kvx_metadata_rejects_broken_invariants_and_other_versions() {
        let mut m = sample(0);
        m.tp_rank = 2;
        assert!(m.encode().expect_err("tp_rank >= tp_size").to_string().contains("tp_rank 2"));
        let mut m = sample(0);
        m.regions[1].block_stride_bytes = 1;
        assert!(m.encode().is_err());
        let mut m = sample(0);
        m.format_version = 99;
        let bytes = rmp_serde::to_vec_named(&m).expect("encodes");
        let err = KvxMetadata::decode(&bytes).expect_err("newer format");
        assert!(err.to_string().contains("format 99"), "{err}");
    }
}
