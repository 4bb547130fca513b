//! `kvx bench --compare-transports ucx,storage,multi`: the same workload on each transport,
//! one table in the shape of vLLM's connector guide, but measured — plus the connectors kvx
//! cannot measure on a machine like this one, and why. `kvx bench --compare-modes pull,push`:
//! the same workload read by decode and written by prefill, one table.

use std::collections::BTreeMap;

use serde_json::json;

use crate::config::bench::BenchSettings;
use crate::host::cpu_seconds;
use crate::pipeline::bench::{self, XferRunner};
use crate::report::chart::{Bars, bars_svg};
use crate::report::compare_runs::{
    RunRow, RunSetting, Spread, kv_buffer_table, modes_table, transports_table,
};
use crate::report::files::{RunWriter, write_atomic};
use crate::report::summary::{Summary, SweepPoint};

/// The median of a run's rounds (0 where none has the figure).
fn median(v: Vec<f64>) -> f64 {
    crate::report::stats::median(&v).unwrap_or(0.0)
}

/// What a comparison compares: the runs differ in this one setting only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compared {
    /// `--compare-transports`: ucx, storage, multi, cuda-batch.
    Transports,
    /// `--compare-modes`: pull (decode READs) and push (prefill WRITEs).
    Modes,
    /// `--compare-kv-buffer-device`: reads of the KV pool itself, and through host buffers.
    KvBuffer,
}

impl Compared {
    pub fn flag(self) -> &'static str {
        match self {
            Compared::Transports => "--compare-transports",
            Compared::Modes => "--compare-modes",
            Compared::KvBuffer => "--compare-kv-buffer-device",
        }
    }

    fn setting_of(self, s: &BenchSettings) -> RunSetting {
        match self {
            Compared::Transports => RunSetting::Transport(s.workers.transport.kind),
            Compared::Modes => RunSetting::Mode(s.workers.transport.mode),
            Compared::KvBuffer => RunSetting::KvBuffer(s.workers.transport.kv_buffer),
        }
    }
}

