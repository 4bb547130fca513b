//! An engine's KV block pool: the block ids its scheduler hands out. All TP ranks of an
//! engine share one block table, so one pool serves every rank.
//!
//! The allocation pattern decides how scattered a request's blocks are, which decides how
//! far its descriptors coalesce: `contiguous` takes the first run of free ids, `fragmented`
//! behaves like vLLM's free-block queue started from a churned pool (take from the head,
//! return to the tail), `random` picks free ids uniformly.

use std::collections::{BTreeSet, VecDeque};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

use crate::layouts::alloc::AllocPattern;

/// A pool of `num_blocks` block ids.
#[derive(Debug)]
pub struct BlockPool {
    num_blocks: u32,
    /// Ids never handed out (vLLM's null block, id 0, in a hybrid engine's pool).
    reserved: u32,
    pattern: AllocPattern,
    free: Free,
    rng: StdRng,
}

#[derive(Debug)]
enum Free {
    Sorted(BTreeSet<u32>),
    Queue(VecDeque<u32>),
    Bag(Vec<u32>),
}

impl BlockPool {
    pub fn new(num_blocks: u32, pattern: AllocPattern, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let free = match pattern {
            AllocPattern::Contiguous => Free::Sorted((0..num_blocks).collect()),
            AllocPattern::Random => Free::Bag((0..num_blocks).collect()),
            AllocPattern::Fragmented => {
                // A churned pool: runs of 1-8 ids in shuffled order.
                let mut runs = Vec::new();
                let mut at = 0;
                while at < num_blocks {
                    let len = rng.random_range(1..=8).min(num_blocks - at);
                    runs.push(at..at + len);
                    at += len;
                }
                runs.shuffle(&mut rng);
                Free::Queue(runs.into_iter().flatten().collect())
            }
        };
        BlockPool { num_blocks, reserved: 0, pattern, free, rng }
    }

    /// The pool without id 0, which vLLM's hybrid allocator keeps as its null block (the id a
    /// block list holds where a group keeps no block).
    pub fn reserving_null(mut self) -> Self {
        let held = match &mut self.free {
            Free::Sorted(s) => s.remove(&0),
            Free::Queue(q) => q.iter().position(|&b| b == 0).and_then(|i| q.remove(i)).is_some(),
            Free::Bag(b) => b.iter().position(|&x| x == 0).map(|i| b.swap_remove(i)).is_some(),
        };
        self.reserved = u32::from(held);
        self
    }

    pub fn capacity(&self) -> u32 {
        self.num_blocks - self.reserved
    }

    pub fn pattern(&self) -> AllocPattern {
        self.pattern
    }

    pub fn free_count(&self) -> u32 {
        (match &self.free {
            Free::Sorted(s) => s.len(),
            Free::Queue(q) => q.len(),
            Free::Bag(b) => b.len(),
        }) as u32
    }

    pub fn in_use(&self) -> u32 {
        self.capacity() - self.free_count()
    }

    /// Takes `n` ids, or `None` when fewer than `n` are free (the caller waits).
    pub fn alloc(&mut self, n: u32) -> Option<Vec<u32>> {
        if n > self.free_count() {
            return None;
        }
        let n = n as usize;
        Some(match &mut self.free {
            Free::Sorted(set) => {
                // First run of n consecutive free ids; else the lowest free ids.
                let mut run_start = None;
                let mut prev: Option<u32> = None;
                let mut len = 0usize;
                for &b in set.iter() {
                    if prev.is_some_and(|p| p + 1 == b) {
                        len += 1;
                    } else {
                        len = 1;
                        run_start = Some(b);
                    }
                    prev = Some(b);
                    if len == n {
                        break;
                    }
                }
                let ids: Vec<u32> = match run_start {
                    Some(s) if len == n => (s..s + n as u32).collect(),
                    _ => set.iter().copied().take(n).collect(),
                };
                for b in &ids {
                    set.remove(b);
                }
                ids
            }
            Free::Queue(q) => q.drain(..n).collect(),
            Free::Bag(bag) => {
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    let i = self.rng.random_range(0..bag.len());
                    ids.push(bag.swap_remove(i));
                }
                ids
            }
        })
    }

    /// Returns ids to the pool.
    pub fn free(&mut self, ids: &[u32]) {
        match &mut self.free {
            Free::Sorted(set) => set.extend(ids.iter().copied()),
            Free::Queue(q) => q.extend(ids.iter().rev().copied()),
            Free::Bag(bag) => bag.extend_from_slice(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_takes_runs_and_accounts() {
        let mut p = BlockPool::new(16, AllocPattern::Contiguous, 0);
        let a = p.alloc(4).expect("fits");
        assert_eq!(a, vec![0, 1, 2, 3]);
        let b = p.alloc(4).expect("fits");
        p.free(&a);
        let c = p.alloc(6).expect("fits");
        assert_eq!(c, (8..14).collect::<Vec<_>>(), "first run long enough");
        assert!(p.alloc(7).is_none());
        p.free(&b);
        p.free(&c);
        assert_eq!(p.in_use(), 0);
    }

    #[test]
    fn every_pattern_hands_out_distinct_ids() {
        for pattern in [AllocPattern::Contiguous, AllocPattern::Fragmented, AllocPattern::Random] {
            let mut p = BlockPool::new(100, pattern, 7);
            let mut all: Vec<u32> = (0..5).flat_map(|_| p.alloc(20).expect("fits")).collect();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), 100, "{pattern}");
            assert_eq!(p.free_count(), 0);
        }
    }
}
