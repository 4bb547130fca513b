//! The flags several commands share, as plain data: what the user typed, before defaults and
//! checks. `cli` parses them with clap and copies them here field for field; everything in
//! `settings` resolves from these types, so nothing below `cli` depends on the shape of the
//! command line (clap attributes, help text, conflicts), and settings can be built and tested
//! without clap (sweep points and `--compare-transports` build them too).
//!
//! A field is `None` (or `false`) when the flag was not given; defaults belong to resolution.

use std::path::PathBuf;

/// Which model's KV cache: a preset, a Hugging Face config.json, or shape overrides.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelFlags {
    /// `--model`
    pub model: Option<String>,
    /// `--model-config`
    pub model_config: Option<PathBuf>,
    /// `--num-kv-heads`
    pub num_kv_heads: Option<u32>,
    /// `--head-dim`
    pub head_dim: Option<u32>,
    /// `--layers`
    pub layers: Option<u32>,
    /// `--dtype`
    pub dtype: Option<String>,
    /// `--mla`
    pub mla: bool,
    /// `--mla-dim`
    pub mla_dim: Option<u32>,
}

/// The prefill and decode engines: TP sizes, layouts, block sizes, vLLM rules.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PairFlags {
    /// `--p-tp`
    pub p_tp: Option<u32>,
    /// `--d-tp`
    pub d_tp: Option<u32>,
    /// `--vllm`
    pub vllm: Option<String>,
    /// `--layout`
    pub layout: Option<String>,
    /// `--p-layout`
    pub p_layout: Option<String>,
    /// `--d-layout`
    pub d_layout: Option<String>,
    /// `--block-size`
    pub block_size: Option<u32>,
    /// `--p-block-size`
    pub p_block_size: Option<u32>,
    /// `--d-block-size`
    pub d_block_size: Option<u32>,
    /// `--permute`
    pub permute: bool,
}

/// Tokens per block when `--block-size` is not given (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

impl PairFlags {
    /// `--block-size`, or its default.
    pub fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(DEFAULT_BLOCK_SIZE)
    }
}

/// Data-parallel engines and side-channel ports (clap supplies their defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortFlags {
    /// `--p-dp`
    pub p_dp: u32,
    /// `--d-dp`
    pub d_dp: u32,
    /// `--side-channel-port`
    pub side_channel_port: u16,
    /// `--port-scheme`
    pub port_scheme: String,
}
