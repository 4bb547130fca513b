//! Device memory on a host that may have no GPU (CI): `--mem cuda` fails clearly, reports
//! name UCX's protocol, the doctor's CUDA lines never fail it, and the default build has
//! CUDA support. On a GPU host the same tests accept success (`scripts/gpu-check.sh` is
//! the acceptance run there).

use std::os::unix::process::CommandExt as _;
use std::time::Duration;

use assert_cmd::Command;

use crate::ucx_common::{Part, project_root, skip, ucx_builds};

const HARD_TIMEOUT: Duration = Duration::from_secs(120);

fn kvx() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvx"));
    c.timeout(HARD_TIMEOUT).env_remove("KVX_UCX_LIB").env_remove("KVX_UCX_DIR");
    c
}

/// `kvx bench` with `args` (split at spaces) and its results in a fresh directory: its output,
/// its stderr (never a panic), and the directory.
fn bench(args: &str) -> (std::process::Output, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("results dir");
    let out = kvx()
        .arg("bench")
        .args(args.split_whitespace())
        .arg("--results-dir")
        .arg(dir.path())
        .output()
        .expect("run kvx bench");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out, stderr, dir)
}

/// A run refused before it started: exit 2, said once, no report and no run directory.
fn assert_never_started(out: &std::process::Output, stderr: &str, dir: &tempfile::TempDir) {
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "said once, before any worker: {stderr}");
    assert!(out.stdout.is_empty(), "no report of a run that never started");
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0, "no run directory either");
}

/// A finished run's summary: `requests` ok, no wrong byte, no leaked block.
fn assert_verified(out: &std::process::Output, requests: u64) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["requests_ok"], requests, "{v}");
    assert_eq!(v["verify_failures"], 0, "{v}");
    assert_eq!(v["blocks_leaked"], 0, "{v}");
    v
}

/// What `--mem cuda` may name as missing: the feature, the driver, a device, a UCX with CUDA.
const MISSING: &[&str] = &["`cuda` feature", "libcuda", "CUDA device", "cannot register CUDA memory"];

