//! Shared-storage transport throughput against `dd`-style baselines on the same
//! directory, measured in the same run.
//!
//! Request: Llama-3.1-70B, 2048 tokens (128 blocks of 16), LBHNC, P tp 8 -> D tp 2, random
//! block tables on both sides. kvx publishes the request from all 8 prefill ranks (8 files
//! of 80 MiB) and fetches it into both decode ranks (each reads 4 files through its plan:
//! 8 KiB head slices landing at a 32 KiB stride). Rank memory is kvx's own host buffers
//! (`HostBuffer`: page-aligned `mmap`, 4 KiB pages unless `--pages thp`).
//!
//! Two kvx-free references move the same bytes between the same memory:
//! - `dd`: one file of the same total size, 8 MiB per `write`/`read` call, one thread, like
//!   `dd bs=8M`: contiguous source and destination.
//! - `same pieces`: one file, `pwritev`/`preadv` of exactly the plan's pieces (the prefill
//!   blocks in request order; the decode pairs in posting order): the ceiling for any
//!   transport that must gather and scatter this layout, without kvx's files, headers,
//!   naming, validation or planning.
//!
//! Page cache, handled the same way for all three:
//! - `buffered`: no fsync; reads hit the page cache the writes just filled (a decode on
//!   the same host right after prefill).
//! - `buffered+fsync`: writes include `fdatasync`; the written files are then dropped from
//!   the page cache (`posix_fadvise(DONTNEED)` per file) so reads come from the disk.
//! - `direct`, `direct+fsync`: `O_DIRECT` everywhere (all buffers are page-aligned); kvx
//!   stages its 8 KiB pieces (the default `direct_min_piece_bytes`); `direct-inplace`
//!   (not run by default) makes kvx read and write them in place instead.
//!
//! Interleaved repetitions (the order rotates each repetition), medians.
//!
//! `cargo bench --bench storage -- [--dir DIR] [--reps N] [--tokens N] [--modes a,b]
//! [--pattern random|contiguous|fragmented] [--pages normal|thp] [--samples] [--verbose]`
//! (default DIR: a temp dir under the target directory, so on the project's disk).

use std::fs::{self, File};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvx::layouts::alloc::{AllocPattern, allocate};
use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{DRankPlan, Planner, RequestBlocks, RequestIds};
use kvx::layouts::verify::{VerifyPlan, fill_request};
use kvx::layouts::{EngineSpec, Layout, Region};
use kvx::settings::model;
use kvx::transfer::memory::{HostBuffer, PageSize};
use kvx::transfer::storage::io::{carve, preadv_all, pwritev_all};
use kvx::transfer::storage::{StorageFetcher, StorageOptions, StoragePublisher};
use kvx::vocab::knob::Knob;

const ENGINE: &str = "bench-prefill";
const CHUNK: usize = 8 << 20;

struct Args {
    dir: Option<PathBuf>,
    reps: usize,
    tokens: u32,
    modes: Vec<String>,
    pattern: AllocPattern,
    pages: PageSize,
    /// Print every sample, not only medians.
    samples: bool,
    /// Print each fetch's statistics.
    verbose: bool,
}

fn args() -> Args {
    let mut a = Args {
        dir: None,
        reps: 5,
        tokens: 2048,
        modes: ["buffered", "buffered+fsync", "direct", "direct+fsync"].map(String::from).to_vec(),
        pattern: AllocPattern::Random,
        pages: PageSize::Normal,
        samples: false,
        verbose: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--dir" => a.dir = it.next().map(PathBuf::from),
            "--reps" => a.reps = it.next().and_then(|v| v.parse().ok()).expect("--reps N"),
            "--tokens" => a.tokens = it.next().and_then(|v| v.parse().ok()).expect("--tokens N"),
            "--modes" => a.modes = it.next().expect("--modes a,b").split(',').map(String::from).collect(),
            "--pattern" => a.pattern = it.next().and_then(|v| v.parse().ok()).expect("--pattern P"),
            "--pages" => {
                a.pages = match it.next().as_deref() {
                    Some("thp") => PageSize::Transparent,
                    _ => PageSize::Normal,
                }
            }
            "--samples" => a.samples = true,
            "--verbose" => a.verbose = true,
            // cargo bench passes --bench; anything else is a filter this bench ignores.
            _ => {}
        }
    }
    a
}

