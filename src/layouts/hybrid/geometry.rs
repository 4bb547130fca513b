//! A hybrid engine's cache as vLLM 0.33 builds it: KV cache groups (HMA), the hybrid-aligned
//! block size and padded page, the state layout of one TP rank (conv parts and SSM state with
//! their byte ranges and the global channels or heads each rank holds), and the NIXL regions and
//! memory registrations, aliased on the device or per layer in a host buffer.
//!
//! Rules (vLLM 0.33.0):
//! - Groups: layers bucketed by cache spec in registration order; group size is the smallest
//!   bucket (the largest when it is under 1.5x the smallest); bucket `i`'s group `j` takes
//!   `layers[j::num_groups]` (`kv_cache_planning.py`, `_get_kv_cache_groups_uniform_page_size`).
//! - Block size: the attention block grows until one attention page holds one state slot,
//!   in steps of `lcm(max(16, block size), prefill checkpoint alignment)`; the state page is
//!   then padded to the attention page (`Platform._align_hybrid_block_size`).
//! - State shapes: `MambaStateShapeCalculator` (DS conv layout: `(channels, kernel - 1)`).
//! - Regions: every group's tensor starts at byte 0 of one allocation (layer-outer layouts), so
//!   layer `k` of every group shares region `k`; regions are named by the first layer in
//!   numeric name order and carry group id -1 when shared (`register_kv_caches`). With
//!   `kv_buffer_device = cpu` each layer has its own host tensor and region.
//!
//! Offsets are bytes from the base of the memory the rank registers: its KV allocation
//! (device), or its host buffer (host), where layer tensors sit in group order, one slot of
//! `num_blocks * page_bytes` each (the oracle's convention).

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

use super::error::{HybridError, RefusalKind};
use super::model::{AttnKind, CacheKind, CacheLayer, Dtype, HybridModel, StateKind, StateSpec};
use crate::layouts::Layout;
use crate::topology;
pub use crate::vocab::kinds::KvBufferDevice;
use crate::vocab::kinds::Role;
use crate::vocab::knob::Knob;

/// vLLM's default block size, and the smallest FLASH_ATTN kernel block (`MultipleOf(16)`).
pub const DEFAULT_BLOCK_TOKENS: u32 = 16;
/// FlashInfer's GDN prefill checkpoints land on 64-token boundaries
/// (`FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`).
pub const FLASHINFER_GDN_ALIGNMENT_TOKENS: u32 = 64;

/// Which kernel runs a GDN model's prefill (vLLM's `gdn_prefill_backend`, `auto` by default).
/// vLLM picks FlashInfer on Hopper (SM90) and, with 128-wide key heads and CUDA 13, on
/// Blackwell (SM10x, SM12x): the GPUs P/D deployments run on, so kvx's default. FlashInfer
/// checkpoints state every 64 tokens, which (with prefix caching on) aligns the hybrid block
/// size to 64 tokens; triton (SM80-class GPUs, or asked for) does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GdnPrefillBackend {
    /// vLLM's choice on H100, H200, B200 (64-token checkpoint alignment).
    #[default]
    FlashInfer,
    /// vLLM's choice on A100-class GPUs (no checkpoint alignment).
    Triton,
}

impl GdnPrefillBackend {
    pub fn name(self) -> &'static str {
        match self {
            GdnPrefillBackend::FlashInfer => "flashinfer",
            GdnPrefillBackend::Triton => "triton",
        }
    }
}

/// The attention backend of an engine: which kernel block sizes it takes. vLLM's
/// FLASH_ATTN (its default on Hopper) and TRITON_ATTN take any multiple of 16 tokens, so the
/// kernel block is the block; FLASHINFER takes 16, 32 or 64, so a larger (hybrid-aligned)
/// block splits into the largest of those that divides it (`select_common_block_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionBackend {
    /// FLASH_ATTN: kernel blocks of any multiple of 16 tokens.
    #[default]
    FlashAttn,
    /// FLASHINFER: kernel blocks of 16, 32 or 64 tokens.
    #[serde(rename = "flashinfer")]
    FlashInfer,
    /// TRITON_ATTN: kernel blocks of any multiple of 16 tokens.
    Triton,
}

impl AttentionBackend {
    /// vLLM's name of the backend (what its attention backend setting takes).
    pub fn vllm_name(self) -> &'static str {
        match self {
            AttentionBackend::FlashAttn => "FLASH_ATTN",
            AttentionBackend::FlashInfer => "FLASHINFER",
            AttentionBackend::Triton => "TRITON_ATTN",
        }
    }

    /// The smallest kernel block the backend supports (the base of the hybrid alignment).
    pub fn min_kernel_block(self) -> u32 {
        DEFAULT_BLOCK_TOKENS
    }

    /// The kernel block vLLM runs a `block_tokens` block with, or `None` when the backend
    /// supports no kernel block that divides it (vLLM: "No common block size").
    pub fn kernel_block(self, block_tokens: u32) -> Option<u32> {
        match self {
            AttentionBackend::FlashAttn | AttentionBackend::Triton => (block_tokens > 0
                && block_tokens.is_multiple_of(DEFAULT_BLOCK_TOKENS))
            .then_some(block_tokens),
            AttentionBackend::FlashInfer => {
                [64, 32, 16].into_iter().find(|&k| block_tokens > 0 && block_tokens.is_multiple_of(k))
            }
        }
    }

    /// What the backend takes, as vLLM prints it.
    pub fn supported_sizes(self) -> &'static str {
        match self {
            AttentionBackend::FlashAttn | AttentionBackend::Triton => "[MultipleOf(16)]",
            AttentionBackend::FlashInfer => "[16, 32, 64]",
        }
    }
}

/// `VLLM_SSM_CONV_STATE_LAYOUT`: DS is `(channels, kernel - 1)`, SD the transpose. vLLM's
/// default is SD, and its NIXL connector refuses it; kvx defaults to DS (a working deployment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ConvStateLayout {
    #[default]
    #[serde(rename = "DS")]
    Ds,
    #[serde(rename = "SD")]
    Sd,
}

/// Which memory a region (and its registration) lives in, in NIXL's terms: where vLLM's KV
/// buffer is, not where kvx allocates a run's pools (`vocab::kinds::MemKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RegionMem {
    /// Device memory (NIXL `VRAM`).
    Vram,
    /// Host memory (NIXL `DRAM`).
    Dram,
}

