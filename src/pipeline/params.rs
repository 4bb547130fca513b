//! `kv_transfer_params`: what a prefill engine hands the decode engine (through the proxy,
//! or through the bench orchestrator) so the decode side can pull the blocks.

use serde::{Deserialize, Serialize};

use crate::topology::TransferMode;

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
    /// Tokens P computed: the prompt length, or one short of it with Mamba/GDN state (vLLM's
    /// backoff).
    pub remote_num_tokens: u64,
    /// `null` from P; a lease expiry only in bidirectional mode.
    pub remote_blocks_expiry_time: Option<f64>,
    /// Bumped when P re-registers its memory; D re-handshakes when it grows.
    pub remote_registration_generation: u64,
    /// `"pull"` (D reads) for the NixlConnector, `"push"` (P writes) for the NixlPushConnector.
    pub transfer_mode: TransferMode,
}

impl KvTransferParams {
    /// Checks the per-group block lists of a hybrid model's prefill engine: one list per KV
    /// cache group (`groups`), every id a `u32`.
    pub fn check_group_block_ids(&self, groups: usize) -> Result<(), String> {
        if self.remote_block_ids.len() != groups {
            return Err(format!(
                "remote_block_ids has {} lists; this model has {groups} KV cache groups",
                self.remote_block_ids.len()
            ));
        }
        match self.remote_block_ids.iter().flatten().find(|&&b| u32::try_from(b).is_err()) {
            Some(b) => Err(format!("remote_block_ids: block id {b} is out of range")),
            None => Ok(()),
        }
    }

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

/// A request id without the random suffix vLLM (0.32+) and kvx's serving engines append to
/// make engine-internal ids unique (`cmpl-<X-Request-Id>-0-1a2b3c4d` -> `cmpl-<X-Request-Id>-0`),
/// as vLLM's `get_base_request_id` strips it: the prefill and decode legs of one request share
/// it, because the proxy gives both the same `X-Request-Id`. Ids without such a suffix are
/// returned whole.
pub fn base_request_id(id: &str) -> &str {
    match id.rsplit_once('-') {
        Some((base, suffix))
            if !base.is_empty() && suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            base
        }
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::base_request_id;

    #[test]
    fn base_ids_drop_the_random_suffix_only() {
        assert_eq!(base_request_id("cmpl-abc-0-1a2b3c4d"), "cmpl-abc-0");
        assert_eq!(base_request_id("chatcmpl-abc-deadbeef"), "chatcmpl-abc");
        assert_eq!(base_request_id("cmpl-run-7-0"), "cmpl-run-7-0", "no 8-hex suffix");
        assert_eq!(base_request_id("cmpl-abc-0-1a2b3c4g"), "cmpl-abc-0-1a2b3c4g", "not hex");
        assert_eq!(base_request_id("-12345678"), "-12345678");
    }
}