/// Runs the same workload once per setting compared (`runs`, resolved by `settings::bench`;
/// `xfer` measures each bench's calibration); returns the comparison summary (one sweep point
/// per run) and its table.
pub fn run(
    what: Compared,
    runs: &[BenchSettings],
    writer: &mut RunWriter,
    run_id: &str,
    xfer: XferRunner,
) -> anyhow::Result<(Summary, String)> {
    let plans: Vec<(RunSetting, &BenchSettings)> = runs.iter().map(|s| (what.setting_of(s), s)).collect();
    let Some((_, first)) = plans.first() else {
        anyhow::bail!("{} needs at least one run", what.flag());
    };
    let mut summary = Summary::new(
        run_id,
        crate::report::summary::now_rfc3339(),
        crate::report::scenario::bench_scenario(first),
    );
    summary.scenario.name = Some(what.flag().trim_start_matches("--").into());
    summary.environment = crate::host::Environment::detect();
    let rounds = first.rounds.max(1) as usize;
    // Each run's measured rounds, in round order; the order within a round alternates.
    let mut measured: Vec<Vec<Round>> = plans.iter().map(|_| Vec::new()).collect();
    'rounds: for round in 0..rounds {
        let order: Vec<usize> =
            if round % 2 == 0 { (0..plans.len()).collect() } else { (0..plans.len()).rev().collect() };
        for (pos, &i) in order.iter().enumerate() {
            let (setting, settings) = plans[i];
            let name = setting.as_str();
            if let Some(sig) = crate::interrupt::requested() {
                let left: Vec<&str> = order[pos..].iter().map(|&j| plans[j].0.as_str()).collect();
                let of_round =
                    if rounds > 1 { format!(" in round {} of {rounds}", round + 1) } else { String::new() };
                summary.notes.push(format!(
                    "interrupted by {}: {} did not run{of_round}",
                    sig.name(),
                    left.join(", ")
                ));
                summary.partial = true;
                break 'rounds;
            }
            let id = if rounds > 1 {
                format!("{run_id}-{name}-r{}", round + 1)
            } else {
                format!("{run_id}-{name}")
            };
            if rounds > 1 {
                crate::output::note!(
                    "kvx bench {}: round {}/{rounds}: {name} ({}/{})",
                    what.flag(),
                    round + 1,
                    pos + 1,
                    plans.len()
                );
            } else {
                crate::output::note!("kvx bench {}: {name} ({}/{})", what.flag(), i + 1, plans.len());
            }
            let cpu0 = cpu_seconds();
            let s = bench::run(settings, writer, &id, xfer)?;
            let cpu = cpu_seconds() - cpu0;
            summary.partial |= s.partial;
            summary.absorb(&s);
            measured[i].push(Round { cpu, s });
        }
    }
    let mut points = Vec::new();
    let mut rows = Vec::new();
    for (i, &(setting, settings)) in plans.iter().enumerate() {
        let runs = &measured[i];
        if runs.is_empty() {
            continue;
        }
        let name = setting.as_str();
        let med = |f: &dyn Fn(&Round) -> f64| median(runs.iter().map(f).collect());
        let stage = |st: &'static str, p99: bool| {
            move |r: &Round| r.s.stages.get(st).map_or(0.0, |x| if p99 { x.p99_us } else { x.p50_us } / 1e3)
        };
        let opt_stage = |st: &str| {
            let v: Vec<f64> =
                runs.iter().filter_map(|r| r.s.stages.get(st).map(|x| x.p50_us / 1e3)).collect();
            (!v.is_empty()).then(|| median(v))
        };
        let gbps = med(&|r| r.s.throughput_gbps);
        let cpu_per_gb = med(&|r| {
            let gb = r.s.bytes_read as f64 / 1e9;
            if gb > 0.0 { r.cpu / gb } else { 0.0 }
        });
        let (t50, t99) = (med(&stage("transfer", false)), med(&stage("transfer", true)));
        let (e50, e99) = (med(&stage("e2e", false)), med(&stage("e2e", true)));
        // Against the first run, round by round (the rounds both ran).
        let ratios: Vec<f64> = runs
            .iter()
            .zip(&measured[0])
            .filter(|(_, base)| base.s.throughput_gbps > 0.0)
            .map(|(r, base)| r.s.throughput_gbps / base.s.throughput_gbps)
            .collect();
        let vs_first = (!ratios.is_empty()).then(|| Spread::of(&ratios));
        let last = &runs[runs.len() - 1].s;
        rows.push(RunRow {
            setting,
            transfer: (t50, t99),
            e2e: (e50, e99),
            ready: (med(&stage(bench::READY, false)), med(&stage(bench::READY, true))),
            hidden_p50: opt_stage("push_hidden"),
            post_p50: med(&stage("post", false)),
            notify_p50: med(&stage("notify", false)),
            save_p50: opt_stage(bench::SAVE_TO_HOST),
            sync_p50: opt_stage(bench::SYNC_TO_DEVICE),
            descriptors: last.descriptors_per_request.raw,
            gbps,
            cpu_per_gb,
            failed: runs.iter().map(|r| r.s.requests_failed).sum(),
            vs_first,
            rounds: runs.len(),
        });
        let mut params = BTreeMap::new();
        let key = match what {
            Compared::Transports => "transport",
            Compared::Modes => "mode",
            Compared::KvBuffer => "kv_buffer_device",
        };
        params.insert(key.into(), json!(name));
        params.insert("cpu_s_per_gb".into(), json!(cpu_per_gb));
        if rounds > 1 {
            params.insert("rounds".into(), json!(runs.len()));
            // GB/s to 3 decimals: the table prints the list as it is.
            let gbps: Vec<f64> = runs.iter().map(|r| (r.s.throughput_gbps * 1e3).round() / 1e3).collect();
            params.insert("round_gbps".into(), json!(gbps));
            if let Some(v) = vs_first {
                params.insert("ratio_to_first".into(), json!(v.median));
                params.insert("ratio_to_first_min".into(), json!(v.min));
                params.insert("ratio_to_first_max".into(), json!(v.max));
            }
        }
        // A host buffer's copies, where the run made them.
        for stage in [bench::SAVE_TO_HOST, bench::SYNC_TO_DEVICE] {
            let v: Vec<f64> = runs.iter().filter_map(|r| r.s.stages.get(stage).map(|t| t.p50_us)).collect();
            if !v.is_empty() {
                params.insert(format!("{stage}_p50_us"), json!(median(v)));
            }
        }
        if let Some(b) = &last.cuda_batch {
            params.insert("cuda_batch_paths".into(), json!(b.paths));
        }
        let kv_ready: Vec<f64> =
            runs.iter().filter_map(|r| r.s.stages.get(bench::READY).map(|t| t.p50_us)).collect();
        points.push(SweepPoint {
            label: name.to_string(),
            series: Some(name.to_string()),
            params,
            block_size: Some(settings.pair().p.block_tokens),
            bytes_per_descriptor: None,
            throughput_gbps: gbps,
            requests_per_s: med(&|r| r.s.requests_per_s),
            transfer_p50_us: Some(t50 * 1e3),
            e2e_p50_us: Some(e50 * 1e3),
            kv_ready_p50_us: (!kv_ready.is_empty()).then(|| median(kv_ready)),
            transfer_bandwidth: last.transfer_bandwidth.clone(),
            descriptors_per_request: Some(last.descriptors_per_request),
            requests_ok: runs.iter().map(|r| r.s.requests_ok).sum(),
            requests_failed: runs.iter().map(|r| r.s.requests_failed).sum(),
            predicted_span_p50_us: None,
            measured_span_p50_us: None,
        });
    }
    let table = match what {
        Compared::Transports => transports_table(&rows),
        Compared::Modes => modes_table(&rows),
        Compared::KvBuffer => kv_buffer_table(&rows),
    };
    let groups: Vec<Bars> = rows
        .iter()
        .map(|r| Bars {
            label: r.setting.as_str().to_string(),
            values: vec![
                ("throughput GB/s".into(), r.gbps),
                ("transfer p50 ms".into(), r.transfer.0),
                ("e2e p50 ms".into(), r.e2e.0),
                ("KV ready p50 ms".into(), r.ready.0),
                ("CPU s per GB".into(), r.cpu_per_gb),
            ],
        })
        .collect();
    let (title, file) = match what {
        Compared::Transports => ("Transports on the same workload", "transports.svg"),
        Compared::Modes => ("Pull and push on the same workload", "modes.svg"),
        Compared::KvBuffer => ("The KV pool and a host buffer on the same workload", "kv-buffer.svg"),
    };
    let svg = bars_svg(title, &groups)?;
    write_atomic(&writer.dir().join(file), svg.as_bytes())?;
    summary.sweep = Some(points);
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    Ok((summary, table))
}

/// One measured run of a comparison's round, and the CPU time it took.
struct Round {
    cpu: f64,
    s: Summary,
}
