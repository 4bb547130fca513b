//! Property tests of the planning core over random TP pairs, head counts, layer counts,
//! block sizes, layouts and block tables.
//!
//! Each accepted case is *executed* in memory: prefill ranks' allocations are filled with
//! the byte pattern, every planned pair is copied, and the decode rank's bytes are verified
//! against its own geometry. So "every head read exactly once, no overlaps, all in bounds"
//! is checked on the bytes, not only on the plan's bookkeeping.

use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Planner, RequestBlocks, RequestIds};
use kvx::layouts::verify::{FillPlan, VerifyPlan, fill_request};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model::{Dtype, Mla, ModelShape};
use kvx::topology::VllmVersion;
use proptest::prelude::*;

const V033: [Layout; 6] =
    [Layout::Lbhnc, Layout::Lbnhc, Layout::Lhbnc, Layout::Blhnc, Layout::Blnhc, Layout::Bhlnc];
const V019: [Layout; 6] = [
    Layout::FaHnd,
    Layout::FaNhd,
    Layout::FiHnd,
    Layout::FiNhd,
    Layout::FaCrossLayers,
    Layout::FiCrossLayers,
];

#[derive(Debug, Clone)]
struct Case {
    version: VllmVersion,
    p_tp: u32,
    d_tp: u32,
    heads: u32,
    mla: bool,
    layers: u32,
    p_block: u32,
    bsr: u32,
    p_layout: Layout,
    d_layout: Layout,
    permute: bool,
    n_blocks: u32,
    hit: u32,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    let tp = prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]);
    (
        (
            any::<bool>(),
            tp.clone(),
            tp,
            prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]),
            prop::bool::weighted(0.2),
            1u32..4,
            prop::sample::select(vec![2u32, 4, 8]),
        ),
        (
            prop::sample::select(vec![1u32, 1, 2, 4]),
            0usize..6,
            prop::bool::weighted(0.2),
            any::<bool>(),
            1u32..6,
            0u32..3,
            any::<u64>(),
        ),
    )
        .prop_map(
            |((v019, p_tp, d_tp, heads, mla, layers, p_block), (bsr, li, other, permute, n, hit, seed))| {
                let version = if v019 { VllmVersion::V0_19 } else { VllmVersion::V0_33 };
                let pool = if v019 { V019 } else { V033 };
                let p_layout = pool[li];
                // Mostly equal layouts; sometimes the permute pair or another layout.
                let d_layout = match (other, permute) {
                    (true, true) if p_layout == Layout::Lbhnc => Layout::Lbnhc,
                    (true, true) if p_layout == Layout::FaHnd => Layout::FaNhd,
                    (true, _) if !mla => pool[(li + 1 + (seed % 5) as usize) % 6],
                    _ => p_layout,
                };
                Case {
                    version,
                    p_tp,
                    d_tp,
                    heads,
                    mla,
                    layers,
                    p_block,
                    bsr,
                    p_layout,
                    d_layout,
                    permute,
                    n_blocks: n,
                    hit: hit.min(n),
                    seed,
                }
            },
        )
}

fn pair_of(c: &Case) -> PairSpec {
    let model = ModelShape {
        name: "prop".into(),
        num_layers: c.layers,
        num_kv_heads: c.heads,
        head_dim: 8,
        dtype: Dtype::Bf16,
        mla: c.mla.then_some(Mla { kv_lora_rank: 12, qk_rope_head_dim: 4 }),
    };
    // A prime pool size, so the strided block tables in `execute` never repeat an id.
    let pool = 31;
    PairSpec {
        version: c.version,
        model,
        p: EngineSpec { tp: c.p_tp, block_tokens: c.p_block, num_blocks: pool, layout: c.p_layout },
        d: EngineSpec { tp: c.d_tp, block_tokens: c.p_block * c.bsr, num_blocks: pool, layout: c.d_layout },
        permute: c.permute,
    }
}

fn permute_pair(p: Layout, d: Layout) -> bool {
    matches!((p, d), (Layout::Lbhnc, Layout::Lbnhc) | (Layout::FaHnd, Layout::FaNhd))
}

fn contiguous(l: Layout) -> bool {
    matches!(
        l,
        Layout::Lbhnc
            | Layout::Blhnc
            | Layout::FaHnd
            | Layout::FiHnd
            | Layout::FaCrossLayers
            | Layout::FiCrossLayers
    )
}

