//! The control protocol between an engine (the process that schedules) and its worker
//! processes (one per TP rank): msgpack over a ZMQ ROUTER (engine) / DEALER (worker).
//!
//! Workers measure their own stages and report durations, never timestamps, so the
//! numbers mean the same when ranks run on other hosts.

use serde::{Deserialize, Serialize};

use crate::pipeline::params::KvTransferParams;
use crate::transfer::ucx::ProtoReport;

/// Hard cap on one control message, checked before decoding.
pub const MAX_CONTROL_BYTES: usize = 64 << 20;

/// How often a worker started elsewhere (`kvx worker --connect tcp://...`) tells its engine
/// it is alive. Such a worker has no pipe to the engine whose closing would say it died.
pub const ALIVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

use crate::config::worker::{Fault, WorkerConfig};
use crate::vocab::kinds::{Role, TransportKind};

/// Engine to worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToWorker {
    Init(Box<WorkerConfig>),
    /// Prefill rank: fill these blocks with the request's pattern and hold them until
    /// `expected_notifs` notifications (0: the count the first notification names).
    Fill {
        req: u64,
        p_request_id: String,
        /// The prompt's tokens (a hybrid model's ranks lay the blocks out per group from it).
        #[serde(default)]
        tokens: u32,
        blocks: Vec<u32>,
        seed: u64,
        expected_notifs: u32,
    },
    /// Decode rank: pull the blocks `params` describes into `local_blocks`.
    Load {
        req: u64,
        d_request_id: String,
        params: Box<KvTransferParams>,
        local_blocks: Vec<u32>,
        seed: u64,
        /// Push mode: this decode engine's side channel, which the registration names.
        side_channel: Option<(String, u16)>,
        /// Start it once it is first in the rank's queue; `false`: hold it there until a
        /// [`ToWorker::Go`] names it (the engine starts a request's ranks together).
        go: bool,
    },
    /// Decode rank: start the held load `req` (every rank of the request gets this at once).
    Go {
        req: u64,
    },
    /// Prefill rank: no decode engine will read this request's blocks (the serving path's
    /// decode leg failed, or its client left before the handoff); free them now.
    Release {
        p_request_id: String,
    },
    /// Decode rank (push mode): a rank of this prefill engine is gone; stop waiting for its
    /// WRITEs (the requests fail as `peer_gone`).
    PeerGone {
        engine_id: String,
    },
    /// Fault injection for resilience tests (`kvx bench --fault`).
    Fault(Fault),
    Shutdown,
}

/// What a worker reports once it is up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadyInfo {
    pub rank: u32,
    /// Prefill ranks: the side-channel payload (kvx agent metadata) the engine serves.
    pub handshake_payload: Option<Vec<u8>>,
    pub ucx_library: String,
    pub ucx_version: String,
    pub pool_bytes: u64,
    pub rss_bytes: u64,
}

/// Why a load failed, for counting failures by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    Handshake,
    Incompatible,
    Transfer,
    Timeout,
    PeerGone,
    Verify,
    Notify,
    Internal,
}

impl FailureCause {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::Handshake => "handshake",
            FailureCause::Incompatible => "incompatible",
            FailureCause::Transfer => "transfer",
            FailureCause::Timeout => "timeout",
            FailureCause::PeerGone => "peer_gone",
            FailureCause::Verify => "verify",
            FailureCause::Notify => "notify",
            FailureCause::Internal => "internal",
        }
    }
}

/// One decode rank's account of one request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LoadResult {
    pub req: u64,
    pub d_rank: u32,
    pub error: Option<(FailureCause, String)>,
    /// Which transport finally moved the bytes, and how many fell back before it.
    pub transport: Option<TransportKind>,
    pub fallbacks: u32,
    pub queue_ns: u64,
    pub handshake_ns: Option<u64>,
    pub plan_ns: u64,
    pub post_ns: u64,
    pub transfer_ns: u64,
    /// When the transfer ran, on this host's monotonic clock (pull mode: the reads); joined
    /// over ranks into the request's wall span.
    #[serde(default)]
    pub transfer_span: Option<crate::clock::ClockSpan>,
    pub notify_ns: u64,
    /// From taking the request to notifications sent (verification excluded).
    pub e2e_ns: u64,
    pub verify_ns: u64,
    /// `--kv-buffer-device cpu`: the copy of the received blocks into the KV pool.
    #[serde(default)]
    pub sync_ns: u64,
    pub bytes: u64,
    pub descs_raw: u64,
    pub descs_coalesced: u64,
    pub bytes_verified: u64,
    /// Bytes read that hold no layer's data (a hybrid model: a group's block in a region where
    /// the group has no layer; vLLM reads them too), so none to verify.
    #[serde(default)]
    pub bytes_padding: u64,
    /// A hybrid model: what this rank read per KV cache group and part.
    #[serde(default)]
    pub parts: Vec<crate::report::summary::PartBytes>,
    pub verify_failure: Option<String>,
    /// UCX transports per endpoint, filled on the first request after a handshake.
    pub transports: Option<String>,
    /// The protocols UCX chose for this rank's reads (per memory-type pair), or why they are
    /// unknown; filled with `transports`.
    pub protocols: Option<ProtoReport>,
    /// UCX settings kvx made on the user's behalf (`NAME=value (why)`), filled with `transports`.
    pub ucx_settings: Option<Vec<String>>,
    /// The cuda-batch transport: which driver path moved the batches, the driver calls it made
    /// and the copies after coalescing (`descs_raw` counts the plan's descriptors).
    #[serde(default)]
    pub batch_path: Option<crate::transfer::cuda_batch::BatchPath>,
    /// One batch per request over all peers, or one per peer (`--batch-launch`).
    #[serde(default)]
    pub batch_launch: Option<crate::transfer::cuda_batch::BatchLaunch>,
    #[serde(default)]
    pub batch_calls: u64,
    #[serde(default)]
    pub batch_copies: u64,
    /// Of `descs_raw`, the descriptors whose address or length is not a multiple of 16
    /// (`transfer::cuda_batch::CopyBatch::unaligned_descriptors`).
    #[serde(default)]
    pub batch_unaligned: u64,
    /// Host time packing the plan's pairs into batches (bounds checked, merged, as the
    /// kernel's descriptors), and waiting for the batches' copies after posting them.
    #[serde(default)]
    pub batch_pack_ns: u64,
    #[serde(default)]
    pub batch_wait_ns: u64,
    /// The kernel's descriptors were made on the device from the plan's grid
    /// (`--batch-descriptors device`), not packed on the host.
    #[serde(default)]
    pub batch_device_descriptors: bool,
}

