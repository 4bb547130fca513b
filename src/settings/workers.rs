//! What worker engines are told, checked once: where a run's KV pools live (`--mem`,
//! `--devices`), which memory each transport moves, the other transport rules `kvx bench`
//! and `kvx xfer` share, and `kvx serve-engine`'s settings ([`ServeEngineFlags`], its worker
//! engine built by `pipeline::setup`'s one builder, as `kvx bench`'s are). Must not start
//! anything.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::flags::{
    AllocFlags, ApiKeyFlags, DevicesFlags, EngineFlags, HybridRuleFlags, INFLIGHT_HELP, KvBufferFlags,
    LeaseFlags, MemFlags, ModeFlags, ModelFlags, PairFlags, SideChannelPortFlags, TimeoutFlags, TpFlags,
    UcxLibFlags, UcxModeFlags, VerifyFlags,
};
use super::parse::parse_size;
use super::scenario;
use crate::config::engine::EngineConfig;
use crate::config::engine::{EngineSlot, KvMemory, WorkerSettings};
use crate::config::serve::EngineIdentity;
use crate::config::serve::HttpEngineConfig;
use crate::config::worker::TransportConfig;
use crate::error::ConfigError;
use crate::topology::TransferMode;
use crate::transfer::memory::MemKind;
use crate::vocab::kinds::{KvBufferDevice, TransportKind};

/// Resolves `--mem` (host or cuda) and `--devices` into where a run's KV pools live. The
/// devices are a round-robin list ([`KvMemory`]'s placement rule), device 0 when none is
/// named; naming devices without `--mem cuda` is refused rather than ignored.
pub fn resolve_mem(kind: MemKind, devices: Option<Vec<u32>>) -> Result<KvMemory, ConfigError> {
    match kind {
        MemKind::Host => match devices {
            Some(_) => Err(ConfigError::new(
                "--devices",
                "--device and --devices place CUDA pools: pass --mem cuda with them, or drop them for host memory",
            )),
            None => Ok(KvMemory::Host),
        },
        MemKind::Cuda => {
            let devices = devices.filter(|d| !d.is_empty()).unwrap_or_else(|| vec![0]);
            let mut seen = std::collections::BTreeSet::new();
            if let Some(d) = devices.iter().find(|d| !seen.insert(**d)) {
                return Err(ConfigError::new("--devices", format!("device {d} is listed twice")));
            }
            Ok(KvMemory::Cuda { devices })
        }
    }
}

/// Which memory each transport moves, for every command that has both choices (`kvx bench`,
/// `kvx xfer`): the one place these rules are written. cuda-batch copies device memory only,
/// and needs a kvx built with CUDA support; device memory moves over UCX or cuda-batch (the
/// storage transport, and multi's storage fallback, read and write files from host memory).
pub fn check_mem_transport(mem: MemKind, kind: TransportKind) -> Result<(), ConfigError> {
    if kind == TransportKind::CudaBatch && !cfg!(feature = "cuda") {
        return Err(ConfigError::new(
            "--transport",
            "cuda-batch needs CUDA support, but this kvx was built without the `cuda` feature: rebuild with \
             `cargo build --release` (cuda is a default feature), or use --transport ucx",
        ));
    }
    match (mem, kind) {
        (MemKind::Host, TransportKind::CudaBatch) => Err(ConfigError::new(
            "--mem",
            "--transport cuda-batch copies device memory between GPUs of one machine: pass --mem cuda, or use \
             --transport ucx for host memory",
        )),
        (MemKind::Cuda, TransportKind::Storage | TransportKind::Multi) => Err(ConfigError::new(
            "--transport",
            format!(
                "'{}' moves host memory through files; with --mem cuda use --transport ucx (or --mem host)",
                kind.as_str()
            ),
        )),
        _ => Ok(()),
    }
}

/// `--transport` of a serving engine: what its KV workers move blocks with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineTransport {
    /// kvx's own UCX binding (one-sided GETs, kvx's metadata in vLLM's handshake framing).
    #[default]
    Ucx,
    /// NIXL itself: vLLM's handshake payload and notifications, so vLLM's own NIXL workers
    /// can read from this engine and be read from.
    Nixl,
}

impl EngineTransport {
    pub fn kind(self) -> TransportKind {
        match self {
            EngineTransport::Ucx => TransportKind::Ucx,
            EngineTransport::Nixl => TransportKind::Nixl,
        }
    }
}