#[derive(Clone, Copy)]
struct Mode {
    direct: bool,
    /// O_DIRECT straight into rank memory even for small pieces (`direct_min_piece_bytes = 0`).
    in_place: bool,
    fsync: bool,
    cold_read: bool,
}

fn mode(name: &str) -> Mode {
    match name {
        "buffered" => Mode { direct: false, in_place: false, fsync: false, cold_read: false },
        "buffered+fsync" => Mode { direct: false, in_place: false, fsync: true, cold_read: true },
        "direct" => Mode { direct: true, in_place: false, fsync: false, cold_read: false },
        "direct+fsync" => Mode { direct: true, in_place: false, fsync: true, cold_read: false },
        "direct-inplace" => Mode { direct: true, in_place: true, fsync: false, cold_read: false },
        other => panic!("unknown mode {other}"),
    }
}

struct Scenario {
    pair: PairSpec,
    p_regions: Vec<Region>,
    req: RequestBlocks,
    p_allocs: Vec<HostBuffer>,
    d_plans: Vec<(Planner, DRankPlan)>,
    d_allocs: Vec<HostBuffer>,
    /// Payload bytes of one prefill rank.
    per_rank: u64,
    bytes: u64,
}

fn scenario(tokens: u32, pattern: AllocPattern, pages: PageSize) -> Scenario {
    let model = model::preset("llama-3.1-70b").expect("preset");
    let blocks = tokens / 16;
    // The pool is the request: allocation bytes = payload bytes, so the references move
    // exactly the memory kvx moves.
    let engine = |tp| EngineSpec { tp, block_tokens: 16, num_blocks: blocks, layout: Layout::Lbhnc };
    let pair =
        PairSpec { version: Layout::Lbhnc.version(), model, p: engine(8), d: engine(2), permute: false };
    let map = pair.validate().expect("valid pair");
    let req = RequestBlocks {
        local: allocate(pattern, blocks, blocks, 1, Knob::DNumBlocks).expect("alloc"),
        remote: allocate(pattern, blocks, blocks, 2, Knob::PNumBlocks).expect("alloc"),
    };
    let p_regions = pair.p_geometry(0).regions();
    let p_allocs: Vec<HostBuffer> = (0..pair.p.tp)
        .map(|r| {
            let g = pair.p_geometry(r);
            let mut a = HostBuffer::alloc(g.total_bytes() as usize, pages).expect("prefill memory");
            fill_request(&g, &g.regions(), &req.remote, 7, a.as_mut_slice());
            a
        })
        .collect();
    let ids = RequestIds { p_request_id: "bench".into(), d_request_id: "d".into() };
    let d_plans: Vec<(Planner, DRankPlan)> = (0..pair.d.tp)
        .map(|d| {
            let planner = Planner::new(&pair, &map, d).expect("planner");
            let plan = planner.plan(&req, &ids).expect("plan");
            (planner, plan)
        })
        .collect();
    let d_allocs: Vec<HostBuffer> = (0..pair.d.tp)
        .map(|d| {
            let mut a =
                HostBuffer::alloc(pair.d_geometry(d).total_bytes() as usize, pages).expect("decode memory");
            a.as_mut_slice().fill(1);
            a
        })
        .collect();
    let bytes: u64 = d_plans.iter().map(|(_, p)| p.bytes()).sum();
    let per_rank = p_regions.iter().map(|r| r.block_len).sum::<u64>() * u64::from(blocks);
    // The `same pieces` reference reads each prefill rank's payload once, in posting order.
    assert_eq!(per_rank * u64::from(pair.p.tp), bytes, "every prefill byte is read exactly once");
    for (_, plan) in &d_plans {
        for read in &plan.reads {
            assert_eq!(read.pairs.iter().map(|p| p.len).sum::<u64>(), per_rank, "whole-rank reads");
        }
    }
    Scenario { pair, p_regions, req, p_allocs, d_plans, d_allocs, per_rank, bytes }
}

fn drop_cached(path: &Path) {
    let f = File::open(path).expect("open for fadvise");
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).expect("fadvise");
}

fn open_opts(m: Mode) -> fs::OpenOptions {
    let mut o = fs::OpenOptions::new();
    if m.direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o
}

/// kvx's endpoints, long-lived as in a serving engine: one publisher per prefill rank,
/// one fetcher per decode rank.
struct Kvx {
    pubs: Vec<StoragePublisher>,
    fetchers: Vec<StorageFetcher>,
    verbose: bool,
}

