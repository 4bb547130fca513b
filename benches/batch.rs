//! cuda-batch posting on the host: what a decode rank does per request before its one kernel
//! launch (`--batch-launch rank`), for the README's P8->D2 Llama-3.1-70B request at 2048 tokens
//! (80 layers, block 16: 10,240 descriptors of 8 KiB from each of a decode rank's 4 prefill
//! ranks, 40,960 in all). `pack_fill_4_peers` is what the copier does with the gather kernel
//! (`pack_descriptors`): the plan's pairs bounds-checked, runs merged and written as the
//! kernel's 24-byte descriptors straight into the buffer that is uploaded, in one pass (on this
//! thread at this size: `PARALLEL_PACK_PAIRS`); `/pool` packs the four parts on rayon's
//! threads instead. The buffer is reused from run to run, as the copier's pinned slot is. The
//! two passes it replaced, still the batch API's path: `pack_4_peers` packs them into a
//! `CopyBatch`'s (dst, src, size) array, `gather_into` copies that into the upload buffer.
//! `reference/copy_pairs` copies the plan's pairs into the same 24-byte records with no check
//! and no arithmetic (a slice copy per record), and `reference/store_same_bytes` writes them
//! with no load: the floors of this machine, measured in the same run. `grid_pack_4_peers` is
//! `--batch-descriptors device`'s host work for the same request: the four READs' region tables
//! and the block pairs checked and written as the upload (the GPU then makes the 40,960
//! descriptors).
//! After criterion's measurements (a filter argument that matches none skips them) the bench
//! times `pack_fill_4_peers` and `/pool` itself, each in turns with
//! `reference/store_same_bytes`, prints the medians per descriptor, and ends with one line
//! `pack+fill: <R>x store ceiling (<N> descriptors)` for the copier's packing.
//! The H200 run (results/gpu-nvidia-h200-2026-11-27.json) spent about 290 us posting per
//! request there, a quarter of the request's transfer span.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use kvx::layouts::alloc::{AllocPattern, allocate};
use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Pair, Planner, RegionXfer, RequestBlocks};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model;
use kvx::transfer::cuda_batch::{
    CopyBatch, GATHER_PIECE, GridBatch, PARALLEL_PACK_PAIRS, PackThreads, Span, gather_into, gather_pieces,
    pack_descriptors_on,
};
use kvx::vocab::knob::Knob;

/// Criterion's measurements, then the ratio line (returned, printed last).
fn bench(c: &mut Criterion) -> String {
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
    let pack = |batch: &mut CopyBatch| {
        for (i, (r, &peer)) in reads.iter().zip(&peers).enumerate() {
            let pairs = r.iter().copied();
            if i == 0 { batch.pack(pairs, local, peer) } else { batch.add(pairs, local, peer) }
                .expect("in bounds");
        }
        black_box(batch.copies())
    };
    g.bench_function("pack_4_peers", |b| b.iter(|| pack(&mut batch)));
    // Once more outside criterion, so that a run filtered to other benchmarks still has the
    // batch (gather_into's input) and the grid to check.
    pack(&mut batch);
    let jobs: Vec<(&[RegionXfer], Span)> =
        planner.reads.iter().zip(&peers).map(|(r, &s)| (r.regions.as_slice(), s)).collect();
    let mut grid = GridBatch::default();
    g.bench_function("grid_pack_4_peers", |b| {
        b.iter(|| {
            grid.pack(black_box(&jobs), &bp.local, &bp.remote, local).expect("in bounds");
            black_box(grid.words().len())
        })
    });
    grid.pack(&jobs, &bp.local, &bp.remote, local).expect("in bounds");
    assert_eq!(grid.descriptors() as usize, n, "the grid makes the plan's descriptors");
    let mut words = vec![0u64; 3 * gather_pieces(&batch, GATHER_PIECE)];
    let pairs: Vec<(&[Pair], Span)> = reads.iter().map(Vec::as_slice).zip(peers.iter().copied()).collect();
    let pack_fill = |threads: PackThreads, words: &mut [u64]| {
        let packed =
            pack_descriptors_on(threads, black_box(&pairs), local, GATHER_PIECE, words).expect("in bounds");
        black_box(packed.pieces)
    };
    assert_eq!(pack_fill(PackThreads::Auto, &mut words), batch.copies(), "one pass packs what two did");
    // As the copier packs (`pack_descriptors`: on this thread at this size), and with the
    // parts on rayon's pool.
    g.bench_function("pack_fill_4_peers", |b| b.iter(|| pack_fill(PackThreads::Auto, &mut words)));
    g.bench_function("pack_fill_4_peers/pool", |b| b.iter(|| pack_fill(PackThreads::Pool, &mut words)));
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
    g.bench_function("reference/store_same_bytes", |b| b.iter(|| store_same_bytes(&mut words)));
    g.finish();
    let mut store = words.clone();
    let threads = rayon::current_num_threads();
    let pool = ratio(n, || pack_fill(PackThreads::Pool, &mut words), &mut store);
    let copier = ratio(n, || pack_fill(PackThreads::Auto, &mut words), &mut store);
    format!(
        "parts on rayon's pool ({threads} threads): pack+fill {:.2} ns per descriptor, store ceiling {:.2} ns \
         per descriptor: {:.2}x\nas the copier packs (one thread below {PARALLEL_PACK_PAIRS} pairs): \
         pack+fill {:.2} ns per descriptor, store ceiling {:.2} ns per descriptor: {:.2}x\n(medians of \
         {RUNS} runs each, pack+fill and the ceiling in turns)\npack+fill: {:.2}x store ceiling ({n} \
         descriptors)\n",
        pool.0,
        pool.1,
        pool.0 / pool.1,
        copier.0,
        copier.1,
        copier.0 / copier.1,
        copier.0 / copier.1,
    )
}

/// Runs of each in [`ratio`].
const RUNS: usize = 2001;

/// The store ceiling: the descriptors' bytes written with no load.
fn store_same_bytes(words: &mut [u64]) {
    for (i, w) in words.chunks_exact_mut(3).enumerate() {
        w.copy_from_slice(&[i as u64, i as u64, 8192]);
    }
    black_box(words);
}

/// `pack_fill` against the store ceiling, timed here in turns (so both see the same machine
/// load), medians of many runs: nanoseconds per descriptor of each.
fn ratio(n: usize, mut pack_fill: impl FnMut() -> usize, store: &mut [u64]) -> (f64, f64) {
    let (mut fill, mut ceiling) = (Vec::with_capacity(RUNS), Vec::with_capacity(RUNS));
    for _ in 0..RUNS {
        let t = Instant::now();
        black_box(pack_fill());
        fill.push(t.elapsed().as_nanos() as f64);
        let t = Instant::now();
        store_same_bytes(store);
        ceiling.push(t.elapsed().as_nanos() as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] / n as f64
    };
    (median(&mut fill), median(&mut ceiling))
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let ratio = bench(&mut c);
    c.final_summary();
    print!("{ratio}");
}