/// One engine's settings (prefill or decode) that shape its cache: the hybrid counterpart of
/// [`EngineSpec`](crate::layouts::EngineSpec), from which vLLM's rules derive its
/// [`EngineGeometry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HybridEngineSpec {
    /// Tensor-parallel size ([`Knob::PTp`], [`Knob::DTp`]).
    pub tp: u32,
    /// Pipeline-parallel size (vLLM refuses PP > 1 with HMA in pull mode).
    pub pp: u32,
    /// Logical blocks in each rank's pool.
    pub num_blocks: u32,
    /// The block size as given ([`Knob::BlockSize`]); hybrid alignment may raise it.
    pub block_tokens: u32,
    /// The attention kernel's block size when smaller than the logical block (vLLM's
    /// `physical_blocks_per_logical_kv_block`); `None`: the logical block (FLASH_ATTN).
    pub kernel_block_tokens: Option<u32>,
    pub kv_buffer_device: KvBufferDevice,
    pub layout: Layout,
    pub gdn_prefill: GdnPrefillBackend,
    /// The attention backend: which kernel blocks the block splits into.
    pub attention_backend: AttentionBackend,
    /// Prefix caching (on by default for hybrid models; puts Mamba caching in "align" mode).
    pub prefix_caching: bool,
    pub conv_state_layout: ConvStateLayout,
    /// Host buffer: the host tensors of state layers hold padded state pages, as their regions
    /// assume (kvx's [`Knob::HostStatePage`] `padded`); vLLM 0.33 allocates unpadded ones.
    pub host_state_page_padded: bool,
    /// Host buffer with state in the model: each group's descriptor ids over its own layers'
    /// host tensors only, and prefill's copy into the buffer of each layer's own group's blocks
    /// (kvx's [`Knob::HostDescriptors`] `per-group`); vLLM 0.33 lays attention ids over every layer's
    /// tensor and state ids over every state layer's, and copies every group's blocks through
    /// every layer.
    pub host_descriptors_per_group: bool,
}

impl Default for HybridEngineSpec {
    fn default() -> Self {
        HybridEngineSpec {
            tp: 1,
            pp: 1,
            num_blocks: 1024,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            kernel_block_tokens: None,
            kv_buffer_device: KvBufferDevice::Cuda,
            layout: Layout::Lbhnc,
            gdn_prefill: GdnPrefillBackend::FlashInfer,
            attention_backend: AttentionBackend::FlashAttn,
            prefix_caching: true,
            conv_state_layout: ConvStateLayout::Ds,
            host_state_page_padded: false,
            host_descriptors_per_group: false,
        }
    }
}

impl HybridEngineSpec {
    /// Defaults with the given TP size and pool size.
    pub fn new(tp: u32, num_blocks: u32) -> Self {
        HybridEngineSpec { tp, num_blocks, ..HybridEngineSpec::default() }
    }
}

/// What a KV cache group holds (vLLM's group spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    Full,
    SlidingWindow { window_tokens: u32 },
    State(StateKind),
}

impl GroupKind {
    pub fn of(kind: CacheKind) -> Self {
        match kind {
            CacheKind::Attention(AttnKind::Full) => GroupKind::Full,
            CacheKind::Attention(AttnKind::SlidingWindow { window_tokens }) => {
                GroupKind::SlidingWindow { window_tokens }
            }
            CacheKind::State(s) => GroupKind::State(s),
        }
    }

    pub fn is_state(self) -> bool {
        matches!(self, GroupKind::State(_))
    }

    pub fn is_attention(self) -> bool {
        !self.is_state()
    }

    /// vLLM's spec class name.
    pub fn vllm_spec(self) -> &'static str {
        match self {
            GroupKind::Full => "FullAttentionSpec",
            GroupKind::SlidingWindow { .. } => "SlidingWindowSpec",
            GroupKind::State(_) => "MambaSpec",
        }
    }
}

/// One KV cache group: layers of one kind that share block ids. Position `k` in `layers`
/// is the region the layer aliases on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KvGroup {
    pub index: u32,
    pub kind: GroupKind,
    pub layers: Vec<CacheLayer>,
}

/// The KV cache groups vLLM's hybrid allocator forms for `model`.
pub fn kv_groups(model: &HybridModel) -> Vec<KvGroup> {
    let mut buckets: Vec<(GroupKind, Vec<CacheLayer>)> = Vec::new();
    for layer in model.cache_layers() {
        let kind = GroupKind::of(layer.kind);
        match buckets.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, v)) => v.push(layer),
            None => buckets.push((kind, vec![layer])),
        }
    }
    let min = buckets.iter().map(|(_, v)| v.len()).min().unwrap_or(0);
    let max = buckets.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
    // vLLM: `max < 1.5 * min` uses the largest bucket as the group size.
    let group_size = if 2 * max < 3 * min { max } else { min }.max(1);
    let mut groups = Vec::new();
    for (kind, layers) in buckets {
        let num_groups = layers.len().div_ceil(group_size);
        for j in 0..num_groups {
            groups.push(KvGroup {
                index: u32::try_from(groups.len()).unwrap_or(u32::MAX),
                kind,
                layers: layers.iter().skip(j).step_by(num_groups).cloned().collect(),
            });
        }
    }
    groups
}

/// The conv sub-projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
pub enum ConvPart {
    X,
    B,
    C,
    Q,
    K,
    V,
}

impl ConvPart {
    pub fn name(self) -> &'static str {
        match self {
            ConvPart::X => "x",
            ConvPart::B => "B",
            ConvPart::C => "C",
            ConvPart::Q => "Q",
            ConvPart::K => "K",
            ConvPart::V => "V",
        }
    }
}

/// A part of one state slot: a conv sub-projection or the SSM (temporal) state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
pub enum StatePart {
    Conv(ConvPart),
    Ssm,
}

impl StatePart {
    /// vLLM's descriptor label stem (`mamba_conv_x`, `mamba_ssm`).
    pub fn label(self) -> String {
        match self {
            StatePart::Conv(c) => format!("mamba_conv_{}", c.name()),
            StatePart::Ssm => "mamba_ssm".to_string(),
        }
    }
}

/// One part of a rank's state slot: where it sits in the page and which global units (conv
/// channels, or SSM heads/rows) it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PartLayout {
    pub part: StatePart,
    /// Byte offset inside the page.
    pub offset_bytes: u64,
    pub len_bytes: u64,
    /// Bytes of one unit: a conv channel (`(kernel - 1) * dtype`), an SSM head (Mamba2:
    /// `head_dim * d_state * dtype`; GDN: `v_dim * k_dim * dtype`) or SSM row (Mamba1:
    /// `d_state * dtype`).
    pub unit_bytes: u64,
    /// Units this rank holds.
    pub units: u64,
    /// Units of the whole model (before TP).
    pub global_units: u64,
    /// Whether every rank holds the same units (Mamba2 B and C when TP does not divide
    /// `n_groups`).
    pub replicated: bool,
}

impl PartLayout {
    /// The first global unit rank `rank` holds.
    pub fn first_global_unit(&self, rank: u32) -> u64 {
        if self.replicated { 0 } else { u64::from(rank) * self.units }
    }
}

/// The state slot of one TP rank, in DS conv layout: conv parts, then the SSM state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StateLayout {
    pub kind: StateKind,
    /// `conv_kernel - 1`.
    pub conv_rows: u64,
    pub parts: Vec<PartLayout>,
    /// The conv parts (`parts` without the SSM state).
    pub conv_bytes: u64,
    pub ssm_bytes: u64,
    /// Shapes as vLLM reports them (`mamba_state_shapes_local`).
    pub conv_shape: [u64; 2],
    pub ssm_shape: Vec<u64>,
    /// Element types of the conv and the SSM state (`mamba_state_dtypes`).
    pub dtypes: (Dtype, Dtype),
}

/// A state layer's shapes on one rank as vLLM's `MambaStateShapeCalculator` gives them (DS
/// conv layout: `(channels, kernel - 1)`), with their element types: the `MambaSpec`'s
/// `shapes` and `dtypes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateShapes {
    pub kind: StateKind,
    pub conv: [u64; 2],
    pub ssm: Vec<u64>,
    pub dtypes: (Dtype, Dtype),
}

