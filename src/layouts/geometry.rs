//! Where each block of a rank's KV cache lives and what it holds.
//!
//! A rank owns one allocation (vLLM 0.33: one backing tensor; 0.19.1: per-layer tensors,
//! laid end to end here). It registers *regions* with NIXL: `(base, block_len,
//! block_stride, num_blocks)`; block `b` of a region is the byte range
//! `[base + b*stride, base + b*stride + block_len)`. Each region's block holds a small
//! row-major tensor described by `BlockContent`, which is what lets kvx verify that a byte
//! holds the head, layer, K/V half and token the rank map promised.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::Layout;
use crate::topology::{self, VllmVersion};
use crate::vocab::model::ModelShape;

/// Per-engine settings that shape each rank's cache (one KV cache group; a hybrid model's
/// engine is a [`HybridEngineSpec`](crate::layouts::hybrid::HybridEngineSpec)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineSpec {
    pub tp: u32,
    /// Tokens per block (vLLM `block_size`).
    pub block_tokens: u32,
    /// Blocks in each rank's pool.
    pub num_blocks: u32,
    pub layout: Layout,
}

/// Logical axes of a block's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Axis {
    Layer,
    Head,
    Token,
    /// K (0) or V (1).
    Kv,
    /// A decode sub-block when decode blocks are `r` prefill blocks long; adds
    /// `index * tokens_per_sub_block` to the token.
    SubBlock,
    /// The bytes of one K or V vector of one head and token (the latent for MLA).
    Bytes,
}

impl Axis {
    pub fn letter(self) -> &'static str {
        match self {
            Axis::Layer => "L",
            Axis::Head => "H",
            Axis::Token => "N",
            Axis::Kv => "KV",
            Axis::SubBlock => "R",
            Axis::Bytes => "bytes",
        }
    }
}

/// The logical coordinate of one K/V vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VecCoord {
    pub layer: u32,
    /// Head index local to the rank.
    pub head: u32,
    /// Token index inside the block.
    pub token: u32,
    pub kv: u32,
}

/// What one block of a region holds: a row-major tensor over `axes` (outermost first,
/// always ending in `Bytes`), with the coordinates the region fixes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockContent {
    pub layer: Option<u32>,
    pub head: Option<u32>,
    pub kv: Option<u32>,
    pub axes: Vec<(Axis, u32)>,
}

impl BlockContent {
    /// Bytes of one block.
    pub fn len(&self) -> u64 {
        self.axes.iter().map(|&(_, n)| u64::from(n)).product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of one vector (the innermost axis).
    pub fn vec_bytes(&self) -> u32 {
        self.axes.last().map_or(0, |&(_, n)| n)
    }

    /// Calls `f(offset_in_block, coord)` for every vector in memory order.
    pub fn for_each_vector(&self, mut f: impl FnMut(u64, VecCoord)) {
        let outer = &self.axes[..self.axes.len().saturating_sub(1)];
        let vec_bytes = u64::from(self.vec_bytes());
        let count: u64 = outer.iter().map(|&(_, n)| u64::from(n)).product();
        let tokens_per_sub = outer.iter().find(|(a, _)| *a == Axis::Token).map_or(1, |&(_, n)| n);
        let mut idx = vec![0u32; outer.len()];
        for v in 0..count {
            let mut c = VecCoord {
                layer: self.layer.unwrap_or(0),
                head: self.head.unwrap_or(0),
                token: 0,
                kv: self.kv.unwrap_or(0),
            };
            for (&(axis, _), &i) in outer.iter().zip(&idx) {
                match axis {
                    Axis::Layer => c.layer = i,
                    Axis::Head => c.head = i,
                    Axis::Token => c.token += i,
                    Axis::Kv => c.kv = i,
                    Axis::SubBlock => c.token += i * tokens_per_sub,
                    Axis::Bytes => {}
                }
            }
            f(v * vec_bytes, c);
            // Advance the odometer, innermost outer axis first.
            for k in (0..outer.len()).rev() {
                idx[k] += 1;
                if idx[k] < outer[k].1 {
                    break;
                }
                idx[k] = 0;
            }
        }
    }

    /// The shape as text, e.g. `[H=8, N=16, KV=2, D=256]`.
    pub fn shape_string(&self) -> String {
        let inner: Vec<String> = self.axes.iter().map(|(a, n)| format!("{}={n}", a.letter())).collect();
        format!("[{}]", inner.join(", "))
    }
}

/// One region a rank registers with NIXL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Region {
    pub name: String,
    /// Offset of block 0 from the rank's allocation base.
    pub base_off: u64,
    pub block_len: u64,
    pub block_stride: u64,
    pub num_blocks: u64,
    pub content: BlockContent,
}

