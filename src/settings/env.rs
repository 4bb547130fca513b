//! Reading the environment: the one place kvx reads its `KVX_*` variables (their names are
//! ground-floor vocabulary, `vocab::env`). Precedence everywhere: defaults < config file <
//! environment < flags.

pub use crate::vocab::env::*;

/// What resolution reads from the process's surroundings, read once per run (tests build
/// their own): `KVX_RESULTS_DIR`, whether stderr is a terminal (the progress bar), and the
/// path of this executable (what engines spawn as workers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// `KVX_RESULTS_DIR`.
    pub results_dir: Option<std::ffi::OsString>,
    pub stderr_is_terminal: bool,
    /// This executable, or why it cannot be found.
    pub exe: Result<std::path::PathBuf, String>,
}

impl ProcessEnv {
    /// Reads this process's surroundings.
    pub fn read() -> Self {
        ProcessEnv {
            results_dir: std::env::var_os(KVX_RESULTS_DIR),
            stderr_is_terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            exe: std::env::current_exe().map_err(|e| e.to_string()),
        }
    }
}

/// The rank a launcher gave this process (`kvx worker` without `--role`), from its
/// environment: Slurm's, Open MPI's, or torchrun's `RANK`/`WORLD_SIZE`, the first pair set.
pub fn launcher_rank() -> Option<(u32, u32)> {
    let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    for (rank, size) in [
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("RANK", "WORLD_SIZE"),
    ] {
        if let (Some(r), Some(n)) = (get(rank), get(size)) {
            return Some((r, n));
        }
    }
    None
}
