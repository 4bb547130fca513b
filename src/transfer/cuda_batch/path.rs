//! The choices of how a batch is issued (`--batch-copy`, `--batch-launch`,
//! `--batch-descriptors`), the driver path one took ([`BatchPath`]) and what one batch cost
//! ([`BatchStats`]): plain data the settings, the ranks and the reports share. No CUDA here.

use serde::{Deserialize, Serialize};

use super::error::CudaBatchError;

/// How `--transport cuda-batch` issues a batch's copies (`--batch-copy`). Every path but
/// `api` is forced: a driver that lacks it is an error naming the flag, never a fallback, so
/// that each path can be run and tested on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchCopy {
    /// The best batch API the driver has: `cuMemcpyBatchAsync_v2` (CUDA 13), else
    /// `cuMemcpyBatchAsync` (CUDA 12.8), else one `cuMemcpyDtoDAsync` per copy.
    Api,
    /// Forces `cuMemcpyBatchAsync_v2` (CUDA 13 drivers).
    ApiV2,
    /// Forces `cuMemcpyBatchAsync`, the CUDA 12.8 batch API.
    ApiV1,
    /// Forces one `cuMemcpyDtoDAsync` per copy, the path of a driver without a batch API.
    PerCopy,
    /// kvx's gather-copy kernel: the descriptors go to device memory in one copy and one
    /// kernel launch moves them all (any CUDA driver). The default: on an H200 (driver 580,
    /// CUDA 13) it moved 8 KiB descriptors, 10,240 a batch, two orders of magnitude faster
    /// than the batch API, whose driver still works per copy
    /// (results/gpu-nvidia-h200-2026-11-27.json, step 6 of `scripts/gpu-check.sh`).
    #[default]
    Kernel,
}

impl BatchCopy {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchCopy::Api => "api",
            BatchCopy::ApiV2 => "api-v2",
            BatchCopy::ApiV1 => "api-v1",
            BatchCopy::PerCopy => "per-copy",
            BatchCopy::Kernel => "kernel",
        }
    }

    /// The help of `--batch-copy` (kvx xfer and kvx bench), its default taken from
    /// [`BatchCopy::default`] so the two cannot disagree.
    pub fn help() -> String {
        format!(
            "How --transport cuda-batch issues a batch's copies: kernel (kvx's gather-copy kernel, one \
             launch), api (the best batch API the driver has), or one path forced: api-v2 \
             (cuMemcpyBatchAsync_v2), api-v1 (cuMemcpyBatchAsync), per-copy (one cuMemcpyDtoDAsync per \
             copy); a forced path the driver lacks is an error [default: {}]",
            BatchCopy::default().as_str()
        )
    }

    /// The one driver path this choice forces, if it forces one (`api` picks the best there is).
    pub fn forced(self) -> Option<BatchPath> {
        match self {
            BatchCopy::Api => None,
            BatchCopy::ApiV2 => Some(BatchPath::BatchV2),
            BatchCopy::ApiV1 => Some(BatchPath::BatchV1),
            BatchCopy::PerCopy => Some(BatchPath::PerDescriptor),
            BatchCopy::Kernel => Some(BatchPath::Kernel),
        }
    }

    /// The path `new` takes on a driver of `version` (`cuDriverGetVersion`) that has the batch
    /// entry points `has_v2` and `has_v1`: the forced one, or an error naming the flag when
    /// the driver lacks it; for `api`, the best there is.
    pub fn choose(self, version: i32, has_v2: bool, has_v1: bool) -> Result<BatchPath, CudaBatchError> {
        let missing = |call: &'static str, since: &'static str| CudaBatchError::PathUnavailable {
            flag: format!("--batch-copy {}", self.as_str()),
            call,
            since,
            driver: version,
        };
        match self {
            BatchCopy::Api if has_v2 => Ok(BatchPath::BatchV2),
            BatchCopy::Api if has_v1 => Ok(BatchPath::BatchV1),
            BatchCopy::Api | BatchCopy::PerCopy => Ok(BatchPath::PerDescriptor),
            BatchCopy::ApiV2 if has_v2 => Ok(BatchPath::BatchV2),
            BatchCopy::ApiV2 => Err(missing("cuMemcpyBatchAsync_v2", "13.0")),
            BatchCopy::ApiV1 if has_v1 => Ok(BatchPath::BatchV1),
            BatchCopy::ApiV1 => Err(missing("cuMemcpyBatchAsync", "12.8")),
            BatchCopy::Kernel => Ok(BatchPath::Kernel),
        }
    }
}

