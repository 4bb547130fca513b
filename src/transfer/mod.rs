//! Moving real bytes between real processes: memory the KV cache lives in, the UCX
//! transport (the only FFI in kvx besides CUDA's), the cuda-batch transport (CUDA IPC and
//! batched device copies, `cuda_batch`), the ZMQ side-channel handshake, notifications, and
//! the commands built directly on them (`kvx xfer`, `kvx probe`, `kvx doctor`).
//!
//! Owns: registration, one-sided reads, handshake wire formats. Must not know about
//! request lifecycles or workloads (that is `pipeline`).

pub mod cuda;
pub mod cuda_batch;
pub mod doctor;
pub mod handshake;
pub mod memory;
pub mod notify;
pub mod probe;
pub mod storage;
pub mod ucx;
pub mod xfer;
