//! Planner speed: a 128k-token Llama-3.1-70B request (80 layers, 8 KV heads, block 16,
//! 8192 blocks) from P tp 8 to D tp 2 with a random block table — 2,621,440 descriptor
//! pairs for decode rank 0. vLLM 0.33's own decode-side preparation of this request ran at
//! 85-104 M descriptor ids/s on this machine; the target is 2x that materialising full
//! (local, remote, len) pairs on one core. `reference/store_same_bytes` writes the same
//! number of bytes with no arithmetic: the store-bandwidth ceiling, measured in the same run.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx::layouts::alloc::{AllocPattern, allocate};
use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{BlockPairs, Pair, Planner, RequestBlocks};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model;
use kvx::vocab::knob::Knob;

const TOKENS: u32 = 131_072;

fn setup(layout: Layout, pattern: AllocPattern, p_tp: u32, d_tp: u32) -> (Planner, BlockPairs) {
    let model = model::preset("llama-3.1-70b").expect("preset");
    let blocks = TOKENS / 16;
    let engine = |tp| EngineSpec { tp, block_tokens: 16, num_blocks: blocks * 2, layout };
    let pair =
        PairSpec { version: layout.version(), model, p: engine(p_tp), d: engine(d_tp), permute: false };
    let map = pair.validate().expect("valid pair");
    let planner = Planner::new(&pair, &map, 0).expect("planner");
    let req = RequestBlocks {
        local: allocate(pattern, blocks, blocks * 2, 1, Knob::DNumBlocks).expect("alloc"),
        remote: allocate(pattern, blocks, blocks * 2, 2, Knob::PNumBlocks).expect("alloc"),
    };
    let bp = planner.pair_blocks(&req).expect("pairs");
    (planner, bp)
}

fn bench(c: &mut Criterion) {
    let (planner, bp) = setup(Layout::Lbhnc, AllocPattern::Random, 8, 2);
    let n = planner.pairs_per_read(&bp) * planner.reads.len();
    assert_eq!(n, 2_621_440, "the issue's request size");
    let mut g = c.benchmark_group("plan_128k_llama70b_p8_d2_random");
    g.throughput(Throughput::Elements(n as u64));
    g.sample_size(30);
    let mut bufs = vec![Vec::<Pair>::new(); planner.reads.len()];
    g.bench_function("materialise_reused_buffers", |b| {
        b.iter(|| {
            planner.plan_into(black_box(&bp), &mut bufs);
            black_box(&bufs);
        })
    });
    g.bench_function("materialise_fresh_buffers", |b| {
        b.iter(|| {
            let mut fresh = vec![Vec::<Pair>::new(); planner.reads.len()];
            planner.plan_into(black_box(&bp), &mut fresh);
            black_box(fresh)
        })
    });
    g.bench_function("stream_no_materialise", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for (_, p) in planner.stream(black_box(&bp)) {
                sum = sum.wrapping_add(p.local ^ p.remote).wrapping_add(p.len);
            }
            black_box(sum)
        })
    });
    g.bench_function("coalesce", |b| b.iter(|| black_box(planner.coalesced(black_box(&bp)))));
    g.bench_function("coalesced_count", |b| b.iter(|| black_box(planner.coalesced_counts(black_box(&bp)))));
    let mut flat = vec![Pair::default(); n];
    g.bench_function("reference/store_same_bytes", |b| {
        b.iter(|| {
            for (i, p) in flat.iter_mut().enumerate() {
                *p = Pair { local: i as u64, remote: i as u64, len: 8192 };
            }
            black_box(&flat);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("plan_128k_llama70b_p8_d8_contiguous");
    for layout in [Layout::Lbhnc, Layout::Blhnc] {
        let (planner, bp) = setup(layout, AllocPattern::Contiguous, 8, 8);
        g.throughput(Throughput::Elements((planner.pairs_per_read(&bp) * planner.reads.len()) as u64));
        g.sample_size(20);
        g.bench_function(format!("coalesce_{layout}"), |b| {
            b.iter(|| black_box(planner.coalesced(black_box(&bp))))
        });
    }
    g.finish();
}

criterion_group!(benches, bench, pattern);
criterion_main!(benches);

/// The byte pattern every prefill rank writes and decode rank checks, against a plain
/// `memset`-like store of the same bytes (the ceiling) in the same run.
fn pattern(c: &mut Criterion) {
    use kvx::layouts::geometry::{Axis, BlockContent};
    use kvx::layouts::pattern::{BlockOrigin, fill_block, verify_block};
    // One Llama-3.1-70B tp-8 page: 16 tokens x K|V x 256 bytes; 4096 of them = 32 MiB.
    let content = BlockContent {
        layer: Some(3),
        head: None,
        kv: None,
        axes: vec![(Axis::Token, 16), (Axis::Kv, 2), (Axis::Bytes, 256)],
    };
    let len = content.len() as usize;
    let blocks = 4096;
    let mut buf = vec![0u8; len * blocks];
    let origin = |i: usize| BlockOrigin { seed: 7, first_global_head: 0, first_token: (i * 16) as u32 };
    let mut g = c.benchmark_group("pattern_32MiB");
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.sample_size(10);
    g.bench_function("fill", |b| {
        b.iter(|| {
            for (i, chunk) in buf.chunks_exact_mut(len).enumerate() {
                fill_block(&content, origin(i), chunk);
            }
        })
    });
    g.bench_function("verify_full", |b| {
        b.iter(|| {
            for (i, chunk) in buf.chunks_exact(len).enumerate() {
                black_box(verify_block(&content, origin(i), chunk, 1).is_ok());
            }
        })
    });
    g.bench_function("reference/store_same_bytes", |b| b.iter(|| buf.fill(black_box(0x5a))));
    g.finish();
}
