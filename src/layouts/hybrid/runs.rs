//! A READ's (local, remote, length) pairs and what makes them fast: the descriptor id runs of
//! `_compute_desc_ids` (attention groups over every region at kernel granularity, state groups
//! over the state rows past them), templates of what no request changes, and runs of pairs
//! that share one row pair, emitted whole.

use std::sync::Arc;

use serde::Serialize;

use super::blocks::{GroupIds, NULL_BLOCK};
use super::desc_lists::DescList;
use super::desc_lists::RowAt;
use super::desc_lists::RowKind;
use super::desc_lists::RowLabel;
use super::geometry::{EngineGeometry, RegionMem};
use crate::layouts::read_plan::Pair;

/// One descriptor pair of a READ: `len` bytes at `remote` (prefill rank) to `local` (decode
/// rank), offsets from each rank's registered memory base, with what it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LabeledPair {
    /// The local row's label.
    pub label: RowLabel,
    /// The KV cache group whose block this is.
    pub group: u32,
    pub pair: Pair,
    /// Kernel block ids on both sides.
    pub local_block: u64,
    pub remote_block: u64,
}

/// Consecutive pairs of one READ that read one row over consecutive blocks of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PairRun {
    /// The local row's label.
    pub label: RowLabel,
    /// The KV cache group whose blocks the run reads (decode's list; `remote_group` prefill's).
    pub group: u32,
    pub remote_group: u32,
    /// The run's first pair in [`HybridRead::pairs`], and how many pairs it has (`u32`: a
    /// READ of 2^32 pairs would hold 96 GiB of them; 32-byte runs are what a state group's
    /// one-pair runs cost to write).
    pub start: u32,
    pub count: u32,
    /// Where the run's blocks start in `local_blocks[group]` and `remote_blocks[remote_group]`.
    pub local_at: u32,
    pub remote_at: u32,
}

impl PairRun {
    /// The run's pairs' indices in [`HybridRead::pairs`].
    pub fn pairs(&self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.count) as usize
    }

    /// The run's blocks' indices in the local (`remote`: the remote) list of its group.
    pub(super) fn blocks(&self, remote: bool) -> std::ops::Range<usize> {
        let at = if remote { self.remote_at } else { self.local_at } as usize;
        at..at + self.count as usize
    }
}

/// Runs of one READ as the planner writes them: one run (`rows` of one label), or one run per
/// row of a template's span over whole lists (`rows` labels, `count` pairs each, one after
/// the other). A span's labels are the planner's, shared: a state group's rows read one slot
/// each, and writing a run per row cost what writing their pairs did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RunBatch {
    pub(super) rows: Rows,
    pub(super) group: u32,
    pub(super) remote_group: u32,
    pub(super) start: u32,
    pub(super) count: u32,
    pub(super) local_at: u32,
    pub(super) remote_at: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Rows {
    One(RowLabel),
    Span(Arc<[RowLabel]>),
}

impl RunBatch {
    pub(super) fn one(run: PairRun) -> RunBatch {
        let PairRun { label, group, remote_group, start, count, local_at, remote_at } = run;
        RunBatch { rows: Rows::One(label), group, remote_group, start, count, local_at, remote_at }
    }

    pub(super) fn runs(&self) -> impl Iterator<Item = PairRun> + '_ {
        let labels = match &self.rows {
            Rows::One(label) => std::slice::from_ref(label),
            Rows::Span(labels) => &labels[..],
        };
        (0u32..).zip(labels).map(move |(j, &label)| PairRun {
            label,
            group: self.group,
            remote_group: self.remote_group,
            start: self.start + j * self.count,
            count: self.count,
            local_at: self.local_at,
            remote_at: self.remote_at,
        })
    }
}

