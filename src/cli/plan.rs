//! `kvx plan`: the descriptor pairs each decode rank posts for one request, and what posting
//! them costs on each transport (`layouts::posting`: is the request post-bound?); with
//! `--mode push`, the WRITEs each prefill rank posts into the decode ranks' blocks. The flags
//! resolve into one request (`settings::plan`), `layouts::request` plans it, `report::plan`
//! renders it; this file prints.

use clap::Args;

use super::common::{Format, reject};
use crate::error::{ConfigError, Outcome};
use crate::layouts::request::plan;
use crate::output;
use crate::report::plan::{PlanView, export, render};
use crate::report::prediction::Simulator;
use crate::settings::plan::{ExportArg, PlanFlags, resolve_plan};

#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  kvx plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --alloc random\n  \
    kvx plan --p-tp 1 --d-tp 2 --num-kv-heads 2 --layers 2 --head-dim 64 --local-blocks 1,3 --remote-blocks 0,2\n  \
    kvx plan --scenario case.json --format json\n  \
    kvx plan --mode push --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 4096\n  \
    kvx plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 8192 --post-ns cuda-batch=150,cuda-batch-call=9000\n\n\
Posting cost: for each transport (ucx on host memory, UCX cuda_ipc, kvx's cuda-batch) the
descriptors the busiest decode rank posts, the time posting them takes at that transport's
per-descriptor rate, and the time the bytes take at its bandwidth ceiling; a request whose
posting takes longer is post-bound. Every rate names the results file and line it comes
from; `--rates FILE` takes your own `kvx xfer --format json` (or gpu-check) JSON instead.

Prediction: with `--rates FILE` written by `kvx calibrate`, each posting rank's transfer time
(fixed + posting + bytes, with as many ranks posting at once as the pair has) and the request's
span, naming the term that bounds it; outside the fitted range it says EXTRAPOLATED.
`--export llm-d-sim|dynamo-mocker` writes that prediction as the simulator's profile."
)]
#[command(allow_negative_numbers = true)]
pub struct PlanArgs {
    #[command(flatten)]
    pub settings: PlanFlags,
}

/// Resolves the flags into one request, plans it, prints it.
pub fn run(args: &PlanArgs) -> anyhow::Result<Outcome> {
    let flags = &args.settings;
    let request = resolve_plan(flags).map_err(|e| reject(flags.format, e))?;
    if flags.export.is_some() && flags.rates.is_none() {
        return Err(reject(
            flags.format,
            ConfigError::new("--export", "needs --rates FILE written by kvx calibrate"),
        ));
    }
    let planned = plan(request).map_err(|e| reject(flags.format, e))?;
    if let Some(sim) = flags.export {
        let sim = match sim {
            ExportArg::LlmdSim => Simulator::LlmdSim,
            ExportArg::DynamoMocker => Simulator::DynamoMocker,
        };
        let profile =
            export(&planned, sim).map_err(|why| reject(flags.format, ConfigError::new("--rates", why)))?;
        output::stdout(profile)?;
        return Ok(Outcome::Ok);
    }
    let view = match flags.format {
        Format::Json => PlanView::Json,
        Format::Table => PlanView::Table { show_pairs: flags.show_pairs },
    };
    output::stdout(render(&planned, view)?)?;
    Ok(Outcome::Ok)
}
