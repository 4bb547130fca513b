//! `kvx bench` across hosts, here: two network namespaces joined by a veth pair stand for two
//! hosts. Prefill ranks run in one, decode ranks and the orchestrator in the other, UCX
//! moves the bytes over tcp on the veth link, and the workers are started by hand (`ip
//! netns exec NS kvx worker --connect ...`) as an operator or a launcher would.
//!
//! The orchestrator sits with the decode ranks, away from the prefill ranks, so a prefill
//! rank that advertised the orchestrator's address instead of its own (for the
//! notifications decode ranks send it) would be caught: its blocks would expire, not be
//! freed. Namespaces get names unique to the run and are deleted by a guard, also on panic.
//! Where they cannot be made (not root, no `ip`, EPERM) the test says `SKIPPED: why`.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::procs::{Spawned, bench_cmd, exclusive, kvx_path, n, read_rows, run_dir, summary_json};
use crate::ucx_common::{Part, skip};

pub const RUN_TIMEOUT: Duration = Duration::from_secs(180);
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Launcher variables a test runner itself may carry; they would override the ones a test sets.
const LAUNCHER_VARS: &[&str] = kvx::vocab::launcher::ALL;

/// Runs `ip ARGS` with a hard timeout; `Err` carries its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = assert_cmd::Command::new("ip")
        .args(args)
        .timeout(Duration::from_secs(20))
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// One side of the link: a namespace, its veth end and its address.
pub struct Side {
    pub ns: String,
    pub dev: String,
    pub addr: String,
}

/// Two namespaces joined by a veth pair; deleted on drop (which also removes the pair and
/// the namespaces' `/etc/netns/NS/` files).
pub struct TwoHosts {
    pub p: Side,
    pub d: Side,
    made: Vec<String>,
}

impl TwoHosts {
    pub fn create() -> Result<TwoHosts, String> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let (pid, seq) = (std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let id = format!("{pid}x{seq}");
        // Interface names are at most 15 bytes.
        let short = format!("{:x}", pid % 0x10_0000 * 16 + seq % 16);
        let subnet = format!("10.{}.{}", 100 + pid % 100, seq % 250);
        let mut hosts = TwoHosts {
            p: Side { ns: format!("kvx-p-{id}"), dev: format!("kvp{short}"), addr: format!("{subnet}.1") },
            d: Side { ns: format!("kvx-d-{id}"), dev: format!("kvd{short}"), addr: format!("{subnet}.2") },
            made: vec![],
        };
        for ns in [hosts.p.ns.clone(), hosts.d.ns.clone()] {
            ip(&["netns", "add", &ns])?;
            hosts.made.push(ns);
        }
        ip(&["link", "add", &hosts.p.dev, "type", "veth", "peer", "name", &hosts.d.dev])?;
        for side in [&hosts.p, &hosts.d] {
            let moved = ip(&["link", "set", &side.dev, "netns", &side.ns]);
            if let Err(e) = moved {
                // Not yet in a namespace, so deleting the namespaces would not remove it.
                let _ = ip(&["link", "del", &side.dev]);
                return Err(e);
            }
            ip(&["-n", &side.ns, "addr", "add", &format!("{}/24", side.addr), "dev", &side.dev])?;
            ip(&["-n", &side.ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &side.ns, "link", "set", &side.dev, "up"])?;
            // Some containers allow namespaces but not entering them (no /sys remount).
            ip(&["netns", "exec", &side.ns, "true"])?;
        }
        Ok(hosts)
    }

    /// `kvx ARGS` run inside `side`'s namespace, with UCX restricted to tcp on the veth link
    /// (both namespaces share one kernel, so UCX would otherwise pick shared memory).
    fn kvx(side: &Side, args: &[&str]) -> Command {
        let mut cmd = Self::exec(side, kvx_path().as_os_str());
        cmd.args(args);
        cmd
    }

    /// `program` run inside `side`'s namespace, UCX on tcp over the veth link, no launcher
    /// variables of the test runner's.
    pub fn exec(side: &Side, program: &std::ffi::OsStr) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &side.ns]).arg(program);
        cmd.env("UCX_TLS", "tcp").env("UCX_NET_DEVICES", &side.dev);
        for var in LAUNCHER_VARS {
            cmd.env_remove(var);
        }
        cmd
    }

    /// Names both namespaces resolve (`ip netns exec` mounts `/etc/netns/NS/hosts` over
    /// `/etc/hosts`): what cluster DNS gives the pods.
    pub fn hosts_file(&self, entries: &[(String, String)]) -> std::io::Result<()> {
        let text: String = entries.iter().map(|(name, addr)| format!("{addr} {name}\n")).collect();
        for ns in &self.made {
            let dir = std::path::Path::new("/etc/netns").join(ns);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(dir.join("hosts"), format!("127.0.0.1 localhost\n{text}"))?;
        }
        Ok(())
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.made {
            let _ = ip(&["netns", "del", ns]);
            let _ = std::fs::remove_dir_all(std::path::Path::new("/etc/netns").join(ns));
        }
    }
}

