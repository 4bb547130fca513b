//! `kvx topo` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct TopoArgs {}

pub fn run(_args: &TopoArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx topo` is not implemented yet")
}
