//! `gather.ptx` run in the PTX simulator ([`super::ptx_sim`]) and held to the Rust it mirrors:
//! the gather kernel copies the pieces `pack.rs` makes, the expand kernel writes the
//! descriptors `grid.rs` expands to, and the launcher's parameters are the PTX's. Tests only.

use super::grid::{self, GridBatch};
use super::pack::{CopyBatch, GATHER_PIECE, Span, gather_descriptors, pack_descriptors};
use super::ptx_sim;
use crate::layouts::read_plan::Pair;

const L: Span = Span { base: 0x7000_0000, len: 1 << 20 };
const P: Span = Span { base: 0x9000_0000, len: 1 << 20 };

fn pair(local: u64, remote: u64, len: u64) -> Pair {
    Pair { local, remote, len }
}

/// Runs `gather.ptx` in the simulator on the pieces of `pairs` (local = destination
/// offset, remote = source offset, in 64 KiB regions) and checks every destination byte,
/// and that nothing else changed.
fn run_kernel(pairs: &[Pair], blocks: u64, threads: u64) {
    run_kernel_on(pairs, blocks, threads, Packer::TwoPass);
}

/// Which packing makes the descriptors [`run_kernel_on`] runs.
#[derive(Debug, Clone, Copy)]
enum Packer {
    /// `CopyBatch::pack`, then `gather_descriptors`.
    TwoPass,
    /// `pack_descriptors` straight into the descriptor buffer.
    OnePass,
}