/// What a rank's UCX chose for its one-sided operations, reported once: the transports of an
/// endpoint, the protocols per memory-type pair, and the settings kvx made for the user.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxChoices {
    pub transports: Option<String>,
    pub protocols: ProtoReport,
    pub settings: Vec<String>,
}

/// What one prefill rank's push of a request took and moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushStats {
    pub handshake_ns: u64,
    pub post_ns: u64,
    /// Writing: posting the PUTs until they completed locally, and flushing the endpoints
    /// (remote completion); without layer overlap, from the first PUT to the last flush.
    pub transfer_ns: u64,
    /// When the WRITEs ran, first PUT to last flush, on this host's monotonic clock.
    #[serde(default)]
    pub span: Option<crate::clock::ClockSpan>,
    pub notify_ns: u64,
    pub bytes: u64,
    pub descriptors: u64,
    /// WRITE time spent while the simulated prefill still ran.
    #[serde(default)]
    pub hidden_ns: u64,
}

/// Worker to engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FromWorker {
    Hello {
        role: Role,
        rank: Option<u32>,
        pid: u32,
        host: String,
    },
    Ready(Box<ReadyInfo>),
    /// `publish_ns`: time to publish the blocks through the storage transport (0 if unused).
    Filled {
        req: u64,
        fill_ns: u64,
        publish_ns: u64,
        /// `--kv-buffer-device cpu`: the copy of the request's blocks to the host buffer.
        #[serde(default)]
        save_ns: u64,
    },
    /// A prefill rank released a request's blocks: all notifications arrived, or the lease expired.
    Freed {
        req: u64,
        expired: bool,
    },
    Loaded(Box<LoadResult>),
    /// Notifications for requests this rank does not hold.
    Unrecognized {
        count: u64,
    },
    /// A worker started elsewhere is still there (every `ALIVE_EVERY`).
    Alive,
    /// Push mode: a prefill rank wrote a request into the decode blocks (or failed to).
    Pushed {
        req: u64,
        /// What the WRITE took and moved (zeros when it failed before writing).
        stats: PushStats,
        /// The simulated prefill computation of the request on this rank (0 without one).
        #[serde(default)]
        compute_ns: u64,
        error: Option<(FailureCause, String)>,
        /// What UCX chose for this rank's WRITEs, with its first written request.
        #[serde(default)]
        ucx: Option<Box<UcxChoices>>,
    },
    /// A prefill rank's handshake metadata changed (its UCX side was torn down): the side
    /// channel advertises this from now on, so decode ranks that connect again learn at once
    /// that it cannot be read over UCX instead of timing out on a dead endpoint.
    Republish {
        payload: Vec<u8>,
    },
    /// The worker is exiting because of this error.
    Fatal {
        msg: String,
    },
    Bye {
        rss_bytes: u64,
    },
}

/// Encodes a control message.
pub fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    // Plain data with string keys: encoding into a Vec cannot fail.
    rmp_serde::to_vec_named(msg).unwrap_or_default()
}

/// Decodes a control message, refusing oversized ones before allocating.
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    if bytes.len() > MAX_CONTROL_BYTES {
        return Err(format!("control message of {} bytes exceeds {MAX_CONTROL_BYTES}", bytes.len()));
    }
    rmp_serde::from_slice(bytes).map_err(|e| format!("malformed control message: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let m = FromWorker::Filled { req: 3, fill_ns: 99, publish_ns: 0, save_ns: 7 };
        assert_eq!(decode::<FromWorker>(&encode(&m)), Ok(m));
        assert!(decode::<FromWorker>(b"\xc1garbage").is_err());
        assert!(decode::<ToWorker>(&[]).is_err());
    }
}
