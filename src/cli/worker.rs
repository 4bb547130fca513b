//! `kvx worker` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct WorkerArgs {}

pub fn run(_args: &WorkerArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx worker` is not implemented yet")
}
