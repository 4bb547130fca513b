//! A P/D pair of one hybrid model as vLLM 0.33 would run it: the model, each engine's
//! settings, the engines as a case states them (and what kvx's own derivation says of them),
//! kvx's switches for vLLM's rules that move the wrong bytes, and vLLM's refusals of the pair
//! at the handshake (`check_pair`: TP and block-size ratios, layouts, PP, host buffers,
//! prefix caching with kernel blocks).

use serde::Serialize;

use super::error::{HybridError, RefusalKind};
use super::geometry::{
    ConvStateLayout, EngineGeometry, HybridEngineSpec, KvBufferDevice, Side, StatedEngine,
};
use super::model::HybridModel;
use super::tp_map::tp_ratio;
use crate::layouts::Layout;
use crate::vocab::knob::Knob;

/// A P/D pair of one hybrid model: the hybrid counterpart of
/// [`PairSpec`](crate::layouts::compat::PairSpec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct HybridPairSpec {
    pub model: HybridModel,
    pub p: HybridEngineSpec,
    pub d: HybridEngineSpec,
    /// vLLM's `enable_permute_local_kv` ([`Knob::Permute`]).
    #[serde(default)]
    pub permute_local_kv: bool,
    /// Where decode reads its slice of each state part in a prefill page ([`Knob::StateSlices`]).
    #[serde(default)]
    pub state_slices: StateSlices,
    /// Which blocks decode's host-to-device copy passes through each layer ([`Knob::HostCopy`]).
    #[serde(default)]
    pub host_copy: HostCopyRule,
    /// Push mode: which decode ranks get attention when several hold one head
    /// ([`Knob::PushAttention`]).
    #[serde(default)]
    pub push_attention: PushAttention,
    /// The engines as vLLM built them, where a case states them: planned as given, and
    /// compared with what kvx derives ([`GeometrySource`]).
    #[serde(default)]
    pub stated: StatedPair,
}

/// A pair's engines as a case states them (`p`, `d`); `None`: derived from the model.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct StatedPair {
    pub p: Option<StatedEngine>,
    pub d: Option<StatedEngine>,
}

/// Where an engine's geometry came from, and what kvx's own derivation says about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GeometrySource {
    pub side: Side,
    /// The case stated it (planned as given) rather than kvx deriving it.
    pub stated: bool,
    /// kvx's derivation under the engine's settings: each field where it differs from what
    /// was stated, naming both values. Empty when they agree or nothing was stated.
    pub differences: Vec<GeometryDifference>,
    /// Why kvx could not derive the engine from the model (a refusal), when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub underivable: Option<String>,
}

/// One field where the stated engine and kvx's derivation differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GeometryDifference {
    pub field: &'static str,
    pub stated: String,
    pub derived: String,
}

impl GeometrySource {
    /// Builds the engine of `side`: as stated when stated (then compared with kvx's
    /// derivation), else derived.
    pub(super) fn build(
        model: &HybridModel,
        config: &HybridEngineSpec,
        stated: Option<&StatedEngine>,
        side: Side,
    ) -> Result<(EngineGeometry, GeometrySource), HybridError> {
        let Some(stated) = stated else {
            let g = EngineGeometry::new(model, config, side)?;
            return Ok((
                g,
                GeometrySource { side, stated: false, differences: Vec::new(), underivable: None },
            ));
        };
        let g = EngineGeometry::from_stated(model, config, stated, side)?;
        let (differences, underivable) = match EngineGeometry::new(model, config, side) {
            Ok(derived) => (compare_stated(stated, &derived.stated()), None),
            Err(e) => (Vec::new(), Some(e.to_string())),
        };
        Ok((g, GeometrySource { side, stated: true, differences, underivable }))
    }
}

/// Where `derived` differs from `stated`, field by field.
pub fn compare_stated(stated: &StatedEngine, derived: &StatedEngine) -> Vec<GeometryDifference> {
    let mut out = Vec::new();
    let mut diff = |field: &'static str, a: String, b: String| {
        if a != b {
            out.push(GeometryDifference { field, stated: a, derived: b });
        }
    };
    diff("block_size_tokens", stated.block_tokens.to_string(), derived.block_tokens.to_string());
    diff("page_bytes", stated.page_bytes.to_string(), derived.page_bytes.to_string());
    diff("local_kv_heads", stated.local_kv_heads.to_string(), derived.local_kv_heads.to_string());
    let groups = |e: &StatedEngine| {
        e.groups
            .iter()
            .map(|g| format!("{}[{}]", g.kind.vllm_spec(), g.layers.join(",")))
            .collect::<Vec<_>>()
            .join(" ")
    };
    diff("groups", groups(stated), groups(derived));
    let shapes = |e: &StatedEngine| {
        e.state
            .as_ref()
            .map_or_else(|| "none".to_string(), |s| format!("{:?} {:?}", s.shapes.conv, s.shapes.ssm))
    };
    diff("mamba_state_shapes_local", shapes(stated), shapes(derived));
    let dtypes = |e: &StatedEngine| {
        e.state
            .as_ref()
            .map_or_else(|| "none".to_string(), |s| format!("{}, {}", s.shapes.dtypes.0, s.shapes.dtypes.1))
    };
    diff("mamba_state_dtypes", dtypes(stated), dtypes(derived));
    out
}

