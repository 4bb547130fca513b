//! What worker engines are told, parsed and checked: the typed choices every worker receives
//! (verification, UCX error and progress modes, transport, transfer mode), what kvx cannot do
//! yet ([`NotYet`]), and `kvx serve-engine`'s flags resolved into its settings (its worker
//! engine built by `pipeline::setup`'s one builder, as `kvx bench`'s are). Must not start
//! anything.

use std::path::PathBuf;
use std::time::Duration;

use super::flags::{ModelFlags, PairFlags};
use super::parse::choice;
use super::scenario;
use crate::error::ConfigError;
use crate::layouts::alloc::AllocPattern;
use crate::pipeline::engine::EngineConfig;
use crate::pipeline::proto::{Role, TransferMode, TransportConfig, TransportKind, VerifyMode};
use crate::pipeline::setup::{EngineSlot, KvMemory, WorkerSettings};
use crate::serve::engine::{EngineConfig as HttpEngineConfig, Role as HttpRole};
use crate::serve::kv::EngineIdentity;
use crate::transfer::ucx::{ErrMode, ProgressMode};

/// Resolves `--mem` (host or cuda) and `--devices` into where a run's KV pools live. The
/// devices are a round-robin list ([`KvMemory`]'s placement rule), device 0 when none is
/// named; naming devices without `--mem cuda` is refused rather than ignored.
pub fn resolve_mem(kind: &str, devices: Option<Vec<u32>>) -> Result<KvMemory, ConfigError> {
    match kind.trim() {
        "host" => match devices {
            Some(_) => Err(ConfigError::new(
                "--devices",
                "--device and --devices place CUDA pools: pass --mem cuda with them, or drop them for host memory",
            )),
            None => Ok(KvMemory::Host),
        },
        "cuda" => {
            let devices = devices.filter(|d| !d.is_empty()).unwrap_or_else(|| vec![0]);
            let mut seen = std::collections::BTreeSet::new();
            if let Some(d) = devices.iter().find(|d| !seen.insert(**d)) {
                return Err(ConfigError::new("--devices", format!("device {d} is listed twice")));
            }
            Ok(KvMemory::Cuda { devices })
        }
        other => Err(ConfigError::new("--mem", format!("'{other}' is not host or cuda"))),
    }
}

/// Device pools move over UCX or cuda-batch: the storage transport (and multi's storage
/// fallback) reads and writes files from host memory. cuda-batch copies device memory only,
/// and needs a kvx built with CUDA support.
pub fn check_mem_transport(mem: &KvMemory, kind: TransportKind) -> Result<(), ConfigError> {
    if kind == TransportKind::CudaBatch && !cfg!(feature = "cuda") {
        return Err(ConfigError::new(
            "--transport",
            "cuda-batch needs CUDA support, but this kvx was built without the `cuda` feature: rebuild with \
             `cargo build --release` (cuda is a default feature), or use --transport ucx",
        ));
    }
    match (mem, kind) {
        (KvMemory::Host, TransportKind::CudaBatch) => Err(ConfigError::new(
            "--mem",
            "--transport cuda-batch copies KV pools between GPUs of one machine: pass --mem cuda (and \
             --devices to place the ranks), or use --transport ucx for host memory",
        )),
        (KvMemory::Cuda { .. }, TransportKind::Storage | TransportKind::Multi) => Err(ConfigError::new(
            "--transport",
            format!(
                "'{}' moves host memory through files; with --mem cuda use --transport ucx (or --mem host)",
                kind.as_str()
            ),
        )),
        _ => Ok(()),
    }
}

/// Parses `--mode` (or the `mode` key).
pub fn parse_mode(name: &str) -> Result<TransferMode, String> {
    choice(name, &[("pull", TransferMode::Pull), ("push", TransferMode::Push)])
}

/// Parses `--verify`.
pub fn parse_verify(name: &str) -> Result<VerifyMode, String> {
    choice(name, &[("full", VerifyMode::Full), ("sample", VerifyMode::Sample), ("off", VerifyMode::Off)])
}

/// Parses `--err-mode`.
pub fn parse_err_mode(name: &str) -> Result<ErrMode, String> {
    choice(name, &[("none", ErrMode::None), ("peer", ErrMode::Peer)])
}

/// Parses `--progress`.
pub fn parse_progress(name: &str) -> Result<ProgressMode, String> {
    choice(
        name,
        &[("busy", ProgressMode::Busy), ("wait", ProgressMode::Wait), ("hybrid", ProgressMode::Hybrid)],
    )
}

