//! The kinds every layer names: which side of a pair a rank serves ([`Role`]), how much of a
//! request is checked ([`VerifyMode`]), which transport moves the bytes ([`TransportKind`]) and
//! which memory they live in ([`MemKind`]). Each is a clap `ValueEnum` and a serde enum, so a
//! choice is typed from the flag (or file key) on.

use serde::{Deserialize, Serialize};

/// Which side of a P/D pair an engine (and its workers) serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    pub fn letter(self) -> char {
        match self {
            Role::Prefill => 'P',
            Role::Decode => 'D',
        }
    }
}

/// What prefill ranks write into a request's blocks, and so what decode ranks check
/// (`--fill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FillPattern {
    /// kvx's pattern: every K/V vector's words derived from (layer, global head, token, K or
    /// V), so a decode rank checks it holds the heads and tokens its layout says.
    #[default]
    Kvx,
    /// The NIXL peers' pattern (`scripts/peers`, vLLM's workers in `vllm-peer`): byte =
    /// (region × 131 + block × 31 + offset) mod 251 over each prefill block; a decode rank
    /// checks each byte against the prefill block and offset its plan read it from.
    Peer,
}

impl FillPattern {
    pub fn as_str(self) -> &'static str {
        match self {
            FillPattern::Kvx => "kvx",
            FillPattern::Peer => "peer",
        }
    }
}

/// How much of each request a decode rank checks (`--verify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VerifyMode {
    /// Every byte.
    Full,
    /// One block in 16, whole (hybrid models: 1 in 16 of each layer's blocks, the only ones
    /// prefill fills).
    #[default]
    Sample,
    /// No check.
    Off,
}

/// The stride of `VerifyMode::Sample`.
pub const SAMPLE_STRIDE: u32 = 16;

impl std::fmt::Display for VerifyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl VerifyMode {
    /// The vector stride to check, if any.
    pub fn stride(self) -> Option<u32> {
        match self {
            VerifyMode::Full => Some(1),
            VerifyMode::Sample => Some(SAMPLE_STRIDE),
            VerifyMode::Off => None,
        }
    }
}

impl VerifyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            VerifyMode::Full => "full",
            VerifyMode::Sample => "sample",
            VerifyMode::Off => "off",
        }
    }
}

/// Which transport moves the bytes (`--transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// One-sided UCX GETs (NixlConnector's model).
    #[default]
    Ucx,
    /// Files in a shared directory (SharedStorageConnector's model).
    Storage,
    /// An ordered list: a load that fails on one is retried on the next (MultiConnector).
    Multi,
    /// GPUs of one machine: the prefill pool mapped with CUDA IPC, one batched copy per peer
    /// and request; notifications over ZMQ. Pull mode only.
    #[serde(rename = "cuda-batch")]
    CudaBatch,
    /// NIXL itself (the library vLLM's NixlConnector uses), loaded at run time from its
    /// wheel's C API: vLLM's handshake payload, prepared lists, NIXL notifications.
    Nixl,
}

impl TransportKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Ucx => "ucx",
            TransportKind::Storage => "storage",
            TransportKind::Multi => "multi",
            TransportKind::CudaBatch => "cuda-batch",
            TransportKind::Nixl => "nixl",
        }
    }
}

/// Which memory buffers live in (`--mem`), before a device is chosen: the kind of a
/// `transfer::memory::MemPlace` (and of a run's `pipeline::setup::KvMemory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MemKind {
    /// The user's own host allocation (what a KV cache is without GPUs).
    #[default]
    Host,
    /// CUDA device memory (cuMemAlloc): needs libcuda, a GPU and, for UCX, a UCX built with CUDA.
    Cuda,
}

impl MemKind {
    /// `host` or `cuda`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemKind::Host => "host",
            MemKind::Cuda => "cuda",
        }
    }
}

/// vLLM's `kv_buffer_device`: where NIXL registers and reads the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvBufferDevice {
    /// The KV cache itself (vLLM's name: its pool is on the GPU; kvx's may be host memory).
    #[default]
    Cuda,
    /// A host staging buffer: prefill copies a request's blocks into it after computing them,
    /// decode reads into its own and then copies them into its KV cache.
    Cpu,
}

impl KvBufferDevice {
    pub fn as_str(self) -> &'static str {
        match self {
            KvBufferDevice::Cuda => "cuda",
            KvBufferDevice::Cpu => "cpu",
        }
    }
}

/// The two generation endpoints, written as their paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Endpoint {
    #[serde(rename = "/v1/completions")]
    Completions,
    #[serde(rename = "/v1/chat/completions")]
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}
