//! cuda-batch posting on the host: what a decode rank does per request before its one kernel
//! launch (`--batch-launch rank`), for the README's P8->D2 Llama-3.1-70B request at 2048 tokens
//! (80 layers, block 16: 10,240 descriptors of 8 KiB from each of a decode rank's 4 prefill
//! ranks, 40,960 in all). `pack_4_peers` bounds-checks and merges them into the batch's
//! (dst, src, size) arrays; `gather_into` writes the kernel's 24-byte descriptors (what goes
//! to pinned memory and is uploaded). `reference/copy_pairs` copies the plan's pairs into the
//! same 24-byte records with no check and no arithmetic, and `reference/store_same_bytes`
//! writes them with no load: the floors of this machine, measured in the same run.
//! `grid_pack_4_peers` is `--batch-descriptors device`'s host work for the same request: the
//! four READs' region tables and the block pairs checked and written as the upload (the GPU
//! then makes the 40,960 descriptors), per descriptor against `pack_4_peers`.
//! The H200 run (results/gpu-nvidia-h200-2026-11-27.json) spent about 290 us posting per
//! request there, a quarter of the request's transfer span.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx::layouts::alloc::{AllocPattern, allocate};
use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Pair, Planner, RegionXfer, RequestBlocks};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model;
use kvx::transfer::cuda_batch::{CopyBatch, GATHER_PIECE, GridBatch, Span, gather_into, gather_pieces};
use kvx::vocab::knob::Knob;

fn bench(c: &mut Criterion) {
    let model = model::preset("llama-3.1-70b").expect("preset");
    let blocks = 2048 / 16;
    let engine = |tp| EngineSpec { tp, block_tokens: 16, num_blocks: 1024, layout: Layout::Lbhnc };
    let pair =
        PairSpec { version: Layout::Lbhnc.version(), model, p: engine(8), d: engine(2), permute: false };
    let map = pair.validate().expect("valid pair");
    let planner = Planner::new(&pair, &map, 0).expect("planner");
    let req = RequestBlocks {
        local: allocate(AllocPattern::Random, blocks, 1024, 1, Knob::DNumBlocks).expect("alloc"),
        remote: allocate(AllocPattern::Random, blocks, 1024, 2, Knob::PNumBlocks).expect("alloc"),
    };
    let bp = planner.pair_blocks(&req).expect("pairs");
    let mut reads = vec![Vec::<Pair>::new(); planner.reads.len()];
    planner.plan_into(&bp, &mut reads);
    let n: usize = reads.iter().map(Vec::len).sum();
    assert_eq!((reads.len(), n), (4, 40_960), "a decode rank's share of the request");
    // Pools as large as the engines' (1024 blocks), at made-up device addresses.
    let pool = reads.iter().flatten().map(|p| p.local.max(p.remote) + p.len).max().unwrap_or(0);
    let local = Span { base: 0x7f00_0000_0000, len: pool };
    let peers: Vec<Span> =
        (0..4).map(|i| Span { base: 0x7e00_0000_0000 + i * (1 << 36), len: pool }).collect();

    let mut g = c.benchmark_group("cuda_batch_post_p8_d2_llama70b_2048");
    g.throughput(Throughput::Elements(n as u64));
    let mut batch = CopyBatch::default();
    g.bench_function("pack_4_peers", |b| {
        b.iter(|| {
            for (i, (r, &peer)) in reads.iter().zip(&peers).enumerate() {
                let pairs = r.iter().copied();
                if i == 0 { batch.pack(pairs, local, peer) } else { batch.add(pairs, local, peer) }
                    .expect("in bounds");
            }
            black_box(batch.copies())
        })
    });
    let jobs: Vec<(&[RegionXfer], Span)> =
        planner.reads.iter().zip(&peers).map(|(r, &s)| (r.regions.as_slice(), s)).collect();
    let mut grid = GridBatch::default();
    g.bench_function("grid_pack_4_peers", |b| {
        b.iter(|| {
            grid.pack(black_box(&jobs), &bp.local, &bp.remote, local).expect("in bounds");
            black_box(grid.words().len())
        })
    });
    assert_eq!(grid.descriptors() as usize, n, "the grid makes the plan's descriptors");
    let mut words = vec![0u64; 3 * gather_pieces(&batch, GATHER_PIECE)];
    g.bench_function("gather_into", |b| {
        b.iter(|| black_box(gather_into(black_box(&batch), GATHER_PIECE, &mut words)))
    });
    g.bench_function("reference/copy_pairs", |b| {
        b.iter(|| {
            let mut o = 0;
            for r in &reads {
                for p in r {
                    words[o..o + 3].copy_from_slice(&[p.local, p.remote, p.len]);
                    o += 3;
                }
            }
            black_box(&words);
        })
    });
    g.bench_function("reference/store_same_bytes", |b| {
        b.iter(|| {
            for (i, w) in words.chunks_exact_mut(3).enumerate() {
                w.copy_from_slice(&[i as u64, i as u64, 8192]);
            }
            black_box(&words);
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
