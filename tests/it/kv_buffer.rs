//! KV pools reached one byte range at a time (`KvBuffer`, as device memory is): the fill
//! and verification plans the workers use give the same bytes and the same verdicts as the
//! whole-allocation forms, in host memory here and in device memory where a GPU exists
//! (skipped, and said so, where none does).

use std::ops::Range;

use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Planner, RequestBlocks, RequestIds};
use kvx::layouts::verify::{FillPlan, VerifyPlan, fill_request};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model::{Dtype, ModelShape};
use kvx::transfer::memory::{KvBuffer, MemPlace, PageSize};

use crate::ucx_common::{Part, skip};

fn pair(p_tp: u32, d_tp: u32, layout: Layout) -> PairSpec {
    PairSpec {
        version: layout.version(),
        model: ModelShape {
            name: "kvbuffer-test".into(),
            num_layers: 3,
            num_kv_heads: 8,
            head_dim: 16,
            dtype: Dtype::Bf16,
            mla: None,
        },
        p: EngineSpec { tp: p_tp, block_tokens: 4, num_blocks: 24, layout },
        d: EngineSpec { tp: d_tp, block_tokens: 4, num_blocks: 24, layout },
        permute: false,
    }
}

/// Every byte of the buffer, read back through its ranges.
fn contents(buf: &KvBuffer, len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len as usize);
    buf.read_ranges(&[Range { start: 0, end: len }], |_, b| out.extend_from_slice(b)).expect("read back");
    out
}

/// Fills prefill rank 0 through a `FillPlan` in `place`, compares with `fill_request`; copies
/// what decode rank 0 reads into a decode pool in `place` and verifies it through a
/// `VerifyPlan`, then corrupts one byte and checks it is found at its offset.
fn plans_match_the_slice_forms(place: MemPlace) {
    for layout in [Layout::FaHnd, Layout::Lbhnc, Layout::Blhnc] {
        let pair = pair(4, 2, layout);
        let map = pair.validate().expect("valid pair");
        let remote: Vec<u32> = (0..6).map(|i| (i * 7 + 3) % 24).collect();
        let local: Vec<u32> = (0..6).map(|i| (i * 5 + 1) % 24).collect();
        let req = RequestBlocks { local, remote };
        let seed = 11;

        let pg = pair.p_geometry(0);
        let p_len = pg.total_bytes();
        let mut want = vec![0u8; p_len as usize];
        fill_request(&pg, &pg.regions(), &req.remote, seed, &mut want);
        let mut p_buf = KvBuffer::alloc(place, p_len as usize, PageSize::Normal).expect("prefill pool");
        let fill = FillPlan::new(&pg, &pg.regions(), &req.remote, seed);
        p_buf.write_ranges(&fill.ranges(), |i, b| fill.fill(i, b)).expect("fill");
        assert_eq!(contents(&p_buf, p_len), want, "{layout:?} in {place}: fill plan = fill_request");

        // Decode rank 0 reads from every prefill rank its plan names.
        let p_allocs: Vec<Vec<u8>> = (0..pair.p.tp)
            .map(|r| {
                let g = pair.p_geometry(r);
                let mut a = vec![0u8; g.total_bytes() as usize];
                fill_request(&g, &g.regions(), &req.remote, seed, &mut a);
                a
            })
            .collect();
        let planner = Planner::new(&pair, &map, 0).expect("planner");
        let ids = RequestIds { p_request_id: "p".into(), d_request_id: "d".into() };
        let plan = planner.plan(&req, &ids).expect("plan");
        let dg = pair.d_geometry(0);
        let d_len = dg.total_bytes();
        let mut d_host = vec![0u8; d_len as usize];
        for read in &plan.reads {
            let src = &p_allocs[read.p_rank as usize];
            for p in &read.pairs {
                let (l, r, n) = (p.local as usize, p.remote as usize, p.len as usize);
                d_host[l..l + n].copy_from_slice(&src[r..r + n]);
            }
        }
        let bp = planner.pair_blocks(&req).expect("pairs");
        let whole = VerifyPlan::new(&dg, &dg.regions(), &bp, 1, false, 4, seed, 1)
            .verify_in(&d_host)
            .expect("verified");
        let mut d_buf = KvBuffer::alloc(place, d_len as usize, PageSize::Normal).expect("decode pool");
        d_buf
            .write_ranges(&[Range { start: 0, end: d_len }], |_, b| b.copy_from_slice(&d_host))
            .expect("land the reads");
        let check = VerifyPlan::new(&dg, &dg.regions(), &bp, 1, false, 4, seed, 1);
        let verify = |buf: &KvBuffer| {
            let (mut bytes, mut first) = (0, None);
            buf.read_ranges(&check.ranges(), |i, got| {
                if first.is_none() {
                    match check.check(i, got) {
                        Ok(n) => bytes += n,
                        Err(m) => first = Some(m),
                    }
                }
            })
            .expect("read the checked ranges");
            first.map_or(Ok(bytes), Err)
        };
        assert_eq!(verify(&d_buf), Ok(whole.bytes), "{layout:?} in {place}: same bytes verified");
        assert!(whole.bytes > 0);
        // One wrong byte inside a checked range is found, at its offset in the pool.
        let at = check.ranges()[check.ranges().len() / 2].start + 5;
        d_buf.write_ranges(&[Range { start: at, end: at + 1 }], |_, b| b[0] ^= 0xFF).expect("corrupt");
        let m = verify(&d_buf).expect_err("corruption caught");
        assert_eq!(m.offset, at, "{layout:?} in {place}: {m}");
        let mut bad = d_host.clone();
        bad[at as usize] ^= 0xFF;
        let slice = VerifyPlan::new(&dg, &dg.regions(), &bp, 1, false, 4, seed, 1)
            .verify_in(&bad)
            .expect_err("caught");
        assert_eq!(slice, m, "both forms report the same mismatch");
    }
}

#[test]
fn fill_and_verify_plans_match_the_slice_forms_in_host_memory() {
    plans_match_the_slice_forms(MemPlace::Host);
}

#[test]
fn fill_and_verify_plans_match_the_slice_forms_in_device_memory() {
    let place = MemPlace::Cuda { device: 0 };
    if let Err(e) = place.check_available() {
        skip(Part::Gpu, &format!("device memory: {e}"));
        return;
    }
    plans_match_the_slice_forms(place);
}
