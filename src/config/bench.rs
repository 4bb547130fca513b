//! The resolved settings of a `kvx bench` run: the workload, the failure policy, the fault to
//! inject and what the calibration measures.

use std::path::PathBuf;
use std::time::Duration;

use super::engine::{EngineConfig, EngineSlot, WorkerSettings};
use super::worker::{Dispatch, Fault};
use crate::vocab::kinds::Role;
use std::fmt;

use serde::Serialize;

use super::arrival::Arrival;
use super::load::Slo;

/// What to do when a load fails (vLLM's `kv_load_failure_policy`, `--on-load-failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// The request ends with an error.
    #[default]
    Fail,
    /// The decode side recomputes the prompt locally; counted apart.
    Recompute,
}

impl FailurePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Fail => "fail",
            FailurePolicy::Recompute => "recompute",
        }
    }
}

/// A fault to inject during a run: `fault` into `role` rank `rank` after `after` measured requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    pub fault: Fault,
    pub role: Role,
    pub rank: u32,
    pub after: u64,
}

/// One descriptor size of a run's reads, and the bytes per request that descriptors of that
/// size carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorShare {
    pub descriptor_bytes: u64,
    pub bytes: u64,
}

/// Resolved settings of one bench run (`settings::bench` resolves them).
#[derive(Debug, Clone)]
pub struct BenchSettings {
    pub name: String,
    /// The launcher that started the orchestrator (the report's environment names it).
    pub launcher: Option<crate::vocab::launcher::Launcher>,
    /// What every worker of both engines shares (the pair, transport, memory, deadlines).
    pub workers: WorkerSettings,
    /// How a request's two legs are sent (concurrent: push mode only).
    pub dispatch: Dispatch,
    pub lens: PromptLens,
    pub arrival: Arrival,
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
    pub warmup: u64,
    pub prefix_hit: f64,
    pub on_failure: FailurePolicy,
    pub fault: Option<FaultPlan>,
    pub repeat: u32,
    /// A comparison's rounds (`--rounds`; 1 outside a comparison, which refuses more).
    pub rounds: u32,
    /// Measure the same-run calibration (memcpy and a UCX loopback read).
    pub calibrate: bool,
    /// `--rates`: the fitted model the report predicts this run's transfers with.
    pub prediction: Option<PredictionModel>,
    /// A hybrid model's reads by descriptor size (a request of the longest prompt, every
    /// decode rank), largest share of the bytes first: the calibration measures `kvx xfer` at
    /// each size. Empty for a uniform model (one size, [`calibration_size`]).
    pub descriptor_mix: Vec<DescriptorShare>,
    /// Show a progress bar (stderr is a terminal).
    pub progress_bar: bool,
    /// Directory runs are written under (`--results-dir`, `KVX_RESULTS_DIR`, `results/`).
    pub results_root: PathBuf,
}

/// A fitted transfer-time model of the path a run takes, and the rates file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct PredictionModel {
    pub path: crate::layouts::posting::PostPath,
    pub model: crate::layouts::predict::TransferModel,
    pub rates: String,
}

impl BenchSettings {
    /// The engine pair.
    pub fn pair(&self) -> &crate::layouts::compat::PairSpec {
        &self.workers.pair
    }

    /// The worker engine of `role`, as every bench starts it (a fresh engine id, a free
    /// side-channel port; decode ranks placed after the prefill ranks).
    pub fn engine(&self, role: Role) -> EngineConfig {
        let first_device_slot = match role {
            Role::Prefill => 0,
            Role::Decode => self.workers.pair.p.tp,
        };
        self.workers.engine(EngineSlot {
            role,
            engine_id: format!("kvx-{}-{}", role.as_str(), uuid::Uuid::new_v4().simple()),
            side_channel_port: 0,
            first_device_slot,
        })
    }
}

/// Largest prompt kvx accepts (tokens).
pub const MAX_PROMPT: u32 = 1 << 24;

/// Prompt lengths: fixed, uniform over a range, or cycled from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum PromptLens {
    Fixed(u32),
    Uniform(u32, u32),
    List(Vec<u32>),
}

impl fmt::Display for PromptLens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PromptLens::Fixed(n) => write!(f, "{n}"),
            PromptLens::Uniform(a, b) => write!(f, "{a}..{b}"),
            PromptLens::List(v) => write!(f, "{} lengths from a file", v.len()),
        }
    }
}

impl PromptLens {
    pub fn max(&self) -> u32 {
        match self {
            PromptLens::Fixed(n) => *n,
            PromptLens::Uniform(_, b) => *b,
            PromptLens::List(v) => v.iter().copied().max().unwrap_or(1),
        }
    }

    pub fn mean(&self) -> f64 {
        match self {
            PromptLens::Fixed(n) => f64::from(*n),
            PromptLens::Uniform(a, b) => (f64::from(*a) + f64::from(*b)) / 2.0,
            PromptLens::List(v) => v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len().max(1) as f64,
        }
    }
}

/// What `kvx bench --serve` adds to the bench settings.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Objectives for goodput (`--slo`).
    pub slo: Option<Slo>,
    /// Serve `/metrics` on this port while the run goes (`--metrics-port`; 0: any free port).
    pub metrics_port: Option<u16>,
}
