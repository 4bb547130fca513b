//! The core's and the run configuration's typed choices as clap sees them: each enum of
//! `topology`, `layouts` and `config` a flag takes gets its `clap::ValueEnum` here, with the name a user types and the line `--help`
//! shows for each value, so the core stays free of clap and the flags still parse straight into
//! the core's enums (and config-file values through [`super::parse::named`]).

use clap::ValueEnum;
use clap::builder::PossibleValue;

use crate::config::bench::FailurePolicy;
use crate::config::serve::Policy;
use crate::config::worker::{Dispatch, Overlap, RankStart};
use crate::layouts::alloc::AllocPattern;
use crate::layouts::hybrid::{
    AttentionBackend, GdnPrefillBackend, HostCopyRule, HostDescriptors, HostStatePage, PushAttention,
    StateSlices,
};
use crate::topology::TransferMode;
use crate::topology::ports::PortScheme;

/// `impl ValueEnum for $ty`: each variant with its name and help line, in `--help` order.
macro_rules! choices {
    ($ty:ty { $($variant:ident => $name:literal: $help:literal,)+ }) => {
        impl ValueEnum for $ty {
            fn value_variants<'a>() -> &'a [Self] {
                &[$(<$ty>::$variant),+]
            }

            fn to_possible_value(&self) -> Option<PossibleValue> {
                Some(match self {
                    $(<$ty>::$variant => PossibleValue::new($name).help($help),)+
                })
            }
        }
    };
}

choices!(TransferMode {
    Pull => "pull": "Decode READs prefill's blocks (vLLM `NixlConnector` / `NixlPullConnector`)",
    Push => "push": "Decode registers its blocks with prefill, which WRITEs into them (vLLM \
                     `NixlPushConnector`, 0.33 rules only)",
});

choices!(PortScheme {
    Engine => "engine": "One ROUTER per engine at `base + dp_rank`, serving every (pp, tp) rank (vLLM >= 0.11)",
    Worker => "worker": "One listener per worker at `base + dp_rank * tp + tp_rank` (vLLM 0.9-0.10)",
});

choices!(AllocPattern {
    Contiguous => "contiguous": "One run of consecutive block ids",
    Fragmented => "fragmented": "Runs of 1-8 consecutive ids scattered over the pool (a pool that has churned)",
    Random => "random": "Every id independent (the worst case for coalescing)",
});

choices!(GdnPrefillBackend {
    FlashInfer => "flashinfer": "vLLM's choice on H100, H200, B200 (64-token checkpoint alignment)",
    Triton => "triton": "vLLM's choice on A100-class GPUs (no checkpoint alignment)",
});

choices!(AttentionBackend {
    FlashAttn => "flash-attn": "FLASH_ATTN: kernel blocks of any multiple of 16 tokens",
    FlashInfer => "flashinfer": "FLASHINFER: kernel blocks of 16, 32 or 64 tokens",
    Triton => "triton": "TRITON_ATTN: kernel blocks of any multiple of 16 tokens",
});

choices!(PushAttention {
    Vllm => "vllm": "vLLM 0.33 (as read): the first decode rank of each head only; the others receive \
                     state but no attention",
    EveryRank => "every-rank": "Every decode rank its head, as pull reads them",
});

choices!(HostCopyRule {
    Vllm => "vllm": "vLLM 0.33: every group's blocks through every layer, in layer order. With several KV \
                     cache groups over aliased device memory, a later group's layer overwrites the blocks \
                     of the others with host bytes it never received ([`Finding::HostCopyOverwrites`])",
    PerGroup => "per-group": "Each layer copies its own group's blocks only",
});

choices!(StateSlices {
    Vllm => "vllm": "vLLM 0.33's `remote_conv_offsets`: every conv part sharded like `x`, so decode rank \
                     `d` reads `d % (D/P)` slices in. Wrong for parts replicated across TP ranks (Mamba2 B \
                     and C with `n_groups` below TP), which kvx reports ([`Finding::StateSliceMisread`])",
    Exact => "exact": "Each part's offset from how the model really splits it: a sharded part as vLLM reads \
                       it, a replicated part where the source rank holds decode's slice of it (decode TP at \
                       least prefill TP: whole; prefill TP above decode TP: each source rank's piece of the \
                       slice, from remote rows of its own)",
});

choices!(Overlap {
    None => "none": "WRITE once the whole prefill is done",
    Layers => "layers": "WRITE each layer's slice of the blocks as soon as that layer is computed",
});

choices!(Dispatch {
    Sequential => "sequential": "Prefill first; decode once prefill answered (vLLM's toy proxy; pull needs it, since \
                                 decode reads the blocks prefill names)",
    Concurrent => "concurrent": "Both legs at once: in push mode decode needs only the prefill engine's identity, so \
                                 it registers its blocks while prefill computes (ai-dynamo/dynamo#13327)",
});

choices!(RankStart {
    Together => "together": "Every rank starts a request in one step, once each has finished the one before \
                             (vLLM's TP workers run each step together)",
    Free => "free": "Each rank starts the next request as soon as it is free (a request's ranks can start \
                     apart by up to a transfer)",
});

choices!(FailurePolicy {
    Fail => "fail": "The request ends with an error",
    Recompute => "recompute": "The decode side recomputes the prompt locally; counted apart",
});

/// The proxy's `--policy`, with vLLM router's names (`round_robin`, ...) accepted too.
impl ValueEnum for Policy {
    fn value_variants<'a>() -> &'a [Self] {
        &[Policy::RoundRobin, Policy::LeastLoaded, Policy::Random, Policy::PowerOfTwo]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(match self {
            Policy::RoundRobin => PossibleValue::new("round-robin").alias("round_robin").help(
                "Next healthy backend in turn (the toy proxy's `itertools.cycle`, minus the unhealthy)",
            ),
            Policy::LeastLoaded => PossibleValue::new("least-loaded")
                .alias("least_loaded")
                .help("Healthy backend with the fewest requests in flight from this proxy"),
            Policy::Random => PossibleValue::new("random").help("A healthy backend at random"),
            Policy::PowerOfTwo => PossibleValue::new("power-of-two")
                .alias("power_of_two")
                .help("The less loaded (fewer requests in flight) of two healthy backends drawn at random"),
        })
    }
}

choices!(HostDescriptors {
    Vllm => "vllm": "vLLM 0.33: with state in the model, every layer's host tensor for attention, every \
                     state layer's for state; prefill copies every group's blocks through every layer",
    PerGroup => "per-group": "Each group's own layers' tensors only, and prefill copies only those",
});

choices!(HostStatePage {
    Vllm => "vllm": "vLLM 0.33: unpadded state pages, under regions that step by padded ones",
    Padded => "padded": "Padded pages, as the regions assume",
});

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's name is the serde name the core's enum writes, so a flag and a results file
    /// spell each choice alike.
    #[test]
    fn names_are_the_serde_names() {
        fn check<T: ValueEnum + serde::Serialize>() {
            for v in T::value_variants() {
                let name = v.to_possible_value().map(|p| p.get_name().to_string());
                let json = serde_json::to_value(v).ok().and_then(|j| j.as_str().map(str::to_string));
                assert_eq!(name, json);
            }
        }
        check::<TransferMode>();
        check::<PortScheme>();
        check::<AllocPattern>();
        check::<GdnPrefillBackend>();
        check::<AttentionBackend>();
        check::<PushAttention>();
        check::<HostCopyRule>();
        check::<StateSlices>();
        check::<HostDescriptors>();
        check::<HostStatePage>();
    }
}