fn backend(l: Layout) -> u8 {
    match l {
        Layout::FaHnd | Layout::FaNhd | Layout::FaCrossLayers => 1,
        Layout::FiHnd | Layout::FiNhd | Layout::FiCrossLayers => 2,
        _ => 0,
    }
}

/// vLLM's acceptance rules (plus kvx's refusals of what vLLM reads wrong), restated
/// independently of kvx's implementation.
fn accepted(c: &Case) -> bool {
    let (p, d) = (c.p_tp, c.d_tp);
    let h = if c.mla { 1 } else { c.heads };
    let divides = if d >= p { d % p == 0 } else { p % d == 0 };
    let shards = |tp: u32| if tp <= h { h % tp == 0 } else { tp.is_multiple_of(h) };
    let sharded = c.mla || shards(p) && shards(d);
    if !divides || !sharded {
        return false;
    }
    let v033 = c.version == VllmVersion::V0_33;
    if p > d && !c.mla && v033 && p > h {
        return false;
    }
    if p > d && !v033 && p >= c.heads {
        return false;
    }
    if !v033 && !c.mla && d > p && p < h && h < d {
        return false;
    }
    if c.mla && matches!(c.p_layout, Layout::FaCrossLayers | Layout::FiCrossLayers) {
        return false;
    }
    if !c.mla && backend(c.p_layout) != backend(c.d_layout) {
        return false;
    }
    let permute_ok = c.permute && permute_pair(c.p_layout, c.d_layout);
    if c.p_layout != c.d_layout && !c.mla && !permute_ok {
        return false;
    }
    if c.permute && !permute_pair(c.p_layout, c.d_layout) && c.p_layout != c.d_layout {
        return false;
    }
    let replicated = if v033 { p > h } else { p >= c.heads };
    let splits_heads = p != d && !c.mla && !replicated && !permute_ok;
    if splits_heads && !(contiguous(c.p_layout) && contiguous(c.d_layout)) {
        return false;
    }
    // Decode layouts whose region blocks are strided: block-outer ones (unless a single
    // layer makes them plain) and FlashInfer's K/V halves.
    let strided = match c.d_layout {
        Layout::Blhnc | Layout::Blnhc => c.layers > 1 || c.mla,
        Layout::Bhlnc => c.layers > 1 || c.mla || h / d > 1,
        Layout::FiHnd | Layout::FiNhd => !c.mla,
        Layout::FaCrossLayers | Layout::FiCrossLayers => true,
        _ => false,
    };
    if c.bsr != 1 && (p > d || strided) {
        return false;
    }
    true
}

