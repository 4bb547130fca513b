//! How a run's worker engines are set up: what every engine of a run shares
//! ([`WorkerSettings`], resolved by `settings`), where each rank's KV pool lives
//! ([`KvMemory`] and its placement rule), and the one builder of an engine's
//! [`EngineConfig`] from them, used by `kvx bench`, `kvx bench --serve` and
//! `kvx serve-engine` alike.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::worker::{PrefillSim, TransportConfig, WorkerConfig};
use crate::layouts::alloc::AllocPattern;
use crate::layouts::compat::PairSpec;
use crate::topology::TransferMode;
use crate::transfer::memory::{MemPlace, MemoryError};
use crate::vocab::kinds::{Role, VerifyMode};

/// Memory of a run's KV pools, resolved once from `--mem` and `--devices` (or `--device`).
///
/// Placement rule: the ranks of a run are numbered in one sequence of slots, the prefill
/// ranks first (prefill rank `r` is slot `r`), then the decode ranks (decode rank `r` is slot
/// `p_tp + r`); slot `s` lives on `devices[s % devices.len()]`. So with as many GPUs as ranks
/// every rank has its own, and the two engines start on different GPUs whenever the list is
/// longer than the prefill TP size. An engine started alone (`kvx serve-engine`) numbers its
/// ranks from slot 0.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KvMemory {
    /// The ranks' own host allocations (what `kvx bench` registers today).
    #[default]
    Host,
    /// CUDA device memory on these devices, round-robin (never empty).
    Cuda { devices: Vec<u32> },
}

impl KvMemory {
    /// Host or device memory (`--mem`).
    pub fn kind(&self) -> crate::transfer::memory::MemKind {
        match self {
            KvMemory::Host => crate::transfer::memory::MemKind::Host,
            KvMemory::Cuda { .. } => crate::transfer::memory::MemKind::Cuda,
        }
    }

    /// Where the rank in slot `slot` keeps its KV pool.
    pub fn place(&self, slot: u32) -> MemPlace {
        match self {
            KvMemory::Host => MemPlace::Host,
            KvMemory::Cuda { devices } => match devices.get(slot as usize % devices.len().max(1)) {
                Some(&device) => MemPlace::Cuda { device },
                None => MemPlace::Host,
            },
        }
    }

    /// Checks that this host can keep pools here before any process starts (for device
    /// memory: the cuda feature, libcuda, a driver and each listed device), so the first
    /// thing a user reads is what is missing, not a worker's failure.
    pub fn check_available(&self) -> Result<(), MemoryError> {
        match self {
            KvMemory::Host => Ok(()),
            KvMemory::Cuda { devices } => {
                check_places(devices.iter().map(|&device| MemPlace::Cuda { device }))
            }
        }
    }

    /// The places of `ranks` ranks whose first is in slot `first_slot`, by rank.
    pub fn places(&self, first_slot: u32, ranks: u32) -> Vec<MemPlace> {
        (0..ranks).map(|r| self.place(first_slot.saturating_add(r))).collect()
    }
}

/// [`KvMemory::check_available`] for the places of an engine's ranks (each one once).
pub fn check_places(places: impl IntoIterator<Item = MemPlace>) -> Result<(), MemoryError> {
    let mut seen = std::collections::HashSet::new();
    places.into_iter().filter(|p| seen.insert(*p)).try_for_each(MemPlace::check_available)
}

impl fmt::Display for KvMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvMemory::Host => f.write_str("host"),
            KvMemory::Cuda { devices } => {
                let list: Vec<String> = devices.iter().map(u32::to_string).collect();
                write!(f, "cuda:{}", list.join(","))
            }
        }
    }
}