/// `--kv-buffer-device cpu` stages the KV through a host buffer for UCX reads in pull mode, as
/// vLLM's NixlConnector does; the other transports and push mode move the pool itself.
pub fn check_kv_buffer(
    buf: KvBufferDevice,
    mode: TransferMode,
    kind: TransportKind,
) -> Result<(), ConfigError> {
    if buf == KvBufferDevice::Cuda {
        return Ok(());
    }
    if mode != TransferMode::Pull {
        return Err(ConfigError::new(
            "--kv-buffer-device",
            "a host buffer is staged for pull mode (decode reads it, as vLLM's NixlConnector): use --mode pull, \
             or --kv-buffer-device cuda",
        ));
    }
    if !matches!(kind, TransportKind::Ucx | TransportKind::Nixl) {
        return Err(ConfigError::new(
            "--kv-buffer-device",
            format!(
                "a host buffer is read over UCX or NIXL; --transport {} moves the pool itself: use --transport \
                 ucx or nixl, or --kv-buffer-device cuda",
                kind.as_str()
            ),
        ));
    }
    Ok(())
}

/// `--transport cuda-batch` maps peers' GPU memory with CUDA IPC, which works between
/// processes of one machine only: ranks that may run elsewhere (workers connecting to a
/// non-loopback `--listen`, or an advertised host other than loopback) are refused.
pub fn check_one_machine(
    kind: TransportKind,
    listen: Option<&crate::config::engine::TcpEndpoint>,
    advertise_host: &str,
) -> Result<(), ConfigError> {
    if kind != TransportKind::CudaBatch {
        return Ok(());
    }
    let why = "--transport cuda-batch needs every rank on this machine (CUDA IPC does not cross machines)";
    if let Some(ep) = listen
        && !is_loopback(&ep.host)
    {
        return Err(ConfigError::new(
            "--listen",
            format!(
                "{why}, but {ep} takes workers from other hosts: listen on tcp://127.0.0.1:PORT, or use \
                 --transport ucx across machines"
            ),
        ));
    }
    if !is_loopback(advertise_host) {
        return Err(ConfigError::new(
            "--advertise-host",
            format!(
                "{why}, but ranks advertise {advertise_host} to their peers: drop --advertise-host, or use \
                 --transport ucx across machines"
            ),
        ));
    }
    Ok(())
}

/// `127.0.0.0/8`, `::1` or `localhost`.
fn is_loopback(host: &str) -> bool {
    let h = host.trim().trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Checks `--inflight`.
pub fn check_inflight(n: u32) -> Result<u32, ConfigError> {
    if n == 0 || n > 1 << 16 {
        return Err(ConfigError::new("--inflight", format!("must be 1..65536, got {n}")));
    }
    Ok(n)
}

/// Which KV backend `kvx serve-engine` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvBackendKind {
    /// One `kvx worker` process per TP rank holding a registered KV pool: the prefill
    /// engine fills and holds blocks and serves its side channel; the decode engine
    /// handshakes, reads them with one-sided UCX GETs, verifies and notifies.
    Workers,
    /// No KV transfer at all: block ids are computed, nothing is held or read. For measuring
    /// the HTTP/proxy path alone; `/metrics` labels it `kv_transfer="none"`.
    Null,
}

/// Per-rank pool budget used when `--pool-blocks` is not given.
pub const DEFAULT_POOL_BYTES_PER_RANK: u64 = 512 << 20;

/// `--itl-ms` default: [`crate::config::serve::DEFAULT_ITL`] in milliseconds.
pub const DEFAULT_ITL_MS: f64 = 15.0;