impl Region {
    /// Offset of block `b` from the rank's allocation base.
    pub fn block_off(&self, b: u64) -> u64 {
        self.base_off + b * self.block_stride
    }
}

/// The cache geometry of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankGeometry {
    pub layout: Layout,
    pub num_layers: u32,
    /// KV heads this rank holds (1 for MLA).
    pub heads: u32,
    /// Global KV heads of this rank's local heads (for MLA: `0..1`).
    pub global_heads: Range<u32>,
    pub block_tokens: u32,
    pub num_blocks: u32,
    /// Bytes of one K or V vector of one head and token; for MLA the whole latent vector.
    pub vec_bytes: u32,
    pub mla: bool,
}

impl RankGeometry {
    /// The geometry of rank `rank` of an engine.
    pub fn new(model: &ModelShape, engine: &EngineSpec, rank: u32) -> Self {
        let mla = model.is_mla();
        let total_heads = if mla { 1 } else { model.num_kv_heads };
        // Saturating: callers size pools from a geometry before `PairSpec::validate` refuses
        // an out-of-range head (a hostile head dimension must be refused, not overflow here).
        let vec_bytes = match model.mla {
            Some(m) => m.head_size().saturating_mul(model.dtype.bytes()),
            None => model.head_dim.saturating_mul(model.dtype.bytes()),
        };
        RankGeometry {
            layout: engine.layout,
            num_layers: model.num_layers,
            heads: topology::heads_per_rank(total_heads, engine.tp),
            global_heads: topology::rank_heads(total_heads, engine.tp, rank),
            block_tokens: engine.block_tokens,
            num_blocks: engine.num_blocks,
            vec_bytes,
            mla,
        }
    }

    /// K and V (2) or one latent vector (1).
    pub fn kv_parts(&self) -> u32 {
        if self.mla { 1 } else { 2 }
    }