/// Runs one accepted case end to end in memory; returns bytes verified.
fn execute(c: &Case, pair: &PairSpec) -> Result<u64, TestCaseError> {
    let map = pair.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    let h = if c.mla { 1 } else { c.heads };
    let remote: Vec<u32> = (0..c.n_blocks * c.bsr).map(|i| (i * 7 + 3) % pair.p.num_blocks).collect();
    let n_d = remote.len().div_ceil(c.bsr as usize) as u32;
    let local: Vec<u32> = (c.hit.min(n_d)..n_d).map(|i| (i * 5 + 1) % pair.d.num_blocks).collect();
    let req = RequestBlocks { local, remote: remote.clone() };
    let ids = RequestIds { p_request_id: "p".into(), d_request_id: "d".into() };
    // Prefill allocations, filled with the pattern.
    let p_allocs: Vec<Vec<u8>> = (0..pair.p.tp)
        .map(|r| {
            let g = pair.p_geometry(r);
            let mut a = vec![0u8; g.total_bytes() as usize];
            fill_request(&g, &g.regions(), &remote, c.seed, &mut a);
            a
        })
        .collect();
    // As `--verify sample` runs: prefill fills only the sampled blocks, the rest stays zero.
    let p_sampled: Vec<Vec<u8>> = (0..pair.p.tp)
        .map(|r| {
            let g = pair.p_geometry(r);
            let mut a = vec![0u8; g.total_bytes() as usize];
            let fill = FillPlan::new(&g, &g.regions(), &remote, c.seed).only(16);
            for (i, range) in fill.ranges().into_iter().enumerate() {
                fill.fill(i, &mut a[range.start as usize..range.end as usize]);
            }
            a
        })
        .collect();
    let mut total = 0;
    for dm in &map.d_ranks {
        // Every head of the rank is covered exactly once.
        if !c.mla {
            let mut seen = Vec::new();
            for r in &dm.reads {
                seen.extend(r.global_heads.clone());
            }
            seen.sort_unstable();
            let want: Vec<u32> = dm.d_heads.clone().collect();
            prop_assert_eq!(&seen, &want, "heads read exactly once");
            prop_assert!(dm.d_heads.end <= h.max(1));
        }
        let planner = Planner::new(pair, &map, dm.d_rank).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let plan = planner.plan(&req, &ids).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let g = pair.d_geometry(dm.d_rank);
        let mut d_alloc = vec![0u8; g.total_bytes() as usize];
        let mut d_sampled = vec![0u8; g.total_bytes() as usize];
        let mut intervals = Vec::new();
        for read in &plan.reads {
            let src = &p_allocs[read.p_rank as usize];
            for p in &read.pairs {
                let (l, r, n) = (p.local as usize, p.remote as usize, p.len as usize);
                prop_assert!(r + n <= src.len(), "remote in bounds");
                prop_assert!(l + n <= d_alloc.len(), "local in bounds");
                d_alloc[l..l + n].copy_from_slice(&src[r..r + n]);
                d_sampled[l..l + n].copy_from_slice(&p_sampled[read.p_rank as usize][r..r + n]);
                intervals.push((p.local, p.local + p.len));
            }
        }
        intervals.sort_unstable();
        for w in intervals.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "reads overlap at {:?}", w);
        }
        let bp = planner.pair_blocks(&req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let verify = |alloc: &[u8], stride: u32| {
            let plan = VerifyPlan::new(
                &g,
                &g.regions(),
                &bp,
                pair.block_size_ratio(),
                pair.permutes(),
                pair.p.block_tokens,
                c.seed,
                stride,
            );
            plan.verify_in(alloc)
                .map_err(|m| TestCaseError::fail(format!("decode rank {}, 1 in {stride}: {m}", dm.d_rank)))
        };
        let verified = verify(&d_alloc, 1)?;
        let copied: u64 = intervals.iter().map(|(a, b)| b - a).sum();
        prop_assert_eq!(verified.bytes, copied, "every copied byte verified, nothing missing");
        // Decode checks the sample prefill filled, choosing it by itself.
        let sampled = verify(&d_sampled, 16)?;
        prop_assert!(sampled.bytes <= copied);
        total += verified.bytes;
    }
    Ok(total)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn plans_move_exactly_the_promised_bytes(c in case()) {
        let pair = pair_of(&c);
        match pair.validate() {
            Err(e) => {
                prop_assert!(!accepted(&c), "kvx rejected a case the rules accept: {e}");
                prop_assert!(e.knob.to_string().starts_with("--"), "rejection names a flag: {e}");
            }
            Ok(_) => {
                prop_assert!(accepted(&c), "kvx accepted a case the rules reject");
                execute(&c, &pair)?;
            }
        }
    }
}

/// A deliberately wrong plan is caught by verification (the check is not vacuous).
#[test]
fn verification_catches_a_wrong_head_offset() {
    let c = Case {
        version: VllmVersion::V0_33,
        p_tp: 1,
        d_tp: 2,
        heads: 2,
        mla: false,
        layers: 2,
        p_block: 4,
        bsr: 1,
        p_layout: Layout::Lbhnc,
        d_layout: Layout::Lbhnc,
        permute: false,
        n_blocks: 2,
        hit: 0,
        seed: 9,
    };
    let pair = pair_of(&c);
    let map = pair.validate().expect("valid");
    let planner = Planner::new(&pair, &map, 1).expect("planner");
    let req = RequestBlocks { local: vec![0, 1], remote: vec![0, 1] };
    let plan =
        planner.plan(&req, &RequestIds { p_request_id: "p".into(), d_request_id: "d".into() }).expect("plan");
    let pg = pair.p_geometry(0);
    let mut src = vec![0u8; pg.total_bytes() as usize];
    fill_request(&pg, &pg.regions(), &req.remote, c.seed, &mut src);
    let g = pair.d_geometry(1);
    let mut dst = vec![0u8; g.total_bytes() as usize];
    for p in &plan.reads[0].pairs {
        // Bug injected: read head 0 (offset 0 of the P block) instead of head 1.
        let wrong = p.remote - planner.reads[0].remote_offset_in_block;
        dst[p.local as usize..(p.local + p.len) as usize]
            .copy_from_slice(&src[wrong as usize..(wrong + p.len) as usize]);
    }
    let bp = planner.pair_blocks(&req).expect("pairs");
    let err = VerifyPlan::new(&g, &g.regions(), &bp, 1, false, 4, c.seed, 1)
        .verify_in(&dst)
        .expect_err("wrong head detected");
    assert_eq!(err.global_head, 1, "{err}");
}