/// How many batches `--transport cuda-batch` posts per request on a decode rank
/// (`--batch-launch`). Without MPS, two decode ranks on one GPU take turns on it, so every
/// launch of one waits behind the other's: fewer launches, fewer turns (`rank`).
/// Under MPS their kernels run side by side, and posting each peer's batch while the last one
/// copies wins (`peer`): on an H200, P8->D2 70B at 8 KiB, a request's span share was 0.32x
/// (`rank`) against 0.21x (`peer`) without MPS and 0.40x against 0.53x under it
/// (results/gpu-nvidia-h200-2026-11-27-run4.json). `auto`, the default, picks by that rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchLaunch {
    /// `peer` when the device's contexts are shared through MPS (the driver's
    /// CU_DEVICE_ATTRIBUTE_MPS_ENABLED), else `rank`; the summary names the one used.
    #[default]
    Auto,
    /// One batch per request per decode rank, over all its prefill peers (one kernel launch
    /// with `--batch-copy kernel`).
    Rank,
    /// One batch per prefill peer, each posted while the one before it copies (faster under
    /// MPS).
    Peer,
}

impl BatchLaunch {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchLaunch::Auto => "auto",
            BatchLaunch::Rank => "rank",
            BatchLaunch::Peer => "peer",
        }
    }

    /// The launch a decode rank uses: `auto` resolved by whether its device runs under MPS.
    pub fn resolve(self, under_mps: bool) -> BatchLaunch {
        match self {
            BatchLaunch::Auto if under_mps => BatchLaunch::Peer,
            BatchLaunch::Auto => BatchLaunch::Rank,
            chosen => chosen,
        }
    }
}

/// Where `--transport cuda-batch` makes the gather kernel's descriptors
/// (`--batch-descriptors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BatchDescriptors {
    /// On the host: each of the plan's pairs bounds-checked, contiguous runs coalesced, long
    /// copies split, written as `(dst, src, len)` and uploaded ([`CopyBatch`](super::CopyBatch)).
    #[default]
    Host,
    /// On the device: the plan's region table and the request's block pairs are uploaded (a
    /// few KiB) and a kernel writes the descriptors ([`GridBatch`](super::GridBatch)); the host checks bounds
    /// per region. Uniform plans with `--batch-copy kernel`, uncoalesced; a request whose
    /// descriptors are longer than [`GATHER_PIECE`](super::GATHER_PIECE) is made on the host.
    Device,
}

impl BatchDescriptors {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchDescriptors::Host => "host",
            BatchDescriptors::Device => "device",
        }
    }
}

/// Which driver entry point moved a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchPath {
    /// `cuMemcpyBatchAsync_v2` (CUDA 13 drivers): one call per batch.
    BatchV2,
    /// `cuMemcpyBatchAsync` (CUDA 12.8 and 12.9 drivers, with `failIdx`): one call per batch.
    BatchV1,
    /// A driver without the batch API: one `cuMemcpyDtoDAsync` per copy on one stream (still
    /// one event per batch, and still coalesced), so posting is per copy again.
    PerDescriptor,
    /// kvx's gather-copy kernel (`--batch-copy kernel`): one copy of the descriptor array to
    /// the device and one launch per batch.
    Kernel,
}

impl BatchPath {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "batch-v2",
            BatchPath::BatchV1 => "batch-v1",
            BatchPath::PerDescriptor => "per-descriptor",
            BatchPath::Kernel => "kernel",
        }
    }

    /// The driver function behind the path, for reports.
    pub fn driver_call(self) -> &'static str {
        match self {
            BatchPath::BatchV2 => "cuMemcpyBatchAsync_v2",
            BatchPath::BatchV1 => "cuMemcpyBatchAsync",
            BatchPath::PerDescriptor => "cuMemcpyDtoDAsync per copy (no batch API in this driver)",
            BatchPath::Kernel => {
                "kvx_gather_copy kernel (cuMemcpyHtoDAsync of the descriptors + cuLaunchKernel)"
            }
        }
    }

    /// Driver calls one batch of `copies` copies costs on this path.
    pub fn calls(self, copies: usize) -> u64 {
        match self {
            BatchPath::BatchV2 | BatchPath::BatchV1 => u64::from(copies > 0),
            BatchPath::PerDescriptor => copies as u64,
            BatchPath::Kernel => 2 * u64::from(copies > 0),
        }
    }
}

