//! The resolved settings of `kvx xfer` (and of the calibration `kvx bench` runs through it):
//! what to measure, how the initiator's UCX session is set up, how a target serves.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::transfer::cuda_batch::BatchCopy;
use crate::transfer::memory::MemPlace;
use crate::transfer::ucx::{ErrMode, ProgressMode};

/// What to measure.
#[derive(Debug, Clone)]
pub struct XferConfig {
    pub sizes: Vec<u64>,
    pub inflight: Vec<usize>,
    pub working_set_bytes: u64,
    pub hot: bool,
    pub ucx_alloc: bool,
    pub huge_pages: bool,
    pub mem: MemPlace,
    pub duration: Duration,
    pub iters: Option<u64>,
    pub timeout: Duration,
    /// How long to keep trying to reach a remote target (`--connect`).
    pub peer_timeout: Duration,
    pub session: SessionOptions,
    /// `--transport cuda-batch`, and how it issues a batch (`--batch-copy`): each batch of
    /// reads is one batched copy from the target's pool mapped with CUDA IPC (local targets
    /// and device memory only). `None`: UCX.
    pub cuda_batch: Option<BatchCopy>,
    /// `--transport nixl`: the reads go through NIXL (its C API and its own UCX), not kvx's UCX.
    pub nixl: Option<NixlOptions>,
    /// `--misalign`: bytes added to every local and remote offset.
    pub misalign: Misalign,
}

/// How `--transport nixl` agents run (`--nixl-progress-thread`) and, in `kvx xfer`, how its
/// transfer requests are made (`--nixl-requests`; the engines make one per READ, as vLLM).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct NixlOptions {
    pub progress_thread: bool,
    #[serde(default)]
    pub requests: NixlRequests,
}

/// How `kvx xfer --transport nixl` makes the transfer request of a batch (`--nixl-requests`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum NixlRequests {
    /// One request made for each batch and released after it, as vLLM's worker makes one per
    /// READ: what a request costs through NIXL.
    #[default]
    PerBatch,
    /// Each distinct batch's request made once, before the timed batches, and posted again each
    /// time (what NIXL's own benchmark does): NIXL's transfer without its per-request set-up.
    Reuse,
}

impl NixlRequests {
    pub fn as_str(self) -> &'static str {
        match self {
            NixlRequests::PerBatch => "per-batch",
            NixlRequests::Reuse => "reuse",
        }
    }
}

/// Initiator-side settings of a session.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    pub ucx_lib: Option<PathBuf>,
    pub progress: ProgressMode,
    pub err_mode: ErrMode,
    pub ucx_config: Vec<(String, String)>,
}

/// Where the target runs.
#[derive(Debug, Clone)]
pub enum TargetSpec {
    /// Spawn `exe xfer --role target` on this host.
    Local { exe: PathBuf },
    /// A target started with `kvx xfer --listen` elsewhere.
    Remote { addr: String },
}

/// `--misalign`: bytes added to every read's local and remote offset, so that descriptors
/// are not 16-byte aligned (the buffers are that much longer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Misalign {
    pub local_bytes: u64,
    pub remote_bytes: u64,
}

impl Misalign {
    pub fn is_none(&self) -> bool {
        self.local_bytes == 0 && self.remote_bytes == 0
    }
}

/// Settings of the target process that are its own (not asked for by the initiator).
#[derive(Debug, Clone, Default)]
pub struct TargetOptions {
    pub ucx_lib: Option<PathBuf>,
    pub progress: ProgressMode,
    pub ucx_config: Vec<(String, String)>,
}