/// Push mode: which decode ranks a prefill rank writes attention into when decode TP is above prefill TP
/// and above the KV heads (several decode ranks hold one head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PushAttention {
    /// vLLM 0.33 (as read): the first decode rank of each head only; the others receive state
    /// but no attention.
    #[default]
    Vllm,
    /// Every decode rank its head, as pull reads them.
    EveryRank,
}

/// Which blocks decode's host-to-device copy (host buffer, `sync_recved_kv_to_device`) passes
/// through each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostCopyRule {
    /// vLLM 0.33: every group's blocks through every layer, in layer order. With several KV
    /// cache groups over aliased device memory, a later group's layer overwrites the blocks of
    /// the others with host bytes it never received ([`Finding::HostCopyOverwrites`]).
    #[default]
    Vllm,
    /// Each layer copies its own group's blocks only.
    PerGroup,
}

/// How big a host buffer's state pages are ([`Knob::HostStatePage`]), as
/// [`HybridEngineSpec::host_state_page_padded`] holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostStatePage {
    /// vLLM 0.33: unpadded state pages, under regions that step by padded ones.
    #[default]
    Vllm,
    /// Padded pages, as the regions assume.
    Padded,
}

/// Which host tensors a host buffer's descriptors read ([`Knob::HostDescriptors`]), as
/// [`HybridEngineSpec::host_descriptors_per_group`] holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostDescriptors {
    /// vLLM 0.33: with state in the model, every layer's host tensor for attention, every state
    /// layer's for state.
    #[default]
    Vllm,
    /// Each group's own layers' tensors only.
    PerGroup,
}

impl HybridEngineSpec {
    pub fn host_state_page(&self) -> HostStatePage {
        if self.host_state_page_padded { HostStatePage::Padded } else { HostStatePage::Vllm }
    }

    pub fn host_descriptors(&self) -> HostDescriptors {
        if self.host_descriptors_per_group { HostDescriptors::PerGroup } else { HostDescriptors::Vllm }
    }
}

/// Where a decode rank reads its slice of each state part in a prefill rank's page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateSlices {
    /// vLLM 0.33's `remote_conv_offsets`: every conv part sharded like `x`, so decode rank `d`
    /// reads `d % (D/P)` slices in. Wrong for parts replicated across TP ranks (Mamba2 B and C
    /// with `n_groups` below TP), which kvx reports ([`Finding::StateSliceMisread`]).
    #[default]
    Vllm,
    /// Each part's offset from how the model really splits it: a sharded part as vLLM reads it,
    /// a replicated part where the source rank holds decode's slice of it (decode TP at least
    /// prefill TP: whole; prefill TP above decode TP: each source rank's piece of the slice,
    /// from remote rows of its own).
    Exact,
}

