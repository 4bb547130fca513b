//! Whether a prefill engine and a decode engine can exchange KV blocks, decided the way
//! vLLM decides at handshake time (`add_remote_agent` / `_validate_remote_agent_handshake`),
//! plus the configurations vLLM accepts but reads wrong data for, which kvx rejects.
//!
//! Every rejection is a `KnobError` naming the setting to change (a [`Knob`]) and the reason.

use serde::{Deserialize, Serialize};

use super::Layout;
use super::geometry::{Axis, EngineSpec, RankGeometry};
use crate::error::KnobError;
use crate::topology::push_map::{PushRankMap, push_rank_map};
use crate::topology::{self, RankMap, TpSpec, VllmVersion};
use crate::vocab::kinds::Role;
use crate::vocab::knob::Knob;
use crate::vocab::model::ModelShape;

/// Largest block size (tokens) kvx accepts.
pub const MAX_BLOCK_TOKENS: u32 = 1 << 16;

/// Largest KV pool of one rank kvx accepts (1 PiB): far above any GPU or host, far below
/// where byte offsets overflow.
pub const MAX_POOL_BYTES: u64 = 1 << 50;
/// Most blocks in one rank's pool kvx accepts (2^24, about 16.8 M): above any engine's pool,
/// and what keeps a pool's block list (4 bytes an id) at 64 MiB.
pub const MAX_POOL_BLOCKS: u32 = 1 << 24;
/// Largest number of layers kvx accepts.
pub const MAX_LAYERS: u32 = 4096;

/// A prefill engine, a decode engine, and the model they serve (one KV cache group; a hybrid
/// model's pair is a [`HybridPairSpec`](crate::layouts::hybrid::HybridPairSpec)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairSpec {
    pub version: VllmVersion,
    pub model: ModelShape,
    pub p: EngineSpec,
    pub d: EngineSpec,
    /// vLLM's `enable_permute_local_kv`: receive HND blocks into a local NHD cache.
    pub permute: bool,
}

impl PairSpec {
    pub fn tp_spec(&self) -> TpSpec {
        TpSpec {
            p_tp: self.p.tp,
            d_tp: self.d.tp,
            num_kv_heads: self.model.num_kv_heads,
            use_mla: self.model.is_mla(),
            version: self.version,
        }
    }

    /// Decode block size over prefill block size (vLLM `block_size_ratio`); valid after
    /// `validate`.
    pub fn block_size_ratio(&self) -> u32 {
        self.d.block_tokens / self.p.block_tokens.max(1)
    }

    pub fn p_geometry(&self, rank: u32) -> RankGeometry {
        RankGeometry::new(&self.model, &self.p, rank)
    }

    pub fn d_geometry(&self, rank: u32) -> RankGeometry {
        RankGeometry::new(&self.model, &self.d, rank)
    }

    /// Whether decode receives HND blocks into an NHD cache (the permute exception).
    pub fn permutes(&self) -> bool {
        self.permute && is_permute_pair(self.p.layout, self.d.layout)
    }

    /// Validates the pair in vLLM's order and returns its rank map.
    pub fn validate(&self) -> Result<RankMap, KnobError> {
        check_model(&self.model)?;
        check_engine(&self.p, Role::Prefill, self.version)?;
        check_engine(&self.d, Role::Decode, self.version)?;
        let (pb, db) = (self.p.block_tokens, self.d.block_tokens);
        if db % pb != 0 {
            return Err(KnobError::new(
                Knob::DBlockSize,
                format!(
                    "decode block size {db} is not a multiple of prefill block size {pb} (vLLM: \"Local block size {db} is \
                     not divisible by remote block size {pb} or vice versa.\"); decode blocks must be 1, 2, 4, ... prefill blocks long"
                ),
            ));
        }
        let map = topology::rank_map(&self.tp_spec())?;
        self.check_layouts(&map)?;
        let bsr = db / pb;
        if bsr != 1 && self.p.tp > self.d.tp {
            return Err(KnobError::new(
                Knob::DBlockSize,
                format!(
                    "decode block size {db} differs from prefill block size {pb} while prefill TP {} > decode TP {}; \
                     vLLM: \"Different local/remote block sizes are not supported when P TP > D TP.\"",
                    self.p.tp, self.d.tp
                ),
            ));
        }
        // vLLM splits a decode block into sub-blocks at block_stride/r and regroups tokens as
        // (r, H, N/r, C): only right for plain pages (stride == length, no layer axis).
        let strided =
            self.d_geometry(0).regions().iter().any(|r| {
                r.block_stride != r.block_len || r.content.axes.iter().any(|(a, _)| *a == Axis::Layer)
            });
        if bsr != 1 && strided {
            return Err(KnobError::new(
                Knob::DBlockSize,
                format!(
                    "decode blocks of {bsr} prefill blocks with layout {}, whose blocks are strided (block stride != block \
                     length): vLLM places decode sub-block j at base + j*block_stride/{bsr}, which then lands in another \
                     layer's or K/V half's bytes; use a layer-outer layout (e.g. {}) or equal block sizes",
                    self.d.layout,
                    Layout::default_for(self.version)
                ),
            ));
        }
        self.check_block_lens(map.p_heads_per_rank, map.d_heads_per_rank)?;
        self.check_pool_bytes()?;
        Ok(map)
    }

