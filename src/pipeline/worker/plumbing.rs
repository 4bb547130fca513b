//! What every rank's loop (`prefill`, `decode`) shares: the control channel to its engine,
//! the worker's error type, the rank a launcher gave the process, its peak memory, the
//! compatibility factors both sides hash, and the storage transport's options. The process
//! around the loops (hello, configuration, goodbye) is `rank`.

use std::time::{Duration, Instant};

use crate::config::worker::WorkerConfig;
use crate::error::ConfigError;
use crate::layouts::compat::PairSpec;
use crate::pipeline::wire::{self, FromWorker, ToWorker};
use crate::topology::TransferMode;
use crate::topology::VllmVersion;
use crate::transfer::handshake::client::{HandshakeClient, PeerMetadata};
use crate::transfer::handshake::compat::{CompatFactors, KvxFactors};
use crate::transfer::handshake::meta::{KVX_METADATA_FORMAT, KvxMetadata, KvxRegion};
use crate::transfer::handshake::zmq_context;
use crate::transfer::memory::{HostBuffer, KvBuffer, MemPlace};
use crate::vocab::model::ModelShape;

/// A worker's fatal error: reported to the engine (which names the rank and fails the
/// requests that need it), then the process exits 2.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A step of start-up or of the role's loop failed; `stage` says which ("load UCX",
    /// "register the KV pool with UCX"), `source` why (and, for UCX, the flag to change).
    #[error("{stage}: {source}")]
    Stage { stage: String, source: Box<dyn std::error::Error + Send + Sync> },
    /// The configuration the engine sent names a choice this worker does not know.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The engine that spawned this worker exited (or was killed).
    #[error("the engine (pid {pid}) that started this worker is gone")]
    EngineGone { pid: u32 },
    /// The engine never sent the configuration after the hello.
    #[error("no configuration from the engine at {endpoint} within {timeout:?}")]
    NoConfig { endpoint: String, timeout: Duration },
    /// A control message this worker cannot decode (a kvx of another version?).
    #[error("a message from the engine cannot be decoded: {reason}")]
    Protocol { reason: String },
    /// The KV pool was torn down (after `kill-ucx`) and something still needed it.
    #[error("the KV pool is gone")]
    PoolGone,
}

impl WorkerError {
    /// The whole chain in one line, for the engine (which only gets text).
    pub fn chain_text(&self) -> String {
        let mut text = self.to_string();
        let mut cur = std::error::Error::source(self);
        while let Some(e) = cur {
            let m = e.to_string();
            if !text.contains(&m) {
                text.push_str(&format!(": {m}"));
            }
            cur = e.source();
        }
        text
    }
}

/// Names the stage a fallible step belongs to: `step().stage("load UCX")?`.
pub trait Stage<T> {
    fn stage(self, stage: impl Into<String>) -> Result<T, WorkerError>;
}

impl<T, E: Into<Box<dyn std::error::Error + Send + Sync>>> Stage<T> for Result<T, E> {
    fn stage(self, stage: impl Into<String>) -> Result<T, WorkerError> {
        self.map_err(|e| WorkerError::Stage { stage: stage.into(), source: e.into() })
    }
}

/// How often a spawned worker checks that the engine that spawned it still exists.
const PARENT_CHECK: Duration = Duration::from_millis(100);

/// The control channel to the engine.
pub struct Control {
    sock: zmq::Socket,
    /// Workers spawned by a local engine (ipc endpoint): the engine's pid. ZMQ does not say
    /// when a peer dies, so without this check a worker whose engine was killed would run
    /// forever.
    parent: Option<u32>,
    next_check: std::cell::Cell<Instant>,
}

impl Control {
    pub fn connect(endpoint: &str) -> Result<Self, WorkerError> {
        let sock = zmq_context().socket(zmq::DEALER).stage("control socket")?;
        let _ = sock.set_linger(1000);
        let _ = sock.set_maxmsgsize(wire::MAX_CONTROL_BYTES as i64);
        sock.connect(endpoint).stage(format!("connect to the engine at {endpoint}"))?;
        let parent = endpoint.starts_with("ipc://").then(std::os::unix::process::parent_id);
        Ok(Control { sock, parent, next_check: std::cell::Cell::new(Instant::now()) })
    }

    pub fn socket(&self) -> &zmq::Socket {
        &self.sock
    }

    pub fn send(&self, msg: &FromWorker) -> Result<(), WorkerError> {
        self.sock.send(wire::encode(msg), 0).stage("send to the engine")
    }

