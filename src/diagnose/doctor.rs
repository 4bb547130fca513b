//! `kvx doctor`: what kvx sees on this host, one [`Check`] per item with a verdict and a
//! hint — the UCX library and its transports, memory types, whether a GET from user
//! memory is truly one-sided (a self-test against a target that does not progress),
//! the error-handling mode's effect, CUDA (driver, devices, UCX's CUDA support, a
//! two-process cuda_ipc read and its protocol, GET zero-copy, NVLink), huge pages,
//! side-channel ports, ZMQ, and the environment.
//!
//! The CUDA checks are gathered as plain facts ([`CudaFacts`]) and judged by a pure
//! function ([`cuda_findings`]), so every verdict is unit-tested without a GPU. A host
//! without CUDA gets `missing` lines that say what is absent; they never fail the doctor.
//!
//! Owns: gathering the checks. Must not print: `cli::doctor` renders them.
#![forbid(unsafe_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use super::xfer::{self, Control, LocalTarget, Session, TargetRequest};
use crate::config::xfer::SessionOptions;
use crate::config::xfer::TargetOptions;
use crate::transfer::cuda::{self, DriverInfo};
use crate::transfer::memory::{self, MemPlace};
use crate::transfer::ucx::{
    CUDA_IPC_GET_ZCOPY_ENV, Context, ContextOptions, Endpoint, ErrMode, MemRegion, ProtoReport, ReadDesc,
    ReadOptions, Ucx, UcxError,
};
use crate::vocab::env;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Ok,
    Warn,
    /// An optional capability is absent (e.g. CUDA on a host without a GPU): the hint
    /// says how to get it; the doctor still passes.
    Missing,
    Fail,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Missing => "missing",
            Verdict::Fail => "fail",
        })
    }
}

/// One line of the doctor's report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
    /// What to do about it (empty when nothing is needed).
    pub hint: String,
}

fn check(name: &'static str, verdict: Verdict, detail: impl Into<String>, hint: impl Into<String>) -> Check {
    Check { name, verdict, detail: detail.into(), hint: hint.into() }
}

/// What the doctor looks at.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    pub ucx_lib: Option<PathBuf>,
    /// The kvx executable, started as the target of the zero-copy self-test (None skips it).
    pub self_test_exe: Option<PathBuf>,
    pub side_channel_port: u16,
    pub ports: u16,
    /// The launcher settings recognised in this process's environment, or why it refused it.
    pub launcher: Result<Option<crate::vocab::launcher::Launcher>, crate::error::ConfigError>,
}

/// The whole report; `needed_missing` is true when kvx cannot work on this host.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    pub checks: Vec<Check>,
    pub needed_missing: bool,
}

pub fn run(opts: &DoctorOptions) -> DoctorReport {
    let mut checks = Vec::new();
    let mut loaded = None;
    match Ucx::load(opts.ucx_lib.as_deref()) {
        Ok(ucx) => {
            let info = ucx.info();
            checks.push(check(
                "ucx.library",
                Verdict::Ok,
                format!("UCX {} from {} ({})", info.version, info.library.display(), info.source),
                "",
            ));
            ucx_checks(&ucx, opts, &mut checks);
            loaded = Some(ucx);
        }
        Err(e) => checks.push(check(
            "ucx.library",
            Verdict::Fail,
            e.to_string(),
            "run scripts/setup-ucx.sh (modern UCX into .ucx/) or apt-get install libucx0, or pass --ucx-lib",
        )),
    }
    checks.push(ptrace_check());
    checks.extend(cuda_findings(&cuda_facts(loaded.as_ref(), opts)));
    checks.push(huge_pages_check());
    checks.push(ports_check(opts.side_channel_port, opts.ports));
    checks.push(zmq_check());
    checks.extend(nixl_checks());
    checks.push(env_check());
    checks.push(launcher_check(&opts.launcher));
    let needed_missing = checks.iter().any(|c| c.verdict == Verdict::Fail);
    DoctorReport { checks, needed_missing }
}

