//! Command-line surface: each subcommand's file holds its `Args` (its settings struct from
//! `settings`, flattened, with the examples of its help) and a thin `run` that hands the
//! parsed flags to `settings` to resolve, calls the library and prints. Flag checks live in
//! `settings`, not here.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

use crate::error::Outcome;

pub mod bench;
pub mod calibrate;
pub mod common;
pub mod completions;
pub mod doctor;
pub mod gate;
pub mod layout;
pub mod load;
pub mod plan;
pub mod probe;
pub mod report;
pub mod serve_engine;
pub mod serve_proxy;
pub mod topo;
pub mod worker;
pub mod xfer;

/// KV-cache transfer toolkit for disaggregated prefill/decode serving (vLLM NixlConnector semantics).
#[derive(Debug, Parser)]
#[command(name = "kvx", version, about, long_about = None, propagate_version = true)]
#[command(after_help = after_help())]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Every subcommand takes negative numbers as values (`--rate -1`), so a negative value is
/// reported against its flag ("invalid value '-1' for '--concurrency'") rather than as an
/// unexpected argument.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Rank map: which decode rank reads which bytes from which prefill rank.
    Topo(topo::TopoArgs),
    /// KV cache layout of one rank: shape, strides, registered regions, bytes per token/block.
    Layout(layout::LayoutArgs),
    /// Descriptor plan of one request: (local, remote, length) pairs per decode rank.
    Plan(plan::PlanArgs),
    /// Transport microbenchmark: one-sided UCX reads between two processes.
    Xfer(Box<xfer::XferArgs>),
    /// Fit this host's transfer-time model from kvx xfer sweeps; write a rates file.
    Calibrate(calibrate::CalibrateArgs),
    /// Speak the side-channel protocol to a kvx or vLLM engine and show what it advertises.
    Probe(probe::ProbeArgs),
    /// Check this host: UCX library, transports, memory types, CUDA, ports.
    Doctor(doctor::DoctorArgs),
    /// Run the whole P/D pipeline: prefill and decode ranks, real reads, verified, reported.
    Bench(Box<bench::BenchArgs>),
    /// Re-render a saved run, or compare two runs side by side.
    Report(report::ReportArgs),
    /// Compare a run with a baseline; exit 1 on a performance regression.
    Gate(gate::GateArgs),
    /// Reference OpenAI-compatible engine (prefill or decode role) with real KV transfers.
    ServeEngine(Box<serve_engine::ServeEngineArgs>),
    /// P/D proxy with the flags of vLLM's toy proxy and of its Rust router (--vllm-pd-disaggregation).
    ServeProxy(serve_proxy::ServeProxyArgs),
    /// Load generator for any OpenAI-compatible endpoint.
    Load(load::LoadArgs),
    /// Print shell completions.
    Completions(completions::CompletionsArgs),
    /// One rank of a bench or engine (started by the orchestrator or a launcher).
    #[command(hide = true)]
    Worker(worker::WorkerArgs),
}

/// The top-level help's closing text: where to start, and the exit codes (which are API).
fn after_help() -> String {
    format!(
        "Start with: kvx bench --p-tp 8 --d-tp 2   (one machine, host memory, UCX over shared memory)\n\n{}",
        crate::error::EXIT_CODES_HELP
    )
}

impl Command {
    /// The logging a command starts with when `KVX_LOG` is not set.
    pub fn log_default(&self) -> LogDefault {
        match self {
            Command::ServeEngine(_) | Command::ServeProxy(_) => LogDefault::Service,
            _ => LogDefault::Command,
        }
    }
}