/// [`run_kernel`] on the descriptors `packer` makes of `pairs`.
fn run_kernel_on(pairs: &[Pair], blocks: u64, threads: u64, packer: Packer) {
    const BASE: u64 = 0x7f00_0000_0000;
    const REGION: u64 = 64 << 10;
    let (src_at, dst_at) = (REGION, 2 * REGION);
    let mut mem = vec![0xee_u8; 3 * REGION as usize];
    for (i, b) in mem[src_at as usize..dst_at as usize].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ (i >> 8) as u8;
    }
    let (dst, src) = (Span { base: BASE + dst_at, len: REGION }, Span { base: BASE + src_at, len: REGION });
    let mut descs = Vec::new();
    let pieces = match packer {
        Packer::TwoPass => {
            let mut batch = CopyBatch::default();
            batch.pack(pairs.iter().copied(), dst, src).expect("in bounds");
            gather_descriptors(&batch, GATHER_PIECE, &mut descs)
        }
        Packer::OnePass => {
            descs = vec![0; 3 * (pairs.len() + (REGION / GATHER_PIECE) as usize + 1)];
            let packed = pack_descriptors(&[(pairs, src)], dst, GATHER_PIECE, &mut descs).expect("in bounds");
            descs.truncate(3 * packed.pieces);
            packed.pieces
        }
    };
    assert!(24 * pieces as u64 <= REGION, "descriptors fit before the source");
    for (i, w) in descs.iter().enumerate() {
        mem[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
    let before = mem.clone();
    let kernel = ptx_sim::Kernel::parse(
        include_str!("../gather.ptx"),
        "kvx_gather_copy",
        &["kvx_gather_copy_descs", "kvx_gather_copy_count"],
    );
    kernel.run(blocks, threads, &[BASE, pieces as u64], &mut mem, BASE);
    let mut want = before;
    for p in pairs {
        let (d, s) = ((dst_at + p.local) as usize, (src_at + p.remote) as usize);
        let from = want[s..s + p.len as usize].to_vec();
        want[d..d + p.len as usize].copy_from_slice(&from);
    }
    let wrong: Vec<usize> = (0..mem.len()).filter(|&i| mem[i] != want[i]).take(5).collect();
    assert!(wrong.is_empty(), "first wrong bytes at {wrong:?} ({blocks}x{threads}, {pairs:?})");
}

#[test]
fn the_gather_kernel_run_in_a_simulator_copies_every_byte_with_aligned_accesses() {
    // Destinations apart, each a different alignment case: aligned, same offset modulo 16
    // (head, 16-byte body, tail), modulo 8, modulo 4, none (bytes), tiny, empty, and one
    // longer than a piece whose two sides differ modulo 16.
    let pairs = [
        pair(0, 0, 4096),
        pair(4096 + 3, 3, 8192 + 5),
        pair(13_000 + 5, 13_000 + 13, 1000),
        pair(15_000 + 1, 15_000 + 13, 999),
        pair(17_000, 17_001, 777),
        pair(18_000 + 7, 18_002, 15),
        pair(18_100 + 9, 18_109, 1),
        pair(18_200 + 11, 18_204, 0),
        pair(20_000 + 1, 20_000 + 6, 40_000),
    ];
    run_kernel(&pairs, 3, 64);
    run_kernel(&pairs, 1, 256);
    // The launcher's block size: 8 KiB is one step of four units per thread.
    run_kernel(&pairs, 2, 128);
    run_kernel(&[pair(0, 0, 8192), pair(8192, 16_384, 8192), pair(16_384, 40_000, 8192 + 48)], 2, 128);
    // Fewer threads than a head or tail has bytes: the byte loops still cover them.
    run_kernel(&pairs[..2], 2, 4);
}

#[test]
fn the_gather_kernel_copies_the_one_pass_descriptors_as_the_plan_says() {
    // Runs contiguous on both sides (merged: fewer descriptors copied than planned, one run
    // longer than a piece), on one side only (not merged), unaligned ones and empty ones: the
    // kernel run on what `pack_descriptors` wrote moves every byte the plan's pairs name.
    let mut pairs: Vec<Pair> = (0..6u64).map(|k| pair(k * 8192, k * 8192, 8192)).collect();
    pairs.extend([
        pair(49_152 + 3, 49_152 + 3, 5),
        pair(49_160, 49_160, 1000),
        pair(50_160, 51_000, 0),
        pair(50_160, 50_160 + 7, 100),
        pair(50_260, 50_267, 333),
        pair(60_000, 200, 64),
    ]);
    let mut out = vec![0u64; 3 * 64];
    let packed = pack_descriptors(&[(&pairs, P)], L, GATHER_PIECE, &mut out).expect("in bounds");
    assert_eq!((packed.descriptors, packed.copies), (12, 4), "{packed:?}");
    for (blocks, threads) in [(3, 64), (2, 128), (1, 256)] {
        run_kernel_on(&pairs, blocks, threads, Packer::OnePass);
    }
}

#[test]
fn the_launcher_and_the_ptx_agree_on_the_kernels() {
    // The launcher passes (u64 descs, u64 count) to `kvx_gather_copy`, (u64 regions, u64
    // blocks, u64 nblocks, u64 count, u64 descs) to `kvx_grid_expand`, and both read or
    // write descriptors as three u64: the PTX must say the same.
    let ptx = include_str!("../gather.ptx");
    let params = |entry: &str| -> Vec<String> {
        let (_, rest) = ptx.split_once(&format!(".visible .entry {entry}(")).expect("the entry point");
        let (head, _) = rest.split_once(')').expect("its parameters");
        head.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect()
    };
    let gather = params("kvx_gather_copy");
    assert_eq!(gather, [".param .u64 kvx_gather_copy_descs,", ".param .u64 kvx_gather_copy_count"]);
    let expand = params("kvx_grid_expand");
    let names = ["regions", "blocks", "nblocks", "count", "descs"];
    assert_eq!(expand.len(), names.len(), "{expand:?}");
    for (p, n) in expand.iter().zip(names) {
        assert!(p.starts_with(".param .u64 ") && p.contains(&format!("kvx_grid_expand_{n}")), "{p}");
    }
    assert!(ptx.contains("mul.lo.u64 \t%rd7, %rd3, 24;"), "24-byte descriptors read");
    assert!(ptx.contains("mul.lo.u64 \t%rd23, %rd10, 24;"), "24-byte descriptors written");
    assert!(ptx.contains("mul.lo.u64 \t%rd14, %rd12, 40;"), "five-word regions");
    assert_eq!(grid::REGION_WORDS, 5);
    assert!(ptx.contains(".address_size 64"));
}

#[test]
fn the_expand_kernel_run_in_a_simulator_writes_the_grids_descriptors() {
    use crate::layouts::read_plan::RegionXfer;
    const BASE: u64 = 0x7f00_0000_0000;
    let region = |l_base, r_base, len| RegionXfer { l_base, l_step: 8192, r_base, r_step: 16_384, len };
    let a = [region(0, 0, 4096), region(1 << 19, 4096, 4096), region(4096, 8, 3)];
    let b = [region(4096, 4096, 4096)];
    let (l, r) = ([3u64, 0, 7, 5], [1u64, 5, 2, 60]);
    let mut g = GridBatch::default();
    g.pack(&[(&a, P), (&b, L)], &l, &r, L).expect("in bounds");
    let count = g.descriptors() as usize;
    let table_at = 24 * count;
    let mut mem = vec![0xee_u8; table_at + 8 * g.words().len()];
    for (i, w) in g.words().iter().enumerate() {
        mem[table_at + 8 * i..table_at + 8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
    let kernel = ptx_sim::Kernel::parse(
        include_str!("../gather.ptx"),
        "kvx_grid_expand",
        &[
            "kvx_grid_expand_regions",
            "kvx_grid_expand_blocks",
            "kvx_grid_expand_nblocks",
            "kvx_grid_expand_count",
            "kvx_grid_expand_descs",
        ],
    );
    let regions = BASE + table_at as u64;
    let blocks = regions + 8 * g.table_words() as u64;
    let want: Vec<u64> = g.expand().flat_map(|(d, s, n)| [d, s, n]).collect();
    assert_eq!(want.len(), 3 * 16);
    // More threads than descriptors, fewer (the grid-stride loop), one.
    for (grid_blocks, threads) in [(2, 32), (1, 5), (3, 2), (1, 1)] {
        let mut m = mem.clone();
        let params = [regions, blocks, g.pairs(), count as u64, BASE];
        kernel.run(grid_blocks, threads, &params, &mut m, BASE);
        let got: Vec<u64> =
            m[..table_at].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8"))).collect();
        assert_eq!(got, want, "{grid_blocks}x{threads}");
        assert_eq!(m[table_at..], mem[table_at..], "the table is only read");
    }
    // No block pairs: nothing written, and no division by zero.
    let mut m = mem.clone();
    kernel.run(2, 4, &[regions, blocks, 0, 0, BASE], &mut m, BASE);
    assert_eq!(m, mem);
}
