//! vLLM's `NixlAgentMetadata` as a kvx rank advertises it with `--transport nixl`: the
//! msgspec encoding of vLLM 0.33's dataclass (or 0.19.1's), NIXL's own agent blob in
//! `agent_metadata`, and the compatibility hash vLLM computes for the same engine.
//!
//! msgspec encodes a dataclass as a map keyed by field names in declaration order, optional
//! fields included (`None` as nil); vLLM's decoder accepts any order but needs every field
//! without a default. The field lists are `vllm-nixl-semantics.md`'s (section C), checked
//! against a live vLLM 0.33.0 worker (`../shared/vllm-peer/real_prefill.py`, decoded by
//! `kvx probe`).
//!
//! Owns: encoding the advertised metadata, the vLLM factors of a kvx engine. Must not open
//! sockets or call NIXL.
#![forbid(unsafe_code)]

use rmpv::Value;

use super::compat::{CompatFactors, VllmFactorsV019, VllmFactorsV033, VllmModelFactors};
use crate::topology::VllmVersion;

/// vLLM 0.33.0's `NIXL_CONNECTOR_VERSION` (hashed).
pub const NIXL_CONNECTOR_VERSION_V0_33: u64 = 15;
/// The vLLM versions kvx speaks, as `vllm.__version__` prints them (hashed).
pub const VLLM_VERSION_V0_33: &str = "0.33.0";
pub const VLLM_VERSION_V0_19: &str = "0.19.1";
/// vLLM 0.19.1's `NIXL_CONNECTOR_VERSION`.
pub const NIXL_CONNECTOR_VERSION_V0_19: u64 = 2;
/// The attention backend vLLM picks on CUDA for standard attention (hashed; kvx has no
/// kernels, so its NIXL engines name vLLM's default unless told otherwise).
pub const DEFAULT_ATTN_BACKEND: &str = "FLASH_ATTN";

/// One advertised region (a layer's KV cache, as vLLM registers one tensor per layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertisedRegion {
    pub name: String,
    pub base_addr: u64,
    pub block_len: u64,
    pub block_stride: u64,
    pub num_blocks: u64,
}

/// What a rank advertises in vLLM's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmAdvertised {
    pub engine_id: String,
    /// `nixl_agent.get_agent_metadata()` of the rank's agent.
    pub agent_metadata: Vec<u8>,
    pub device_id: u64,
    /// `DRAM` or `VRAM`.
    pub mem_type: String,
    pub regions: Vec<AdvertisedRegion>,
    /// `kv_cache_layout` (0.33: `LBHNC`, ...; 0.19: `HND` / `NHD`).
    pub layout: String,
    pub block_size: u64,
    pub attn_backend_name: String,
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn u64s(v: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(v.into_iter().map(Value::from).collect())
}

impl VllmAdvertised {
    /// The msgspec encoding of `NixlAgentMetadata` for `version`.
    pub fn encode(&self, version: VllmVersion) -> Vec<u8> {
        let num_blocks = self.regions.first().map_or(0, |r| r.num_blocks);
        let mut m: Vec<(Value, Value)> = vec![
            (s("engine_id"), s(&self.engine_id)),
            (s("agent_metadata"), Value::Binary(self.agent_metadata.clone())),
            (s("kv_caches_base_addr"), u64s(self.regions.iter().map(|r| r.base_addr))),
            (s("device_id"), Value::from(self.device_id)),
            (s("num_blocks"), Value::from(num_blocks)),
            (s("block_lens"), u64s(self.regions.iter().map(|r| r.block_len))),
        ];
        match version {
            VllmVersion::V0_19 => {
                m.push((s("kv_cache_layout"), s(&self.layout)));
                m.push((s("block_size"), Value::from(self.block_size)));
                m.push((s("ssm_sizes"), u64s([0, 0])));
            }
            VllmVersion::V0_33 => {
                m.push((s("block_strides"), u64s(self.regions.iter().map(|r| r.block_stride))));
                m.push((s("kv_cache_layout"), s(&self.layout)));
                m.push((s("block_size"), Value::from(self.block_size)));
                m.push((s("ssm_sizes"), u64s([0, 0])));
                m.push((s("attn_backend_name"), s(&self.attn_backend_name)));
                m.push((s("physical_blocks_per_logical_kv_block"), Value::from(1u64)));
                m.push((s("region_num_blocks"), u64s(self.regions.iter().map(|r| r.num_blocks))));
                m.push((s("region_group_ids"), u64s(self.regions.iter().map(|_| 0))));
                m.push((s("region_names"), Value::Array(self.regions.iter().map(|r| s(&r.name)).collect())));
                m.push((
                    s("region_mem_types"),
                    Value::Array(self.regions.iter().map(|_| s(&self.mem_type)).collect()),
                ));
                m.push((s("dcp_size"), Value::from(1u64)));
                m.push((s("pcp_size"), Value::from(1u64)));
                m.push((s("ple_block_len"), Value::Nil));
                m.push((s("region_members"), Value::Array(Vec::new())));
                m.push((s("packed_member_layouts"), Value::Map(Vec::new())));
            }
        }
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &Value::Map(m));
        out
    }
}