impl StateShapes {
    /// vLLM's shapes for `spec` on a rank of a `tp`-rank engine, or its refusal when the model
    /// does not split over `tp` (`divide`, and Mamba2's head and group checks).
    pub fn of(spec: &StateSpec, tp: u32, side: Side) -> Result<Self, HybridError> {
        let t = u64::from(tp);
        let div = |what: &str, n: u64| -> Result<u64, HybridError> {
            if t > 0 && n.is_multiple_of(t) {
                Ok(n / t)
            } else {
                Err(HybridError::refused(
                    RefusalKind::ModelNotDivisible,
                    format!("{n} is not divisible by {t}"),
                    "vllm/distributed/utils.py:53 (divide)",
                    Knob::tp(side.role()),
                    format!("the model's {what} ({n}) must split evenly over TP {t}"),
                ))
            }
        };
        let rows = u64::from(spec.conv_kernel()) - 1;
        let (conv, ssm) = match spec {
            StateSpec::Mamba1(m) => {
                let i = u64::from(m.intermediate_size);
                let local = div("intermediate size", i)?;
                ([local, rows], vec![div("intermediate size", i)?, u64::from(m.d_state)])
            }
            StateSpec::Mamba2(m) => {
                if !m.num_heads.is_multiple_of(tp) {
                    return Err(HybridError::refused(
                        RefusalKind::ModelNotDivisible,
                        "Tensor parallel world size must divide num heads.",
                        "vllm/model_executor/layers/mamba/mamba_mixer2.py:316",
                        Knob::tp(side.role()),
                        format!("{} Mamba2 heads must split evenly over TP {tp}", m.num_heads),
                    ));
                }
                if !m.n_groups.is_multiple_of(tp) && m.n_groups != 1 {
                    return Err(HybridError::refused(
                        RefusalKind::Mamba2Groups,
                        "If tensor parallel world size does not divide num_groups, then num_groups must equal 1.",
                        "vllm/model_executor/layers/mamba/mamba_mixer2.py:320",
                        Knob::tp(side.role()),
                        format!("use a TP size that divides n_groups = {}", m.n_groups),
                    ));
                }
                // `extra_groups_for_head_shards`: groups grow to TP so each head shard
                // carries its group.
                let groups =
                    if m.n_groups.is_multiple_of(tp) { u64::from(m.n_groups) } else { u64::from(tp) };
                let conv_dim = m.intermediate_size() + 2 * groups * u64::from(m.d_state);
                (
                    [div("Mamba2 conv channels", conv_dim)?, rows],
                    vec![
                        div("Mamba2 heads", u64::from(m.num_heads))?,
                        u64::from(m.head_dim),
                        u64::from(m.d_state),
                    ],
                )
            }
            StateSpec::Gdn(g) => {
                let key = u64::from(g.num_k_heads) * u64::from(g.head_k_dim);
                let value = u64::from(g.num_v_heads) * u64::from(g.head_v_dim);
                (
                    [div("GDN conv channels", 2 * key + value)?, rows],
                    vec![
                        div("GDN value heads", u64::from(g.num_v_heads))?,
                        u64::from(g.head_v_dim),
                        u64::from(g.head_k_dim),
                    ],
                )
            }
        };
        Ok(StateShapes { kind: spec.kind(), conv, ssm, dtypes: spec.dtypes() })
    }

    /// Bytes of one state slot (`MambaSpec.page_size_bytes` before padding).
    pub fn page_bytes(&self) -> u64 {
        self.conv[0] * self.conv[1] * u64::from(self.dtypes.0.bytes())
            + self.ssm.iter().product::<u64>() * u64::from(self.dtypes.1.bytes())
    }
}

impl StateLayout {
    /// The state slot of a rank of a `tp`-rank engine, or vLLM's refusal when the model does
    /// not split over `tp`: the shapes `MambaStateShapeCalculator` gives, split into parts as
    /// the connector splits them ([`StateLayout::from_shapes`]).
    pub fn new(spec: &StateSpec, tp: u32, side: Side) -> Result<Self, HybridError> {
        let shapes = StateShapes::of(spec, tp, side)?;
        let n_groups = match spec {
            StateSpec::Mamba2(m) => Some(m.n_groups),
            _ => None,
        };
        StateLayout::from_shapes(&shapes, tp, n_groups).map_err(|e| HybridError::model("state", e))
    }

    /// The state slot of a rank from its shapes (what an engine reports, or a case states), as
    /// vLLM's connector decomposes them (`derive_mamba_conv_split`): Mamba1's conv is `x`;
    /// Mamba2's is `x` (heads x head_dim of the SSM shape, times TP) then B and C of equal
    /// size; GDN's is Q and K of equal size then V (value heads x value dim). `n_groups`
    /// (Mamba2) says whether B and C are replicated on every rank (below TP) rather than
    /// sharded; unknown, they are taken as sharded, as vLLM's offsets take them.
    pub fn from_shapes(shapes: &StateShapes, tp: u32, n_groups: Option<u32>) -> Result<Self, String> {
        let t = u64::from(tp.max(1));
        let [conv_dim, rows] = shapes.conv;
        let ssm = &shapes.ssm;
        let (conv_b, ssm_b) = (u64::from(shapes.dtypes.0.bytes()), u64::from(shapes.dtypes.1.bytes()));
        if conv_dim == 0 || rows == 0 || ssm.is_empty() || ssm.contains(&0) {
            return Err(format!("state shapes {:?} and {:?} hold nothing", shapes.conv, shapes.ssm));
        }
        let want_dims = if shapes.kind == StateKind::Mamba1 { 2 } else { 3 };
        if ssm.len() != want_dims {
            return Err(format!(
                "a {} SSM state has {want_dims} dimensions, not {} ({:?})",
                shapes.kind.name(),
                ssm.len(),
                ssm
            ));
        }
        let chan = rows * conv_b;
        // (part, local channels, global channels, replicated)
        let conv: Vec<(ConvPart, u64, u64, bool)> = match shapes.kind {
            StateKind::Mamba1 => {
                if ssm[0] != conv_dim {
                    return Err(format!(
                        "Mamba1 temporal state dim ({}) doesn't match conv dim ({conv_dim}); both should be \
                         intermediate_size/TP",
                        ssm[0]
                    ));
                }
                vec![(ConvPart::X, conv_dim, conv_dim * t, false)]
            }
            StateKind::Mamba2 => {
                let (local_heads, head_dim, d_state) = (ssm[0], ssm[1], ssm[2]);
                let x_global = local_heads * t * head_dim;
                let total = conv_dim * t;
                let remainder = total.saturating_sub(x_global);
                if remainder == 0 || !remainder.is_multiple_of(2) {
                    return Err(format!(
                        "Conv dim ({conv_dim}*tp={tp}) doesn't decompose into intermediate_size={x_global} + \
                         2*groups_ss. remainder={remainder}"
                    ));
                }
                let groups_ss = remainder / 2;
                let replicated = n_groups.is_some_and(|g| !g.is_multiple_of(tp.max(1)));
                let bc_global = match n_groups {
                    Some(g) if replicated => u64::from(g) * d_state,
                    _ => groups_ss,
                };
                let (x_local, bc_local) = (x_global / t, groups_ss / t);
                vec![
                    (ConvPart::X, x_local, x_global, false),
                    (ConvPart::B, bc_local, bc_global, replicated),
                    (ConvPart::C, bc_local, bc_global, replicated),
                ]
            }
            StateKind::Gdn => {
                let value_local = ssm[0] * ssm[1];
                let remainder = conv_dim.saturating_sub(value_local);
                if remainder == 0 || !remainder.is_multiple_of(2) {
                    return Err(format!(
                        "GDN conv dim ({conv_dim}) doesn't decompose into 2*key_dim_local + \
                         value_dim_local={value_local}. remainder={remainder}"
                    ));
                }
                let key_local = remainder / 2;
                vec![
                    (ConvPart::Q, key_local, key_local * t, false),
                    (ConvPart::K, key_local, key_local * t, false),
                    (ConvPart::V, value_local, value_local * t, false),
                ]
            }
        };
        let mut parts = Vec::with_capacity(conv.len() + 1);
        let mut off = 0;
        for &(p, local, global, replicated) in &conv {
            parts.push(PartLayout {
                part: StatePart::Conv(p),
                offset_bytes: off,
                len_bytes: local * chan,
                unit_bytes: chan,
                units: local,
                global_units: global,
                replicated,
            });
            off += local * chan;
        }
        let conv_bytes = off;
        let ssm_units = ssm[0];
        let unit_bytes = ssm[1..].iter().product::<u64>() * ssm_b;
        parts.push(PartLayout {
            part: StatePart::Ssm,
            offset_bytes: conv_bytes,
            len_bytes: ssm_units * unit_bytes,
            unit_bytes,
            units: ssm_units,
            global_units: ssm_units * t,
            replicated: false,
        });
        Ok(StateLayout {
            kind: shapes.kind,
            conv_rows: rows,
            conv_bytes,
            ssm_bytes: ssm_units * unit_bytes,
            conv_shape: shapes.conv,
            ssm_shape: ssm.clone(),
            dtypes: shapes.dtypes,
            parts,
        })
    }