impl Kvx {
    fn new(s: &Scenario, opts: &StorageOptions, verbose: bool) -> Self {
        Kvx {
            pubs: (0..s.pair.p.tp)
                .map(|r| StoragePublisher::new(opts.clone(), ENGINE, r).expect("publisher"))
                .collect(),
            fetchers: (0..s.pair.d.tp).map(|_| StorageFetcher::new(opts.clone()).expect("fetcher")).collect(),
            verbose,
        }
    }
}

/// kvx: publish from every prefill rank, then fetch into every decode rank.
fn run_kvx(s: &mut Scenario, k: &mut Kvx, m: Mode, id: &str, verify: bool) -> (Duration, Duration) {
    let t = Instant::now();
    let mut paths = Vec::new();
    for (p, alloc) in k.pubs.iter_mut().zip(&s.p_allocs) {
        paths.push(p.publish(id, &s.p_regions, &s.req.remote, alloc.as_slice()).expect("publish").path);
    }
    let write = t.elapsed();
    if m.cold_read {
        paths.iter().for_each(|p| drop_cached(p));
    }
    let t = Instant::now();
    for (((_, plan), alloc), f) in s.d_plans.iter().zip(&mut s.d_allocs).zip(&mut k.fetchers) {
        let st = f
            .fetch(
                ENGINE,
                id,
                &plan.reads,
                &s.p_regions,
                &s.req.remote,
                alloc.as_mut_slice(),
                Duration::from_secs(60),
            )
            .expect("fetch");
        if k.verbose {
            eprintln!("{st:?}");
        }
    }
    let read = t.elapsed();
    if verify {
        for (d, ((planner, _), alloc)) in s.d_plans.iter().zip(&s.d_allocs).enumerate() {
            let g = s.pair.d_geometry(d as u32);
            let bp = planner.pair_blocks(&s.req).expect("pairs");
            VerifyPlan::new(&g, &g.regions(), &bp, 1, false, 16, 7, 16)
                .verify_in(alloc.as_slice())
                .expect("verified");
        }
    }
    for p in &mut k.pubs {
        p.release(id).expect("release");
    }
    (write, read)
}

/// `dd`: one file, 8 MiB calls, contiguous source and destination.
fn run_dd(s: &mut Scenario, dir: &Path, m: Mode) -> (Duration, Duration) {
    let path = dir.join("dd.bin");
    let t = Instant::now();
    let mut f = open_opts(m).write(true).create(true).truncate(true).open(&path).expect("create");
    for a in &s.p_allocs {
        for c in a.as_slice().chunks(CHUNK) {
            f.write_all(c).expect("write");
        }
    }
    if m.fsync {
        f.sync_data().expect("fdatasync");
    }
    drop(f);
    let write = t.elapsed();
    if m.cold_read {
        drop_cached(&path);
    }
    let t = Instant::now();
    let mut f = open_opts(m).read(true).open(&path).expect("open");
    for a in &mut s.d_allocs {
        for c in a.as_mut_slice().chunks_mut(CHUNK) {
            f.read_exact(c).expect("read");
        }
    }
    drop(f);
    let read = t.elapsed();
    fs::remove_file(&path).expect("remove");
    (write, read)
}

/// `same pieces`: one file, gathered from the prefill blocks in request order and scattered
/// into the decode pairs in posting order.
fn run_pieces(s: &mut Scenario, dir: &Path, m: Mode) -> (Duration, Duration) {
    let path = dir.join("pieces.bin");
    let t = Instant::now();
    let f = open_opts(m).write(true).create(true).truncate(true).open(&path).expect("create");
    for (r, a) in s.p_allocs.iter().enumerate() {
        let mem = a.as_slice();
        let mut ios: Vec<IoSlice<'_>> = s
            .p_regions
            .iter()
            .flat_map(|reg| {
                s.req.remote.iter().map(move |&b| {
                    let off = reg.block_off(u64::from(b)) as usize;
                    IoSlice::new(&mem[off..off + reg.block_len as usize])
                })
            })
            .collect();
        pwritev_all(&f, &mut ios, r as u64 * s.per_rank).expect("write");
    }
    if m.fsync {
        f.sync_data().expect("fdatasync");
    }
    drop(f);
    let write = t.elapsed();
    if m.cold_read {
        drop_cached(&path);
    }
    let t = Instant::now();
    let f = open_opts(m).read(true).open(&path).expect("open");
    for ((_, plan), a) in s.d_plans.iter().zip(&mut s.d_allocs) {
        let pieces: Vec<(u64, u64)> =
            plan.reads.iter().flat_map(|r| &r.pairs).map(|p| (p.local, p.len)).collect();
        let mut dst = carve(a.as_mut_slice(), &pieces).expect("disjoint pairs");
        let mut at = 0;
        for read in &plan.reads {
            let n = read.pairs.len();
            let mut ios: Vec<IoSliceMut<'_>> =
                dst[at..at + n].iter_mut().map(|d| IoSliceMut::new(d)).collect();
            preadv_all(&f, &mut ios, u64::from(read.p_rank) * s.per_rank).expect("read");
            at += n;
        }
    }
    drop(f);
    let read = t.elapsed();
    fs::remove_file(&path).expect("remove");
    (write, read)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn fs_type(dir: &Path) -> String {
    let canon = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && canon.starts_with(f[1]))
                .then(|| (f[1].len(), format!("{} on {} ({})", f[0], f[1], f[2])))
        })
        .max()
        .map_or_else(|| "unknown".into(), |(_, s)| s)
}