/// One READ: every pair a decode rank reads from one prefill rank, in posting order. The
/// pairs are plain (as the uniform planner's); what each reads is kept per run of a row
/// ([`PairRun`], [`HybridRead::runs`]) and [`HybridRead::labeled`] gives it back pair by pair.
/// Two READs are equal when they read the same pairs with the same runs, however batched.
#[derive(Debug, Clone, Serialize)]
pub struct HybridRead {
    pub p_rank: u32,
    pub notif_msg: String,
    pub pairs: Vec<Pair>,
    /// What the pairs read: runs covering `pairs` in order, batched.
    #[serde(rename = "runs", serialize_with = "serialize_runs")]
    pub(super) batches: Vec<RunBatch>,
    /// Kernel block ids per group on each side, as the READs' descriptor ids take them: the
    /// request's paired lists, shared by every READ of the plan (a READ's runs reach only the
    /// groups its prefill rank serves).
    pub local_blocks: Arc<GroupIds>,
    pub remote_blocks: Arc<GroupIds>,
}

pub(super) fn serialize_runs<S: serde::Serializer>(batches: &[RunBatch], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(batches.iter().flat_map(RunBatch::runs))
}

impl PartialEq for HybridRead {
    fn eq(&self, other: &Self) -> bool {
        (self.p_rank, &self.notif_msg, &self.pairs, &self.local_blocks, &self.remote_blocks)
            == (other.p_rank, &other.notif_msg, &other.pairs, &other.local_blocks, &other.remote_blocks)
            && self.runs().eq(other.runs())
    }
}

impl Eq for HybridRead {}

impl HybridRead {
    /// What the pairs read: runs covering `pairs` in order.
    pub fn runs(&self) -> impl Iterator<Item = PairRun> + '_ {
        self.batches.iter().flat_map(RunBatch::runs)
    }

    /// Every pair with what it reads, in posting order.
    pub fn labeled(&self) -> impl Iterator<Item = LabeledPair> + '_ {
        self.runs().flat_map(move |r| {
            let local = &self.local_blocks[r.group as usize][r.blocks(false)];
            let remote = &self.remote_blocks[r.remote_group as usize][r.blocks(true)];
            self.pairs[r.pairs()].iter().zip(local.iter().zip(remote)).map(
                move |(&pair, (&local_block, &remote_block))| LabeledPair {
                    label: r.label,
                    group: r.group,
                    pair,
                    local_block,
                    remote_block,
                },
            )
        })
    }

    /// Bytes the READ moves.
    pub fn bytes(&self) -> u64 {
        self.pairs.iter().map(|p| p.len).sum()
    }

    /// Appends `count` pairs starting at `start` to the runs, extending the last run when
    /// they continue it.
    /// (A span's batch runs over whole lists: a run after it starts no further than the
    /// list's end, so nothing continues it.)
    pub(super) fn push_run(&mut self, run: PairRun) {
        if let Some(last) = self.batches.last_mut()
            && last.rows == Rows::One(run.label)
            && (last.group, last.remote_group) == (run.group, run.remote_group)
            && last.start + last.count == run.start
            && last.local_at + last.count == run.local_at
            && last.remote_at + last.count == run.remote_at
        {
            last.count += run.count;
            return;
        }
        self.batches.push(RunBatch::one(run));
    }
}

/// What one READ's walk needs that no request changes: which groups its prefill rank serves,
/// and per side (local, remote) the descriptor id runs of `_compute_desc_ids` (they depend on
/// the geometry and the group count, not on the blocks), each with the row holding its first id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ReadTemplate {
    pub(super) keeps: Vec<bool>,
    pub(super) runs: [Vec<RunRow>; 2],
    /// Per side and group: how many of the side's runs read the group (a READ's descriptor
    /// count is the sum over its groups of this times the group's list length).
    pub(super) runs_per_group: [Vec<usize>; 2],
    /// When both sides' runs go group for group (the k-th local run reads the same group as
    /// the k-th remote run, as `_compute_desc_ids` lays them out whenever both engines have
    /// the same groups): each run pair with both rows resolved, ready to emit whole lists.
    pub(super) aligned: Option<Vec<RowPair>>,
    /// The aligned run pairs cut into spans of consecutive pairs of one group (a state
    /// group's rows, an attention group's layers): one check per span, then every pair of
    /// the span in one pass.
    pub(super) spans: Vec<RunSpan>,
}