/// What every worker engine of a run shares, resolved once: the engine pair, how bytes move,
/// where the pools live, deadlines, and how the worker processes start.
#[derive(Debug, Clone)]
pub struct WorkerSettings {
    pub pair: PairSpec,
    /// A hybrid model (Mamba/GDN state, sliding windows): the pair as vLLM 0.33 builds it.
    /// `pair` then carries what the engines share with uniform models (TP sizes, the aligned
    /// block sizes, pool sizes, the model's name and layer count).
    pub hybrid: Option<crate::layouts::hybrid::HybridPairSpec>,
    pub transport: TransportConfig,
    pub verify: VerifyMode,
    /// What prefill ranks write and decode ranks check (`--fill`).
    pub fill: crate::vocab::kinds::FillPattern,
    pub mem: KvMemory,
    /// Lease prefill ranks hold blocks under (vLLM `kv_lease_duration`).
    pub lease: Duration,
    /// Deadline of every wait (handshake, reads, notifications); engines wait 4x for answers.
    pub timeout: Duration,
    pub alloc: AllocPattern,
    /// Seed of allocations and byte patterns (and of a bench's prompt lengths).
    pub seed: u64,
    /// The kvx binary engines spawn as workers.
    pub exe: PathBuf,
    /// Extra environment for spawned workers (UCX_TLS, ...).
    pub worker_env: Vec<(String, String)>,
    /// `Some(tcp://HOST:PORT)`: wait for external `kvx worker --connect` processes instead of
    /// spawning them (prefill on PORT, decode on PORT + 1; port 0: each engine takes a free one).
    pub listen: Option<TcpEndpoint>,
    /// Host workers bind their listeners on, and the one they advertise.
    pub bind_host: String,
    pub advertise_host: String,
    /// The prefill computation prefill ranks simulate, and when push mode WRITEs.
    pub prefill: PrefillSim,
    /// When a decode engine's ranks start a request (`kvx bench --rank-start`).
    pub rank_start: crate::config::worker::RankStart,
}

/// What tells apart the engines one [`WorkerSettings`] starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSlot {
    pub role: Role,
    pub engine_id: String,
    /// Side-channel port of a prefill engine (0: a free one).
    pub side_channel_port: u16,
    /// The placement slot of the engine's rank 0 (see [`KvMemory`]).
    pub first_device_slot: u32,
}

