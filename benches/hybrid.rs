//! Hybrid planning speed against pure attention, per descriptor (issue 25's target: hybrid
//! plans within 0.9x of pure-attention plans). Each bench plans one whole request for every
//! decode rank from scratch (blocks clipped, TP mapping, every (local, remote, len) pair
//! materialised with its label), so the figure is descriptors per second of a full plan:
//!
//! - `attention/llama-3.1-8b`: `layouts::read_plan::Planner` (the uniform planner), P2 -> D2 at
//!   32k tokens, block 16;
//! - `hybrid/gpt-oss-120b`: sliding-window and full-attention groups, P1 -> D2 at 32k tokens;
//! - `hybrid/qwen3-next-80b-a3b`: GDN state and full attention, P1 -> D2 at 32k tokens;
//! - `hybrid/qwen3-next-80b-a3b-128k`: the same at 128k tokens (4x the attention descriptors,
//!   the same state descriptors and per-request work);
//! - `attention/llama-3.1-8b-as-qwen3-next`: the uniform planner again, on a request of as
//!   many descriptors as the Qwen3-Next plan (its hybrid blocks are 34x larger, so 32k tokens
//!   make a small plan, where the fixed cost of a request weighs more per descriptor): the
//!   like-with-like reference for that plan; `-128k` likewise for the 128k plan.
//!
//! And the fill by meaning a hybrid bench's prefill writes and decode checks
//! (`fill_by_meaning`): prefill rank 0's blocks of a 2,048-token Qwen3-Next request at P4 -> D2
//! (`bench-configs/hybrid-qwen3-next.toml`), range by range into one buffer reused (so the
//! figure is the pattern's cost, not memory's), against `memset` of the same ranges.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvx::layouts::alloc::{AllocPattern, allocate};
use kvx::layouts::compat::PairSpec;
use kvx::layouts::hybrid::blocks::RequestShape;
use kvx::layouts::hybrid::coverage::RequestFill;
use kvx::layouts::hybrid::geometry::kv_groups;
use kvx::layouts::hybrid::{
    GdnPrefillBackend, HybridEngineSpec, HybridPairSpec, HybridPlanner, HybridRequest, preset,
};
use kvx::layouts::read_plan::{Planner, RequestBlocks, RequestIds};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model;
use kvx::vocab::knob::Knob;

const TOKENS: u32 = 32_768;

