//! The shared-storage transport on real files in temp directories: plans of every kind
//! executed through files and verified byte for byte on the decode side, concurrency,
//! atomic visibility, release and lease sweeps, hostile ids, damaged files, timeouts.

use std::fs;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use kvx::layouts::compat::PairSpec;
use kvx::layouts::read_plan::{Pair, Planner, ReadPlan, RequestBlocks, RequestIds};
use kvx::layouts::verify::{VerifyPlan, fill_request};
use kvx::layouts::{EngineSpec, Layout};
use kvx::settings::model::{Dtype, ModelShape};
use kvx::topology::VllmVersion;
use kvx::transfer::storage::io::AlignedBuf;
use kvx::transfer::storage::{
    StorageError, StorageFetcher, StorageOptions, StoragePublisher, request_path, sweep_dir,
};
use proptest::prelude::*;

const ENGINE: &str = "prefill-engine";
/// Generous: only a bug makes a test wait this long.
const TIMEOUT: Duration = Duration::from_secs(20);
/// What decode memory holds before a fetch; bytes outside the plan must keep it.
const SENTINEL: u8 = 0xA5;

fn model(heads: u32, layers: u32) -> ModelShape {
    ModelShape {
        name: "storage-test".into(),
        num_layers: layers,
        num_kv_heads: heads,
        head_dim: 8,
        dtype: Dtype::Bf16,
        mla: None,
    }
}

fn pair(layout: Layout, p_tp: u32, d_tp: u32, bsr: u32) -> PairSpec {
    let p_block = 4;
    PairSpec {
        version: layout.version(),
        model: model(8, 2),
        p: EngineSpec { tp: p_tp, block_tokens: p_block, num_blocks: 31, layout },
        d: EngineSpec { tp: d_tp, block_tokens: p_block * bsr, num_blocks: 31, layout },
        permute: false,
    }
}

/// A request of `n` prefill blocks with `hit` decode blocks already cached (prefix hit),
/// on strided block tables so ids are neither contiguous nor sorted.
fn request(pair: &PairSpec, n: u32, hit: u32) -> RequestBlocks {
    let bsr = pair.block_size_ratio();
    let remote: Vec<u32> = (0..n).map(|i| (i * 7 + 3) % pair.p.num_blocks).collect();
    let n_d = n.div_ceil(bsr);
    let local = (hit.min(n_d)..n_d).map(|i| (i * 5 + 1) % pair.d.num_blocks).collect();
    RequestBlocks { local, remote }
}

/// Fills and publishes the request from every prefill rank.
fn publish_all(
    opts: &StorageOptions,
    pair: &PairSpec,
    engine: &str,
    req_id: &str,
    remote: &[u32],
    seed: u64,
) {
    for r in 0..pair.p.tp {
        let g = pair.p_geometry(r);
        let mut alloc = vec![0u8; g.total_bytes() as usize];
        fill_request(&g, &g.regions(), remote, seed, &mut alloc);
        let mut p = StoragePublisher::new(opts.clone(), engine, r).expect("publisher");
        let st = p.publish(req_id, &g.regions(), remote, &alloc).expect("publish");
        assert_eq!(
            st.payload_bytes,
            g.regions().iter().map(|x| x.block_len).sum::<u64>() * remote.len() as u64
        );
        assert_eq!(fs::metadata(&st.path).expect("published file").len(), st.file_bytes);
    }
}

/// Fetches the request into every decode rank and verifies each byte; returns the bytes
/// verified.
fn fetch_and_verify(
    opts: &StorageOptions,
    pair: &PairSpec,
    engine: &str,
    req_id: &str,
    req: &RequestBlocks,
    seed: u64,
) -> u64 {
    let map = pair.validate().expect("valid pair");
    let ids = RequestIds { p_request_id: req_id.into(), d_request_id: "d".into() };
    let remote_regions = pair.p_geometry(0).regions();
    let mut total = 0;
    for d in 0..pair.d.tp {
        let planner = Planner::new(pair, &map, d).expect("planner");
        let plan = planner.plan(req, &ids).expect("plan");
        let g = pair.d_geometry(d);
        let mut alloc = vec![SENTINEL; g.total_bytes() as usize];
        let mut f = StorageFetcher::new(opts.clone()).expect("fetcher");
        let st = f
            .fetch(engine, req_id, &plan.reads, &remote_regions, &req.remote, &mut alloc, TIMEOUT)
            .unwrap_or_else(|e| panic!("decode rank {d}: {e}"));
        assert_eq!(st.bytes, plan.bytes(), "decode rank {d}: every planned byte delivered");
        assert_eq!(st.files as usize, plan.reads.len());
        let bp = planner.pair_blocks(req).expect("pairs");
        let v = VerifyPlan::new(
            &g,
            &g.regions(),
            &bp,
            pair.block_size_ratio(),
            pair.permutes(),
            pair.p.block_tokens,
            seed,
            1,
        )
        .verify_in(&alloc)
        .unwrap_or_else(|m| panic!("decode rank {d} of {pair:?}: {m}"));
        assert_eq!(v.bytes, plan.bytes(), "decode rank {d}: verified what was planned");
        assert_untouched_outside(&alloc, &plan.reads);
        total += v.bytes;
    }
    total
}

