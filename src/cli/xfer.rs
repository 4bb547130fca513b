//! `kvx xfer` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct XferArgs {}

pub fn run(_args: &XferArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx xfer` is not implemented yet")
}
