//! `kvx load`: its flags (`settings::load`, which checks them) and the output around `serve::load`. Reports through the
//! same machinery as `kvx bench`: a run directory under `results/` (summary, CSVs, SVGs) and
//! tables or the summary JSON on stdout; a progress bar on stderr when it is a terminal.

use clap::Args;

use crate::error::Outcome;
use crate::report::files::RunWriter;
use crate::report::summary::{new_run_id, now_rfc3339};
use crate::report::table::Style;
use crate::serve::load::{self, LoadProgress, ProgressDisplay};
use crate::serve::load_report;
use crate::settings::env::ProcessEnv;
pub use crate::settings::load::{EndpointArg, Format};
use crate::settings::load::{LoadFlags, resolve};

#[derive(Debug, Args)]
#[command(allow_negative_numbers = true)]
pub struct LoadArgs {
    #[command(flatten)]
    pub settings: LoadFlags,
}

pub fn run(args: &LoadArgs) -> anyhow::Result<Outcome> {
    let args = &args.settings;
    let settings = resolve(args, &ProcessEnv::read())?;
    let (mut cfg, root) = (settings.load, settings.results_root);
    // A slow open loop waits long before its first request: say how long, up front.
    if let crate::config::arrival::Arrival::Poisson { rate: r } = cfg.arrival
        && r < 1.0
    {
        crate::output::note!(
            "kvx load: open loop at {r} requests/s per target: about {:.0} s between requests (Poisson)",
            1.0 / r
        );
    }
    let started_at = now_rfc3339();
    let run_id = new_run_id(&started_at);
    let writer = RunWriter::create(&root, &run_id)?;
    // Ctrl-C ends the load: no new requests, a short grace for those in flight, the partial
    // report written and printed, exit 130/143.
    crate::interrupt::arm();
    let rt = super::serve_engine::runtime(args.threads)?;
    let progress = LoadProgress::new();
    let total = cfg.requests.map(|n| (n + cfg.warmup) * cfg.targets.len() as u64);
    let display = ProgressDisplay::start(progress.clone(), total);
    let (run, cfg) = rt.block_on(async move {
        if cfg.model.is_none() {
            cfg.model = load::discover_model(&cfg.targets[0].url, cfg.api_key.as_deref()).await;
        }
        load::run_with_progress(cfg.clone(), Some(progress)).await.map(|r| (r, cfg))
    })?;
    drop(display);
    let mut summary = load_report::summary(
        &run,
        &cfg,
        &run_id,
        &started_at,
        args.run_name.name.as_deref().unwrap_or("load"),
    );
    let interrupted = load_report::mark_interrupted(&mut summary);
    let out = match args.format {
        Format::Table => format!(
            "{}results: {}\n",
            load_report::render(&summary, &run.summary, Style::Terminal),
            writer.dir().display()
        ),
        Format::Json => String::from_utf8_lossy(&crate::report::export::summary_json(&summary)?).into_owned(),
    };
    // Printed before any file is written: a full disk does not hide what was measured.
    crate::output::keep_verdict(crate::output::stdout(out))?;
    load_report::write_run(writer, &summary, &run)?;
    if let Some(sig) = interrupted {
        return Ok(Outcome::Interrupted(sig));
    }
    // The run completed: failed requests are its verdict (exit 1), not an error (exit 2).
    if let Some(t) = run.summary.targets.iter().find(|t| t.ok == 0) {
        return Ok(Outcome::Failed(format!(
            "kvx load: no request to target `{}` ({}) succeeded; errors: {:?}",
            t.name, t.url, t.errors
        )));
    }
    Ok(crate::report::verdict::outcome("kvx load", &summary))
}

#[cfg(test)]
mod tests {
    #[test]
    fn bench_takes_slo_and_metrics_port_with_serve_only() {
        use clap::Parser as _;
        let parse = |v: &[&str]| crate::cli::Cli::try_parse_from(v.iter().copied());
        assert!(parse(&["kvx", "bench", "--serve", "--slo", "ttft=200ms", "--metrics-port", "0"]).is_ok());
        for flag in [["--slo", "ttft=200ms"], ["--metrics-port", "0"]] {
            let e = parse(&["kvx", "bench", flag[0], flag[1]]).expect_err("needs --serve");
            assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument, "{e}");
            assert!(e.to_string().contains("--serve"), "{e}");
        }
    }
}
