//! Helpers of the `kvx bench` tests: real `kvx` processes, each in its own process group so
//! the test can kill it together with every worker it started (on drop, so also when a test
//! panics); waits on events with deadlines (a line on stderr, rows in `requests.csv`, a
//! process's exit); the run directory a bench wrote; `/proc` to find a bench's workers.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Process tests take turns: each starts a handful of worker processes, and the machine may
/// have two cores shared with everything else `cargo test` runs.
static HEAVY: Mutex<()> = Mutex::new(());

pub fn exclusive() -> MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The `kvx` binary cargo built for these tests.
pub fn kvx_path() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvx"))
}

/// Sends `sig` to a process (`pid > 0`) or a process group (`pid < 0`).
#[expect(unsafe_code, reason = "kill(2) has no safe wrapper in std; it touches no memory of ours")]
pub fn signal(pid: i32, sig: i32) -> bool {
    // SAFETY: kill(2) takes two integers and only affects other processes.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// Starts `cmd` with SIGINT and SIGTERM at their default dispositions, whatever this process
/// inherited: a suite started in the background by a non-interactive shell ignores SIGINT, and
/// a command that keeps the default (kvx probe) would inherit the ignoring.
#[expect(unsafe_code, reason = "pre_exec runs in the child between fork and exec")]
pub fn default_signals(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: signal(2) is async-signal-safe, and the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            Ok(())
        });
    }
}

/// A running process with its stdout collected and its stderr readable line by line.
pub struct Spawned {
    pub name: String,
    pub pid: u32,
    exit: mpsc::Receiver<ExitStatus>,
    status: Option<ExitStatus>,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<Vec<u8>>>,
    stdout_done: mpsc::Receiver<()>,
    /// Signalled each time stdout grows.
    stdout_grew: mpsc::Receiver<()>,
    stderr_done: mpsc::Receiver<()>,
}

impl Spawned {
    /// Starts `cmd` in a new process group, stdin closed, stdout and stderr captured.
    pub fn start(name: &str, mut cmd: Command) -> Spawned {
        cmd.process_group(0).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{name}: cannot start {cmd:?}: {e}"));
        let pid = child.id();
        let (mut out, err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (line_tx, lines) = mpsc::channel();
        let log = stderr.clone();
        let (err_done_tx, stderr_done) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                log.lock().expect("log").push_str(&format!("{line}\n"));
                let _ = line_tx.send(line);
            }
            let _ = err_done_tx.send(());
        });
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, stdout_done) = mpsc::channel();
        let (grew_tx, stdout_grew) = mpsc::channel();
        let buf = stdout.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 65536];
            while let Ok(n) = out.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.lock().expect("stdout").extend_from_slice(&chunk[..n]);
                let _ = grew_tx.send(());
            }
            let _ = done_tx.send(());
        });
        let (exit_tx, exit) = mpsc::channel();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = exit_tx.send(status);
            }
        });
        Spawned {
            name: name.to_string(),
            pid,
            exit,
            status: None,
            lines,
            stderr,
            stdout,
            stdout_done,
            stdout_grew,
            stderr_done,
        }
    }

    /// Waits at most `timeout` for the process to exit.
    /// Once it has, what it wrote last is in [`stderr`](Self::stderr): the reader is waited
    /// for until it reaches the end of the pipe (at most 5 s, should a worker of the group
    /// still hold it open).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.exit.recv_timeout(timeout).ok();
            if self.status.is_some() {
                let _ = self.stderr_done.recv_timeout(Duration::from_secs(5));
            }
        }
        self.status
    }

    /// Waits for the exit or fails the test, killing the process group first.
    pub fn expect_exit(&mut self, timeout: Duration) -> ExitStatus {
        match self.wait_exit(timeout) {
            Some(s) => s,
            None => {
                self.kill_group();
                panic!("{} did not exit within {timeout:?}; stderr:\n{}", self.name, self.stderr());
            }
        }
    }

    /// The first stderr line (from now on) that `pred` accepts, waiting at most `timeout`.
    pub fn wait_line(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(line) if pred(&line) => return Some(line),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// What the process wrote to stdout so far (without waiting for it to close stdout).
    pub fn stdout_so_far(&self) -> String {
        String::from_utf8_lossy(&self.stdout.lock().expect("stdout")).into_owned()
    }

    /// Waits (on each write to stdout, at most `timeout`) until what stdout holds satisfies
    /// `pred`; returns that text.
    pub fn wait_stdout(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.stdout_so_far();
            if pred(&text) {
                return Some(text);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            self.stdout_grew.recv_timeout(left).ok()?;
        }
    }

    /// Everything the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("log").clone()
    }

    /// Stdout, once the process has closed it (waits at most `timeout` for that).
    pub fn stdout(&self, timeout: Duration) -> String {
        let _ = self.stdout_done.recv_timeout(timeout);
        String::from_utf8_lossy(&self.stdout.lock().expect("stdout")).into_owned()
    }

    /// SIGKILL to the whole process group (the process and every worker it started).
    pub fn kill_group(&self) {
        signal(-(self.pid as i32), libc::SIGKILL);
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        // Also after a clean exit: workers that outlived their engine must not linger.
        self.kill_group();
    }
}