    /// Next message, waiting at most `timeout` (`None`: nothing arrived).
    pub fn recv(&self, timeout: Duration) -> Result<Option<ToWorker>, WorkerError> {
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        if self.sock.poll(zmq::POLLIN, ms).stage("poll the control socket")? == 0 {
            return Ok(None);
        }
        self.try_recv()
    }

    /// Next message if one is queued; an error once the spawning engine is gone. Workers
    /// started elsewhere also say they are alive here, every `ALIVE_EVERY` (the role loops
    /// call this at least every 100 ms between requests).
    pub fn try_recv(&self) -> Result<Option<ToWorker>, WorkerError> {
        if self.parent.is_none() && Instant::now() >= self.next_check.get() {
            self.next_check.set(Instant::now() + wire::ALIVE_EVERY);
            self.send(&FromWorker::Alive)?;
        }
        if let Some(parent) = self.parent
            && Instant::now() >= self.next_check.get()
        {
            self.next_check.set(Instant::now() + PARENT_CHECK);
            if std::os::unix::process::parent_id() != parent {
                return Err(WorkerError::EngineGone { pid: parent });
            }
        }
        match self.sock.recv_bytes(zmq::DONTWAIT) {
            Ok(b) => wire::decode(&b).map(Some).map_err(|reason| WorkerError::Protocol { reason }),
            Err(zmq::Error::EAGAIN) => Ok(None),
            Err(e) => Err(e).stage("receive from the engine"),
        }
    }
}

/// Peak resident set size of this process in bytes (`VmHWM`), so a report shows the most a
/// worker ever held, not what it holds at the moment of asking.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        })
        .map_or(0, |kib| kib * 1024)
}

/// The compatibility factors both sides of a pair hash (model, dtype, heads, head size,
/// layers, layout family, transfer mode).
pub fn compat_factors(model: &ModelShape, version: VllmVersion, mode: TransferMode) -> CompatFactors {
    CompatFactors::kvx(&KvxFactors {
        kvx_format_version: KVX_METADATA_FORMAT,
        model: model.name.clone(),
        dtype: model.dtype.torch_name().to_string(),
        num_kv_heads: u64::from(if model.is_mla() { 1 } else { model.num_kv_heads }),
        head_size: u64::from(model.mla.map_or(model.head_dim, |m| m.head_size())),
        num_hidden_layers: u64::from(model.num_layers),
        cache_dtype: "auto".into(),
        layout_family: match version {
            VllmVersion::V0_33 => "v0.33".into(),
            VllmVersion::V0_19 => "classic".into(),
        },
        transfer_mode: mode.as_str().into(),
    })
}

/// The failure cause of a handshake error: the peer refused us or is not kvx (incompatible),
/// or the handshake itself failed.
pub fn handshake_cause(e: &crate::transfer::handshake::HandshakeError) -> wire::FailureCause {
    use crate::transfer::handshake::HandshakeError;
    match e {
        HandshakeError::HashMismatch { .. }
        | HandshakeError::Rejected { .. }
        | HandshakeError::NotKvx { .. } => wire::FailureCause::Incompatible,
        _ => wire::FailureCause::Handshake,
    }
}

/// Fetches the metadata of `ranks` from `endpoint`, each peer checked by `validate`: at
/// least one peer, or the failure's cause and message.
/// A hybrid engine's ranks as `g` plans their pools: each rank's regions (offsets from its
/// first, lengths, strides, block counts) must be the planned ones, or descriptors would land
/// elsewhere. `who`: the peer engine, for the message; `planned`: who planned it and at what TP.
/// Returns the plan's first region offset and the span its regions reach (for the remote keys).
pub fn hybrid_peer_regions(
    g: &crate::layouts::hybrid::EngineGeometry,
    peers: &[PeerMetadata],
    who: &str,
    planned: &str,
) -> Result<(u64, u64), (wire::FailureCause, String)> {
    let first = g.regions.first().map_or(0, |r| r.base_off);
    let len = g.regions.iter().map(|r| r.base_off + r.num_blocks * r.block_stride).max().unwrap_or(0);
    for peer in peers {
        let meta = &peer.metadata;
        let base = meta.regions.first().map_or(0, |r| r.base_addr);
        let advertised = meta
            .regions
            .iter()
            .map(|r| (r.base_addr.wrapping_sub(base), r.block_len_bytes, r.block_stride_bytes, r.num_blocks));
        let plan = g
            .regions
            .iter()
            .map(|r| (r.base_off.wrapping_sub(first), r.block_len, r.block_stride, r.num_blocks));
        if !plan.eq(advertised) {
            return Err((
                wire::FailureCause::Incompatible,
                format!(
                    "{who} rank {} registers {} regions that differ from the {} {planned} (give both engines \
                     the same --layout, --block-size, --kernel-block-size, --kv-buffer-device, \
                     --host-state-page and --host-descriptors)",
                    meta.tp_rank,
                    meta.regions.len(),
                    g.regions.len()
                ),
            ));
        }
    }
    Ok((first, len))
}

