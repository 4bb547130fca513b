//! An engine: the scheduling process of one prefill or decode engine, and its worker
//! processes (one per TP rank).
//!
//! Like vLLM's scheduler, the engine owns the block table (one pool shared by all ranks)
//! and, on the prefill side, the side-channel ROUTER that serves every rank's metadata.
//! Workers do the memory work: prefill ranks fill and hold blocks, decode ranks read,
//! verify and notify. The engine runs an event loop in its own thread; callers submit
//! requests and get a one-shot reply, so the same engine serves `kvx bench` (a driver
//! thread) and `kvx serve-engine` (async HTTP handlers).
//!
//! A worker that dies is noticed at once (its stderr pipe closes): requests waiting on it
//! fail with `PeerGone`, and the engine refuses new ones rather than hang.

pub mod pool;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::oneshot;
use tracing::{debug, warn};

use crate::config::engine::{EngineConfig, Launch, split_endpoint};
use crate::config::worker::{Fault, RankStart};
use crate::pipeline::engine::pool::BlockPool;
use crate::pipeline::params::KvTransferParams;
use crate::pipeline::wire::{self, FailureCause, FromWorker, LoadResult, PushStats, ReadyInfo, ToWorker};
use crate::topology::TransferMode;
use crate::transfer::handshake::server::{HandshakeServer, PayloadTable};
use crate::transfer::handshake::zmq_context;
use crate::vocab::kinds::{Role, TransportKind};

/// How long workers get to come up (allocate, register, bind) before the engine gives up.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a worker's goodbye may trail its exit before shutdown stops waiting for it.
const BYE_GRACE: Duration = Duration::from_millis(300);

/// Why an engine operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("{engine} engine: {what}")]
    Startup { engine: String, what: String },
    #[error("{role} rank {rank} is gone ({why}); requests that need it fail")]
    RankGone { role: &'static str, rank: u32, why: String },
    #[error("request {req}: no answer from {role} rank(s) {ranks:?} within {timeout:?}")]
    Timeout { req: u64, role: &'static str, ranks: Vec<u32>, timeout: Duration },
    #[error("request {req} needs {needed} blocks but the pool has only {capacity}; raise --pool-blocks")]
    TooLarge { req: u64, needed: u32, capacity: u32 },
    #[error("request {req}: {msg}")]
    Rejected { req: u64, msg: String },
    #[error("the engine has shut down")]
    Closed,
    #[error("{engine} engine: interrupted while its workers were starting")]
    Interrupted { engine: &'static str },
}

impl EngineError {
    pub fn cause(&self) -> FailureCause {
        match self {
            EngineError::RankGone { .. } => FailureCause::PeerGone,
            EngineError::Timeout { .. } => FailureCause::Timeout,
            _ => FailureCause::Internal,
        }
    }
}

/// What callers learn about a running engine.
#[derive(Debug, Clone, Serialize)]
pub struct EngineInfo {
    pub engine_id: String,
    pub role: Role,
    pub tp: u32,
    pub side_channel_host: String,
    pub side_channel_port: u16,
    pub ucx_library: String,
    pub ucx_version: String,
    pub pool_blocks: u32,
    pub pool_bytes_per_rank: u64,
    pub worker_rss_bytes: Vec<u64>,
    /// A hybrid model: how this engine's requests take blocks (per group, from one pool).
    #[serde(skip)]
    pub hybrid: Option<crate::layouts::hybrid::blocks::RequestShape>,
}

/// How an engine of `role` of a hybrid pair lays a request's blocks out.
pub fn request_shape(
    config: &crate::layouts::hybrid::HybridPairSpec,
    role: Role,
) -> Result<crate::layouts::hybrid::blocks::RequestShape, crate::layouts::hybrid::HybridError> {
    use crate::layouts::hybrid::geometry::{EngineGeometry, Side};
    let (engine, side) = match role {
        Role::Prefill => (&config.p, Side::Prefill),
        Role::Decode => (&config.d, Side::Decode),
    };
    Ok(crate::layouts::hybrid::blocks::RequestShape::of(&EngineGeometry::new(&config.model, engine, side)?))
}

impl EngineInfo {
    /// Blocks a request of `tokens` prompt tokens takes on this engine when its first
    /// `hit_blocks` blocks are already held (a hybrid model: one per group and position).
    pub fn request_blocks(&self, tokens: u32, block_tokens: u32, hit_blocks: u32) -> u32 {
        match &self.hybrid {
            Some(shape) => shape.blocks(tokens, hit_blocks),
            None => tokens.div_ceil(block_tokens.max(1)).saturating_sub(hit_blocks),
        }
    }

    /// Tokens of a `tokens`-token prompt a prefill engine computes (vLLM's
    /// `num_computed_tokens`): with state, all but the last (the backoff); else all.
    pub fn computed_tokens(&self, tokens: u32) -> u32 {
        match &self.hybrid {
            Some(shape) => shape.tokens(tokens, 0).p_computed_tokens,
            None => tokens,
        }
    }

    /// The `kv_transfer_params` a prefill engine answers a request with: where its blocks
    /// are (`blocks`) and who it is. A push-mode decode leg sent before prefill answered (the
    /// concurrent dispatch) needs only the identity: `blocks` empty.
    pub fn kv_params(
        &self,
        p_request_id: &str,
        tokens: u32,
        blocks: &[u32],
        mode: TransferMode,
    ) -> KvTransferParams {
        // A hybrid model: each group's list, clipped as vLLM's scheduler sends it (a window's
        // tail, the last state slot).
        let remote_block_ids = match &self.hybrid {
            Some(shape) if !blocks.is_empty() => shape
                .lists(tokens, 0, blocks)
                .and_then(|raw| {
                    crate::layouts::hybrid::blocks::clip_for_exchange(
                        &shape.groups,
                        shape.block_tokens,
                        &raw,
                        true,
                    )
                    .ok()
                })
                .unwrap_or_default()
                .into_iter()
                .map(|l| l.into_iter().map(u64::from).collect())
                .collect(),
            _ => vec![blocks.iter().map(|&b| u64::from(b)).collect()],
        };
        KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids,
            remote_engine_id: self.engine_id.clone(),
            remote_request_id: p_request_id.to_string(),
            remote_host: self.side_channel_host.clone(),
            remote_port: self.side_channel_port,
            tp_size: self.tp,
            dcp_size: 1,
            pp_size: 1,
            // What prefill computed (vLLM's `num_computed_tokens`): with state, one short of
            // the prompt (the backoff).
            remote_num_tokens: u64::from(self.computed_tokens(tokens)),
            remote_blocks_expiry_time: None,
            remote_registration_generation: 0,
            transfer_mode: mode,
        }
    }
}

/// The prefill side's answer: the blocks are filled and held.
#[derive(Debug, Clone)]
pub struct PrefillDone {
    pub params: KvTransferParams,
    /// Slowest rank's fill time (excluded from transfer time).
    pub fill_ns: u64,
    /// Slowest rank's storage publish time (storage transport; 0 otherwise).
    pub publish_ns: u64,
    /// Slowest rank's copy to its host buffer (`--kv-buffer-device cpu`; 0 otherwise).
    pub save_ns: u64,
}

/// The decode side's answer: one result per decode rank.
#[derive(Debug, Clone)]
pub struct LoadDone {
    pub ranks: Vec<LoadResult>,
    pub local_blocks: u32,
}

/// An engine's final accounting.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineFinal {
    /// Blocks still allocated at shutdown (should be 0).
    pub blocks_leaked: u32,
    /// Requests whose blocks were freed because their lease ran out.
    pub leases_expired: u64,
    /// When each of those leases ran out (the charts over time mark them).
    #[serde(skip)]
    pub lease_expired_at: Vec<Instant>,
    /// Blocks held by ranks that died, written off.
    pub blocks_lost_with_dead_ranks: u32,
    pub unrecognized_notifs: u64,
    pub dead_ranks: Vec<u32>,
    pub worker_rss_bytes: Vec<u64>,
    /// Push mode, prefill engine: each rank's WRITE of each request, as it reported it.
    pub pushes: Vec<PushRecord>,
    /// Push mode, prefill engine: what UCX chose for the WRITEs, as the first rank that
    /// wrote reported it.
    pub push_ucx: Option<crate::pipeline::wire::UcxChoices>,
}

