//! `kvx doctor`: what kvx sees on this host, one [`Check`] per item with a verdict and a
//! hint — the UCX library and its transports, memory types, whether a GET from user
//! memory is truly one-sided (a self-test against a target that does not progress),
//! the error-handling mode's effect, CUDA, huge pages, side-channel ports, ZMQ, and the
//! environment.
//!
//! Owns: gathering the checks. Must not print: `cli::doctor` renders them.
#![forbid(unsafe_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use super::memory;
use super::ucx::{
    Context, ContextOptions, Endpoint, ErrMode, MemRegion, ReadDesc, ReadOptions, Ucx, UcxError,
};
use super::xfer::{
    self, Control, LocalTarget, MemKind, Session, SessionOptions, TargetOptions, TargetRequest,
};
use crate::settings::env;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
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
}

/// The whole report; `needed_missing` is true when kvx cannot work on this host.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorReport {
    pub checks: Vec<Check>,
    pub needed_missing: bool,
}

pub fn run(opts: &DoctorOptions) -> DoctorReport {
    let mut checks = Vec::new();
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
        }
        Err(e) => checks.push(check(
            "ucx.library",
            Verdict::Fail,
            e.to_string(),
            "run scripts/setup-ucx.sh (modern UCX into .ucx/) or apt-get install libucx0, or pass --ucx-lib",
        )),
    }
    checks.push(ptrace_check());
    checks.push(cuda_check());
    checks.push(huge_pages_check());
    checks.push(ports_check(opts.side_channel_port, opts.ports));
    checks.push(zmq_check());
    checks.push(env_check());
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
            let cuda_driver = matches!(memory::cuda_devices(), Ok(n) if n > 0);
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
            mem: MemKind::Host,
            device: 0,
            progress: false,
            max_serve_secs: 60,
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

fn cuda_check() -> Check {
    match memory::cuda_devices() {
        Ok(0) => check("cuda", Verdict::Warn, "driver present, no devices", "--mem cuda needs a GPU"),
        Ok(n) => check("cuda", Verdict::Ok, format!("{n} device(s)"), ""),
        Err(memory::MemoryError::CudaNotBuilt) => check(
            "cuda",
            Verdict::Ok,
            "not built with CUDA support (host memory only)",
            "cargo build --features cuda for --mem cuda",
        ),
        Err(e) => check("cuda", Verdict::Ok, format!("unavailable: {e}"), "host memory only on this machine"),
    }
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

fn zmq_check() -> Check {
    let (a, b, c) = zmq::version();
    check("zmq", Verdict::Ok, format!("libzmq {a}.{b}.{c} (built into kvx)"), "")
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
