//! `kvx layout`: the KV cache layout of one rank: shape, strides, registered regions, bytes. The
//! flags resolve into one engine (`settings::layout`), `report::layout` renders it; this file
//! prints.

use clap::Args;

use super::common::{Format, reject};
use crate::error::Outcome;
use crate::output;
use crate::report::layout::{LayoutView, render};
use crate::settings::layout::{LayoutFlags, resolve_layout};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx layout --model llama-3.1-70b --tp 8\n  \
    kvx layout --model deepseek-v3 --layout BLHNC --tokens 32768\n  \
    kvx layout --model qwen3-8b --vllm 0.19 --layout NHD --format json")]
#[command(allow_negative_numbers = true)]
pub struct LayoutArgs {
    #[command(flatten)]
    pub settings: LayoutFlags,
}

/// Resolves the flags into one engine, prints its layout.
pub fn run(args: &LayoutArgs) -> anyhow::Result<Outcome> {
    let flags = &args.settings;
    let engine = resolve_layout(flags).map_err(|e| reject(flags.format, e))?;
    let view = match flags.format {
        Format::Json => LayoutView::Json,
        Format::Table => LayoutView::Table { show_regions: flags.show_regions },
    };
    output::stdout(render(&engine, view)?)?;
    Ok(Outcome::Ok)
}