/// One prefill rank's WRITE of one request (push mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PushRecord {
    pub req: u64,
    pub rank: u32,
    pub stats: PushStats,
    pub compute_ns: u64,
    pub error: Option<(FailureCause, String)>,
}

/// What an engine holds right now, published by its loop after every round so callers
/// (`kvx serve-engine`'s `/metrics`) can read it without a round trip.
#[derive(Debug, Default)]
pub struct EngineLive {
    blocks_in_use: AtomicU32,
    requests_held: AtomicU32,
    backlog: AtomicU32,
    leases_expired: AtomicU64,
    unrecognized_notifs: AtomicU64,
}

/// A snapshot of [`EngineLive`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveCounts {
    /// Blocks allocated from the pool (held for a reader, filling, or being loaded into).
    pub blocks_in_use: u32,
    /// Prefill: requests whose blocks wait for notifications or their lease.
    pub requests_held: u32,
    /// Requests waiting for free blocks.
    pub backlog: u32,
    /// Rank leases that ran out before their notifications arrived.
    pub leases_expired: u64,
    /// Notifications for requests no rank held (vLLM logs "Potentially invalid KV blocks for
    /// unrecognized request"), and NIXL messages that were not vLLM's.
    pub unrecognized_notifs: u64,
}

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

enum Cmd {
    Prefill {
        req: u64,
        p_request_id: String,
        tokens: u32,
        seed: u64,
        expected_notifs: u32,
        reply: Reply<PrefillDone>,
    },
    Load {
        req: u64,
        d_request_id: String,
        params: Box<KvTransferParams>,
        local_blocks: u32,
        seed: u64,
        reply: Reply<LoadDone>,
    },
    PeerGone {
        engine_id: String,
    },
    Release {
        p_request_id: String,
    },
    Fault {
        rank: u32,
        fault: Fault,
    },
}

/// A running engine. Dropping it shuts the workers down.
pub struct Engine {
    info: EngineInfo,
    live: Arc<EngineLive>,
    tx: Option<mpsc::Sender<Cmd>>,
    bell: UnixStream,
    thread: Option<JoinHandle<EngineFinal>>,
    gone: Gone,
}

/// The first rank death an engine saw, shared with callers so they can fail a request
/// before starting it (an engine with a dead rank cannot serve any request).
type Gone = std::sync::Arc<std::sync::Mutex<Option<EngineError>>>;