    /// The shapes and dtypes this slot was built from.
    pub fn shapes(&self) -> StateShapes {
        StateShapes {
            kind: self.kind,
            conv: self.conv_shape,
            ssm: self.ssm_shape.clone(),
            dtypes: self.dtypes,
        }
    }

    /// Bytes of one state slot before padding.
    pub fn real_page_bytes(&self) -> u64 {
        self.conv_bytes + self.ssm_bytes
    }

    /// vLLM's `ssm_sizes`: `(conv_bytes, ssm_bytes)` of one rank.
    pub fn ssm_sizes(&self) -> (u64, u64) {
        (self.conv_bytes, self.ssm_bytes)
    }

    /// What `[page_off, page_off + len)` of rank `rank`'s state slot holds: its part and the
    /// global byte range of that part (unit index times unit bytes, plus the byte inside the
    /// unit). `None` when the range leaves one part.
    pub fn global_span(&self, rank: u32, page_off: u64, len: u64) -> Option<(StatePart, u64, u64)> {
        let p = self
            .parts
            .iter()
            .find(|p| p.offset_bytes <= page_off && page_off < p.offset_bytes + p.len_bytes)?;
        if page_off + len > p.offset_bytes + p.len_bytes {
            return None;
        }
        Some((p.part, p.first_global_unit(rank) * p.unit_bytes + page_off - p.offset_bytes, len))
    }

    /// The conv parts only.
    pub fn conv_parts(&self) -> impl Iterator<Item = &PartLayout> {
        self.parts.iter().filter(|p| p.part != StatePart::Ssm)
    }

    pub fn part(&self, part: StatePart) -> Option<&PartLayout> {
        self.parts.iter().find(|p| p.part == part)
    }
}

/// Which engine of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Side {
    Prefill,
    Decode,
}

impl Side {
    /// The role of the engine on this side.
    pub fn role(self) -> Role {
        match self {
            Side::Prefill => Role::Prefill,
            Side::Decode => Role::Decode,
        }
    }

    pub fn prefix(self) -> &'static str {
        match self {
            Side::Prefill => "p",
            Side::Decode => "d",
        }
    }
}

/// Block size and page sizes of an engine after vLLM's hybrid alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockSizing {
    /// Tokens per (logical) block: vLLM's `block_size` after alignment.
    pub block_tokens: u32,
    /// The step the block size grows in (`kernel block alignment`).
    pub alignment_tokens: u32,
    /// One token of attention KV on one rank (K and V, all local heads).
    pub attn_bytes_per_token: u64,
    /// Bytes of one page (one layer, one block): the attention page, which the state page is
    /// padded to.
    pub page_bytes: u64,
    /// One state slot before padding (`mamba_real_page_bytes`), if the model keeps state.
    pub state_page_bytes: Option<u64>,
}

impl BlockSizing {
    /// Padding of the state page (0 without state).
    pub fn padding_bytes(&self) -> u64 {
        self.state_page_bytes.map_or(0, |s| self.page_bytes - s)
    }
}

/// The block size and pages vLLM settles on for one engine (`_align_hybrid_block_size`).
pub fn block_sizing(
    model: &HybridModel,
    engine: &HybridEngineSpec,
    state: Option<&StateLayout>,
) -> Result<BlockSizing, HybridError> {
    let a = &model.attention;
    let heads = u64::from(topology::heads_per_rank(a.num_kv_heads, engine.tp.max(1)));
    let per_token = 2 * heads * u64::from(a.head_dim) * u64::from(a.dtype.bytes());
    let user = engine.block_tokens;
    if user == 0 {
        return Err(HybridError::request(Knob::BlockSize, "a block of 0 tokens holds nothing"));
    }
    let Some(state) = state else {
        return Ok(BlockSizing {
            block_tokens: user,
            alignment_tokens: user,
            attn_bytes_per_token: per_token,
            page_bytes: u64::from(user) * per_token,
            state_page_bytes: None,
        });
    };
    let state_page = state.real_page_bytes();
    let kernel_min = engine.attention_backend.min_kernel_block();
    let mut align = u64::from(kernel_min.max(user));
    // Prefix caching puts Mamba caching in "align" mode: blocks land on prefill checkpoints.
    if engine.prefix_caching
        && state.kind == StateKind::Gdn
        && engine.gdn_prefill == GdnPrefillBackend::FlashInfer
    {
        align = lcm(align, u64::from(FLASHINFER_GDN_ALIGNMENT_TOKENS));
    }
    let needed = align * state_page.div_ceil(align * per_token);
    let needed = needed.div_ceil(u64::from(kernel_min)) * u64::from(kernel_min);
    let block = needed.max(u64::from(user));
    let block_tokens = u32::try_from(block).map_err(|_| {
        HybridError::request(Knob::BlockSize, format!("aligned block of {block} tokens is too large"))
    })?;
    Ok(BlockSizing {
        block_tokens,
        alignment_tokens: u32::try_from(align).unwrap_or(u32::MAX),
        attn_bytes_per_token: per_token,
        page_bytes: block * per_token,
        state_page_bytes: Some(state_page),
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// One region a rank registers with NIXL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HybridRegion {
    pub index: u32,
    /// The first layer (numeric name order) at this region's base.
    pub name: String,
    /// The owning group, or -1 when several groups share the region.
    pub group_id: i32,
    pub mem: RegionMem,
    /// Offset of block 0 from the base of `mem`.
    pub base_off: u64,
    pub block_len: u64,
    pub block_stride: u64,
    /// Blocks in the region (kernel blocks).
    pub num_blocks: u64,
    /// Every layer at this base, in numeric name order.
    pub layers: Vec<String>,
    /// Whether a state layer registered here (vLLM `_ssm_region_indices`).
    pub holds_state: bool,
}

impl HybridRegion {
    pub fn block_off(&self, block: u64) -> u64 {
        self.base_off + block * self.block_stride
    }
}

/// A memory registration: `len` bytes at `off` of `mem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Registration {
    pub mem: RegionMem,
    pub off: u64,
    pub len: u64,
}

impl Registration {
    pub fn end(&self) -> u64 {
        self.off + self.len
    }
}

/// What a span of a page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PageContent {
    /// K and V of the rank's heads for the block's tokens (`[H, N, C]` under LBHNC).
    Attention,
    State(StatePart),
    /// The state page's padding up to the attention page.
    Padding,
}

