//! Block-id allocation patterns for synthetic requests: how fragmented a pool's free list is
//! decides how far a plan coalesces.

use std::fmt;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::KnobError;
use crate::vocab::knob::Knob;

/// How a request's blocks are picked from a pool ([`Knob::Alloc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AllocPattern {
    /// One run of consecutive block ids.
    #[default]
    Contiguous,
    /// Runs of 1-8 consecutive ids scattered over the pool (a pool that has churned).
    Fragmented,
    /// Every id independent (the worst case for coalescing).
    Random,
}

impl FromStr for AllocPattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "contiguous" => Ok(AllocPattern::Contiguous),
            "fragmented" => Ok(AllocPattern::Fragmented),
            "random" => Ok(AllocPattern::Random),
            other => Err(format!("unknown allocation pattern '{other}' (contiguous, fragmented or random)")),
        }
    }
}

impl fmt::Display for AllocPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AllocPattern::Contiguous => "contiguous",
            AllocPattern::Fragmented => "fragmented",
            AllocPattern::Random => "random",
        })
    }
}

/// Picks `n` distinct block ids out of a pool of `pool` blocks; `pool_knob` sets the pool.
pub fn allocate(
    pattern: AllocPattern,
    n: u32,
    pool: u32,
    seed: u64,
    pool_knob: Knob,
) -> Result<Vec<u32>, KnobError> {
    if n > pool {
        return Err(KnobError::new(
            pool_knob,
            format!(
                "the request needs {n} blocks but the pool has only {pool}; raise {pool_knob} or shorten the prompt"
            ),
        ));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    Ok(match pattern {
        AllocPattern::Contiguous => {
            let start = if pool > n { rng.random_range(0..=pool - n) } else { 0 };
            (start..start + n).collect()
        }
        AllocPattern::Random => {
            let mut ids: Vec<u32> = (0..pool).collect();
            let (picked, _) = ids.partial_shuffle(&mut rng, n as usize);
            picked.to_vec()
        }
        AllocPattern::Fragmented => {
            // Cut the pool into runs of 1-8 blocks, shuffle the runs, take runs until n.
            let mut runs = Vec::new();
            let mut at = 0;
            while at < pool {
                let len = rng.random_range(1..=8).min(pool - at);
                runs.push(at..at + len);
                at += len;
            }
            runs.shuffle(&mut rng);
            runs.into_iter().flatten().take(n as usize).collect()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_give_distinct_in_range_ids() {
        for p in [AllocPattern::Contiguous, AllocPattern::Fragmented, AllocPattern::Random] {
            let ids = allocate(p, 100, 1000, 3, Knob::PNumBlocks).expect("fits");
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 100, "{p}");
            assert!(ids.iter().all(|&b| b < 1000));
        }
        assert!(allocate(AllocPattern::Random, 10, 5, 0, Knob::PNumBlocks).is_err());
    }
}