fn ucx_checks(ucx: &Ucx, opts: &DoctorOptions, checks: &mut Vec<Check>) {
    let ctx = match Context::new(ucx, &ContextOptions::default()) {
        Ok(c) => c,
        Err(e) => {
            checks.push(check(
                "ucx.context",
                Verdict::Fail,
                e.to_string(),
                "check the UCX_* environment variables",
            ));
            return;
        }
    };
    let resources = ctx.print_info().map(|t| parse_resources(&t)).unwrap_or_default();
    let has_shm = resources.iter().any(|r| r.starts_with("posix/") || r.starts_with("sysv/"));
    let has_cma = resources.iter().any(|r| r.starts_with("cma/"));
    checks.push(check(
        "ucx.transports",
        if has_shm { Verdict::Ok } else { Verdict::Warn },
        if resources.is_empty() { "none found".to_string() } else { resources.join(", ") },
        if has_shm {
            if has_cma { "" } else { "no cma: cross-process GETs cannot be zero-copy" }
        } else {
            "no shared-memory transport (posix/sysv): same-host transfers fall back to tcp; check UCX_TLS"
        },
    ));
    match ctx.memory_types() {
        Ok(types) => {
            let cuda_driver = matches!(cuda::device_count(), Ok(n) if n > 0);
            let cuda_in_ucx = types.contains(&"cuda");
            checks.push(check(
                "ucx.memory_types",
                if cuda_driver && !cuda_in_ucx { Verdict::Warn } else { Verdict::Ok },
                types.join(", "),
                if cuda_driver && !cuda_in_ucx {
                    "this UCX cannot register CUDA memory: use the project's UCX (scripts/setup-ucx.sh)"
                } else {
                    ""
                },
            ));
        }
        Err(e) => checks.push(check("ucx.memory_types", Verdict::Warn, e.to_string(), "")),
    }
    drop(ctx);
    match &opts.self_test_exe {
        Some(exe) => self_test(ucx, exe, opts.ucx_lib.as_deref(), checks),
        None => {
            checks.push(check("ucx.zero_copy_get", Verdict::Warn, "self-test skipped", "drop --no-self-test"))
        }
    }
}

/// `resource N : md M dev D flags -- tl/dev` lines of `ucp_context_print_info`.
pub fn parse_resources(info: &str) -> Vec<String> {
    info.lines()
        .filter(|l| l.contains("resource"))
        .filter_map(|l| l.rsplit_once("--").map(|(_, r)| r.trim().to_string()))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Reads 1 MiB from a target process that does not progress its worker: if the read
/// completes, GETs from user memory are one-sided (cma zero-copy); if it times out, UCX
/// emulates them and needs the target's progress. Then, with the target progressing,
/// shows which transports an endpoint in error-handling mode `peer` gets.
fn self_test(ucx: &Ucx, exe: &Path, ucx_lib: Option<&Path>, checks: &mut Vec<Check>) {
    let result = (|| -> Result<(String, bool, Result<String, String>), xfer::XferError> {
        let target = LocalTarget::spawn(
            exe,
            &TargetOptions { ucx_lib: ucx_lib.map(Path::to_path_buf), ..Default::default() },
            &[],
        )?;
        let mut child = target.child;
        let req = TargetRequest {
            region_bytes: 1 << 20,
            ucx_alloc: false,
            huge_pages: false,
            mem: MemPlace::Host,
            progress: false,
            max_serve_secs: 60,
            cuda_batch: false,
            nixl: false,
            nixl_progress_thread: false,
            nixl_err_mode: ErrMode::None,
        };
        let opts = SessionOptions { ucx_lib: ucx_lib.map(Path::to_path_buf), ..Default::default() };
        let out = (|| {
            let mut s = Session::establish(target.stream, &req, &opts)?;
            let mut local =
                MemRegion::register(&s.ctx, memory::HostBuffer::alloc(1 << 20, memory::PageSize::Normal)?)?;
            let read = s.remote.read_batch(
                &mut local,
                [ReadDesc { local_off: 0, remote_off: 0, len: 1 << 20 }],
                &ReadOptions { max_inflight: 1, timeout: Duration::from_secs(1) },
            );
            let one_sided = match read {
                Ok(_) => true,
                Err(UcxError::Timeout { .. }) => false,
                Err(e) => return Err(e.into()),
            };
            s.control(Control::Resume)?;
            let peer = Endpoint::connect(&s.worker, &s.hello.worker_address, ErrMode::Peer)
                .and_then(|ep| ep.transports())
                .map_err(|e| e.to_string());
            let transports = s.transports.clone();
            // `local` may be poisoned (the read above timed out); it is leaked, not freed.
            drop(local);
            let _ = s.finish();
            Ok((transports, one_sided, peer))
        })();
        xfer::reap(&mut child, Duration::from_secs(5));
        out
    })();
    match result {
        Ok((transports, one_sided, peer)) => {
            let (major, minor, _) = ucx.version_triple();
            checks.push(if one_sided {
                check(
                    "ucx.zero_copy_get",
                    Verdict::Ok,
                    format!("GET from user memory is one-sided (completed while the target was idle; transports {transports})"),
                    "",
                )
            } else {
                check(
                    "ucx.zero_copy_get",
                    Verdict::Warn,
                    format!(
                        "GET from user memory is emulated in software by UCX {major}.{minor} (transports {transports}): \
                         the target must progress, and reads are slower"
                    ),
                    "run scripts/setup-ucx.sh for a UCX with cma zero-copy GET",
                )
            });
            checks.push(match peer {
                Ok(t) => {
                    let shm_gone = !t.contains("posix") && !t.contains("sysv");
                    check(
                        "ucx.err_mode",
                        Verdict::Ok,
                        format!(
                            "--err-mode none: {transports}; --err-mode peer: {t}{}",
                            if shm_gone { " (shared memory excluded)" } else { "" }
                        ),
                        if shm_gone { "peer mode detects dead peers but gives up shared memory" } else { "" },
                    )
                }
                Err(e) => check(
                    "ucx.err_mode",
                    Verdict::Warn,
                    format!("--err-mode none: {transports}; --err-mode peer: no endpoint ({e})"),
                    "peer mode needs a transport with peer-failure detection (tcp); keep --err-mode none or allow tcp in UCX_TLS",
                ),
            });
        }
        Err(e) => checks.push(check(
            "ucx.zero_copy_get",
            Verdict::Warn,
            format!("self-test failed: {e}"),
            "run `kvx xfer --sizes 64KiB --iters 5` to see the error in context",
        )),
    }
}

fn ptrace_check() -> Check {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => check("cma.ptrace", Verdict::Ok, "no Yama ptrace restriction", ""),
        Ok(s) if s.trim() == "0" => check("cma.ptrace", Verdict::Ok, "ptrace_scope 0", ""),
        Ok(s) => check(
            "cma.ptrace",
            Verdict::Warn,
            format!("ptrace_scope {}", s.trim()),
            "cma (process_vm_readv) between unrelated processes may be refused: sysctl kernel.yama.ptrace_scope=0",
        ),
    }
}

