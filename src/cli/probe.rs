//! `kvx probe`: speak the side-channel protocol to a kvx engine or a live vLLM and print
//! what it advertises for one rank (`--repeat N` also measures handshake latency).

use anyhow::Context as _;
use clap::Args;

use crate::diagnose::probe::{self, LatencySummary};
use crate::error::Outcome;
use crate::output;
use crate::settings::probe::{ProbeFlags, resolve};
pub use crate::settings::probe::{ProbeFormat, VllmFraming};

#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub settings: ProbeFlags,
}

pub fn run(args: &ProbeArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    let settings = resolve(args)?;
    let (endpoint, opts) = (settings.endpoint, settings.opts);
    let mut samples = Vec::with_capacity(args.repeat.repeat() as usize);
    let mut last = None;
    for _ in 0..args.repeat.repeat() {
        let report = probe::probe(&endpoint, &opts).with_context(|| format!("probing {endpoint}"))?;
        samples.push(report.latency_us);
        last = Some(report);
    }
    let report = last.context("no probe ran")?;
    let latency = (args.repeat.repeat() > 1).then(|| LatencySummary::of(&samples)).flatten();
    match args.format {
        ProbeFormat::Json => {
            let mut v = serde_json::to_value(&report)?;
            if let (Some(l), Some(obj)) = (latency, v.as_object_mut()) {
                obj.insert("latency_summary".into(), serde_json::to_value(l)?);
            }
            output::stdout_json(&v)?;
        }
        ProbeFormat::Table => {
            let mut text = probe::render_table(&report);
            if let Some(l) = latency {
                text.push_str(&format!(
                    "handshake latency over {} probes: min {:.0} µs, p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs\n",
                    l.count, l.min_us, l.p50_us, l.p99_us, l.max_us
                ));
            }
            output::stdout(text)?;
        }
    }
    if let probe::Advertised::PeerError { message } = &report.advertised {
        anyhow::bail!("{endpoint} answered with an error instead of metadata: {message}");
    }
    Ok(Outcome::Ok)
}
