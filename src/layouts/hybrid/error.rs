//! Typed errors of the hybrid planner: vLLM's own refusals (with the text vLLM raises, where
//! it raises it, and the kvx setting to change, a [`Knob`]), invalid model descriptions,
//! configurations kvx does not model, and bad block lists.

use std::fmt;

use serde::Serialize;

use crate::error::{ConfigError, KnobError};
use crate::vocab::knob::Knob;

/// Which of vLLM 0.33's checks refused a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RefusalKind {
    /// TP sizes do not divide each other (`TransferTopology.tp_ratio`).
    TpNotDivisible,
    /// The (hybrid-aligned) block sizes do not divide each other (`block_size_ratio`).
    BlockSizeNotDivisible,
    /// Attention-only model, prefill TP above decode TP and above the KV heads (bare assert).
    ReplicatedKvPrefillAboveDecode,
    /// A model dimension (KV heads, state heads or channels) does not split over the TP size: vLLM fails loading the model.
    ModelNotDivisible,
    /// Mamba2 with `n_groups` neither 1 nor divisible by TP.
    Mamba2Groups,
    /// Pipeline parallelism with HMA in pull mode, or with Mamba.
    PipelineParallel,
    /// `enable_permute_local_kv` with HMA (always the case for a hybrid model).
    PermuteWithHma,
    /// Different `kv_cache_layout` on the two sides.
    LayoutMismatch,
    /// Heterogeneous TP on a layout whose heads are not contiguous in a block.
    NonContiguousHeads,
    /// Host buffer with heterogeneous block sizes.
    HostBufferBlockSizes,
    /// Mamba with prefix caching and different kernel blocks per logical block.
    PrefixCachingKernelBlocks,
    /// Head-sharded attention reads with P TP > D TP and heterogeneous block sizes.
    HeadShardedBlockSizes,
    /// The conv state layout is not DS (`VLLM_SSM_CONV_STATE_LAYOUT`).
    ConvStateLayout,
    /// The attention backend runs no kernel block that divides the block size.
    NoKernelBlock,
    /// Mamba or GDN state without the hybrid KV cache manager.
    StateWithoutHma,
}

/// A pair vLLM 0.33 refuses, as vLLM refuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    /// What vLLM raises: its message; empty for a bare `assert` (an `AssertionError` without
    /// one), whose condition is `assertion`.
    pub vllm_message: String,
    /// The condition of the bare `assert` that fails; `None` where vLLM raises a message.
    pub assertion: Option<&'static str>,
    /// Where vLLM raises it (0.33.0 source).
    pub vllm_site: &'static str,
    /// The kvx setting to change.
    pub knob: Knob,
    /// What to change it to, in words.
    pub hint: String,
}

impl Refusal {
    /// What vLLM raises, in words: its message, or the bare `assert` that fails.
    pub fn raised(&self) -> String {
        match self.assertion {
            Some(condition) if self.vllm_message.is_empty() => {
                format!("AssertionError (no message) from `{condition}`")
            }
            _ => self.vllm_message.clone(),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "vLLM 0.33 refuses this pair: {} [{}]; change {}: {}",
            self.raised(),
            self.vllm_site,
            self.knob,
            self.hint
        )
    }
}

/// Errors of the hybrid planning core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HybridError {
    /// vLLM itself would refuse this configuration.
    #[error("{0}")]
    Refused(Box<Refusal>),
    /// The model description is incomplete or inconsistent (`field`: the description's field).
    #[error("invalid hybrid model ({field}): {reason}")]
    Model { field: String, reason: String },
    /// An engine as a case states it (its `p` or `d`, `Knob::Scenario`) contradicts itself or the model
    /// (`field`: the case's field).
    #[error("the case's engine ({field}): {reason}")]
    Stated { field: String, reason: String },
    /// No hybrid preset answers to the name, or its config does not read.
    #[error("invalid hybrid model ({}): {reason}", Knob::Model)]
    Preset { reason: String },
    /// A configuration vLLM may accept but kvx's hybrid planner does not model.
    #[error("{what} is not modelled by kvx's hybrid planner (change {knob})")]
    Unsupported { what: String, knob: Knob },
    /// A request's block lists or token counts do not fit the engines.
    #[error("{reason} (change {knob})")]
    Request { knob: Knob, reason: String },
}

impl HybridError {
    pub(crate) fn model(field: &str, reason: String) -> Self {
        HybridError::Model { field: field.to_string(), reason }
    }

    pub(crate) fn stated(field: &str, reason: String) -> Self {
        HybridError::Stated { field: field.to_string(), reason }
    }

    pub(crate) fn refused(
        kind: RefusalKind,
        vllm_message: impl Into<String>,
        vllm_site: &'static str,
        knob: Knob,
        hint: impl Into<String>,
    ) -> Self {
        HybridError::Refused(Box::new(Refusal {
            kind,
            vllm_message: vllm_message.into(),
            assertion: None,
            vllm_site,
            knob,
            hint: hint.into(),
        }))
    }

    /// A refusal by a bare `assert`: vLLM raises an `AssertionError` with no message.
    pub(crate) fn refused_by_assert(
        kind: RefusalKind,
        condition: &'static str,
        vllm_site: &'static str,
        knob: Knob,
        hint: impl Into<String>,
    ) -> Self {
        HybridError::Refused(Box::new(Refusal {
            kind,
            vllm_message: String::new(),
            assertion: Some(condition),
            vllm_site,
            knob,
            hint: hint.into(),
        }))
    }

    pub(crate) fn unsupported(what: impl Into<String>, knob: Knob) -> Self {
        HybridError::Unsupported { what: what.into(), knob }
    }

    pub(crate) fn request(knob: Knob, reason: impl Into<String>) -> Self {
        HybridError::Request { knob, reason: reason.into() }
    }

    /// The refusal, when vLLM would refuse.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            HybridError::Refused(r) => Some(r),
            _ => None,
        }
    }

    /// The setting to change.
    pub fn knob(&self) -> Knob {
        match self {
            HybridError::Refused(r) => r.knob,
            HybridError::Model { .. } | HybridError::Preset { .. } => Knob::Model,
            HybridError::Stated { .. } => Knob::Scenario,
            HybridError::Unsupported { knob, .. } | HybridError::Request { knob, .. } => *knob,
        }
    }
}

impl From<HybridError> for KnobError {
    fn from(e: HybridError) -> Self {
        // A knob error names its knob itself: the reason without the "(change KNOB)" tail.
        match e {
            HybridError::Request { knob, reason } => KnobError::new(knob, reason),
            HybridError::Refused(r) => KnobError::new(
                r.knob,
                format!("vLLM 0.33 refuses this pair: {} [{}]; {}", r.raised(), r.vllm_site, r.hint),
            ),
            HybridError::Unsupported { what, knob } => {
                KnobError::new(knob, format!("{what} is not modelled by kvx's hybrid planner"))
            }
            other => KnobError::new(other.knob(), other.to_string()),
        }
    }
}

impl From<HybridError> for ConfigError {
    fn from(e: HybridError) -> Self {
        KnobError::from(e).into()
    }
}