impl std::fmt::Display for BatchPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one batch cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchStats {
    /// Time to issue the driver call(s) and record the event.
    pub post_ns: u64,
    /// Of `post_ns`, the host's time writing the gather kernel's descriptors into pinned
    /// memory (0 on the other paths).
    #[serde(default)]
    pub fill_ns: u64,
    /// Of `post_ns`, the host's time packing the plan's pairs, where the copier packed them
    /// (`BatchCopier::enqueue_pairs`; with the gather kernel the same time as `fill_ns`:
    /// pairs are packed straight into pinned memory). 0 for batches packed before posting.
    #[serde(default)]
    pub pack_ns: u64,
    /// From the start of posting to the event's completion.
    pub complete_ns: u64,
    /// Driver calls made (1 with the batch API, one per copy without it).
    pub calls: u64,
    /// Copies after coalescing: the descriptors copied (before splitting into pieces).
    pub copies: u64,
    /// Plan descriptors before coalescing: the descriptors planned.
    pub descriptors: u64,
    pub bytes: u64,
    /// Plan descriptors whose address (on either side) or length is not a multiple of 16
    /// ([`CopyBatch::unaligned_descriptors`](super::CopyBatch::unaligned_descriptors)).
    #[serde(default)]
    pub unaligned_descriptors: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_launch_is_peer_under_mps_and_rank_without() {
        assert_eq!(BatchLaunch::default(), BatchLaunch::Auto);
        assert_eq!(BatchLaunch::Auto.resolve(true), BatchLaunch::Peer);
        assert_eq!(BatchLaunch::Auto.resolve(false), BatchLaunch::Rank);
        for chosen in [BatchLaunch::Rank, BatchLaunch::Peer] {
            assert_eq!(chosen.resolve(true), chosen, "an explicit choice stands");
            assert_eq!(chosen.resolve(false), chosen);
        }
    }

    #[test]
    fn batch_paths_count_their_driver_calls() {
        assert_eq!(BatchPath::Kernel.calls(10_240), 2, "the descriptor copy and the launch");
        assert_eq!(BatchPath::Kernel.calls(0), 0);
        assert_eq!(BatchPath::BatchV2.calls(10_240), 1);
        assert_eq!(BatchPath::BatchV1.calls(0), 0);
        assert_eq!(BatchPath::PerDescriptor.calls(10_240), 10_240);
        assert_eq!(
            serde_json::to_string(&BatchPath::PerDescriptor).ok().as_deref(),
            Some("\"per-descriptor\"")
        );
        assert_eq!(BatchPath::BatchV1.to_string(), "batch-v1");
    }

    #[test]
    fn each_batch_copy_forces_its_path_or_names_the_flag() {
        // A CUDA 13 driver with both entry points, a 12.8 one with v1 only, a 12.4 one with none.
        let v13 = |c: BatchCopy| c.choose(13000, true, true);
        let v128 = |c: BatchCopy| c.choose(12080, false, true);
        let v124 = |c: BatchCopy| c.choose(12040, false, false);
        assert_eq!(v13(BatchCopy::Api), Ok(BatchPath::BatchV2));
        assert_eq!(v128(BatchCopy::Api), Ok(BatchPath::BatchV1));
        assert_eq!(v124(BatchCopy::Api), Ok(BatchPath::PerDescriptor), "api falls back, as before");
        assert_eq!(v13(BatchCopy::ApiV1), Ok(BatchPath::BatchV1));
        assert_eq!(v13(BatchCopy::PerCopy), Ok(BatchPath::PerDescriptor));
        assert_eq!(v124(BatchCopy::Kernel), Ok(BatchPath::Kernel));
        let e = v128(BatchCopy::ApiV2).expect_err("no v2 in 12.8");
        assert!(e.to_string().starts_with("--batch-copy api-v2 forces cuMemcpyBatchAsync_v2"), "{e}");
        assert!(e.to_string().contains("version 12080"), "{e}");
        let e = v124(BatchCopy::ApiV1).expect_err("no v1 in 12.4");
        assert!(e.to_string().contains("--batch-copy api-v1") && e.to_string().contains("12.8"), "{e}");
        for c in [BatchCopy::ApiV2, BatchCopy::ApiV1, BatchCopy::PerCopy, BatchCopy::Kernel] {
            assert_eq!(v13(c).ok(), c.forced(), "{c:?} forces the path it takes");
        }
        assert_eq!(BatchCopy::Api.forced(), None);
    }

    #[test]
    fn batch_copy_names_agree_between_flag_file_and_help() {
        use clap::ValueEnum as _;
        for c in BatchCopy::value_variants() {
            let flag = c.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(flag.as_deref(), Some(c.as_str()));
            let file = serde_json::to_string(c).ok();
            assert_eq!(file, Some(format!("\"{}\"", c.as_str())), "the bench file's spelling");
        }
        assert_eq!(BatchCopy::default(), BatchCopy::Kernel);
        assert!(BatchCopy::help().ends_with("[default: kernel]"), "{}", BatchCopy::help());
    }
}