/// Consecutive aligned run pairs `start..end` of one group, and what whole lists must stay
/// under to take the fast way for all of them at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RunSpan {
    pub(super) group: u32,
    pub(super) start: usize,
    pub(super) end: usize,
    /// The run pairs' labels, in order (what the span's runs read).
    pub(super) labels: Arc<[RowLabel]>,
    /// Every run pair of the span takes the fast way (see [`RowPair::fast`]).
    pub(super) fast: bool,
    /// The lowest `lcap` and `rcap` over the span.
    pub(super) lcap: u64,
    pub(super) rcap: u64,
}

impl RunSpan {
    /// The spans of `pairs`, cut where the group changes.
    pub(super) fn cut(pairs: &[RowPair]) -> Vec<RunSpan> {
        let mut out: Vec<RunSpan> = Vec::new();
        for (k, rp) in pairs.iter().enumerate() {
            match out.last_mut() {
                Some(s) if s.group == rp.group => {
                    s.end = k + 1;
                    s.fast &= rp.fast;
                    s.lcap = s.lcap.min(rp.lcap);
                    s.rcap = s.rcap.min(rp.rcap);
                }
                _ => out.push(RunSpan {
                    group: rp.group,
                    start: k,
                    end: k + 1,
                    labels: Arc::new([]),
                    fast: rp.fast,
                    lcap: rp.lcap,
                    rcap: rp.rcap,
                }),
            }
        }
        for s in &mut out {
            let rps = &pairs[s.start..s.end];
            s.labels = rps.iter().map(|rp| rp.label).collect();
        }
        out
    }

    /// Whether whole lists of these bounds fit every run pair of the span and read no null
    /// block.
    #[inline]
    pub(super) fn fits(&self, (&((_, lmax), _), &((rmin, rmax), _)): (&ListBounds, &ListBounds)) -> bool {
        self.fast && lmax < self.lcap && rmax < self.rcap && rmin != u64::from(NULL_BLOCK)
    }

    /// Every pair of the span's run pairs `rps` over whole lists `ls` and `rs` (which
    /// [`fits`](Self::fits)), run pair by run pair, with one run each (one batch).
    // Not inlined: inside `plan_ranks` the pair loop's values spilled to the stack (measured
    // in `benches/hybrid.rs`: Qwen3-Next 15% and gpt-oss 25% faster on their own).
    #[inline(never)]
    pub(super) fn emit(&self, rps: &[RowPair], read: &mut HybridRead, (ls, rs): (&[u64], &[u64])) {
        let start = read.pairs.len();
        let n = ls.len();
        let at = |o: u64, b: u64, st: u64| o.wrapping_add(b.wrapping_mul(st));
        if let (&[lb], &[rb]) = (ls, rs) {
            read.pairs.extend(rps.iter().map(|rp| Pair {
                local: at(rp.local, lb, rp.lstride),
                remote: at(rp.remote, rb, rp.rstride),
                len: rp.len,
            }));
        } else {
            for rp in rps {
                Self::row(rp, read, (ls, rs));
            }
        }
        // Whole lists start at their first block: nothing to merge with the run before.
        read.batches.push(RunBatch {
            rows: Rows::Span(self.labels.clone()),
            group: self.group,
            remote_group: self.group,
            start: start as u32,
            count: n as u32,
            local_at: 0,
            remote_at: 0,
        });
    }
}

impl RunSpan {
    /// The pairs of run pair `rp` over whole lists `ls` and `rs`.
    #[inline(always)]
    pub(super) fn row(rp: &RowPair, read: &mut HybridRead, (ls, rs): (&[u64], &[u64])) {
        // In locals, so the loop keeps them in registers.
        let RowPair { local, lstride, remote, rstride, len, .. } = *rp;
        read.pairs.extend(ls.iter().zip(rs).map(|(&lb, &rb)| Pair {
            local: local.wrapping_add(lb.wrapping_mul(lstride)),
            remote: remote.wrapping_add(rb.wrapping_mul(rstride)),
            len,
        }));
    }
}