/// One span of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PageSpan {
    pub what: PageContent,
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// A layer's place in the host buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostSlot {
    pub layer: String,
    pub group: u32,
    /// Position in its group (the device region it aliases).
    pub position: u32,
    pub off: u64,
    /// Bytes of the host tensor (`num_blocks` unpadded state pages for a state layer).
    pub tensor_bytes: u64,
}

/// Numeric-aware order of layer names (vLLM `_region_sort_key`).
pub fn cmp_layer_names(a: &str, b: &str) -> Ordering {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Part<'a> {
        Num(u128),
        Text(&'a str),
    }
    fn parts(s: &str) -> Vec<Part<'_>> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        while start < bytes.len() {
            let digit = bytes[start].is_ascii_digit();
            let end = bytes[start..]
                .iter()
                .position(|c| c.is_ascii_digit() != digit)
                .map_or(bytes.len(), |p| start + p);
            let run = &s[start..end];
            out.push(if digit { Part::Num(run.parse().unwrap_or(u128::MAX)) } else { Part::Text(run) });
            start = end;
        }
        out
    }
    parts(a).cmp(&parts(b))
}

/// An engine's cache as a vLLM engine built it, in the terms a case states it (`p` and `d`
/// of `hybrid_v033.json`): block size, page, local KV heads, KV cache groups with their
/// layers, and the state's shapes and pages. [`EngineGeometry::from_stated`] plans with it as
/// given; [`EngineGeometry::stated`] writes a derived engine the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatedEngine {
    /// `block_size_tokens`: the (hybrid-aligned) logical block.
    pub block_tokens: u32,
    /// `page_bytes`: one layer's page of one block.
    pub page_bytes: u64,
    /// `local_kv_heads`: attention heads on one rank.
    pub local_kv_heads: u32,
    pub groups: Vec<StatedGroup>,
    pub state: Option<StatedState>,
}

impl StatedEngine {
    /// The engine in the terms of a case's `p` or `d` (`hybrid_v033.json`): what
    /// `kvx layout` prints as `engine` in JSON, and what a `kvx plan` scenario file holds.
    pub fn case_json(&self, tp: u32, num_blocks: u32, kv_buffer_device: KvBufferDevice) -> serde_json::Value {
        let torch = |d: Dtype| d.torch_name().trim_start_matches("torch.").to_string();
        let mut out = serde_json::json!({
            "tp": tp,
            "block_size_tokens": self.block_tokens,
            "num_blocks": num_blocks,
            "local_kv_heads": self.local_kv_heads,
            "page_bytes": self.page_bytes,
            "kv_buffer_device": kv_buffer_device.as_str(),
            "groups": self.groups.iter().enumerate().map(|(i, g)| {
                let mut v = serde_json::json!({"group": i, "spec": g.kind.vllm_spec(), "layers": g.layers});
                if let GroupKind::SlidingWindow { window_tokens } = g.kind {
                    v["sliding_window"] = window_tokens.into();
                }
                if let GroupKind::State(k) = g.kind {
                    v["mamba_type"] = k.name().into();
                }
                v
            }).collect::<Vec<_>>(),
        });
        if let Some(s) = &self.state {
            out["mamba_state_shapes_local"] = serde_json::json!([s.shapes.conv, s.shapes.ssm]);
            out["mamba_state_dtypes"] =
                serde_json::json!([torch(s.shapes.dtypes.0), torch(s.shapes.dtypes.1)]);
            out["mamba_real_page_bytes"] = s.real_page_bytes.into();
            out["mamba_page_size_padded"] = s.padded_page_bytes.into();
        }
        out
    }
}

/// One KV cache group as stated: its spec and its layers' names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatedGroup {
    pub kind: GroupKind,
    pub layers: Vec<String>,
}

/// The state as stated: `mamba_state_shapes_local` and `mamba_state_dtypes`,
/// `mamba_real_page_bytes`, `mamba_page_size_padded`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatedState {
    pub shapes: StateShapes,
    pub real_page_bytes: u64,
    pub padded_page_bytes: u64,
}

/// The cache geometry of one engine (every rank of it: ranks differ only in which global
/// heads and state units they hold).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EngineGeometry {
    pub side: Side,
    pub config: HybridEngineSpec,
    pub groups: Vec<KvGroup>,
    pub sizing: BlockSizing,
    /// Tokens per kernel block (the block size NIXL sees).
    pub kernel_block_tokens: u32,
    /// Kernel blocks per logical block.
    pub physical_per_logical: u32,
    /// Model KV heads and this engine's heads per rank.
    pub total_kv_heads: u32,
    pub heads_per_rank: u32,
    /// One attention cell: K and V of one head and one token.
    pub cell_bytes: u64,
    pub state: Option<StateLayout>,
    pub regions: Vec<HybridRegion>,
    pub registrations: Vec<Registration>,
    /// Host buffer layout in copy order, when `kv_buffer_device = cpu`.
    pub host_slots: Vec<HostSlot>,
}

impl EngineGeometry {
    /// Builds an engine's geometry as vLLM derives it from the model and the engine's
    /// settings; errors are vLLM's load-time refusals (a TP that does not split the model, a
    /// block no kernel block divides) or what kvx does not model.
    pub fn new(model: &HybridModel, config: &HybridEngineSpec, side: Side) -> Result<Self, HybridError> {
        Self::check_engine(model, config, side)?;
        let h = model.attention.num_kv_heads;
        let tp = config.tp;
        if (tp <= h && !h.is_multiple_of(tp)) || (tp > h && !tp.is_multiple_of(h)) {
            let (n, d) = if tp <= h { (h, tp) } else { (tp, h) };
            return Err(HybridError::refused(
                RefusalKind::ModelNotDivisible,
                format!("{n} is not divisible by {d}"),
                "vllm/distributed/utils.py:53 (divide)",
                Knob::tp(side.role()),
                format!("{h} KV heads must split evenly over TP {tp} (or TP over the heads)"),
            ));
        }
        let state = match &model.state {
            Some(spec) if model.has_state() => Some(StateLayout::new(spec, tp, side)?),
            _ => None,
        };
        let sizing = block_sizing(model, config, state.as_ref())?;
        let groups = kv_groups(model);
        Self::assemble(model, config, side, groups, sizing, state, topology::heads_per_rank(h, tp))
    }

