//! What `kvx bench` was asked to run (one bench, `--serve`, `--compare-transports` or
//! `--sweep`), with every bench of it resolved before the first starts, so a bad flag or a bad
//! point fails before any worker process exists.

use std::path::Path;

use super::bench::{BenchFlags, resolve};
use super::engine::{parse_mode, parse_transport};
use super::env::ProcessEnv;
use super::sweep::{self, SweepPlan};
use crate::error::ConfigError;
use crate::pipeline::bench::BenchSettings;
use crate::pipeline::proto::TransportKind;

/// What `kvx bench` was asked to do, with every run resolved before any starts.
#[derive(Debug, Clone)]
pub enum BenchPlan {
    /// One bench.
    Single(Box<BenchSettings>),
    /// `--serve`: the bench's workload through HTTP engines and the proxy.
    Serve(Box<BenchSettings>),
    /// `--compare-transports`: the same workload on each transport, in the order given.
    CompareTransports(Vec<BenchSettings>),
    /// `--compare-modes`: the same workload in each transfer mode (pull, push), in order.
    CompareModes(Vec<BenchSettings>),
    /// `--sweep`: one bench per point of the file's axes.
    Sweep(SweepPlan),
}

impl BenchPlan {
    /// Directory the run is written under.
    pub fn results_root(&self) -> &Path {
        match self {
            BenchPlan::Single(s) | BenchPlan::Serve(s) => &s.results_root,
            BenchPlan::CompareTransports(runs) | BenchPlan::CompareModes(runs) => {
                runs.first().map_or(Path::new(""), |s| &s.results_root)
            }
            BenchPlan::Sweep(plan) => &plan.results_root,
        }
    }
}

/// Resolves `kvx bench`'s flags into what to run.
pub fn resolve_plan(flags: &BenchFlags, env: &ProcessEnv) -> Result<BenchPlan, ConfigError> {
    if flags.serve {
        return Ok(BenchPlan::Serve(Box::new(resolve(flags, env)?)));
    }
    if let Some(names) = &flags.compare_transports {
        let mut runs = Vec::new();
        let kinds = names
            .iter()
            .map(|n| parse_transport(n).map_err(|e| ConfigError::new("--compare-transports", e)))
            .collect::<Result<Vec<_>, _>>()?;
        if flags.batch_copy.is_some() && !kinds.contains(&TransportKind::CudaBatch) {
            return Err(ConfigError::new(
                "--batch-copy",
                "applies to --transport cuda-batch: add cuda-batch to --compare-transports, or drop --batch-copy",
            ));
        }
        for (n, kind) in names.iter().zip(kinds) {
            let one = BenchFlags {
                compare_transports: None,
                transport: Some(n.trim().to_string()),
                // How cuda-batch copies is its run's alone.
                batch_copy: flags.batch_copy.filter(|_| kind == TransportKind::CudaBatch),
                ..flags.clone()
            };
            runs.push(resolve(&one, env)?);
        }
        if runs.is_empty() {
            return Err(ConfigError::new(
                "--compare-transports",
                "needs at least one of ucx, storage, multi, cuda-batch",
            ));
        }
        return Ok(BenchPlan::CompareTransports(runs));
    }
    if let Some(names) = &flags.compare_modes {
        let mut runs = Vec::new();
        for n in names {
            parse_mode(n).map_err(|e| ConfigError::new("--compare-modes", e))?;
            let one = BenchFlags {
                compare_modes: None,
                mode: Some(n.trim().to_string()),
                in_mode_comparison: true,
                ..flags.clone()
            };
            runs.push(resolve(&one, env)?);
        }
        if runs.is_empty() {
            return Err(ConfigError::new("--compare-modes", "needs at least one of pull, push"));
        }
        return Ok(BenchPlan::CompareModes(runs));
    }
    if let Some(path) = &flags.sweep {
        return Ok(BenchPlan::Sweep(sweep::plan(flags, path, env)?));
    }
    Ok(BenchPlan::Single(Box::new(resolve(flags, env)?)))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::transfer::cuda_batch::BatchCopy;

    fn env() -> ProcessEnv {
        ProcessEnv { results_dir: None, stderr_is_terminal: false, exe: Ok(PathBuf::from("/usr/bin/kvx")) }
    }

    #[test]
    fn plans_resolve_every_run_first() {
        let flags = BenchFlags {
            compare_transports: Some(vec!["ucx".into(), "storage".into()]),
            ..Default::default()
        };
        let BenchPlan::CompareTransports(runs) = resolve_plan(&flags, &env()).expect("valid") else {
            panic!("a comparison")
        };
        let kinds: Vec<_> = runs.iter().map(|r| r.workers.transport.kind).collect();
        assert_eq!(kinds, [TransportKind::Ucx, TransportKind::Storage]);
        let bad =
            BenchFlags { compare_transports: Some(vec!["ucx".into(), "nccl".into()]), ..Default::default() };
        assert_eq!(resolve_plan(&bad, &env()).expect_err("nccl").flag, "--compare-transports");
        // cuda-batch is a valid value, resolved (and refused) as --transport cuda-batch is.
        let gpu = BenchFlags {
            compare_transports: Some(vec!["ucx".into(), "cuda-batch".into()]),
            mem: Some("cuda".into()),
            ..Default::default()
        };
        match resolve_plan(&gpu, &env()) {
            Ok(BenchPlan::CompareTransports(runs)) => {
                let kinds: Vec<_> = runs.iter().map(|r| r.workers.transport.kind).collect();
                assert_eq!(kinds, [TransportKind::Ucx, TransportKind::CudaBatch]);
            }
            Ok(_) => panic!("a comparison"),
            Err(e) => assert!(!cfg!(feature = "cuda") && e.flag == "--transport", "{e:?}"),
        }
        // --batch-copy goes to the cuda-batch run only, and needs one.
        // (The UCX run keeps the default, the kernel.)
        let api = BenchFlags { batch_copy: Some(BatchCopy::Api), ..gpu.clone() };
        match resolve_plan(&api, &env()) {
            Ok(BenchPlan::CompareTransports(runs)) => {
                let copies: Vec<_> = runs.iter().map(|r| r.workers.transport.batch_copy).collect();
                assert_eq!(copies, [BatchCopy::Kernel, BatchCopy::Api]);
            }
            Ok(_) => panic!("a comparison"),
            Err(e) => assert!(!cfg!(feature = "cuda") && e.flag == "--transport", "{e:?}"),
        }
        let no_batch = BenchFlags {
            compare_transports: Some(vec!["ucx".into(), "storage".into()]),
            batch_copy: Some(BatchCopy::Kernel),
            ..Default::default()
        };
        assert_eq!(resolve_plan(&no_batch, &env()).expect_err("no cuda-batch run").flag, "--batch-copy");
        let host = BenchFlags { mem: None, ..gpu };
        assert_eq!(
            resolve_plan(&host, &env()).expect_err("host pools").flag,
            if cfg!(feature = "cuda") { "--mem" } else { "--transport" }
        );
        let serve = BenchFlags { serve: true, ..Default::default() };
        assert!(matches!(resolve_plan(&serve, &env()), Ok(BenchPlan::Serve(_))));
        assert!(matches!(resolve_plan(&BenchFlags::default(), &env()), Ok(BenchPlan::Single(_))));
    }
}
