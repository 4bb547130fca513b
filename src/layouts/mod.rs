//! KV cache layouts, the regions a rank registers, per-request descriptor plans, and the
//! byte pattern that makes every transferred byte checkable.
//!
//! Pure arithmetic over plain data (no I/O, no FFI): `geometry` says where each block of
//! each region lives in a rank's allocation and what it holds; `compat` decides whether a
//! P/D pair can talk (vLLM's handshake-time validation); `plan` turns a request's block
//! ids into (local offset, remote offset, length) descriptor pairs in vLLM's posting order,
//! and coalesces them; `push` does the same for push mode (prefill WRITEs, so local is the
//! prefill rank); `pattern` fills and verifies blocks; `posting` says what posting a plan's
//! descriptors costs on each transport (the post-bound check of `kvx plan`), with `rates` reading
//! its rates from results files; `predict` is the fitted transfer-time model (fixed, per
//! descriptor, byte rate, readers at once) that `kvx calibrate` fits and `kvx plan` and `kvx
//! bench` predict with; `request` plans `kvx plan`'s request whole (uniform or hybrid,
//! pull or push) into one typed answer, and `rank_maps` maps `kvx topo`'s pair the same way.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod compat;
pub mod geometry;
pub mod hybrid;
pub mod model_config;
pub mod pattern;
pub mod posting;
pub mod predict;
pub mod rank_maps;
pub mod rates;
pub mod read_plan;
pub mod request;
pub mod verify;
pub mod write_plan;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::topology::VllmVersion;

pub use geometry::{Axis, BlockContent, EngineSpec, RankGeometry, Region};

/// A KV cache layout.
///
/// vLLM 0.33 names a stride permutation of the logical axes `[L, B, H, N, C]` (layer, block,
/// head, token, cell bytes with K and V packed), outermost first. vLLM 0.19.1 keeps K and V
/// as separate regions and names only HND/NHD, per attention backend, plus cross-layer
/// blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Layout {
    /// 0.33 `LBHNC` (= HND, NIXL's default): per layer, per block, heads then tokens.
    Lbhnc,
    /// 0.33 `LBNHC` (= NHD): per layer, per block, tokens then heads.
    Lbnhc,
    /// 0.33 `LHBNC`: heads outside blocks.
    Lhbnc,
    /// 0.33 `BLHNC`: block-outermost, all layers of a block contiguous (cross-layer).
    Blhnc,
    /// 0.33 `BLNHC`: block-outermost, tokens before heads.
    Blnhc,
    /// 0.33 `BHLNC`: block-outermost, heads outside layers.
    Bhlnc,
    /// 0.19 FlashAttention `(2, B, H, N, D)` per layer: K and V separate regions.
    FaHnd,
    /// 0.19 FlashAttention `(2, B, N, H, D)` per layer.
    FaNhd,
    /// 0.19 FlashInfer `(B, 2, H, N, D)` per layer: blocks first, K/V halves of each block.
    FiHnd,
    /// 0.19 FlashInfer `(B, 2, N, H, D)` per layer.
    FiNhd,
    /// 0.19 FlashAttention cross-layer blocks `(B, H, L, 2, N, D)`: one region.
    FaCrossLayers,
    /// 0.19 FlashInfer cross-layer blocks `(B, 2, H, L, N, D)`: K and V halves.
    FiCrossLayers,
}

impl Layout {
    pub const ALL: [Layout; 12] = [
        Layout::Lbhnc,
        Layout::Lbnhc,
        Layout::Lhbnc,
        Layout::Blhnc,
        Layout::Blnhc,
        Layout::Bhlnc,
        Layout::FaHnd,
        Layout::FaNhd,
        Layout::FiHnd,
        Layout::FiNhd,
        Layout::FaCrossLayers,
        Layout::FiCrossLayers,
    ];