pub fn fetch_peers<E: std::fmt::Display>(
    client: &HandshakeClient,
    endpoint: &str,
    ranks: &[(u32, u32)],
    factors: &CompatFactors,
    validate: impl Fn(&KvxMetadata) -> Result<(), E>,
) -> Result<Vec<PeerMetadata>, (wire::FailureCause, String)> {
    let peers = client
        .fetch_metadata_many(endpoint, ranks, Some(factors), validate)
        .map_err(|e| (handshake_cause(&e), e.to_string()))?;
    if peers.is_empty() {
        return Err((wire::FailureCause::Handshake, format!("{endpoint} returned no metadata")));
    }
    Ok(peers)
}

/// A peer's first advertised region (`who` names the peer's side in the error).
pub fn first_region<'m>(
    meta: &'m KvxMetadata,
    who: &str,
) -> Result<&'m KvxRegion, (wire::FailureCause, String)> {
    meta.regions
        .first()
        .ok_or_else(|| (wire::FailureCause::Incompatible, format!("{who} advertises no regions")))
}

/// The engine spec a peer's metadata describes (TP, block size, pool, layout).
pub fn peer_spec(meta: &KvxMetadata, local: &PairSpec) -> Result<crate::layouts::EngineSpec, String> {
    let layout = crate::layouts::Layout::parse_for(&meta.layout, local.version)
        .map_err(|e| format!("peer layout: {e}"))?;
    let num_blocks = meta.regions.first().map_or(0, |r| r.num_blocks);
    Ok(crate::layouts::EngineSpec {
        tp: meta.tp_size,
        block_tokens: meta.block_size_tokens,
        num_blocks: u32::try_from(num_blocks).map_err(|_| format!("peer advertises {num_blocks} blocks"))?,
        layout,
    })
}

/// The pair as a decode rank sees it: its prefill side from the peer's metadata.
pub fn peer_pair(local: &PairSpec, meta: &KvxMetadata) -> Result<PairSpec, String> {
    Ok(PairSpec { p: peer_spec(meta, local)?, ..local.clone() })
}

/// The storage transport's options from a worker's configuration.
pub fn storage_options(cfg: &WorkerConfig) -> crate::transfer::storage::StorageOptions {
    let dir = cfg
        .transport
        .storage_dir
        .clone()
        .unwrap_or_else(crate::transfer::storage::StorageOptions::default_dir);
    let mut opts = crate::transfer::storage::StorageOptions::new(dir);
    opts.direct_io = cfg.transport.storage_direct_io;
    opts.fsync = cfg.transport.storage_fsync;
    opts
}

/// The failure cause of a UCX error in a transfer.
pub fn classify_ucx(e: &crate::transfer::ucx::UcxError) -> wire::FailureCause {
    use crate::transfer::ucx::UcxError;
    use wire::FailureCause;
    match e {
        UcxError::Timeout { .. } => FailureCause::Timeout,
        UcxError::Status { name, .. } if name.contains("UNREACHABLE") || name.contains("CONNECTION") => {
            FailureCause::PeerGone
        }
        UcxError::Status { .. } | UcxError::Poisoned => FailureCause::Transfer,
        _ => FailureCause::Internal,
    }
}

/// The handshake payload a rank advertises on its engine's side channel: its UCX worker
/// address (empty once its UCX side is gone), its pool's regions at `base` behind remote key
/// `rkey`, its engine side (`spec`: TP, layout, block size), its notification endpoint and,
/// for `--transport cuda-batch`, its pool's CUDA IPC export.
#[expect(clippy::too_many_arguments, reason = "advertised_payload's fields and the export")]
pub fn advertised_payload(
    cfg: &WorkerConfig,
    spec: &crate::layouts::EngineSpec,
    regions: &[crate::layouts::Region],
    base: u64,
    worker_address: Vec<u8>,
    rkey: &[u8],
    notify_ep: &str,
    cuda_ipc: Option<crate::transfer::handshake::meta::CudaIpcExport>,
) -> Result<Vec<u8>, WorkerError> {
    use crate::transfer::handshake::meta::{KvxMetadata, KvxRegion};
    let kvx_regions: Vec<KvxRegion> = regions
        .iter()
        .map(|r| KvxRegion {
            name: r.name.clone(),
            mem_type: cfg.mem.mem_type().as_str().into(),
            device_id: cfg.mem.device().unwrap_or(0),
            base_addr: base + r.base_off,
            rkey: rkey.to_vec(),
            block_len_bytes: r.block_len,
            block_stride_bytes: r.block_stride,
            num_blocks: r.num_blocks,
        })
        .collect();
    let factors = compat_factors(&cfg.pair.model, cfg.pair.version, cfg.transport.mode);
    let mut meta = KvxMetadata::new(
        cfg.engine_id.clone(),
        worker_address,
        (spec.tp, cfg.rank, 0, 0),
        spec.layout.name(),
        spec.block_tokens,
        kvx_regions,
        Some(notify_ep.to_string()),
        &factors,
    );
    meta.cuda_ipc = cuda_ipc;
    Ok(meta.to_payload().stage("encode metadata")?.encode())
}