/// The endpoint in an engine's "waiting for workers" line.
fn endpoint(line: &str) -> String {
    line.split_whitespace().find(|w| w.starts_with("tcp://")).expect("an endpoint in the line").to_string()
}

/// Checks a run across the link: all requests ok and verified, every block freed by its
/// notifications (none by lease expiry), and UCX on tcp only.
pub fn check_across(case: &str, s: &Value, requests: u64) {
    assert_eq!(n(s, "requests_ok"), requests, "{case}: {s}");
    assert_eq!(n(s, "requests_failed"), 0, "{case}: {s}");
    assert_eq!(n(s, "verify_failures"), 0, "{case}: {s}");
    assert!(n(s, "bytes_verified") > 0 && n(s, "bytes_verified") == n(s, "bytes_read"), "{case}: {s}");
    assert_eq!(n(s, "blocks_leaked"), 0, "{case}: {s}");
    assert_eq!(n(s, "blocks_expired"), 0, "{case}: notifications reached the prefill ranks: {s}");
    let tls: Vec<&str> =
        s["ucx"]["transports"].as_array().expect("transports").iter().filter_map(Value::as_str).collect();
    assert!(
        !tls.is_empty() && tls.iter().all(|t| t.starts_with("tcp")),
        "{case}: UCX over tcp only: {tls:?}"
    );
}

