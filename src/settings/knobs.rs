//! How the core's knobs are spelled: the one mapping from a [`Knob`] (what a `topology` or
//! `layouts` rule asks the user to change) to the flag the user types. `Knob`'s `Display` is
//! this mapping, so a core refusal (`KnobError`, a hybrid `Refusal`) prints the flag wherever it
//! is shown (the CLI's error, a failed request's reason, `kvx plan --format json`) while the
//! core itself names no flag.

use std::fmt;

use crate::error::{ConfigError, KnobError};
use crate::vocab::knob::Knob;

/// The flag that sets `knob`.
pub fn flag(knob: Knob) -> &'static str {
    match knob {
        Knob::Tp => "--tp",
        Knob::BlockSize => "--block-size",
        Knob::NumBlocks => "--num-blocks",
        Knob::Layout => "--layout",
        Knob::Rank => "--rank",
        Knob::PTp => "--p-tp",
        Knob::DTp => "--d-tp",
        Knob::PBlockSize => "--p-block-size",
        Knob::DBlockSize => "--d-block-size",
        Knob::PNumBlocks => "--p-num-blocks",
        Knob::DNumBlocks => "--d-num-blocks",
        Knob::PLayout => "--p-layout",
        Knob::DLayout => "--d-layout",
        Knob::PPp => "--p-pp",
        Knob::DPp => "--d-pp",
        Knob::PRank => "--p-rank",
        Knob::DRank => "--d-rank",
        Knob::PoolBlocks => "--pool-blocks",
        Knob::KernelBlockSize => "--kernel-block-size",
        Knob::Model => "--model",
        Knob::Layers => "--layers",
        Knob::HeadDim => "--head-dim",
        Knob::Mla => "--mla",
        Knob::NumKvHeads => "--num-kv-heads",
        Knob::Vllm => "--vllm",
        Knob::Mode => "--mode",
        Knob::Permute => "--permute",
        Knob::PushAttention => "--push-attention",
        Knob::StateSlices => "--state-slices",
        Knob::HostCopy => "--host-copy",
        Knob::HostDescriptors => "--host-descriptors",
        Knob::HostStatePage => "--host-state-page",
        Knob::ConvStateLayout => "--conv-state-layout",
        Knob::NoPrefixCaching => "--no-prefix-caching",
        Knob::KvBufferDevice => "--kv-buffer-device",
        Knob::AttentionBackend => "--attention-backend",
        Knob::Scenario => "--scenario",
        Knob::PrefixHit => "--prefix-hit",
        Knob::LocalBlocks => "--local-blocks",
        Knob::RemoteBlocks => "--remote-blocks",
        Knob::Alloc => "--alloc",
        Knob::Verify => "--verify",
        Knob::Overlap => "--overlap",
        Knob::SideChannelPort => "--side-channel-port",
        Knob::PortScheme => "--port-scheme",
        Knob::Transport => "--transport",
        Knob::PostNs => "--post-ns",
        Knob::CeilingGbps => "--ceiling-gbps",
        Knob::Rates => "--rates",
    }
}

/// A core refusal of the one engine a command builds alone (`kvx layout`, which checks it as
/// a pair of two alike): the flag to change is the engine's own (`--tp`, not `--p-tp`); the
/// reason stays as the pair's rule wrote it.
pub fn for_one_engine(e: impl Into<KnobError>) -> ConfigError {
    let e = e.into();
    ConfigError::new(flag(e.knob.unsided()), e.reason)
}

impl fmt::Display for Knob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(flag(*self))
    }
}
