//! `kvx calibrate`: fits this host's transfer-time model from `kvx xfer` sweeps
//! (`diagnose::calibrate`) and writes the rates file `kvx plan --rates` and `kvx bench
//! --rates` predict with; prints the fitted terms (and, with `--compare`, how each moved).

use clap::Args;

use crate::error::{ConfigError, Outcome};
use crate::output;
use crate::settings::calibrate::{CalibrateFlags, resolve_calibrate};

#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  kvx calibrate --out rates.json\n  \
    kvx calibrate --quick --out rates.json\n  \
    kvx calibrate --out rates2.json --compare rates.json     # is the fit stable on this host?\n  \
    kvx calibrate --path cuda-batch --out rates-gpu.json\n  \
    kvx plan --p-tp 4 --d-tp 2 --model qwen3-next-80b-a3b --prompt-len 32768 --rates rates.json\n\n\
The model: one posting rank's transfer of a request takes fixed + descriptors x ns/descriptor +
bytes / rate, with ns/descriptor and rate measured with 1, 2 and 4 readers at once on this host.
Each term is a least-squares fit of kvx xfer batch times (child processes of this binary); the
file keeps every point, the command, host, kvx and UCX versions and the date.")]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub settings: CalibrateFlags,
}

pub fn run(args: &CalibrateArgs) -> anyhow::Result<Outcome> {
    let words: Vec<String> = std::env::args().skip(1).collect();
    let command = format!("kvx {}", words.join(" "));
    let cfg = resolve_calibrate(&args.settings, command)?;
    let date = crate::clock::now_rfc3339();
    // From here on Ctrl-C (or SIGTERM) stops the sweeps' children and ends the run (130/143).
    crate::interrupt::arm();
    let done = match crate::diagnose::calibrate::calibrate(&cfg, &date) {
        Err(crate::diagnose::calibrate::CalibrateError::Interrupted(sig)) => {
            output::note!("kvx calibrate: interrupted by {}; no rates file written", sig.name());
            return Ok(Outcome::Interrupted(sig));
        }
        other => other?,
    };
    let mut text = serde_json::to_string_pretty(&done.file)?;
    text.push('\n');
    std::fs::write(&cfg.out, text)
        .map_err(|e| ConfigError::new("--out", format!("cannot write {}: {e}", cfg.out.display())))?;
    output::stdout(crate::report::prediction::calibrate_text(
        cfg.path,
        &done.model,
        &done.fit,
        done.changes.as_deref(),
        &cfg.out.display().to_string(),
    ))?;
    Ok(Outcome::Ok)
}