    /// Bytes of one layer of one block (K and V together): vLLM's page size.
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.heads)
            * u64::from(self.block_tokens)
            * u64::from(self.kv_parts())
            * u64::from(self.vec_bytes)
    }

    /// Bytes of one block over all layers.
    pub fn block_bytes_all_layers(&self) -> u64 {
        self.page_bytes() * u64::from(self.num_layers)
    }

    /// Bytes of the rank's whole allocation, or `None` where it does not fit in 64 bits.
    pub fn checked_total_bytes(&self) -> Option<u64> {
        u64::from(self.heads)
            .checked_mul(u64::from(self.block_tokens))?
            .checked_mul(u64::from(self.kv_parts()))?
            .checked_mul(u64::from(self.vec_bytes))?
            .checked_mul(u64::from(self.num_layers))?
            .checked_mul(u64::from(self.num_blocks))
    }

    /// Bytes of the rank's whole allocation (pairs are validated to keep it within
    /// `compat::MAX_POOL_BYTES`).
    pub fn total_bytes(&self) -> u64 {
        self.block_bytes_all_layers() * u64::from(self.num_blocks)
    }

    /// Bytes of KV cache per token on this rank.
    pub fn bytes_per_token(&self) -> u64 {
        self.block_bytes_all_layers() / u64::from(self.block_tokens.max(1))
    }

    /// The regions this rank registers, in descriptor-id order.
    pub fn regions(&self) -> Vec<Region> {
        match self.layout.version() {
            VllmVersion::V0_33 => self.regions_v033(),
            VllmVersion::V0_19 => self.regions_v019(),
        }
    }

    /// The physical axes of the allocation, outermost first, with sizes and byte strides.
    pub fn physical_axes(&self) -> Vec<(&'static str, u64, u64)> {
        let (l, b, h, n) = (
            u64::from(self.num_layers),
            u64::from(self.num_blocks),
            u64::from(self.heads),
            u64::from(self.block_tokens),
        );
        let d = u64::from(self.vec_bytes);
        let c = d * u64::from(self.kv_parts());
        let dims: Vec<(&'static str, u64)> = match self.layout {
            Layout::Lbhnc => vec![("L", l), ("B", b), ("H", h), ("N", n), ("C", c)],
            Layout::Lbnhc => vec![("L", l), ("B", b), ("N", n), ("H", h), ("C", c)],
            Layout::Lhbnc => vec![("L", l), ("H", h), ("B", b), ("N", n), ("C", c)],
            Layout::Blhnc => vec![("B", b), ("L", l), ("H", h), ("N", n), ("C", c)],
            Layout::Blnhc => vec![("B", b), ("L", l), ("N", n), ("H", h), ("C", c)],
            Layout::Bhlnc => vec![("B", b), ("H", h), ("L", l), ("N", n), ("C", c)],
            _ if self.mla => vec![("L", l), ("B", b), ("N", n), ("D", d)],
            Layout::FaHnd => vec![("L", l), ("KV", 2), ("B", b), ("H", h), ("N", n), ("D", d)],
            Layout::FaNhd => vec![("L", l), ("KV", 2), ("B", b), ("N", n), ("H", h), ("D", d)],
            Layout::FiHnd => vec![("L", l), ("B", b), ("KV", 2), ("H", h), ("N", n), ("D", d)],
            Layout::FiNhd => vec![("L", l), ("B", b), ("KV", 2), ("N", n), ("H", h), ("D", d)],
            Layout::FaCrossLayers => vec![("B", b), ("H", h), ("L", l), ("KV", 2), ("N", n), ("D", d)],
            Layout::FiCrossLayers => vec![("B", b), ("KV", 2), ("H", h), ("L", l), ("N", n), ("D", d)],
        };
        let mut stride = 1u64;
        let mut out: Vec<(&'static str, u64, u64)> = dims
            .iter()
            .rev()
            .map(|&(name, size)| {
                let s = stride;
                stride *= size;
                (name, size, s)
            })
            .collect();
        out.reverse();
        out
    }

    /// The memory registrations vLLM makes for this rank: `(offset, bytes)`.
    pub fn registrations(&self) -> Vec<(u64, u64)> {
        match self.layout.version() {
            VllmVersion::V0_33 => vec![(0, self.total_bytes())],
            VllmVersion::V0_19 => {
                let regions = self.regions();
                match self.layout {
                    // Blocks-first and cross-layer tensors are registered once per tensor.
                    Layout::FiHnd | Layout::FiNhd if !self.mla => regions
                        .chunks(2)
                        .map(|kv| (kv[0].base_off, kv[0].num_blocks * kv[0].block_stride))
                        .collect(),
                    Layout::FiCrossLayers => vec![(0, self.total_bytes())],
                    _ => regions.iter().map(|r| (r.base_off, r.num_blocks * r.block_stride)).collect(),
                }
            }
        }
    }

    fn layer_name(l: u32) -> String {
        format!("model.layers.{l}.self_attn.attn")
    }

    /// Heads (when there are several) and tokens of a block, in the layout's order: heads
    /// first for HND, tokens first for NHD.
    fn head_token_axes(&self, hnd: bool) -> Vec<(Axis, u32)> {
        let mut axes = Vec::with_capacity(4);
        let heads = (self.heads > 1).then_some((Axis::Head, self.heads));
        let tokens = (Axis::Token, self.block_tokens);
        if hnd {
            axes.extend(heads);
            axes.push(tokens);
        } else {
            axes.push(tokens);
            axes.extend(heads);
        }
        axes
    }

    /// The tokens-and-bytes tail of a page, in the layout's head/token order.
    fn page_axes(&self, hnd: bool) -> Vec<(Axis, u32)> {
        let mut axes = self.head_token_axes(hnd);
        if !self.mla {
            axes.push((Axis::Kv, 2));
        }
        axes.push((Axis::Bytes, self.vec_bytes));
        axes
    }

    /// vLLM 0.33: one backing allocation; regions per the layout's stride order.
    fn regions_v033(&self) -> Vec<Region> {
        let page = self.page_bytes();
        let (nl, nb) = (u64::from(self.num_layers), u64::from(self.num_blocks));
        let hnd = matches!(self.layout, Layout::Lbhnc | Layout::Blhnc | Layout::Lhbnc | Layout::Bhlnc);
        let per_layer = |stride: u64, layer_step: u64| -> Vec<Region> {
            (0..self.num_layers)
                .map(|l| Region {
                    name: Self::layer_name(l),
                    base_off: u64::from(l) * layer_step,
                    block_len: page,
                    block_stride: stride,
                    num_blocks: nb,
                    content: BlockContent { layer: Some(l), head: None, kv: None, axes: self.page_axes(hnd) },
                })
                .collect()
        };
        let whole_row = |axes: Vec<(Axis, u32)>| -> Vec<Region> {
            vec![Region {
                name: Self::layer_name(0),
                base_off: 0,
                block_len: nl * page,
                block_stride: nl * page,
                num_blocks: nb,
                content: BlockContent { layer: None, head: None, kv: None, axes },
            }]
        };
        match self.layout {
            Layout::Lbhnc | Layout::Lbnhc => per_layer(page, nb * page),
            Layout::Lhbnc if self.heads <= 1 => per_layer(page, nb * page),
            Layout::Lhbnc => {
                // Heads outside blocks: each (layer, head) is its own run of blocks.
                let head_block = page / u64::from(self.heads);
                let mut out = Vec::with_capacity((self.num_layers * self.heads) as usize);
                for l in 0..self.num_layers {
                    for h in 0..self.heads {
                        let mut axes = vec![(Axis::Token, self.block_tokens)];
                        if !self.mla {
                            axes.push((Axis::Kv, 2));
                        }
                        axes.push((Axis::Bytes, self.vec_bytes));
                        out.push(Region {
                            name: format!("{}.head{h}", Self::layer_name(l)),
                            base_off: u64::from(l) * nb * page + u64::from(h) * nb * head_block,
                            block_len: head_block,
                            block_stride: head_block,
                            num_blocks: nb,
                            content: BlockContent { layer: Some(l), head: Some(h), kv: None, axes },
                        });
                    }
                }
                out
            }
            // MLA caches in a block-outer layout are one packed row per block.
            Layout::Blhnc | Layout::Blnhc | Layout::Bhlnc if self.mla => {
                let mut axes = vec![(Axis::Layer, self.num_layers)];
                axes.extend(self.page_axes(true));
                whole_row(axes)
            }
            Layout::Blhnc | Layout::Blnhc => per_layer(nl * page, page),
            Layout::Bhlnc if self.heads <= 1 => per_layer(nl * page, page),
            Layout::Bhlnc => {
                let mut axes = vec![
                    (Axis::Head, self.heads),
                    (Axis::Layer, self.num_layers),
                    (Axis::Token, self.block_tokens),
                ];
                axes.push((Axis::Kv, 2));
                axes.push((Axis::Bytes, self.vec_bytes));
                whole_row(axes)
            }
            _ => unreachable_v019(),
        }
    }

    /// vLLM 0.19.1: K and V separate (FlashAttention), K/V halves of blocks-first tensors
    /// (FlashInfer), one latent region per layer (MLA), or one cross-layer tensor.
    fn regions_v019(&self) -> Vec<Region> {
        let nb = u64::from(self.num_blocks);
        let heads = (self.heads > 1).then_some((Axis::Head, self.heads));
        let hn = |hnd: bool| -> Vec<(Axis, u32)> {
            let mut axes = self.head_token_axes(hnd);
            axes.push((Axis::Bytes, self.vec_bytes));
            axes
        };
        // Bytes of one K (or V) block of one layer.
        let half = u64::from(self.heads) * u64::from(self.block_tokens) * u64::from(self.vec_bytes);
        if self.mla {
            let page = u64::from(self.block_tokens) * u64::from(self.vec_bytes);
            return (0..self.num_layers)
                .map(|l| Region {
                    name: Self::layer_name(l),
                    base_off: u64::from(l) * nb * page,
                    block_len: page,
                    block_stride: page,
                    num_blocks: nb,
                    content: BlockContent {
                        layer: Some(l),
                        head: None,
                        kv: Some(0),
                        axes: vec![(Axis::Token, self.block_tokens), (Axis::Bytes, self.vec_bytes)],
                    },
                })
                .collect();
        }
        let kv_name =
            |l: u32, kv: u32| format!("{}.{}", Self::layer_name(l), if kv == 0 { "k" } else { "v" });
        match self.layout {
            Layout::FaHnd | Layout::FaNhd | Layout::FiHnd | Layout::FiNhd => {
                let hnd = matches!(self.layout, Layout::FaHnd | Layout::FiHnd);
                // FlashAttention: one tensor per layer and K/V; FlashInfer: K and V
                // interleaved in each block of one tensor per layer.
                let fi = matches!(self.layout, Layout::FiHnd | Layout::FiNhd);
                (0..self.num_layers * 2)
                    .map(|i| {
                        let (layer, kv) = (i / 2, i % 2);
                        let (base_off, block_stride) = if fi {
                            (u64::from(layer) * nb * 2 * half + u64::from(kv) * half, 2 * half)
                        } else {
                            (u64::from(i) * nb * half, half)
                        };
                        Region {
                            name: kv_name(layer, kv),
                            base_off,
                            block_len: half,
                            block_stride,
                            num_blocks: nb,
                            content: BlockContent {
                                layer: Some(layer),
                                head: None,
                                kv: Some(kv),
                                axes: hn(hnd),
                            },
                        }
                    })
                    .collect()
            }
            Layout::FaCrossLayers => {
                let row = 2 * half * u64::from(self.num_layers);
                let mut axes: Vec<(Axis, u32)> = heads.into_iter().collect();
                axes.push((Axis::Layer, self.num_layers));
                axes.push((Axis::Kv, 2));
                axes.push((Axis::Token, self.block_tokens));
                axes.push((Axis::Bytes, self.vec_bytes));
                vec![Region {
                    name: "cross_layers".to_string(),
                    base_off: 0,
                    block_len: row,
                    block_stride: row,
                    num_blocks: nb,
                    content: BlockContent { layer: None, head: None, kv: None, axes },
                }]
            }
            Layout::FiCrossLayers => {
                let kv_row = half * u64::from(self.num_layers);
                (0..2)
                    .map(|kv| {
                        let mut axes: Vec<(Axis, u32)> = heads.into_iter().collect();
                        axes.push((Axis::Layer, self.num_layers));
                        axes.push((Axis::Token, self.block_tokens));
                        axes.push((Axis::Bytes, self.vec_bytes));
                        Region {
                            name: format!("cross_layers.{}", if kv == 0 { "k" } else { "v" }),
                            base_off: u64::from(kv) * kv_row,
                            block_len: kv_row,
                            block_stride: 2 * kv_row,
                            num_blocks: nb,
                            content: BlockContent { layer: None, head: None, kv: Some(kv), axes },
                        }
                    })
                    .collect()
            }
            _ => unreachable_v033(),
        }
    }
}