/// A local and a remote run of one group, with what their pairs are made of: block `lb` on
/// the local side is at `local + lb * lstride`, `rb` remote at `remote + rb * rstride`, while
/// `lb < lcap` and `rb < rcap` (inside the rows), `len` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RowPair {
    pub(super) group: u32,
    pub(super) label: RowLabel,
    pub(super) local: u64,
    pub(super) lstride: u64,
    pub(super) lcap: u64,
    pub(super) remote: u64,
    pub(super) rstride: u64,
    pub(super) rcap: u64,
    pub(super) len: u64,
    /// Both rows lie in one registration each and have the same length: whole lists inside
    /// the caps go the fast way.
    pub(super) fast: bool,
}

impl RowPair {
    /// The pairs of whole lists `ls` and `rs` (bounds `lb`, `rb`: lowest, highest, length),
    /// when both fit inside the rows and read no null block; false (nothing pushed) otherwise.
    #[inline]
    pub(super) fn emit(
        &self,
        read: &mut HybridRead,
        (&((_, lmax), _), &((rmin, rmax), _)): (&ListBounds, &ListBounds),
        (ls, rs): (&[u64], &[u64]),
    ) -> bool {
        if lmax >= self.lcap || rmax >= self.rcap || rmin == u64::from(NULL_BLOCK) {
            return false;
        }
        let start = read.pairs.len();
        let at = |o: u64, b: u64, st: u64| o.wrapping_add(b.wrapping_mul(st));
        if let ([lb], [rb]) = (ls, rs) {
            read.pairs.push(Pair {
                local: at(self.local, *lb, self.lstride),
                remote: at(self.remote, *rb, self.rstride),
                len: self.len,
            });
        } else {
            let RowPair { local, lstride, remote, rstride, len, .. } = *self;
            read.pairs.extend(ls.iter().zip(rs).map(|(&lb, &rb)| Pair {
                local: at(local, lb, lstride),
                remote: at(remote, rb, rstride),
                len,
            }));
        }
        // Whole lists start at their first block: nothing to merge with the run before.
        read.batches.push(RunBatch {
            rows: Rows::One(self.label),
            group: self.group,
            remote_group: self.group,
            start: start as u32,
            count: ls.len() as u32,
            local_at: 0,
            remote_at: 0,
        });
        true
    }

    pub(super) fn new(l: RunRow, r: RunRow, llist: &DescList, rlist: &DescList) -> Option<RowPair> {
        if l.run.group != r.run.group {
            return None;
        }
        let (Some((li, loff)), Some((ri, roff))) = (l.row, r.row) else {
            return Some(RowPair { group: l.run.group, fast: false, ..RowPair::NONE });
        };
        let (lrow, rrow) = (&llist.rows[li], &rlist.rows[ri]);
        Some(RowPair {
            group: l.run.group,
            label: lrow.label,
            local: lrow.addr_off.wrapping_add(loff.wrapping_mul(lrow.stride)),
            lstride: lrow.stride,
            lcap: lrow.count - loff,
            remote: rrow.addr_off.wrapping_add(roff.wrapping_mul(rrow.stride)),
            rstride: rrow.stride,
            rcap: rrow.count - roff,
            len: lrow.len,
            fast: llist.registered[li] && rlist.registered[ri] && lrow.len == rrow.len,
        })
    }

    const NONE: RowPair = RowPair {
        group: 0,
        label: RowLabel { kind: RowKind::AttnPage, region: 0 },
        local: 0,
        lstride: 0,
        lcap: 0,
        remote: 0,
        rstride: 0,
        rcap: 0,
        len: 0,
        fast: false,
    };
}

/// An id run and the row of its side's list holding id `run.base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RunRow {
    pub(super) run: IdRun,
    pub(super) row: RowAt,
}

/// A block list's lowest and highest block, and its length.
pub(super) type ListBounds = ((u64, u64), usize);

