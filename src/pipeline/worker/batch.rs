//! The cuda-batch transport in a worker: what a prefill rank advertises (its pool's CUDA IPC
//! export), what a decode rank keeps (one copier on its device, each peer's pool mapped once
//! per handshake), how one request's reads become batched copies (one over all peers, or one
//! per peer: `--batch-launch`), and how a run's batches are summed up for the summary.
//!
//! Owns: the glue between `transfer::cuda_batch` and the decode and prefill ranks, and the
//! failure causes its errors map to. Must not know the request lifecycle beyond one read
//! (notifications, leases and verification stay in `decode` and `prefill`, as for UCX).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::layouts::read_plan::{BlockPairs, Pair, RegionXfer};
use crate::pipeline::wire::{FailureCause, LoadResult};
use crate::pipeline::worker::plumbing::{Stage as _, WorkerError};
use crate::report::summary::{CudaBatchInfo, Summary};
use crate::transfer::cuda::{CudaBuffer, CudaDevice};
use crate::transfer::cuda_batch::{
    BatchCopier, BatchCopy, BatchDescriptors, BatchLaunch, BatchPath, CudaBatchError, GATHER_PIECE,
    GridBatch, PeerMapping, Span, export,
};
use crate::transfer::handshake::meta::{CudaIpcExport, KvxMetadata};
use crate::transfer::memory::{KvBuffer, MemPlace};

type Failure = (FailureCause, String);

/// A prefill rank's export of its pool, for its handshake metadata.
pub fn export_pool(mem: &KvBuffer) -> Result<CudaIpcExport, WorkerError> {
    // `settings::workers::check_mem_transport` refuses cuda-batch over host memory.
    let buf = mem.as_cuda().ok_or_else(|| WorkerError::Stage {
        stage: "export the KV pool for CUDA IPC".into(),
        source: format!("internal error: the cuda-batch transport got a KV pool in {} memory", mem.place())
            .into(),
    })?;
    export(buf).stage("export the KV pool for CUDA IPC (cuIpcGetMemHandle)")
}

/// What a decode rank keeps for the cuda-batch transport.
pub struct BatchSide {
    copier: BatchCopier,
    dev: Arc<CudaDevice>,
    launch: BatchLaunch,
    descriptors: BatchDescriptors,
    /// `--batch-descriptors device`: the request's grid, reused.
    grid: GridBatch,
}

/// One READ of a request for [`BatchSide::read_request`]: the prefill rank, its mapped pool (none
/// when it exported none) and the plan's pairs.
pub type BatchRead<'a> = (u32, Option<&'a Arc<PeerMapping>>, &'a [Pair]);

/// One READ of a request for [`BatchSide::read_grid`]: the prefill rank, its mapped pool and
/// the READ's regions (the plan's grid, over the request's block pairs).
pub type GridRead<'a> = (u32, Option<&'a Arc<PeerMapping>>, &'a [RegionXfer]);

impl BatchSide {
    /// A copier on the device the rank's pool lives on, issuing batches as `copy` says, one
    /// per request or one per peer as `launch` says.
    pub fn new(
        place: MemPlace,
        copy: BatchCopy,
        launch: BatchLaunch,
        descriptors: BatchDescriptors,
    ) -> Result<BatchSide, WorkerError> {
        // `settings::workers::check_mem_transport` refuses cuda-batch over host memory.
        let device = place.device().ok_or_else(|| WorkerError::Stage {
            stage: "start the cuda-batch copier".into(),
            source: "internal error: the cuda-batch transport got a KV pool in host memory".into(),
        })?;
        let dev = CudaDevice::open(device).stage(format!("open CUDA device {device}"))?;
        let what = match copy {
            BatchCopy::Api | BatchCopy::ApiV2 | BatchCopy::ApiV1 | BatchCopy::PerCopy => {
                "cuda-batch stream and event"
            }
            BatchCopy::Kernel => "cuda-batch stream, event and gather kernel (cuModuleLoadData of its PTX)",
        };
        let copier = BatchCopier::new(&dev, copy).stage(what)?;
        // `auto` is settled here, once: the summary reports the launch each rank used.
        let launch = launch.resolve(launch == BatchLaunch::Auto && copier.under_mps());
        Ok(BatchSide { copier, dev, launch, descriptors, grid: GridBatch::default() })
    }