/// Starts the bench in the decode namespace; returns it and its results dir.
fn start_bench(hosts: &TwoHosts, listen: &str, extra: &[&str]) -> (Spawned, tempfile::TempDir) {
    let results = tempfile::tempdir().expect("temp dir");
    let mut args = vec!["--listen", listen, "--advertise-host", &hosts.d.addr, "--ucx-tls", "tcp"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--num-kv-heads", "4", "--layers", "2", "--head-dim", "64", "--verify", "full"]);
    let bench_args = bench_cmd(results.path(), &args);
    let mut cmd = TwoHosts::kvx(&hosts.d, &[]);
    cmd.args(bench_args.get_args());
    (Spawned::start("bench (decode host)", cmd), results)
}

#[test]
fn bench_across_two_network_namespaces_over_ucx_tcp() {
    let _turn = exclusive();
    let hosts = match TwoHosts::create() {
        Ok(h) => h,
        Err(why) => {
            skip(
                Part::Netns,
                &format!("bench_across_two_network_namespaces_over_ucx_tcp: cannot make namespaces: {why}"),
            );
            return;
        }
    };

    // 1. Workers started by hand with explicit roles; port 0, each engine prints its endpoint.
    let listen = format!("tcp://{}:0", hosts.d.addr);
    let (mut bench, results) =
        start_bench(&hosts, &listen, &["--p-tp", "2", "--d-tp", "1", "--requests", "6"]);
    let waiting = |role: &str| {
        let needle = format!("{role} engine waiting");
        bench.wait_line(STEP_TIMEOUT, |l| l.contains(&needle)).unwrap_or_else(|| {
            panic!("no '{needle}' line within {STEP_TIMEOUT:?}; stderr:\n{}", bench.stderr())
        })
    };
    let p_ep = endpoint(&waiting("prefill"));
    let mut workers: Vec<Spawned> = (0..2)
        .map(|r| {
            let rank = r.to_string();
            let cmd = TwoHosts::kvx(
                &hosts.p,
                &["worker", "--connect", &p_ep, "--role", "prefill", "--rank", &rank],
            );
            Spawned::start(&format!("P{r}"), cmd)
        })
        .collect();
    let d_ep = endpoint(&waiting("decode"));
    let cmd = TwoHosts::kvx(&hosts.d, &["worker", "--connect", &d_ep, "--role", "decode", "--rank", "0"]);
    workers.push(Spawned::start("D0", cmd));
    let status = bench.expect_exit(RUN_TIMEOUT);
    assert!(status.success(), "bench exited {status}; stderr:\n{}", bench.stderr());
    check_across("explicit ranks", &summary_json(&bench), 6);
    let run = run_dir(results.path()).expect("run dir");
    assert_eq!(read_rows(&run).len(), 6);
    for w in &mut workers {
        let st = w.expect_exit(STEP_TIMEOUT);
        assert!(st.success(), "{} exited {st}; stderr:\n{}", w.name, w.stderr());
    }

    // 2. Ranks from launcher environments (Open MPI on the prefill host, Slurm on the decode
    // host), all started at once. The port convention (decode = prefill + 1) needs a fixed
    // port; the namespace is this test's own, so nothing else can hold it.
    let listen = format!("tcp://{}:5600", hosts.d.addr);
    let (mut bench, _results) =
        start_bench(&hosts, &listen, &["--p-tp", "1", "--d-tp", "2", "--requests", "5"]);
    let connect = listen.clone();
    let world = "3";
    let mut workers = vec![];
    let mut cmd = TwoHosts::kvx(&hosts.p, &["worker", "--connect", &connect, "--p-tp", "1"]);
    cmd.env("OMPI_COMM_WORLD_RANK", "0").env("OMPI_COMM_WORLD_SIZE", world);
    workers.push(Spawned::start("P0 (mpirun)", cmd));
    for global in 1..3 {
        let mut cmd = TwoHosts::kvx(&hosts.d, &["worker", "--connect", &connect, "--p-tp", "1"]);
        cmd.env("SLURM_PROCID", global.to_string()).env("SLURM_NTASKS", world);
        workers.push(Spawned::start(&format!("global rank {global} (slurm)"), cmd));
    }
    let status = bench.expect_exit(RUN_TIMEOUT);
    assert!(status.success(), "bench exited {status}; stderr:\n{}", bench.stderr());
    check_across("launcher ranks", &summary_json(&bench), 5);
    for w in &mut workers {
        let st = w.expect_exit(STEP_TIMEOUT);
        assert!(st.success(), "{} exited {st}; stderr:\n{}", w.name, w.stderr());
    }
}

/// A prefill rank on the other host dies mid-run. It has no pipe to the orchestrator, so
/// its engine learns of it when it stops saying it is alive; then later requests fail fast,
/// the bench ends and accounts for every block.
#[test]
fn prefill_rank_killed_on_the_other_host_is_noticed() {
    let _turn = exclusive();
    let hosts = match TwoHosts::create() {
        Ok(h) => h,
        Err(why) => {
            skip(
                Part::Netns,
                &format!("prefill_rank_killed_on_the_other_host_is_noticed: cannot make namespaces: {why}"),
            );
            return;
        }
    };
    let listen = format!("tcp://{}:0", hosts.d.addr);
    let extra = ["--p-tp", "2", "--d-tp", "1", "--requests", "3000", "--timeout", "1s", "--lease", "2s"];
    let (mut bench, results) = start_bench(&hosts, &listen, &extra);
    let line = |bench: &Spawned, role: &str| {
        let needle = format!("{role} engine waiting");
        let l = bench.wait_line(STEP_TIMEOUT, |l| l.contains(&needle));
        endpoint(&l.unwrap_or_else(|| panic!("no '{needle}' line; stderr:\n{}", bench.stderr())))
    };
    let p_ep = line(&bench, "prefill");
    let mut prefill: Vec<Spawned> = (0..2)
        .map(|r| {
            let rank = r.to_string();
            let cmd = TwoHosts::kvx(
                &hosts.p,
                &["worker", "--connect", &p_ep, "--role", "prefill", "--rank", &rank],
            );
            Spawned::start(&format!("P{r}"), cmd)
        })
        .collect();
    let d_ep = line(&bench, "decode");
    let cmd = TwoHosts::kvx(&hosts.d, &["worker", "--connect", &d_ep, "--role", "decode", "--rank", "0"]);
    let mut decode = Spawned::start("D0", cmd);
    let run = crate::procs::wait_rows(&mut bench, results.path(), 5, RUN_TIMEOUT);
    prefill[1].kill_group();
    prefill[1].expect_exit(STEP_TIMEOUT);
    // Silence limit (8 x --timeout) + lease + shutdown grace, with room for a loaded machine.
    let status = bench.expect_exit(Duration::from_secs(60));
    // A rank killed from outside (no --fault) fails requests: the run exits 1.
    assert_eq!(status.code(), Some(1), "bench exited {status}; stderr:\n{}", bench.stderr());
    let s = summary_json(&bench);
    let (ok, failed) = (n(&s, "requests_ok"), n(&s, "requests_failed"));
    assert_eq!(ok + failed, 3000, "{s}");
    assert!(ok >= 5 && failed > 0, "{s}");
    assert_eq!(n(&s, "blocks_leaked"), 0, "{s}");
    assert!(s["failures_by_cause"]["peer_gone"].as_u64().is_some_and(|g| g + 10 >= failed), "{s}");
    let notes = s["notes"].to_string();
    assert!(notes.contains("ranks that died: prefill [1], decode []"), "{notes}");
    assert!(bench.stderr().contains("prefill rank 1 is gone: not heard from"), "{}", bench.stderr());
    assert_eq!(read_rows(&run).len(), 3000);
    for w in prefill.iter_mut().take(1).chain([&mut decode]) {
        let st = w.expect_exit(STEP_TIMEOUT);
        assert!(st.success(), "{} exited {st} after the bench shut it down:\n{}", w.name, w.stderr());
    }
}
