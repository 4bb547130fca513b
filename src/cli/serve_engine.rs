//! `kvx serve-engine` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct ServeEngineArgs {}

pub fn run(_args: &ServeEngineArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx serve-engine` is not implemented yet")
}
