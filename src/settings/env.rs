//! Reading the environment: the one place kvx reads its `KVX_*` variables (their names are
//! ground-floor vocabulary, `vocab::env`). Precedence everywhere: defaults < config file <
//! environment < flags.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

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

/// Default directory runs are written under.
pub const DEFAULT_RESULTS_DIR: &str = "results";

/// Where runs go: the flag if given, else the value of `KVX_RESULTS_DIR` (read by the caller,
/// see `settings::env`), else `results/`.
pub fn results_root(flag: Option<&Path>, env_value: Option<OsString>) -> PathBuf {
    match (flag, env_value) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(v)) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_RESULTS_DIR),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_root_precedence() {
        assert_eq!(results_root(Some(Path::new("f")), Some("e".into())), PathBuf::from("f"));
        assert_eq!(results_root(None, Some("e".into())), PathBuf::from("e"));
        assert_eq!(results_root(None, Some("".into())), PathBuf::from("results"));
        assert_eq!(results_root(None, None), PathBuf::from("results"));
    }
}