/// `kvx serve-engine`'s flags (clap supplies the defaults). Host, port and threads are the
/// process's own: `cli` binds and starts the runtime with them.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct ServeEngineFlags {
    #[command(flatten)]
    pub role: super::flags::RoleFlags,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind; 0 picks a free one (read it from the first stdout line).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    #[command(flatten)]
    pub model_name: super::flags::ModelNameFlags,
    #[command(flatten)]
    pub tp: TpFlags,
    /// Context length: prompt + max_tokens must fit; also the default max_tokens bound.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: u64,
    /// Simulated prefill throughput in tokens/s (0 = instant prefill).
    #[arg(long, default_value_t = 0.0)]
    pub prefill_tokens_per_s: f64,
    /// Inter-token latency in milliseconds: one decode step of a real engine (10-30 ms for
    /// 8B-70B models on current GPUs). 0 sends all tokens at once: clients then report an
    /// ITL and TPOT of zero, and the engine's Server-Timing says pacing is off.
    #[arg(long, default_value_t = DEFAULT_ITL_MS)]
    pub itl_ms: f64,
    #[command(flatten)]
    pub api_key: ApiKeyFlags,
    /// Requests generating at once; more wait (vllm:num_requests_waiting).
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Largest request body taken, e.g. 64MiB, 1GiB; a larger one is answered 413.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "64MiB")]
    pub max_body_size: u64,
    /// The synthetic model samples EOS as its N-th token (unless ignore_eos); default never.
    #[arg(long, value_name = "N")]
    pub eos_at: Option<u64>,
    /// Engine id advertised as `remote_engine_id` (default: a random uuid4).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Side-channel host: the prefill engine binds its side channel (and its ranks their
    /// notification listeners) there and advertises it as `remote_host`
    /// (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST).
    #[arg(long, default_value = "localhost")]
    pub side_channel_host: String,
    #[command(flatten)]
    pub side_channel: SideChannelPortFlags,
    /// KV backend: real worker processes and UCX reads, or none (HTTP-only measurements).
    #[arg(long, value_enum, default_value = "workers")]
    pub kv_backend: KvBackendKind,
    /// Runtime worker threads, 1 to 1024 (default: one per CPU).
    #[arg(long, value_name = "N", value_parser = super::parse::parse_threads)]
    pub threads: Option<usize>,
    #[command(flatten, next_help_heading = "Connections")]
    pub conn: super::proxy::ServeConnFlags,
    #[command(flatten)]
    pub model: ModelFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub engine: EngineFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub pool_blocks: super::flags::PoolBlocksFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub alloc: AllocFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub lease: LeaseFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub timeout: TimeoutFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub verify: VerifyFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub ucx_lib: UcxLibFlags,
    #[arg(long, value_enum, help_heading = "KV workers", help = super::flags::TRANSPORT_HELP)]
    pub transport: Option<EngineTransport>,
    #[command(flatten, next_help_heading = "KV workers")]
    pub nixl: super::flags::NixlFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub fill: super::flags::FillFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub ucx_mode: UcxModeFlags,
    #[arg(long, help_heading = "KV workers", help = INFLIGHT_HELP)]
    pub inflight: Option<u32>,
    /// Post coalesced descriptors instead of vLLM's one per block and region.
    #[arg(long, help_heading = "KV workers")]
    pub coalesce: bool,
    #[command(flatten, next_help_heading = "KV workers")]
    pub mem: MemFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub devices: DevicesFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub mode: ModeFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub kv_buffer: KvBufferFlags,
    #[command(flatten, next_help_heading = "KV workers")]
    pub hybrid_rules: HybridRuleFlags,
}

/// How `kvx serve-engine`'s KV side is built.
#[derive(Debug, Clone)]
pub enum KvSettings {
    Null(EngineIdentity),
    Workers(Box<EngineConfig>),
}

/// Everything `kvx serve-engine` runs with.
#[derive(Debug, Clone)]
pub struct ServeEngineSettings {
    pub http: HttpEngineConfig,
    pub kv: KvSettings,
}

/// A bind address for ZMQ, which does not resolve host names when binding.
/// A side-channel host ZMQ can bind: an IP address, `*`, an interface of this host, or a
/// name that resolves (said here, naming the flag, rather than as a worker's ZMQ error).
fn check_side_channel_host(host: &str) -> Result<(), ConfigError> {
    let ok = host == "*"
        || host.parse::<std::net::IpAddr>().is_ok()
        || (!host.is_empty()
            && !host.contains(['/', '\0'])
            && std::path::Path::new("/sys/class/net").join(host).exists())
        || std::net::ToSocketAddrs::to_socket_addrs(&(host, 0)).is_ok_and(|mut a| a.next().is_some());
    if ok {
        Ok(())
    } else {
        Err(ConfigError::new(
            "--side-channel-host",
            format!("{host:?} is not an IP address, `*`, an interface of this host or a name that resolves"),
        ))
    }
}

fn bind_host(host: &str) -> String {
    if host == "localhost" { "127.0.0.1".to_string() } else { host.to_string() }
}

