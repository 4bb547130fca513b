//! Reading the environment: the one place kvx reads its `KVX_*` variables (their names are
//! ground-floor vocabulary, `vocab::env`). Precedence everywhere: defaults < config file <
//! environment < flags.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

pub use crate::vocab::env::*;
pub use crate::vocab::launcher::Launcher;
use crate::vocab::launcher::{
    GROVE_HEADLESS_SERVICE, GROVE_PCLQ_NAME, GROVE_PCLQ_POD_INDEX, GROVE_PCS_INDEX, GROVE_PCS_NAME, HOSTNAME,
    JOB_COMPLETION_INDEX, LWS_GROUP_SIZE, LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, OMPI_COMM_WORLD_RANK,
    OMPI_COMM_WORLD_SIZE, RANK, SLURM_NTASKS, SLURM_PROCID, WORLD_SIZE,
};

use crate::error::ConfigError;

/// What resolution reads from the process's surroundings, read once per run (tests build
/// their own): `KVX_RESULTS_DIR`, the launcher, whether stderr is a terminal (the progress bar), and the
/// path of this executable (what engines spawn as workers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// `KVX_RESULTS_DIR`.
    pub results_dir: Option<std::ffi::OsString>,
    pub stderr_is_terminal: bool,
    /// The launcher that started this process ([`launcher`]), or why its variables are refused.
    pub launcher: Result<Option<Launcher>, ConfigError>,
    /// This executable, or why it cannot be found.
    pub exe: Result<std::path::PathBuf, String>,
}

impl ProcessEnv {
    /// Reads this process's surroundings.
    pub fn read() -> Self {
        ProcessEnv {
            results_dir: std::env::var_os(KVX_RESULTS_DIR),
            stderr_is_terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            launcher: launcher(),
            exe: std::env::current_exe().map_err(|e| e.to_string()),
        }
    }
}

/// The launcher that started this process (see [`Launcher`]), read from this process's
/// environment; `None` when no launcher's variables are set.
pub fn launcher() -> Result<Option<Launcher>, ConfigError> {
    resolve_launcher(|k| std::env::var(k).ok())
}