/// Bytes no pair targets still hold the sentinel (no stray writes).
fn assert_untouched_outside(alloc: &[u8], reads: &[ReadPlan]) {
    let mut ranges: Vec<(u64, u64)> =
        reads.iter().flat_map(|r| &r.pairs).map(|p| (p.local, p.local + p.len)).collect();
    ranges.sort_unstable();
    let mut at = 0u64;
    for (a, b) in ranges.into_iter().chain([(alloc.len() as u64, alloc.len() as u64)]) {
        if let Some(i) = alloc[at as usize..a as usize].iter().position(|&x| x != SENTINEL) {
            panic!("byte {} outside every planned range was written", at as usize + i);
        }
        at = at.max(b);
    }
}

fn round_trip(opts: &StorageOptions, pair: &PairSpec, req: &RequestBlocks, req_id: &str, seed: u64) -> u64 {
    publish_all(opts, pair, ENGINE, req_id, &req.remote, seed);
    fetch_and_verify(opts, pair, ENGINE, req_id, req, seed)
}

/// P tp x D tp x layout x block-size ratio x prefix hit; returns (cases run, bytes).
fn grid(opts: &StorageOptions, tps: &[u32]) -> (u32, u64) {
    let (mut cases, mut bytes) = (0, 0);
    for layout in [Layout::Lbhnc, Layout::Blhnc, Layout::FaHnd] {
        for &p_tp in tps {
            for &d_tp in tps {
                for bsr in [1, 2] {
                    let pair = pair(layout, p_tp, d_tp, bsr);
                    if pair.validate().is_err() {
                        continue;
                    }
                    for hit in [0, 1] {
                        let req = request(&pair, 6, hit);
                        let id = format!("grid-{layout}-{p_tp}-{d_tp}-{bsr}-{hit}");
                        bytes += round_trip(opts, &pair, &req, &id, u64::from(p_tp * 100 + d_tp));
                        cases += 1;
                    }
                }
            }
        }
    }
    (cases, bytes)
}

#[test]
fn grid_round_trips_buffered() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (cases, bytes) = grid(&StorageOptions::new(dir.path()), &[1, 2, 4, 8]);
    // 16 TP pairs x 3 layouts at ratio 1, less FA-HND's P > D with P TP >= heads (8 -> 1,
    // 2, 4: vLLM 0.19 refuses), plus ratio 2 where P <= D on plain pages (LBHNC, FA-HND:
    // 10 TP pairs each); each with and without a prefix hit.
    assert_eq!(cases, (16 * 3 - 3 + 10 * 2) * 2);
    assert!(bytes > 0);
}

#[test]
fn grid_round_trips_with_fsync_and_small_direct_chunks() {
    // O_DIRECT needs a disk-backed filesystem: use the target directory rather than /tmp
    // (tmpfs on many machines).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let mut opts = StorageOptions::new(dir.path());
    opts.fsync = true;
    opts.direct_io = true;
    // Chunks smaller than a file and no read-through, so reads span windows and extents.
    opts.direct_chunk_bytes = 8192;
    opts.max_gap_bytes = 0;
    match StoragePublisher::new(opts.clone(), ENGINE, 0) {
        Err(StorageError::DirectIoUnsupported { .. }) => {
            eprintln!("skipped: {} does not support O_DIRECT", dir.path().display());
            return;
        }
        other => {
            other.expect("publisher");
        }
    }
    let (cases, _) = grid(&opts, &[1, 2, 8]);
    assert!(cases >= 30, "{cases}");
    // Reading through holes gives the same bytes.
    opts.max_gap_bytes = 1 << 20;
    let (cases, _) = grid(&opts, &[1, 4]);
    assert!(cases >= 10, "{cases}");
}

