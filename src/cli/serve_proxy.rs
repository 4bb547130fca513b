//! `kvx serve-proxy` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct ServeProxyArgs {}

pub fn run(_args: &ServeProxyArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx serve-proxy` is not implemented yet")
}