/// A `kvx bench` command writing under `results` with a JSON summary on stdout.
pub fn bench_cmd(results: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(kvx_path());
    cmd.arg("bench").args(args).arg("--results-dir").arg(results).args([
        "--no-calibrate",
        "--format",
        "json",
    ]);
    cmd
}

/// The run directory a bench created under `results` (the only entry).
pub fn run_dir(results: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(results).ok()?.flatten().map(|e| e.path()).collect();
    dirs.retain(|p| p.is_dir());
    (dirs.len() == 1).then(|| dirs.remove(0))
}

/// Complete rows in `requests.csv` (header and a half-written last line excluded).
pub fn complete_rows(run: &Path) -> usize {
    std::fs::read(run.join("requests.csv"))
        .map(|b| b.iter().filter(|&&c| c == b'\n').count().saturating_sub(1))
        .unwrap_or(0)
}

/// Waits until the bench under `results` has written at least `n` request rows; returns its
/// run directory. Panics with the bench's stderr after `timeout`.
pub fn wait_rows(bench: &mut Spawned, results: &Path, n: usize, timeout: Duration) -> PathBuf {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(run) = run_dir(results)
            && complete_rows(&run) >= n
        {
            return run;
        }
        if let Some(status) = bench.wait_exit(Duration::ZERO) {
            panic!("{} exited ({status}) before writing {n} rows; stderr:\n{}", bench.name, bench.stderr());
        }
        if Instant::now() > deadline {
            bench.kill_group();
            panic!("{}: fewer than {n} rows after {timeout:?}; stderr:\n{}", bench.name, bench.stderr());
        }
        // Rows are appended as requests finish; a file has no cheaper change notification here.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The rows of `requests.csv`, keyed by column name.
pub fn read_rows(run: &Path) -> Vec<BTreeMap<String, String>> {
    let mut rdr = csv::Reader::from_path(run.join("requests.csv")).expect("requests.csv opens");
    let headers = rdr.headers().expect("header").clone();
    rdr.records()
        .map(|r| {
            let r = r.expect("a well-formed row");
            headers.iter().zip(r.iter()).map(|(h, v)| (h.to_string(), v.to_string())).collect()
        })
        .collect()
}

/// A process as `/proc` shows it.
#[derive(Debug, Clone)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    pub state: char,
    pub argv: Vec<String>,
}

fn proc_info(pid: u32) -> Option<ProcInfo> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let argv = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into())
                .collect()
        })
        .unwrap_or_default();
    Some(ProcInfo { pid, ppid, state, argv })
}

/// Live (not zombie) children of `pid`.
pub fn children_of(pid: u32) -> Vec<ProcInfo> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(proc_info)
        .filter(|p| p.ppid == pid && p.state != 'Z')
        .collect()
}

/// The `kvx worker` children of a bench with this role and rank.
pub fn worker_of(bench_pid: u32, role: &str, rank: u32) -> Option<ProcInfo> {
    let rank = rank.to_string();
    children_of(bench_pid).into_iter().find(|p| {
        let has = |flag: &str, v: &str| p.argv.windows(2).any(|w| w[0] == flag && w[1] == v);
        p.argv.get(1).is_some_and(|a| a == "worker") && has("--role", role) && has("--rank", &rank)
    })
}

