//! Push-mode plans (vLLM `NixlPushConnector`): prefill ranks WRITE into decode ranks' blocks.
//!
//! Every accepted case is executed in memory: prefill allocations are filled with the byte
//! pattern, every planned WRITE pair is copied into the decode allocations, and each decode
//! rank is verified against its own geometry. Wherever pull accepts the same scenario, the
//! decode allocations after push must equal those after pull byte for byte: push and pull
//! move the same bytes.
//!
//! Cases "from vLLM's code" were derived by reading vLLM 0.33.0's
//! `vllm/distributed/kv_transfer/kv_connector/v1/nixl/` (and `kv_connector/utils.py`); each
//! names the file and function it comes from. `docs/push-semantics.md` has the derivations.

use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Planner, RequestBlocks, RequestIds};
use kvx::layouts::verify::{VerifyPlan, fill_request};
use kvx::layouts::write_plan::PushPlanner;
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model::{Dtype, Mla, ModelShape};
use kvx::topology::VllmVersion;
use proptest::prelude::*;

use crate::common::kvx;

const LAYOUTS: [Layout; 6] =
    [Layout::Lbhnc, Layout::Lbnhc, Layout::Lhbnc, Layout::Blhnc, Layout::Blnhc, Layout::Bhlnc];

#[derive(Debug, Clone)]
struct Case {
    p_tp: u32,
    d_tp: u32,
    heads: u32,
    mla: bool,
    layers: u32,
    p_block: u32,
    d_block: u32,
    p_layout: Layout,
    d_layout: Layout,
    permute: bool,
    n_blocks: u32,
    hit: u32,
    seed: u64,
}