    /// Builds an engine's geometry from what a vLLM engine actually built (a case's `p` or
    /// `d`): its block size, page, groups and state shapes as given, never re-derived. Errors
    /// name the stated field that contradicts itself or the model.
    pub fn from_stated(
        model: &HybridModel,
        config: &HybridEngineSpec,
        stated: &StatedEngine,
        side: Side,
    ) -> Result<Self, HybridError> {
        Self::check_engine(model, config, side)?;
        let at = |field: &str| format!("{}.{field}", side.prefix());
        let bad = |field: &str, reason: String| HybridError::stated(&at(field), reason);
        let (block, page) = (stated.block_tokens, stated.page_bytes);
        if block == 0 || page == 0 || stated.local_kv_heads == 0 {
            return Err(bad(
                "block_size_tokens",
                "block size, page bytes and local KV heads must be positive".into(),
            ));
        }
        let cell = 2 * u64::from(model.attention.head_dim) * u64::from(model.attention.dtype.bytes());
        let per_token = u64::from(stated.local_kv_heads) * cell;
        if u64::from(block) * per_token != page {
            return Err(bad(
                "page_bytes",
                format!(
                    "{page} bytes is not {block} tokens x {} local KV heads x {cell} bytes (K and V of one head, \
                     one token)",
                    stated.local_kv_heads
                ),
            ));
        }
        let state = match (&stated.state, model.has_state()) {
            (Some(s), true) => {
                let n_groups = match &model.state {
                    Some(StateSpec::Mamba2(m)) => Some(m.n_groups),
                    _ => None,
                };
                let layout = StateLayout::from_shapes(&s.shapes, config.tp, n_groups)
                    .map_err(|e| bad("mamba_state_shapes_local", e))?;
                if layout.real_page_bytes() != s.real_page_bytes {
                    return Err(bad(
                        "mamba_real_page_bytes",
                        format!(
                            "{} bytes, but the stated shapes hold {}",
                            s.real_page_bytes,
                            layout.real_page_bytes()
                        ),
                    ));
                }
                if s.padded_page_bytes != page {
                    return Err(bad(
                        "mamba_page_size_padded",
                        format!("{} bytes, but the attention page is {page}", s.padded_page_bytes),
                    ));
                }
                Some(layout)
            }
            (None, false) => None,
            (None, true) => {
                return Err(bad(
                    "mamba_state_shapes_local",
                    "the model keeps state but no state shapes are given".into(),
                ));
            }
            (Some(_), false) => {
                return Err(bad(
                    "mamba_state_shapes_local",
                    "state shapes given for a model without state layers".into(),
                ));
            }
        };
        let layers = model.cache_layers();
        let mut groups = Vec::with_capacity(stated.groups.len());
        let mut seen = std::collections::HashSet::new();
        for (i, g) in stated.groups.iter().enumerate() {
            let mut members = Vec::with_capacity(g.layers.len());
            for name in &g.layers {
                let layer = layers
                    .iter()
                    .find(|l| &l.name == name && GroupKind::of(l.kind) == g.kind)
                    .ok_or_else(|| {
                        bad(
                            &format!("groups[{i}].layers"),
                            format!("{name} is not a {} layer of the model", g.kind.vllm_spec()),
                        )
                    })?;
                if !seen.insert(name.as_str()) {
                    return Err(bad(&format!("groups[{i}].layers"), format!("{name} is in two groups")));
                }
                members.push(layer.clone());
            }
            if members.is_empty() {
                return Err(bad(&format!("groups[{i}].layers"), "a group without layers".into()));
            }
            groups.push(KvGroup {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                kind: g.kind,
                layers: members,
            });
        }
        if let Some(missing) = layers.iter().find(|l| !seen.contains(l.name.as_str())) {
            return Err(bad("groups", format!("{} is in no group", missing.name)));
        }
        let sizing = BlockSizing {
            block_tokens: block,
            alignment_tokens: block,
            attn_bytes_per_token: per_token,
            page_bytes: page,
            state_page_bytes: state.as_ref().map(StateLayout::real_page_bytes),
        };
        Self::assemble(model, config, side, groups, sizing, state, stated.local_kv_heads)
    }

    /// What every engine needs whatever says its geometry: a valid model, a TP size and a
    /// pool, a layer-outer layout.
    fn check_engine(model: &HybridModel, config: &HybridEngineSpec, side: Side) -> Result<(), HybridError> {
        model.validate()?;
        if config.tp == 0 || config.num_blocks == 0 {
            return Err(HybridError::request(
                Knob::tp(side.role()),
                "TP size and pool size must be positive",
            ));
        }
        if !matches!(config.layout, Layout::Lbhnc | Layout::Lbnhc) {
            return Err(HybridError::unsupported(
                format!(
                    "layout {} with a hybrid model (kvx plans layer-outer LBHNC and LBNHC)",
                    config.layout
                ),
                Knob::layout(side.role()),
            ));
        }
        Ok(())
    }

    /// The geometry of groups, block sizing and state decided: kernel blocks, regions,
    /// registrations.
    fn assemble(
        model: &HybridModel,
        config: &HybridEngineSpec,
        side: Side,
        groups: Vec<KvGroup>,
        sizing: BlockSizing,
        state: Option<StateLayout>,
        heads_per_rank: u32,
    ) -> Result<Self, HybridError> {
        let block = sizing.block_tokens;
        let kernel = match config.kernel_block_tokens {
            Some(k) => (k > 0 && block.is_multiple_of(k)).then_some(k).ok_or_else(|| {
                HybridError::unsupported(
                    format!("a {k}-token kernel block under {block}-token blocks"),
                    Knob::KernelBlockSize,
                )
            })?,
            None => config.attention_backend.kernel_block(block).ok_or_else(|| {
                HybridError::refused(
                    RefusalKind::NoKernelBlock,
                    format!(
                        "No common block size for {block} ({}: {})",
                        config.attention_backend.vllm_name(),
                        config.attention_backend.supported_sizes()
                    ),
                    "vllm/v1/worker/utils.py:554 (select_common_block_size)",
                    Knob::BlockSize,
                    format!(
                        "{} runs blocks of {}; pick a block size it divides",
                        config.attention_backend.vllm_name(),
                        config.attention_backend.supported_sizes()
                    ),
                )
            })?,
        };
        let cell_bytes = 2 * u64::from(model.attention.head_dim) * u64::from(model.attention.dtype.bytes());
        let mut geom = EngineGeometry {
            side,
            config: *config,
            groups,
            sizing,
            kernel_block_tokens: kernel,
            physical_per_logical: block / kernel,
            total_kv_heads: model.attention.num_kv_heads,
            heads_per_rank,
            cell_bytes,
            state,
            regions: Vec::new(),
            registrations: Vec::new(),
            host_slots: Vec::new(),
        };
        geom.build_regions();
        Ok(geom)
    }