/// Every live descendant of `pid` (children, their children, ...), whatever their process group.
pub fn descendants_of(pid: u32) -> Vec<ProcInfo> {
    let mut found = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children_of(p) {
            next.push(c.pid);
            found.push(c);
        }
    }
    found
}

/// True while the process exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    proc_info(pid).is_some_and(|p| p.state != 'Z')
}

/// Waits until none of `pids` is alive; returns those still alive after `timeout`. Waits on
/// exit events: a pidfd (pidfd_open(2)) becomes readable when its process ends, whether or
/// not it is our child (a zombie's at once, as [`alive`] counts it gone).
#[expect(unsafe_code, reason = "poll(2) over pidfds has no safe wrapper in std")]
pub fn wait_gone(pids: &[u32], timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    let mut fds: Vec<OwnedFd> = pids.iter().filter_map(|&p| pidfd(p)).collect();
    while !fds.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut polls: Vec<libc::pollfd> = fds
            .iter()
            .map(|fd| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 })
            .collect();
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `polls` is a live array of `polls.len()` pollfd structs for the whole call.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, ms) };
        if n == 0 || (n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted) {
            break;
        }
        let mut ended = polls.iter().map(|p| p.revents != 0);
        fds.retain(|_| !ended.next().unwrap_or(false));
    }
    pids.iter().copied().filter(|&p| alive(p)).collect()
}

/// A pidfd of `pid`, or `None` when it is gone already.
#[expect(unsafe_code, reason = "pidfd_open(2) has no wrapper in std or libc, only the raw syscall")]
fn pidfd(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: a non-negative return of pidfd_open is a new descriptor nobody else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The processes of process group `pgid` (its leader included).
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().is_some_and(|stat| {
                // Fields after the command name: state, ppid, pgrp.
                let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
                rest.split_whitespace().nth(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
            })
        })
        .collect()
}

/// Parses a bench's stdout (the JSON summary).
pub fn summary_json(bench: &Spawned) -> serde_json::Value {
    let out = bench.stdout(Duration::from_secs(10));
    serde_json::from_str(&out).unwrap_or_else(|e| {
        panic!("{}: stdout is not a JSON summary ({e}):\n{out}\nstderr:\n{}", bench.name, bench.stderr())
    })
}

/// A summary field that must be a non-negative integer.
pub fn n(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("summary has no integer `{key}`: {v}"))
}

/// How a finished command ended, what it said on stderr and how much CPU it used.
pub struct Finished {
    pub code: Option<i32>,
    pub stderr: String,
    /// User plus system time of the process itself (from wait4's rusage): what it cost, apart
    /// from the time it waited for a core other tests held.
    pub cpu: Duration,
}

/// Runs `cmd` to its end (stdin closed), killed after `limit`. Its CPU time comes from wait4,
/// which reaps exactly this child, so other tests' children do not count.
#[expect(unsafe_code, reason = "wait4(2) has no safe wrapper in std or nix; it writes only our locals")]
#[expect(clippy::zombie_processes, reason = "the child is reaped by wait4, which std's Child does not see")]
pub fn run_measured(mut cmd: Command, limit: Duration) -> Finished {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let pid = child.id() as i32;
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    // Stdout is drained (so a full pipe cannot stall the child), not kept.
    let out_reader = std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()).ok());
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).ok();
        s
    });
    // A watchdog kills the child past `limit`; it is told when the child was reaped.
    let (reaped_tx, reaped) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if reaped.recv_timeout(limit) == Err(mpsc::RecvTimeoutError::Timeout) {
            signal(pid, libc::SIGKILL);
        }
    });
    let mut status = 0;
    // SAFETY: rusage is plain old data that wait4 fills; `status` and `usage` outlive the call.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; pid is our own unreaped child (std's Child is never waited on).
    let got = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(got, pid, "wait4 on {cmd:?}: {}", std::io::Error::last_os_error());
    drop(reaped_tx);
    watchdog.join().expect("watchdog");
    out_reader.join().expect("stdout reader");
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Finished {
        code,
        stderr: err_reader.join().expect("stderr reader"),
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
    }
}