/// vLLM's pair-level checks, in the order vLLM makes them; returns the TP ratio.
pub(super) fn check_pair(
    config: &HybridPairSpec,
    p: &EngineGeometry,
    d: &EngineGeometry,
) -> Result<i64, HybridError> {
    let has_state = d.has_state();
    for (g, side) in [(d, Side::Decode), (p, Side::Prefill)] {
        if has_state && g.config.conv_state_layout == ConvStateLayout::Sd {
            return Err(HybridError::refused(
                RefusalKind::ConvStateLayout,
                "3-read Mamba conv transfer requires DS conv state layout. Set VLLM_SSM_CONV_STATE_LAYOUT=DS",
                "nixl/base_worker.py:705 (NixlBaseConnectorWorker.__init__)",
                Knob::ConvStateLayout,
                format!("set VLLM_SSM_CONV_STATE_LAYOUT=DS on the {} engine", side.prefix()),
            ));
        }
        if g.config.pp > 1 {
            return Err(HybridError::refused(
                RefusalKind::PipelineParallel,
                "NixlConnector (pull) does not support pipeline_parallel_size > 1 with hybrid KV cache \
                 layouts (HMA); use NixlPushConnector for PP + HMA.",
                "nixl/base_worker.py:872",
                Knob::pp(side.role()),
                "use pipeline-parallel size 1 (hybrid models always use HMA)",
            ));
        }
    }
    let (pt, dt) = (config.p.tp, config.d.tp);
    if dt >= pt && !dt.is_multiple_of(pt) {
        return Err(HybridError::refused(
            RefusalKind::TpNotDivisible,
            format!("Local tensor parallel size {dt} is not divisible by remote tensor parallel size {pt}."),
            "kv_connector/utils.py:530 (TransferTopology.tp_ratio)",
            Knob::DTp,
            "use TP sizes that divide each other",
        ));
    }
    if pt > dt && !pt.is_multiple_of(dt) {
        return Err(HybridError::refused(
            RefusalKind::TpNotDivisible,
            format!("Remote tensor parallel size {pt} is not divisible by local tensor parallel size {dt}."),
            "kv_connector/utils.py:535 (TransferTopology.tp_ratio)",
            Knob::DTp,
            "use TP sizes that divide each other",
        ));
    }
    let ratio = tp_ratio(pt, dt);
    let (lk, rk) = (d.kernel_block_tokens, p.kernel_block_tokens);
    if !lk.is_multiple_of(rk) {
        let common = d.sizing.block_tokens.max(p.sizing.block_tokens);
        return Err(HybridError::refused(
            RefusalKind::BlockSizeNotDivisible,
            format!("Local block size {lk} is not divisible by remote block size {rk} or vice versa."),
            "kv_connector/utils.py:543 (TransferTopology.block_size_ratio)",
            Knob::BlockSize,
            format!(
                "the hybrid block size follows TP ({rk} tokens at prefill TP {pt}, {lk} at decode TP {dt}); \
                 choose TP sizes whose block sizes divide, or set {} {common} on both engines",
                Knob::BlockSize,
            ),
        ));
    }
    let bsr = lk / rk;
    let h = config.model.attention.num_kv_heads;
    if !has_state && ratio < 0 && pt > h {
        return Err(HybridError::refused_by_assert(
            RefusalKind::ReplicatedKvPrefillAboveDecode,
            "assert not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))",
            "nixl/base_worker.py:2728 (_validate_remote_agent_handshake)",
            Knob::PTp,
            format!(
                "with prefill TP {pt} above the model's {h} KV heads, decode TP must be at least prefill TP"
            ),
        ));
    }
    if has_state && config.d.prefix_caching && p.physical_per_logical != d.physical_per_logical {
        return Err(HybridError::refused(
            RefusalKind::PrefixCachingKernelBlocks,
            format!(
                "Prefix caching with heterogeneous physical_blocks_per_logical is not supported for Mamba hybrid \
                 models. Local: {}, Remote: {}. Disable prefix caching with --disable-prefix-caching.",
                d.physical_per_logical, p.physical_per_logical
            ),
            "nixl/base_worker.py:2766",
            Knob::NoPrefixCaching,
            "disable prefix caching, or use the same kernel block size per logical block on both engines",
        ));
    }
    if bsr != 1 && config.d.kv_buffer_device == KvBufferDevice::Cpu {
        return Err(HybridError::refused(
            RefusalKind::HostBufferBlockSizes,
            "Heterogeneous block sizes are not supported with host buffer",
            "nixl/base_worker.py:2785",
            Knob::KvBufferDevice,
            format!(
                "use {} cuda, or TP sizes with equal block sizes ({rk} vs {lk} tokens)",
                Knob::KvBufferDevice
            ),
        ));
    }
    let (ll, rl) = (config.d.layout, config.p.layout);
    if ll != rl {
        if config.permute_local_kv && rl == Layout::Lbhnc && ll == Layout::Lbnhc {
            return Err(HybridError::refused(
                RefusalKind::PermuteWithHma,
                "HMA does not support block size post processing",
                "nixl/base_worker.py:2803",
                Knob::Permute,
                format!(
                    "hybrid models always use HMA: use the same layout (LBHNC) on both engines without {}",
                    Knob::Permute
                ),
            ));
        }
        return Err(HybridError::refused(
            RefusalKind::LayoutMismatch,
            format!(
                "Heterogeneous TP expects same kv_cache_layout (local {}, remote {}). Or enable experimental \
                 feature to receive LBHNC into a local LBNHC cache by setting 'enable_permute_local_kv'=True in \
                 --kv-transfer-config.",
                ll.vllm_name(),
                rl.vllm_name()
            ),
            "nixl/base_worker.py:2808",
            Knob::DLayout,
            "use the same layout on both engines",
        ));
    }
    if ratio.abs() != 1 && pt <= h && !ll.heads_contiguous() {
        return Err(HybridError::refused(
            RefusalKind::NonContiguousHeads,
            "Heterogeneous TP head-dimension splitting requires contiguous heads. Use a block-contiguous layout \
             (e.g. LBHNC) on the prefill side.",
            "nixl/base_worker.py:2841",
            Knob::Layout,
            "use LBHNC, or equal TP sizes",
        ));
    }
    if !has_state && ratio < 0 && bsr != 1 {
        return Err(HybridError::refused(
            RefusalKind::HeadShardedBlockSizes,
            "Different local/remote block sizes are not supported when P TP > D TP.",
            "nixl/base_worker.py:2914 (_validate_remote_agent_handshake)",
            Knob::BlockSize,
            "use the same block size on both engines when prefill TP exceeds decode TP",
        ));
    }
    Ok(ratio)
}
