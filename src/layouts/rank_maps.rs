//! `kvx topo`'s rank maps, built whole: one resolved [`TopoRequest`] (a uniform pair in pull or
//! push mode with its ports, or a hybrid pair) goes through one function, [`rank_map`], into
//! one typed answer, [`TopoMap`], that `report::topo` renders.
//!
//! Owns: which rank map each case takes, each READ's (WRITE's) place in the blocks, every
//! rank's side-channel port, and who writes what for a hybrid pair in push mode. Pure: no I/O.

use super::compat::PairSpec;
use super::hybrid::write_plan as hybrid_push;
use super::hybrid::{HybridPairSpec, HybridPlanner};
use super::read_plan::{Planner, ReadGeom};
use super::write_plan::{PushPlanner, WriteGeom};
use crate::error::ConfigError;
use crate::topology::RankMap;
use crate::topology::ports::{PortScheme, engine_ports};
use crate::topology::push_map::PushRankMap;

/// Every rank's side-channel port of one engine, `[dp_rank][tp_rank]`.
pub type EnginePorts = Vec<Vec<u16>>;

/// Per decode rank a prefill rank writes into, the KV cache groups it writes (none: a
/// notification only).
pub type GroupsWritten = Vec<(u32, Vec<u32>)>;

/// Resolved data-parallel and port settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub p_dp: u32,
    pub d_dp: u32,
    pub base: u16,
    pub scheme: PortScheme,
}

/// What `kvx topo` maps.
#[derive(Debug, Clone)]
#[expect(clippy::large_enum_variant, reason = "one value per command run, moved, never collected")]
pub enum TopoRequest {
    /// A uniform pair, decode reading.
    UniformPull { pair: PairSpec, ports: Ports },
    /// A uniform pair, prefill writing.
    UniformPush { pair: PairSpec, ports: Ports },
    /// A hybrid pair; `push`: prefill writing.
    Hybrid { pair: HybridPairSpec, push: bool },
}

/// A mapped pair, one variant per kind of [`TopoRequest`].
#[derive(Debug)]
#[expect(clippy::large_enum_variant, reason = "one value per command run, moved, never collected")]
pub enum TopoMap {
    UniformPull(PullMap),
    UniformPush(PushMap),
    Hybrid(HybridMap),
}

/// A uniform pair's pull map: who reads what, and where.
#[derive(Debug)]
pub struct PullMap {
    pub pair: PairSpec,
    pub map: RankMap,
    /// Per decode rank (in `map.d_ranks` order), each READ's place in the blocks.
    pub reads: Vec<Vec<ReadGeom>>,
    /// Every rank's side-channel port, per side.
    pub p_ports: EnginePorts,
    pub d_ports: EnginePorts,
    pub scheme: PortScheme,
}

/// A uniform pair's push map: who writes what, and where.
#[derive(Debug)]
pub struct PushMap {
    pub pair: PairSpec,
    pub map: PushRankMap,
    /// Per prefill rank (in `map.p_ranks` order), each WRITE's place in the blocks.
    pub writes: Vec<Vec<WriteGeom>>,
    pub p_ports: EnginePorts,
    pub d_ports: EnginePorts,
    pub scheme: PortScheme,
}

/// A hybrid pair's map: vLLM 0.33's handshake (the planner), and in push mode who writes what.
#[derive(Debug)]
pub struct HybridMap {
    pub planner: HybridPlanner,
    pub push: Option<HybridPushMap>,
}

/// Who writes what in push mode for a hybrid pair `check_push` accepted.
#[derive(Debug)]
pub struct HybridPushMap {
    /// Per prefill rank: each decode rank it writes into, with the groups written.
    pub p_ranks: Vec<(u32, GroupsWritten)>,
    pub d_ranks: Vec<HybridPushWait>,
}

/// What a decode rank of a hybrid pair waits for in push mode.
#[derive(Debug)]
pub struct HybridPushWait {
    pub d_rank: u32,
    /// The prefill ranks its registration goes to (vLLM's handshake set).
    pub registers_with: Vec<u32>,
    pub written_by: Vec<u32>,
    /// Notifications it counts per request.
    pub expected_notifs: u32,
    /// vLLM's rule leaves its attention out.
    pub attention_skipped: bool,
}

/// Maps the pair, or says why it cannot be mapped.
pub fn rank_map(request: TopoRequest) -> Result<TopoMap, ConfigError> {
    Ok(match request {
        TopoRequest::UniformPull { pair, ports } => {
            let map = pair.validate()?;
            let (p_ports, d_ports) = rank_ports(&pair, &ports)?;
            let reads = map
                .d_ranks
                .iter()
                .map(|d| Planner::new(&pair, &map, d.d_rank).map(|p| p.reads))
                .collect::<Result<_, _>>()?;
            TopoMap::UniformPull(PullMap { pair, map, reads, p_ports, d_ports, scheme: ports.scheme })
        }
        TopoRequest::UniformPush { pair, ports } => {
            let map = pair.validate_push()?;
            let (p_ports, d_ports) = rank_ports(&pair, &ports)?;
            let writes = map
                .p_ranks
                .iter()
                .map(|p| PushPlanner::new(&pair, &map, p.p_rank).map(|p| p.writes))
                .collect::<Result<_, _>>()?;
            TopoMap::UniformPush(PushMap { pair, map, writes, p_ports, d_ports, scheme: ports.scheme })
        }
        TopoRequest::Hybrid { pair, push } => {
            let planner = HybridPlanner::new(&pair)?;
            let push = if push {
                hybrid_push::check_push(&planner)?;
                Some(hybrid_push_map(&planner))
            } else {
                None
            };
            TopoMap::Hybrid(HybridMap { planner, push })
        }
    })
}

/// Every rank's side-channel port, prefill's then decode's.
fn rank_ports(pair: &PairSpec, ports: &Ports) -> Result<(EnginePorts, EnginePorts), ConfigError> {
    let p_ports = engine_ports(ports.scheme, ports.base, ports.p_dp, pair.p.tp)?;
    let d_ports = engine_ports(ports.scheme, ports.base, ports.d_dp, pair.d.tp)?;
    Ok((p_ports, d_ports))
}

/// Each prefill rank's decode ranks and the groups it writes into each, and what each decode
/// rank waits for.
fn hybrid_push_map(planner: &HybridPlanner) -> HybridPushMap {
    let config = &planner.config;
    let (p_tp, d_tp) = (config.p.tp, config.d.tp);
    let p_ranks = (0..p_tp)
        .map(|p| {
            let writes = hybrid_push::write_ranks(p_tp, d_tp, p)
                .into_iter()
                .map(|d| (d, hybrid_push::write_groups(planner, p, d)))
                .collect();
            (p, writes)
        })
        .collect();
    let d_ranks = planner
        .d_ranks
        .iter()
        .map(|r| HybridPushWait {
            d_rank: r.d_rank,
            registers_with: r.handshake_ranks.to_vec(),
            written_by: hybrid_push::writers(p_tp, d_tp, r.d_rank),
            expected_notifs: hybrid_push::expected_notifs(p_tp, d_tp),
            attention_skipped: hybrid_push::attention_skipped(config, r.d_rank),
        })
        .collect();
    HybridPushMap { p_ranks, d_ranks }
}
