//! `kvx topo`: the rank map of a P/D pair, as a table or as JSON with the oracle's field names.
//! `--mode push` shows the push-mode map instead: which prefill rank WRITEs which bytes into
//! which decode rank's blocks, and how many notifications each decode rank waits for. The
//! flags resolve into one pair (`settings::topo`), `layouts::rank_maps` maps it,
//! `report::topo` renders it; this file prints.

use clap::Args;

use super::common::{Format, reject};
use crate::error::Outcome;
use crate::layouts::rank_maps::rank_map;
use crate::output;
use crate::report::topo::{TopoView, render};
use crate::settings::topo::{TopoFlags, resolve_topo};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx topo --p-tp 8 --d-tp 2 --model llama-3.1-70b\n  \
    kvx topo --p-tp 2 --d-tp 8 --num-kv-heads 4 --format json\n  \
    kvx topo --p-tp 4 --d-tp 1 --model deepseek-v3 --vllm 0.19\n  \
    kvx topo --mode push --p-tp 2 --d-tp 4 --model llama-3.1-70b")]
#[command(allow_negative_numbers = true)]
pub struct TopoArgs {
    #[command(flatten)]
    pub settings: TopoFlags,
}

/// Resolves the flags into one pair, maps it, prints the map.
pub fn run(args: &TopoArgs) -> anyhow::Result<Outcome> {
    let flags = &args.settings;
    let request = resolve_topo(flags).map_err(|e| reject(flags.format, e))?;
    let map = rank_map(request).map_err(|e| reject(flags.format, e))?;
    let view = match flags.format {
        Format::Json => TopoView::Json,
        Format::Table => TopoView::Table,
    };
    output::stdout(render(&map, view)?)?;
    Ok(Outcome::Ok)
}