/// Descriptor ids `base + b` for every block `b` of one group's list, in list order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdRun {
    pub(super) group: u32,
    pub(super) base: u64,
}

/// Where one READ's walk stands: the lists it resolves ids in, and the registration and
/// row the last descriptor fell in, per side.
pub(super) struct ReadWalk<'a> {
    pub(super) d_rank: u32,
    pub(super) p_rank: u32,
    pub(super) llist: &'a DescList,
    pub(super) rlist: &'a DescList,
    pub(super) near: [usize; 2],
    pub(super) rows: [usize; 2],
    /// The lowest and highest block of each group's whole list, and its length, per side.
    pub(super) bounds: [&'a [ListBounds]; 2],
}

/// Equal stretches of one id run on each side (`n` blocks from `local_at` / `remote_at`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Chunk {
    pub(super) local: IdRun,
    pub(super) remote: IdRun,
    pub(super) local_at: usize,
    pub(super) remote_at: usize,
    pub(super) n: usize,
}

pub(super) fn min_max(xs: &[u64]) -> (u64, u64) {
    xs.iter().fold((u64::MAX, 0), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// vLLM's `_compute_desc_ids` for one side over `groups` block lists, as runs: for each run,
/// in posting order, the ids `base + b` of one group's blocks `b`. `bsr` expands the attention
/// descriptors (local side).
pub(super) fn desc_id_runs(g: &EngineGeometry, groups: usize, bsr: u32) -> Vec<IdRun> {
    let mut out = Vec::new();
    let bsr = u64::from(bsr.max(1));
    let mut offsets = Vec::with_capacity(g.regions.len());
    let mut acc = 0;
    for n in region_sizes(g) {
        offsets.push(acc);
        acc += n * bsr;
    }
    let num_fa = acc;
    let groups = 0..groups as u32;
    let Some(state) = &g.state else {
        let gids: Vec<i32> = g.regions.iter().map(|r| r.group_id).collect();
        if gids.iter().all(|&x| x == gids[0]) {
            // Shared regions: every group's blocks over every region.
            for &base in &offsets {
                out.extend(groups.clone().map(|group| IdRun { group, base }));
            }
        } else {
            for group in groups {
                for (&gid, &base) in gids.iter().zip(&offsets) {
                    if gid == group as i32 || gid == -1 {
                        out.push(IdRun { group, base });
                    }
                }
            }
        }
        return out;
    };
    let num_blocks = g.kernel_blocks() * bsr;
    let logical = g.num_blocks();
    let state_regions: Vec<i32> = g.regions.iter().filter(|r| r.holds_state).map(|r| r.group_id).collect();
    let parts = state.parts.len() as u64;
    // Host descriptors per group: a host buffer's group over its own layers' tensors only
    // (each host region is one layer's, of one group); vLLM's over every region (attention)
    // and every state region (state).
    let own = g.config.host_descriptors_per_group && g.mem() == RegionMem::Dram;
    let mine =
        |gid: i32, grp: &super::geometry::KvGroup| !own || gid == i32::try_from(grp.index).unwrap_or(-1);
    for (group, grp) in groups.zip(&g.groups) {
        if grp.kind.is_attention() {
            out.extend(
                (0u64..)
                    .zip(&g.regions)
                    .filter(|(_, r)| mine(r.group_id, grp))
                    .map(|(r, _)| IdRun { group, base: r * num_blocks }),
            );
        } else {
            // Rows run state region by state region, one per part (`local_rows`).
            out.extend(
                (0u64..)
                    .zip(&state_regions)
                    .filter(|&(_, &gid)| mine(gid, grp))
                    .flat_map(|(si, _)| si * parts..(si + 1) * parts)
                    .map(|row| IdRun { group, base: num_fa + row * logical }),
            );
        }
    }
    out
}

/// Kernel blocks of every region of `g`.
pub(super) fn region_sizes(g: &EngineGeometry) -> Vec<u64> {
    g.regions.iter().map(|r| r.num_blocks).collect()
}
