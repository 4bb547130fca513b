//! `kvx completions <shell>`.
use clap::{Args, CommandFactory};
use clap_complete::Shell;

use crate::error::Outcome;

#[derive(Debug, Args)]
#[command(after_help = "Example:\n  kvx completions bash > /etc/bash_completion.d/kvx")]
#[command(allow_negative_numbers = true)]
pub struct CompletionsArgs {
    /// Shell to generate completions for.
    pub shell: Shell,
}

pub fn run(args: &CompletionsArgs) -> anyhow::Result<Outcome> {
    let mut cmd = super::Cli::command();
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "kvx", &mut script);
    crate::output::stdout(script)?;
    Ok(Outcome::Ok)
}
