//! The request stream a bench drives: prompt lengths, arrivals, how many, prefix hits.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::config::bench::PromptLens;

/// Generates the request stream deterministically from a seed.
#[derive(Debug)]
pub struct Generator {
    lens: PromptLens,
    rng: StdRng,
    next_index: usize,
}

impl Generator {
    pub fn new(lens: PromptLens, seed: u64) -> Self {
        Generator { lens, rng: StdRng::seed_from_u64(seed), next_index: 0 }
    }

    /// The next prompt length.
    pub fn prompt_len(&mut self) -> u32 {
        let i = self.next_index;
        self.next_index += 1;
        match &self.lens {
            PromptLens::Fixed(n) => *n,
            PromptLens::Uniform(a, b) => self.rng.random_range(*a..=*b),
            PromptLens::List(v) => v[i % v.len()],
        }
    }

    /// Time to the next arrival of a Poisson process at `rate` per second.
    pub fn inter_arrival(&mut self, rate: f64) -> Duration {
        let u: f64 = self.rng.random_range(f64::EPSILON..1.0);
        Duration::from_secs_f64(-u.ln() / rate)
    }

    /// A per-request seed for the byte pattern.
    pub fn pattern_seed(&mut self) -> u64 {
        self.rng.random()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lens_parse() {
        assert_eq!("8192".parse(), Ok(PromptLens::Fixed(8192)));
        assert_eq!("1024..32768".parse(), Ok(PromptLens::Uniform(1024, 32768)));
        assert!("0".parse::<PromptLens>().is_err());
        assert!("9..3".parse::<PromptLens>().is_err());
        assert!("abc".parse::<PromptLens>().is_err());
    }

    #[test]
    fn poisson_mean_is_one_over_rate() {
        let mut g = Generator::new(PromptLens::Fixed(1), 1);
        let n = 20_000;
        let total: f64 = (0..n).map(|_| g.inter_arrival(100.0).as_secs_f64()).sum();
        let mean = total / f64::from(n);
        assert!((mean - 0.01).abs() < 0.001, "mean {mean}");
    }
}
