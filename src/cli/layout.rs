//! `kvx layout` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct LayoutArgs {}

pub fn run(_args: &LayoutArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx layout` is not implemented yet")
}