fn hybrid(name: &str, tokens: u32) -> (HybridPlanner, HybridRequest) {
    let model = preset(name).expect("hybrid preset");
    let pool = kv_groups(&model).len() as u32 * (tokens / 16 + 2) + 2;
    let config = HybridPairSpec {
        model,
        p: HybridEngineSpec::new(1, pool),
        d: HybridEngineSpec::new(2, pool),
        permute_local_kv: false,
        state_slices: Default::default(),
        host_copy: Default::default(),
        push_attention: Default::default(),
        stated: Default::default(),
    };
    let planner = HybridPlanner::new(&config).expect("accepted pair");
    let req = HybridRequest::simulated(&planner, tokens, 0);
    (planner, req)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_32k_per_descriptor");
    g.sample_size(20);

    let shape = model::preset("llama-3.1-8b").expect("preset");
    let blocks = TOKENS / 16;
    let engine = |tp| EngineSpec { tp, block_tokens: 16, num_blocks: blocks * 2, layout: Layout::Lbhnc };
    let pair = PairSpec {
        version: Layout::Lbhnc.version(),
        model: shape,
        p: engine(2),
        d: engine(2),
        permute: false,
    };
    let map = pair.validate().expect("valid pair");
    let planners: Vec<Planner> = (0..2).map(|d| Planner::new(&pair, &map, d).expect("planner")).collect();
    let ids = RequestIds { p_request_id: "req-P".into(), d_request_id: "req-D".into() };
    let uniform = |g: &mut criterion::BenchmarkGroup<'_, _>, name: &str, n_blocks: u32| {
        let req = RequestBlocks {
            local: allocate(AllocPattern::Random, n_blocks, blocks * 2, 1, Knob::DNumBlocks).expect("alloc"),
            remote: allocate(AllocPattern::Random, n_blocks, blocks * 2, 2, Knob::PNumBlocks).expect("alloc"),
        };
        let n: usize = planners.iter().map(|p| p.plan(&req, &ids).expect("plan").descriptor_count()).sum();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                for p in &planners {
                    black_box(p.plan(black_box(&req), &ids).expect("plan"));
                }
            })
        });
        n
    };
    // Pure attention: the uniform planner, every decode rank.
    let per_block = uniform(&mut g, "attention/llama-3.1-8b", blocks) / blocks as usize;

    let mut qwen_descriptors = Vec::new();
    for (name, tokens, label) in [
        ("gpt-oss-120b", TOKENS, ""),
        ("qwen3-next-80b-a3b", TOKENS, ""),
        // The same model at 4x the tokens: the per-request cost spread over 4x the attention
        // descriptors (how far the rate is fixed cost, not per-descriptor cost).
        ("qwen3-next-80b-a3b", TOKENS * 4, "-128k"),
    ] {
        let (planner, req) = hybrid(name, tokens);
        let plan = planner.plan(&req, "req-P").expect("plan");
        let n: usize = plan.d_ranks.iter().map(|d| d.descriptor_count()).sum();
        if name.starts_with("qwen3-next") {
            qwen_descriptors.push((n, label));
        }
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("hybrid/{name}{label}"), |b| {
            b.iter(|| black_box(planner.plan(black_box(&req), "req-P").expect("plan")))
        });
    }
    // The same planner on requests the size of each Qwen3-Next plan (whole blocks: at least
    // as many descriptors).
    for (n, label) in qwen_descriptors {
        let blocks = u32::try_from(n.div_ceil(per_block)).expect("small request");
        uniform(&mut g, &format!("attention/llama-3.1-8b-as-qwen3-next{label}"), blocks);
    }
    g.finish();
}

fn fill(c: &mut Criterion) {
    let tokens = 2048;
    let config = HybridPairSpec {
        model: preset("qwen3-next-80b-a3b").expect("preset"),
        // Triton GDN prefill, as bench-configs/hybrid-qwen3-next.toml (FlashInfer's 320- and
        // 576-token blocks do not divide).
        p: HybridEngineSpec { gdn_prefill: GdnPrefillBackend::Triton, ..HybridEngineSpec::new(4, 97) },
        d: HybridEngineSpec { gdn_prefill: GdnPrefillBackend::Triton, ..HybridEngineSpec::new(2, 49) },
        permute_local_kv: false,
        state_slices: Default::default(),
        host_copy: Default::default(),
        push_attention: Default::default(),
        stated: Default::default(),
    };
    let planner = HybridPlanner::new(&config).expect("accepted pair");
    let shape = RequestShape::of(&planner.p);
    let flat: Vec<u32> = (1..=shape.blocks(tokens, 0)).collect();
    let lists = shape.lists(tokens, 0, &flat).expect("lists");
    let request = RequestFill::new(&planner.p, 0, &lists, shape.tokens(tokens, 0).p_computed_tokens, 7);
    let ranges = request.ranges();
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let longest = ranges.iter().map(|r| r.end - r.start).max().unwrap_or(0) as usize;
    let mut buf = vec![0u8; longest];
    let mut g = c.benchmark_group("fill_by_meaning");
    g.sample_size(20);
    g.throughput(Throughput::Bytes(total));
    g.bench_function("hybrid/qwen3-next-80b-a3b-p4-rank0", |b| {
        b.iter(|| {
            for (i, r) in ranges.iter().enumerate() {
                black_box(request.fill(i, &mut buf[..(r.end - r.start) as usize]));
            }
        })
    });
    g.bench_function("memset/same-ranges", |b| {
        b.iter(|| {
            for r in &ranges {
                black_box(&mut buf[..(r.end - r.start) as usize]).fill(0x5a);
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench, fill);
criterion_main!(benches);
