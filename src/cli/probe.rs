//! `kvx probe` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct ProbeArgs {}

pub fn run(_args: &ProbeArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx probe` is not implemented yet")
}
