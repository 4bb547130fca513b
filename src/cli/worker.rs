//! `kvx worker` (hidden): one rank of a prefill or decode engine.

use clap::{Args, ValueEnum};

use crate::error::Outcome;
use crate::settings::env::launcher_rank;
use crate::vocab::kinds::Role;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Prefill,
    Decode,
}

#[derive(Debug, Args)]
#[command(
    after_help = "Example (a decode rank on another host):\n  kvx worker --connect tcp://orchestrator:7000 --role decode --rank 1\n\
    Under Slurm or mpirun, omit --role/--rank and pass --p-tp: global ranks below it are prefill ranks,\n\
    the rest decode ranks; decode ranks connect to the given port + 1."
)]
pub struct WorkerArgs {
    /// The engine's control endpoint (printed by `kvx bench --listen`).
    #[arg(long)]
    pub connect: String,
    #[arg(long, value_enum)]
    pub role: Option<RoleArg>,
    /// This worker's TP rank (default: from the launcher's environment, else assigned).
    #[arg(long)]
    pub rank: Option<u32>,
    /// With a launcher: the prefill TP size, to split global ranks into prefill and decode.
    #[arg(long)]
    pub p_tp: Option<u32>,
}

pub fn run(args: &WorkerArgs) -> anyhow::Result<Outcome> {
    // Ctrl-C at a terminal signals the whole process group; the engine that started this
    // worker stops it (and the worker ends when its engine does).
    if let Err(e) = crate::transfer::ucx::ignore_sigint() {
        tracing::debug!("cannot ignore SIGINT: {e}");
    }
    let (role, rank, endpoint) = match (args.role, launcher_rank(), args.p_tp) {
        (Some(r), _, _) => {
            let role = if r == RoleArg::Prefill { Role::Prefill } else { Role::Decode };
            (role, args.rank, args.connect.clone())
        }
        (None, Some((global, _)), Some(p_tp)) if global < p_tp => {
            (Role::Prefill, Some(global), args.connect.clone())
        }
        (None, Some((global, _)), Some(p_tp)) => {
            (Role::Decode, Some(global - p_tp), bump_port(&args.connect)?)
        }
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