    /// Whether a plan whose READs have these regions has its descriptors made on the device:
    /// `--batch-descriptors device` with the gather kernel, and no descriptor longer than one
    /// piece (the host splits longer copies over many thread blocks).
    pub fn device_descriptors<'a>(&self, mut regions: impl Iterator<Item = &'a RegionXfer>) -> bool {
        self.descriptors == BatchDescriptors::Device
            && self.copier.path() == BatchPath::Kernel
            && regions.all(|x| x.len <= GATHER_PIECE)
    }

    /// One request's READs with their descriptors made on the device ([`GridBatch`]): with
    /// `--batch-launch rank` one grid over all READs, posted once; with `peer` one per READ,
    /// each posted while the one before copies. Then waits, as [`request`](Self::request)
    /// says.
    pub fn read_grid(
        &mut self,
        local: &mut KvBuffer,
        reads: &[GridRead<'_>],
        bp: &BlockPairs,
        timeout: Duration,
        r: &mut LoadResult,
    ) -> Result<(), Failure> {
        self.request(local, reads, timeout, r, |me, buf, local_span, peers, r| {
            let who = |i: usize| format!("prefill rank {}", reads[i].0);
            let jobs: Vec<(&[RegionXfer], Span)> =
                reads.iter().zip(peers).map(|((_, _, regions), peer)| (*regions, peer.span())).collect();
            // `Auto` was resolved in `new`: one grid over all READs, or one per READ.
            let per = if me.launch == BatchLaunch::Peer { 1 } else { reads.len().max(1) };
            for first in (0..reads.len()).step_by(per) {
                let g = first..(first + per).min(reads.len());
                let t_pack = Instant::now();
                let packed = me.grid.pack(&jobs[g.clone()], &bp.local, &bp.remote, local_span);
                r.batch_pack_ns += t_pack.elapsed().as_nanos() as u64;
                packed.map_err(|(i, e)| failure(&who(first + i), e))?;
                let whom = if g.len() == 1 { who(first) } else { "its prefill ranks".to_string() };
                let st = me
                    .copier
                    .enqueue_grid(buf, &peers[g], &me.grid, timeout)
                    .map_err(|e| failure(&whom, e))?;
                me.count(&st, r);
            }
            Ok(())
        })?;
        r.batch_device_descriptors = true;
        Ok(())
    }

    /// Maps a prefill rank's advertised pool into this process.
    pub fn open(&self, meta: &KvxMetadata) -> Result<Arc<PeerMapping>, Failure> {
        let peer = format!("prefill rank {}", meta.tp_rank);
        PeerMapping::open(&self.dev, &peer, meta.cuda_ipc.as_ref()).map_err(|e| failure(&peer, e))
    }

    /// How the transport is named in reports: `cuda-batch/batch-v2`.
    pub fn label(&self) -> String {
        format!("cuda-batch/{}", self.copier.path())
    }

    /// One request's `reads` into `local`: with `--batch-launch peer`, each READ packed and
    /// posted at once (the next packed while it copies); with `rank`, every READ packed (on
    /// several threads when the request is large) into one batch, posted once. The copier
    /// packs them ([`BatchCopier::enqueue_pairs`]: with the gather kernel straight into the
    /// pinned descriptors it uploads).
    /// Then waits, as [`request`](Self::request) says. What it cost goes to `r`.
    pub fn read_request(
        &mut self,
        local: &mut KvBuffer,
        reads: &[BatchRead<'_>],
        timeout: Duration,
        r: &mut LoadResult,
    ) -> Result<(), Failure> {
        self.request(local, reads, timeout, r, |me, buf, _local_span, peers, r| {
            let who = |i: usize| format!("prefill rank {}", reads[i].0);
            let jobs: Vec<&[Pair]> = reads.iter().map(|(_, _, pairs)| *pairs).collect();
            // `Auto` was resolved in `new`: one batch over all READs, or one per READ.
            let per = if me.launch == BatchLaunch::Peer { 1 } else { reads.len().max(1) };
            for first in (0..reads.len()).step_by(per) {
                let g = first..(first + per).min(reads.len());
                let whom = if g.len() == 1 { who(first) } else { "its prefill ranks".to_string() };
                let st = me
                    .copier
                    .enqueue_pairs(buf, &peers[g.clone()], &jobs[g], timeout)
                    .map_err(|(part, e)| failure(&part.map_or(whom, |i| who(first + i)), e))?;
                me.count(&st, r);
            }
            Ok(())
        })
    }

    /// One request's READs from start to end: their prefill ranks' pools looked up (one not
    /// mapped fails the request before anything is posted), `post` given them and this rank's
    /// pool, then a wait for what was posted ([`finish`](Self::finish)) even when posting
    /// failed (nothing of this request may still be copying when the next one posts).
    /// Posting's error comes first; the transport used goes to `r`.
    fn request<T>(
        &mut self,
        local: &mut KvBuffer,
        reads: &[(u32, Option<&Arc<PeerMapping>>, T)],
        timeout: Duration,
        r: &mut LoadResult,
        post: impl FnOnce(
            &mut Self,
            &mut CudaBuffer,
            Span,
            &[Arc<PeerMapping>],
            &mut LoadResult,
        ) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let posted = (|| {
            let peers = mapped(reads.iter().map(|(p_rank, peer, _)| (*p_rank, *peer)))?;
            let (buf, local_span) = device_pool(local)?;
            post(self, buf, local_span, &peers, r)
        })();
        let waited = self.finish(timeout, r);
        posted.and(waited)?;
        r.transport = Some(crate::vocab::kinds::TransportKind::CudaBatch);
        r.transports = Some(self.label());
        Ok(())
    }

    /// Waits for every batch posted for the request (one event: one stream runs them in
    /// order). Called even when posting failed: nothing of a request may still be copying
    /// when the next one posts.
    pub fn finish(&mut self, timeout: Duration, r: &mut LoadResult) -> Result<(), Failure> {
        let ns = self.copier.finish(timeout).map_err(|e| failure("the prefill ranks", e))?;
        r.batch_wait_ns += ns;
        Ok(())
    }

    fn count(&self, st: &crate::transfer::cuda_batch::BatchStats, r: &mut LoadResult) {
        // Packing inside the post is reported as packing, as when it came before it.
        r.batch_pack_ns += st.pack_ns;
        r.post_ns += st.post_ns.saturating_sub(st.pack_ns);
        r.bytes += st.bytes;
        r.batch_path = Some(self.copier.path());
        r.batch_launch = Some(self.launch);
        r.batch_calls += st.calls;
        r.batch_copies += st.copies;
        r.batch_unaligned += st.unaligned_descriptors;
    }
}

/// The mapped pool of each READ's prefill rank, in order; a rank that is not mapped fails the
/// request before anything is posted.
fn mapped<'a>(
    reads: impl ExactSizeIterator<Item = (u32, Option<&'a Arc<PeerMapping>>)>,
) -> Result<Vec<Arc<PeerMapping>>, Failure> {
    let mut peers = Vec::with_capacity(reads.len());
    for (p_rank, peer) in reads {
        let Some(peer) = peer else {
            return Err((
                FailureCause::PeerGone,
                format!("prefill rank {p_rank} is not mapped (no CUDA IPC export)"),
            ));
        };
        peers.push(Arc::clone(peer));
    }
    Ok(peers)
}

/// This rank's pool in device memory, and its span.
fn device_pool(
    local: &mut KvBuffer,
) -> Result<(&mut crate::transfer::cuda::CudaBuffer, crate::transfer::cuda_batch::Span), Failure> {
    let buf = local.as_cuda_mut().ok_or_else(|| {
        (FailureCause::Internal, "the cuda-batch transport needs this rank's KV pool in device memory".into())
    })?;
    let span = crate::transfer::cuda_batch::Span {
        base: crate::transfer::ucx::Registrable::addr(&*buf),
        len: buf.len() as u64,
    };
    Ok((buf, span))
}

/// The failure cause of a cuda-batch error: what cannot work between these two ranks is an
/// incompatibility (it will not work on a retry either), a missed deadline a timeout.
fn failure(who: &str, e: CudaBatchError) -> Failure {
    let cause = match &e {
        CudaBatchError::Timeout { .. } => FailureCause::Timeout,
        CudaBatchError::NoExport { .. }
        | CudaBatchError::OtherMachine { .. }
        | CudaBatchError::SameProcess { .. }
        | CudaBatchError::BadHandle { .. }
        | CudaBatchError::Open { .. }
        | CudaBatchError::OutOfBounds { .. }
        | CudaBatchError::PathUnavailable { .. } => FailureCause::Incompatible,
        CudaBatchError::WrongBuffers => FailureCause::Internal,
        CudaBatchError::Cuda(_) | CudaBatchError::Call { .. } => FailureCause::Transfer,
    };
    let msg = e.to_string();
    (cause, if msg.contains(who) { msg } else { format!("cuda-batch read from {who}: {msg}") })
}

/// A run's batches, summed from the decode ranks' results.
#[derive(Debug, Clone, Default)]
pub struct BatchTally {
    paths: Vec<BatchPath>,
    launches: Vec<BatchLaunch>,
    /// Where each counted rank result's descriptors were made: `host`, `device`.
    made_on: Vec<BatchDescriptors>,
    requests: u64,
    calls: u64,
    copies: u64,
    descriptors: u64,
    unaligned: u64,
    post_ns: u64,
    /// Decode ranks' results counted (one per rank per request), and their host and wait time.
    rank_requests: u64,
    pack_ns: u64,
    wait_ns: u64,
}

impl BatchTally {
    /// Adds one request's results (all its decode ranks).
    pub fn add<'a>(&mut self, ranks: impl IntoIterator<Item = &'a LoadResult>) {
        let mut counted = false;
        for r in ranks {
            let Some(path) = r.batch_path else { continue };
            if !self.paths.contains(&path) {
                self.paths.push(path);
            }
            if let Some(launch) = r.batch_launch.filter(|l| !self.launches.contains(l)) {
                self.launches.push(launch);
            }
            let made =
                if r.batch_device_descriptors { BatchDescriptors::Device } else { BatchDescriptors::Host };
            if !self.made_on.contains(&made) {
                self.made_on.push(made);
            }
            counted = true;
            self.calls += r.batch_calls;
            self.copies += r.batch_copies;
            self.descriptors += r.descs_raw;
            self.unaligned += r.batch_unaligned;
            self.post_ns += r.post_ns;
            self.rank_requests += 1;
            self.pack_ns += r.batch_pack_ns;
            self.wait_ns += r.batch_wait_ns;
        }
        self.requests += u64::from(counted);
    }

    /// The summary's `cuda_batch` section (nothing when no request went through cuda-batch).
    pub fn report(&self, summary: &mut Summary) {
        if self.requests == 0 {
            return;
        }
        let per_request = |n: u64| n as f64 / self.requests as f64;
        let per = |num: u64, den: u64| if den > 0 { num as f64 / den as f64 } else { 0.0 };
        summary.cuda_batch = Some(CudaBatchInfo {
            paths: self.paths.clone(),
            driver_calls: self.paths.iter().map(|p| p.driver_call().to_string()).collect(),
            launches: self.launches.clone(),
            descriptors_made_on: self.made_on.clone(),
            calls_per_request: per_request(self.calls),
            copies_per_request: per_request(self.copies),
            descriptors_per_request: per_request(self.descriptors),
            unaligned_descriptors_per_request: per_request(self.unaligned),
            post_ns_per_descriptor: per(self.post_ns, self.descriptors),
            post_us_per_call: per(self.post_ns, self.calls) / 1e3,
            pack_us_per_rank: per(self.pack_ns, self.rank_requests) / 1e3,
            post_us_per_rank: per(self.post_ns, self.rank_requests) / 1e3,
            wait_us_per_rank: per(self.wait_ns, self.rank_requests) / 1e3,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_causes_and_name_the_peer_once() {
        let (cause, msg) =
            failure("prefill rank 3", CudaBatchError::NoExport { peer: "prefill rank 3".into() });
        assert_eq!(cause, FailureCause::Incompatible);
        assert_eq!(msg.matches("prefill rank 3").count(), 1, "{msg}");
        let (cause, msg) =
            failure("prefill rank 1", CudaBatchError::Timeout { copies: 4, timeout: Duration::from_secs(5) });
        assert_eq!(cause, FailureCause::Timeout);
        assert!(msg.starts_with("cuda-batch read from prefill rank 1"), "{msg}");
        let (cause, _) = failure("p", CudaBatchError::Call { op: "cuEventQuery", reason: "x".into() });
        assert_eq!(cause, FailureCause::Transfer);
    }

    #[test]
    fn batches_sum_up_per_request() {
        let rank = |calls, copies, descs, post| LoadResult {
            batch_path: Some(BatchPath::BatchV2),
            batch_calls: calls,
            batch_copies: copies,
            descs_raw: descs,
            post_ns: post,
            batch_pack_ns: 1_000,
            batch_wait_ns: 2_000,
            ..LoadResult::default()
        };
        let mut t = BatchTally::default();
        t.add(&[rank(4, 40, 400, 40_000), LoadResult { batch_unaligned: 30, ..rank(4, 40, 400, 40_000) }]);
        t.add(&[rank(4, 20, 400, 20_000), LoadResult::default()]);
        t.add(&[LoadResult::default()]); // a request cuda-batch did not move
        let mut s = Summary::new("r", "t", Default::default());
        t.report(&mut s);
        let info = s.cuda_batch.expect("reported");
        assert_eq!(info.paths, [BatchPath::BatchV2]);
        assert_eq!(info.driver_calls, ["cuMemcpyBatchAsync_v2"]);
        assert_eq!(info.calls_per_request, 6.0);
        assert_eq!(info.copies_per_request, 50.0);
        assert_eq!(info.descriptors_per_request, 600.0);
        assert_eq!(info.unaligned_descriptors_per_request, 15.0, "30 over two requests");
        assert_eq!(info.post_ns_per_descriptor, 100_000.0 / 1200.0);
        assert_eq!(info.post_us_per_call, 100_000.0 / 12.0 / 1e3);
        assert_eq!(info.post_us_per_rank, 100_000.0 / 3.0 / 1e3, "three decode ranks' results");
        assert_eq!(info.pack_us_per_rank, 3_000.0 / 3.0 / 1e3);
        assert_eq!(info.wait_us_per_rank, 6_000.0 / 3.0 / 1e3);
        assert_eq!(info.descriptors_made_on, [BatchDescriptors::Host]);
        // A rank whose descriptors the GPU made is named beside the host's.
        t.add(&[LoadResult { batch_device_descriptors: true, ..rank(3, 400, 400, 1_000) }]);
        let mut s = Summary::new("r", "t", Default::default());
        t.report(&mut s);
        assert_eq!(
            s.cuda_batch.expect("reported").descriptors_made_on,
            [BatchDescriptors::Host, BatchDescriptors::Device]
        );
        let mut none = Summary::new("r", "t", Default::default());
        BatchTally::default().report(&mut none);
        assert!(none.cuda_batch.is_none());
    }
}
