//! vLLM 0.33's host-buffer copies as byte moves (`kv_buffer_device = "cpu"`): prefill's
//! `save_kv_to_host` (KV cache to host buffer, after computing a request) and decode's
//! `sync_recved_kv_to_device` (host buffer to KV cache, after its READs).
//!
//! Both copy layer by layer in the host buffer's order (one host tensor per layer, group after
//! group) and, per layer, every block id handed to the copy: vLLM hands every group's ids to
//! every layer (`HostCopyRule::Vllm`), so a layer also copies the blocks of groups it does not
//! belong to; on decode, whose KV cache aliases one device tensor across the groups' layers at
//! the same position, a later group's layer then overwrites blocks with host bytes nobody
//! received. `HostCopyRule::PerGroup` copies each layer's own group's ids only.
//!
//! A layer's tensor is indexed as its kind indexes it: an attention layer by kernel block
//! (`kernel_page_bytes` apart on the device and in the host tensor), a state layer by logical
//! block (a padded page apart on the device; in the host tensor, its `tensor_bytes` over the
//! engine's blocks apart: vLLM's unpadded page unless `host_state_page_padded`); a state block
//! copies the state's bytes, not the padding. Ids past a tensor's blocks are skipped.

use super::blocks::{clip_for_exchange, logical_to_kernel};
use super::error::HybridError;
use super::geometry::EngineGeometry;

/// The kernel block ids per group prefill's `save_kv_to_host` copies for a request whose raw
/// lists (nulls included) are `lists`: a window's tail, every state slot (vLLM saves before
/// clipping state).
pub fn saved_kernel_ids(geo: &EngineGeometry, lists: &[Vec<u32>]) -> Result<Vec<Vec<u64>>, HybridError> {
    let saved = clip_for_exchange(&geo.groups, geo.sizing.block_tokens, lists, false)?;
    Ok(logical_to_kernel(&geo.groups, &saved, geo.physical_per_logical))
}

/// One contiguous copy: `len` bytes at `device` in the KV cache and at `host` in the host
/// buffer (offsets from each allocation's base).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub device: u64,
    pub host: u64,
    pub len: u64,
}

/// The moves of one copy between an engine's KV cache laid out as `device` (its geometry with
/// `kv_buffer_device = cuda`) and its host buffer laid out as `host` (the same engine with
/// `cpu`), for `kernel_ids` per group (attention ids at kernel granularity, state ids logical,
/// as `blocks::logical_to_kernel` gives them), in copy order. `per_group`: each layer copies
/// only its own group's ids.
pub fn host_copy_moves(
    device: &EngineGeometry,
    host: &EngineGeometry,
    kernel_ids: &[Vec<u64>],
    per_group: bool,
) -> Vec<Move> {
    let kpage = device.kernel_page_bytes();
    let page = device.sizing.page_bytes;
    let nb = device.num_blocks();
    let mut out = Vec::new();
    for slot in &host.host_slots {
        let Some(region) = device.regions.iter().find(|r| r.layers.contains(&slot.layer)) else {
            continue;
        };
        let Some(group) = device.groups.get(slot.group as usize) else { continue };
        let (dev_unit, host_unit, len, blocks) = match (&device.state, group.kind.is_state()) {
            (Some(s), true) => (page, slot.tensor_bytes / nb.max(1), s.real_page_bytes(), nb),
            _ => (kpage, kpage, kpage, device.kernel_blocks()),
        };
        for (g, ids) in kernel_ids.iter().enumerate() {
            if per_group && g != slot.group as usize {
                continue;
            }
            out.extend(ids.iter().filter(|&&b| b < blocks).map(|&b| Move {
                device: region.base_off + b * dev_unit,
                host: slot.off + b * host_unit,
                len,
            }));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::hybrid::geometry::{HybridEngineSpec, KvBufferDevice, Side};
    use crate::layouts::hybrid::preset;

    fn engines(padded: bool) -> (EngineGeometry, EngineGeometry) {
        let model = preset("nemotron-h-8b").expect("preset");
        let mut e = HybridEngineSpec::new(1, 8);
        let device = EngineGeometry::new(&model, &e, Side::Decode).expect("device");
        e.kv_buffer_device = KvBufferDevice::Cpu;
        e.host_state_page_padded = padded;
        (device, EngineGeometry::new(&model, &e, Side::Decode).expect("host"))
    }

    /// Every layer copies every group's ids under vLLM's rule, its own group's alone per group;
    /// each move stays inside its layer's host tensor and its device region.
    #[test]
    fn moves_cover_each_layer_and_stay_inside_its_tensor() {
        let (device, host) = engines(false);
        let groups = device.groups.len();
        let ids: Vec<Vec<u64>> = (0..groups as u64).map(|g| vec![g + 1]).collect();
        let all = host_copy_moves(&device, &host, &ids, false);
        let own = host_copy_moves(&device, &host, &ids, true);
        assert_eq!(all.len(), host.host_slots.len() * groups);
        assert_eq!(own.len(), host.host_slots.len());
        for (i, m) in all.iter().enumerate() {
            let slot = &host.host_slots[i / groups];
            assert!(m.host >= slot.off && m.host + m.len <= slot.off + slot.tensor_bytes, "move {i}: {m:?}");
            let in_region = device.regions.iter().any(|r| {
                r.base_off <= m.device && m.device + m.len <= r.base_off + r.num_blocks * r.block_stride
            });
            assert!(in_region, "move {i}: {m:?}");
        }
    }

    /// vLLM's unpadded host tensors put a state block a real page apart; padded ones a page.
    #[test]
    fn state_blocks_sit_an_unpadded_page_apart_unless_padded() {
        let state = |padded: bool| {
            let (device, host) = engines(padded);
            let g = device.groups.iter().position(|g| g.kind.is_state()).expect("state group");
            let mut ids = vec![Vec::new(); device.groups.len()];
            ids[g] = vec![1, 2];
            let moves = host_copy_moves(&device, &host, &ids, true);
            (moves[1].host - moves[0].host, device.state.as_ref().map(|s| s.real_page_bytes()), device)
        };
        let (apart, real, device) = state(false);
        assert_eq!(Some(apart), real);
        assert_ne!(apart, device.sizing.page_bytes, "nemotron-h pads its state page");
        let (apart, _, device) = state(true);
        assert_eq!(apart, device.sizing.page_bytes);
    }
}
