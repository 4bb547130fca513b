//! `kvx doctor` (not implemented yet).
use clap::Args;

use crate::Outcome;

#[derive(Debug, Args)]
pub struct DoctorArgs {}

pub fn run(_args: &DoctorArgs) -> anyhow::Result<Outcome> {
    anyhow::bail!("`kvx doctor` is not implemented yet")
}