    /// A rank's pool must have a size kvx can represent and allocate: at most
    /// [`MAX_POOL_BYTES`], computed with checked arithmetic (a wrapped size would print as
    /// a small number and allocate the wrong amount).
    fn check_pool_bytes(&self) -> Result<(), KnobError> {
        self.check_pool_blocks()?;
        for (role, e, g) in
            [(Role::Prefill, &self.p, self.p_geometry(0)), (Role::Decode, &self.d, self.d_geometry(0))]
        {
            let bytes = g.checked_total_bytes();
            if bytes.is_none_or(|b| b > MAX_POOL_BYTES) {
                let size = bytes.map_or_else(|| "more than 2^64 bytes".to_string(), |b| format!("{b} bytes"));
                return Err(KnobError::new(
                    Knob::num_blocks(role),
                    format!(
                        "a {} rank's pool of {} blocks of {} bytes is {size}, over the {MAX_POOL_BYTES} bytes \
                         (1 PiB) kvx accepts per rank; use fewer blocks ({}, {})",
                        role.as_str(),
                        e.num_blocks,
                        g.block_bytes_all_layers(),
                        Knob::NumBlocks,
                        Knob::PoolBlocks,
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Each rank's pool has at most [`MAX_POOL_BLOCKS`] blocks: checked before any block list
    /// of a pool is built.
    pub fn check_pool_blocks(&self) -> Result<(), KnobError> {
        for (role, e) in [(Role::Prefill, &self.p), (Role::Decode, &self.d)] {
            if e.num_blocks > MAX_POOL_BLOCKS {
                return Err(KnobError::new(
                    Knob::num_blocks(role),
                    format!(
                        "a pool of {} blocks: kvx takes at most {MAX_POOL_BLOCKS} blocks per rank",
                        e.num_blocks
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Validates the pair for push mode (vLLM's `NixlPushConnector`, whose checks run on
    /// the prefill side with the decode engine as the remote) and returns its rank map.
    ///
    /// Beyond the TP rules of `push_rank_map`: block sizes must be equal (with decode blocks
    /// larger, prefill's handshake to decode fails `block_size_ratio`'s assertion; with
    /// prefill blocks larger, prefill writes sub-blocks that are head slices, not token
    /// slices, and the decode worker fails the same assertion when the request completes),
    /// and layouts must be equal (nobody permutes in push: the receive-side permute of pull
    /// runs on the decode side, which in push never validates or post-processes layouts).
    pub fn validate_push(&self) -> Result<PushRankMap, KnobError> {
        check_model(&self.model)?;
        check_engine(&self.p, Role::Prefill, self.version)?;
        check_engine(&self.d, Role::Decode, self.version)?;
        let map = push_rank_map(&self.tp_spec())?;
        let (pb, db) = (self.p.block_tokens, self.d.block_tokens);
        if pb != db {
            let what = if db > pb {
                format!(
                    "the prefill side's handshake with decode fails vLLM's assertion \"Local block size {pb} is not \
                     divisible by remote block size {db} or vice versa.\", so nothing is written and the request \
                     waits out its lease"
                )
            } else {
                format!(
                    "prefill would write each {pb}-token block as {} sub-blocks that are head slices, not token \
                     slices, and the decode worker fails the assertion \"Local block size {db} is not divisible by \
                     remote block size {pb} or vice versa.\" when the request completes",
                    pb / db.max(1)
                )
            };
            return Err(KnobError::new(
                Knob::DBlockSize,
                format!(
                    "push mode needs equal block sizes, but prefill uses {pb} tokens and decode {db}: {what}; \
                     use the same {} on both sides, or {} pull (which reads smaller prefill blocks \
                     into larger decode blocks)",
                    Knob::BlockSize,
                    Knob::Mode,
                ),
            ));
        }
        let (pl, dl) = (self.p.layout, self.d.layout);
        let mla = self.model.is_mla();
        if pl != dl && !mla && self.permute {
            return Err(KnobError::new(
                Knob::Permute,
                format!(
                    "push mode cannot permute layouts: vLLM permutes received blocks on the receiving side, and in \
                     push the decode side never validates or post-processes layouts (prefill {pl} into decode {dl} \
                     is either refused by the prefill side or written unpermuted); drop {} and use one layout",
                    Knob::Permute,
                ),
            ));
        }
        if pl != dl && !mla {
            return Err(KnobError::new(
                Knob::DLayout,
                format!(
                    "prefill layout {pl} differs from decode layout {dl}; vLLM's push connector checks on the prefill \
                     side: \"Heterogeneous TP expects same kv_cache_layout (local {}, remote {}).\" Use {pl} on the \
                     decode side",
                    pl.vllm_name(),
                    dl.vllm_name()
                ),
            ));
        }
        // The prefill side exempts a *replicated decode* engine (its remote), not a
        // replicated prefill engine as pull does.
        let hetero = map.tp_ratio.abs() != 1;
        let d_replicated = self.d.tp > map.spec.effective_heads();
        if hetero && !mla && !d_replicated && !pl.heads_contiguous() {
            return Err(KnobError::new(
                Knob::Layout,
                format!(
                    "heterogeneous TP ({} -> {}) splits heads inside each block, but {pl} does not keep a block's heads \
                     contiguous; vLLM: \"Heterogeneous TP head-dimension splitting requires contiguous heads. Use a \
                     block-contiguous layout (e.g. LBHNC) on the prefill side.\" Use {}",
                    self.p.tp,
                    self.d.tp,
                    pl.hnd_counterpart()
                ),
            ));
        }
        self.check_block_lens(map.p_heads_per_rank, map.d_heads_per_rank)?;
        Ok(map)
    }

    fn check_layouts(&self, map: &RankMap) -> Result<(), KnobError> {
        let (pl, dl) = (self.p.layout, self.d.layout);
        let mla = self.model.is_mla();
        if mla && matches!(pl, Layout::FaCrossLayers | Layout::FiCrossLayers) {
            return Err(KnobError::new(
                Knob::Layout,
                "vLLM 0.19 cross-layer blocks exist only for FlashAttention/FlashInfer, not MLA; drop the cross-layer layout",
            ));
        }
        let backend = |l: Layout| match l {
            Layout::FaHnd | Layout::FaNhd | Layout::FaCrossLayers => Some("FLASH_ATTN"),
            Layout::FiHnd | Layout::FiNhd | Layout::FiCrossLayers => Some("FLASHINFER"),
            _ => None,
        };
        if !mla && backend(pl) != backend(dl) {
            return Err(KnobError::new(
                Knob::DLayout,
                format!(
                    "prefill uses {} and decode {}: different attention backends ({} vs {}) change vLLM's compatibility hash, \
                     so the handshake is refused; use the same backend on both sides",
                    pl,
                    dl,
                    backend(pl).unwrap_or("?"),
                    backend(dl).unwrap_or("?")
                ),
            ));
        }
        let permute_ok = self.permute && is_permute_pair(pl, dl);
        if pl != dl && !mla && !permute_ok {
            let hint = if is_permute_pair(pl, dl) {
                format!(
                    " or pass {} (vLLM's enable_permute_local_kv) to receive HND into the local NHD cache",
                    Knob::Permute
                )
            } else {
                format!(" or use {pl} on the decode side")
            };
            return Err(KnobError::new(
                Knob::DLayout,
                format!(
                    "prefill layout {pl} differs from decode layout {dl}; vLLM: \"Heterogeneous TP expects same \
                     kv_cache_layout (local {}, remote {}).\"{hint}",
                    dl.vllm_name(),
                    pl.vllm_name()
                ),
            ));
        }
        if self.permute && !is_permute_pair(pl, dl) && pl != dl {
            return Err(KnobError::new(
                Knob::Permute,
                format!(
                    "{} only receives HND (prefill) into NHD (decode); prefill is {pl}, decode is {dl}",
                    Knob::Permute
                ),
            ));
        }
        let spec = map.spec;
        let hetero = map.tp_ratio.abs() != 1;
        if hetero && !mla && !spec.prefill_replicated() && !permute_ok {
            for (layout, knob) in [(dl, Knob::DLayout), (pl, Knob::PLayout)] {
                if !layout.heads_contiguous() {
                    let why = if self.version == VllmVersion::V0_19 {
                        " (vLLM 0.19.1 accepts this and splits each block's bytes in halves, which in NHD are token \
                         halves, not head halves: silently wrong KV)"
                    } else {
                        ""
                    };
                    return Err(KnobError::new(
                        knob,
                        format!(
                            "heterogeneous TP ({} -> {}) splits heads inside each block, but {layout} does not keep a \
                             block's heads contiguous{why}; vLLM: \"Heterogeneous TP head-dimension splitting requires \
                             contiguous heads. Use a block-contiguous layout (e.g. LBHNC) on the prefill side.\" Use {}",
                            spec.p_tp,
                            spec.d_tp,
                            layout.hnd_counterpart()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// vLLM's block-length invariants between the two sides' regions, given the KV heads
    /// each side's ranks hold.
    fn check_block_lens(&self, p_heads_per_rank: u32, d_heads_per_rank: u32) -> Result<(), KnobError> {
        let (pg, dg) = (self.p_geometry(0), self.d_geometry(0));
        let (pr, dr) = (pg.regions(), dg.regions());
        if pr.len() != dr.len() {
            return Err(KnobError::new(
                Knob::DLayout,
                format!(
                    "prefill registers {} regions per rank ({}) and decode {} ({}); vLLM: \"Number of KV layers must \
                     match between prefill and decode\"",
                    pr.len(),
                    self.p.layout,
                    dr.len(),
                    self.d.layout
                ),
            ));
        }
        let bsr = u64::from(self.block_size_ratio());
        let (hp, hd) = (u64::from(p_heads_per_rank), u64::from(d_heads_per_rank));
        for (p, d) in pr.iter().zip(&dr) {
            // local_len // bsr == remote_len scaled by the heads each side holds.
            let expect_remote = d.block_len * hp / hd / bsr;
            if p.block_len != expect_remote {
                return Err(KnobError::new(
                    Knob::DLayout,
                    format!(
                        "region {}: prefill block is {} bytes but decode expects {} ({} heads x {} tokens); the two \
                         layouts do not describe the same blocks",
                        p.name, p.block_len, expect_remote, hp, self.p.block_tokens
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The one layout mismatch vLLM can bridge: remote HND into local NHD.
fn is_permute_pair(p: Layout, d: Layout) -> bool {
    matches!((p, d), (Layout::Lbhnc, Layout::Lbnhc) | (Layout::FaHnd, Layout::FaNhd))
}

fn check_model(m: &ModelShape) -> Result<(), KnobError> {
    if m.num_layers == 0 || m.num_layers > MAX_LAYERS {
        return Err(KnobError::new(
            Knob::Layers,
            format!("number of layers must be between 1 and {MAX_LAYERS}, got {}", m.num_layers),
        ));
    }
    if !m.is_mla() && (m.head_dim == 0 || m.head_dim > 65_536) {
        return Err(KnobError::new(
            Knob::HeadDim,
            format!("head dimension must be between 1 and 65536, got {}", m.head_dim),
        ));
    }
    if let Some(mla) = m.mla
        && (mla.head_size() == 0 || mla.head_size() > 65_536)
    {
        return Err(KnobError::new(
            Knob::Mla,
            format!(
                "MLA latent size kv_lora_rank + qk_rope_head_dim must be 1..65536, got {}",
                mla.head_size()
            ),
        ));
    }
    Ok(())
}

/// One engine's own ranges: block size, pool, and a layout of the vLLM release in force.
fn check_engine(e: &EngineSpec, role: Role, version: VllmVersion) -> Result<(), KnobError> {
    if e.block_tokens == 0 || e.block_tokens > MAX_BLOCK_TOKENS {
        return Err(KnobError::new(
            Knob::block_size(role),
            format!("block size must be between 1 and {MAX_BLOCK_TOKENS} tokens, got {}", e.block_tokens),
        ));
    }
    if e.num_blocks == 0 {
        return Err(KnobError::new(Knob::num_blocks(role), "a pool needs at least 1 block"));
    }
    if e.layout.version() != version {
        return Err(KnobError::new(
            Knob::layout(role),
            format!(
                "layout {} belongs to vLLM {}, but the rules in force are vLLM {version} ({}); pick a {version} layout",
                e.layout,
                e.layout.version(),
                Knob::Vllm,
            ),
        ));
    }
    Ok(())
}