impl WorkerSettings {
    /// The engine of `slot.role`: the worker template, its ranks and their pools, how its
    /// workers start, its side channel. The one builder every command uses.
    pub fn engine(&self, slot: EngineSlot) -> EngineConfig {
        let EngineSlot { role, engine_id, side_channel_port, first_device_slot } = slot;
        let spec = match role {
            Role::Prefill => &self.pair.p,
            Role::Decode => &self.pair.d,
        };
        let launch = match &self.listen {
            Some(ep) => {
                // Port 0: both engines take a free port (each prints its endpoint).
                let port =
                    if role == Role::Prefill || ep.port == 0 { ep.port } else { ep.port.saturating_add(1) };
                Launch::External { bind: format!("tcp://{}:{port}", ep.host) }
            }
            None => Launch::Spawn { exe: self.exe.clone(), env: self.worker_env.clone() },
        };
        EngineConfig {
            worker: WorkerConfig {
                role,
                rank: 0,
                engine_id,
                pair: self.pair.clone(),
                hybrid: self.hybrid.clone().map(Box::new),
                transport: self.transport.clone(),
                // Filled per rank from `mem` below.
                mem: MemPlace::Host,
                verify: self.verify,
                fill: self.fill,
                lease_ms: self.lease.as_millis() as u64,
                timeout_ms: self.timeout.as_millis() as u64,
                bind_host: self.bind_host.clone(),
                advertise_host: self.advertise_host.clone(),
                prefill: self.prefill,
            },
            tp: spec.tp,
            pool_blocks: spec.num_blocks,
            block_tokens: spec.block_tokens,
            alloc: self.alloc,
            // The decode side's block tables differ from the prefill side's.
            seed: self.seed ^ u64::from(role == Role::Decode),
            mem: self.mem.places(first_device_slot, spec.tp),
            launch,
            // Prefill engines serve their metadata for decode ranks to read from; in push mode
            // decode engines serve theirs too, for prefill ranks to write into (port 0: free).
            side_channel_bind: match (role, self.transport.mode) {
                (Role::Prefill, _) => Some(format!("tcp://{}:{side_channel_port}", self.bind_host)),
                (Role::Decode, TransferMode::Push) => Some(format!("tcp://{}:0", self.bind_host)),
                (Role::Decode, TransferMode::Pull) => None,
            },
            timeout: self.timeout * 4,
            rank_start: self.rank_start,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_placed_round_robin_prefill_first() {
        let cuda = KvMemory::Cuda { devices: vec![0, 1, 2] };
        // P tp 4 -> D tp 2 over 3 GPUs: slots 0..4 are prefill, 4..6 decode.
        let p = cuda.places(0, 4);
        let d = cuda.places(4, 2);
        let dev = |v: &[MemPlace]| -> Vec<u32> {
            v.iter()
                .map(|m| match m {
                    MemPlace::Cuda { device } => *device,
                    MemPlace::Host => u32::MAX,
                })
                .collect()
        };
        assert_eq!(dev(&p), [0, 1, 2, 0]);
        assert_eq!(dev(&d), [1, 2], "decode continues where prefill stopped");
        // As many GPUs as ranks: every rank has its own.
        let eight = KvMemory::Cuda { devices: (0..8).collect() };
        let all: Vec<u32> = dev(&eight.places(0, 4)).into_iter().chain(dev(&eight.places(4, 4))).collect();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        // One device: everything on it; host: everything on the host.
        assert_eq!(KvMemory::Cuda { devices: vec![3] }.places(5, 2), [MemPlace::Cuda { device: 3 }; 2]);
        assert_eq!(KvMemory::Host.places(0, 3), [MemPlace::Host; 3]);
        assert_eq!(KvMemory::Cuda { devices: vec![0, 1] }.to_string(), "cuda:0,1");
        assert_eq!(KvMemory::Host.to_string(), "host");
    }
}

/// Where the workers come from.
#[derive(Debug, Clone)]
pub enum Launch {
    /// Spawn `exe worker ...` locally, one process per rank.
    Spawn { exe: PathBuf, env: Vec<(String, String)> },
    /// Wait for `kvx worker --connect` processes started elsewhere (Slurm, mpirun, by hand)
    /// on this control endpoint.
    External { bind: String },
}

/// How to start an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The worker config template; `rank` is filled per worker.
    pub worker: WorkerConfig,
    pub tp: u32,
    pub pool_blocks: u32,
    pub block_tokens: u32,
    pub alloc: AllocPattern,
    pub seed: u64,
    /// Where each rank's KV pool lives, by rank (`tp` entries; settings place them).
    pub mem: Vec<MemPlace>,
    pub launch: Launch,
    /// Prefill engines: the side-channel bind endpoint, e.g. `tcp://127.0.0.1:0`.
    pub side_channel_bind: Option<String>,
    /// Per-request deadline for worker answers.
    pub timeout: Duration,
    /// Decode engines: when a request's ranks start it.
    pub rank_start: crate::config::worker::RankStart,
}

/// `--listen`'s endpoint, `tcp://HOST:PORT`, as settings checked it: prefill's workers connect
/// to PORT, decode's to PORT + 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpEndpoint {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for TcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tcp://{}:{}", self.host, self.port)
    }
}

/// `tcp://host:port` to `(host, port)`: an endpoint a socket reports once bound.
pub fn split_endpoint(ep: &str) -> (String, u16) {
    let rest = ep.split_once("://").map_or(ep, |(_, r)| r);
    match rest.rsplit_once(':') {
        Some((h, p)) => (h.trim_matches(['[', ']']).to_string(), p.parse().unwrap_or(0)),
        None => (rest.to_string(), 0),
    }
}
