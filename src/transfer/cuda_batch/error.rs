//! The cuda-batch transport's errors: one [`CudaBatchError`] for packing, IPC, the driver's
//! copy paths and timeouts, each saying what to change.

/// What can go wrong with the cuda-batch transport, each saying what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaBatchError {
    #[error(transparent)]
    Cuda(#[from] crate::transfer::cuda::CudaError),
    #[error(
        "descriptor {index}: {side} bytes {offset}..{end} are outside the {len}-byte {side} buffer \
         (the peer's advertised pool does not match the plan)"
    )]
    OutOfBounds { index: usize, side: &'static str, offset: u64, end: u64, len: u64 },
    #[error("a batch packed for other buffers was handed to the copier (local or peer mapping differs)")]
    WrongBuffers,
    #[error(
        "{peer} advertises no CUDA IPC export: it does not run --transport cuda-batch (start both engines \
         with it), or its KV pool is not in device memory (--mem cuda)"
    )]
    NoExport { peer: String },
    #[error(
        "{peer} runs on another machine (boot id {theirs}, here {ours}): --transport cuda-batch maps the \
         peer's GPU memory with CUDA IPC, which works between processes of one machine only; use \
         --transport ucx across machines"
    )]
    OtherMachine { peer: String, theirs: String, ours: String },
    #[error(
        "{peer} is this process: CUDA refuses to open an IPC handle where it was exported, so the \
         cuda-batch transport needs two processes (kvx xfer and kvx bench start them)"
    )]
    SameProcess { peer: String },
    #[error("{peer}'s CUDA IPC handle is {len} bytes, not the 64 of a CUipcMemHandle")]
    BadHandle { peer: String, len: usize },
    #[error(
        "opening {peer}'s CUDA IPC handle failed: {reason}. CUDA IPC needs both processes on one machine, \
         seeing the peer's GPU (check CUDA_VISIBLE_DEVICES and `kvx doctor`'s cuda.ipc line), with peer \
         access between the two devices when they differ, and in containers a shared IPC namespace"
    )]
    Open { peer: String, reason: String },
    #[error("batched copy of {copies} copies did not complete within {timeout:?} (its event never fired)")]
    Timeout { copies: usize, timeout: std::time::Duration },
    #[error("CUDA {op} failed: {reason}")]
    Call { op: &'static str, reason: String },
    /// A path forced with `--batch-copy` that this driver does not have (or refuses).
    #[error(
        "{flag} forces {call} (CUDA drivers {since} and later), which this CUDA driver (version {driver}) \
         does not have or refuses: use --batch-copy api (the best batch API this driver has), per-copy or \
         kernel"
    )]
    PathUnavailable { flag: String, call: &'static str, since: &'static str, driver: i32 },
}
