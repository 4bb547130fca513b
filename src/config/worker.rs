//! What every worker process of an engine is started with: how bytes move
//! ([`TransportConfig`]), the simulated prefill ([`PrefillSim`]), and the whole
//! [`WorkerConfig`] an engine sends each of its ranks at start.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::layouts::compat::PairSpec;
use crate::topology::TransferMode;
use crate::transfer::memory::MemPlace;
use crate::transfer::notify::NotifyTransport;
use crate::transfer::ucx::{ErrMode, ProgressMode};
use crate::vocab::kinds::{KvBufferDevice, Role, TransportKind, VerifyMode};

/// Transport settings every worker of a run shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct TransportConfig {
    pub kind: TransportKind,
    /// For `Multi`: the order to try.
    pub chain: Vec<TransportKind>,
    /// Who moves the bytes (pull only, for now).
    pub mode: TransferMode,
    pub ucx_lib: Option<PathBuf>,
    /// UCX error-handling mode (peer excludes the shared-memory transports).
    pub err_mode: ErrMode,
    /// How waiting ranks progress UCX.
    pub progress: ProgressMode,
    /// Register UCX-allocated memory instead of the rank's own allocation (flattering).
    pub ucx_alloc: bool,
    pub huge_pages: bool,
    /// GETs in flight per source rank.
    pub inflight: u32,
    /// Post coalesced descriptors instead of vLLM's one-per-block descriptors.
    pub coalesce: bool,
    /// How decode ranks notify prefill ranks with the UCX transport: UCX active messages on
    /// the read endpoint, or ZMQ. Prefill ranks listen on both; the storage and multi
    /// transports always notify over ZMQ.
    #[serde(default)]
    pub notify: NotifyTransport,
    pub storage_dir: Option<PathBuf>,
    pub storage_direct_io: bool,
    pub storage_fsync: bool,
    /// `--transport cuda-batch`: how a batch's copies are issued (`--batch-copy`).
    #[serde(default)]
    pub batch_copy: crate::transfer::cuda_batch::BatchCopy,
    /// `--transport cuda-batch`: one batch per request per decode rank, or one per peer
    /// (`--batch-launch`).
    #[serde(default)]
    pub batch_launch: crate::transfer::cuda_batch::BatchLaunch,
    /// `--transport cuda-batch` with the gather kernel: where the kernel's descriptors are
    /// made (`--batch-descriptors`).
    #[serde(default)]
    pub batch_descriptors: crate::transfer::cuda_batch::BatchDescriptors,
    /// Gate testing only (`kvx bench --slowdown F`): each read is made F times its own duration
    /// slower by waiting after it completes, so a regression of known size can be staged.
    #[serde(default)]
    pub slowdown: f64,
    /// Where ranks register the KV for transfers (vLLM's `kv_buffer_device`): the pool itself,
    /// or a host buffer the pool is copied through (`--kv-buffer-device cpu`).
    #[serde(default)]
    pub kv_buffer: KvBufferDevice,
    /// `--transport nixl`: how the ranks' NIXL agents run (`--nixl-progress-thread`).
    #[serde(default)]
    pub nixl: crate::config::xfer::NixlOptions,
}

/// How prefill ranks hand KV to decode in push mode: after the whole prefill, or layer by
/// layer as each is computed (vllm-project/vllm#56874).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlap {
    /// WRITE once the whole prefill is done.
    #[default]
    None,
    /// WRITE each layer's slice of the blocks as soon as that layer is computed.
    Layers,
}

impl Overlap {
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::None => "none",
            Overlap::Layers => "layers",
        }
    }
}

/// How the orchestrator (the bench, or the serving proxy) sends a request's two legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dispatch {
    /// Prefill first; decode once prefill answered (vLLM's toy proxy; pull needs it, since
    /// decode reads the blocks prefill names).
    #[default]
    Sequential,
    /// Both legs at once: in push mode decode needs only the prefill engine's identity, so it
    /// registers its blocks while prefill computes (ai-dynamo/dynamo#13327).
    Concurrent,
}

impl Dispatch {
    pub fn as_str(self) -> &'static str {
        match self {
            Dispatch::Sequential => "sequential",
            Dispatch::Concurrent => "concurrent",
        }
    }
}

/// When a decode engine's ranks start a request's transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RankStart {
    /// Every rank of the request in one step, once each has finished the request before it.
    /// vLLM's TP workers run each scheduler step together, so a request's reads start on every
    /// decode rank in the same step; a kvx rank moves one request at a time, so the step waits
    /// for the slowest rank's previous request (the wait is the request's `queue` stage).
    #[default]
    Together,
    /// Each rank starts the next request as soon as it is free: a request's ranks can start
    /// apart, by up to a transfer, and its span holds that drift.
    Free,
}

/// The prefill computation a prefill rank simulates for each request: `per_layer` of wall
/// time per model layer, as a GPU's forward pass takes it while the rank's CPU stays free to
/// move bytes (zero: the blocks are ready as soon as they are filled). Requests are computed
/// one after the other on a rank, as one GPU runs one forward at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PrefillSim {
    pub per_layer_ns: u64,
    pub overlap: Overlap,
}

impl PrefillSim {
    pub fn per_layer(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.per_layer_ns)
    }
}

/// Everything a worker needs to start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerConfig {
    pub role: Role,
    pub rank: u32,
    pub engine_id: String,
    pub pair: PairSpec,
    /// A hybrid model's pair (see `setup::WorkerSettings::hybrid`).
    #[serde(default)]
    pub hybrid: Option<Box<crate::layouts::hybrid::HybridPairSpec>>,
    pub transport: TransportConfig,
    /// Where this rank's KV pool lives (the engine fills it per rank).
    pub mem: MemPlace,
    pub verify: VerifyMode,
    /// What prefill ranks write and decode ranks check (`--fill`).
    #[serde(default)]
    pub fill: crate::vocab::kinds::FillPattern,
    /// Lease a prefill rank holds blocks under (vLLM `kv_lease_duration`).
    pub lease_ms: u64,
    /// Deadline of every wait (handshake, reads, notifications).
    pub timeout_ms: u64,
    /// Host the worker binds its listeners on, and the one it advertises.
    pub bind_host: String,
    pub advertise_host: String,
    /// Prefill ranks: the simulated prefill computation, and when push mode WRITEs.
    #[serde(default)]
    pub prefill: PrefillSim,
}

/// A fault a worker injects into itself on request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// Tear down the rank's UCX side (worker, registration) but keep its memory and its
    /// side channel: reads over UCX fail, other transports still work.
    KillUcx,
    /// Exit at once, as a crash would.
    Exit,
}