/// What kvx found out about CUDA on this host: the input of [`cuda_findings`].
#[derive(Debug, Clone)]
pub struct CudaFacts {
    /// kvx was built with the `cuda` feature.
    pub built: bool,
    /// The driver and its devices, or why there is none (e.g. no libcuda).
    pub driver: Result<DriverInfo, String>,
    /// What the loaded UCX offers for CUDA (None: UCX did not load).
    pub ucx: Option<UcxCudaFacts>,
    /// The two-process read of device memory.
    pub ipc: IpcFact,
    /// `UCX_CUDA_IPC_ENABLE_GET_ZCOPY` as set in the environment.
    pub get_zcopy_env: Option<String>,
    /// Active NVLink links per GPU (NVML), or why unknown.
    pub nvlink: Result<Vec<u32>, String>,
}

/// The loaded UCX's CUDA support, from a context with a CUDA context current when a
/// device exists.
#[derive(Debug, Clone)]
pub struct UcxCudaFacts {
    pub version: String,
    /// `cuda_copy/cuda`, `cuda_ipc/cuda`, `gdr_copy/...` resources.
    pub cuda_transports: Vec<String>,
    /// `cuda` among the context's memory types (it can register device memory).
    pub cuda_memory: bool,
}

/// The outcome of reading device memory from a second kvx process.
#[derive(Debug, Clone)]
pub enum IpcFact {
    /// Not attempted, and why.
    NotRun(String),
    /// Attempted and failed.
    Failed(String),
    /// 1 MiB read and verified; the protocols UCX chose.
    Read(ProtoReport),
}

fn cuda_facts(ucx: Option<&Ucx>, opts: &DoctorOptions) -> CudaFacts {
    let driver = cuda::driver_info().map_err(|e| match e {
        cuda::CudaError::NoDriver => "no libcuda (the NVIDIA driver is not installed)".to_string(),
        cuda::CudaError::NotBuilt => "kvx was built without the cuda feature".to_string(),
        other => other.to_string(),
    });
    let has_device = driver.as_ref().is_ok_and(|d| !d.devices.is_empty());
    let ucx_facts = ucx.map(|ucx| {
        let opts = ContextOptions { cuda_device: has_device.then_some(0), ..Default::default() };
        let version = ucx.info().version;
        match Context::new(ucx, &opts) {
            Ok(ctx) => {
                let resources = ctx.print_info().map(|t| parse_resources(&t)).unwrap_or_default();
                UcxCudaFacts {
                    version,
                    cuda_transports: resources
                        .into_iter()
                        .filter(|r| r.starts_with("cuda") || r.starts_with("gdr"))
                        .collect(),
                    cuda_memory: ctx.memory_types().is_ok_and(|t| t.contains(&"cuda")),
                }
            }
            // NoCudaSupport and friends: the UCX cannot do device memory.
            Err(_) => UcxCudaFacts { version, cuda_transports: Vec::new(), cuda_memory: false },
        }
    });
    let ipc = match (&driver, &ucx_facts, &opts.self_test_exe) {
        (Err(e), _, _) => IpcFact::NotRun(format!("not available: {e}")),
        (Ok(_), _, _) if !has_device => IpcFact::NotRun("not available: no CUDA device".into()),
        (_, None, _) => IpcFact::NotRun("not available: UCX did not load".into()),
        (_, Some(u), _) if !u.cuda_memory => {
            IpcFact::NotRun("not available: this UCX cannot register CUDA memory".into())
        }
        (_, _, None) => IpcFact::NotRun("skipped (--no-self-test)".into()),
        (_, _, Some(exe)) => match cuda_ipc_probe(exe, opts.ucx_lib.as_deref()) {
            Ok(p) => IpcFact::Read(p),
            Err(e) => IpcFact::Failed(e),
        },
    };
    CudaFacts {
        built: cfg!(feature = "cuda"),
        driver,
        ucx: ucx_facts,
        ipc,
        get_zcopy_env: std::env::var(CUDA_IPC_GET_ZCOPY_ENV).ok(),
        nvlink: cuda::nvlink_active_links(),
    }
}