/// The pool as host memory, for the storage transport, which reads and writes files from
/// host memory (settings refuse it with device pools before any worker starts).
pub fn host_pool(mem: &KvBuffer) -> Result<&HostBuffer, WorkerError> {
    mem.as_host().ok_or_else(|| device_pool_refused(mem.place()))
}

/// [`host_pool`], mutable.
pub fn host_pool_mut(mem: &mut KvBuffer) -> Result<&mut HostBuffer, WorkerError> {
    let place = mem.place();
    mem.as_host_mut().ok_or_else(|| device_pool_refused(place))
}

fn device_pool_refused(place: MemPlace) -> WorkerError {
    ConfigError::new(
        "--transport",
        format!("the storage transport moves host memory; this rank's KV pool is in {place} memory"),
    )
    .into()
}

/// A rank's KV pool, allocated where `--mem` says, and what its transport needs beside it.
pub(super) struct RankPool {
    pub regions: Vec<crate::layouts::Region>,
    /// The pool's bytes.
    pub total: usize,
    /// UCX is loaded (every transport but storage and cuda-batch).
    pub uses_ucx: bool,
    /// The shared-storage transport, alone or in a multi chain.
    pub uses_storage: bool,
    /// The memory transports move: the KV pool, or its host buffer (`--kv-buffer-device cpu`).
    pub mem: crate::transfer::memory::KvBuffer,
    /// With a host buffer: the KV pool itself, which the rank fills (prefill) or checks
    /// (decode), copied to or from `mem`.
    pub staged: Option<crate::transfer::memory::KvBuffer>,
}

/// A hybrid model's pair and this rank's engine and side (`None` for a uniform model).
fn hybrid_engine(
    cfg: &WorkerConfig,
) -> Option<(
    &crate::layouts::hybrid::HybridPairSpec,
    &crate::layouts::hybrid::HybridEngineSpec,
    crate::layouts::hybrid::geometry::Side,
)> {
    use crate::layouts::hybrid::geometry::Side;
    let h = cfg.hybrid.as_deref()?;
    Some(match cfg.role {
        crate::vocab::kinds::Role::Prefill => (h, &h.p, Side::Prefill),
        crate::vocab::kinds::Role::Decode => (h, &h.d, Side::Decode),
    })
}

/// A hybrid model's rank geometry as vLLM lays it out (`None` for a uniform model).
pub(super) fn hybrid_geometry(
    cfg: &WorkerConfig,
) -> Result<Option<crate::layouts::hybrid::geometry::EngineGeometry>, WorkerError> {
    use crate::layouts::hybrid::geometry::EngineGeometry;
    let Some((h, engine, side)) = hybrid_engine(cfg) else { return Ok(None) };
    EngineGeometry::new(&h.model, engine, side).map(Some).stage("the hybrid model's geometry")
}

/// With a host buffer (`--kv-buffer-device cpu`), a hybrid model's KV cache as vLLM lays it out
/// on the device (the geometry [`hybrid_geometry`] gives is the host buffer's: one tensor per
/// layer); `None` otherwise.
pub(super) fn hybrid_cache_geometry(
    cfg: &WorkerConfig,
) -> Result<Option<crate::layouts::hybrid::geometry::EngineGeometry>, WorkerError> {
    use crate::layouts::hybrid::geometry::{EngineGeometry, KvBufferDevice};
    let Some((h, engine, side)) = hybrid_engine(cfg) else { return Ok(None) };
    if engine.kv_buffer_device != KvBufferDevice::Cpu {
        return Ok(None);
    }
    let cache =
        crate::layouts::hybrid::HybridEngineSpec { kv_buffer_device: KvBufferDevice::Cuda, ..*engine };
    EngineGeometry::new(&h.model, &cache, side).map(Some).stage("the hybrid model's KV cache geometry")
}

