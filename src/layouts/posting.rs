//! What posting a request's descriptors costs on each transport, before anything runs: the
//! descriptors a decode rank posts times the transport's per-descriptor posting cost, against
//! the time its bytes take at the transport's bandwidth ceiling. A request whose posting takes
//! longer than its bytes is *post-bound*: no faster link helps it, fewer descriptors do.
//!
//! Posting and copying overlap (a transport posts the next descriptor while earlier ones
//! move), so a request takes about `max(post, copy)`; the model reports both and that bound.
//! Each decode rank posts its own reads in parallel with the others, so a request is as slow as
//! its busiest decode rank, which is the one reported.
//!
//! The rates are data ([`PostRates`]): built in from committed results files (each rate names
//! its file and line; `rates` implements the default), replaced by the user's own measurements (a
//! results file of the user's, or figures given one by one: [`Knob::Rates`], [`Knob::PostNs`],
//! [`Knob::CeilingGbps`], resolved in `settings`).
//!
//! Owns: the cost arithmetic. Pure: no I/O.

use serde::Serialize;

use crate::vocab::knob::Knob;

/// A way of posting a request's descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PostPath {
    /// UCX on host memory (cma, posix): one GET per vLLM descriptor.
    Ucx,
    /// UCX cuda_ipc on device memory (what NIXL uses between GPUs of one machine): one
    /// `cuMemcpyAsync` plus an event per GET, one GET per vLLM descriptor.
    CudaIpc,
    /// kvx's `cuda-batch` transport: a request's descriptors from one peer, coalesced where
    /// contiguous, in one `cuMemcpyBatchAsync` call.
    CudaBatch,
}

impl PostPath {
    pub const ALL: [PostPath; 3] = [PostPath::Ucx, PostPath::CudaIpc, PostPath::CudaBatch];

    /// The key [`Knob::PostNs`] and [`Knob::CeilingGbps`] name it by.
    pub fn key(self) -> &'static str {
        match self {
            PostPath::Ucx => "ucx",
            PostPath::CudaIpc => "cuda-ipc",
            PostPath::CudaBatch => "cuda-batch",
        }
    }

    /// What memory the path moves.
    pub fn memory(self) -> &'static str {
        match self {
            PostPath::Ucx => "host",
            PostPath::CudaIpc | PostPath::CudaBatch => "cuda",
        }
    }
}

/// Where a rate came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum RateSource {
    /// A results file (built in, or the user's, [`Knob::Rates`]): its path, the line the figure stands
    /// on, and what was derived from it and how.
    File { path: String, line: usize, detail: String },
    /// Given on the command line.
    User,
}

impl RateSource {
    pub fn text(&self) -> String {
        match self {
            RateSource::File { path, line, detail } => format!("{path}:{line}: {detail}"),
            RateSource::User => format!("given with {}/{}", Knob::PostNs, Knob::CeilingGbps),
        }
    }
}

/// One path's posting cost and bandwidth ceiling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathRate {
    /// CPU time to post one descriptor (one entry of a batch, for cuda-batch).
    pub ns_per_descriptor: f64,
    /// Fixed CPU time per driver call on top (cuda-batch: the call, its event record and the
    /// wait's wake-up; 0 where each descriptor is its own call, folded into the rate above).
    pub ns_per_call: f64,
    pub post_source: RateSource,
    /// Bandwidth the bytes move at once posted (GB/s = 1e9 B/s).
    pub ceiling_gbps: f64,
    pub ceiling_source: RateSource,
    /// The whole transfer-time model, where a `kvx calibrate` rates file gave one
    /// (`layouts::predict`): what `kvx plan` and `kvx bench` predict transfer times with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<super::predict::TransferModel>,
}

/// The rates of every path.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PostRates {
    pub ucx: PathRate,
    pub cuda_ipc: PathRate,
    pub cuda_batch: PathRate,
}

impl PostRates {
    pub fn of(&self, path: PostPath) -> &PathRate {
        match path {
            PostPath::Ucx => &self.ucx,
            PostPath::CudaIpc => &self.cuda_ipc,
            PostPath::CudaBatch => &self.cuda_batch,
        }
    }

