//! Where vLLM 0.33's rules move the wrong bytes or reach outside registered memory: each
//! finding as kvx reports it.

use serde::Serialize;

use super::geometry::{Side, StatePart};

/// Something vLLM 0.33's rules do that moves the wrong bytes or reaches outside registered
/// memory. kvx plans as vLLM does and says so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Finding {
    /// A descriptor reaches outside every memory registration of its rank.
    OutsideRegistration { d_rank: u32, p_rank: u32, side: Side, label: String, off: u64, len: u64 },
    /// A state row reads bytes that are not the decode rank's slice of that part (Mamba2 with
    /// `n_groups` below TP: B and C are replicated, but the remote conv offsets assume they are
    /// sharded like `x`).
    StateSliceMisread { d_rank: u32, p_rank: u32, part: String, reads: String },
    /// Host buffer with a padded state page: host tensors hold unpadded pages while regions
    /// use the padded page as block length and stride, so block `b` sits `b * padding_bytes`
    /// off and the last block runs past the tensor.
    HostStatePagePadded { side: Side, real_page_bytes: u64, padded_page_bytes: u64 },
    /// Host buffer with several groups: the host-to-device copy passes every group's block
    /// ids through every layer in group order, so a later group's layer, aliasing the same
    /// device memory, overwrites blocks with host bytes it never received.
    HostCopyOverwrites { d_rank: u32, group: u32, lost_blocks: u64, blocks: u64 },
    /// A READ reads prefill's null block (id 0).
    NullBlockRead { d_rank: u32, p_rank: u32, group: u32 },
    /// An attention group's first decode block receives prefill tokens from another position:
    /// with a block-size ratio and a decode prefix hit, prefill's list is trimmed to the count of
    /// decode sub-blocks, which includes the unfilled tail of decode's last block, so every token
    /// lands `local_token - remote_token` positions off.
    AttentionTokensShifted { d_rank: u32, p_rank: u32, group: u32, local_token: u64, remote_token: u64 },
    /// A decode rank gathers its attention heads from several prefill ranks (prefill TP above
    /// decode TP, prefill heads replicated, so vLLM does not refuse the layout) into head
    /// slots of its blocks, but the layout keeps a block's heads interleaved with its tokens
    /// (LBNHC): each slot's bytes are rows of tokens of every head, not one head's.
    HeadSlotsNotContiguous { d_rank: u32, layout: String, source_ranks: u32 },
}

pub(super) fn describe_span(s: Option<&(StatePart, u64, u64)>) -> String {
    match s {
        Some((part, first, n)) => {
            format!("{} bytes {first}..{} of the model's part", part.label(), first + n)
        }
        None => "bytes across parts or outside the state".into(),
    }
}
