//! `kvx worker` (hidden): one rank of a prefill or decode engine.

use clap::Args;

use crate::error::{ConfigError, Outcome};
use crate::settings::env::Launcher;
use crate::vocab::kinds::Role;

#[derive(Debug, Args)]
#[command(
    after_help = "Example (a decode rank on another host):\n  kvx worker --connect tcp://orchestrator:7000 --role decode --rank 1\n\
    Under Slurm, mpirun or torchrun, omit --role/--rank and pass --p-tp: global ranks below it are\n\
    prefill ranks, the rest decode ranks; decode ranks connect to the given port + 1. Under a\n\
    LeaderWorkerSet or an Indexed Job the same holds, pod 0 (the leader) running `kvx bench --listen`\n\
    and pod i being global rank i - 1. With --role and no --rank, the rank is the launcher's index\n\
    (LWS_WORKER_INDEX, JOB_COMPLETION_INDEX, GROVE_PCLQ_POD_INDEX, SLURM_PROCID, ...): a\n\
    DisaggregatedSet role or a Grove PodClique per role. See docs/kubernetes.md."
)]
#[command(allow_negative_numbers = true)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub connect: crate::settings::flags::ConnectFlags,
    #[command(flatten)]
    pub role: crate::settings::flags::RoleFlags,
    #[command(flatten)]
    pub rank: crate::settings::flags::RankFlags,
    /// Prefill tensor-parallel size [default: 1].
    #[arg(long, value_name = "P")]
    pub p_tp: Option<u32>,
}

pub fn run(args: &WorkerArgs) -> anyhow::Result<Outcome> {
    // Ctrl-C at a terminal signals the whole process group; the engine that started this
    // worker stops it (and the worker ends when its engine does).
    if let Err(e) = crate::transfer::ucx::ignore_sigint() {
        tracing::debug!("cannot ignore SIGINT: {e}");
    }
    let Some(connect) = args.connect.connect.clone() else {
        return Err(
            ConfigError::new("--connect", "is required: the endpoint `kvx bench --listen` printed").into()
        );
    };
    let launcher = crate::settings::env::launcher()?;
    if let Some(l) = &launcher {
        tracing::info!("launcher: {}", l.describe());
    }
    let (role, rank, endpoint) = match (args.role.role, &launcher, args.p_tp) {
        (Some(role), l, _) => (role, args.rank.rank.or(l.as_ref().map(Launcher::index)), connect),
        (None, Some(l), Some(p_tp)) => match global_rank(l)? {
            global if global < p_tp => (Role::Prefill, Some(global), connect),
            global => (Role::Decode, Some(global - p_tp), bump_port(&connect)?),
        },
        (None, Some(l), None) => {
            return Err(ConfigError::new(
                "--p-tp",
                format!(
                    "is needed without --role: {} gave {}={}, and global ranks below --p-tp are prefill ranks",
                    l.name(),
                    l.index_variable(),
                    l.index()
                ),
            )
            .into());
        }
        (None, None, _) => {
            return Err(ConfigError::new(
                "--role",
                "is needed: pass --role prefill|decode, or run under a launcher (Slurm, mpirun, torchrun, \
                 LeaderWorkerSet, Indexed Job) with --p-tp",
            )
            .into());
        }
    };
    crate::pipeline::worker::run(&endpoint, role, rank)?;
    Ok(Outcome::Ok)
}

/// This process's rank among all workers, prefill ranks first, when no `--role` is given.
fn global_rank(l: &Launcher) -> Result<u32, ConfigError> {
    if matches!(l, Launcher::Grove { .. }) {
        return Err(ConfigError::new(
            "--role",
            "is needed under Grove: one PodClique per role, each pod's rank is its GROVE_PCLQ_POD_INDEX",
        ));
    }
    match (l.orchestrator_is_index_zero(), l.index()) {
        (false, i) => Ok(i),
        (true, 0) => Err(ConfigError::new(
            l.index_variable(),
            format!(
                "is 0: pod 0 of a {} is where `kvx bench --listen` runs (its name is the one known in \
                 advance); workers are pods 1 and up",
                l.name()
            ),
        )),
        (true, i) => Ok(i - 1),
    }
}

/// The decode engine listens one port above the prefill engine.
fn bump_port(ep: &str) -> anyhow::Result<String> {
    let (head, port) = ep.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("--connect {ep} has no port"))?;
    let port: u16 = port.parse().map_err(|_| anyhow::anyhow!("--connect {ep}: bad port"))?;
    Ok(format!(
        "{head}:{}",
        port.checked_add(1).ok_or_else(|| anyhow::anyhow!("--connect {ep}: port too high"))?
    ))
}