    pub fn of_mut(&mut self, path: PostPath) -> &mut PathRate {
        match path {
            PostPath::Ucx => &mut self.ucx,
            PostPath::CudaIpc => &mut self.cuda_ipc,
            PostPath::CudaBatch => &mut self.cuda_batch,
        }
    }
}

/// One READ of a decode rank's plan (one source prefill rank), as the cost model needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadShape {
    /// vLLM's descriptors (one per block and region).
    pub descriptors: u64,
    /// After merging descriptors contiguous on both sides.
    pub coalesced: u64,
    pub bytes: u64,
}

/// What one path costs the busiest decode rank of a request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathCost {
    pub transport: PostPath,
    pub memory: &'static str,
    pub d_rank: u32,
    /// Descriptors the path posts: vLLM's for UCX (host and cuda_ipc), coalesced ones for
    /// cuda-batch.
    pub descriptors: u64,
    /// Driver or UCX calls: one per descriptor, or one per peer with cuda-batch.
    pub calls: u64,
    pub bytes: u64,
    pub post_ns: f64,
    /// The bytes at the ceiling.
    pub copy_ns: f64,
    /// Posting takes longer than the bytes: the path is post-bound.
    pub post_bound: bool,
    /// `bytes / max(post, copy)`: the most the rank can move a request at.
    pub bound_gbps: f64,
}

/// The cost of one decode rank's reads on `path`.
pub fn rank_cost(path: PostPath, rate: &PathRate, d_rank: u32, reads: &[ReadShape]) -> PathCost {
    let bytes: u64 = reads.iter().map(|r| r.bytes).sum();
    let (descriptors, calls) = match path {
        PostPath::Ucx | PostPath::CudaIpc => {
            let n = reads.iter().map(|r| r.descriptors).sum();
            (n, n)
        }
        PostPath::CudaBatch => {
            (reads.iter().map(|r| r.coalesced).sum(), reads.iter().filter(|r| r.coalesced > 0).count() as u64)
        }
    };
    let post_ns = descriptors as f64 * rate.ns_per_descriptor
        + if path == PostPath::CudaBatch { calls as f64 * rate.ns_per_call } else { 0.0 };
    // 1 GB/s is one byte per nanosecond.
    let copy_ns = if rate.ceiling_gbps > 0.0 { bytes as f64 / rate.ceiling_gbps } else { 0.0 };
    let slowest = post_ns.max(copy_ns);
    PathCost {
        transport: path,
        memory: path.memory(),
        d_rank,
        descriptors,
        calls,
        bytes,
        post_ns,
        copy_ns,
        post_bound: post_ns > copy_ns,
        bound_gbps: if slowest > 0.0 { bytes as f64 / slowest } else { 0.0 },
    }
}