/// With 4 KiB-aligned memory and blocks (real head sizes) and no minimum piece size,
/// `O_DIRECT` moves bytes straight between rank memory and the file; with unaligned memory
/// or pieces below the minimum it stages; all verified.
#[test]
fn direct_io_goes_straight_to_aligned_memory_and_stages_otherwise() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let mut opts = StorageOptions::new(dir.path());
    opts.direct_io = true;
    if let Err(StorageError::DirectIoUnsupported { .. }) = StoragePublisher::new(opts.clone(), ENGINE, 0) {
        eprintln!("skipped: {} does not support O_DIRECT", dir.path().display());
        return;
    }
    // 8 KiB per head per block: every head slice and block is 4 KiB-aligned.
    let model = ModelShape { head_dim: 128, ..model(8, 2) };
    for (p_tp, d_tp) in [(2, 1), (2, 4), (1, 1)] {
        let engine = |tp| EngineSpec { tp, block_tokens: 16, num_blocks: 9, layout: Layout::Lbhnc };
        let pair = PairSpec {
            version: VllmVersion::V0_33,
            model: model.clone(),
            p: engine(p_tp),
            d: engine(d_tp),
            permute: false,
        };
        let map = pair.validate().expect("valid");
        let req = RequestBlocks { local: vec![4, 0, 7], remote: vec![8, 2, 5] };
        for (misalign, min_piece) in [(0usize, 0u64), (8, 0), (0, 1 << 20)] {
            opts.direct_min_piece_bytes = min_piece;
            let in_place = misalign == 0 && min_piece == 0;
            let id = format!("aligned-{p_tp}-{d_tp}-{misalign}-{min_piece}");
            for r in 0..p_tp {
                let g = pair.p_geometry(r);
                let mut buf = AlignedBuf::new(g.total_bytes() as usize + 4096);
                let alloc = &mut buf.as_mut_slice()[misalign..misalign + g.total_bytes() as usize];
                fill_request(&g, &g.regions(), &req.remote, 3, alloc);
                let st = StoragePublisher::new(opts.clone(), ENGINE, r)
                    .expect("publisher")
                    .publish(&id, &g.regions(), &req.remote, alloc)
                    .expect("publish");
                assert_eq!(st.staged_bytes == 0, in_place, "{st:?}");
            }
            for d in 0..d_tp {
                let planner = Planner::new(&pair, &map, d).expect("planner");
                let plan = planner
                    .plan(&req, &RequestIds { p_request_id: id.clone(), d_request_id: "d".into() })
                    .expect("plan");
                let g = pair.d_geometry(d);
                let mut buf = AlignedBuf::new(g.total_bytes() as usize + 4096);
                let alloc = &mut buf.as_mut_slice()[misalign..misalign + g.total_bytes() as usize];
                alloc.fill(SENTINEL);
                let st = StorageFetcher::new(opts.clone())
                    .expect("fetcher")
                    .fetch(
                        ENGINE,
                        &id,
                        &plan.reads,
                        &pair.p_geometry(0).regions(),
                        &req.remote,
                        alloc,
                        TIMEOUT,
                    )
                    .expect("fetch");
                assert_eq!(st.staged_bytes, if in_place { 0 } else { plan.bytes() }, "{st:?}");
                let bp = planner.pair_blocks(&req).expect("pairs");
                VerifyPlan::new(&g, &g.regions(), &bp, 1, false, 16, 3, 1)
                    .verify_in(alloc)
                    .unwrap_or_else(|m| panic!("{p_tp}->{d_tp} rank {d} misalign {misalign}: {m}"));
                assert_untouched_outside(alloc, &plan.reads);
            }
        }
    }
}

#[test]
fn coalesced_plans_read_the_same_bytes() {
    // Pairs merged across blocks and regions (Planner::coalesced) still map to the file.
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    for layout in [Layout::Lbhnc, Layout::Blhnc] {
        let pair = pair(layout, 1, 1, 1);
        let map = pair.validate().expect("valid");
        let planner = Planner::new(&pair, &map, 0).expect("planner");
        // Consecutive ids on both sides so blocks merge.
        let req = RequestBlocks { local: (4..10).collect(), remote: (10..16).collect() };
        publish_all(&opts, &pair, ENGINE, "coalesced", &req.remote, 5);
        let bp = planner.pair_blocks(&req).expect("pairs");
        let merged = planner.coalesced(&bp);
        let reads: Vec<ReadPlan> = planner
            .reads
            .iter()
            .zip(merged)
            .map(|(r, pairs)| ReadPlan { p_rank: r.p_rank, notif_msg: String::new(), pairs })
            .collect();
        assert!(
            reads.iter().any(|r| r.pairs.iter().any(|p| p.len > pair.p_geometry(0).regions()[0].block_len))
        );
        let g = pair.d_geometry(0);
        let mut alloc = vec![SENTINEL; g.total_bytes() as usize];
        StorageFetcher::new(opts.clone())
            .expect("fetcher")
            .fetch(
                ENGINE,
                "coalesced",
                &reads,
                &pair.p_geometry(0).regions(),
                &req.remote,
                &mut alloc,
                TIMEOUT,
            )
            .expect("fetch");
        VerifyPlan::new(&g, &g.regions(), &bp, 1, false, 4, 5, 1).verify_in(&alloc).expect("verified");
        assert_untouched_outside(&alloc, &reads);
    }
}