    /// The engine as the case format states it (`kvx layout`'s `engine`, a case's `p`/`d`).
    pub fn stated(&self) -> StatedEngine {
        StatedEngine {
            block_tokens: self.sizing.block_tokens,
            page_bytes: self.sizing.page_bytes,
            local_kv_heads: self.heads_per_rank,
            groups: self
                .groups
                .iter()
                .map(|g| StatedGroup {
                    kind: g.kind,
                    layers: g.layers.iter().map(|l| l.name.clone()).collect(),
                })
                .collect(),
            state: self.state.as_ref().map(|s| StatedState {
                shapes: s.shapes(),
                real_page_bytes: s.real_page_bytes(),
                padded_page_bytes: self.sizing.page_bytes,
            }),
        }
    }

    /// Whether the model keeps Mamba/GDN state (vLLM `_has_mamba`).
    pub fn has_state(&self) -> bool {
        self.state.is_some()
    }

    pub fn mem(&self) -> RegionMem {
        match self.config.kv_buffer_device {
            KvBufferDevice::Cuda => RegionMem::Vram,
            KvBufferDevice::Cpu => RegionMem::Dram,
        }
    }

    /// Layers per group (the number of device regions).
    pub fn group_size(&self) -> u32 {
        self.groups.iter().map(|g| u32::try_from(g.layers.len()).unwrap_or(u32::MAX)).max().unwrap_or(0)
    }

    /// Logical blocks per rank.
    pub fn num_blocks(&self) -> u64 {
        u64::from(self.config.num_blocks)
    }

    /// Kernel blocks per rank (vLLM's `num_blocks` after the kernel split).
    pub fn kernel_blocks(&self) -> u64 {
        self.num_blocks() * u64::from(self.physical_per_logical)
    }

    /// Bytes of one kernel block of one layer.
    pub fn kernel_page_bytes(&self) -> u64 {
        self.sizing.page_bytes / u64::from(self.physical_per_logical)
    }

    /// The global KV heads rank `rank` holds.
    pub fn rank_heads(&self, rank: u32) -> std::ops::Range<u32> {
        topology::rank_heads(self.total_kv_heads, self.config.tp, rank)
    }

    /// Indices of the regions state layers registered (vLLM `_ssm_region_indices`).
    pub fn state_region_indices(&self) -> Vec<u32> {
        self.regions.iter().filter(|r| r.holds_state).map(|r| r.index).collect()
    }

    /// Every cache layer with its group and position.
    fn placed_layers(&self) -> Vec<(&CacheLayer, u32, u32)> {
        let mut out: Vec<(&CacheLayer, u32, u32)> = self
            .groups
            .iter()
            .flat_map(|g| (0u32..).zip(&g.layers).map(move |(k, l)| (l, g.index, k)))
            .collect();
        out.sort_by(|a, b| cmp_layer_names(&a.0.name, &b.0.name));
        out
    }

    fn build_regions(&mut self) {
        let nb = self.num_blocks();
        let page = self.sizing.page_bytes;
        let kpage = self.kernel_page_bytes();
        let kblocks = self.kernel_blocks();
        let mem = self.mem();
        // Where each (group, position) layer's tensor starts.
        let mut host_off = std::collections::HashMap::new();
        if mem == RegionMem::Dram {
            let mut off = 0;
            for g in &self.groups {
                for (k, l) in (0u32..).zip(&g.layers) {
                    let tensor_bytes = match (l.kind, &self.state) {
                        (CacheKind::State(_), Some(s)) if !self.config.host_state_page_padded => {
                            nb * s.real_page_bytes()
                        }
                        _ => nb * page,
                    };
                    self.host_slots.push(HostSlot {
                        layer: l.name.clone(),
                        group: g.index,
                        position: k,
                        off,
                        tensor_bytes,
                    });
                    host_off.insert(l.name.clone(), off);
                    off += nb * page;
                }
            }
        }
        let mut regions: Vec<HybridRegion> = Vec::new();
        let mut registrations = Vec::new();
        for (layer, group, k) in self.placed_layers() {
            let base = match mem {
                RegionMem::Vram => u64::from(k) * nb * page,
                RegionMem::Dram => host_off.get(&layer.name).copied().unwrap_or(0),
            };
            let is_state = matches!(layer.kind, CacheKind::State(_));
            let gid = i32::try_from(group).unwrap_or(i32::MAX);
            match regions.iter_mut().find(|r| r.base_off == base) {
                Some(r) => {
                    if r.group_id != gid {
                        r.group_id = -1;
                    }
                    r.layers.push(layer.name.clone());
                    r.holds_state |= is_state;
                }
                None => {
                    regions.push(HybridRegion {
                        index: u32::try_from(regions.len()).unwrap_or(u32::MAX),
                        name: layer.name.clone(),
                        group_id: gid,
                        mem,
                        base_off: base,
                        block_len: kpage,
                        block_stride: kpage,
                        num_blocks: kblocks,
                        layers: vec![layer.name.clone()],
                        holds_state: is_state,
                    });
                    if mem == RegionMem::Dram {
                        let bytes = self
                            .host_slots
                            .iter()
                            .find(|s| s.layer == layer.name)
                            .map_or(0, |s| s.tensor_bytes);
                        registrations.push(Registration { mem, off: base, len: bytes });
                    }
                }
            }
        }
        if mem == RegionMem::Vram {
            registrations.push(Registration { mem, off: 0, len: u64::from(self.group_size()) * nb * page });
        }
        self.regions = regions;
        self.registrations = registrations;
    }

    /// What one page (one layer, one logical block) holds for a group of kind `kind`, part by
    /// part with byte ranges: the attention page, or the conv parts, the SSM state and the
    /// padding up to the attention page.
    pub fn page_map(&self, kind: GroupKind) -> Vec<PageSpan> {
        let page = self.sizing.page_bytes;
        match (&self.state, kind) {
            (Some(s), GroupKind::State(_)) => {
                let mut out: Vec<PageSpan> = s
                    .parts
                    .iter()
                    .map(|p| PageSpan {
                        what: PageContent::State(p.part),
                        offset_bytes: p.offset_bytes,
                        len_bytes: p.len_bytes,
                    })
                    .collect();
                let real = s.real_page_bytes();
                if real < page {
                    out.push(PageSpan {
                        what: PageContent::Padding,
                        offset_bytes: real,
                        len_bytes: page - real,
                    });
                }
                out
            }
            _ => vec![PageSpan { what: PageContent::Attention, offset_bytes: 0, len_bytes: page }],
        }
    }

    /// Whether `[off, off + len)` of `mem` lies inside one registration.
    pub fn registered(&self, mem: RegionMem, off: u64, len: u64) -> bool {
        self.registered_near(mem, off, len, &mut 0)
    }