#[test]
fn xfer_on_device_memory_without_a_gpu_exits_2_naming_what_is_missing() {
    let out = kvx()
        .args(["xfer", "--mem", "cuda", "--sizes", "64KiB", "--inflight", "1", "--iters", "2"])
        .args(["--working-set", "1MiB", "--format", "json"])
        .output()
        .expect("run kvx xfer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if out.status.success() {
        skip(
            Part::NoGpu,
            "this host has a GPU and a UCX with CUDA: --mem cuda ran (see scripts/gpu-check.sh)",
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["memory"]["kind"], "cuda");
        assert_eq!(v["ceiling"], "device_copy");
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(MISSING.iter().any(|m| stderr.contains(m)), "the message should name what is missing: {stderr}");
    assert!(out.stdout.is_empty(), "no partial report on stdout");
    // Every missing piece is named once, not repeated by the process that re-ran itself.
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
}

#[test]
fn xfer_reports_name_the_protocol_ucx_chose_on_each_build() {
    for (label, lib) in ucx_builds() {
        let lib = match lib {
            Ok(p) => p,
            Err(why) => {
                skip(Part::of_build(label), &format!("{label} UCX build: {why}"));
                continue;
            }
        };
        let out = kvx()
            .args(["xfer", "--sizes", "64KiB", "--inflight", "2", "--iters", "3", "--working-set", "1MiB"])
            .args(["--format", "json", "--ucx-lib"])
            .arg(&lib)
            .env_remove("UCX_PROTO_INFO")
            .env_remove("UCX_PROTO_INFO_DIR")
            .env_remove("UCX_LOG_FILE")
            .output()
            .expect("run kvx xfer");
        assert!(out.status.success(), "{label}: {}", String::from_utf8_lossy(&out.stderr));
        // UCX prints its protocol tables to its log; none may reach kvx's stdout.
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON report");
        let protocols = &v["ucx"]["protocols"];
        let uses = protocols["uses"].as_array().expect("uses");
        let version = v["ucx"]["version"].as_str().unwrap_or_default();
        if version.starts_with("1.13") {
            // UCX 1.13's protocol layer reports nothing: the report says so.
            assert!(uses.is_empty(), "{label}: {protocols}");
            assert!(protocols["note"].as_str().is_some_and(|n| n.contains("1.13")), "{label}: {protocols}");
        } else {
            let get =
                uses.iter().find(|u| u["op"] == "get").unwrap_or_else(|| panic!("{label}: {protocols}"));
            assert_eq!(get["emulated"], false, "{label}: {get}");
            if label == "project" {
                assert_eq!(get["choices"][0]["description"], "zero-copy", "{label}: {get}");
                assert_eq!(get["choices"][0]["config"], "cma/memory", "{label}: {get}");
            }
        }
        assert_eq!(v["ceiling"], "memcpy");
        assert_eq!(v["warnings"].as_array().map(Vec::len), Some(0), "host memory gets no protocol warning");
        let r = &v["results"][0];
        assert_eq!(r["ceiling_gbps"], r["memcpy_gbps"], "for host memory the ceiling is the memcpy");
    }
}

#[test]
fn doctor_cuda_lines_say_what_is_missing_and_never_fail_it() {
    let Some((_, Ok(lib))) = ucx_builds().into_iter().find(|(_, l)| l.is_ok()) else {
        skip(Part::Ucx, "no UCX build on this host");
        return;
    };
    let out = kvx().args(["doctor", "--format", "json", "--ucx-lib"]).arg(&lib).output().expect("run doctor");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let checks = v["checks"].as_array().expect("checks");
    for name in
        ["cuda", "cuda.driver", "cuda.devices", "cuda.ucx", "cuda.ipc", "cuda.get_zcopy", "cuda.nvlink"]
    {
        let c = checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no {name} in {v}"));
        let verdict = c["verdict"].as_str().unwrap_or_default();
        assert!(["ok", "warn", "missing"].contains(&verdict), "{c}");
        if verdict == "missing" {
            assert!(c["detail"].as_str().is_some_and(|d| !d.is_empty()), "{c}");
        }
    }
    assert_eq!(v["needed_missing"], false);
}

#[test]
fn the_default_build_includes_cuda_support() {
    let text = std::fs::read_to_string(project_root().join("Cargo.toml")).expect("Cargo.toml");
    let manifest: toml::Table = toml::from_str(&text).expect("toml");
    let default = manifest["features"]["default"].as_array().expect("a default feature list");
    assert!(default.iter().any(|f| f.as_str() == Some("cuda")), "{default:?}");
}

#[test]
fn bench_on_device_memory_without_a_gpu_exits_2_naming_what_is_missing() {
    let (out, stderr, dir) = bench(
        "--mem cuda --p-tp 2 --d-tp 1 --model llama-3.1-8b --requests 4 --prompt-len 256 --no-calibrate --format json",
    );
    if out.status.success() {
        skip(
            Part::NoGpu,
            "this host has a GPU and a UCX with CUDA: bench --mem cuda ran (see scripts/gpu-check.sh)",
        );
        let v = assert_verified(&out, 4);
        assert_eq!(v["scenario"]["mem"], "cuda:0");
        let uses = v["ucx"]["protocols"]["uses"].as_array().cloned().unwrap_or_default();
        assert!(
            uses.iter()
                .any(|u| u["op"] == "get" && u["local"].as_str().is_some_and(|l| l.starts_with("cuda")))
        );
        return;
    }
    assert!(MISSING.iter().any(|m| stderr.contains(m)), "the message should name what is missing: {stderr}");
    assert_never_started(&out, &stderr, &dir);
}

/// Without a GPU: exit 2 naming what is missing, before serving. With one: prefill and
/// decode engines keep their pools in device memory, and a request through the proxy reads
/// its KV from device to device, every byte verified, nothing left held.
#[test]
fn serve_engine_with_device_pools_serves_verified_kv_on_a_gpu_and_exits_2_without_one() {
    let engine = |role: &str, tp: &str| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_kvx"));
        c.args(["serve-engine", "--role", role, "--kv-backend", "workers", "--model", "llama-3.1-8b"])
            .args(["--layers", "2", "--model-name", "stub-model", "--tp", tp, "--max-model-len", "1024"])
            .args(["--mem", "cuda", "--devices", "0", "--port", "0", "--side-channel-port", "0"])
            .args(["--verify", "full", "--timeout", "10s"])
            .env_remove("KVX_UCX_LIB")
            .env_remove("KVX_UCX_DIR")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0);
        GroupProc::spawn(c)
    };
    let mut p = engine("prefill", "2");
    let addr_p = match p.first_line(Duration::from_secs(60)) {
        Ok(addr) => addr,
        Err(()) => {
            // No GPU here: the engine said why and stopped before serving.
            let (code, stderr) = p.finish(Duration::from_secs(30));
            assert_eq!(code, Some(2), "{stderr}");
            assert!(MISSING.iter().any(|m| stderr.contains(m)), "{stderr}");
            return;
        }
    };
    let mut d = engine("decode", "1");
    let addr_d = d
        .first_line(Duration::from_secs(60))
        .unwrap_or_else(|()| panic!("{}", d.finish(Duration::from_secs(5)).1));
    let mut x = {
        let (pp, dp) = (port(&addr_p), port(&addr_d));
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_kvx"));
        c.args(["serve-proxy", "--port", "0", "--prefiller-host", "127.0.0.1", "--prefiller-port", &pp])
            .args(["--decoder-host", "127.0.0.1", "--decoder-port", &dp])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0);
        GroupProc::spawn(c)
    };
    let addr_x = x
        .first_line(Duration::from_secs(30))
        .unwrap_or_else(|()| panic!("{}", x.finish(Duration::from_secs(5)).1));
    let prompt = (0..40).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let body = format!(r#"{{"model":"stub-model","prompt":"{prompt}","max_tokens":2}}"#);
    let reply = http(&addr_x, "POST", "/v1/completions", &body);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let metrics = http(&addr_d, "GET", "/metrics", "");
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
    };
    let labels = "{backend=\"workers\",kv_transfer=\"ucx\",role=\"decode\"}";
    let read = value(&format!("kvx:kv_bytes_read_total{labels}"));
    assert!(read > 0.0, "{metrics}");
    assert_eq!(value(&format!("kvx:kv_bytes_verified_total{labels}")), read, "every byte read was verified");
    assert_eq!(value(&format!("kvx:kv_verify_failures_total{labels}")), 0.0);
    for proc in [&mut x, &mut d, &mut p] {
        proc.signal(libc::SIGTERM);
        let (code, stderr) = proc.finish(Duration::from_secs(30));
        assert!(matches!(code, Some(0 | 143)), "{code:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// A kvx process in its own group: its first stdout line (`listening on http://ADDR`), then
/// its exit, both with deadlines; the group is killed on drop.
struct GroupProc {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl GroupProc {
    fn spawn(mut c: std::process::Command) -> GroupProc {
        let mut child = c.spawn().expect("spawn kvx");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
            let _ = tx.send(line);
        });
        GroupProc { child, lines }
    }

    /// The address it listens on, or `Err` if it ended (or printed nothing) first.
    fn first_line(&mut self, limit: Duration) -> Result<String, ()> {
        let line = self.lines.recv_timeout(limit).map_err(|_| ())?;
        line.trim().strip_prefix("listening on http://").map(str::to_string).ok_or(())
    }

    fn signal(&self, sig: i32) {
        let _ = std::process::Command::new("kill")
            .args(["-s", &sig.to_string(), "--", &format!("-{}", self.child.id())])
            .stderr(std::process::Stdio::null())
            .status();
    }

    /// Exit code and stderr, killing the group if it has not ended within `limit`.
    fn finish(&mut self, limit: Duration) -> (Option<i32>, String) {
        use wait_timeout::ChildExt as _;
        let status = match self.child.wait_timeout(limit).expect("wait") {
            Some(s) => s,
            None => {
                self.signal(libc::SIGKILL);
                self.child.wait().expect("wait")
            }
        };
        let mut stderr = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
        }
        (status.code(), stderr)
    }
}

