//! `kvx doctor`: flags and rendering of the host check.

use clap::Args;

use crate::cli::xfer::Format;
use crate::diagnose::doctor::{self, DoctorOptions, DoctorReport};
use crate::error::Outcome;
use crate::output;

/// What kvx sees on this host, one line per item: verdict, detail, hint.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  kvx doctor                       # first thing to run when a number looks low
  kvx doctor --format json
  kvx doctor --ucx-lib /usr/lib/x86_64-linux-gnu/libucp.so.0

Exit code 0 unless something kvx needs is missing (then 2).")]
#[command(allow_negative_numbers = true)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub ucx_lib: crate::settings::flags::UcxLibFlags,
    #[command(flatten)]
    pub side_channel: crate::settings::flags::SideChannelPortFlags,
    /// How many side-channel ports to check from the first.
    #[arg(long, default_value_t = 8)]
    pub ports: u16,
    /// Skip the two-process zero-copy GET self-test.
    #[arg(long)]
    pub no_self_test: bool,
    #[arg(long, value_enum, default_value_t = Format::Table, help = crate::settings::flags::FORMAT_HELP)]
    pub format: Format,
}

pub fn run(args: &DoctorArgs) -> anyhow::Result<Outcome> {
    let self_test_exe = if args.no_self_test { None } else { std::env::current_exe().ok() };
    let report = doctor::run(&DoctorOptions {
        ucx_lib: args.ucx_lib.clone().ucx_lib,
        self_test_exe,
        side_channel_port: args.side_channel.side_channel_port,
        ports: args.ports.max(1),
        launcher: crate::settings::env::launcher(),
    });
    match args.format {
        Format::Json => output::stdout_json(&report)?,
        Format::Table => output::stdout(render(&report))?,
    }
    if report.needed_missing {
        let failed: Vec<&str> =
            report.checks.iter().filter(|c| c.verdict == doctor::Verdict::Fail).map(|c| c.name).collect();
        anyhow::bail!("kvx cannot run on this host: {} failed (see the hints above)", failed.join(", "));
    }
    Ok(Outcome::Ok)
}

fn render(r: &DoctorReport) -> String {
    let width = r.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let verdicts: Vec<String> = r.checks.iter().map(|c| c.verdict.to_string()).collect();
    let v = verdicts.iter().map(String::len).max().unwrap_or(0);
    let mut out = String::new();
    for (c, verdict) in r.checks.iter().zip(&verdicts) {
        out.push_str(&format!("{verdict:<v$}  {:<width$}  {}\n", c.name, c.detail));
        if !c.hint.is_empty() {
            out.push_str(&format!("{:<v$}  {:<width$}  hint: {}\n", "", "", c.hint));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diagnose::doctor::{Check, Verdict};

    #[test]
    fn names_and_details_line_up_whatever_the_verdict() {
        let c = |name, verdict, hint: &str| Check { name, verdict, detail: "d".into(), hint: hint.into() };
        let r = DoctorReport {
            checks: vec![
                c("cuda", Verdict::Ok, ""),
                c("cuda.driver", Verdict::Missing, "install it"),
                c("zmq", Verdict::Warn, ""),
            ],
            needed_missing: false,
        };
        let text = render(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        // Every name starts in one column, every detail in another, hints under the details.
        let name_col: Vec<usize> = lines
            .iter()
            .zip(["cuda", "cuda.driver", "hint:", "zmq"])
            .map(|(l, w)| l.find(w).unwrap_or(0))
            .collect();
        assert_eq!(name_col[0], name_col[1], "{text}");
        assert_eq!(name_col[0], name_col[3], "{text}");
        let detail_col: Vec<Option<usize>> = [0, 1, 3].iter().map(|&i| lines[i].rfind(" d")).collect();
        assert!(detail_col.iter().all(|c| c.is_some() && *c == detail_col[0]), "{text}");
        assert_eq!(Some(name_col[2] - 1), detail_col[0], "the hint sits under the details: {text}");
    }
}