    /// The name kvx prints and accepts.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Lbhnc => "LBHNC",
            Layout::Lbnhc => "LBNHC",
            Layout::Lhbnc => "LHBNC",
            Layout::Blhnc => "BLHNC",
            Layout::Blnhc => "BLNHC",
            Layout::Bhlnc => "BHLNC",
            Layout::FaHnd => "FA-HND",
            Layout::FaNhd => "FA-NHD",
            Layout::FiHnd => "FI-HND",
            Layout::FiNhd => "FI-NHD",
            Layout::FaCrossLayers => "FA-HND-XL",
            Layout::FiCrossLayers => "FI-HND-XL",
        }
    }

    /// The string vLLM itself uses for `kv_cache_layout` (handshake metadata).
    pub fn vllm_name(self) -> &'static str {
        match self {
            Layout::FaHnd | Layout::FiHnd | Layout::FaCrossLayers | Layout::FiCrossLayers => "HND",
            Layout::FaNhd | Layout::FiNhd => "NHD",
            other => other.name(),
        }
    }

    /// Which vLLM release this layout belongs to.
    pub fn version(self) -> VllmVersion {
        match self {
            Layout::Lbhnc | Layout::Lbnhc | Layout::Lhbnc | Layout::Blhnc | Layout::Blnhc | Layout::Bhlnc => {
                VllmVersion::V0_33
            }
            _ => VllmVersion::V0_19,
        }
    }

    /// One-line description for tables and help.
    pub fn describe(self) -> &'static str {
        match self {
            Layout::Lbhnc => "layer-outer, heads before tokens (HND); NIXL's default",
            Layout::Lbnhc => "layer-outer, tokens before heads (NHD)",
            Layout::Lhbnc => "layer-outer, heads outside blocks",
            Layout::Blhnc => "block-outer (all layers of a block contiguous), HND pages",
            Layout::Blnhc => "block-outer, NHD pages",
            Layout::Bhlnc => "block-outer, heads outside layers (one region per block row)",
            Layout::FaHnd => "0.19 FlashAttention HND, K and V separate regions",
            Layout::FaNhd => "0.19 FlashAttention NHD, K and V separate regions",
            Layout::FiHnd => "0.19 FlashInfer HND, K/V halves of each block",
            Layout::FiNhd => "0.19 FlashInfer NHD, K/V halves of each block",
            Layout::FaCrossLayers => "0.19 FlashAttention cross-layer blocks (one region)",
            Layout::FiCrossLayers => "0.19 FlashInfer cross-layer blocks (K/V halves)",
        }
    }

    /// Whether a TP head slice of one block is a contiguous byte range, by vLLM's rule:
    /// 0.33 accepts only LBHNC and BLHNC (`is_block_contiguous`); kvx also requires HND for
    /// 0.19 (vLLM 0.19.1 accepted NHD and read token halves instead of head halves).
    pub fn heads_contiguous(self) -> bool {
        matches!(
            self,
            Layout::Lbhnc
                | Layout::Blhnc
                | Layout::FaHnd
                | Layout::FiHnd
                | Layout::FaCrossLayers
                | Layout::FiCrossLayers
        )
    }

    /// Whether the block index is the outermost axis (all layers of a block together).
    pub fn block_outer(self) -> bool {
        matches!(
            self,
            Layout::Blhnc | Layout::Blnhc | Layout::Bhlnc | Layout::FaCrossLayers | Layout::FiCrossLayers
        )
    }

    /// The same layout in HND order where one exists (used in hints).
    pub fn hnd_counterpart(self) -> Layout {
        match self {
            Layout::Lbnhc | Layout::Lhbnc => Layout::Lbhnc,
            Layout::Blnhc | Layout::Bhlnc => Layout::Blhnc,
            Layout::FaNhd => Layout::FaHnd,
            Layout::FiNhd => Layout::FiHnd,
            other => other,
        }
    }

    /// Parses a layout name in the context of a vLLM version: `HND`/`NHD` mean LBHNC/LBNHC
    /// for 0.33 (as `VLLM_KV_CACHE_LAYOUT` accepts) and the FlashAttention layouts for 0.19.
    pub fn parse_for(s: &str, version: VllmVersion) -> Result<Layout, String> {
        let norm = s.trim().to_ascii_uppercase().replace('_', "-");
        let layout = match (norm.as_str(), version) {
            ("HND", VllmVersion::V0_33) => Layout::Lbhnc,
            ("NHD", VllmVersion::V0_33) => Layout::Lbnhc,
            ("HND", VllmVersion::V0_19) => Layout::FaHnd,
            ("NHD", VllmVersion::V0_19) => Layout::FaNhd,
            _ => norm.parse::<Layout>()?,
        };
        if layout.version() != version {
            let hint = match version {
                VllmVersion::V0_33 => {
                    "vLLM 0.33 layouts are LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC (cross-layer blocks are the block-outer ones)"
                }
                VllmVersion::V0_19 => {
                    "vLLM 0.19 layouts are HND, NHD, FA-HND, FA-NHD, FI-HND, FI-NHD, FA-HND-XL, FI-HND-XL"
                }
            };
            return Err(format!("layout {} is not a vLLM {version} layout; {hint}", layout.name()));
        }
        Ok(layout)
    }

    /// The default layout of a vLLM version (what NIXL asks for).
    pub fn default_for(version: VllmVersion) -> Layout {
        match version {
            VllmVersion::V0_33 => Layout::Lbhnc,
            VllmVersion::V0_19 => Layout::FaHnd,
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_uppercase().replace('_', "-");
        let found = match norm.as_str() {
            "FLASHATTN-HND" | "FLASH-ATTN-HND" => Some(Layout::FaHnd),
            "FLASHATTN-NHD" | "FLASH-ATTN-NHD" => Some(Layout::FaNhd),
            "FLASHINFER-HND" => Some(Layout::FiHnd),
            "FLASHINFER-NHD" => Some(Layout::FiNhd),
            "FA-XL" | "FA-CROSS-LAYERS" | "CROSS-LAYERS" => Some(Layout::FaCrossLayers),
            "FI-XL" | "FI-CROSS-LAYERS" => Some(Layout::FiCrossLayers),
            _ => Layout::ALL.iter().copied().find(|l| l.name() == norm),
        };
        found.ok_or_else(|| {
            format!(
                "unknown layout '{s}'; expected one of: HND, NHD, {}",
                Layout::ALL.iter().map(|l| l.name()).collect::<Vec<_>>().join(", ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for l in Layout::ALL {
            assert_eq!(l.name().parse::<Layout>(), Ok(l));
        }
        assert_eq!(Layout::parse_for("hnd", VllmVersion::V0_33), Ok(Layout::Lbhnc));
        assert_eq!(Layout::parse_for("NHD", VllmVersion::V0_19), Ok(Layout::FaNhd));
        assert!(Layout::parse_for("LBHNC", VllmVersion::V0_19).is_err());
    }
}
