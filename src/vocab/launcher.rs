//! The launcher that started this process, as plain data: which one it was, the index it
//! gave the process and what else its variables said. `settings::env` reads the variables
//! and builds a [`Launcher`]; `kvx worker` takes its rank from it, and the report's
//! environment section and `kvx doctor` name it.
//!
//! Two kinds of launcher. Slurm, Open MPI and torchrun number every process of the job
//! (`kvx bench` runs outside it). The Kubernetes group launchers, LeaderWorkerSet and an
//! Indexed Job, number the pods of a group, and the group's pod 0 is the only one with a
//! name known in advance (the leader address, `<job>-0.<service>`): there it runs `kvx
//! bench --listen`, so worker ranks are numbered from pod 1. Grove numbers the pods of each
//! PodClique, one clique per role.

use serde::{Deserialize, Serialize};

/// LeaderWorkerSet's variables (kubernetes-sigs/lws, `api/leaderworkerset/v1`).
pub const LWS_LEADER_ADDRESS: &str = "LWS_LEADER_ADDRESS";
pub const LWS_GROUP_SIZE: &str = "LWS_GROUP_SIZE";
pub const LWS_WORKER_INDEX: &str = "LWS_WORKER_INDEX";
/// An Indexed Job's pod index (Kubernetes `batch/v1` Job, `completionMode: Indexed`).
pub const JOB_COMPLETION_INDEX: &str = "JOB_COMPLETION_INDEX";
/// The pod's host name (`<job>-<index>` for an Indexed Job's pods); reported, not required.
pub const HOSTNAME: &str = "HOSTNAME";
/// Grove's variables (ai-dynamo/grove, `operator/api/common/constants`).
pub const GROVE_PCS_NAME: &str = "GROVE_PCS_NAME";
pub const GROVE_PCS_INDEX: &str = "GROVE_PCS_INDEX";
pub const GROVE_PCLQ_NAME: &str = "GROVE_PCLQ_NAME";
pub const GROVE_PCLQ_POD_INDEX: &str = "GROVE_PCLQ_POD_INDEX";
pub const GROVE_HEADLESS_SERVICE: &str = "GROVE_HEADLESS_SERVICE";
/// Slurm's, Open MPI's and torchrun's rank and size.
pub const SLURM_PROCID: &str = "SLURM_PROCID";
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
pub const RANK: &str = "RANK";
pub const WORLD_SIZE: &str = "WORLD_SIZE";

/// Every launcher variable kvx reads (tests clear them so a runner's own cannot leak in).
pub const ALL: &[&str] = &[
    SLURM_PROCID,
    SLURM_NTASKS,
    OMPI_COMM_WORLD_RANK,
    OMPI_COMM_WORLD_SIZE,
    RANK,
    WORLD_SIZE,
    LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE,
    LWS_WORKER_INDEX,
    JOB_COMPLETION_INDEX,
    GROVE_PCS_NAME,
    GROVE_PCS_INDEX,
    GROVE_PCLQ_NAME,
    GROVE_PCLQ_POD_INDEX,
    GROVE_HEADLESS_SERVICE,
];

/// The launcher recognised in this process's environment, with what it said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Launcher {
    /// `SLURM_PROCID` of `SLURM_NTASKS`.
    Slurm { rank: u32, size: u32 },
    /// `OMPI_COMM_WORLD_RANK` of `OMPI_COMM_WORLD_SIZE`.
    OpenMpi { rank: u32, size: u32 },
    /// torchrun's `RANK` of `WORLD_SIZE`.
    Torchrun { rank: u32, size: u32 },
    /// A LeaderWorkerSet group (also each role of a DisaggregatedSet): pod `worker_index`
    /// of `group_size`, the leader (index 0) at `leader_address`.
    LeaderWorkerSet { worker_index: u32, group_size: u32, leader_address: String },
    /// An Indexed Job's pod `completion_index`; `hostname` is `<job>-<index>`.
    IndexedJob { completion_index: u32, hostname: Option<String> },
    /// Pod `pod_index` of the Grove PodClique `clique` (its full name), in replica
    /// `set_index` of the PodCliqueSet `set`, whose headless service is `headless_service`.
    Grove { pod_index: u32, clique: String, set: String, set_index: u32, headless_service: String },
}