#[test]
fn concurrent_requests_engines_and_ranks_never_collide() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let pair = pair(Layout::Lbhnc, 4, 2, 1);
    // Same block ids, different request ids / engines, different data.
    let req = request(&pair, 5, 0);
    let jobs = [(ENGINE, "req-a", 1u64), (ENGINE, "req-b", 2), ("other-engine", "req-a", 3)];
    std::thread::scope(|s| {
        for &(engine, id, seed) in &jobs {
            for r in 0..pair.p.tp {
                let (opts, pair, remote) = (&opts, &pair, &req.remote);
                s.spawn(move || {
                    let g = pair.p_geometry(r);
                    let mut alloc = vec![0u8; g.total_bytes() as usize];
                    fill_request(&g, &g.regions(), remote, seed, &mut alloc);
                    let mut p = StoragePublisher::new(opts.clone(), engine, r).expect("publisher");
                    p.publish(id, &g.regions(), remote, &alloc).expect("publish");
                });
            }
        }
    });
    assert_eq!(fs::read_dir(dir.path()).expect("list").count(), jobs.len() * pair.p.tp as usize);
    std::thread::scope(|s| {
        for &(engine, id, seed) in &jobs {
            let (opts, pair, req) = (&opts, &pair, &req);
            s.spawn(move || fetch_and_verify(opts, pair, engine, id, req, seed));
        }
    });
}

#[test]
fn a_reader_sees_no_file_or_a_complete_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    // Big enough (8 MiB per file) that a write takes many system calls.
    let pair = PairSpec {
        version: VllmVersion::V0_33,
        model: ModelShape { head_dim: 128, ..model(8, 8) },
        p: EngineSpec { tp: 1, block_tokens: 16, num_blocks: 64, layout: Layout::Lbhnc },
        d: EngineSpec { tp: 1, block_tokens: 16, num_blocks: 64, layout: Layout::Lbhnc },
        permute: false,
    };
    let req = RequestBlocks { local: (0..16).rev().collect(), remote: (0..16).map(|i| i * 3).collect() };
    let seeds = [11u64, 22];
    let g = pair.p_geometry(0);
    let allocs: Vec<Vec<u8>> = seeds
        .iter()
        .map(|&seed| {
            let mut a = vec![0u8; g.total_bytes() as usize];
            fill_request(&g, &g.regions(), &req.remote, seed, &mut a);
            a
        })
        .collect();
    let path = request_path(dir.path(), ENGINE, "race", 0).expect("path");
    let rounds = 12;
    let (tx, rx) = mpsc::channel::<usize>();
    std::thread::scope(|s| {
        let (opts, g, allocs, req) = (&opts, &g, &allocs, &req);
        s.spawn(move || {
            let mut p = StoragePublisher::new(opts.clone(), ENGINE, 0).expect("publisher");
            for i in 0..rounds {
                // Each publish replaces the file the reader is opening.
                p.publish("race", &g.regions(), &req.remote, &allocs[i % 2]).expect("publish");
                tx.send(i).expect("reader alive");
            }
        });
        let map = pair.validate().expect("valid");
        let planner = Planner::new(&pair, &map, 0).expect("planner");
        let ids = RequestIds { p_request_id: "race".into(), d_request_id: "d".into() };
        let plan = planner.plan(req, &ids).expect("plan");
        let bp = planner.pair_blocks(req).expect("pairs");
        let dg = pair.d_geometry(0);
        let mut f = StorageFetcher::new(opts.clone()).expect("fetcher");
        let mut alloc = vec![0u8; dg.total_bytes() as usize];
        let (mut absent, mut complete) = (0, 0);
        let mut fetch_once = |alloc: &mut Vec<u8>| {
            alloc.fill(SENTINEL);
            f.fetch(ENGINE, "race", &plan.reads, &g.regions(), &req.remote, alloc, TIMEOUT)
                .expect("complete file");
            let ok = seeds.iter().any(|&seed| {
                VerifyPlan::new(&dg, &dg.regions(), &bp, 1, false, 16, seed, 1).verify_in(alloc).is_ok()
            });
            assert!(ok, "the bytes read match neither publish: a torn file");
        };
        // Before the first publish lands: no file, or (if it landed) a complete one.
        loop {
            match fs::File::open(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => absent += 1,
                Err(e) => panic!("{e}"),
                Ok(_) => break,
            }
            if absent > 1000 {
                break;
            }
        }
        // Each event: the file exists; read it while the next publish is in flight.
        for _ in rx.iter() {
            fetch_once(&mut alloc);
            complete += 1;
        }
        assert_eq!(complete, rounds);
        // No temporary file is left behind and no reader ever saw one.
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
            .collect();
        assert_eq!(names, vec![path.file_name().expect("name").to_string_lossy().into_owned()]);
    });
}

