//! `kv_transfer_params`: what a prefill engine hands the decode engine (through the proxy,
//! or through the bench orchestrator) so the decode side can pull the blocks.

use serde::{Deserialize, Serialize};

/// `kv_transfer_params` as vLLM 0.33's NixlConnector (pull mode) returns them from the
/// prefill engine. Field order is the wire order (`pull_scheduler.request_finished`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    pub do_remote_prefill: bool,
    pub do_remote_decode: bool,
    /// P's block ids, one list per KV-cache group (kvx models one group).
    pub remote_block_ids: Vec<Vec<u64>>,
    /// P engine id: the key D handshakes under.
    pub remote_engine_id: String,
    /// P's engine-internal request id; D names it in its completion notification.
    pub remote_request_id: String,
    /// P's side channel (ZMQ ROUTER) host and port.
    pub remote_host: String,
    pub remote_port: u16,
    pub tp_size: u32,
    pub dcp_size: u32,
    pub pp_size: u32,
    /// Tokens P computed (the prompt length).
    pub remote_num_tokens: u64,
    /// `null` from P; a lease expiry only in bidirectional mode.
    pub remote_blocks_expiry_time: Option<f64>,
    /// Bumped when P re-registers its memory; D re-handshakes when it grows.
    pub remote_registration_generation: u64,
    /// `"pull"` (D reads) for the NixlConnector.
    pub transfer_mode: String,
}

impl KvTransferParams {
    /// The prefill block ids of the single KV cache group, as `u32`, checked.
    pub fn block_ids(&self) -> Result<Vec<u32>, String> {
        match self.remote_block_ids.as_slice() {
            [one] => one
                .iter()
                .map(|&b| {
                    u32::try_from(b).map_err(|_| format!("remote_block_ids: block id {b} is out of range"))
                })
                .collect(),
            [] => Err("remote_block_ids is empty; kvx expects one list of block ids".into()),
            more => Err(format!("remote_block_ids has {} groups; kvx models one KV cache group", more.len())),
        }
    }
}
