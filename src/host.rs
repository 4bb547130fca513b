//! The machine kvx runs on, as a run's summary records it: host name, CPU, memory, OS and
//! kernel, read from `/proc` and `/etc/os-release`; and the CPU time this process has spent
//! ([`cpu_seconds`]). A leaf every layer may use: the layers that run something (`pipeline`,
//! `serve`, `diagnose`) fill a summary's [`Environment`] from here, so `report` carries it
//! without reading the system.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// The machine the run ran on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Environment {
    pub hostname: String,
    pub cpu_model: String,
    pub cores: u32,
    pub memory_bytes: u64,
    pub os: String,
    pub kernel: String,
    pub kvx_version: String,
    /// The launcher that started the process that wrote the summary, and the index it gave
    /// (settings resolve it; `detect` leaves it out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub launcher: Option<crate::vocab::launcher::Launcher>,
}

impl Environment {
    /// Describes this host from `/proc` and `/etc/os-release`; unknown fields stay empty.
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                matches!(k.trim(), "model name" | "Model" | "cpu model").then(|| v.trim().to_string())
            })
            .unwrap_or_default();
        let memory_bytes = read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024);
        let os = read("/etc/os-release")
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_else(|| std::env::consts::OS.to_string());
        Environment {
            hostname: read("/proc/sys/kernel/hostname").trim().to_string(),
            cpu_model,
            cores: std::thread::available_parallelism()
                .map_or(0, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)),
            memory_bytes,
            os,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            kvx_version: env!("CARGO_PKG_VERSION").to_string(),
            launcher: None,
        }
    }
}

/// CPU seconds (user + system) of this process and of its reaped children so far (0 for
/// what `getrusage` cannot tell).
pub fn cpu_seconds() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
        .into_iter()
        .filter_map(|who| getrusage(who).ok())
        .map(|u| secs(u.user_time()) + secs(u.system_time()))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_detect_fills_what_this_host_has() {
        let e = Environment::detect();
        assert!(e.cores >= 1);
        assert_eq!(e.kvx_version, env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn cpu_seconds_grow_with_work() {
        let before = cpu_seconds();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(cpu_seconds() >= before, "{x}");
    }
}
