//! `kvx calibrate`: fits the transfer-time model of one path (`layouts::predict`) from `kvx
//! xfer` sweeps on this host, and writes it as a rates file `kvx plan --rates` and `kvx bench
//! --rates` read (`layouts::rates`), with its provenance: the command, the host, the kvx and
//! UCX versions, the date, and every measured point.
//!
//! The sweeps are `kvx xfer` itself, run as child processes of this binary (`--format json`):
//! one over sizes and depths with one reader, then, per reader count, that many at once over
//! a few sizes, so the cost of several decode ranks reading on one host is measured, not
//! assumed. Must not print: `cli` prints what this returns.

use std::process::{Command, Stdio};

use serde_json::{Value, json};
use thiserror::Error;

use crate::config::calibrate::CalibrateConfig;
use crate::layouts::posting::PostPath;
use crate::layouts::predict::{
    BatchFit, FittedRange, RATES_VERSION, ReadersRate, TermChange, TransferModel, XferPoint, compare_models,
    fit_batches, fit_rates, median_points,
};

/// Why a calibration did not finish.
#[derive(Debug, Error)]
pub enum CalibrateError {
    #[error("cannot start kvx xfer ({exe}): {source}")]
    Spawn { exe: String, source: std::io::Error },
    #[error("kvx xfer ({args}) failed: {stderr}")]
    Xfer { args: String, stderr: String },
    #[error("kvx xfer ({args}) printed no report: {reason}")]
    Report { args: String, reason: String },
    #[error("the {path} sweep cannot be fitted: {reason}")]
    Fit { path: &'static str, reason: String },
    #[error("--compare {file}: {reason}")]
    Compare { file: String, reason: String },
    /// A signal stopped the sweeps (passed on to the `kvx xfer` children, which ended).
    #[error("interrupted by {}", .0.name())]
    Interrupted(crate::error::Signal),
}

/// A finished calibration: the rates file's JSON, the model, and the comparison asked for.
#[derive(Debug)]
pub struct Calibrated {
    pub file: Value,
    pub model: TransferModel,
    pub fit: BatchFit,
    pub changes: Option<Vec<TermChange>>,
}

fn size_arg(sizes: &[u64]) -> String {
    sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// `kvx xfer` with these sizes and depths, `readers` copies at once; each copy's report.
fn run_xfers(
    cfg: &CalibrateConfig,
    sizes: &[u64],
    depths: &[u64],
    readers: u32,
) -> Result<Vec<Value>, CalibrateError> {
    let exe = std::env::current_exe()
        .map_err(|e| CalibrateError::Spawn { exe: "current executable".into(), source: e })?;
    let mut args: Vec<String> = vec![
        "xfer".into(),
        "--sizes".into(),
        size_arg(sizes),
        "--inflight".into(),
        size_arg(depths),
        "--duration".into(),
        format!("{}ms", cfg.case_time.as_millis().max(1)),
        "--working-set".into(),
        (cfg.working_set_bytes / u64::from(readers.max(1))).max(16 << 20).to_string(),
        "--format".into(),
        "json".into(),
    ];
    match cfg.path {
        PostPath::Ucx => {}
        PostPath::CudaIpc => {
            args.extend(["--mem".into(), "cuda".into(), "--device".into(), cfg.device.to_string()])
        }
        PostPath::CudaBatch => args.extend([
            "--mem".into(),
            "cuda".into(),
            "--device".into(),
            cfg.device.to_string(),
            "--transport".into(),
            "cuda-batch".into(),
        ]),
    }
    let shown = args[1..].join(" ");
    let children: Vec<std::process::Child> = (0..readers.max(1))
        .map(|_| {
            // Each child in a process group of its own: a terminal's Ctrl-C reaches this
            // process only, which passes it on (see `wait_passing_signals_on`).
            std::os::unix::process::CommandExt::process_group(
                Command::new(&exe)
                    .args(&args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped()),
                0,
            )
            .spawn()
            .map_err(|e| CalibrateError::Spawn { exe: exe.display().to_string(), source: e })
        })
        .collect::<Result<_, _>>()?;
    let outputs = wait_passing_signals_on(children)
        .map_err(|e| CalibrateError::Spawn { exe: exe.display().to_string(), source: e })?;
    if let Some(sig) = crate::interrupt::requested() {
        return Err(CalibrateError::Interrupted(sig));
    }
    let mut reports = Vec::new();
    for out in outputs {
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(4).collect();
            return Err(CalibrateError::Xfer {
                args: shown,
                stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            });
        }
        let v: Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| CalibrateError::Report { args: shown.clone(), reason: e.to_string() })?;
        reports.push(v);
    }
    Ok(reports)
}