#[test]
fn a_fetch_waits_for_a_late_publish() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let pair = pair(Layout::FaHnd, 2, 2, 1);
    let req = request(&pair, 4, 0);
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        let (opts, pair, req) = (&opts, &pair, &req);
        let reader = s.spawn(move || {
            tx.send(()).expect("main alive");
            fetch_and_verify(opts, pair, ENGINE, "late", req, 8)
        });
        rx.recv().expect("reader started");
        publish_all(opts, pair, ENGINE, "late", &req.remote, 8);
        assert!(reader.join().expect("reader") > 0);
    });
}

#[test]
fn fetching_a_missing_request_times_out_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let pair = pair(Layout::Lbhnc, 2, 1, 1);
    let map = pair.validate().expect("valid");
    let planner = Planner::new(&pair, &map, 0).expect("planner");
    let req = request(&pair, 3, 0);
    let plan = planner
        .plan(&req, &RequestIds { p_request_id: "never".into(), d_request_id: "d".into() })
        .expect("plan");
    let mut alloc = vec![0u8; pair.d_geometry(0).total_bytes() as usize];
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let err = StorageFetcher::new(opts)
        .expect("fetcher")
        .fetch(ENGINE, "never", &plan.reads, &pair.p_geometry(0).regions(), &req.remote, &mut alloc, timeout)
        .expect_err("nothing published");
    let took = t0.elapsed();
    assert!(matches!(err, StorageError::Timeout { p_rank: 0, .. }), "{err:?}");
    assert!(took >= timeout && took < timeout + Duration::from_secs(3), "took {took:?}");
    let msg = err.to_string();
    assert!(msg.contains("never") && msg.contains("--storage-dir") && msg.contains("300ms"), "{msg}");
}

fn set_age(path: &Path, age: Duration) {
    let f = fs::File::options().write(true).open(path).expect("open");
    f.set_modified(SystemTime::now() - age).expect("set mtime");
}

#[test]
fn release_removes_and_sweep_expires_only_stale_files_of_its_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let pair = pair(Layout::Lbhnc, 1, 1, 1);
    let req = request(&pair, 2, 0);
    let g = pair.p_geometry(0);
    let alloc = vec![7u8; g.total_bytes() as usize];
    let mut p0 = StoragePublisher::new(opts.clone(), ENGINE, 0).expect("publisher");
    let mut p1 = StoragePublisher::new(opts.clone(), ENGINE, 1).expect("publisher");
    let mut other = StoragePublisher::new(opts.clone(), "other", 0).expect("publisher");
    for id in ["done", "stale", "fresh"] {
        p0.publish(id, &g.regions(), &req.remote, &alloc).expect("publish");
    }
    let p1_stale = p1.publish("stale", &g.regions(), &req.remote, &alloc).expect("publish").path;
    let other_stale = other.publish("stale", &g.regions(), &req.remote, &alloc).expect("publish").path;

    let done = p0.path("done").expect("path");
    p0.release("done").expect("release");
    assert!(!done.exists());
    p0.release("done").expect("releasing twice is fine");
    p0.release("never-published").expect("releasing the unknown is fine");

    // An abandoned temporary file of this rank (a writer that crashed) and unrelated files.
    let tmp = dir.path().join(format!(".{}.stale-tmp.p0.kvx.0123abcd.tmp", ENGINE));
    fs::write(&tmp, b"partial").expect("write");
    let notes = dir.path().join("notes.txt");
    fs::write(&notes, b"not kvx's").expect("write");
    let hour = Duration::from_secs(3600);
    for path in [&p0.path("stale").expect("path"), &p1_stale, &other_stale, &tmp, &notes] {
        set_age(path, hour);
    }
    let st = p0.sweep(Duration::from_secs(60)).expect("sweep");
    assert_eq!((st.expired, st.abandoned), (1, 1), "{st:?}");
    assert!(!p0.path("stale").expect("path").exists());
    assert!(p0.path("fresh").expect("path").exists(), "within its lease");
    assert!(p1_stale.exists() && other_stale.exists(), "other ranks' and engines' files are theirs to sweep");
    assert!(notes.exists());
    // The directory-wide sweep takes every stale kvx file, still not foreign ones.
    let st = sweep_dir(dir.path(), Duration::from_secs(60)).expect("sweep");
    assert_eq!(st.expired, 2);
    assert!(!p1_stale.exists() && !other_stale.exists() && notes.exists());
}