/// The launcher `get` (a variable's value) describes. A launcher is recognised when its
/// index variable is set; the Kubernetes launchers' other variables must then be set too
/// (their absence names the missing one), Slurm's, Open MPI's and torchrun's size beside
/// their rank (a rank alone, common under other tools, is not a launcher). Two launchers
/// at once are refused, naming both index variables: which rank is meant is not knowable
/// (mpirun inside a Slurm allocation sets both, with different ranks).
pub fn resolve_launcher(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launcher>, ConfigError> {
    let index = |k: &'static str| -> Result<Option<u32>, ConfigError> {
        get(k)
            .map(|v| {
                v.trim().parse::<u32>().map_err(|_| {
                    ConfigError::new(k, format!("is `{v}`: a launcher's index must be a whole number"))
                })
            })
            .transpose()
    };
    let needed = |k: &'static str, by: &'static str, launcher: &str| -> Result<String, ConfigError> {
        get(k).filter(|v| !v.trim().is_empty()).ok_or_else(|| {
            ConfigError::new(
                k,
                format!("is not set, but {by} is: a {launcher} pod has both (set {k} or unset {by})"),
            )
        })
    };
    let needed_index = |k: &'static str, by: &'static str, launcher: &str| -> Result<u32, ConfigError> {
        needed(k, by, launcher)?;
        Ok(index(k)?.unwrap_or_default())
    };
    let mut found: Vec<Launcher> = vec![];
    for (rank, size, make) in [
        (
            SLURM_PROCID,
            SLURM_NTASKS,
            (|rank, size| Launcher::Slurm { rank, size }) as fn(u32, u32) -> Launcher,
        ),
        (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, |rank, size| Launcher::OpenMpi { rank, size }),
        (RANK, WORLD_SIZE, |rank, size| Launcher::Torchrun { rank, size }),
    ] {
        if get(rank).is_some()
            && get(size).is_some()
            && let (Some(r), Some(n)) = (index(rank)?, index(size)?)
        {
            found.push(make(r, n));
        }
    }
    // Grove's and LeaderWorkerSet's variables are theirs alone: any one of them means the pod
    // was started by it, so a missing sibling is an error, not a different launcher.
    if let Some(by) =
        [LWS_WORKER_INDEX, LWS_GROUP_SIZE, LWS_LEADER_ADDRESS].into_iter().find(|k| get(k).is_some())
    {
        let lws = "LeaderWorkerSet";
        found.push(Launcher::LeaderWorkerSet {
            worker_index: needed_index(LWS_WORKER_INDEX, by, lws)?,
            group_size: needed_index(LWS_GROUP_SIZE, by, lws)?,
            leader_address: needed(LWS_LEADER_ADDRESS, by, lws)?,
        });
    }
    if let Some(i) = index(JOB_COMPLETION_INDEX)? {
        found.push(Launcher::IndexedJob { completion_index: i, hostname: get(HOSTNAME) });
    }
    let grove =
        [GROVE_PCLQ_POD_INDEX, GROVE_PCLQ_NAME, GROVE_PCS_NAME, GROVE_PCS_INDEX, GROVE_HEADLESS_SERVICE];
    if let Some(by) = grove.into_iter().find(|k| get(k).is_some()) {
        let g = "Grove";
        found.push(Launcher::Grove {
            pod_index: needed_index(GROVE_PCLQ_POD_INDEX, by, g)?,
            clique: needed(GROVE_PCLQ_NAME, by, g)?,
            set: needed(GROVE_PCS_NAME, by, g)?,
            set_index: needed_index(GROVE_PCS_INDEX, by, g)?,
            headless_service: needed(GROVE_HEADLESS_SERVICE, by, g)?,
        });
    }
    match found.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(one.clone())),
        [a, b, ..] => Err(ConfigError::new(
            format!("{} or {}", a.index_variable(), b.index_variable()),
            format!(
                "both are set: this process looks started by {} and by {}; unset the variables of the one \
                 that did not start it",
                a.name(),
                b.name()
            ),
        )),
    }
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

    fn launcher_of(vars: &[(&str, &str)]) -> Result<Option<Launcher>, ConfigError> {
        resolve_launcher(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn each_launcher_is_recognised_with_the_index_it_gave() {
        assert_eq!(launcher_of(&[]), Ok(None));
        assert_eq!(
            launcher_of(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "3")]),
            Ok(Some(Launcher::Slurm { rank: 2, size: 3 }))
        );
        // A rank without its size is not a launcher (RANK is a common name).
        assert_eq!(launcher_of(&[("RANK", "1"), ("HOSTNAME", "h")]), Ok(None));
        let lws =
            [("LWS_LEADER_ADDRESS", "kvx-0.kvx.default"), ("LWS_GROUP_SIZE", "4"), ("LWS_WORKER_INDEX", "3")];
        assert_eq!(
            launcher_of(&lws),
            Ok(Some(Launcher::LeaderWorkerSet {
                worker_index: 3,
                group_size: 4,
                leader_address: "kvx-0.kvx.default".into()
            }))
        );
        assert_eq!(
            launcher_of(&[("JOB_COMPLETION_INDEX", "1"), ("HOSTNAME", "kvx-bench-1")]),
            Ok(Some(Launcher::IndexedJob { completion_index: 1, hostname: Some("kvx-bench-1".into()) }))
        );
        let grove = [
            ("GROVE_PCS_NAME", "kvx"),
            ("GROVE_PCS_INDEX", "0"),
            ("GROVE_PCLQ_NAME", "kvx-0-prefill"),
            ("GROVE_HEADLESS_SERVICE", "kvx-0.default.svc.cluster.local"),
            ("GROVE_PCLQ_POD_INDEX", "1"),
        ];
        let g = launcher_of(&grove).expect("grove").expect("recognised");
        assert_eq!((g.name(), g.index(), g.size()), ("Grove", 1, None));
    }

    #[test]
    fn a_partial_kubernetes_set_names_the_missing_variable() {
        let e = launcher_of(&[("LWS_WORKER_INDEX", "1"), ("LWS_GROUP_SIZE", "3")]).expect_err("partial");
        assert_eq!(e.flag, "LWS_LEADER_ADDRESS", "{e}");
        assert!(e.reason.contains("LWS_WORKER_INDEX is"), "{e}");
        let e =
            launcher_of(&[("GROVE_PCLQ_POD_INDEX", "0"), ("GROVE_PCS_NAME", "kvx")]).expect_err("partial");
        assert_eq!(e.flag, "GROVE_PCLQ_NAME", "{e}");
        let e = launcher_of(&[("JOB_COMPLETION_INDEX", "one")]).expect_err("not a number");
        assert_eq!(e.flag, "JOB_COMPLETION_INDEX", "{e}");
    }

    #[test]
    fn two_launchers_at_once_are_refused_naming_both() {
        let e = launcher_of(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ])
        .expect_err("conflict");
        assert_eq!(e.flag, "SLURM_PROCID or OMPI_COMM_WORLD_RANK", "{e}");
        let e = launcher_of(&[
            ("JOB_COMPLETION_INDEX", "0"),
            ("LWS_LEADER_ADDRESS", "a"),
            ("LWS_GROUP_SIZE", "2"),
            ("LWS_WORKER_INDEX", "1"),
        ])
        .expect_err("conflict");
        assert!(e.to_string().contains("LWS_WORKER_INDEX or JOB_COMPLETION_INDEX"), "{e}");
        assert!(e.reason.contains("LeaderWorkerSet and by Indexed Job"), "{e}");
    }
}