/// How long a child that was passed a signal has to end before it is killed (`kvx xfer`
/// stops within 2 s: this bounds one that cannot).
const CHILD_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits for every child (their output read on threads of their own, so none blocks on a full
/// pipe), passing the first SIGINT or SIGTERM this process gets on to each, and killing those
/// that do not end within [`CHILD_STOP_GRACE`] of it.
fn wait_passing_signals_on(children: Vec<std::process::Child>) -> std::io::Result<Vec<std::process::Output>> {
    use nix::sys::signal::{Signal as Sig, kill};
    use nix::unistd::Pid;
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let mut running: Vec<_> = children
        .into_iter()
        .map(|mut c| {
            let out = drain(c.stdout.take().map(|x| Box::new(x) as Box<dyn std::io::Read + Send>));
            let err = drain(c.stderr.take().map(|x| Box::new(x) as Box<dyn std::io::Read + Send>));
            (c, out, err, None)
        })
        .collect();
    let mut passed_at: Option<std::time::Instant> = None;
    while running.iter().any(|(_, _, _, st)| st.is_none()) {
        for (c, _, _, st) in running.iter_mut().filter(|r| r.3.is_none()) {
            *st = c.try_wait()?;
        }
        match (passed_at, crate::interrupt::requested()) {
            (None, Some(sig)) => {
                let sig = match sig {
                    crate::error::Signal::Interrupt => Sig::SIGINT,
                    crate::error::Signal::Terminate => Sig::SIGTERM,
                };
                for (c, _, _, _) in running.iter().filter(|r| r.3.is_none()) {
                    let pid = Pid::from_raw(i32::try_from(c.id()).unwrap_or(i32::MAX));
                    if let Err(e) = kill(pid, sig) {
                        tracing::debug!("cannot pass {sig} on to a kvx xfer process: {e}");
                    }
                }
                passed_at = Some(std::time::Instant::now());
            }
            (Some(at), _) if at.elapsed() > CHILD_STOP_GRACE => {
                for (c, _, _, st) in running.iter_mut().filter(|r| r.3.is_none()) {
                    c.kill()?;
                    *st = Some(c.wait()?);
                }
            }
            _ => {}
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(running
        .into_iter()
        .map(|(_, out, err, st)| std::process::Output {
            status: st.unwrap_or_default(),
            stdout: out.join().unwrap_or_default(),
            stderr: err.join().unwrap_or_default(),
        })
        .collect())
}

/// The measured cases of `kvx xfer` reports: one batch's time per case.
fn points(reports: &[Value], readers: u32) -> Vec<XferPoint> {
    reports
        .iter()
        .flat_map(|r| r["results"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| {
            Some(XferPoint {
                size_bytes: c["size_bytes"].as_u64()?,
                inflight: c["inflight"].as_u64()?,
                batch_ns: c["complete_us"].as_f64().filter(|x| x.is_finite() && *x > 0.0)? * 1e3,
                readers,
            })
        })
        .collect()
}

/// The largest GB/s any single-reader case reached.
fn best_gbps(reports: &[Value]) -> f64 {
    reports
        .iter()
        .flat_map(|r| r["results"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["gbps"].as_f64())
        .fold(0.0, f64::max)
}

/// Runs the sweeps, fits the model, builds the rates file (and compares it with `--compare`).
pub fn calibrate(cfg: &CalibrateConfig, date: &str) -> Result<Calibrated, CalibrateError> {
    let key = cfg.path.key();
    // An earlier file is read first: a wrong one fails before minutes of measuring.
    let before = match &cfg.compare {
        Some(f) => {
            let name = f.display().to_string();
            let text = crate::input::read_text(f)
                .map_err(|e| CalibrateError::Compare { file: name.clone(), reason: e.to_string() })?;
            let mut rates = crate::layouts::posting::PostRates::default();
            crate::layouts::rates::apply(&name, &text, &mut rates)
                .map_err(|reason| CalibrateError::Compare { file: name.clone(), reason })?;
            Some(rates.of(cfg.path).model.clone().ok_or_else(|| CalibrateError::Compare {
                file: name,
                reason: format!("no fitted model for {key} (`paths.{key}.model`)"),
            })?)
        }
        None => None,
    };
    // Every sweep `rounds` times, each case's median fitted: a round a neighbour slowed moves
    // no case. The rounds interleave (one reader, then each count at once, then again), so a
    // burst of someone else's work lands in one round of a sweep, not in all of them.
    let rounds = cfg.rounds.max(1);
    let several: Vec<u32> = cfg.readers.iter().copied().filter(|&k| k > 1).collect();
    let mut single = Vec::new();
    let mut single_rounds = Vec::new();
    let mut several_rounds: Vec<Vec<Vec<XferPoint>>> = vec![Vec::new(); several.len()];
    for _ in 0..rounds {
        let reports = run_xfers(cfg, &cfg.sizes, &cfg.depths, 1)?;
        single_rounds.push(points(&reports, 1));
        single.extend(reports);
        for (i, &k) in several.iter().enumerate() {
            // Each reader's points of a case are pooled with the other rounds' for the median.
            several_rounds[i]
                .push(points(&run_xfers(cfg, &cfg.concurrency_sizes, &[cfg.concurrency_depth], k)?, k));
        }
    }
    let mut all_points = median_points(single_rounds);
    let fit = fit_batches(&all_points).map_err(|reason| CalibrateError::Fit { path: key, reason })?;
    // cuda-batch posts a batch in one call: the intercept is the call's cost.
    let (fixed_ns, ns_per_call) =
        if cfg.path == PostPath::CudaBatch { (0.0, fit.fixed_ns) } else { (fit.fixed_ns, 0.0) };
    let mut concurrency =
        vec![ReadersRate { readers: 1, ns_per_descriptor: fit.ns_per_descriptor, gbps: fit.gbps }];
    for (&k, each) in several.iter().zip(several_rounds) {
        let pts = median_points(each);
        let (ns, gbps) = fit_rates(&pts, fit.fixed_ns).map_err(|reason| CalibrateError::Fit {
            path: key,
            reason: format!("{k} readers at once: {reason}"),
        })?;
        concurrency.push(ReadersRate { readers: k, ns_per_descriptor: ns, gbps });
        all_points.extend(pts);
    }
    let model = TransferModel {
        fixed_ns,
        ns_per_descriptor: fit.ns_per_descriptor,
        ns_per_call,
        gbps: fit.gbps,
        ceiling_gbps: best_gbps(&single).max(fit.gbps),
        concurrency,
        fitted: FittedRange {
            min_descriptor_bytes: cfg.sizes.iter().copied().min().unwrap_or(0),
            max_descriptor_bytes: cfg.sizes.iter().copied().max().unwrap_or(0),
            max_readers: cfg.readers.iter().copied().max().unwrap_or(1).max(1),
        },
    };
    let changes = before.as_ref().map(|b| compare_models(b, &model));
    let first = single.first().cloned().unwrap_or(Value::Null);
    // The library's file name only: a path names this machine.
    let library = first["ucx"]["library"].as_str().map(|l| l.rsplit('/').next().unwrap_or(l).to_string());
    let env = crate::host::Environment::detect();
    let provenance = json!({
        "command": cfg.command,
        "host": env.hostname,
        "cpu": env.cpu_model,
        "cores": env.cores,
        "kvx_version": env!("CARGO_PKG_VERSION"),
        "ucx_version": first["ucx"]["version"].as_str().unwrap_or("none (not a UCX path)"),
        "ucx_library": library,
        "ucx_transports": first["ucx"]["transports"],
        "memory": first["memory"],
        "date": date,
    });
    let mut file = json!({
        "kvx_rates_version": RATES_VERSION,
        "note": format!("kvx calibrate on {}, {date}", env.hostname),
        "provenance": provenance,
        "paths": {
            key: {
                "memory": cfg.path.memory(),
                "ns_per_descriptor": model.ns_per_descriptor,
                "ns_per_call": model.ns_per_call,
                "ceiling_gbps": model.ceiling_gbps,
                "how": format!(
                    "least-squares fit of kvx xfer batch times over {} sizes x {} depths, each case the \
                     median of {rounds} rounds (worst miss {:.1}%)",
                    cfg.sizes.len(), cfg.depths.len(), 100.0 * fit.max_rel_error
                ),
                "ceiling_how": "the fastest case of the sweep",
                "model": model,
                "fit": {"max_rel_error": fit.max_rel_error},
            }
        },
        "points": all_points,
    });
    if let Some(c) = &changes {
        file["stability"] =
            json!({"compared_with": cfg.compare.as_ref().map(|p| p.display().to_string()), "terms": c});
    }
    Ok(Calibrated { file, model, fit, changes })
}