#[test]
fn hostile_ids_stay_inside_the_directory_or_are_refused() {
    let parent = tempfile::tempdir().expect("tempdir");
    let dir = parent.path().join("store");
    let opts = StorageOptions::new(&dir);
    let pair = pair(Layout::Lbhnc, 1, 2, 1);
    let req = request(&pair, 3, 0);
    let long = "r".repeat(300);
    for (i, id) in ["../x", "/", "..", "a/../../b", "%2E%2E", long.as_str()].iter().enumerate() {
        round_trip(&opts, &pair, &req, id, i as u64);
        assert_eq!(fs::read_dir(&dir).expect("list").count(), i + 1, "one file per id, inside the store");
    }
    assert_eq!(fs::read_dir(parent.path()).expect("list").count(), 1, "nothing written beside the store");
    // A hostile engine id is encoded the same way.
    round_trip(&opts, &pair, &req, "r", 1);
    publish_all(&opts, &pair, "../evil", "r", &req.remote, 1);
    fetch_and_verify(&opts, &pair, "../evil", "r", &req, 1);
    assert_eq!(fs::read_dir(parent.path()).expect("list").count(), 1);

    let g = pair.p_geometry(0);
    let alloc = vec![0u8; g.total_bytes() as usize];
    let mut p = StoragePublisher::new(opts.clone(), ENGINE, 0).expect("publisher");
    let huge = "x".repeat(5000);
    for id in ["", "a\0b", huge.as_str()] {
        let err = p.publish(id, &g.regions(), &req.remote, &alloc).expect_err("refused");
        assert!(matches!(err, StorageError::BadId { what: "request id", .. }), "{err:?}");
        assert!(err.to_string().len() < 400, "the error does not echo 5000 bytes");
        let mut f = StorageFetcher::new(opts.clone()).expect("fetcher");
        let mut d = vec![0u8; 16];
        // Refused before any wait, even by a plan that reads nothing.
        let err = f.fetch(ENGINE, id, &[], &g.regions(), &req.remote, &mut d, TIMEOUT).expect_err("refused");
        assert!(matches!(err, StorageError::BadId { what: "request id", .. }), "{err:?}");
    }
    assert!(matches!(
        StoragePublisher::new(opts, "a\0b", 0).err(),
        Some(StorageError::BadId { what: "engine id", .. })
    ));
}

/// Publishes one request and returns what a fetch of its first decode rank needs.
struct Published {
    pair: PairSpec,
    req: RequestBlocks,
    reads: Vec<ReadPlan>,
    path: std::path::PathBuf,
}

fn publish_one(opts: &StorageOptions, id: &str) -> Published {
    let pair = pair(Layout::Lbhnc, 1, 1, 1);
    let req = request(&pair, 3, 0);
    publish_all(opts, &pair, ENGINE, id, &req.remote, 4);
    let map = pair.validate().expect("valid");
    let planner = Planner::new(&pair, &map, 0).expect("planner");
    let plan =
        planner.plan(&req, &RequestIds { p_request_id: id.into(), d_request_id: "d".into() }).expect("plan");
    let path = request_path(&opts.dir, ENGINE, id, 0).expect("path");
    Published { pair, req, reads: plan.reads, path }
}

fn fetch_err(opts: &StorageOptions, p: &Published, id: &str) -> StorageError {
    let mut alloc = vec![0u8; p.pair.d_geometry(0).total_bytes() as usize];
    StorageFetcher::new(opts.clone())
        .expect("fetcher")
        .fetch(ENGINE, id, &p.reads, &p.pair.p_geometry(0).regions(), &p.req.remote, &mut alloc, TIMEOUT)
        .expect_err("damaged")
}

