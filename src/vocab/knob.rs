//! The settings a user can change, as the core names them when a rule refuses a value: a
//! [`Knob`] says *what* to change (prefill's TP size, decode's layout), never how it is spelled.
//!
//! The spelling is the settings layer's: `settings::knobs` gives `Knob` its `Display` (the
//! flag a user types, `--p-tp`), the one mapping from knobs to flags. So `topology` and
//! `layouts` refuse with a knob in a typed field ([`crate::error::KnobError`],
//! `layouts::hybrid::Refusal`) and write `{knob}` where their advice names one, and the flag
//! names live in one file, beside the flags.

use super::kinds::Role;

/// A setting a core rule may ask the user to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Knob {
    // One engine (`kvx layout`, `kvx serve-engine`): the engine kvx builds alone.
    /// Its TP size.
    Tp,
    /// Its block size (tokens); both engines' when a pair shares one.
    BlockSize,
    /// Blocks in each of its ranks' pools.
    NumBlocks,
    /// Its KV cache layout; both engines' when a pair shares one.
    Layout,
    /// One of its TP ranks.
    Rank,

    // Each side of a pair.
    /// Prefill's TP size.
    PTp,
    /// Decode's TP size.
    DTp,
    /// Prefill's block size (tokens).
    PBlockSize,
    /// Decode's block size (tokens).
    DBlockSize,
    /// Blocks in each prefill rank's pool.
    PNumBlocks,
    /// Blocks in each decode rank's pool.
    DNumBlocks,
    /// Prefill's KV cache layout.
    PLayout,
    /// Decode's KV cache layout.
    DLayout,
    /// Prefill's pipeline-parallel size.
    PPp,
    /// Decode's pipeline-parallel size.
    DPp,
    /// One prefill rank.
    PRank,
    /// One decode rank.
    DRank,
    /// Blocks in each rank's pool when both engines share one size (`kvx bench`).
    PoolBlocks,
    /// The attention kernel's block size (tokens) under a larger logical block.
    KernelBlockSize,

    // The model.
    /// The model (a preset or a config.json).
    Model,
    /// Its layers.
    Layers,
    /// Its head dimension.
    HeadDim,
    /// Its MLA latent (DeepSeek's compressed KV).
    Mla,
    /// Its KV heads.
    NumKvHeads,

    // vLLM's rules and the pair.
    /// Which vLLM release's rules hold.
    Vllm,
    /// Which way blocks move (pull or push).
    Mode,
    /// vLLM's `enable_permute_local_kv`.
    Permute,
    /// Push mode: which decode ranks get attention when several hold one head.
    PushAttention,
    /// Where decode reads its slice of each state part.
    StateSlices,
    /// Which blocks decode's host-to-device copy passes through each layer.
    HostCopy,
    /// Host buffer: each group's descriptors over its own layers only.
    HostDescriptors,
    /// Host buffer: padded state pages in the host tensors.
    HostStatePage,
    /// vLLM's `VLLM_SSM_CONV_STATE_LAYOUT`.
    ConvStateLayout,
    /// Prefix caching off.
    NoPrefixCaching,
    /// vLLM's `kv_buffer_device`.
    KvBufferDevice,
    /// The attention backend.
    AttentionBackend,

    // A request and how it is allocated.
    /// A scenario file (a hybrid case: the request's block lists).
    Scenario,
    /// The decode side's prefix-cache hit.
    PrefixHit,
    /// Decode's block ids of a request.
    LocalBlocks,
    /// Prefill's block ids of a request.
    RemoteBlocks,
    /// How a request's block ids are picked from a pool.
    Alloc,
    /// Which blocks decode checks.
    Verify,
    /// Push mode: WRITE each layer as it is computed.
    Overlap,

    // Ports and transports.
    /// The base side-channel (handshake) port.
    SideChannelPort,
    /// How side-channel ports are assigned.
    PortScheme,
    /// Which transport moves the bytes.
    Transport,
    /// What posting a descriptor costs (ns).
    PostNs,
    /// A transport's bandwidth ceiling (GB/s).
    CeilingGbps,
    /// A results file of posting rates.
    Rates,
}

impl Knob {
    /// The TP size of `role`'s engine.
    pub fn tp(role: Role) -> Knob {
        match role {
            Role::Prefill => Knob::PTp,
            Role::Decode => Knob::DTp,
        }
    }

    /// The block size of `role`'s engine.
    pub fn block_size(role: Role) -> Knob {
        match role {
            Role::Prefill => Knob::PBlockSize,
            Role::Decode => Knob::DBlockSize,
        }
    }

    /// The pool of each of `role`'s ranks.
    pub fn num_blocks(role: Role) -> Knob {
        match role {
            Role::Prefill => Knob::PNumBlocks,
            Role::Decode => Knob::DNumBlocks,
        }
    }

    /// The layout of `role`'s engine.
    pub fn layout(role: Role) -> Knob {
        match role {
            Role::Prefill => Knob::PLayout,
            Role::Decode => Knob::DLayout,
        }
    }

    /// The pipeline-parallel size of `role`'s engine.
    pub fn pp(role: Role) -> Knob {
        match role {
            Role::Prefill => Knob::PPp,
            Role::Decode => Knob::DPp,
        }
    }

    /// The same setting of the one engine a command builds alone (`kvx layout`): a side's TP
    /// size, block size, pool, layout or rank without its side; any other knob as it is.
    pub fn unsided(self) -> Knob {
        match self {
            Knob::PTp | Knob::DTp => Knob::Tp,
            Knob::PBlockSize | Knob::DBlockSize => Knob::BlockSize,
            Knob::PNumBlocks | Knob::DNumBlocks => Knob::NumBlocks,
            Knob::PLayout | Knob::DLayout => Knob::Layout,
            Knob::PRank | Knob::DRank => Knob::Rank,
            other => other,
        }
    }
}
