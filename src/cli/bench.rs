//! `kvx bench` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct BenchArgs {}

pub fn run(_args: &BenchArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx bench` is not implemented yet")
}