#[test]
fn damaged_files_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let p = publish_one(&opts, "dmg");
    let good = fs::read(&p.path).expect("read");
    let expect = |bytes: &[u8], check: &dyn Fn(&StorageError) -> bool, what: &str| {
        fs::write(&p.path, bytes).expect("write");
        let err = fetch_err(&opts, &p, "dmg");
        assert!(check(&err), "{what}: {err:?}");
        assert!(err.to_string().contains(&*p.path.to_string_lossy()), "{what}: names the path: {err}");
    };
    expect(&[], &|e| matches!(e, StorageError::Truncated { actual: 0, .. }), "empty");
    expect(&good[..good.len() - 4096], &|e| matches!(e, StorageError::Truncated { .. }), "payload cut");
    expect(&good[..4000], &|e| matches!(e, StorageError::Truncated { .. }), "header cut");
    let mut longer = good.clone();
    longer.extend_from_slice(&[0; 4096]);
    expect(&longer, &|e| matches!(e, StorageError::Corrupt { .. }), "extra bytes");
    let mut bad = good.clone();
    bad[0] = b'X';
    expect(&bad, &|e| matches!(e, StorageError::Corrupt { .. }), "magic");
    let mut bad = good.clone();
    bad[8] = 2;
    expect(&bad, &|e| matches!(e, StorageError::UnsupportedVersion { found: 2, .. }), "version");
    for at in [16, 20, 24, 40, 48, 60, 100] {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        expect(&bad, &|e| matches!(e, StorageError::Corrupt { .. } | StorageError::Truncated { .. }), "flip");
    }
    let garbage: Vec<u8> = (0..3 * 4096u32).map(|i| (i * 31 % 251) as u8).collect();
    expect(&garbage, &|e| matches!(e, StorageError::Corrupt { .. }), "garbage");
    // A file of another request, renamed over this one: the header says so.
    fs::write(&p.path, &good).expect("restore");
    let other = request_path(dir.path(), ENGINE, "other", 0).expect("path");
    fs::copy(&p.path, &other).expect("copy");
    let err = fetch_err(&opts, &p, "other");
    assert!(matches!(&err, StorageError::Mismatch { what, .. } if what == "request id"), "{err:?}");
}

#[test]
fn a_file_of_another_geometry_or_block_list_is_a_mismatch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let p = publish_one(&opts, "geo");
    let regions = p.pair.p_geometry(0).regions();
    let mut alloc = vec![0u8; p.pair.d_geometry(0).total_bytes() as usize];
    let mut f = StorageFetcher::new(opts.clone()).expect("fetcher");
    let mut blocks = p.req.remote.clone();
    blocks.swap(0, 1);
    let err = f.fetch(ENGINE, "geo", &p.reads, &regions, &blocks, &mut alloc, TIMEOUT).expect_err("mismatch");
    assert!(matches!(&err, StorageError::Mismatch { what, .. } if what.contains("block id")), "{err:?}");
    let mut other = regions.clone();
    other[1].block_stride *= 2;
    let err =
        f.fetch(ENGINE, "geo", &p.reads, &other, &p.req.remote, &mut alloc, TIMEOUT).expect_err("mismatch");
    assert!(matches!(&err, StorageError::Mismatch { what, .. } if what.contains("region 1")), "{err:?}");
    let err = f
        .fetch(ENGINE, "geo", &p.reads, &regions[..1], &p.req.remote, &mut alloc, TIMEOUT)
        .expect_err("mismatch");
    assert!(matches!(&err, StorageError::Mismatch { what, .. } if what.contains("region count")), "{err:?}");
}

#[test]
fn plans_that_do_not_fit_are_refused_before_any_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let p = publish_one(&opts, "fit");
    let regions = p.pair.p_geometry(0).regions();
    let d_len = p.pair.d_geometry(0).total_bytes() as usize;
    let mut f = StorageFetcher::new(opts.clone()).expect("fetcher");
    let with_pairs = |pairs: Vec<Pair>| vec![ReadPlan { p_rank: 0, notif_msg: String::new(), pairs }];
    let block = regions[0].block_len;
    let in_req = regions[0].block_off(u64::from(p.req.remote[0]));
    let not_in_req =
        regions[0].block_off(u64::from((0..31).find(|b| !p.req.remote.contains(b)).expect("free")));
    let cases = [
        (vec![Pair { local: 0, remote: u64::MAX - 4, len: 4 }], "not inside any block"),
        (vec![Pair { local: 0, remote: not_in_req, len: block }], "not one of the request's blocks"),
        (vec![Pair { local: d_len as u64 - 2, remote: in_req, len: 4 }], "runs past"),
        (
            vec![Pair { local: 0, remote: in_req, len: 8 }, Pair { local: 4, remote: in_req, len: 8 }],
            "overlap",
        ),
    ];
    for (pairs, why) in cases {
        let mut alloc = vec![SENTINEL; d_len];
        let err = f
            .fetch(ENGINE, "fit", &with_pairs(pairs), &regions, &p.req.remote, &mut alloc, TIMEOUT)
            .expect_err("refused");
        assert!(matches!(&err, StorageError::Plan(m) if m.contains(why)), "{why}: {err:?}");
        assert!(alloc.iter().all(|&b| b == SENTINEL), "{why}: nothing written");
    }
    let mut alloc = vec![0u8; d_len];
    let err = f
        .fetch(ENGINE, "fit", &p.reads, &regions, &[1, 1, 2], &mut alloc, TIMEOUT)
        .expect_err("duplicate ids");
    assert!(matches!(&err, StorageError::Plan(m) if m.contains("twice")), "{err:?}");
}