impl Drop for GroupProc {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

fn port(addr: &str) -> String {
    addr.rsplit(':').next().unwrap_or_default().to_string()
}

/// One HTTP/1.1 request over a plain socket, with a hard timeout; the whole reply.
fn http(addr: &str, method: &str, path: &str, body: &str) -> String {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// Each mode names the operation that moves its KV: decode's GETs when pulling, prefill's PUTs
/// when pushing (recorded by the prefill ranks).
#[test]
fn bench_reports_name_the_protocol_ucx_chose_for_the_reads_or_writes() {
    for (label, lib) in ucx_builds() {
        let lib = match lib {
            Ok(p) => p,
            Err(why) => {
                skip(Part::of_build(label), &format!("{label} UCX build: {why}"));
                continue;
            }
        };
        for (mode, op) in [("pull", "get"), ("push", "put")] {
            let case = format!("{label}, --mode {mode}");
            let dir = tempfile::tempdir().expect("results dir");
            let out = kvx()
                .args(["bench", "--p-tp", "2", "--d-tp", "1", "--model", "llama-3.1-8b", "--requests", "3"])
                .args(["--prompt-len", "256", "--no-calibrate", "--format", "json", "--mode", mode])
                .arg("--results-dir")
                .arg(dir.path())
                .arg("--ucx-lib")
                .arg(&lib)
                .env_remove("UCX_PROTO_INFO")
                .env_remove("UCX_PROTO_INFO_DIR")
                .env_remove("UCX_LOG_FILE")
                .output()
                .expect("run kvx bench");
            assert!(out.status.success(), "{case}: {}", String::from_utf8_lossy(&out.stderr));
            let v: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("stdout is one JSON summary");
            let protocols = &v["ucx"]["protocols"];
            let uses = protocols["uses"].as_array().unwrap_or_else(|| panic!("{case}: {v}"));
            if v["ucx"]["version"].as_str().unwrap_or_default().starts_with("1.13") {
                assert!(uses.is_empty(), "{case}: {protocols}");
                assert!(
                    protocols["note"].as_str().is_some_and(|n| n.contains("1.13")),
                    "{case}: {protocols}"
                );
            } else {
                // One-sided operations only (notifications' active messages are left out).
                assert!(uses.iter().all(|u| u["op"] == "get" || u["op"] == "put"), "{case}: {protocols}");
                let used =
                    uses.iter().find(|u| u["op"] == op).unwrap_or_else(|| panic!("{case}: {protocols}"));
                assert_eq!(used["emulated"], false, "{case}: {used}");
            }
            assert!(v.get("warnings").is_none(), "host memory gets no protocol warning: {v}");
        }
    }
}

/// What `--transport cuda-batch` may name as missing on a host without a GPU: the feature,
/// the driver, a device.
const BATCH_MISSING: &[&str] = &["`cuda` feature", "libcuda", "CUDA device"];

#[test]
fn bench_over_cuda_batch_without_a_gpu_exits_2_naming_what_is_missing() {
    let (out, stderr, dir) = bench(
        "--transport cuda-batch --mem cuda --p-tp 2 --d-tp 1 --model llama-3.1-8b --requests 4 --prompt-len 256 --no-calibrate --format json",
    );
    if out.status.success() {
        skip(Part::NoGpu, "this host has a GPU: bench --transport cuda-batch ran (see scripts/gpu-check.sh)");
        let v = assert_verified(&out, 4);
        assert_eq!(v["scenario"]["transport"], "cuda-batch");
        let paths = v["cuda_batch"]["paths"].as_array().cloned().unwrap_or_default();
        assert!(!paths.is_empty(), "the summary names the batch path: {v}");
        return;
    }
    assert!(BATCH_MISSING.iter().any(|m| stderr.contains(m)), "names what is missing: {stderr}");
    assert!(stderr.contains("cuda-batch"), "says which transport needs it: {stderr}");
    assert_never_started(&out, &stderr, &dir);
}

/// A hybrid model over cuda-batch: every byte of attention KV and Mamba state copied between
/// device pools and checked by meaning where a GPU is at hand; without one, exit 2 before any
/// run, naming what is missing (not a refusal of the hybrid model).
#[test]
fn a_hybrid_model_over_cuda_batch_verifies_on_a_gpu_or_exits_2_naming_what_is_missing() {
    let (out, stderr, dir) = bench(
        "--transport cuda-batch --mem cuda --p-tp 2 --d-tp 1 --model nemotron-h-8b --requests 2 --prompt-len 512 --verify full --no-calibrate --format json",
    );
    if out.status.success() {
        skip(
            Part::NoGpu,
            "this host has a GPU: a hybrid bench over cuda-batch ran (see scripts/gpu-check.sh)",
        );
        let v = assert_verified(&out, 2);
        assert_eq!(v["scenario"]["transport"], "cuda-batch");
        assert_eq!(v["bytes_verified"], v["bytes_read"], "every byte read is checked: {v}");
        return;
    }
    assert!(BATCH_MISSING.iter().any(|m| stderr.contains(m)), "names what is missing: {stderr}");
    assert!(!stderr.contains("is a hybrid model"), "the model is not what is refused: {stderr}");
    assert_never_started(&out, &stderr, &dir);
}

#[test]
fn comparing_ucx_with_cuda_batch_without_a_gpu_exits_2_before_any_run() {
    let dir = tempfile::tempdir().expect("results dir");
    let out = kvx()
        .args(["bench", "--compare-transports", "ucx,cuda-batch", "--mem", "cuda", "--p-tp", "2"])
        .args(["--d-tp", "1", "--model", "llama-3.1-8b", "--requests", "2", "--prompt-len", "256"])
        .args(["--no-calibrate", "--results-dir"])
        .arg(dir.path())
        .output()
        .expect("run kvx bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        skip(Part::NoGpu, "this host has a GPU: the comparison ran (see scripts/gpu-check.sh)");
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(MISSING.iter().any(|m| stderr.contains(m)), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "said once, before any run: {stderr}");
    assert!(!stderr.contains("[P0]"), "no worker started: {stderr}");
}

#[test]
fn xfer_over_cuda_batch_without_a_gpu_exits_2_naming_what_is_missing() {
    let out = kvx()
        .args(["xfer", "--transport", "cuda-batch", "--mem", "cuda", "--sizes", "8KiB,64KiB"])
        .args(["--inflight", "64", "--iters", "2", "--working-set", "4MiB", "--format", "json"])
        .output()
        .expect("run kvx xfer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if out.status.success() {
        skip(Part::NoGpu, "this host has a GPU: xfer --transport cuda-batch ran (see scripts/gpu-check.sh)");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(v["transport"], "cuda-batch");
        assert_eq!(v["ceiling"], "device_copy");
        assert!(v["cuda_batch"]["path"].is_string(), "{v}");
        for r in v["results"].as_array().expect("results") {
            assert!(r["verified_bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        }
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(BATCH_MISSING.iter().any(|m| stderr.contains(m)), "names what is missing: {stderr}");
    assert!(stderr.contains("cuda-batch"), "{stderr}");
    assert_eq!(stderr.matches("error:").count(), 1, "{stderr}");
    assert!(out.stdout.is_empty(), "no partial report on stdout");
}

#[test]
fn cuda_batch_on_host_memory_exits_2_naming_mem() {
    let dir = tempfile::tempdir().expect("results dir");
    let bench = kvx()
        .args(["bench", "--transport", "cuda-batch", "--requests", "2", "--no-calibrate", "--results-dir"])
        .arg(dir.path())
        .output()
        .expect("run kvx bench");
    let xfer =
        kvx().args(["xfer", "--transport", "cuda-batch", "--sizes", "8KiB"]).output().expect("run xfer");
    for (what, out) in [("bench", bench), ("xfer", xfer)] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        // A kvx built without the cuda feature names the feature (and --transport) first.
        assert!(
            stderr.contains("--mem cuda") && stderr.contains("(change --mem)")
                || stderr.contains("`cuda` feature"),
            "{what}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{what}");
    }
    // The other machine-bound refusals name their flags too.
    for (args, flag) in [
        (
            vec!["bench", "--transport", "cuda-batch", "--mem", "cuda", "--advertise-host", "10.9.8.7"],
            "--advertise-host",
        ),
        (vec!["bench", "--transport", "cuda-batch", "--mem", "cuda", "--mode", "push"], "--transport"),
        (
            vec!["xfer", "--transport", "cuda-batch", "--mem", "cuda", "--connect", "10.9.8.7:5700"],
            "--connect",
        ),
    ] {
        let mut cmd = kvx();
        cmd.args(&args);
        if args[0] == "bench" {
            cmd.arg("--results-dir").arg(dir.path());
        }
        let out = cmd.output().expect("run kvx");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("(change {flag})")) || stderr.contains("`cuda` feature"),
            "{args:?}: {stderr}"
        );
    }
}
