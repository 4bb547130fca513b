//! `kvx load` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct LoadArgs {}

pub fn run(_args: &LoadArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx load` is not implemented yet")
}