/// Runs the parsed command.
pub fn dispatch(cli: Cli) -> anyhow::Result<Outcome> {
    match cli.command {
        Command::Topo(a) => topo::run(&a),
        Command::Layout(a) => layout::run(&a),
        Command::Plan(a) => plan::run(&a),
        Command::Xfer(a) => xfer::run(&a),
        Command::Calibrate(a) => calibrate::run(&a),
        Command::Probe(a) => probe::run(&a),
        Command::Doctor(a) => doctor::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Report(a) => report::run(&a),
        Command::Gate(a) => gate::run(&a),
        Command::ServeEngine(a) => serve_engine::run(&a),
        Command::ServeProxy(a) => serve_proxy::run(&a),
        Command::Load(a) => load::run(&a),
        Command::Completions(a) => completions::run(&a),
        Command::Worker(a) => worker::run(&a),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Values that break naive arithmetic: zero, negatives, NaN and infinities, the tiniest
    /// and largest floats, integers one past each width.
    const HOSTILE: [&str; 16] = [
        "4294967295",
        "1e308",
        "0",
        "-0",
        "1",
        "-1",
        "0.5",
        "1e-300",
        "1e300",
        "NaN",
        "inf",
        "-inf",
        "4294967296",
        "18446744073709551616",
        "99999999999999999999999999",
        "1e-9",
    ];

    /// Resolves a parsed command line as `run` would before starting anything: `Ok(())`, or
    /// the flag a refusal names.
    fn resolve_only(cli: Cli) -> Result<(), String> {
        use crate::settings::{env::ProcessEnv, load, probe, proxy, xfer};
        let env = ProcessEnv {
            results_dir: None,
            stderr_is_terminal: false,
            launcher: Ok(None),
            exe: Ok("/usr/bin/kvx".into()),
        };
        let flag = |e: crate::error::ConfigError| e.flag;
        match cli.command {
            Command::Bench(a) => {
                crate::settings::plan::resolve_bench_job(&a.settings, &env).map(drop).map_err(flag)
            }
            Command::Load(a) => load::resolve(&a.settings, &env).map(drop).map_err(flag),
            Command::ServeEngine(a) => serve_engine::resolve(&a).map(drop).map_err(flag),
            Command::ServeProxy(a) => proxy::resolve(&a.settings).map(drop).map_err(flag),
            Command::Xfer(a) => xfer::resolve(&a.settings).map(drop).map_err(flag),
            Command::Probe(a) => probe::resolve(&a.settings).map(drop).map_err(flag),
            _ => Ok(()),
        }
    }

    /// Issue 23's target: every flag that takes a value, of every command that runs
    /// something (bench, load, serve-engine, serve-proxy, xfer, probe), given each hostile
    /// number, is refused by clap or by the settings naming a flag, or resolves; never a
    /// panic. (topo, layout and plan, which only compute, are run whole by tests/it/hostile.rs.)
    #[test]
    fn every_flag_of_every_command_takes_hostile_numbers_without_a_panic() {
        let bases: [&[&str]; 6] = [
            &["bench"],
            &["load", "--url", "http://127.0.0.1:9", "--concurrency", "2"],
            &["serve-engine", "--role", "prefill"],
            &["serve-proxy", "--prefiller-host", "127.0.0.1", "--decoder-host", "127.0.0.1"],
            &["xfer"],
            &["probe", "127.0.0.1:5600"],
        ];
        let root = Cli::command();
        let mut tried = 0;
        for base in bases {
            let sub = root.find_subcommand(base[0]).expect("subcommand");
            let flags: Vec<String> = sub
                .get_arguments()
                .filter(|a| a.get_action().takes_values() && a.get_long().is_some())
                .map(|a| format!("--{}", a.get_long().unwrap_or_default()))
                .filter(|f| !matches!(f.as_str(), "--config" | "--sweep" | "--model-config" | "--scenario"))
                .collect();
            assert!(flags.len() > 3, "{}: {flags:?}", base[0]);
            for flag in &flags {
                for v in HOSTILE {
                    let mut line = vec!["kvx"];
                    line.extend_from_slice(base);
                    line.extend_from_slice(&[flag.as_str(), v]);
                    let Ok(cli) = Cli::try_parse_from(&line) else { continue };
                    tried += 1;
                    match std::panic::catch_unwind(|| resolve_only(cli)) {
                        Ok(Ok(())) => {}
                        Ok(Err(named)) => {
                            assert!(named.contains("--"), "{line:?}: refused without a flag: {named:?}")
                        }
                        Err(_) => panic!("{line:?} panicked"),
                    }
                }
            }
        }
        assert!(tried > 200, "only {tried} command lines parsed");
    }

    /// One definition per setting: a flag that several commands take means the same in each,
    /// with one default and one help text (a shared flag group, flattened where it is taken).
    #[test]
    fn every_flag_shared_by_commands_has_one_default_and_one_help() {
        use std::collections::BTreeMap;
        fn walk(
            cmd: &clap::Command,
            path: String,
            out: &mut BTreeMap<String, Vec<(String, String, String)>>,
        ) {
            for a in cmd.get_arguments() {
                let Some(long) = a.get_long() else { continue };
                if matches!(long, "help" | "version") {
                    continue;
                }
                let default: Vec<String> =
                    a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
                let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                out.entry(format!("--{long}")).or_default().push((path.clone(), default.join(","), help));
            }
            for s in cmd.get_subcommands() {
                walk(s, format!("{path} {}", s.get_name()), out);
            }
        }
        let mut flags = BTreeMap::new();
        walk(&Cli::command(), "kvx".into(), &mut flags);
        let mut differ = Vec::new();
        for (flag, uses) in &flags {
            let (_, d0, h0) = &uses[0];
            for (cmd, d, h) in &uses[1..] {
                if d != d0 {
                    differ.push(format!("{flag}: default '{d0}' in `{}`, '{d}' in `{cmd}`", uses[0].0));
                }
                if h != h0 {
                    differ.push(format!(
                        "{flag}: help differs between `{}` and `{cmd}`:\n  {h0}\n  {h}",
                        uses[0].0
                    ));
                }
            }
        }
        assert!(flags.len() > 100, "only {} flags listed", flags.len());
        assert!(differ.is_empty(), "{} flags differ between commands:\n{}", differ.len(), differ.join("\n"));
    }
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<Outcome> {
    init_logging(cli.command.log_default());
    crate::interrupt::survive_file_size_limit();
    dispatch(cli)
}

/// Warnings and errors of kvx (and of its workers, which the engines forward) on stderr;
/// `KVX_LOG` sets the filter, e.g. `kvx=debug`. Long-running services (`serve-engine`,
/// `serve-proxy`) default to `kvx=info` with timestamps, everything else to `kvx=warn`.
/// The first call wins.
pub fn init_logging(default: LogDefault) {
    let fallback = match default {
        LogDefault::Command => "kvx=warn",
        LogDefault::Service => "kvx=info",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env(crate::vocab::env::KVX_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(fallback));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_target(false)
        .with_writer(std::io::stderr);
    let _ = match default {
        LogDefault::Command => builder.without_time().try_init(),
        LogDefault::Service => builder.try_init(),
    };
}

/// Which logging a command starts with when `KVX_LOG` is not set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogDefault {
    /// A command that runs and ends: warnings and errors, no timestamps.
    Command,
    /// A long-running service: info and above, with timestamps.
    Service,
}

/// The core's knobs, spelled by `settings::knobs`, against the flags the commands take (here,
/// where the command line is known: settings must not import it).
#[cfg(test)]
mod knob_flags {
    use clap::CommandFactory;

    use crate::settings::knobs::flag;
    use crate::vocab::knob::Knob;

    /// Every knob's flag is one some kvx command takes, except the few that name a setting
    /// only a scenario file (pipeline parallelism), vLLM's environment (the conv state layout)
    /// or kvx itself (the prefill rank a push plan is built for) holds.
    #[test]
    fn every_flag_exists() {
        let cmd = super::Cli::command();
        let mut longs = std::collections::BTreeSet::new();
        for sub in cmd.get_subcommands() {
            for arg in sub.get_arguments() {
                if let Some(l) = arg.get_long() {
                    longs.insert(format!("--{l}"));
                }
            }
        }
        let not_flags = [Knob::PPp, Knob::DPp, Knob::ConvStateLayout, Knob::PRank];
        let wrong: Vec<_> =
            ALL.into_iter().filter(|k| longs.contains(flag(*k)) == not_flags.contains(k)).collect();
        assert!(wrong.is_empty(), "{wrong:?}");
    }

    const ALL: [Knob; 49] = [
        Knob::Tp,
        Knob::BlockSize,
        Knob::NumBlocks,
        Knob::Layout,
        Knob::Rank,
        Knob::PTp,
        Knob::DTp,
        Knob::PBlockSize,
        Knob::DBlockSize,
        Knob::PNumBlocks,
        Knob::DNumBlocks,
        Knob::PLayout,
        Knob::DLayout,
        Knob::PPp,
        Knob::DPp,
        Knob::PRank,
        Knob::DRank,
        Knob::PoolBlocks,
        Knob::KernelBlockSize,
        Knob::Model,
        Knob::Layers,
        Knob::HeadDim,
        Knob::Mla,
        Knob::NumKvHeads,
        Knob::Vllm,
        Knob::Mode,
        Knob::Permute,
        Knob::PushAttention,
        Knob::StateSlices,
        Knob::HostCopy,
        Knob::HostDescriptors,
        Knob::HostStatePage,
        Knob::ConvStateLayout,
        Knob::NoPrefixCaching,
        Knob::KvBufferDevice,
        Knob::AttentionBackend,
        Knob::Scenario,
        Knob::PrefixHit,
        Knob::LocalBlocks,
        Knob::RemoteBlocks,
        Knob::Alloc,
        Knob::Verify,
        Knob::Overlap,
        Knob::SideChannelPort,
        Knob::PortScheme,
        Knob::Transport,
        Knob::PostNs,
        Knob::CeilingGbps,
        Knob::Rates,
    ];
}
