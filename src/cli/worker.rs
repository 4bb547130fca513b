//! `kvx worker` (hidden): one rank of a prefill or decode engine.

use clap::Args;

use crate::error::{ConfigError, Outcome};
use crate::settings::env::launcher_rank;
use crate::vocab::kinds::Role;

#[derive(Debug, Args)]
#[command(
    after_help = "Example (a decode rank on another host):\n  kvx worker --connect tcp://orchestrator:7000 --role decode --rank 1\n\
    Under Slurm or mpirun, omit --role/--rank and pass --p-tp: global ranks below it are prefill ranks,\n\
    the rest decode ranks; decode ranks connect to the given port + 1."
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
    let (role, rank, endpoint) = match (args.role.role, launcher_rank(), args.p_tp) {
        (Some(role), _, _) => (role, args.rank.rank, connect),
        (None, Some((global, _)), Some(p_tp)) if global < p_tp => (Role::Prefill, Some(global), connect),
        (None, Some((global, _)), Some(p_tp)) => (Role::Decode, Some(global - p_tp), bump_port(&connect)?),
        _ => anyhow::bail!(
            "pass --role prefill|decode, or run under a launcher (SLURM_PROCID, OMPI_COMM_WORLD_RANK or RANK) with --p-tp"
        ),
    };
    crate::pipeline::worker::run(&endpoint, role, rank)?;
    Ok(Outcome::Ok)
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