/// Parses `--transport`.
pub fn parse_transport(name: &str) -> Result<TransportKind, String> {
    choice(
        name,
        &[
            ("ucx", TransportKind::Ucx),
            ("storage", TransportKind::Storage),
            ("multi", TransportKind::Multi),
            ("cuda-batch", TransportKind::CudaBatch),
        ],
    )
}

/// `--transport cuda-batch` maps peers' GPU memory with CUDA IPC, which works between
/// processes of one machine only: ranks that may run elsewhere (workers connecting to a
/// non-loopback `--listen`, or an advertised host other than loopback) are refused.
pub fn check_one_machine(
    kind: TransportKind,
    listen: Option<&str>,
    advertise_host: &str,
) -> Result<(), ConfigError> {
    if kind != TransportKind::CudaBatch {
        return Ok(());
    }
    let why = "--transport cuda-batch needs every rank on this machine (CUDA IPC does not cross machines)";
    if let Some(ep) = listen {
        let (host, _) = crate::pipeline::engine::split_endpoint(ep);
        if !is_loopback(&host) {
            return Err(ConfigError::new(
                "--listen",
                format!(
                    "{why}, but {ep} takes workers from other hosts: listen on tcp://127.0.0.1:PORT, or use \
                     --transport ucx across machines"
                ),
            ));
        }
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

/// `kvx serve-engine`'s flags as plain data (clap supplies the defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct ServeEngineFlags {
    pub role: HttpRole,
    pub model_name: Option<String>,
    pub tp: u32,
    pub block_size: u32,
    pub max_model_len: u64,
    pub prefill_tokens_per_s: f64,
    pub itl_ms: f64,
    pub api_key: Option<String>,
    pub max_num_seqs: usize,
    pub eos_at: Option<u64>,
    pub engine_id: Option<String>,
    pub side_channel_host: String,
    pub side_channel_port: u16,
    pub kv_backend: KvBackendKind,
    pub model: ModelFlags,
    pub vllm: Option<String>,
    pub layout: Option<String>,
    pub pool_blocks: Option<u32>,
    pub alloc: String,
    pub lease: Duration,
    pub timeout: Duration,
    pub verify: String,
    pub ucx_lib: Option<PathBuf>,
    pub ucx_tls: Option<String>,
    pub err_mode: String,
    pub progress: String,
    pub inflight: u32,
    pub coalesce: bool,
    pub huge_pages: bool,
    /// `--mem`: host or cuda.
    pub mem: String,
    /// `--devices` (or `--device`): GPUs of `--mem cuda`, round-robin over this engine's ranks.
    pub devices: Option<Vec<u32>>,
    /// `--mode`: pull (decode reads, NixlConnector) or push (prefill writes,
    /// NixlPushConnector); `None` is pull. Both engines of a pair must agree (the handshake's
    /// compatibility hash includes it).
    pub mode: Option<String>,
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
fn bind_host(host: &str) -> String {
    if host == "localhost" { "127.0.0.1".to_string() } else { host.to_string() }
}

/// Checks `kvx serve-engine`'s flags and builds its settings.
pub fn resolve_serve_engine(
    a: &ServeEngineFlags,
    exe: &Result<PathBuf, String>,
) -> Result<ServeEngineSettings, ConfigError> {
    if a.tp == 0 {
        return Err(ConfigError::new("--tp", "tensor-parallel size must be at least 1"));
    }
    if a.block_size == 0 {
        return Err(ConfigError::new("--block-size", "block size must be at least 1 token"));
    }
    if a.max_model_len < 2 {
        return Err(ConfigError::new("--max-model-len", "context must hold a prompt and one token (>= 2)"));
    }
    if !(a.prefill_tokens_per_s.is_finite() && a.prefill_tokens_per_s >= 0.0) {
        return Err(ConfigError::new("--prefill-tokens-per-s", "must be a finite number >= 0 (0 = instant)"));
    }
    if !(a.itl_ms.is_finite() && (0.0..=60_000.0).contains(&a.itl_ms)) {
        return Err(ConfigError::new("--itl-ms", "must be between 0 and 60000 milliseconds"));
    }
    if a.max_num_seqs == 0 {
        return Err(ConfigError::new("--max-num-seqs", "must be at least 1"));
    }
    if a.eos_at == Some(0) {
        return Err(ConfigError::new("--eos-at", "EOS position counts from 1"));
    }
    let engine_id = a.engine_id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let model_name =
        a.model_name.clone().or_else(|| a.model.model.clone()).unwrap_or_else(|| "kvx-synthetic".to_string());
    let http = HttpEngineConfig {
        role: a.role,
        model_name,
        max_model_len: a.max_model_len,
        block_size_tokens: a.block_size,
        tp_size: a.tp,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        itl: Duration::from_secs_f64(a.itl_ms / 1000.0),
        api_key: a.api_key.clone(),
        max_num_seqs: a.max_num_seqs,
        eos_at: a.eos_at,
    };
    let kv = match a.kv_backend {
        KvBackendKind::Null => KvSettings::Null(EngineIdentity {
            engine_id,
            side_channel_host: a.side_channel_host.clone(),
            side_channel_port: a.side_channel_port,
            tp_size: a.tp,
        }),
        KvBackendKind::Workers => {
            let role = match a.role {
                HttpRole::Prefill => Role::Prefill,
                HttpRole::Decode => Role::Decode,
            };
            let workers = serve_engine_workers(a, exe)?;
            let slot =
                EngineSlot { role, engine_id, side_channel_port: a.side_channel_port, first_device_slot: 0 };
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
        p_tp: Some(a.tp),
        d_tp: Some(a.tp),
        vllm: a.vllm.clone(),
        layout: a.layout.clone(),
        block_size: Some(a.block_size),
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
    // Pool size needs the block size in bytes, which needs the shape: resolve once to size.
    let probe = scenario::resolve_pair(&a.model, &pair_flags, 1, 1).map_err(own_flag)?;
    let blocks_per_prompt = u32::try_from(a.max_model_len.div_ceil(u64::from(a.block_size)))
        .map_err(|_| ConfigError::new("--max-model-len", "too many blocks per prompt"))?;
    let block_bytes = probe.p_geometry(0).block_bytes_all_layers().max(1);
    let pool = match a.pool_blocks {
        Some(0) => return Err(ConfigError::new("--pool-blocks", "the pool needs at least 1 block")),
        Some(n) => n,
        None => {
            let budget = u32::try_from(DEFAULT_POOL_BYTES_PER_RANK / block_bytes).unwrap_or(u32::MAX);
            blocks_per_prompt.saturating_mul(4).min(budget).max(blocks_per_prompt).max(1)
        }
    };
    let pair = scenario::resolve_pair(&a.model, &pair_flags, pool, pool).map_err(own_flag)?;
    let mode = match &a.mode {
        Some(m) => parse_mode(m).map_err(|e| ConfigError::new("--mode", e))?,
        None => TransferMode::Pull,
    };
    match mode {
        TransferMode::Pull => pair.validate().map(|_| ()).map_err(own_flag)?,
        TransferMode::Push => pair.validate_push().map(|_| ()).map_err(own_flag)?,
    }
    let alloc: AllocPattern = a.alloc.parse().map_err(|e| ConfigError::new("--alloc", e))?;
    let verify = parse_verify(&a.verify).map_err(|e| ConfigError::new("--verify", e))?;
    let err_mode = parse_err_mode(&a.err_mode).map_err(|e| ConfigError::new("--err-mode", e))?;
    let progress = parse_progress(&a.progress).map_err(|e| ConfigError::new("--progress", e))?;
    let inflight = check_inflight(a.inflight)?;
    if a.lease.is_zero() || a.timeout.is_zero() {
        return Err(ConfigError::new("--lease", "--lease and --timeout must be longer than 0"));
    }
    let exe =
        exe.clone().map_err(|e| ConfigError::new("(system)", format!("cannot find the kvx binary: {e}")))?;
    let host = bind_host(&a.side_channel_host);
    let mem = resolve_mem(&a.mem, a.devices.clone())?;
    Ok(WorkerSettings {
        pair,
        transport: TransportConfig {
            kind: TransportKind::Ucx,
            chain: vec![],
            mode,
            ucx_lib: a.ucx_lib.clone(),
            err_mode,
            progress,
            ucx_alloc: false,
            huge_pages: a.huge_pages,
            inflight,
            coalesce: a.coalesce,
            notify: Default::default(),
            storage_dir: None,
            storage_direct_io: false,
            storage_fsync: false,
            batch_copy: Default::default(),
            slowdown: 0.0,
        },
        verify,
        mem,
        lease: a.lease,
        timeout: a.timeout,
        alloc,
        seed: 0,
        exe,
        worker_env: a.ucx_tls.iter().map(|t| ("UCX_TLS".to_string(), t.clone())).collect(),
        listen: None,
        advertise_host: if host == "0.0.0.0" { "127.0.0.1".into() } else { host.clone() },
        bind_host: host,
        prefill: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::engine::Launch;
    use crate::transfer::memory::MemPlace;

    #[test]
    fn only_pull_mode_and_host_pools_for_now() {
        assert_eq!(parse_mode("pull"), Ok(TransferMode::Pull));
        assert_eq!(parse_mode("push"), Ok(TransferMode::Push));
        assert!(parse_mode("sideways").is_err_and(|e| e.contains("sideways")));
        assert_eq!(resolve_mem("host", None), Ok(KvMemory::Host));
        assert_eq!(resolve_mem("cuda", None), Ok(KvMemory::Cuda { devices: vec![0] }));
        assert_eq!(resolve_mem(" cuda", Some(vec![2, 0])), Ok(KvMemory::Cuda { devices: vec![2, 0] }));
        assert_eq!(resolve_mem("cuda", Some(vec![1, 1])).expect_err("twice").flag, "--devices");
        assert_eq!(resolve_mem("host", Some(vec![1])).expect_err("devices without cuda").flag, "--devices");
        assert_eq!(resolve_mem("gpu", None).expect_err("unknown").flag, "--mem");
        let cuda = KvMemory::Cuda { devices: vec![0] };
        assert!(check_mem_transport(&cuda, TransportKind::Ucx).is_ok());
        assert!(check_mem_transport(&KvMemory::Host, TransportKind::Storage).is_ok());
        for kind in [TransportKind::Storage, TransportKind::Multi] {
            let e = check_mem_transport(&cuda, kind).expect_err("storage moves host memory");
            assert_eq!(e.flag, "--transport", "{e}");
        }
    }

    #[test]
    fn cuda_batch_needs_device_pools_one_machine_and_the_cuda_feature() {
        assert_eq!(parse_transport("cuda-batch"), Ok(TransportKind::CudaBatch));
        assert!(parse_transport("nccl").is_err_and(|e| e.contains("cuda-batch")), "the error lists it");
        let cuda = KvMemory::Cuda { devices: vec![0, 1] };
        if cfg!(feature = "cuda") {
            assert!(check_mem_transport(&cuda, TransportKind::CudaBatch).is_ok());
            let e = check_mem_transport(&KvMemory::Host, TransportKind::CudaBatch).expect_err("host pools");
            assert_eq!(e.flag, "--mem", "{e}");
            assert!(e.reason.contains("--mem cuda"), "{e}");
        } else {
            let e = check_mem_transport(&cuda, TransportKind::CudaBatch).expect_err("no cuda feature");
            assert_eq!(e.flag, "--transport", "{e}");
            assert!(e.reason.contains("`cuda` feature"), "{e}");
        }
        let ok = |listen: Option<&str>, adv: &str| check_one_machine(TransportKind::CudaBatch, listen, adv);
        assert!(ok(None, "127.0.0.1").is_ok());
        assert!(ok(Some("tcp://127.0.0.1:5700"), "localhost").is_ok());
        assert!(ok(Some("tcp://[::1]:5700"), "::1").is_ok());
        assert_eq!(ok(Some("tcp://0.0.0.0:5700"), "127.0.0.1").expect_err("any host").flag, "--listen");
        let e = ok(None, "10.0.0.7").expect_err("advertised elsewhere");
        assert_eq!(e.flag, "--advertise-host");
        assert!(e.reason.contains("--transport ucx"), "{e}");
        // Other transports may span machines.
        assert!(check_one_machine(TransportKind::Ucx, Some("tcp://0.0.0.0:1"), "10.0.0.7").is_ok());
    }

    fn serve_flags(role: HttpRole) -> ServeEngineFlags {
        ServeEngineFlags {
            role,
            model_name: None,
            tp: 2,
            block_size: 16,
            max_model_len: 256,
            prefill_tokens_per_s: 0.0,
            itl_ms: 0.0,
            api_key: None,
            max_num_seqs: 256,
            eos_at: None,
            engine_id: Some("e1".into()),
            side_channel_host: "localhost".into(),
            side_channel_port: 0,
            kv_backend: KvBackendKind::Workers,
            model: ModelFlags { model: Some("llama-3.1-8b".into()), ..ModelFlags::default() },
            vllm: None,
            layout: None,
            pool_blocks: None,
            alloc: "contiguous".into(),
            lease: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
            verify: "sample".into(),
            ucx_lib: None,
            ucx_tls: Some("tcp".into()),
            err_mode: "peer".into(),
            progress: "wait".into(),
            inflight: 8,
            coalesce: false,
            huge_pages: false,
            mem: "host".into(),
            devices: None,
            mode: None,
        }
    }

    #[test]
    fn serve_engine_mode_is_typed_and_push_refusals_name_the_flag() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        let push = ServeEngineFlags { mode: Some("push".into()), ..serve_flags(HttpRole::Decode) };
        let KvSettings::Workers(w) = resolve_serve_engine(&push, &exe).expect("push").kv else {
            panic!("workers backend")
        };
        assert_eq!(w.worker.transport.mode, TransferMode::Push);
        let bad = ServeEngineFlags { mode: Some("pour".into()), ..serve_flags(HttpRole::Decode) };
        assert_eq!(resolve_serve_engine(&bad, &exe).map(|_| ()).expect_err("bad mode").flag, "--mode");
        let v019 = ServeEngineFlags { vllm: Some("0.19".into()), ..push };
        assert_eq!(resolve_serve_engine(&v019, &exe).map(|_| ()).expect_err("0.19 push").flag, "--vllm");
    }

    #[test]
    fn serve_engine_workers_come_from_the_shared_builder() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        let s = resolve_serve_engine(&serve_flags(HttpRole::Prefill), &exe).expect("valid");
        let KvSettings::Workers(w) = s.kv else { panic!("workers backend") };
        assert_eq!(w.worker.engine_id, "e1");
        assert_eq!(w.worker.transport.err_mode, ErrMode::Peer);
        assert_eq!(w.worker.transport.progress, ProgressMode::Wait);
        assert_eq!(w.worker.transport.inflight, 8);
        assert_eq!(w.mem, [MemPlace::Host; 2], "one placement per rank");
        assert_eq!(w.side_channel_bind.as_deref(), Some("tcp://127.0.0.1:0"), "port 0: a free port");
        assert!(matches!(&w.launch, Launch::Spawn { env, .. } if env == &[("UCX_TLS".into(), "tcp".into())]));
        let d = resolve_serve_engine(&serve_flags(HttpRole::Decode), &exe).expect("valid");
        let KvSettings::Workers(w) = d.kv else { panic!("workers backend") };
        assert_eq!(w.side_channel_bind, None);
        assert_eq!(w.worker.role, Role::Decode);
        // --mem cuda --devices 1,0: this engine's ranks from slot 0, round-robin.
        let flags = ServeEngineFlags {
            mem: "cuda".into(),
            devices: Some(vec![1, 0]),
            ..serve_flags(HttpRole::Decode)
        };
        let c = resolve_serve_engine(&flags, &exe).expect("cuda pools");
        let KvSettings::Workers(w) = c.kv else { panic!("workers backend") };
        assert_eq!(w.mem, [MemPlace::Cuda { device: 1 }, MemPlace::Cuda { device: 0 }]);
    }

    #[test]
    fn bad_serve_engine_values_name_their_flag() {
        let exe = Ok(PathBuf::from("/bin/kvx"));
        type Set = fn(&mut ServeEngineFlags);
        let cases: [(Set, &str); 9] = [
            (|f| f.mem = "gpu".into(), "--mem"),
            (|f| f.devices = Some(vec![0]), "--devices"),
            (|f| f.err_mode = "x".into(), "--err-mode"),
            (|f| f.progress = "spin".into(), "--progress"),
            (|f| f.verify = "most".into(), "--verify"),
            (|f| f.inflight = 0, "--inflight"),
            (|f| f.tp = 3, "--tp"),
            (|f| f.lease = Duration::ZERO, "--lease"),
            (|f| f.block_size = 0, "--block-size"),
        ];
        for (set, flag) in cases {
            let mut f = serve_flags(HttpRole::Decode);
            set(&mut f);
            let e = resolve_serve_engine(&f, &exe).expect_err(flag);
            assert_eq!(e.flag, flag, "{e}");
        }
        let e =
            resolve_serve_engine(&serve_flags(HttpRole::Decode), &Err("gone".into())).expect_err("no exe");
        assert_eq!(e.flag, "(system)");
    }
}