impl Launcher {
    /// The launcher's name as people write it.
    pub fn name(&self) -> &'static str {
        match self {
            Launcher::Slurm { .. } => "Slurm",
            Launcher::OpenMpi { .. } => "Open MPI",
            Launcher::Torchrun { .. } => "torchrun",
            Launcher::LeaderWorkerSet { .. } => "LeaderWorkerSet",
            Launcher::IndexedJob { .. } => "Indexed Job",
            Launcher::Grove { .. } => "Grove",
        }
    }

    /// The variable that carries this process's index.
    pub fn index_variable(&self) -> &'static str {
        match self {
            Launcher::Slurm { .. } => SLURM_PROCID,
            Launcher::OpenMpi { .. } => OMPI_COMM_WORLD_RANK,
            Launcher::Torchrun { .. } => RANK,
            Launcher::LeaderWorkerSet { .. } => LWS_WORKER_INDEX,
            Launcher::IndexedJob { .. } => JOB_COMPLETION_INDEX,
            Launcher::Grove { .. } => GROVE_PCLQ_POD_INDEX,
        }
    }

    /// The index the launcher gave this process (within its job, group or clique).
    pub fn index(&self) -> u32 {
        match self {
            Launcher::Slurm { rank, .. }
            | Launcher::OpenMpi { rank, .. }
            | Launcher::Torchrun { rank, .. } => *rank,
            Launcher::LeaderWorkerSet { worker_index, .. } => *worker_index,
            Launcher::IndexedJob { completion_index, .. } => *completion_index,
            Launcher::Grove { pod_index, .. } => *pod_index,
        }
    }

    /// How many processes the launcher started, where it says.
    pub fn size(&self) -> Option<u32> {
        match self {
            Launcher::Slurm { size, .. }
            | Launcher::OpenMpi { size, .. }
            | Launcher::Torchrun { size, .. } => Some(*size),
            Launcher::LeaderWorkerSet { group_size, .. } => Some(*group_size),
            Launcher::IndexedJob { .. } | Launcher::Grove { .. } => None,
        }
    }

    /// Whether the launcher's pod 0 is the orchestrator (`kvx bench --listen`) rather than a
    /// rank: the group launchers, whose pod 0 is the one name known in advance.
    pub fn orchestrator_is_index_zero(&self) -> bool {
        matches!(self, Launcher::LeaderWorkerSet { .. } | Launcher::IndexedJob { .. })
    }

    /// One line for reports: the launcher, the index it gave and what else it said.
    pub fn describe(&self) -> String {
        let of = self.size().map(|n| format!(" of {n}")).unwrap_or_default();
        let head = format!("{}, {}={}{of}", self.name(), self.index_variable(), self.index());
        match self {
            Launcher::LeaderWorkerSet { leader_address, .. } => format!("{head}, leader {leader_address}"),
            Launcher::IndexedJob { hostname: Some(h), .. } => format!("{head}, host {h}"),
            Launcher::Grove { clique, headless_service, .. } => {
                format!("{head}, clique {clique}, service {headless_service}")
            }
            _ => head,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_names_the_launcher_its_index_variable_and_its_size() {
        let lws = Launcher::LeaderWorkerSet {
            worker_index: 2,
            group_size: 4,
            leader_address: "kvx-bench-0.kvx-bench.default".into(),
        };
        assert_eq!(
            lws.describe(),
            "LeaderWorkerSet, LWS_WORKER_INDEX=2 of 4, leader kvx-bench-0.kvx-bench.default"
        );
        assert_eq!(
            Launcher::IndexedJob { completion_index: 1, hostname: None }.describe(),
            "Indexed Job, JOB_COMPLETION_INDEX=1"
        );
        assert!(lws.orchestrator_is_index_zero());
        assert!(!Launcher::Slurm { rank: 0, size: 2 }.orchestrator_is_index_zero());
    }

    #[test]
    fn serializes_with_its_kind() {
        let j = serde_json::to_value(Launcher::Torchrun { rank: 1, size: 2 }).expect("json");
        assert_eq!(j, serde_json::json!({"kind": "torchrun", "rank": 1, "size": 2}));
    }
}
