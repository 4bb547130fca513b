//! The request stream a bench drives: prompt lengths, arrivals, how many, prefix hits.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use crate::error::ConfigError;

/// Largest prompt kvx accepts (tokens).
pub const MAX_PROMPT: u32 = 1 << 24;

/// Prompt lengths: fixed, uniform over a range, or cycled from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum PromptLens {
    Fixed(u32),
    Uniform(u32, u32),
    List(Vec<u32>),
}

impl fmt::Display for PromptLens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptLens::Fixed(n) => write!(f, "{n}"),
            PromptLens::Uniform(a, b) => write!(f, "{a}..{b}"),
            PromptLens::List(v) => write!(f, "{} lengths from a file", v.len()),
        }
    }
}

impl FromStr for PromptLens {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parse = |t: &str| -> Result<u32, String> {
            let n: u32 =
                t.trim().replace('_', "").parse().map_err(|_| format!("'{t}' is not a token count"))?;
            if n == 0 || n > MAX_PROMPT {
                return Err(format!("prompt length {n} is outside 1..={MAX_PROMPT}"));
            }
            Ok(n)
        };
        match s.split_once("..") {
            Some((a, b)) => {
                let (a, b) = (parse(a)?, parse(b.trim_start_matches('='))?);
                if a > b {
                    return Err(format!("range {a}..{b} is empty"));
                }
                Ok(if a == b { PromptLens::Fixed(a) } else { PromptLens::Uniform(a, b) })
            }
            None => Ok(PromptLens::Fixed(parse(s)?)),
        }
    }
}

impl PromptLens {
    /// Reads one length per line (blank lines and `#` comments skipped).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let flag = "--prompt-lens";
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", path.display())))?;
        let mut v = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let t = line.split('#').next().unwrap_or("").trim();
            if t.is_empty() {
                continue;
            }
            match t.parse::<PromptLens>() {
                Ok(PromptLens::Fixed(n)) => v.push(n),
                _ => {
                    return Err(ConfigError::new(
                        flag,
                        format!(
                            "{} line {}: '{t}' is not a prompt length (1..={MAX_PROMPT})",
                            path.display(),
                            i + 1
                        ),
                    ));
                }
            }
        }
        if v.is_empty() {
            return Err(ConfigError::new(flag, format!("{} has no prompt lengths", path.display())));
        }
        Ok(PromptLens::List(v))
    }

    pub fn max(&self) -> u32 {
        match self {
            PromptLens::Fixed(n) => *n,
            PromptLens::Uniform(_, b) => *b,
            PromptLens::List(v) => v.iter().copied().max().unwrap_or(1),
        }
    }

    pub fn mean(&self) -> f64 {
        match self {
            PromptLens::Fixed(n) => f64::from(*n),
            PromptLens::Uniform(a, b) => (f64::from(*a) + f64::from(*b)) / 2.0,
            PromptLens::List(v) => v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len().max(1) as f64,
        }
    }
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Arrival {
    /// Keep `n` requests in flight.
    Closed { concurrency: u32 },
    /// Open loop, Poisson arrivals at `rate` requests per second.
    Poisson { rate: f64 },
}

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