    /// [`registered`](Self::registered), trying registration `*hint` first and leaving there
    /// the one that held the range: a request's consecutive descriptors mostly fall in the
    /// same registration, so a plan checks each in constant time instead of scanning them all.
    pub fn registered_near(&self, mem: RegionMem, off: u64, len: u64, hint: &mut usize) -> bool {
        let holds = |r: &Registration| r.mem == mem && r.off <= off && off.saturating_add(len) <= r.end();
        if self.registrations.get(*hint).is_some_and(holds) {
            return true;
        }
        match self.registrations.iter().position(holds) {
            Some(i) => {
                *hint = i;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::hybrid::preset;

    fn aligned(model: &str, tp: u32, backend: GdnPrefillBackend) -> u32 {
        let m = preset(model).expect("preset");
        let cfg = HybridEngineSpec { gdn_prefill: backend, ..HybridEngineSpec::new(tp, 8) };
        EngineGeometry::new(&m, &cfg, Side::Decode).expect("geometry").sizing.block_tokens
    }

    #[test]
    fn aligned_block_sizes_match_vllm() {
        let tri = GdnPrefillBackend::Triton;
        let fi = GdnPrefillBackend::FlashInfer;
        let tps = [1, 2, 4, 8];
        let table: [(&str, GdnPrefillBackend, [u32; 4]); 6] = [
            ("qwen3-next-80b-a3b", tri, [544, 544, 272, 144]),
            ("qwen3-next-80b-a3b", fi, [576, 576, 320, 192]),
            ("nemotron-h-8b", tri, [1040; 4]),
            ("granite-4.0-h-tiny", tri, [400, 400, 400, 208]),
            ("jamba-v0.1", tri, [80; 4]),
            ("falcon-h1-7b", tri, [1568, 1568, 784, 400]),
        ];
        for (model, backend, want) in table {
            let got: Vec<u32> = tps.iter().map(|&tp| aligned(model, tp, backend)).collect();
            assert_eq!(got, want, "{model} {backend:?}");
        }
        // Prefix caching off: no checkpoint alignment, FlashInfer or not.
        let m = preset("qwen3-next-80b-a3b").expect("preset");
        let cfg = HybridEngineSpec { gdn_prefill: fi, prefix_caching: false, ..HybridEngineSpec::new(4, 8) };
        assert_eq!(EngineGeometry::new(&m, &cfg, Side::Decode).expect("geometry").sizing.block_tokens, 272);
        // Attention-only models keep --block-size.
        assert_eq!(aligned("gpt-oss-120b", 2, tri), 16);
    }

    #[test]
    fn state_layouts_match_the_oracle_shapes() {
        let m = preset("nemotron-h-8b").expect("preset");
        let s = StateLayout::new(m.state.as_ref().expect("state"), 2, Side::Decode).expect("state");
        assert_eq!(s.conv_shape, [5120, 3]);
        assert_eq!(s.ssm_shape, vec![64, 64, 128]);
        assert_eq!(s.ssm_sizes(), (30720, 2097152));
        let lens: Vec<(u64, u64)> = s.parts.iter().map(|p| (p.offset_bytes, p.len_bytes)).collect();
        assert_eq!(lens, vec![(0, 24576), (24576, 3072), (27648, 3072), (30720, 2097152)]);
        let q = preset("qwen3-next-80b-a3b").expect("preset");
        let s = StateLayout::new(q.state.as_ref().expect("state"), 1, Side::Prefill).expect("state");
        assert_eq!((s.conv_shape, s.ssm_sizes()), ([8192, 3], (49152, 1048576)));
        // granite: n_groups 1 < TP 2, so B and C are replicated, one group's channels each.
        let g = preset("granite-4.0-h-tiny").expect("preset");
        let s = StateLayout::new(g.state.as_ref().expect("state"), 2, Side::Decode).expect("state");
        let b = s.part(StatePart::Conv(ConvPart::B)).expect("B");
        assert!(b.replicated);
        assert_eq!((b.units, b.global_units, b.first_global_unit(1)), (128, 128, 0));
    }

    #[test]
    fn groups_follow_the_hybrid_allocator() {
        let sizes = |name: &str| -> Vec<(GroupKind, usize)> {
            let m = preset(name).expect("preset");
            kv_groups(&m).iter().map(|g| (g.kind, g.layers.len())).collect()
        };
        let q = sizes("qwen3-next-80b-a3b");
        assert_eq!(q.len(), 4);
        assert!(q[..3].iter().all(|&(k, n)| k == GroupKind::State(StateKind::Gdn) && n == 12));
        assert_eq!(q[3], (GroupKind::Full, 12));
        assert_eq!(sizes("nemotron-h-8b").len(), 7);
        assert_eq!(
            sizes("gpt-oss-120b"),
            vec![(GroupKind::SlidingWindow { window_tokens: 128 }, 18), (GroupKind::Full, 18)]
        );
        // Gemma-3-4b: 29 local in groups of 5 (the last one padded), then the 5 global.
        let g = sizes("gemma-3-4b");
        assert_eq!(g.len(), 7);
        assert_eq!(g[5].1, 4);
        assert_eq!(g[6], (GroupKind::Full, 5));
        // Falcon-H1: attention and state in every layer, one group each; attention first.
        assert_eq!(
            sizes("falcon-h1-7b"),
            vec![(GroupKind::Full, 44), (GroupKind::State(StateKind::Mamba2), 44)]
        );
        // Strided membership: group j of a bucket takes layers j, j + n, ...
        let m = preset("qwen3-next-80b-a3b").expect("preset");
        let gr = kv_groups(&m);
        assert_eq!(gr[0].layers.iter().take(3).map(|l| l.layer).collect::<Vec<_>>(), vec![0, 4, 8]);
    }

    #[test]
    fn page_maps_show_parts_and_padding() {
        let m = preset("nemotron-h-8b").expect("preset");
        let g = EngineGeometry::new(&m, &HybridEngineSpec::new(1, 8), Side::Prefill).expect("geometry");
        let spans: Vec<(u64, u64)> = g
            .page_map(GroupKind::State(StateKind::Mamba2))
            .iter()
            .map(|s| (s.offset_bytes, s.len_bytes))
            .collect();
        assert_eq!(spans, vec![(0, 49152), (49152, 6144), (55296, 6144), (61440, 4194304), (4255744, 4096)]);
        assert_eq!(g.page_map(GroupKind::Full).len(), 1);
    }

    #[test]
    fn layer_names_sort_numerically() {
        assert_eq!(cmp_layer_names("model.layers.10.mixer", "model.layers.9.mixer"), Ordering::Greater);
        assert_eq!(cmp_layer_names("model.layers.3.mixer", "model.layers.3.mixer.attn"), Ordering::Less);
        assert_eq!(cmp_layer_names("model.44.mixer", "model.layers.0.attn"), Ordering::Less);
    }

    #[test]
    fn device_regions_alias_and_host_regions_do_not() {
        let m = preset("gpt-oss-120b").expect("preset");
        let g = EngineGeometry::new(&m, &HybridEngineSpec::new(1, 40), Side::Prefill).expect("geometry");
        assert_eq!(g.regions.len(), 18);
        assert!(g.regions.iter().all(|r| r.group_id == -1 && r.layers.len() == 2));
        assert_eq!(
            g.registrations,
            vec![Registration { mem: RegionMem::Vram, off: 0, len: 18 * 40 * 32768 }]
        );
        let cfg = HybridEngineSpec { kv_buffer_device: KvBufferDevice::Cpu, ..HybridEngineSpec::new(1, 40) };
        let h = EngineGeometry::new(&m, &cfg, Side::Prefill).expect("geometry");
        assert_eq!(h.regions.len(), 36);
        assert_eq!((h.regions[1].name.as_str(), h.regions[1].group_id), ("model.layers.1.attn.attn", 1));
        // Layer 1 is the first of group 1, after group 0's 18 layers.
        assert_eq!(h.regions[1].base_off, 18 * 40 * 32768);
    }
}
