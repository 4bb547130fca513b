//! Moving real bytes between real processes: memory the KV cache lives in, the UCX
//! transport (the only FFI in kvx besides CUDA's), the cuda-batch transport (CUDA IPC and
//! batched device copies, `cuda_batch`), the ZMQ side-channel handshake, notifications and
//! the shared-storage transport, each behind safe types.
//!
//! Owns: registration, one-sided reads, handshake wire formats, and every `unsafe` of kvx.
//! Must not know about request lifecycles or workloads (that is `pipeline`), nor hold the
//! commands that probe a host or a link with these pieces (`kvx xfer`, `kvx probe`, `kvx
//! doctor`: that is `diagnose`).

pub mod cuda;
pub mod cuda_batch;
pub mod handshake;
pub mod memory;
pub mod nixl;
pub mod notify;
pub mod storage;
pub mod ucx;