/// The model factors of a kvx engine, as vLLM hashes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFactors {
    pub model: String,
    /// `torch.bfloat16` and so on.
    pub dtype: String,
    pub num_kv_heads: u64,
    pub head_size: u64,
    pub num_hidden_layers: u64,
    pub attn_backend_name: String,
    pub is_hma_enabled: bool,
    /// `pull` or `push`.
    pub transfer_mode: String,
}

/// vLLM's compatibility factors for an engine of `version` (vLLM's defaults elsewhere:
/// cache dtype `auto`, no speculative decoding, no cross-layer blocks).
pub fn vllm_factors(f: &EngineFactors, version: VllmVersion) -> CompatFactors {
    let common = |vllm_version: &str, connector: u64| VllmModelFactors {
        vllm_version: vllm_version.into(),
        nixl_connector_version: connector,
        model: f.model.clone(),
        dtype: f.dtype.clone(),
        num_kv_heads: f.num_kv_heads,
        head_size: f.head_size,
        num_hidden_layers: f.num_hidden_layers,
        attn_backend_name: f.attn_backend_name.clone(),
        cache_dtype: "auto".into(),
    };
    match version {
        VllmVersion::V0_33 => CompatFactors::vllm_v0_33(&VllmFactorsV033 {
            common: common(VLLM_VERSION_V0_33, NIXL_CONNECTOR_VERSION_V0_33),
            is_hma_enabled: f.is_hma_enabled,
            speculative_config: None,
            transfer_mode: f.transfer_mode.clone(),
        }),
        VllmVersion::V0_19 => CompatFactors::vllm_v0_19(&VllmFactorsV019 {
            common: common(VLLM_VERSION_V0_19, NIXL_CONNECTOR_VERSION_V0_19),
            cross_layers_blocks: false,
            is_hma_enabled: f.is_hma_enabled,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::handshake::meta::VllmAgentMetadata;

    fn toy() -> EngineFactors {
        EngineFactors {
            model: "toy/model".into(),
            dtype: "torch.bfloat16".into(),
            num_kv_heads: 4,
            head_size: 128,
            num_hidden_layers: 4,
            attn_backend_name: DEFAULT_ATTN_BACKEND.into(),
            is_hma_enabled: true,
            transfer_mode: "pull".into(),
        }
    }

    #[test]
    fn the_hash_is_vllm_033s_for_the_same_engine() {
        // vLLM 0.33.0's own worker (../shared/vllm-peer/real_prefill.py, its defaults:
        // toy/model, 4 layers, 4 KV heads of 128, bfloat16, FLASH_ATTN) printed this hash.
        assert_eq!(
            vllm_factors(&toy(), VllmVersion::V0_33).hash_hex(),
            "9761a36159d845910bad12961a122bc2a068615b3466a4805f00a909df2b47ec"
        );
    }

    #[test]
    fn the_encoding_decodes_as_vllm_metadata_with_every_field() {
        let adv = VllmAdvertised {
            engine_id: "P".into(),
            agent_metadata: b"nixlSerDes|Agent".to_vec(),
            device_id: 0,
            mem_type: "DRAM".into(),
            regions: (0..2)
                .map(|i| AdvertisedRegion {
                    name: format!("model.layers.{i}.self_attn.attn"),
                    base_addr: 4096 + i * 65536,
                    block_len: 4096,
                    block_stride: 4096,
                    num_blocks: 16,
                })
                .collect(),
            layout: "LBHNC".into(),
            block_size: 16,
            attn_backend_name: DEFAULT_ATTN_BACKEND.into(),
        };
        let m = VllmAgentMetadata::decode(&adv.encode(VllmVersion::V0_33)).expect("decodes");
        assert_eq!(m.engine_id.as_deref(), Some("P"));
        assert_eq!(m.kv_caches_base_addr, Some(vec![4096, 69632]));
        assert_eq!(m.block_strides, Some(vec![4096, 4096]));
        assert_eq!(m.region_num_blocks, Some(vec![16, 16]));
        assert_eq!(m.kv_cache_layout.as_deref(), Some("LBHNC"));
        assert_eq!(m.agent_metadata, b"nixlSerDes|Agent");
        for field in
            ["ssm_sizes", "physical_blocks_per_logical_kv_block", "dcp_size", "pcp_size", "ple_block_len"]
        {
            assert!(m.other_fields.contains_key(field), "{field} advertised");
        }
        assert!(m.undecodable.is_empty(), "{:?}", m.undecodable);
        let old = VllmAgentMetadata::decode(&adv.encode(VllmVersion::V0_19)).expect("0.19 decodes");
        assert!(old.block_strides.is_none(), "0.19.1 has no block_strides");
    }
}