/// Runs `kvx xfer --mem cuda` for one 1 MiB read of device 0's memory between two kvx
/// processes (it records UCX's protocols itself), verified, and returns the protocols.
fn cuda_ipc_probe(exe: &Path, ucx_lib: Option<&Path>) -> Result<ProtoReport, String> {
    const DEADLINE: Duration = Duration::from_secs(120);
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let out_path = dir.path().join("xfer.json");
    let err_path = dir.path().join("xfer.err");
    let file = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        "xfer",
        "--mem",
        "cuda",
        "--device",
        "0",
        "--sizes",
        "1MiB",
        "--inflight",
        "1",
        "--iters",
        "2",
    ])
    .args(["--working-set", "1MiB", "--duration", "1ms", "--format", "json"]);
    if let Some(lib) = ucx_lib {
        cmd.arg("--ucx-lib").arg(lib);
    }
    cmd.stdin(std::process::Stdio::null()).stdout(file(&out_path)?).stderr(file(&err_path)?);
    let mut child = cmd.spawn().map_err(|e| format!("starting {}: {e}", exe.display()))?;
    let deadline = std::time::Instant::now() + DEADLINE;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() >= deadline => {
                xfer::reap(&mut child, Duration::ZERO);
                return Err(format!("kvx xfer --mem cuda did not finish within {DEADLINE:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for kvx xfer: {e}")),
        }
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    if !status.success() {
        let why = stderr.lines().rev().find(|l| l.starts_with("error:")).unwrap_or(stderr.trim());
        return Err(format!("kvx xfer --mem cuda exited {status}: {why}"));
    }
    let text = std::fs::read_to_string(&out_path).map_err(|e| format!("reading its report: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("its report is not JSON: {e}"))?;
    let verified = v["results"][0]["verified_bytes"].as_u64().unwrap_or(0);
    if verified < 1 << 20 {
        return Err(format!("the read was not verified ({verified} bytes)"));
    }
    serde_json::from_value(v["ucx"]["protocols"].clone()).map_err(|e| format!("its protocols: {e}"))
}

/// Judges the CUDA facts: driver, devices, UCX's CUDA support, the two-process read,
/// GET zero-copy and NVLink, each ok / warn / missing with what to do.
pub fn cuda_findings(f: &CudaFacts) -> Vec<Check> {
    let mut out = Vec::new();
    let no_cuda = match (&f.driver, f.built) {
        (_, false) => Some("not available: kvx was built without the cuda feature".to_string()),
        (Err(e), true) => Some(format!("not available: {e}")),
        (Ok(_), true) => None,
    };
    let details = cuda_details(f, &no_cuda);
    // One line that sums the others up: --mem cuda works here or not.
    let gpu_host = no_cuda.is_none() && f.driver.as_ref().is_ok_and(|d| !d.devices.is_empty());
    let lacking: Vec<&str> = details.iter().filter(|c| c.verdict != Verdict::Ok).map(|c| c.name).collect();
    out.push(match (&no_cuda, gpu_host, lacking.is_empty()) {
        (Some(why), _, _) => {
            check("cuda", Verdict::Ok, format!("host memory only: {why}"), "see cuda.driver")
        }
        (None, false, _) => check("cuda", Verdict::Ok, "host memory only: no CUDA device", ""),
        (None, true, true) => check("cuda", Verdict::Ok, "--mem cuda ready (cuda_ipc zero-copy reads)", ""),
        (None, true, false) => check(
            "cuda",
            Verdict::Warn,
            format!("--mem cuda limited: see {}", lacking.join(", ")),
            "follow the hints of those lines",
        ),
    });
    out.extend(details);
    out
}

fn cuda_details(f: &CudaFacts, no_cuda: &Option<String>) -> Vec<Check> {
    let mut out = Vec::new();
    // Driver.
    out.push(match (&f.driver, f.built) {
        (_, false) => check(
            "cuda.driver",
            Verdict::Missing,
            "not available: kvx was built without the cuda feature",
            "cargo build --release (cuda is a default feature) for --mem cuda",
        ),
        (Err(e), true) => check(
            "cuda.driver",
            Verdict::Missing,
            format!("not available: {e}"),
            "install the NVIDIA driver (or run on a GPU host) for --mem cuda; host memory works without it",
        ),
        (Ok(d), true) => {
            check("cuda.driver", Verdict::Ok, format!("driver for CUDA {}", d.version_string()), "")
        }
    });
    // Devices.
    let devices = f.driver.as_ref().map(|d| d.devices.as_slice()).unwrap_or(&[]);
    out.push(match no_cuda {
        Some(why) => check("cuda.devices", Verdict::Missing, why.clone(), "--mem cuda needs a GPU"),
        None if devices.is_empty() => check(
            "cuda.devices",
            Verdict::Missing,
            "the driver reports no CUDA device",
            "--mem cuda needs a GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
        ),
        None => check(
            "cuda.devices",
            Verdict::Ok,
            devices
                .iter()
                .map(|d| {
                    format!(
                        "{}: {} ({:.1} GiB)",
                        d.ordinal,
                        d.name,
                        d.total_mem_bytes as f64 / (1u64 << 30) as f64
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            "",
        ),
    });
    // UCX with CUDA.
    const UCX_FIX: &str = "use a UCX built with CUDA: --ucx-lib (or KVX_UCX_LIB) pointing at libucx/lib/libucp.so.0 \
                           of the PyPI wheel libucx-cu12 or libucx-cu13 (scripts/setup-ucx.sh installs one)";
    out.push(match (&f.ucx, no_cuda) {
        (None, _) => {
            check("cuda.ucx", Verdict::Missing, "not available: UCX did not load", "see ucx.library")
        }
        (Some(u), Some(why)) => check(
            "cuda.ucx",
            Verdict::Missing,
            format!(
                "{why} (UCX {} loads its CUDA transports only where libcuda is; transports seen: {})",
                u.version,
                if u.cuda_transports.is_empty() { "none".to_string() } else { u.cuda_transports.join(", ") }
            ),
            "",
        ),
        (Some(u), None) if u.cuda_memory && u.cuda_transports.iter().any(|t| t.starts_with("cuda_ipc")) => {
            check(
                "cuda.ucx",
                Verdict::Ok,
                format!(
                    "UCX {} registers CUDA memory; transports {}",
                    u.version,
                    u.cuda_transports.join(", ")
                ),
                "",
            )
        }
        (Some(u), None) if u.cuda_memory => check(
            "cuda.ucx",
            Verdict::Warn,
            format!(
                "UCX {} registers CUDA memory but has no cuda_ipc transport (transports: {}): reads between \
                 processes on one host are not zero-copy",
                u.version,
                if u.cuda_transports.is_empty() { "none".to_string() } else { u.cuda_transports.join(", ") }
            ),
            UCX_FIX,
        ),
        (Some(u), None) => check(
            "cuda.ucx",
            Verdict::Missing,
            format!(
                "UCX {} cannot register CUDA memory (built without CUDA, or its CUDA module did not load)",
                u.version
            ),
            UCX_FIX,
        ),
    });
    // Two-process read.
    out.push(match &f.ipc {
        IpcFact::NotRun(why) => check(
            "cuda.ipc",
            Verdict::Missing,
            why.clone(),
            if why.contains("--no-self-test") { "drop --no-self-test" } else { "" },
        ),
        IpcFact::Failed(e) => check(
            "cuda.ipc",
            Verdict::Warn,
            format!("reading device memory from a second process failed: {e}"),
            "run `kvx xfer --mem cuda --sizes 1MiB --iters 3` to see the error in context",
        ),
        IpcFact::Read(p) => {
            let gets: Vec<_> = p.device_uses(crate::transfer::ucx::Rma::Get).collect();
            if gets.iter().any(|u| u.emulated) {
                check(
                    "cuda.ipc",
                    Verdict::Warn,
                    format!("device memory read and verified, but by software emulation: {}", p.summary()),
                    "see `kvx xfer --mem cuda` warnings: CUDA context before UCX, exportable memory, \
                     UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, a CUDA-enabled UCX",
                )
            } else if gets.iter().any(|u| u.choices.iter().any(|c| c.config.contains("cuda_ipc"))) {
                check("cuda.ipc", Verdict::Ok, format!("1 MiB read and verified: {}", p.summary()), "")
            } else {
                check(
                    "cuda.ipc",
                    Verdict::Warn,
                    format!("1 MiB read and verified, but not over cuda_ipc: {}", p.summary()),
                    "cuda_ipc needs both processes on one host with CUDA IPC allowed (same container or --ipc=host)",
                )
            }
        }
    });
    // GET zero-copy.
    let nvlink_any = f.nvlink.as_ref().ok().map(|l| l.iter().any(|&n| n > 0));
    let nvlink_words = match nvlink_any {
        Some(true) => "NVLink present",
        Some(false) => "no NVLink",
        None => "NVLink unknown",
    };
    out.push(match (f.get_zcopy_env.as_deref().map(str::to_ascii_lowercase).as_deref(), no_cuda) {
        (_, Some(why)) => check("cuda.get_zcopy", Verdict::Missing, why.clone(), ""),
        (Some("y" | "yes" | "on" | "1"), None) => check(
            "cuda.get_zcopy",
            Verdict::Ok,
            format!("on: {CUDA_IPC_GET_ZCOPY_ENV}=y in the environment ({nvlink_words})"),
            "",
        ),
        (Some("n" | "no" | "off" | "0"), None) => check(
            "cuda.get_zcopy",
            Verdict::Warn,
            format!("off: {CUDA_IPC_GET_ZCOPY_ENV}=n in the environment; cuda_ipc READs are not zero-copy"),
            format!("unset {CUDA_IPC_GET_ZCOPY_ENV} (kvx then sets y for --mem cuda)"),
        ),
        (Some(v), None) if nvlink_any == Some(true) => check(
            "cuda.get_zcopy",
            Verdict::Ok,
            format!("on: {CUDA_IPC_GET_ZCOPY_ENV}={v} and NVLink present"),
            "",
        ),
        (Some(v), None) => check(
            "cuda.get_zcopy",
            Verdict::Warn,
            format!(
                "off where UCX sees no NVLink: {CUDA_IPC_GET_ZCOPY_ENV}={v} in the environment ({nvlink_words}), \
                 and kvx does not override a value the user set"
            ),
            format!("unset {CUDA_IPC_GET_ZCOPY_ENV} (kvx then sets y for --mem cuda) or set it to y"),
        ),
        (None, None) => check(
            "cuda.get_zcopy",
            Verdict::Ok,
            format!(
                "on for --mem cuda: kvx sets {CUDA_IPC_GET_ZCOPY_ENV}=y (UCX's auto would turn it off without \
                 NVLink; {nvlink_words})"
            ),
            "",
        ),
    });
    // NVLink.
    out.push(match (&f.nvlink, no_cuda) {
        (_, Some(why)) => check("cuda.nvlink", Verdict::Missing, why.clone(), ""),
        (Err(e), None) => check(
            "cuda.nvlink",
            Verdict::Missing,
            format!("unknown: {e}"),
            "NVML ships with the NVIDIA driver (libnvidia-ml.so.1)",
        ),
        (Ok(links), None) if links.iter().any(|&n| n > 0) => check(
            "cuda.nvlink",
            Verdict::Ok,
            format!(
                "present (NVML): active links per GPU {}",
                links.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
            ),
            "",
        ),
        (Ok(_), None) => check(
            "cuda.nvlink",
            Verdict::Ok,
            "none (NVML): GPUs talk over PCIe, or there is one GPU; cuda_ipc GET zero-copy then needs \
             UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y, which kvx sets",
            "",
        ),
    });
    out
}

fn huge_pages_check() -> Check {
    let total = memory::huge_pages_total().unwrap_or(0);
    let free = memory::huge_pages_free().unwrap_or(0);
    let size = memory::huge_page_size().map_or("?".into(), |b| format!("{}KiB", b / 1024));
    let thp = memory::thp_available();
    if total > 0 {
        check("huge_pages", Verdict::Ok, format!("{free} free of {total} hugetlb pages of {size}"), "")
    } else if thp {
        check(
            "huge_pages",
            Verdict::Ok,
            "no hugetlb pages reserved; transparent huge pages on request",
            "--huge-pages uses THP; reserve hugetlb pages with sysctl vm.nr_hugepages=N",
        )
    } else {
        check(
            "huge_pages",
            Verdict::Warn,
            "none reserved and THP disabled",
            "sysctl vm.nr_hugepages=N for --huge-pages",
        )
    }
}

fn ports_check(base: u16, n: u16) -> Check {
    let mut taken = Vec::new();
    let last = base.saturating_add(n.saturating_sub(1));
    for p in base..=last {
        if TcpListener::bind(("0.0.0.0", p)).is_err() {
            taken.push(p.to_string());
        }
    }
    if taken.is_empty() {
        check("side_channel.ports", Verdict::Ok, format!("{base}..={last} free"), "")
    } else {
        check(
            "side_channel.ports",
            Verdict::Warn,
            format!("{base}..={last}: taken {}", taken.join(", ")),
            "pick another base with --side-channel-port (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT)",
        )
    }
}

/// NIXL (`--transport nixl`): found or not, its version against the one kvx is tested with,
/// its plugins, and whether its UCX backend can be created (and with which parameters). NIXL
/// is needed by `--transport nixl` only, so its absence is "missing", not a failure.
fn nixl_checks() -> Vec<Check> {
    use crate::transfer::nixl::{Agent, AgentOptions, Nixl, TESTED_VERSION};
    let nixl = match Nixl::load() {
        Ok(n) => n,
        Err(e) => {
            return vec![check(
                "nixl.library",
                Verdict::Missing,
                e.to_string(),
                "needed by --transport nixl only: run scripts/setup-nixl.sh (the nixl-cu12 wheel into .nixl/)",
            )];
        }
    };
    let info = nixl.info();
    let version = info.version.clone().unwrap_or_else(|| "version unknown".into());
    let mut out = vec![check(
        "nixl.library",
        if info.version.as_deref() == Some(TESTED_VERSION) { Verdict::Ok } else { Verdict::Warn },
        format!("NIXL {version} from {}", info.library.display()),
        if info.version.as_deref() == Some(TESTED_VERSION) {
            String::new()
        } else {
            format!("kvx is tested with NIXL {TESTED_VERSION} (scripts/setup-nixl.sh installs it)")
        },
    )];
    let opts = AgentOptions { progress_thread: false, ..AgentOptions::default() };
    match Agent::new(&nixl, &format!("kvx-doctor-{}", std::process::id()), &opts) {
        Ok(agent) => {
            let plugins = agent.plugins().map(|p| p.join(", ")).unwrap_or_else(|e| e.to_string());
            out.push(check("nixl.plugins", Verdict::Ok, plugins, ""));
            let backend = match agent.backend_info() {
                Ok(b) => {
                    let params = b.params.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
                    format!("UCX backend created: memory {}; {params}", b.mem_types.join(", "))
                }
                Err(e) => format!("UCX backend created; its parameters unreadable: {e}"),
            };
            let ucx = nixl
                .bundled_ucx_version()
                .map_or_else(|| "NIXL's own UCX: version unknown".into(), |v| format!("NIXL's own UCX {v}"));
            out.push(check("nixl.backend", Verdict::Ok, format!("{backend}; {ucx}"), ""));
        }
        Err(e) => out.push(check(
            "nixl.backend",
            Verdict::Warn,
            e.to_string(),
            "NIXL loaded but its UCX backend could not be created: check UCX_* variables and the wheel's plugins",
        )),
    }
    out
}

fn zmq_check() -> Check {
    let (a, b, c) = zmq::version();
    check("zmq", Verdict::Ok, format!("libzmq {a}.{b}.{c} (built into kvx)"), "")
}

/// Which launcher started this process and the index it gave, as `kvx worker` would take it.
fn launcher_check(l: &Result<Option<crate::vocab::launcher::Launcher>, crate::error::ConfigError>) -> Check {
    match l {
        Ok(Some(l)) => check("launcher", Verdict::Ok, l.describe(), ""),
        Ok(None) => check("launcher", Verdict::Ok, "none recognised (ranks come from --role/--rank)", ""),
        Err(e) => check(
            "launcher",
            Verdict::Fail,
            e.to_string(),
            "kvx worker and kvx bench refuse this environment (exit 2); see docs/kubernetes.md",
        ),
    }
}

fn env_check() -> Check {
    let mut set: Vec<String> = env::ALL
        .iter()
        .filter_map(|(name, _)| std::env::var(name).ok().map(|v| format!("{name}={v}")))
        .collect();
    // UCX's own knobs change what kvx measures, so they belong in the picture too.
    let mut ucx_vars: Vec<String> =
        std::env::vars().filter(|(k, _)| k.starts_with("UCX_")).map(|(k, v)| format!("{k}={v}")).collect();
    ucx_vars.sort();
    set.extend(ucx_vars);
    check(
        "env",
        Verdict::Ok,
        if set.is_empty() { "no KVX_* or UCX_* variables set".into() } else { set.join(" ") },
        "",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_facts() -> CudaFacts {
        CudaFacts {
            built: true,
            driver: Ok(DriverInfo {
                version: 13000,
                devices: vec![cuda::DeviceInfo {
                    ordinal: 0,
                    name: "NVIDIA H100 80GB HBM3".into(),
                    total_mem_bytes: 85_000_000_000,
                }],
                peer_access: vec![],
            }),
            ucx: Some(UcxCudaFacts {
                version: "1.22.0".into(),
                cuda_transports: vec!["cuda_copy/cuda".into(), "cuda_ipc/cuda".into()],
                cuda_memory: true,
            }),
            ipc: IpcFact::Read(ProtoReport {
                uses: crate::transfer::ucx::summarize_protocols(&crate::transfer::ucx::parse_log(
                    "| remote memory read by ucp_get* into cuda/GPU0 from cuda/dev[0] |\n| 0..inf | zero-copy | cuda_ipc/cuda |\n",
                )),
                note: None,
            }),
            get_zcopy_env: None,
            nvlink: Ok(vec![0]),
        }
    }

    fn verdict(checks: &[Check], name: &str) -> (Verdict, String, String) {
        let c = checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name} in {checks:?}"));
        (c.verdict, c.detail.clone(), c.hint.clone())
    }

    #[test]
    fn the_launcher_line_names_it_and_a_refused_environment_fails_the_doctor() {
        use crate::vocab::launcher::Launcher;
        let c = launcher_check(&Ok(Some(Launcher::Grove {
            pod_index: 1,
            clique: "kvx-0-prefill".into(),
            set: "kvx".into(),
            set_index: 0,
            headless_service: "kvx-0.default.svc.cluster.local".into(),
        })));
        assert_eq!(c.verdict, Verdict::Ok);
        assert_eq!(
            c.detail,
            "Grove, GROVE_PCLQ_POD_INDEX=1, clique kvx-0-prefill, service kvx-0.default.svc.cluster.local"
        );
        assert_eq!(launcher_check(&Ok(None)).verdict, Verdict::Ok);
        let e = crate::error::ConfigError::new("LWS_LEADER_ADDRESS", "is not set, but LWS_WORKER_INDEX is");
        let c = launcher_check(&Err(e));
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.detail.contains("(change LWS_LEADER_ADDRESS)"), "{}", c.detail);
    }

    #[test]
    fn a_host_without_libcuda_gets_missing_lines_that_never_fail_the_doctor() {
        let f = CudaFacts {
            built: true,
            driver: Err("no libcuda (the NVIDIA driver is not installed)".into()),
            ucx: Some(UcxCudaFacts { version: "1.22.0".into(), cuda_transports: vec![], cuda_memory: false }),
            ipc: IpcFact::NotRun("not available: no libcuda (the NVIDIA driver is not installed)".into()),
            get_zcopy_env: None,
            nvlink: Err("NVML (libnvidia-ml.so.1) not loadable".into()),
        };
        let checks = cuda_findings(&f);
        assert_eq!(checks.len(), 7);
        assert_eq!(verdict(&checks, "cuda").0, Verdict::Ok, "a host without a GPU is fine for host memory");
        for c in checks.iter().filter(|c| c.name != "cuda") {
            assert_eq!(c.verdict, Verdict::Missing, "{c:?}");
            assert!(c.detail.contains("not available"), "{c:?}");
        }
        assert!(verdict(&checks, "cuda.driver").2.contains("install the NVIDIA driver"));
        let unbuilt = cuda_findings(&CudaFacts { built: false, ..f });
        assert!(verdict(&unbuilt, "cuda.driver").1.contains("cuda feature"));
        assert!(verdict(&unbuilt, "cuda.driver").2.contains("cargo build"));
    }

    #[test]
    fn a_gpu_host_with_cuda_ipc_zero_copy_is_all_ok() {
        let checks = cuda_findings(&gpu_facts());
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Ok, "{c:?}");
        }
        assert!(verdict(&checks, "cuda.devices").1.contains("H100"));
        assert!(verdict(&checks, "cuda.driver").1.contains("13.0"));
        assert!(verdict(&checks, "cuda.ipc").1.contains("zero-copy cuda_ipc/cuda"));
        let (_, zcopy, _) = verdict(&checks, "cuda.get_zcopy");
        assert!(zcopy.contains("kvx sets") && zcopy.contains("no NVLink"), "{zcopy}");
        assert!(verdict(&checks, "cuda.nvlink").1.contains("none"));
    }

    #[test]
    fn slow_paths_and_missing_pieces_on_a_gpu_host_say_what_to_fix() {
        // Software emulation (the H100 run of kvx 296e604).
        let mut f = gpu_facts();
        f.ipc = IpcFact::Read(ProtoReport {
            uses: crate::transfer::ucx::summarize_protocols(&crate::transfer::ucx::parse_log(
                "| remote memory read by ucp_get* into cuda/GPU0 from cuda |\n| 0..inf | software emulation | sysv/memory |\n",
            )),
            note: None,
        });
        let (v, detail, hint) = verdict(&cuda_findings(&f), "cuda.ipc");
        assert_eq!(v, Verdict::Warn);
        assert!(detail.contains("software emulation"), "{detail}");
        let (v, summary, _) = verdict(&cuda_findings(&f), "cuda");
        assert_eq!(v, Verdict::Warn);
        assert!(summary.contains("cuda.ipc"), "{summary}");
        assert!(hint.contains("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"), "{hint}");
        // A UCX without CUDA.
        let mut f = gpu_facts();
        f.ucx = Some(UcxCudaFacts { version: "1.13.1".into(), cuda_transports: vec![], cuda_memory: false });
        let (v, _, hint) = verdict(&cuda_findings(&f), "cuda.ucx");
        assert_eq!(v, Verdict::Missing);
        assert!(hint.contains("libucx-cu12"), "{hint}");
        // The user switched GET zero-copy off, or left it on auto without NVLink.
        let mut f = gpu_facts();
        f.get_zcopy_env = Some("n".into());
        assert_eq!(verdict(&cuda_findings(&f), "cuda.get_zcopy").0, Verdict::Warn);
        f.get_zcopy_env = Some("auto".into());
        let (v, detail, _) = verdict(&cuda_findings(&f), "cuda.get_zcopy");
        assert_eq!(v, Verdict::Warn);
        assert!(detail.contains("no NVLink"), "{detail}");
        f.nvlink = Ok(vec![18]);
        assert_eq!(verdict(&cuda_findings(&f), "cuda.get_zcopy").0, Verdict::Ok);
        assert!(verdict(&cuda_findings(&f), "cuda.nvlink").1.contains("18"));
        // No device, and a failed read.
        let mut f = gpu_facts();
        f.driver = Ok(DriverInfo { version: 12080, devices: vec![], peer_access: vec![] });
        assert_eq!(verdict(&cuda_findings(&f), "cuda.devices").0, Verdict::Missing);
        let mut f = gpu_facts();
        f.ipc = IpcFact::Failed("ucp_get_nbx completion failed: UCS_ERR_IO_ERROR".into());
        assert_eq!(verdict(&cuda_findings(&f), "cuda.ipc").0, Verdict::Warn);
    }

    #[test]
    fn resources_are_parsed_from_context_info() {
        let text = "#      resource 0  :  md 0  dev 0  flags -- self/memory\n#      resource 1  :  md 1  dev 1  flags -- tcp/lo\n#            md 0  :  component 0  self\n";
        assert_eq!(parse_resources(text), vec!["self/memory", "tcp/lo"]);
    }

    #[test]
    fn a_taken_port_is_reported() {
        let l = TcpListener::bind("0.0.0.0:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let c = ports_check(port, 1);
        assert_eq!(c.verdict, Verdict::Warn);
        assert!(c.detail.contains(&port.to_string()));
    }
}