fn main() {
    let a = args();
    let tmp = match &a.dir {
        Some(d) => {
            fs::create_dir_all(d).expect("create --dir");
            tempfile::tempdir_in(d).expect("tempdir")
        }
        None => tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir"),
    };
    let dir = tmp.path().to_path_buf();
    let mut s = scenario(a.tokens, a.pattern, a.pages);
    println!(
        "storage bench: Llama-3.1-70B, {} tokens, LBHNC, P tp 8 -> D tp 2, {} block tables, {}; {} MiB per \
         direction; {} reps, medians; dir {} [{}]",
        a.tokens,
        a.pattern,
        s.p_allocs[0].page_size(),
        s.bytes >> 20,
        a.reps,
        dir.display(),
        fs_type(&dir)
    );
    println!(
        "{:<15} | {:>9} {:>9} {:>9} {:>6} {:>6} | {:>9} {:>9} {:>9} {:>6} {:>6}",
        "GB/s", "write kvx", "dd", "pieces", "/dd", "/pcs", "read kvx", "dd", "pieces", "/dd", "/pcs"
    );
    for name in &a.modes {
        let m = mode(name);
        let mut opts = StorageOptions::new(&dir);
        opts.direct_io = m.direct;
        opts.fsync = m.fsync;
        if m.in_place {
            opts.direct_min_piece_bytes = 0;
        }
        let mut kvx = Kvx::new(&s, &opts, a.verbose);
        // One unmeasured, verified round warms buffers and filesystem metadata.
        run_kvx(&mut s, &mut kvx, m, "warmup", true);
        run_dd(&mut s, &dir, m);
        run_pieces(&mut s, &dir, m);
        let mut times: [(Vec<Duration>, Vec<Duration>); 3] = Default::default();
        for rep in 0..a.reps {
            for k in 0..3 {
                let which = (rep + k) % 3;
                let (w, r) = match which {
                    0 => run_kvx(&mut s, &mut kvx, m, &format!("req-{rep}"), false),
                    1 => run_dd(&mut s, &dir, m),
                    _ => run_pieces(&mut s, &dir, m),
                };
                times[which].0.push(w);
                times[which].1.push(r);
            }
        }
        if a.samples {
            for (label, (w, r)) in ["kvx", "dd", "pieces"].iter().zip(&times) {
                let g = |v: &Vec<Duration>| -> Vec<String> {
                    v.iter().map(|d| format!("{:.2}", s.bytes as f64 / d.as_secs_f64() / 1e9)).collect()
                };
                eprintln!("{name} {label}: write {:?} read {:?}", g(w), g(r));
            }
        }
        let gbps = |d: Duration| s.bytes as f64 / d.as_secs_f64() / 1e9;
        let [kvx, dd, pcs] = times.map(|(w, r)| (gbps(median(w)), gbps(median(r))));
        println!(
            "{:<15} | {:>9.2} {:>9.2} {:>9.2} {:>6.2} {:>6.2} | {:>9.2} {:>9.2} {:>9.2} {:>6.2} {:>6.2}",
            name,
            kvx.0,
            dd.0,
            pcs.0,
            kvx.0 / dd.0,
            kvx.0 / pcs.0,
            kvx.1,
            dd.1,
            pcs.1,
            kvx.1 / dd.1,
            kvx.1 / pcs.1
        );
    }
}