/// Every path's cost for a request, from each decode rank's reads: per path, the decode rank
/// that takes longest (`max(post, copy)`; the first such rank on a tie). No ranks, no rows.
pub fn request_costs(ranks: &[(u32, Vec<ReadShape>)], rates: &PostRates) -> Vec<PathCost> {
    PostPath::ALL
        .iter()
        .filter_map(|&path| {
            ranks
                .iter()
                .map(|(d, reads)| rank_cost(path, rates.of(path), *d, reads))
                .reduce(|a, b| if b.post_ns.max(b.copy_ns) > a.post_ns.max(a.copy_ns) { b } else { a })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// P8 -> D2 Llama-3.1-70B at 8 KiB descriptors, as the GPU notes count them: 81,920 reads
    /// per request, 40,960 per decode rank over 4 peers.
    fn p8d2_rank() -> Vec<ReadShape> {
        vec![ReadShape { descriptors: 10_240, coalesced: 10_240, bytes: 10_240 * 8192 }; 4]
    }

    #[test]
    fn cuda_ipc_at_8_kib_is_post_bound_at_about_1_5_gb_per_s() {
        let rates = PostRates::default();
        let r = &rates.cuda_ipc;
        let c = rank_cost(PostPath::CudaIpc, r, 0, &p8d2_rank());
        assert_eq!((c.descriptors, c.calls), (40_960, 40_960));
        assert!((c.post_ns - 40_960.0 * r.ns_per_descriptor).abs() < 1.0);
        assert!(c.post_bound);
        // 8192 B per GET's posting time: about 1.5 GB/s at 5.4 us.
        assert!((c.bound_gbps - 8192.0 / r.ns_per_descriptor).abs() < 1e-9, "{}", c.bound_gbps);
        assert!(c.bound_gbps < 2.0, "{}", c.bound_gbps);
        assert!((c.copy_ns - 40_960.0 * 8192.0 / r.ceiling_gbps).abs() < 1.0);
    }

    #[test]
    fn cuda_batch_pays_one_call_per_peer_and_coalesced_descriptors() {
        let rates = PostRates::default();
        let mut reads = p8d2_rank();
        reads[3].coalesced = 10; // one peer's blocks happen to be contiguous
        let c = rank_cost(PostPath::CudaBatch, &rates.cuda_batch, 1, &reads);
        assert_eq!(c.calls, 4);
        assert_eq!(c.descriptors, 3 * 10_240 + 10);
        let r = &rates.cuda_batch;
        let want = (3.0 * 10_240.0 + 10.0) * r.ns_per_descriptor + 4.0 * r.ns_per_call;
        assert!((c.post_ns - want).abs() < 1e-6);
        // 84 us of posting against 0.18 ms of copying: not post-bound, as measured.
        assert!(!c.post_bound, "{c:?}");
        assert!(
            c.bound_gbps > 10.0 * 8192.0 / rates.cuda_ipc.ns_per_descriptor,
            "clears the issue's 10x target"
        );
        // A peer that sends nothing costs no call.
        let none = [ReadShape::default(), ReadShape { descriptors: 2, coalesced: 1, bytes: 64 }];
        assert_eq!(rank_cost(PostPath::CudaBatch, &rates.cuda_batch, 0, &none).calls, 1);
    }

    #[test]
    fn large_descriptors_are_bandwidth_bound() {
        // 16 MiB each: 5.5 us posts 3 TB/s worth (at 1 MiB cuda_ipc is still post-bound, as
        // the GPU notes' 144-183 GB/s at 1 MiB show).
        let rates = PostRates::default();
        let reads = [ReadShape { descriptors: 4, coalesced: 4, bytes: 64 << 20 }];
        for path in PostPath::ALL {
            let c = rank_cost(path, rates.of(path), 0, &reads);
            assert!(!c.post_bound, "{path:?}: {c:?}");
            assert!((c.bound_gbps - rates.of(path).ceiling_gbps).abs() < 1e-9);
        }
    }

    #[test]
    fn a_request_costs_what_its_busiest_decode_rank_costs() {
        let rates = PostRates::default();
        let small = vec![ReadShape { descriptors: 10, coalesced: 10, bytes: 81_920 }];
        let ranks = vec![(0, small), (1, p8d2_rank())];
        let costs = request_costs(&ranks, &rates);
        assert_eq!(costs.iter().map(|c| c.transport).collect::<Vec<_>>(), PostPath::ALL.to_vec());
        assert!(costs.iter().all(|c| c.d_rank == 1), "{costs:?}");
        assert!(request_costs(&[], &rates).is_empty());
        // Nothing to read (a full prefix hit): no time, not post-bound, no rate.
        let empty = rank_cost(PostPath::Ucx, &rates.ucx, 0, &[]);
        assert_eq!(
            (empty.post_ns, empty.copy_ns, empty.post_bound, empty.bound_gbps),
            (0.0, 0.0, false, 0.0)
        );
    }

    #[test]
    fn defaults_name_the_file_and_line_of_each_rate() {
        let r = PostRates::default();
        for p in PostPath::ALL {
            assert!(matches!(r.of(p).post_source, RateSource::File { line, .. } if line > 0), "{p:?}");
        }
        assert!(
            r.cuda_batch.post_source.text().starts_with("results/gpu-nvidia-h200-")
                && r.cuda_batch.post_source.text().ends_with("(on an NVIDIA H200)"),
            "{}",
            r.cuda_batch.post_source.text()
        );
        assert!(r.ucx.post_source.text().starts_with("results/docs/xfer-rates/out.txt:"));
        assert_eq!(PostPath::CudaBatch.key(), "cuda-batch");
        assert_eq!(serde_json::to_value(PostPath::CudaIpc).ok(), Some(serde_json::json!("cuda-ipc")));
    }
}