/// The bytes a hybrid geometry's regions span.
pub(super) fn hybrid_span(g: &crate::layouts::hybrid::geometry::EngineGeometry) -> u64 {
    g.regions.iter().map(|r| r.base_off + r.num_blocks * r.block_stride).max().unwrap_or(0)
}

/// A rank's regions and the bytes its pool spans: a uniform model's from `geom`, a hybrid
/// model's from vLLM's layout (several layers' tensors aliased at one base, padded pages; no
/// `content`, as hybrid blocks are filled and checked by meaning, `layouts::hybrid::coverage`).
pub(super) fn rank_regions(
    geom: &crate::layouts::RankGeometry,
    hybrid: Option<&crate::layouts::hybrid::geometry::EngineGeometry>,
) -> (Vec<crate::layouts::Region>, u64) {
    let Some(g) = hybrid else { return (geom.regions(), geom.total_bytes()) };
    let regions = g
        .regions
        .iter()
        .map(|r| crate::layouts::Region {
            name: r.name.clone(),
            base_off: r.base_off,
            block_len: r.block_len,
            block_stride: r.block_stride,
            num_blocks: r.num_blocks,
            content: crate::layouts::geometry::BlockContent {
                layer: None,
                head: None,
                kv: None,
                axes: Vec::new(),
            },
        })
        .collect();
    (regions, hybrid_span(g))
}

/// Allocates the pool of a rank laid out as `regions` over `total` bytes (prefill and decode
/// alike). With a host buffer, `total` is the buffer's and `cache_total` the KV pool's (a
/// hybrid model's host buffer is laid out otherwise than its pool).
pub(super) fn rank_pool(
    cfg: &WorkerConfig,
    regions: Vec<crate::layouts::Region>,
    total: u64,
    cache_total: u64,
) -> Result<RankPool, WorkerError> {
    use crate::vocab::kinds::TransportKind;
    let total = usize::try_from(total).stage("pool size")?;
    let kind = cfg.transport.kind;
    let uses_ucx = !matches!(kind, TransportKind::Storage | TransportKind::CudaBatch | TransportKind::Nixl);
    let uses_storage = kind == TransportKind::Storage
        || kind == TransportKind::Multi && cfg.transport.chain.contains(&TransportKind::Storage);
    let pages = if cfg.transport.huge_pages {
        crate::transfer::memory::PageSize::Huge
    } else {
        crate::transfer::memory::PageSize::Normal
    };
    let staging = cfg.transport.kv_buffer == crate::vocab::kinds::KvBufferDevice::Cpu;
    let pool_bytes = if staging { usize::try_from(cache_total).stage("pool size")? } else { total };
    let mem = crate::transfer::memory::KvBuffer::alloc(cfg.mem, pool_bytes, pages)
        .stage(format!("allocate the {pool_bytes}-byte KV pool in {} memory", cfg.mem))?;
    if staging {
        // vLLM's host buffer: one host tensor per device tensor (a uniform model: the pool's
        // layout; a hybrid model: one per layer, where the pool aliases them).
        let host = crate::transfer::memory::KvBuffer::alloc(MemPlace::Host, total, pages)
            .stage(format!("allocate the {total}-byte host buffer"))?;
        return Ok(RankPool { regions, total, uses_ucx, uses_storage, mem: host, staged: Some(mem) });
    }
    Ok(RankPool { regions, total, uses_ucx, uses_storage, mem, staged: None })
}

/// The byte ranges of whole blocks `blocks` in every region (what vLLM's host-buffer copies
/// move: every layer of each block).
pub fn block_ranges(regions: &[crate::layouts::Region], blocks: &[u32]) -> Vec<std::ops::Range<u64>> {
    let mut out = Vec::with_capacity(regions.len() * blocks.len());
    for r in regions {
        out.extend(blocks.iter().map(|&b| {
            let off = r.base_off + u64::from(b) * r.block_stride;
            off..off + r.block_len
        }));
    }
    out
}

/// Source and destination ranges of a host buffer's copy.
pub(super) type Moves = (Vec<std::ops::Range<u64>>, Vec<std::ops::Range<u64>>);

/// `moves` as (from, to) ranges: KV cache to host buffer (`to_host`, prefill's save) or host
/// buffer to KV cache (decode's sync).
pub(super) fn split_moves(moves: &[crate::layouts::hybrid::staging::Move], to_host: bool) -> Moves {
    moves
        .iter()
        .map(|m| {
            let (cache, host) = (m.device..m.device + m.len, m.host..m.host + m.len);
            if to_host { (cache, host) } else { (host, cache) }
        })
        .unzip()
}
