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
use crate::report::compare_runs::{RunRow, RunSetting, kv_buffer_table, modes_table, transports_table};
use crate::report::files::{RunWriter, write_atomic};
use crate::report::summary::{Summary, SweepPoint};

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
    let mut points = Vec::new();
    let mut rows = Vec::new();
    for (i, &(setting, settings)) in plans.iter().enumerate() {
        let name = setting.as_str();
        if let Some(sig) = crate::interrupt::requested() {
            let left: Vec<&str> = plans[i..].iter().map(|(n, _)| n.as_str()).collect();
            summary.notes.push(format!("interrupted by {}: {} did not run", sig.name(), left.join(", ")));
            summary.partial = true;
            break;
        }
        crate::output::note!("kvx bench {}: {name} ({}/{})", what.flag(), i + 1, plans.len());
        let cpu0 = cpu_seconds();
        let s = bench::run(settings, writer, &format!("{run_id}-{name}"), xfer)?;
        summary.partial |= s.partial;
        let cpu = cpu_seconds() - cpu0;
        let gb = s.bytes_read as f64 / 1e9;
        let cpu_per_gb = if gb > 0.0 { cpu / gb } else { 0.0 };
        let stage = |st: &str| s.stages.get(st).map(|x| (x.p50_us / 1e3, x.p99_us / 1e3)).unwrap_or_default();
        let (t50, t99) = stage("transfer");
        let (e50, e99) = stage("e2e");
        summary.absorb(&s);
        rows.push(RunRow {
            setting,
            transfer: (t50, t99),
            e2e: (e50, e99),
            ready: stage(bench::READY),
            hidden_p50: s.stages.get("push_hidden").map(|x| x.p50_us / 1e3),
            post_p50: stage("post").0,
            notify_p50: stage("notify").0,
            save_p50: s.stages.get(bench::SAVE_TO_HOST).map(|x| x.p50_us / 1e3),
            sync_p50: s.stages.get(bench::SYNC_TO_DEVICE).map(|x| x.p50_us / 1e3),
            descriptors: s.descriptors_per_request.raw,
            gbps: s.throughput_gbps,
            cpu_per_gb,
            failed: s.requests_failed,
        });
        let mut params = BTreeMap::new();
        let key = match what {
            Compared::Transports => "transport",
            Compared::Modes => "mode",
            Compared::KvBuffer => "kv_buffer_device",
        };
        params.insert(key.into(), json!(name));
        params.insert("cpu_s_per_gb".into(), json!(cpu_per_gb));
        // A host buffer's copies, where the run made them.
        for stage in [bench::SAVE_TO_HOST, bench::SYNC_TO_DEVICE] {
            if let Some(t) = s.stages.get(stage) {
                params.insert(format!("{stage}_p50_us"), json!(t.p50_us));
            }
        }
        if let Some(b) = &s.cuda_batch {
            params.insert("cuda_batch_paths".into(), json!(b.paths));
        }
        points.push(SweepPoint {
            label: name.to_string(),
            series: Some(name.to_string()),
            params,
            block_size: Some(settings.pair().p.block_tokens),
            bytes_per_descriptor: None,
            throughput_gbps: s.throughput_gbps,
            requests_per_s: s.requests_per_s,
            transfer_p50_us: Some(t50 * 1e3),
            e2e_p50_us: Some(e50 * 1e3),
            kv_ready_p50_us: s.stages.get(bench::READY).map(|t| t.p50_us),
            transfer_bandwidth: s.transfer_bandwidth.clone(),
            descriptors_per_request: Some(s.descriptors_per_request),
            requests_ok: s.requests_ok,
            requests_failed: s.requests_failed,
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
