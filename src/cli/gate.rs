//! `kvx gate` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct GateArgs {}

pub fn run(_args: &GateArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx gate` is not implemented yet")
}