impl Engine {
    /// Starts the workers and waits until every rank is ready.
    pub fn start(cfg: EngineConfig) -> Result<Engine, EngineError> {
        if cfg.mem.len() != cfg.tp as usize {
            return Err(startup(
                &cfg,
                format!("{} memory placements for {} ranks (one per rank is needed)", cfg.mem.len(), cfg.tp),
            ));
        }
        let (tx, rx) = mpsc::channel();
        let (bell, bell_rx) = UnixStream::pair().map_err(|e| startup(&cfg, format!("socketpair: {e}")))?;
        bell_rx.set_nonblocking(true).map_err(|e| startup(&cfg, format!("socketpair: {e}")))?;
        let (info_tx, info_rx) = mpsc::channel();
        let gone = Gone::default();
        let loop_gone = gone.clone();
        let live = Arc::new(EngineLive::default());
        let loop_live = live.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvx-{}-engine", cfg.worker.role.as_str()))
            .spawn(move || {
                let mut lp = match EngineLoop::start(cfg, bell_rx, loop_gone, loop_live) {
                    Ok(lp) => lp,
                    Err(e) => {
                        let _ = info_tx.send(Err(e));
                        return EngineFinal::default();
                    }
                };
                let _ = info_tx.send(Ok(lp.info.clone()));
                lp.run(&rx);
                lp.shutdown()
            })
            .map_err(|e| EngineError::Startup {
                engine: "engine".into(),
                what: format!("cannot spawn thread: {e}"),
            })?;
        match info_rx.recv() {
            Ok(Ok(info)) => Ok(Engine { info, live, tx: Some(tx), bell, thread: Some(thread), gone }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(EngineError::Closed),
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Blocks and requests the engine holds now (as of its loop's last round).
    pub fn live(&self) -> LiveCounts {
        let l = &self.live;
        LiveCounts {
            blocks_in_use: l.blocks_in_use.load(Ordering::Relaxed),
            requests_held: l.requests_held.load(Ordering::Relaxed),
            backlog: l.backlog.load(Ordering::Relaxed),
            leases_expired: l.leases_expired.load(Ordering::Relaxed),
            unrecognized_notifs: l.unrecognized_notifs.load(Ordering::Relaxed),
        }
    }

    /// Why the engine cannot serve any more (a rank is gone), if so.
    pub fn gone(&self) -> Option<EngineError> {
        self.gone.lock().ok().and_then(|g| g.clone())
    }

    fn send(&self, cmd: Cmd) -> bool {
        let ok = self.tx.as_ref().is_some_and(|tx| tx.send(cmd).is_ok());
        // Wake the loop; a full socket buffer already means it has wake-ups pending.
        let _ = (&self.bell).write(&[1]);
        ok
    }

    /// Prefill role: allocate, fill and hold blocks for `tokens` tokens until each rank has
    /// `expected_notifs` notifications (0: the count the first notification names, for
    /// when the decode side's TP is not known in advance) or its lease runs out.
    pub fn prefill(
        &self,
        req: u64,
        p_request_id: String,
        tokens: u32,
        seed: u64,
        expected_notifs: u32,
    ) -> oneshot::Receiver<Result<PrefillDone, EngineError>> {
        let (reply, rx) = oneshot::channel();
        let cmd = Cmd::Prefill { req, p_request_id, tokens, seed, expected_notifs, reply };
        if let Err(Cmd::Prefill { reply, .. }) = self.try_send(cmd) {
            let _ = reply.send(Err(EngineError::Closed));
        }
        rx
    }

    /// Decode role: pull the blocks `params` describes into `local_blocks` new blocks.
    pub fn load(
        &self,
        req: u64,
        d_request_id: String,
        params: KvTransferParams,
        local_blocks: u32,
        seed: u64,
    ) -> oneshot::Receiver<Result<LoadDone, EngineError>> {
        let (reply, rx) = oneshot::channel();
        let cmd = Cmd::Load { req, d_request_id, params: Box::new(params), local_blocks, seed, reply };
        if let Err(Cmd::Load { reply, .. }) = self.try_send(cmd) {
            let _ = reply.send(Err(EngineError::Closed));
        }
        rx
    }

    /// Prefill role: no decode engine will read this request's blocks (the serving path's
    /// decode leg failed, or its client left before the handoff). They are freed now rather
    /// than at lease expiry, and a fill still waiting for free blocks is dropped. Unknown ids
    /// are ignored. Decode role (push mode): the prefill of this request failed; a decode rank
    /// waiting for its WRITEs (or about to) stops.
    pub fn release(&self, p_request_id: String) {
        let _ = self.send(Cmd::Release { p_request_id });
    }

    /// Decode role (push mode): a rank of prefill engine `engine_id` is gone; ranks waiting
    /// for its WRITEs stop waiting.
    pub fn peer_gone(&self, engine_id: String) {
        let _ = self.send(Cmd::PeerGone { engine_id });
    }

    /// Injects a fault into one rank (resilience tests).
    pub fn inject(&self, rank: u32, fault: Fault) {
        let _ = self.send(Cmd::Fault { rank, fault });
    }

    fn try_send(&self, cmd: Cmd) -> Result<(), Cmd> {
        match &self.tx {
            Some(tx) => {
                let r = tx.send(cmd).map_err(|e| e.0);
                let _ = (&self.bell).write(&[1]);
                r
            }
            None => Err(cmd),
        }
    }

    /// Stops the workers and returns the final accounting.
    pub fn shutdown(mut self) -> EngineFinal {
        self.stop()
    }

    fn stop(&mut self) -> EngineFinal {
        self.tx = None;
        let _ = (&self.bell).write(&[1]);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.stop();
        }
    }
}

fn startup(cfg: &EngineConfig, what: String) -> EngineError {
    EngineError::Startup { engine: cfg.worker.role.as_str().to_string(), what }
}

/// A worker as the engine sees it.
struct Rank {
    identity: Option<Vec<u8>>,
    child: Option<Child>,
    stderr: Option<ChildStderr>,
    stderr_buf: Vec<u8>,
    ready: Option<ReadyInfo>,
    dead: Option<String>,
    /// Said goodbye (and reported its peak memory) on shutdown.
    bye: bool,
    /// The local process has exited (and was reaped).
    exited: bool,
    /// When it was seen to exit: its goodbye, if it is still in flight, gets a short grace.
    exited_at: Option<Instant>,
    last_seen: Instant,
}

struct PendingPrefill {
    p_request_id: String,
    tokens: u32,
    blocks: Vec<u32>,
    waiting: BTreeSet<u32>,
    /// Ranks that already released the blocks (lease shorter than the engine's deadline).
    freed: BTreeSet<u32>,
    fill_ns: u64,
    publish_ns: u64,
    save_ns: u64,
    deadline: Instant,
    reply: Reply<PrefillDone>,
}

struct PendingLoad {
    blocks: Vec<u32>,
    waiting: BTreeSet<u32>,
    results: Vec<LoadResult>,
    deadline: Instant,
    reply: Reply<LoadDone>,
}

struct EngineLoop {
    cfg: EngineConfig,
    info: EngineInfo,
    ctl: zmq::Socket,
    bell: UnixStream,
    ranks: Vec<Rank>,
    pool: BlockPool,
    handshake: Option<HandshakeServer>,
    /// Commands waiting for free blocks, in arrival order.
    backlog: VecDeque<Cmd>,
    prefills: HashMap<u64, PendingPrefill>,
    loads: HashMap<u64, PendingLoad>,
    /// Decode, ranks starting together: the load its ranks work on now, and the loads sent
    /// to them but held until it is done, in the order they came.
    stepping: Option<u64>,
    held_loads: VecDeque<u64>,
    /// Prefill: requests held, with the ranks that have not freed them yet.
    held: HashMap<u64, (Vec<u32>, BTreeSet<u32>)>,
    fin: EngineFinal,
    /// Shutdown was requested: workers exiting now are expected to.
    shutting_down: bool,
    live: Arc<EngineLive>,
    _tmp: Option<tempfile::TempDir>,
    gone: Gone,
}

/// The environment that makes a worker's UCX record the protocols it selects as files
/// under `dir` (UCX reports them through its own settings only, read when it loads). The
/// tables UCX prints alongside go to the worker's stdout, which is discarded. Nothing when the
/// user set UCX's switches: their settings stand, and the worker reads what they produce.
fn protocol_capture_env(dir: &std::path::Path) -> Vec<(String, String)> {
    match crate::transfer::ucx::proto_capture_env(dir) {
        Ok(env) => env.into_iter().filter(|(k, _)| k != crate::transfer::ucx::LOG_FILE_ENV).collect(),
        Err(why) => {
            debug!("UCX protocols not recorded by kvx: {why}");
            Vec::new()
        }
    }
}

/// An engine's temp directory (its control socket) is `kvx-engine-<pid>-XXXXXX` in the
/// temp dir; a run killed before it could clean up leaves one behind.
const ENGINE_DIR_PREFIX: &str = "kvx-engine-";

/// Removes the engine directories in `tmp` whose owner process is gone (a killed run's), so
/// killed runs do not pile up in `/tmp`. Directories of live processes, of other users and
/// of other names are left alone; a failure to remove one is only logged.
fn remove_stale_engine_dirs(tmp: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(ENGINE_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || std::path::Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        match std::fs::remove_dir_all(e.path()) {
            Ok(()) => tracing::debug!("removed {} (its process {pid} is gone)", e.path().display()),
            Err(err) => tracing::debug!("cannot remove stale {}: {err}", e.path().display()),
        }
    }
}

impl EngineLoop {
    fn start(
        cfg: EngineConfig,
        bell: UnixStream,
        gone: Gone,
        live: Arc<EngineLive>,
    ) -> Result<Self, EngineError> {
        let ctx = zmq_context();
        let ctl = ctx.socket(zmq::ROUTER).map_err(|e| startup(&cfg, format!("control socket: {e}")))?;
        let _ = ctl.set_linger(0);
        let _ = ctl.set_router_mandatory(true);
        let (bind, tmp) = match &cfg.launch {
            Launch::Spawn { .. } => {
                let tmp = std::env::temp_dir();
                remove_stale_engine_dirs(&tmp);
                let dir = tempfile::Builder::new()
                    .prefix(&format!("{ENGINE_DIR_PREFIX}{}-", std::process::id()))
                    .tempdir_in(&tmp)
                    .map_err(|e| startup(&cfg, format!("temp dir: {e}")))?;
                (format!("ipc://{}/ctl", dir.path().display()), Some(dir))
            }
            Launch::External { bind } => (bind.clone(), None),
        };
        ctl.bind(&bind)
            .map_err(|e| startup(&cfg, format!("cannot bind the control socket at {bind}: {e}")))?;
        let endpoint = ctl.get_last_endpoint().ok().and_then(Result::ok).unwrap_or(bind);
        let role = cfg.worker.role;
        if matches!(cfg.launch, Launch::External { .. }) {
            // The one place the bound port shows when --listen asked for port 0.
            crate::output::note!(
                "kvx: {} engine waiting for {} worker(s): kvx worker --connect {endpoint} --role {}",
                role.as_str(),
                cfg.tp,
                role.as_str()
            );
        }
        let mut ranks: Vec<Rank> = (0..cfg.tp)
            .map(|_| Rank {
                identity: None,
                child: None,
                stderr: None,
                stderr_buf: Vec::new(),
                ready: None,
                dead: None,
                bye: false,
                exited: false,
                exited_at: None,
                last_seen: Instant::now(),
            })
            .collect();
        if let Launch::Spawn { exe, env } = &cfg.launch {
            for (r, rank) in ranks.iter_mut().enumerate() {
                let mut cmd = Command::new(exe);
                cmd.arg("worker")
                    .args(["--connect", &endpoint, "--role", role.as_str(), "--rank", &r.to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
                // The ranks whose one-sided operations move KV: decode's GETs, or in push mode
                // prefill's PUTs.
                let moves_kv = match cfg.worker.transport.mode {
                    TransferMode::Pull => role == Role::Decode,
                    TransferMode::Push => role == Role::Prefill,
                };
                if let (Some(dir), true) =
                    (&tmp, moves_kv && cfg.worker.transport.kind != TransportKind::Storage)
                {
                    cmd.envs(protocol_capture_env(&dir.path().join(format!("ucx-{r}"))));
                }
                let mut child = cmd
                    .spawn()
                    .map_err(|e| startup(&cfg, format!("cannot start {} worker: {e}", exe.display())))?;
                if let Some(err) = child.stderr.take() {
                    set_nonblocking(&err);
                    rank.stderr = Some(err);
                }
                rank.child = Some(child);
            }
        }
        let mut pool = BlockPool::new(cfg.pool_blocks, cfg.alloc, cfg.seed);
        let hybrid = cfg
            .worker
            .hybrid
            .as_deref()
            .map(|h| request_shape(h, role))
            .transpose()
            .map_err(|e| startup(&cfg, format!("the hybrid model's geometry: {e}")))?;
        if hybrid.is_some() {
            pool = pool.reserving_null();
        }
        let info = EngineInfo {
            hybrid,
            engine_id: cfg.worker.engine_id.clone(),
            role,
            tp: cfg.tp,
            side_channel_host: String::new(),
            side_channel_port: 0,
            ucx_library: String::new(),
            ucx_version: String::new(),
            pool_blocks: cfg.pool_blocks,
            pool_bytes_per_rank: 0,
            worker_rss_bytes: vec![],
        };
        let mut lp = EngineLoop {
            cfg,
            info,
            ctl,
            bell,
            ranks,
            pool,
            handshake: None,
            backlog: VecDeque::new(),
            prefills: HashMap::new(),
            loads: HashMap::new(),
            stepping: None,
            held_loads: VecDeque::new(),
            held: HashMap::new(),
            fin: EngineFinal::default(),
            shutting_down: false,
            live,
            _tmp: tmp,
            gone,
        };
        lp.wait_ready()?;
        Ok(lp)
    }

    fn role_str(&self) -> &'static str {
        self.cfg.worker.role.as_str()
    }

    /// Handshakes every worker (Hello -> Init -> Ready) and starts the side channel.
    fn wait_ready(&mut self) -> Result<(), EngineError> {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while self.ranks.iter().any(|r| r.ready.is_none()) {
            if crate::interrupt::requested().is_some() {
                self.kill_workers();
                return Err(EngineError::Interrupted { engine: self.role_str() });
            }
            if let Some((r, why)) =
                self.ranks.iter().enumerate().find_map(|(i, r)| r.dead.clone().map(|d| (i, d)))
            {
                return Err(startup(
                    &self.cfg,
                    format!("{} rank {r} died while starting: {why}", self.role_str()),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = self
                    .ranks
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.ready.is_none())
                    .map(|(i, _)| i)
                    .collect();
                return Err(startup(
                    &self.cfg,
                    format!(
                        "ranks {missing:?} were not ready after {STARTUP_TIMEOUT:?} (see their errors above)"
                    ),
                ));
            }
            self.poll_once(Duration::from_millis(50));
        }
        if let Some(bind) = self.cfg.side_channel_bind.clone() {
            let table = PayloadTable::new();
            for (r, rank) in self.ranks.iter().enumerate() {
                if let Some(p) = rank.ready.as_ref().and_then(|i| i.handshake_payload.clone()) {
                    table.publish(0, r as u32, p);
                }
            }
            let server = HandshakeServer::start(&bind, table)
                .map_err(|e| startup(&self.cfg, format!("side channel at {bind}: {e}")))?;
            let (host, port) = split_endpoint(server.endpoint());
            self.info.side_channel_host =
                if host == "0.0.0.0" || host == "*" { self.cfg.worker.advertise_host.clone() } else { host };
            self.info.side_channel_port = port;
            self.handshake = Some(server);
        }
        if let Some(first) = self.ranks.first().and_then(|r| r.ready.as_ref()) {
            self.info.ucx_library = first.ucx_library.clone();
            self.info.ucx_version = first.ucx_version.clone();
            self.info.pool_bytes_per_rank = first.pool_bytes;
        }
        self.info.worker_rss_bytes =
            self.ranks.iter().map(|r| r.ready.as_ref().map_or(0, |i| i.rss_bytes)).collect();
        Ok(())
    }

    fn run(&mut self, rx: &mpsc::Receiver<Cmd>) {
        let mut open = true;
        while open || !self.prefills.is_empty() || !self.loads.is_empty() {
            // An interrupted run stops waiting for what its workers still have in flight (the
            // callers gave up on it); shutdown tears the workers down.
            if !open && crate::interrupt::requested().is_some() {
                break;
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.submit(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            let wait = self.next_deadline().map_or(Duration::from_millis(100), |d| {
                d.saturating_duration_since(Instant::now()).min(Duration::from_millis(100))
            });
            self.poll_once(wait);
            self.expire_deadlines();
            self.check_silent();
            self.next_step();
            self.publish_live();
        }
    }

    /// Workers started elsewhere have no stderr pipe whose closing says they died; one that
    /// stopped saying it is alive for longer than any request may take is declared gone.
    fn check_silent(&mut self) {
        let silence = (self.cfg.timeout * 2).max(wire::ALIVE_EVERY * 3);
        let silent: Vec<u32> = (0..self.cfg.tp)
            .filter(|&r| {
                let rank = &self.ranks[r as usize];
                rank.child.is_none()
                    && rank.ready.is_some()
                    && rank.dead.is_none()
                    && !self.shutting_down
                    && rank.last_seen.elapsed() > silence
            })
            .collect();
        for r in silent {
            self.rank_died(r, format!("not heard from for {silence:?}"));
        }
    }

    fn publish_live(&self) {
        let l = &self.live;
        l.blocks_in_use.store(self.pool.in_use(), Ordering::Relaxed);
        l.requests_held.store(self.held.len() as u32, Ordering::Relaxed);
        l.backlog.store(self.backlog.len() as u32, Ordering::Relaxed);
        l.leases_expired.store(self.fin.leases_expired, Ordering::Relaxed);
        l.unrecognized_notifs.store(self.fin.unrecognized_notifs, Ordering::Relaxed);
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.prefills.values().map(|p| p.deadline).chain(self.loads.values().map(|l| l.deadline)).min()
    }

    /// One round of waiting: worker messages, stderr of local workers, the caller's bell.
    fn poll_once(&mut self, timeout: Duration) {
        let mut items = vec![
            self.ctl.as_poll_item(zmq::POLLIN),
            zmq::PollItem::from_fd(self.bell.as_raw_fd(), zmq::POLLIN),
        ];
        let stderr_ranks: Vec<usize> =
            self.ranks.iter().enumerate().filter(|(_, r)| r.stderr.is_some()).map(|(i, _)| i).collect();
        for &i in &stderr_ranks {
            if let Some(fd) = self.ranks[i].stderr.as_ref().map(AsRawFd::as_raw_fd) {
                items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
            }
        }
        let ms = i64::try_from(timeout.as_millis()).unwrap_or(100).max(if timeout.is_zero() { 0 } else { 1 });
        if zmq::poll(&mut items, ms).is_err() {
            return;
        }
        let ctl_ready = items[0].is_readable();
        let bell_ready = items[1].is_readable();
        // A pipe at EOF reports POLLHUP without POLLIN: any event means "go and read it".
        let stderr_ready: Vec<usize> = stderr_ranks
            .iter()
            .enumerate()
            .filter(|(k, _)| !items[k + 2].get_revents().is_empty())
            .map(|(_, &i)| i)
            .collect();
        drop(items);
        if bell_ready {
            let mut buf = [0u8; 256];
            while matches!((&self.bell).read(&mut buf), Ok(n) if n > 0) {}
        }
        // Messages first: a worker's goodbye often arrives in the same round as its exit.
        if ctl_ready {
            while let Ok(frames) = self.ctl.recv_multipart(zmq::DONTWAIT) {
                if let [identity, body] = frames.as_slice() {
                    self.on_message(identity, body);
                }
            }
        }
        for i in stderr_ready {
            self.drain_stderr(i);
        }
    }

    fn drain_stderr(&mut self, i: usize) {
        let prefix = format!("[{}{i}] ", self.cfg.worker.role.letter());
        let rank = &mut self.ranks[i];
        let mut buf = [0u8; 8192];
        let mut eof = false;
        if let Some(err) = rank.stderr.as_mut() {
            loop {
                match err.read(&mut buf) {
                    Ok(0) => {
                        eof = true;
                        break;
                    }
                    Ok(n) => rank.stderr_buf.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(_) => {
                        eof = true;
                        break;
                    }
                }
            }
        }
        while let Some(pos) = rank.stderr_buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = rank.stderr_buf.drain(..=pos).collect();
            crate::output::stderr_bytes(&[prefix.as_bytes(), &line].concat());
        }
        if eof {
            rank.stderr = None;
            let status = rank.child.as_mut().and_then(|c| c.wait().ok());
            rank.exited = true;
            rank.exited_at = Some(Instant::now());
            // A clean exit after the engine asked for it is a shutdown, not a death.
            if self.shutting_down && status.is_some_and(|s| s.success()) {
                return;
            }
            let why = match status {
                Some(s) if s.success() => "exited".to_string(),
                Some(s) => format!("exited with {s}"),
                None => "its output closed".to_string(),
            };
            self.rank_died(i as u32, why);
        }
    }

    fn rank_died(&mut self, rank: u32, why: String) {
        let role = self.role_str();
        let Some(r) = self.ranks.get_mut(rank as usize) else { return };
        if r.dead.is_some() {
            return;
        }
        warn!("{role} rank {rank} is gone: {why}");
        r.dead = Some(why.clone());
        self.fin.dead_ranks.push(rank);
        let err = EngineError::RankGone { role, rank, why };
        if let Ok(mut g) = self.gone.lock() {
            g.get_or_insert_with(|| err.clone());
        }
        let failed: Vec<u64> =
            self.prefills.iter().filter(|(_, p)| p.waiting.contains(&rank)).map(|(&k, _)| k).collect();
        for req in failed {
            if let Some(p) = self.prefills.remove(&req) {
                let _ = p.reply.send(Err(err.clone()));
                self.hold_or_free(req, p.blocks, &p.freed);
            }
        }
        let failed: Vec<u64> =
            self.loads.iter().filter(|(_, l)| l.waiting.contains(&rank)).map(|(&k, _)| k).collect();
        for req in failed {
            if let Some(l) = self.loads.remove(&req) {
                self.pool.free(&l.blocks);
                let _ = l.reply.send(Err(err.clone()));
            }
        }
        // Blocks the dead rank held can never be freed by it: write them off for that rank.
        let held: Vec<u64> = self.held.keys().copied().collect();
        for req in held {
            self.freed_by(req, rank, false, true);
        }
    }

    /// Blocks sent to prefill ranks stay allocated until every live rank has freed them
    /// (notifications or lease); a dead rank never will, so it is not waited for.
    fn hold_or_free(&mut self, req: u64, blocks: Vec<u32>, freed: &BTreeSet<u32>) {
        let live: BTreeSet<u32> = (0..self.cfg.tp)
            .filter(|&r| self.ranks[r as usize].dead.is_none() && !freed.contains(&r))
            .collect();
        if live.is_empty() {
            self.pool.free(&blocks);
        } else {
            self.held.insert(req, (blocks, live));
        }
    }

    fn freed_by(&mut self, req: u64, rank: u32, expired: bool, dead: bool) {
        let Some((_, waiting)) = self.held.get_mut(&req) else { return };
        if !waiting.remove(&rank) {
            return;
        }
        if expired {
            self.fin.leases_expired += 1;
            self.fin.lease_expired_at.push(Instant::now());
        }
        if waiting.is_empty()
            && let Some((blocks, _)) = self.held.remove(&req)
        {
            if dead {
                self.fin.blocks_lost_with_dead_ranks += blocks.len() as u32;
            }
            self.pool.free(&blocks);
            self.drain_backlog();
        }
    }

    fn send_to(&mut self, rank: u32, msg: &ToWorker) -> bool {
        let Some(r) = self.ranks.get(rank as usize) else { return false };
        let Some(id) = r.identity.clone() else { return false };
        let body = wire::encode(msg);
        self.ctl.send_multipart([id.as_slice(), body.as_slice()], 0).is_ok()
    }

    fn on_message(&mut self, identity: &[u8], body: &[u8]) {
        let msg: FromWorker = match wire::decode(body) {
            Ok(m) => m,
            Err(e) => {
                warn!("{} engine: dropping a message from a worker: {e}", self.role_str());
                return;
            }
        };
        let rank_of = |ranks: &[Rank]| ranks.iter().position(|r| r.identity.as_deref() == Some(identity));
        if let Some(i) = rank_of(&self.ranks) {
            self.ranks[i].last_seen = Instant::now();
        }
        match msg {
            FromWorker::Hello { role, rank, pid, host } => {
                if role != self.cfg.worker.role {
                    warn!(
                        "a {} worker (pid {pid} on {host}) connected to the {} engine; ignored",
                        role.as_str(),
                        self.role_str()
                    );
                    return;
                }
                let slot =
                    rank.map(|r| r as usize).or_else(|| self.ranks.iter().position(|r| r.identity.is_none()));
                let Some(slot) = slot.filter(|&s| s < self.ranks.len()) else {
                    warn!("{} engine: no free rank for worker pid {pid} on {host}", self.role_str());
                    return;
                };
                self.ranks[slot].identity = Some(identity.to_vec());
                self.ranks[slot].last_seen = Instant::now();
                let mut cfg = self.cfg.worker.clone();
                cfg.rank = slot as u32;
                cfg.mem = self.cfg.mem.get(slot).copied().unwrap_or_default();
                self.send_to(slot as u32, &ToWorker::Init(Box::new(cfg)));
            }
            FromWorker::Ready(info) => {
                if let Some(i) = rank_of(&self.ranks) {
                    debug!("{} rank {i} ready", self.role_str());
                    self.ranks[i].ready = Some(*info);
                }
            }
            FromWorker::Filled { req, fill_ns, publish_ns, save_ns } => {
                let Some(rank) = rank_of(&self.ranks) else { return };
                let done = match self.prefills.get_mut(&req) {
                    Some(p) => {
                        p.waiting.remove(&(rank as u32));
                        p.fill_ns = p.fill_ns.max(fill_ns);
                        p.publish_ns = p.publish_ns.max(publish_ns);
                        p.save_ns = p.save_ns.max(save_ns);
                        p.waiting.is_empty()
                    }
                    None => false,
                };
                if done && let Some(p) = self.prefills.remove(&req) {
                    let params = self.params_for(&p);
                    self.hold_or_free(req, p.blocks, &p.freed);
                    // Published before the reply: a caller that answers its client and is then
                    // asked for its held blocks must see this request's (the loop may not reach
                    // the end of its round before that scrape).
                    self.publish_live();
                    let _ = p.reply.send(Ok(PrefillDone {
                        params,
                        fill_ns: p.fill_ns,
                        publish_ns: p.publish_ns,
                        save_ns: p.save_ns,
                    }));
                }
            }
            FromWorker::Freed { req, expired } => {
                if let Some(rank) = rank_of(&self.ranks) {
                    // Not held yet: the request is still waiting for other ranks' fills.
                    if let Some(p) = self.prefills.get_mut(&req) {
                        p.freed.insert(rank as u32);
                        if expired {
                            self.fin.leases_expired += 1;
                            self.fin.lease_expired_at.push(Instant::now());
                        }
                    }
                    self.freed_by(req, rank as u32, expired, false);
                }
            }
            FromWorker::Loaded(res) => {
                let Some(rank) = rank_of(&self.ranks) else { return };
                let req = res.req;
                let done = match self.loads.get_mut(&req) {
                    Some(l) => {
                        l.waiting.remove(&(rank as u32));
                        l.results.push(*res);
                        l.waiting.is_empty()
                    }
                    None => false,
                };
                if done && let Some(mut l) = self.loads.remove(&req) {
                    // The next request's ranks start at once, before anything else is done.
                    self.next_step();
                    self.pool.free(&l.blocks);
                    l.results.sort_by_key(|r| r.d_rank);
                    let n = l.blocks.len() as u32;
                    self.drain_backlog();
                    self.publish_live();
                    let _ = l.reply.send(Ok(LoadDone { ranks: l.results, local_blocks: n }));
                }
            }
            FromWorker::Unrecognized { count } => self.fin.unrecognized_notifs += count,
            FromWorker::Alive => {}
            FromWorker::Pushed { req, stats, compute_ns, error, ucx } => {
                if self.fin.push_ucx.is_none() {
                    self.fin.push_ucx = ucx.map(|u| *u);
                }
                if let Some(i) = rank_of(&self.ranks) {
                    if let Some((cause, why)) = &error {
                        warn!(
                            "request {req}: prefill rank {i} could not write it ({}): {why}",
                            cause.as_str()
                        );
                    }
                    self.fin.pushes.push(PushRecord { req, rank: i as u32, stats, compute_ns, error });
                }
            }
            FromWorker::Republish { payload } => {
                let Some(i) = rank_of(&self.ranks) else { return };
                if let Some(hs) = self.handshake.as_ref() {
                    hs.table().publish(0, i as u32, payload);
                }
                // Its process lives on, but with UCX the only transport nothing can read its
                // blocks (shared-memory reads may still reach them, yet its notifications are
                // lost): the rank is gone for this engine, as a dead process is, and requests
                // that need it fail at once; so with NIXL, whose agent went. With a fallback
                // transport (multi) it still serves.
                if self.cfg.worker.transport.kind == TransportKind::Ucx {
                    self.rank_died(i as u32, "its UCX side was torn down".into());
                } else if self.cfg.worker.transport.kind == TransportKind::Nixl {
                    self.rank_died(i as u32, "its NIXL agent was torn down".into());
                } else {
                    warn!(
                        "{} rank {i} has no UCX side any more; its fallback transport serves",
                        self.role_str()
                    );
                }
            }
            FromWorker::Fatal { msg } => {
                if let Some(i) = rank_of(&self.ranks) {
                    self.rank_died(i as u32, msg);
                }
            }
            FromWorker::Bye { rss_bytes } => {
                if let Some(i) = rank_of(&self.ranks) {
                    if let Some(ready) = self.ranks[i].ready.as_mut() {
                        ready.rss_bytes = ready.rss_bytes.max(rss_bytes);
                    }
                    self.ranks[i].bye = true;
                    // The acknowledgement the worker waits for before it exits (see rank::run).
                    self.send_to(i as u32, &ToWorker::Shutdown);
                }
            }
        }
    }

    fn params_for(&self, p: &PendingPrefill) -> KvTransferParams {
        self.info.kv_params(&p.p_request_id, p.tokens, &p.blocks, self.cfg.worker.transport.mode)
    }

    fn live_ranks(&self) -> Result<BTreeSet<u32>, EngineError> {
        if let Some((r, rank)) = self.ranks.iter().enumerate().find(|(_, r)| r.dead.is_some()) {
            return Err(EngineError::RankGone {
                role: self.role_str(),
                rank: r as u32,
                why: rank.dead.clone().unwrap_or_default(),
            });
        }
        Ok((0..self.cfg.tp).collect())
    }

    fn blocks_needed(&self, cmd: &Cmd) -> u32 {
        match cmd {
            Cmd::Prefill { tokens, .. } => self.info.request_blocks(*tokens, self.cfg.block_tokens, 0),
            Cmd::Load { local_blocks, .. } => *local_blocks,
            Cmd::Release { .. } | Cmd::PeerGone { .. } | Cmd::Fault { .. } => 0,
        }
    }

    fn submit(&mut self, cmd: Cmd) {
        if !self.backlog.is_empty() && !matches!(cmd, Cmd::Release { .. } | Cmd::Fault { .. }) {
            self.backlog.push_back(cmd);
            return;
        }
        if let Some(cmd) = self.try_start(cmd) {
            self.backlog.push_back(cmd);
        }
    }

    fn drain_backlog(&mut self) {
        while let Some(cmd) = self.backlog.pop_front() {
            if let Some(cmd) = self.try_start(cmd) {
                self.backlog.push_front(cmd);
                break;
            }
        }
    }

    /// Starts a command, or gives it back when the pool is short of blocks.
    fn try_start(&mut self, cmd: Cmd) -> Option<Cmd> {
        let needed = self.blocks_needed(&cmd);
        let timeout = self.cfg.timeout;
        match cmd {
            Cmd::Fault { rank, fault } => {
                self.send_to(rank, &ToWorker::Fault(fault));
                None
            }
            Cmd::PeerGone { engine_id } => {
                for r in 0..self.cfg.tp {
                    self.send_to(r, &ToWorker::PeerGone { engine_id: engine_id.clone() });
                }
                None
            }
            Cmd::Release { p_request_id } => {
                self.backlog
                    .retain(|c| !matches!(c, Cmd::Prefill { p_request_id: id, .. } if *id == p_request_id));
                for r in 0..self.cfg.tp {
                    self.send_to(r, &ToWorker::Release { p_request_id: p_request_id.clone() });
                }
                None
            }
            Cmd::Prefill { req, reply, .. } if needed > self.pool.capacity() => {
                let _ =
                    reply.send(Err(EngineError::TooLarge { req, needed, capacity: self.pool.capacity() }));
                None
            }
            Cmd::Load { req, reply, .. } if needed > self.pool.capacity() => {
                let _ =
                    reply.send(Err(EngineError::TooLarge { req, needed, capacity: self.pool.capacity() }));
                None
            }
            Cmd::Prefill { req, p_request_id, tokens, seed, expected_notifs, reply } => {
                let live = match self.live_ranks() {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return None;
                    }
                };
                let Some(blocks) = self.pool.alloc(needed) else {
                    return Some(Cmd::Prefill { req, p_request_id, tokens, seed, expected_notifs, reply });
                };
                for &r in &live {
                    self.send_to(
                        r,
                        &ToWorker::Fill {
                            req,
                            p_request_id: p_request_id.clone(),
                            tokens,
                            blocks: blocks.clone(),
                            seed,
                            expected_notifs,
                        },
                    );
                }
                self.prefills.insert(
                    req,
                    PendingPrefill {
                        p_request_id,
                        tokens,
                        blocks,
                        waiting: live,
                        freed: BTreeSet::new(),
                        fill_ns: 0,
                        publish_ns: 0,
                        save_ns: 0,
                        deadline: Instant::now() + timeout,
                        reply,
                    },
                );
                None
            }
            Cmd::Load { req, d_request_id, params, local_blocks, seed, reply } => {
                let live = match self.live_ranks() {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return None;
                    }
                };
                let Some(blocks) = self.pool.alloc(local_blocks) else {
                    return Some(Cmd::Load { req, d_request_id, params, local_blocks, seed, reply });
                };
                let go = match self.cfg.rank_start {
                    RankStart::Free => true,
                    RankStart::Together if self.stepping.is_none() && self.held_loads.is_empty() => {
                        self.stepping = Some(req);
                        true
                    }
                    RankStart::Together => {
                        self.held_loads.push_back(req);
                        false
                    }
                };
                for &r in &live {
                    self.send_to(
                        r,
                        &ToWorker::Load {
                            req,
                            d_request_id: d_request_id.clone(),
                            params: params.clone(),
                            local_blocks: blocks.clone(),
                            seed,
                            side_channel: self
                                .handshake
                                .is_some()
                                .then(|| (self.info.side_channel_host.clone(), self.info.side_channel_port)),
                            go,
                        },
                    );
                }
                self.loads.insert(
                    req,
                    PendingLoad {
                        blocks,
                        waiting: live,
                        results: Vec::new(),
                        deadline: Instant::now() + timeout,
                        reply,
                    },
                );
                None
            }
        }
    }

    /// Ranks starting together: once the request they work on is done (answered, failed or
    /// expired), tell the ranks of the next held one to start it, all at once.
    fn next_step(&mut self) {
        if self.cfg.rank_start != RankStart::Together
            || self.stepping.is_some_and(|r| self.loads.contains_key(&r))
        {
            return;
        }
        self.stepping = None;
        while let Some(req) = self.held_loads.pop_front() {
            let Some(ranks) = self.loads.get(&req).map(|l| l.waiting.clone()) else { continue };
            for r in ranks {
                self.send_to(r, &ToWorker::Go { req });
            }
            self.stepping = Some(req);
            return;
        }
    }

    fn expire_deadlines(&mut self) {
        let now = Instant::now();
        let role = self.role_str();
        let timeout = self.cfg.timeout;
        let late: Vec<u64> =
            self.prefills.iter().filter(|(_, p)| p.deadline <= now).map(|(&k, _)| k).collect();
        for req in late {
            if let Some(p) = self.prefills.remove(&req) {
                let ranks: Vec<u32> = p.waiting.iter().copied().collect();
                let _ = p.reply.send(Err(EngineError::Timeout { req, role, ranks, timeout }));
                // Ranks that did fill hold the blocks under their lease.
                self.hold_or_free(req, p.blocks, &p.freed);
            }
        }
        let late: Vec<u64> = self.loads.iter().filter(|(_, l)| l.deadline <= now).map(|(&k, _)| k).collect();
        for req in late {
            if let Some(l) = self.loads.remove(&req) {
                self.pool.free(&l.blocks);
                let ranks: Vec<u32> = l.waiting.iter().copied().collect();
                let _ = l.reply.send(Err(EngineError::Timeout { req, role, ranks, timeout }));
            }
        }
    }

    /// Kills the local workers still running and reaps them.
    fn kill_workers(&mut self) {
        for r in &mut self.ranks {
            if let Some(child) = r.child.as_mut()
                && matches!(child.try_wait(), Ok(None))
            {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// Waits for held blocks to be freed (notifications or leases), stops the workers. An
    /// interrupted run waits for no lease and gives its workers [`INTERRUPTED_BYE`] to go.
    fn shutdown(mut self) -> EngineFinal {
        let interrupted = crate::interrupt::requested().is_some();
        // Prefill ranks free held blocks when notified or when leases run out.
        let lease = Duration::from_millis(self.cfg.worker.lease_ms);
        let deadline = Instant::now() + lease + Duration::from_secs(2);
        while !interrupted
            && !self.held.is_empty()
            && Instant::now() < deadline
            && self.ranks.iter().any(|r| r.dead.is_none())
        {
            self.poll_once(Duration::from_millis(50));
        }
        self.shutting_down = true;
        // A rank declared gone whose process still runs (its UCX side torn down) is stopped
        // like the others.
        let running = |r: &Rank| r.child.is_some() && !r.exited;
        for r in 0..self.cfg.tp {
            let rank = &self.ranks[r as usize];
            if rank.dead.is_none() || running(rank) {
                self.send_to(r, &ToWorker::Shutdown);
            }
        }
        // Wait for every live worker's goodbye (its peak memory) and, for local ones, its exit.
        let bye_wait = if interrupted { INTERRUPTED_BYE } else { Duration::from_secs(10) };
        let deadline = Instant::now() + bye_wait;
        // A worker that exited without its goodbye arriving (the message lost, or never sent)
        // is waited for only briefly: nothing more will come from it.
        let pending = |r: &Rank| {
            let bye_may_come = !r.bye && r.exited_at.is_none_or(|t| t.elapsed() < BYE_GRACE);
            (r.dead.is_none() && bye_may_come) || running(r)
        };
        while Instant::now() < deadline && self.ranks.iter().any(pending) {
            self.poll_once(Duration::from_millis(50));
        }
        if !interrupted {
            let role = self.cfg.worker.role;
            for (rank, r) in self.ranks.iter_mut().enumerate() {
                if r.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None))) {
                    tracing::warn!(
                        "{role:?} rank {rank} did not exit within 10 s of shutdown (goodbye received: {}); killing it",
                        r.bye
                    );
                }
            }
        }
        self.kill_workers();
        if let Some(hs) = self.handshake.take() {
            hs.stop();
        }
        self.fin.blocks_leaked = self.pool.in_use();
        self.fin.worker_rss_bytes =
            self.ranks.iter().map(|r| r.ready.as_ref().map_or(0, |i| i.rss_bytes)).collect();
        self.fin
    }
}

/// How long the workers of an interrupted run get to say goodbye before they are killed.
const INTERRUPTED_BYE: Duration = Duration::from_millis(400);

/// Makes a child's stderr pipe non-blocking, so draining it never stalls the engine. Failure
/// only costs that (the pipe stays blocking), so it is logged, not returned.
fn set_nonblocking(err: &ChildStderr) {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    if let Err(e) = fcntl_getfl(err).and_then(|flags| fcntl_setfl(err, flags | OFlags::NONBLOCK)) {
        tracing::debug!("O_NONBLOCK on a worker's stderr pipe: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_engine_dirs_of_gone_processes_are_removed_and_others_kept() {
        let tmp = tempfile::tempdir().expect("tmp");
        // A process that has exited: its pid is free (until reused, which would only keep it).
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let dead = child.id();
        child.wait().expect("wait");
        let stale = tmp.path().join(format!("kvx-engine-{dead}-abc123"));
        let mine = tmp.path().join(format!("kvx-engine-{}-def456", std::process::id()));
        let other = tmp.path().join("kvx-engine-notapid");
        for d in [&stale, &mine, &other] {
            std::fs::create_dir(d).expect("mkdir");
            std::fs::write(d.join("ctl"), b"").expect("file");
        }
        remove_stale_engine_dirs(tmp.path());
        assert!(!stale.exists(), "the gone process's directory is removed");
        assert!(mine.exists() && other.exists(), "a live owner's and an unknown name's are kept");
    }
}
