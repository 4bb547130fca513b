//! `kvx calibrate`'s flags resolved into a [`CalibrateConfig`]: the default sweep, or a short
//! one with `--quick`. Must not run anything.

use std::path::PathBuf;

use clap::Args;

use super::parse::parse_duration;
use crate::config::calibrate::CalibrateConfig;
use crate::error::ConfigError;
use crate::layouts::posting::PostPath;

/// The path a model is fitted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PathArg {
    /// UCX on host memory.
    Ucx,
    /// UCX (cuda_ipc) on device memory.
    CudaIpc,
    /// kvx's cuda-batch transport on device memory.
    CudaBatch,
}

impl From<PathArg> for PostPath {
    fn from(p: PathArg) -> Self {
        match p {
            PathArg::Ucx => PostPath::Ucx,
            PathArg::CudaIpc => PostPath::CudaIpc,
            PathArg::CudaBatch => PostPath::CudaBatch,
        }
    }
}

/// `kvx calibrate`'s flags.
#[derive(Debug, Clone, Args)]
pub struct CalibrateFlags {
    /// Where to write the rates file (JSON; `kvx plan --rates`, `kvx bench --rates` read it)
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// The transport and memory to fit: ucx (host memory), cuda-ipc or cuda-batch (device memory)
    #[arg(long, value_enum, default_value_t = PathArg::Ucx)]
    pub path: PathArg,
    /// A short sweep (3 sizes, 2 depths, 2 readers at once; for tests and a first look)
    #[arg(long)]
    pub quick: bool,
    /// How long each case of the sweeps measures [default: 300ms, --quick 50ms]
    #[arg(long, value_name = "DURATION")]
    pub case_time: Option<String>,
    /// An earlier rates file of the same path: print each term's change and name those that
    /// moved by 10% or more (unstable on this host)
    #[arg(long, value_name = "FILE")]
    pub compare: Option<PathBuf>,
    /// How many times every sweep runs (interleaved), each case's median fitted: more rounds,
    /// steadier terms on a busy host [default: 3, --quick 1]
    #[arg(long = "sweep-rounds", value_name = "N")]
    pub rounds: Option<u32>,
    /// The GPU of the device paths
    #[arg(long = "gpu", value_name = "N", default_value_t = 0)]
    pub gpu: u32,
}

const KIB: u64 = 1024;
/// The most rounds a calibration runs (20 rounds of the full sweep take about 7 minutes).
const MAX_ROUNDS: u32 = 20;
const MIB: u64 = 1024 * 1024;

/// The sweeps the flags ask for.
pub fn resolve_calibrate(f: &CalibrateFlags, command: String) -> Result<CalibrateConfig, ConfigError> {
    let case_time = match &f.case_time {
        Some(s) => parse_duration(s).map_err(|e| ConfigError::new("--case-time", e))?,
        None if f.quick => std::time::Duration::from_millis(50),
        None => std::time::Duration::from_millis(300),
    };
    if case_time.is_zero() || case_time > std::time::Duration::from_secs(60) {
        return Err(ConfigError::new("--case-time", "give a duration above 0 and at most 60s"));
    }
    if let Some(parent) = f.out.parent().filter(|p| !p.as_os_str().is_empty())
        && !parent.is_dir()
    {
        return Err(ConfigError::new("--out", format!("{} is not a folder", parent.display())));
    }
    let rounds = f.rounds.unwrap_or(if f.quick { 1 } else { 3 });
    if !(1..=MAX_ROUNDS).contains(&rounds) {
        return Err(ConfigError::new("--sweep-rounds", format!("give 1 to {MAX_ROUNDS} rounds")));
    }
    let (sizes, depths, readers) = if f.quick {
        (vec![4 * KIB, 64 * KIB, MIB], vec![1, 64], vec![2])
    } else {
        (vec![4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB], vec![1, 16, 64], vec![2, 4])
    };
    Ok(CalibrateConfig {
        path: f.path.into(),
        sizes,
        depths,
        readers,
        concurrency_sizes: if f.quick { vec![4 * KIB, MIB] } else { vec![4 * KIB, 64 * KIB, MIB] },
        concurrency_depth: 64,
        case_time,
        rounds,
        working_set_bytes: if f.quick { 64 * MIB } else { 256 * MIB },
        device: f.gpu,
        out: f.out.clone(),
        compare: f.compare.clone(),
        command,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(quick: bool, rounds: Option<u32>) -> CalibrateFlags {
        CalibrateFlags {
            out: PathBuf::from("rates.json"),
            path: PathArg::Ucx,
            quick,
            case_time: None,
            compare: None,
            rounds,
            gpu: 0,
        }
    }

    #[test]
    fn rounds_default_by_sweep_and_are_bounded() {
        let rounds = |quick, r| resolve_calibrate(&flags(quick, r), String::new()).map(|c| c.rounds);
        assert_eq!(rounds(false, None).ok(), Some(3));
        assert_eq!(rounds(true, None).ok(), Some(1));
        assert_eq!(rounds(false, Some(6)).ok(), Some(6));
        for bad in [0, MAX_ROUNDS + 1] {
            let e = rounds(false, Some(bad)).expect_err("out of range");
            assert!(e.to_string().contains("--sweep-rounds"), "{e}");
        }
    }
}