/// Checks `kvx serve-engine`'s flags and builds its settings.
pub fn resolve_serve_engine(
    a: &ServeEngineFlags,
    exe: &Result<PathBuf, String>,
) -> Result<ServeEngineSettings, ConfigError> {
    if a.tp.tp == 0 {
        return Err(ConfigError::new("--tp", "tensor-parallel size must be at least 1"));
    }
    if a.engine.block_size() == 0 {
        return Err(ConfigError::new("--block-size", "block size must be at least 1 token"));
    }
    if a.max_model_len < 2 {
        return Err(ConfigError::new("--max-model-len", "context must hold a prompt and one token (>= 2)"));
    }
    // A positive rate below one token per second would make a prefill take longer than a run
    // can wait (and a long prompt's time overflow a Duration).
    if !(a.prefill_tokens_per_s.is_finite()
        && (a.prefill_tokens_per_s == 0.0 || a.prefill_tokens_per_s >= 1.0))
    {
        return Err(ConfigError::new(
            "--prefill-tokens-per-s",
            format!("must be 0 (instant) or at least 1 token per second, got {:e}", a.prefill_tokens_per_s),
        ));
    }
    if !(a.itl_ms.is_finite() && (0.0..=60_000.0).contains(&a.itl_ms)) {
        return Err(ConfigError::new("--itl-ms", "must be between 0 and 60000 milliseconds"));
    }
    if a.max_num_seqs == 0 {
        return Err(ConfigError::new("--max-num-seqs", "must be at least 1"));
    }
    let max_body_bytes = super::parse::body_limit("--max-body-size", a.max_body_size)?;
    if a.eos_at == Some(0) {
        return Err(ConfigError::new("--eos-at", "EOS position counts from 1"));
    }
    if a.threads == Some(0) {
        return Err(ConfigError::new("--threads", "must be at least 1"));
    }
    let Some(role) = a.role.role else {
        return Err(ConfigError::new("--role", "is required: prefill or decode"));
    };
    let engine_id = a.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let model_name = a
        .model_name
        .model_name
        .clone()
        .or_else(|| a.model.model.clone())
        .unwrap_or_else(|| "kvx-synthetic".to_string());
    let http = HttpEngineConfig {
        role,
        model_name,
        max_model_len: a.max_model_len,
        block_size_tokens: a.engine.block_size(),
        tp_size: a.tp.tp,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        itl: Duration::from_secs_f64(a.itl_ms / 1000.0),
        api_key: a.api_key.api_key.clone(),
        max_num_seqs: a.max_num_seqs,
        eos_at: a.eos_at,
        max_body_bytes,
        conn: super::proxy::resolve_conn(&a.conn)?,
    };
    if a.kv_backend == KvBackendKind::Null {
        // The KV workers' flags size and steer workers that a null backend never starts.
        let given = [
            (a.engine.vllm.is_some(), "--vllm"),
            (a.engine.layout.is_some(), "--layout"),
            (a.pool_blocks.pool_blocks.is_some(), "--pool-blocks"),
            (a.ucx_lib.ucx_lib.is_some(), "--ucx-lib"),
            (a.ucx_mode.ucx_tls.is_some(), "--ucx-tls"),
            (a.coalesce, "--coalesce"),
            (a.mem.huge_pages, "--huge-pages"),
            (a.mem.mem() != MemKind::Host, "--mem"),
            (a.devices.devices.is_some(), "--devices"),
            (a.mem.device.is_some(), "--device"),
            (a.mode.mode.is_some(), "--mode"),
            (a.kv_buffer.device() != KvBufferDevice::Cuda, "--kv-buffer-device"),
            (a.hybrid_rules.host_copy.is_some(), "--host-copy"),
            (a.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
            (a.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
            (a.hybrid_rules.state_slices.is_some(), "--state-slices"),
            (a.engine.kernel_block_size.is_some(), "--kernel-block-size"),
            (a.engine.no_prefix_caching, "--no-prefix-caching"),
            (a.engine.gdn_prefill.is_some(), "--gdn-prefill"),
            (a.engine.attention_backend.is_some(), "--attention-backend"),
            (a.inflight.is_some(), "--inflight"),
        ];
        if let Some((_, flag)) = given.iter().find(|(on, _)| *on) {
            return Err(ConfigError::new(
                *flag,
                "applies to --kv-backend workers; --kv-backend null moves no KV: drop the flag or use workers",
            ));
        }
    }
    let kv = match a.kv_backend {
        KvBackendKind::Null => KvSettings::Null(EngineIdentity {
            engine_id,
            side_channel_host: a.side_channel_host.clone(),
            side_channel_port: a.side_channel.side_channel_port,
            tp_size: a.tp.tp,
        }),
        KvBackendKind::Workers => {
            let workers = serve_engine_workers(a, exe)?;
            let slot = EngineSlot {
                role,
                engine_id,
                side_channel_port: a.side_channel.side_channel_port,
                first_device_slot: 0,
            };
            KvSettings::Workers(Box::new(workers.engine(slot)))
        }
    };
    Ok(ServeEngineSettings { http, kv })
}

/// The worker settings behind `--kv-backend workers`: this engine's TP, layout, block size
/// and pool make its side of the pair (both sides, here); the other side is learned at
/// handshake time.
fn serve_engine_workers(
    a: &ServeEngineFlags,
    exe: &Result<PathBuf, String>,
) -> Result<WorkerSettings, ConfigError> {
    let pair_flags = PairFlags {
        p_tp: Some(a.tp.tp),
        d_tp: Some(a.tp.tp),
        engine: EngineFlags { block_size: Some(a.engine.block_size()), ..a.engine.clone() },
        ..PairFlags::default()
    };
    // The pair's checks speak of P and D; this engine is one side with its own flags.
    let own_flag = |e: ConfigError| {
        let flag = match e.flag.as_str() {
            "--p-tp" | "--d-tp" => "--tp".to_string(),
            "--p-layout" | "--d-layout" => "--layout".to_string(),
            "--p-block-size" | "--d-block-size" => "--block-size".to_string(),
            other => other.to_string(),
        };
        ConfigError { flag, reason: e.reason }
    };
    let hybrid_model = super::hybrid_flags::hybrid_preset_of(&a.model, a.engine.vllm, &[])?;
    super::hybrid_flags::check_host_switches(
        hybrid_model.is_some(),
        a.kv_buffer.device() == KvBufferDevice::Cpu,
        &[(a.hybrid_rules.state_slices.is_some(), "--state-slices")],
        &[
            (a.hybrid_rules.host_copy.is_some(), "--host-copy"),
            (a.hybrid_rules.host_state_page.is_some(), "--host-state-page"),
            (a.hybrid_rules.host_descriptors.is_some(), "--host-descriptors"),
        ],
        "--kv-buffer-device cpu",
    )?;
    let (pair, hybrid) = match hybrid_model {
        Some(model) => {
            let (pair, config) = serve_engine_hybrid(a, model, &pair_flags).map_err(own_flag)?;
            (pair, Some(config))
        }
        None => (serve_engine_pair(a, &pair_flags).map_err(own_flag)?, None),
    };
    finish_serve_engine(a, exe, pair, hybrid)
}

/// A uniform model's pair for one serving engine (both sides its own), its pool sized for
/// `--max-model-len` prompts, vLLM's checks of the mode.
fn serve_engine_pair(
    a: &ServeEngineFlags,
    pair_flags: &PairFlags,
) -> Result<crate::layouts::compat::PairSpec, ConfigError> {
    // Pool size needs the block size in bytes, which needs the shape: resolve once to size.
    let probe = scenario::resolve_pair(&a.model, pair_flags, 1, 1)?;
    let blocks_per_prompt = u32::try_from(a.max_model_len.div_ceil(u64::from(a.engine.block_size())))
        .map_err(|_| ConfigError::new("--max-model-len", "too many blocks per prompt"))?;
    let block_bytes = probe.p_geometry(0).block_bytes_all_layers().max(1);
    let pool = match a.pool_blocks.pool_blocks {
        Some(0) => return Err(ConfigError::new("--pool-blocks", "the pool needs at least 1 block")),
        Some(n) => n,
        None => {
            let budget = u32::try_from(DEFAULT_POOL_BYTES_PER_RANK / block_bytes).unwrap_or(u32::MAX);
            blocks_per_prompt.saturating_mul(4).min(budget).max(blocks_per_prompt).max(1)
        }
    };
    let pair = scenario::resolve_pair(&a.model, pair_flags, pool, pool)?;
    match a.mode.mode.unwrap_or_default() {
        TransferMode::Pull => pair.validate().map(|_| ())?,
        TransferMode::Push => pair.validate_push().map(|_| ())?,
    }
    Ok(pair)
}

/// A hybrid model's pair for one serving engine: its engine from its own flags on both sides
/// (a decode engine plans each prefill engine at handshake, from its TP and pool), block
/// sizes aligned as vLLM aligns them, the pool sized for `--max-model-len` prompts (one block
/// per KV cache group and position, plus vLLM's null block).
fn serve_engine_hybrid(
    a: &ServeEngineFlags,
    model: crate::layouts::hybrid::HybridModel,
    pair_flags: &PairFlags,
) -> Result<(crate::layouts::compat::PairSpec, crate::layouts::hybrid::HybridPairSpec), ConfigError> {
    use crate::layouts::hybrid::blocks::RequestShape;
    use crate::layouts::hybrid::geometry::{EngineGeometry, Side};
    let name = model.name.clone();
    let (mut own, _) = super::hybrid_flags::hybrid_engines(pair_flags, 1, None, None)?;
    if a.kv_buffer.device() == KvBufferDevice::Cpu {
        own.kv_buffer_device = KvBufferDevice::Cpu;
        own.host_state_page_padded =
            a.hybrid_rules.host_state_page == Some(crate::layouts::hybrid::HostStatePage::Padded);
        own.host_descriptors_per_group =
            a.hybrid_rules.host_descriptors == Some(crate::layouts::hybrid::HostDescriptors::PerGroup);
    }
    let one = EngineGeometry::new(&model, &own, Side::Prefill)?;
    let shape = RequestShape::of(&one);
    let max_tokens = u32::try_from(a.max_model_len).map_err(|_| {
        ConfigError::new("--max-model-len", "too many tokens for a hybrid model's block tables")
    })?;
    let per_request = shape.blocks(max_tokens, 0);
    own.num_blocks = match a.pool_blocks.pool_blocks {
        Some(n) if n <= per_request => {
            return Err(ConfigError::new(
                "--pool-blocks",
                format!(
                    "a {max_tokens}-token prompt (--max-model-len) of {name} needs {per_request} blocks ({} per \
                     KV cache group) plus vLLM's null block, but the pool has {n}",
                    per_request / shape.groups.len().max(1) as u32
                ),
            ));
        }
        Some(n) => n,
        None => {
            // The bytes one logical block spans in a rank's pool (every group's layers).
            let per_block = one
                .regions
                .iter()
                .map(|r| r.base_off + r.num_blocks * r.block_stride)
                .max()
                .unwrap_or(1)
                .max(1);
            let budget = u32::try_from(DEFAULT_POOL_BYTES_PER_RANK / per_block).unwrap_or(u32::MAX);
            per_request.saturating_mul(4).min(budget).max(per_request).saturating_add(1)
        }
    };
    let config = crate::layouts::hybrid::HybridPairSpec {
        model,
        p: own,
        d: own,
        permute_local_kv: false,
        state_slices: a.hybrid_rules.state_slices.unwrap_or_default(),
        host_copy: a.hybrid_rules.host_copy.unwrap_or_default(),
        push_attention: Default::default(),
        stated: Default::default(),
    };
    let (pair, _) = super::hybrid_flags::hybrid_pair_spec(&config)?;
    Ok((pair, config))
}

/// The rest of a serving engine's worker settings, past its pair.
fn finish_serve_engine(
    a: &ServeEngineFlags,
    exe: &Result<PathBuf, String>,
    pair: crate::layouts::compat::PairSpec,
    hybrid: Option<crate::layouts::hybrid::HybridPairSpec>,
) -> Result<WorkerSettings, ConfigError> {
    let mode = a.mode.mode.unwrap_or_default();
    let inflight = check_inflight(a.inflight.unwrap_or(super::flags::DEFAULT_INFLIGHT))?;
    check_kv_buffer(a.kv_buffer.device(), mode, TransportKind::Ucx)?;
    let timeout = a.timeout.or(super::flags::DEFAULT_TIMEOUT);
    for (d, flag) in [(a.lease.lease(), "--lease"), (timeout, "--timeout")] {
        if d.is_zero() {
            return Err(ConfigError::new(flag, "must be longer than 0"));
        }
    }
    let exe =
        exe.clone().map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    check_side_channel_host(&a.side_channel_host)?;
    let host = bind_host(&a.side_channel_host);
    // `--device N` is `--devices N`.
    let mem = resolve_mem(a.mem.mem(), a.devices.clone().devices.or(a.mem.device.map(|d| vec![d])))?;
    let kind = a.transport.unwrap_or_default().kind();
    Ok(WorkerSettings {
        pair,
        hybrid,
        transport: TransportConfig {
            kind,
            chain: vec![],
            mode,
            ucx_lib: a.ucx_lib.clone().ucx_lib,
            err_mode: a.ucx_mode.err_mode(kind == TransportKind::Nixl),
            progress: a.ucx_mode.progress(),
            ucx_alloc: false,
            huge_pages: a.mem.huge_pages,
            inflight,
            coalesce: a.coalesce,
            notify: Default::default(),
            storage_dir: None,
            storage_direct_io: false,
            storage_fsync: false,
            batch_copy: Default::default(),
            batch_launch: Default::default(),
            batch_descriptors: Default::default(),
            slowdown: 0.0,
            kv_buffer: a.kv_buffer.device(),
            nixl: crate::config::xfer::NixlOptions {
                progress_thread: a.nixl.nixl_progress_thread,
                ..Default::default()
            },
        },
        verify: a.verify.resolve(None),
        fill: a.fill.fill.unwrap_or_default(),
        mem,
        lease: a.lease.lease(),
        timeout,
        alloc: a.alloc.alloc(),
        seed: 0,
        exe,
        worker_env: a.ucx_mode.ucx_tls.iter().map(|t| ("UCX_TLS".to_string(), t.clone())).collect(),
        listen: None,
        advertise_host: if host == "0.0.0.0" { "127.0.0.1".into() } else { host.clone() },
        bind_host: host,
        prefill: Default::default(),
        rank_start: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::engine::Launch;
    use crate::transfer::memory::MemPlace;
    use crate::transfer::ucx::{ErrMode, ProgressMode};

    #[test]
    fn memory_and_the_transports_that_move_it() {
        assert_eq!(resolve_mem(MemKind::Host, None), Ok(KvMemory::Host));
        assert_eq!(resolve_mem(MemKind::Cuda, None), Ok(KvMemory::Cuda { devices: vec![0] }));
        assert_eq!(resolve_mem(MemKind::Cuda, Some(vec![2, 0])), Ok(KvMemory::Cuda { devices: vec![2, 0] }));
        assert_eq!(resolve_mem(MemKind::Cuda, Some(vec![1, 1])).expect_err("twice").flag, "--devices");
        assert_eq!(
            resolve_mem(MemKind::Host, Some(vec![1])).expect_err("devices without cuda").flag,
            "--devices"
        );
        assert!(check_mem_transport(MemKind::Cuda, TransportKind::Ucx).is_ok());
        assert!(check_mem_transport(MemKind::Host, TransportKind::Storage).is_ok());
        for kind in [TransportKind::Storage, TransportKind::Multi] {
            let e = check_mem_transport(MemKind::Cuda, kind).expect_err("storage moves host memory");
            assert_eq!(e.flag, "--transport", "{e}");
        }
    }

    #[test]
    fn cuda_batch_needs_device_pools_one_machine_and_the_cuda_feature() {
        let cuda = MemKind::Cuda;
        if cfg!(feature = "cuda") {
            assert!(check_mem_transport(cuda, TransportKind::CudaBatch).is_ok());
            let e = check_mem_transport(MemKind::Host, TransportKind::CudaBatch).expect_err("host pools");
            assert_eq!(e.flag, "--mem", "{e}");
            assert!(e.reason.contains("--mem cuda"), "{e}");
        } else {
            let e = check_mem_transport(cuda, TransportKind::CudaBatch).expect_err("no cuda feature");
            assert_eq!(e.flag, "--transport", "{e}");
            assert!(e.reason.contains("`cuda` feature"), "{e}");
        }
        let ep = |host: &str, port| crate::config::engine::TcpEndpoint { host: host.into(), port };
        let ok = |listen: Option<crate::config::engine::TcpEndpoint>, adv: &str| {
            check_one_machine(TransportKind::CudaBatch, listen.as_ref(), adv)
        };
        assert!(ok(None, "127.0.0.1").is_ok());
        assert!(ok(Some(ep("127.0.0.1", 5700)), "localhost").is_ok());
        assert!(ok(Some(ep("::1", 5700)), "::1").is_ok());
        assert_eq!(ok(Some(ep("0.0.0.0", 5700)), "127.0.0.1").expect_err("any host").flag, "--listen");
        let e = ok(None, "10.0.0.7").expect_err("advertised elsewhere");
        assert_eq!(e.flag, "--advertise-host");
        assert!(e.reason.contains("--transport ucx"), "{e}");
        // Other transports may span machines.
        assert!(check_one_machine(TransportKind::Ucx, Some(&ep("0.0.0.0", 1)), "10.0.0.7").is_ok());
    }

    use crate::topology::VllmVersion;
    use crate::vocab::kinds::Role;

    fn serve_flags(role: Role) -> ServeEngineFlags {
        use crate::settings::flags::{ApiKeyFlags, ModelNameFlags, RoleFlags};
        ServeEngineFlags {
            role: RoleFlags { role: Some(role) },
            host: "127.0.0.1".into(),
            port: 0,
            model_name: ModelNameFlags::default(),
            tp: TpFlags { tp: 2 },
            max_model_len: 256,
            prefill_tokens_per_s: 0.0,
            itl_ms: 0.0,
            api_key: ApiKeyFlags::default(),
            max_num_seqs: 256,
            max_body_size: crate::config::serve::DEFAULT_BODY_LIMIT as u64,
            eos_at: None,
            engine_id: Some("e1".into()),
            side_channel_host: "localhost".into(),
            side_channel: SideChannelPortFlags { side_channel_port: 0 },
            kv_backend: KvBackendKind::Workers,
            threads: None,
            conn: crate::settings::proxy::ServeConnFlags::default(),
            model: ModelFlags { model: Some("llama-3.1-8b".into()), ..ModelFlags::default() },
            engine: EngineFlags::default(),
            pool_blocks: Default::default(),
            alloc: AllocFlags::default(),
            lease: LeaseFlags::default(),
            timeout: TimeoutFlags::default(),
            verify: VerifyFlags::default(),
            ucx_lib: UcxLibFlags::default(),
            transport: None,
            nixl: Default::default(),
            fill: Default::default(),
            ucx_mode: UcxModeFlags {
                err_mode: Some(ErrMode::Peer),
                progress: Some(ProgressMode::Wait),
                ucx_tls: Some("tcp".into()),
            },
            inflight: Some(8),
            coalesce: false,
            mem: MemFlags::default(),
            devices: DevicesFlags::default(),
            mode: ModeFlags::default(),
            kv_buffer: KvBufferFlags::default(),
            hybrid_rules: HybridRuleFlags::default(),
        }
    }

    #[test]
    fn serve_engine_mode_is_typed_and_push_refusals_name_the_flag() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        let push = ServeEngineFlags {
            mode: crate::settings::flags::ModeFlags { mode: Some(TransferMode::Push) },
            ..serve_flags(Role::Decode)
        };
        let KvSettings::Workers(w) = resolve_serve_engine(&push, &exe).expect("push").kv else {
            panic!("workers backend")
        };
        assert_eq!(w.worker.transport.mode, TransferMode::Push);
        let v019 = ServeEngineFlags {
            engine: crate::settings::flags::EngineFlags {
                vllm: Some(VllmVersion::V0_19),
                ..Default::default()
            },
            ..push
        };
        assert_eq!(resolve_serve_engine(&v019, &exe).map(|_| ()).expect_err("0.19 push").flag, "--vllm");
    }

    #[test]
    fn serve_engine_workers_come_from_the_shared_builder() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        let s = resolve_serve_engine(&serve_flags(Role::Prefill), &exe).expect("valid");
        let KvSettings::Workers(w) = s.kv else { panic!("workers backend") };
        assert_eq!(w.worker.engine_id, "e1");
        assert_eq!(w.worker.transport.err_mode, ErrMode::Peer);
        assert_eq!(w.worker.transport.progress, ProgressMode::Wait);
        assert_eq!(w.worker.transport.inflight, 8);
        assert_eq!(w.mem, [MemPlace::Host; 2], "one placement per rank");
        assert_eq!(w.side_channel_bind.as_deref(), Some("tcp://127.0.0.1:0"), "port 0: a free port");
        assert!(matches!(&w.launch, Launch::Spawn { env, .. } if env == &[("UCX_TLS".into(), "tcp".into())]));
        let d = resolve_serve_engine(&serve_flags(Role::Decode), &exe).expect("valid");
        let KvSettings::Workers(w) = d.kv else { panic!("workers backend") };
        assert_eq!(w.side_channel_bind, None);
        assert_eq!(w.worker.role, Role::Decode);
        // --mem cuda --devices 1,0: this engine's ranks from slot 0, round-robin.
        let flags = ServeEngineFlags {
            mem: crate::settings::flags::MemFlags { mem: Some(MemKind::Cuda), ..Default::default() },
            devices: crate::settings::flags::DevicesFlags { devices: Some(vec![1, 0]) },
            ..serve_flags(Role::Decode)
        };
        let c = resolve_serve_engine(&flags, &exe).expect("cuda pools");
        let KvSettings::Workers(w) = c.kv else { panic!("workers backend") };
        assert_eq!(w.mem, [MemPlace::Cuda { device: 1 }, MemPlace::Cuda { device: 0 }]);
    }

    #[test]
    fn bad_serve_engine_values_name_their_flag() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        type Set = fn(&mut ServeEngineFlags);
        let cases: [(Set, &str); 8] = [
            (|f| f.devices.devices = Some(vec![0]), "--devices"),
            (
                |f| {
                    f.kv_buffer.kv_buffer_device = Some(KvBufferDevice::Cpu);
                    f.mode.mode = Some(TransferMode::Push);
                },
                "--kv-buffer-device",
            ),
            (|f| f.mem.device = Some(0), "--devices"),
            (|f| f.inflight = Some(0), "--inflight"),
            (|f| f.threads = Some(0), "--threads"),
            (|f| f.tp.tp = 3, "--tp"),
            (|f| f.lease.lease = Some(Duration::ZERO), "--lease"),
            (|f| f.engine.block_size = Some(0), "--block-size"),
        ];
        for (set, flag) in cases {
            let mut f = serve_flags(Role::Decode);
            set(&mut f);
            let e = resolve_serve_engine(&f, &exe).expect_err(flag);
            assert_eq!(e.flag, flag, "{e}");
        }
        let e = resolve_serve_engine(&serve_flags(Role::Decode), &Err("gone".into())).expect_err("no exe");
        assert_eq!(e.flag, "(system)");
    }
}