// The two region builders are selected by `Layout::version`, so each only sees its own
// release's layouts; these keep the match exhaustive without a panic path.
fn unreachable_v019() -> Vec<Region> {
    Vec::new()
}

fn unreachable_v033() -> Vec<Region> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::model::ModelShape;

    fn toy(heads: u32) -> ModelShape {
        ModelShape::toy(heads)
    }

    fn geom(layout: Layout, tp: u32, blocks: u32) -> RankGeometry {
        let engine = EngineSpec { tp, block_tokens: 16, num_blocks: blocks, layout };
        RankGeometry::new(&toy(2), &engine, 0)
    }

    fn assert_tiles(g: &RankGeometry) {
        // Every byte of the allocation belongs to exactly one (region, block).
        let mut covered = vec![0u8; g.total_bytes() as usize];
        for r in g.regions() {
            assert_eq!(r.content.len(), r.block_len, "{} content size", r.name);
            for b in 0..r.num_blocks {
                let off = r.block_off(b) as usize;
                for x in &mut covered[off..off + r.block_len as usize] {
                    *x += 1;
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1), "{:?} regions tile the allocation", g.layout);
    }

    #[test]
    fn every_layout_tiles_its_allocation() {
        for layout in Layout::ALL {
            for tp in [1, 2] {
                assert_tiles(&geom(layout, tp, 3));
            }
        }
    }

    #[test]
    fn bhlnc_is_one_row_region() {
        let g = geom(Layout::Bhlnc, 1, 4);
        let r = g.regions();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].block_len, r[0].block_stride), (16384, 16384));
        // With one head per rank the page is contiguous again: per-layer regions.
        let g = geom(Layout::Bhlnc, 2, 6);
        let r = g.regions();
        assert_eq!(
            r.iter().map(|r| (r.base_off, r.block_len, r.block_stride)).collect::<Vec<_>>(),
            vec![(0, 4096, 8192), (4096, 4096, 8192)]
        );
    }

    #[test]
    fn fa_regions_are_k_then_v_per_layer() {
        let g = geom(Layout::FaHnd, 1, 4);
        let r = g.regions();
        assert_eq!(r.len(), 4);
        assert_eq!(r.iter().map(|r| r.base_off).collect::<Vec<_>>(), vec![0, 16384, 32768, 49152]);
        assert_eq!(r[1].content.kv, Some(1));
    }
}
