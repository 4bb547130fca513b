//! The resolved settings of `kvx calibrate`: which `kvx xfer` sweeps to run (sizes, depths,
//! several readers at once) for which path, and where the rates file goes.

use std::path::PathBuf;
use std::time::Duration;

use crate::layouts::posting::PostPath;

/// What `kvx calibrate` measures and writes.
#[derive(Debug, Clone)]
pub struct CalibrateConfig {
    /// The path the model is fitted for: decides `kvx xfer`'s `--mem` and `--transport`.
    pub path: PostPath,
    /// The single-reader sweep: every size at every depth.
    pub sizes: Vec<u64>,
    pub depths: Vec<u64>,
    /// Several readers at once: each count, every `concurrency_sizes` at `concurrency_depth`.
    pub readers: Vec<u32>,
    pub concurrency_sizes: Vec<u64>,
    pub concurrency_depth: u64,
    /// How long each case of each sweep measures.
    pub case_time: Duration,
    /// How many times every sweep runs; each case's median is fitted (a shared host's
    /// neighbours slow some rounds, not the median).
    pub rounds: u32,
    /// Bytes each `kvx xfer` registers (smaller with several at once, so all fit).
    pub working_set_bytes: u64,
    /// One GPU, for the device paths.
    pub device: u32,
    pub out: PathBuf,
    /// An earlier rates file to compare each term with.
    pub compare: Option<PathBuf>,
    /// The command line, for the file's provenance.
    pub command: String,
}
