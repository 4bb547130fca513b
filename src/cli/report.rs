//! `kvx report` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct ReportArgs {}

pub fn run(_args: &ReportArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx report` is not implemented yet")
}
