//! `kvx plan` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct PlanArgs {}

pub fn run(_args: &PlanArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx plan` is not implemented yet")
}
