//! One rank's process (`kvx worker`, hidden), start to exit: it connects to its engine's
//! control socket, says hello, receives its configuration, runs the role's loop (`prefill`
//! or `decode`) and says goodbye. Its rank comes from the flags, from a launcher's
//! environment (Slurm, Open MPI, torchrun), or from the engine.

pub mod batch;
pub mod decode;
pub mod nixl;
mod plumbing;
pub mod prefill;
pub mod pusher;

use std::time::{Duration, Instant};

use crate::config::worker::WorkerConfig;
use crate::pipeline::wire::{FromWorker, ToWorker};
use crate::pipeline::worker::plumbing::{Control, WorkerError, rss_bytes};
use crate::vocab::kinds::Role;

/// How long a worker waits for its configuration after saying hello.
pub const INIT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a worker waits for the engine to acknowledge its goodbye.
const BYE_ACK_TIMEOUT: Duration = Duration::from_secs(1);

/// Runs a worker until its engine shuts it down.
pub fn run(endpoint: &str, role: Role, rank: Option<u32>) -> Result<(), WorkerError> {
    let ctl = Control::connect(endpoint)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
    ctl.send(&FromWorker::Hello { role, rank, pid: std::process::id(), host })?;
    let deadline = Instant::now() + INIT_TIMEOUT;
    let cfg: WorkerConfig = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WorkerError::NoConfig { endpoint: endpoint.to_string(), timeout: INIT_TIMEOUT });
        }
        match ctl.recv(left)? {
            Some(ToWorker::Init(cfg)) => break *cfg,
            Some(ToWorker::Shutdown) => return Ok(()),
            _ => {}
        }
    };
    let mut cfg = cfg;
    if matches!(cfg.bind_host.as_str(), "0.0.0.0" | "*" | "::")
        && let Some(own) = route_source(endpoint)
    {
        // The engine's advertise host is the orchestrator's; a worker on another host is
        // reached at its own address, the one its traffic to the orchestrator leaves from.
        cfg.advertise_host = own;
    }
    let result = match cfg.role {
        Role::Prefill => crate::pipeline::worker::prefill::run(&ctl, cfg),
        Role::Decode => crate::pipeline::worker::decode::run(&ctl, cfg),
    };
    match &result {
        Ok(()) => {
            let _ = ctl.send(&FromWorker::Bye { rss_bytes: rss_bytes() });
            // The ZMQ context is process-wide and never terminated, so nothing flushes a queued
            // message at exit: wait (briefly) for the engine to acknowledge the goodbye, or it
            // can be lost and the engine waits for it in vain.
            let _ = ctl.recv(BYE_ACK_TIMEOUT);
        }
        Err(e) => {
            let _ = ctl.send(&FromWorker::Fatal { msg: e.chain_text() });
        }
    }
    result
}

/// This host's IPv4 address on the route to a `tcp://host:port` endpoint (`None` for other
/// transports or when it cannot be found). A UDP connect sends nothing; it only picks the route.
pub fn route_source(endpoint: &str) -> Option<String> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let rest = endpoint.strip_prefix("tcp://")?;
    let target = rest.to_socket_addrs().ok()?.find(std::net::SocketAddr::is_ipv4)?;
    let sock = UdpSocket::bind("0.0.0.0:0").ok()?;
    sock.connect(target).ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then(|| ip.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_source_is_the_local_end_of_the_route() {
        assert_eq!(route_source("tcp://127.0.0.1:9").as_deref(), Some("127.0.0.1"));
        assert_eq!(route_source("ipc:///tmp/x"), None);
        assert_eq!(route_source("tcp://not a host:1"), None);
    }
}