#[test]
fn publish_refuses_blocks_outside_the_allocation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = StorageOptions::new(dir.path());
    let pair = pair(Layout::Lbhnc, 1, 1, 1);
    let g = pair.p_geometry(0);
    let alloc = vec![0u8; g.total_bytes() as usize];
    let mut p = StoragePublisher::new(opts, ENGINE, 0).expect("publisher");
    for (blocks, why) in [(vec![31], "outside region"), (vec![1, 1], "twice")] {
        let err = p.publish("x", &g.regions(), &blocks, &alloc).expect_err("refused");
        assert!(matches!(&err, StorageError::Input(m) if m.contains(why)), "{err:?}");
    }
    let err = p.publish("x", &g.regions(), &[3], &alloc[..100]).expect_err("short allocation");
    assert!(matches!(&err, StorageError::Input(m) if m.contains("past the rank's allocation")), "{err:?}");
    assert_eq!(fs::read_dir(dir.path()).expect("list").count(), 0, "no file and no temporary left");
}

/// tmpfs refused `O_DIRECT` before Linux 6.6 and accepts it since: either way the user
/// gets a working transport or an error that says which flag to drop.
#[test]
fn direct_io_on_tmpfs_works_or_is_refused_clearly() {
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    let Some(tmpfs) = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "tmpfs").then(|| f[1].to_string())
        })
        .find(|m| tempfile::tempdir_in(m).is_ok())
    else {
        eprintln!("skipped: no writable tmpfs mount");
        return;
    };
    let dir = tempfile::tempdir_in(&tmpfs).expect("tempdir");
    let mut opts = StorageOptions::new(dir.path());
    opts.direct_io = true;
    match StoragePublisher::new(opts.clone(), ENGINE, 0) {
        Err(err) => {
            assert!(matches!(err, StorageError::DirectIoUnsupported { .. }), "{err:?}");
            assert!(err.to_string().contains("--storage-direct-io"), "{err}");
            assert_eq!(fs::read_dir(dir.path()).expect("list").count(), 0, "the probe cleans up");
        }
        Ok(_) => {
            assert_eq!(fs::read_dir(dir.path()).expect("list").count(), 0, "the probe cleans up");
            let pair = pair(Layout::Lbhnc, 2, 1, 1);
            assert!(round_trip(&opts, &pair, &request(&pair, 5, 1), "tmpfs", 3) > 0);
        }
    }
}

/// Random cases in the style of `props`: versions, layouts, TP pairs, head and layer
/// counts, block-size ratios, prefix hits and block tables, through files.
#[derive(Debug, Clone)]
struct Case {
    layout: Layout,
    p_tp: u32,
    d_tp: u32,
    heads: u32,
    layers: u32,
    bsr: u32,
    n: u32,
    hit: u32,
    seed: u64,
}

fn case() -> impl Strategy<Value = Case> {
    let tp = prop::sample::select(vec![1u32, 2, 4, 8]);
    (
        prop::sample::select(Layout::ALL.to_vec()),
        tp.clone(),
        tp,
        prop::sample::select(vec![1u32, 2, 4, 8]),
        1u32..4,
        prop::sample::select(vec![1u32, 2]),
        1u32..8,
        0u32..3,
        any::<u64>(),
    )
        .prop_map(|(layout, p_tp, d_tp, heads, layers, bsr, n, hit, seed)| Case {
            layout,
            p_tp,
            d_tp,
            heads,
            layers,
            bsr,
            n,
            hit,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_plans_round_trip_through_files(c in case()) {
        let pair = PairSpec {
            version: c.layout.version(),
            model: model(c.heads, c.layers),
            p: EngineSpec { tp: c.p_tp, block_tokens: 2, num_blocks: 23, layout: c.layout },
            d: EngineSpec { tp: c.d_tp, block_tokens: 2 * c.bsr, num_blocks: 23, layout: c.layout },
            permute: false,
        };
        prop_assume!(pair.validate().is_ok());
        // A block table shuffled by the seed.
        let mut pool: Vec<u32> = (0..23).collect();
        let mut x = c.seed;
        for i in (1..pool.len()).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            pool.swap(i, (x >> 33) as usize % (i + 1));
        }
        let remote: Vec<u32> = pool[..c.n as usize].to_vec();
        let n_d = c.n.div_ceil(c.bsr);
        let local: Vec<u32> = pool[c.hit.min(n_d) as usize..n_d as usize].to_vec();
        let req = RequestBlocks { local, remote };
        let dir = tempfile::tempdir().expect("tempdir");
        round_trip(&StorageOptions::new(dir.path()), &pair, &req, "prop", c.seed);
    }
}