impl Case {
    fn new(p_tp: u32, d_tp: u32, heads: u32, mla: bool) -> Self {
        Case {
            p_tp,
            d_tp,
            heads,
            mla,
            layers: 2,
            p_block: 4,
            d_block: 4,
            p_layout: Layout::Lbhnc,
            d_layout: Layout::Lbhnc,
            permute: false,
            n_blocks: 3,
            hit: 0,
            seed: 7,
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    let tp = prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]);
    (
        (tp.clone(), tp, prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]), prop::bool::weighted(0.2), 1u32..4),
        (
            prop::sample::select(vec![2u32, 4, 8]),
            prop::sample::select(vec![1u32, 1, 1, 1, 2]),
            0usize..6,
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.1),
            1u32..6,
            0u32..3,
            any::<u64>(),
        ),
    )
        .prop_map(
            |((p_tp, d_tp, heads, mla, layers), (block, ratio, li, other, permute, n, hit, seed))| {
                let p_layout = LAYOUTS[li];
                let d_layout = match (other, permute) {
                    (true, true) if p_layout == Layout::Lbhnc => Layout::Lbnhc,
                    (true, true) if p_layout == Layout::Lbnhc => Layout::Lbhnc,
                    (true, _) if !mla => LAYOUTS[(li + 1 + (seed % 5) as usize) % 6],
                    _ => p_layout,
                };
                // Sometimes decode blocks are larger, sometimes prefill blocks.
                let (p_block, d_block) =
                    if seed % 2 == 0 { (block, block * ratio) } else { (block * ratio, block) };
                Case {
                    p_tp,
                    d_tp,
                    heads,
                    mla,
                    layers,
                    p_block,
                    d_block,
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
        name: "push-prop".into(),
        num_layers: c.layers,
        num_kv_heads: c.heads,
        head_dim: 8,
        dtype: Dtype::Bf16,
        mla: c.mla.then_some(Mla { kv_lora_rank: 12, qk_rope_head_dim: 4 }),
    };
    // Prime pool sizes, so the strided block tables below never repeat an id.
    PairSpec {
        version: VllmVersion::V0_33,
        model,
        p: EngineSpec { tp: c.p_tp, block_tokens: c.p_block, num_blocks: 31, layout: c.p_layout },
        d: EngineSpec { tp: c.d_tp, block_tokens: c.d_block, num_blocks: 29, layout: c.d_layout },
        permute: c.permute,
    }
}

fn contiguous(l: Layout) -> bool {
    matches!(l, Layout::Lbhnc | Layout::Blhnc)
}

/// vLLM 0.33's push acceptance, restated independently of kvx's implementation
/// (`docs/push-semantics.md` section 1.3).
fn push_accepted(c: &Case) -> bool {
    let (p, d) = (c.p_tp, c.d_tp);
    let h = if c.mla { 1 } else { c.heads };
    let divides = if d >= p { d % p == 0 } else { p % d == 0 };
    let shards = |tp: u32| if tp <= h { h % tp == 0 } else { tp.is_multiple_of(h) };
    if !divides || !(c.mla || shards(p) && shards(d)) {
        return false;
    }
    // base_worker._validate_remote_agent_handshake, P local: no replicated remote (decode)
    // when the remote has more ranks.
    if !c.mla && d > p && d > h {
        return false;
    }
    // TransferTopology.block_size_ratio on the prefill side, and again on the decode side.
    if c.p_block != c.d_block {
        return false;
    }
    if !c.mla && c.p_layout != c.d_layout {
        return false;
    }
    let d_replicated = d > h;
    if p != d && !c.mla && !d_replicated && !contiguous(c.p_layout) {
        return false;
    }
    true
}

fn request(c: &Case, pair: &PairSpec) -> RequestBlocks {
    let remote: Vec<u32> = (0..c.n_blocks).map(|i| (i * 7 + 3) % pair.p.num_blocks).collect();
    let local: Vec<u32> = (c.hit..c.n_blocks).map(|i| (i * 5 + 1) % pair.d.num_blocks).collect();
    RequestBlocks { local, remote }
}

fn ids() -> RequestIds {
    RequestIds { p_request_id: "req-P".into(), d_request_id: "req-D".into() }
}

fn prefill_allocs(pair: &PairSpec, remote: &[u32], seed: u64) -> Vec<Vec<u8>> {
    (0..pair.p.tp)
        .map(|r| {
            let g = pair.p_geometry(r);
            let mut a = vec![0u8; g.total_bytes() as usize];
            fill_request(&g, &g.regions(), remote, seed, &mut a);
            a
        })
        .collect()
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Executes the push plans of every prefill rank; checks bounds, overlaps, duplicate
/// writes, notification counts, and verifies every decode rank. Returns the decode
/// allocations.
fn execute_push(c: &Case, pair: &PairSpec) -> Result<Vec<Vec<u8>>, TestCaseError> {
    let map = pair.validate_push().map_err(fail)?;
    let req = request(c, pair);
    let p_allocs = prefill_allocs(pair, &req.remote, c.seed);
    let mut d_allocs: Vec<Vec<u8>> =
        (0..pair.d.tp).map(|r| vec![0u8; pair.d_geometry(r).total_bytes() as usize]).collect();
    let mut intervals: Vec<Vec<(u64, u64)>> = vec![Vec::new(); pair.d.tp as usize];
    let mut writes_into = vec![0u32; pair.d.tp as usize];
    let mut bp_any = None;
    for pm in &map.p_ranks {
        let planner = PushPlanner::new(pair, &map, pm.p_rank).map_err(fail)?;
        let plan = planner.plan(&req, &ids()).map_err(fail)?;
        bp_any = Some(planner.pair_blocks(&req).map_err(fail)?);
        let src = &p_allocs[pm.p_rank as usize];
        for w in &plan.writes {
            prop_assert_eq!(&w.notif_msg, &format!("req-D:{}", pair.p.tp));
            writes_into[w.d_rank as usize] += 1;
            let dst = &mut d_allocs[w.d_rank as usize];
            for p in &w.pairs {
                let (l, r, n) = (p.local as usize, p.remote as usize, p.len as usize);
                prop_assert!(l + n <= src.len(), "prefill side in bounds");
                prop_assert!(r + n <= dst.len(), "decode side in bounds");
                if w.duplicate_of.is_some() {
                    // A duplicate WRITE puts the very bytes already there.
                    prop_assert_eq!(&dst[r..r + n], &src[l..l + n], "duplicate write differs");
                } else {
                    dst[r..r + n].copy_from_slice(&src[l..l + n]);
                    intervals[w.d_rank as usize].push((p.remote, p.remote + p.len));
                }
            }
        }
        // Coalescing only merges: same bytes, never more descriptors.
        if !plan.writes.is_empty() {
            let bp = planner.pair_blocks(&req).map_err(fail)?;
            for (w, co) in plan.writes.iter().zip(planner.coalesced(&bp)) {
                prop_assert!(co.len() <= w.pairs.len());
                prop_assert_eq!(
                    co.iter().map(|x| x.len).sum::<u64>(),
                    w.pairs.iter().map(|x| x.len).sum::<u64>()
                );
            }
        }
    }
    let Some(bp) = bp_any else { return Ok(d_allocs) };
    for dv in &map.d_ranks {
        let d = dv.d_rank as usize;
        if !req.local.is_empty() {
            prop_assert_eq!(writes_into[d], dv.expected_notifs, "one notification per WRITE into D{}", d);
            prop_assert_eq!(dv.writers.len() as u32, dv.expected_notifs);
        }
        let iv = &mut intervals[d];
        iv.sort_unstable();
        for w in iv.windows(2) {
            prop_assert!(w[0].1 <= w[1].0, "writes overlap at {:?}", w);
        }
        let g = pair.d_geometry(dv.d_rank);
        let verified = VerifyPlan::new(&g, &g.regions(), &bp, 1, false, pair.p.block_tokens, c.seed, 1)
            .verify_in(&d_allocs[d])
            .map_err(|m| fail(format!("decode rank {d}: {m}")))?;
        let written: u64 = iv.iter().map(|(a, b)| b - a).sum();
        prop_assert_eq!(verified.bytes, written, "every written byte verified, nothing missing");
    }
    Ok(d_allocs)
}

/// Executes the pull plans (the existing planner) into fresh decode allocations.
fn execute_pull(c: &Case, pair: &PairSpec) -> Result<Vec<Vec<u8>>, TestCaseError> {
    let map = pair.validate().map_err(fail)?;
    let req = request(c, pair);
    let p_allocs = prefill_allocs(pair, &req.remote, c.seed);
    let mut d_allocs = Vec::new();
    for dm in &map.d_ranks {
        let planner = Planner::new(pair, &map, dm.d_rank).map_err(fail)?;
        let plan = planner.plan(&req, &ids()).map_err(fail)?;
        let mut a = vec![0u8; pair.d_geometry(dm.d_rank).total_bytes() as usize];
        for read in &plan.reads {
            let src = &p_allocs[read.p_rank as usize];
            for p in &read.pairs {
                let (l, r, n) = (p.local as usize, p.remote as usize, p.len as usize);
                a[l..l + n].copy_from_slice(&src[r..r + n]);
            }
        }
        d_allocs.push(a);
    }
    Ok(d_allocs)
}

/// Runs push (and pull where it accepts) and compares what lands on decode.
fn push_equals_pull(c: &Case) -> Result<(), TestCaseError> {
    let pair = pair_of(c);
    let pushed = execute_push(c, &pair)?;
    if pair.validate().is_ok() {
        let pulled = execute_pull(c, &pair)?;
        for (d, (a, b)) in pushed.iter().zip(&pulled).enumerate() {
            prop_assert!(a == b, "decode rank {} holds different bytes after push and after pull", d);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn push_moves_the_same_bytes_as_pull(c in case()) {
        let pair = pair_of(&c);
        match pair.validate_push() {
            Err(e) => {
                prop_assert!(!push_accepted(&c), "kvx refused a case vLLM's push connector accepts: {e}");
                prop_assert!(e.knob.to_string().starts_with("--"), "refusal names a flag: {e}");
            }
            Ok(_) => {
                prop_assert!(push_accepted(&c), "kvx accepted a case vLLM's push connector refuses");
                push_equals_pull(&c)?;
            }
        }
    }
}

/// The whole grid of TP pairs and head counts, deterministically: every case push accepts
/// runs end to end, and the grid holds cases of each kind (accepted by both modes, by push
/// only, by pull only), so the comparison above is not vacuous.
#[test]
fn grid_of_tp_pairs_and_heads() {
    let (mut both, mut push_only, mut pull_only) = (0, 0, 0);
    for mla in [false, true] {
        for p in [1, 2, 4, 8] {
            for d in [1, 2, 4, 8] {
                for heads in [1, 2, 4, 8] {
                    let c = Case::new(p, d, heads, mla);
                    let pair = pair_of(&c);
                    match (pair.validate().is_ok(), pair.validate_push().is_ok()) {
                        (true, true) => both += 1,
                        (false, true) => push_only += 1,
                        (true, false) => pull_only += 1,
                        (false, false) => continue,
                    }
                    assert_eq!(pair.validate_push().is_ok(), push_accepted(&c), "{c:?}");
                    if pair.validate_push().is_ok() {
                        run(&c);
                    }
                }
            }
        }
    }
    assert!(
        both > 50 && push_only > 0 && pull_only > 0,
        "both {both}, push only {push_only}, pull only {pull_only}"
    );
}

/// A deliberately wrong push plan is caught by decode's verification.
#[test]
fn verification_catches_a_wrong_push_slot() {
    let c = Case::new(2, 1, 2, false);
    let pair = pair_of(&c);
    let map = pair.validate_push().expect("valid");
    let req = request(&c, &pair);
    let p_allocs = prefill_allocs(&pair, &req.remote, c.seed);
    let g = pair.d_geometry(0);
    let mut dst = vec![0u8; g.total_bytes() as usize];
    let mut bp = None;
    for p in 0..2u32 {
        let planner = PushPlanner::new(&pair, &map, p).expect("planner");
        bp = Some(planner.pair_blocks(&req).expect("pairs"));
        let plan = planner.plan(&req, &ids()).expect("plan");
        for x in &plan.writes[0].pairs {
            // Bug injected: both prefill ranks write into slot 0 of the decode block.
            let wrong = x.remote - planner.writes[0].remote_offset_in_block;
            let src = &p_allocs[p as usize][x.local as usize..(x.local + x.len) as usize];
            dst[wrong as usize..(wrong + x.len) as usize].copy_from_slice(src);
        }
    }
    let bp = bp.expect("two prefill ranks");
    let err = VerifyPlan::new(&g, &g.regions(), &bp, 1, false, c.p_block, c.seed, 1)
        .verify_in(&dst)
        .expect_err("caught");
    assert_eq!(err.global_head, 0, "{err}");
}

fn run(c: &Case) {
    if let Err(e) = push_equals_pull(c) {
        panic!("{c:?}: {e}");
    }
}

#[test]
fn p8_to_d2_moves_the_same_bytes_as_pull() {
    let c = Case::new(8, 2, 8, false);
    let pair = pair_of(&c);
    pair.validate().expect("pull accepts");
    let map = pair.validate_push().expect("push accepts");
    // Prefill rank p writes its whole one-head block into decode rank p / 4 at slot p % 4
    // (tp_mapping.compute_tp_mapping / compute_head_offset with prefill local).
    let len_p = pair.p_geometry(0).regions()[0].block_len;
    for p in 0..8u32 {
        let planner = PushPlanner::new(&pair, &map, p).expect("planner");
        let w = &planner.writes[0];
        assert_eq!(w.d_rank, p / 4);
        assert_eq!(
            (w.local_offset_in_block, w.remote_offset_in_block, w.length),
            (0, u64::from(p % 4) * len_p, len_p)
        );
    }
    assert!(map.d_ranks.iter().all(|d| d.expected_notifs == 4));
    run(&c);
}

#[test]
fn p2_to_d4_moves_the_same_bytes_as_pull() {
    let c = Case::new(2, 4, 8, false);
    let pair = pair_of(&c);
    pair.validate().expect("pull accepts");
    let map = pair.validate_push().expect("push accepts");
    let len_d = pair.d_geometry(0).regions()[0].block_len;
    let planner = PushPlanner::new(&pair, &map, 1).expect("planner");
    let got: Vec<(u32, u64, u64)> = planner
        .writes
        .iter()
        .map(|w| (w.d_rank, w.local_offset_in_block, w.remote_offset_in_block))
        .collect();
    assert_eq!(got, vec![(2, 0, 0), (3, len_d, 0)]);
    assert!(map.d_ranks.iter().all(|d| d.expected_notifs == 1));
    run(&c);
}

#[test]
fn mla_moves_the_same_bytes_as_pull() {
    for (p, d) in [(4, 2), (2, 4), (2, 2), (8, 1)] {
        let c = Case::new(p, d, 128, true);
        let pair = pair_of(&c);
        pair.validate().expect("pull accepts");
        pair.validate_push().expect("push accepts");
        run(&c);
    }
    // With a partial prefix hit and a block-outer layout too.
    let mut c = Case::new(4, 2, 128, true);
    c.hit = 1;
    c.p_layout = Layout::Blhnc;
    c.d_layout = Layout::Blhnc;
    run(&c);
}

#[test]
fn block_sizes_that_differ_are_pulled_but_not_pushed() {
    // Pull reads 4-token prefill blocks into 8-token decode blocks (block_size_ratio 2).
    let mut c = Case::new(2, 4, 8, false);
    c.d_block = 8;
    let pair = pair_of(&c);
    pair.validate().expect("pull accepts differing block sizes");
    let e = pair.validate_push().expect_err("push refuses");
    assert_eq!(e.knob.to_string(), "--d-block-size", "{e}");
    assert!(e.reason.contains("Local block size 4 is not divisible by remote block size 8"), "{e}");
    // Prefill blocks larger: the decode worker's assertion when the request completes.
    c.p_block = 16;
    let e = pair_of(&c).validate_push().expect_err("push refuses");
    assert_eq!(e.knob.to_string(), "--d-block-size", "{e}");
    assert!(e.reason.contains("Local block size 8 is not divisible by remote block size 16"), "{e}");
    // Equal block sizes: fine, and the same bytes as pull.
    c.p_block = 8;
    run(&c);
}

/// `base_worker._validate_remote_agent_handshake` (prefill local):
/// `assert not (tp_ratio < 0 and is_kv_replicated(remote))`, with
/// `TransferTopology.is_kv_replicated` = remote TP > total KV heads. So D 8 > P 2 with 4
/// heads is refused in push, while pull accepts it (its P2 -> D8 worked example).
#[test]
fn vllm_replicated_decode_is_refused_in_push_only() {
    let c = Case::new(2, 8, 4, false);
    let pair = pair_of(&c);
    pair.validate().expect("pull accepts P2 -> D8 with 4 heads");
    assert_eq!(pair.validate_push().expect_err("push refuses").knob.to_string(), "--d-tp");
}

/// `tp_mapping.compute_head_offset(tp_rank, tp_size, remote_tp_size, H)` with the prefill
/// rank local: P 8 -> D 2 with 4 heads takes the `tp_size > total_num_kv_heads` branch,
/// `local_head - remote_head` = `p*4//8 - (p*2//8)*4//2` = 0,0,1,1,0,0,1,1. The assertion
/// above does not fire (the remote, decode, is not replicated), so push accepts what pull
/// refuses; prefill ranks holding the same head write it twice.
#[test]
fn vllm_replicated_prefill_is_pushed_with_duplicate_writes() {
    let c = Case::new(8, 2, 4, false);
    let pair = pair_of(&c);
    assert_eq!(pair.validate().expect_err("pull refuses").knob.to_string(), "--p-tp");
    let map = pair.validate_push().expect("push accepts");
    let f: Vec<u32> = map.p_ranks.iter().map(|p| p.rank_offset_factor).collect();
    assert_eq!(f, vec![0, 0, 1, 1, 0, 0, 1, 1]);
    assert_eq!(map.duplicate_writes(), 4);
    // `push_worker._get_new_notifs`: pp_size * max(1, 8 // 2) = 4, one per WRITE.
    assert!(map.d_ranks.iter().all(|d| d.expected_notifs == 4 && d.writers.len() == 4));
    run(&c);
}

/// `push_worker._xfer_blocks_for_req`: `replicate_attn = use_mla and tp_ratio < 0`, and then
/// `write_ranks = sorted(dst_xfer_side_handles[engine])`, the decode ranks handshaked
/// (`TransferTopology.handshake_target_ranks`: `p*2 + i` for P 2 -> D 4). With P >= D the
/// mapping collapses to `[p * D // P]`, so every prefill rank writes the same latent.
#[test]
fn vllm_mla_writes_every_decode_rank() {
    let pair = pair_of(&Case::new(2, 4, 128, true));
    let map = pair.validate_push().expect("accepted");
    assert_eq!(map.p_ranks[1].write_ranks, vec![2, 3]);
    let pair = pair_of(&Case::new(4, 2, 128, true));
    let map = pair.validate_push().expect("accepted");
    assert_eq!(map.d_ranks[1].writers, vec![2, 3]);
    assert_eq!(map.p_ranks[3].writes[0].duplicate_of, Some(2));
    assert_eq!(map.d_ranks[1].expected_notifs, 2);
}

/// `push_worker._xfer_blocks`: `notif_id = f"{remote_request_id}:{self.world_size}"`, where
/// the remote request id is the decode request id from the `PUSH_REG` registration and the
/// world size is the prefill TP; `_get_new_notifs` on decode waits for
/// `pp_size * max(1, int(tp_size) // self.world_size)`.
#[test]
fn vllm_notification_names_the_decode_request_and_prefill_tp() {
    for (p, d, want) in [(4, 4, 1), (8, 2, 4), (2, 8, 1), (1, 8, 1)] {
        let pair = pair_of(&Case::new(p, d, 8, false));
        let map = pair.validate_push().expect("accepted");
        assert!(map.d_ranks.iter().all(|v| v.expected_notifs == want), "P{p} -> D{d}");
        let planner = PushPlanner::new(&pair, &map, 0).expect("planner");
        let req = RequestBlocks { local: vec![0], remote: vec![1] };
        let plan = planner.plan(&req, &ids()).expect("plan");
        assert!(plan.writes.iter().all(|w| w.notif_msg == format!("req-D:{p}")));
    }
}

/// `base_worker._apply_prefix_caching`: decode registered only its uncached blocks; prefill
/// end-trims its list to that many (`prefill_group[-num_decode_blocks:]`) and asserts decode
/// has no more than prefill.
#[test]
fn vllm_prefix_hit_writes_only_the_tail() {
    let pair = pair_of(&Case::new(1, 1, 2, false));
    let map = pair.validate_push().expect("accepted");
    let planner = PushPlanner::new(&pair, &map, 0).expect("planner");
    let req = RequestBlocks { local: vec![9, 4], remote: vec![1, 2, 3] };
    let bp = planner.pair_blocks(&req).expect("paired");
    assert_eq!((bp.remote.clone(), bp.local.clone()), (vec![2, 3], vec![9, 4]));
    let plan = planner.plan(&req, &ids()).expect("plan");
    let r0 = &planner.remote_regions[0];
    let l0 = &planner.local_regions[0];
    let first = plan.writes[0].pairs[0];
    assert_eq!((first.local, first.remote), (l0.block_off(2), r0.block_off(9)));
    let too_many = RequestBlocks { local: vec![1, 2, 3, 4], remote: vec![1, 2, 3] };
    assert_eq!(planner.plan(&too_many, &ids()).expect_err("refused").knob.to_string(), "--local-blocks");
}

/// `base_worker._validate_remote_agent_handshake` with prefill local: layouts must match
/// unless the *remote* (decode) is LBHNC and the local (prefill) LBNHC, and that escape
/// hatch only flags a permute nobody runs in push. Pull's permute pair is refused.
#[test]
fn vllm_layouts_must_match_in_push() {
    let mut c = Case::new(2, 2, 4, false);
    c.d_layout = Layout::Lbnhc;
    c.permute = true;
    let pair = pair_of(&c);
    pair.validate().expect("pull permutes HND into NHD");
    assert_eq!(pair.validate_push().expect_err("push refuses").knob.to_string(), "--permute");
    c.permute = false;
    assert_eq!(pair_of(&c).validate_push().expect_err("push refuses").knob.to_string(), "--d-layout");
    // Heterogeneous TP needs contiguous heads on the prefill side.
    let mut c = Case::new(2, 4, 8, false);
    c.p_layout = Layout::Lbnhc;
    c.d_layout = Layout::Lbnhc;
    assert_eq!(pair_of(&c).validate_push().expect_err("push refuses").knob.to_string(), "--layout");
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = kvx().args(args).output().expect("kvx runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn topo_push_json_shows_writes_and_notification_counts() {
    let v = json(&[
        "topo",
        "--mode",
        "push",
        "--p-tp",
        "8",
        "--d-tp",
        "2",
        "--num-kv-heads",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(v["mode"], "push");
    assert_eq!(v["tp_ratio"], 4);
    let len_p = v["p_block_len_bytes"].as_u64().expect("len");
    let p5 = &v["p_ranks"][5];
    assert_eq!(p5["write_ranks"], serde_json::json!([1]));
    assert_eq!(p5["writes"][0]["remote_offset_in_block"].as_u64(), Some(len_p));
    assert_eq!(p5["writes"][0]["length"].as_u64(), Some(len_p));
    assert_eq!(p5["notif_count"], 8);
    assert_eq!(v["d_ranks"][1]["writers"], serde_json::json!([4, 5, 6, 7]));
    assert_eq!(v["d_ranks"][1]["expected_notifs"], 4);
    assert_eq!(v["d_ranks"][1]["registers_with"], serde_json::json!([4, 5, 6, 7]));
}

#[test]
fn topo_push_table_names_writers_and_waits() {
    let out = kvx()
        .args(["topo", "--mode", "push", "--p-tp", "2", "--d-tp", "4", "--num-kv-heads", "8"])
        .output()
        .expect("kvx runs");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for want in ["kvx topo --mode push", "WRITEs", "PUSH_REG to", "waits for notifs", "<D id>:2"] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn plan_push_json_pairs_are_prefill_to_decode() {
    let v = json(&[
        "plan",
        "--mode",
        "push",
        "--p-tp",
        "2",
        "--d-tp",
        "1",
        "--num-kv-heads",
        "2",
        "--layers",
        "1",
        "--head-dim",
        "64",
        "--local-blocks",
        "3",
        "--remote-blocks",
        "1",
        "--format",
        "json",
    ]);
    assert_eq!(v["mode"], "push");
    assert_eq!(v["decode_blocks"], serde_json::json!([3]));
    // One head x 16 tokens x K|V x 64 x 2 bytes = 4096 per prefill block, 8192 per decode block.
    let w = &v["p_ranks"][1]["writes"][0];
    assert_eq!(w["d_rank"], 0);
    assert_eq!(w["notif_msg"], "req-D:2");
    assert_eq!(w["pairs"], serde_json::json!([[4096, 3 * 8192 + 4096, 4096]]));
    assert_eq!(v["d_ranks"][0]["expected_notifs"], 2);
    assert_eq!(v["d_ranks"][0]["bytes_written"], 8192);
}

#[test]
fn plan_push_table_and_decode_rank_filter() {
    let out = kvx()
        .args([
            "plan",
            "--mode",
            "push",
            "--p-tp",
            "8",
            "--d-tp",
            "2",
            "--num-kv-heads",
            "8",
            "--prompt-len",
            "64",
            "--d-rank",
            "1",
        ])
        .output()
        .expect("kvx runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("D1 <- P4,P5,P6,P7 (4 notifications)"), "{text}");
    assert!(!text.contains("D0 <-"), "{text}");
}

#[test]
fn push_refusals_exit_2_and_name_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["topo", "--mode", "push", "--vllm", "0.19"], "--vllm"),
        (&["topo", "--mode", "push", "--p-tp", "2", "--d-tp", "8", "--num-kv-heads", "4"], "--d-tp"),
        (&["topo", "--mode", "push", "--p-block-size", "16", "--d-block-size", "32"], "--d-block-size"),
        (&["topo", "--mode", "push", "--p-layout", "LBHNC", "--d-layout", "LBNHC", "--permute"], "--permute"),
        (&["topo", "--mode", "push", "--p-layout", "LBNHC", "--d-layout", "LBHNC"], "--d-layout"),
        (&["plan", "--mode", "push", "--local-blocks", "0,1", "--remote-blocks", "2"], "--local-blocks"),
        (&["plan", "--mode", "push", "--prompt-len", "64", "--d-rank", "3"], "--d-rank"),
        (&["topo", "--mode", "sideways"], "--mode"),
    ];
    for (args, flag) in cases {
        let out = kvx().args(*args).output().expect("kvx runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} should exit 2; stderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: message should name {flag}: {stderr}");
    }
    // The JSON form of a refusal says which flag.
    let out = kvx()
        .args([
            "topo",
            "--mode",
            "push",
            "--p-tp",
            "2",
            "--d-tp",
            "8",
            "--num-kv-heads",
            "4",
            "--format",
            "json",
        ])
        .output()
        .expect("kvx runs");
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["status"].as_str(), v["flag"].as_str()), (Some("rejected"), Some("--d-tp")));
}

#[test]
fn pull_is_the_default_mode() {
    for args in [
        &["topo", "--p-tp", "8", "--d-tp", "2", "--format", "json"][..],
        &["plan", "--p-tp", "2", "--d-tp", "4", "--prompt-len", "64", "--format", "json"][..],
    ] {
        let default = kvx().args(args).output().expect("kvx runs");
        let pull = kvx().args(args).args(["--mode", "pull"]).output().expect("kvx runs");
        assert!(default.status.success());
        assert_eq!(default.stdout, pull.stdout, "{args:?}");
    }
}
