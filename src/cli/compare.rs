//! `kvx bench --compare-transports ucx,storage,multi`: the same workload on each transport,
//! one table in the shape of vLLM's connector guide, but measured — plus the connectors kvx
//! cannot measure on a machine like this one, and why. `kvx bench --compare-modes pull,push`:
//! the same workload read by decode and written by prefill, one table.

use std::collections::BTreeMap;

use serde_json::json;

use crate::diagnose::xfer::run_for_calibration;
use crate::pipeline::bench;
use crate::pipeline::bench::BenchSettings;
use crate::report::chart::{Bars, bars_svg};
use crate::report::files::{RunWriter, write_atomic};
use crate::report::summary::{Summary, SweepPoint};
use crate::report::table::{Style, new_table};

/// CPU seconds (user + system) of this process and of its reaped children so far (0 for
/// what `getrusage` cannot tell).
fn cpu_seconds() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
        .into_iter()
        .filter_map(|who| getrusage(who).ok())
        .map(|u| secs(u.user_time()) + secs(u.system_time()))
        .sum()
}

/// What a connector needs, for the table.
fn needs(kind: &str) -> &'static str {
    match kind {
        "ucx" => "UCX (RDMA NIC, NVLink or shared memory); a side channel (ZMQ) to handshake",
        "storage" => "a directory both sides reach (local disk, NFS, Lustre); no NIC or service",
        "multi" => "both of the above; storage is used only when UCX fails",
        "cuda-batch" => {
            "GPUs of one machine (CUDA IPC), a CUDA 12.8+ driver for the batch API; ZMQ to notify"
        }
        _ => "",
    }
}

/// Connectors of vLLM's guide kvx does not measure here, with the reason.
const NOT_MEASURED: &[(&str, &str, &str)] = &[
    ("PyNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("P2pNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("LMCacheConnectorV1", "variable (vLLM's guide)", "needs an LMCache server (external service) and GPUs"),
];

/// What a comparison compares: the runs differ in this one setting only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compared {
    /// `--compare-transports`: ucx, storage, multi, cuda-batch.
    Transports,
    /// `--compare-modes`: pull (decode READs) and push (prefill WRITEs).
    Modes,
}

impl Compared {
    pub fn flag(self) -> &'static str {
        match self {
            Compared::Transports => "--compare-transports",
            Compared::Modes => "--compare-modes",
        }
    }

    fn name_of(self, s: &BenchSettings) -> String {
        match self {
            Compared::Transports => s.workers.transport.kind.as_str().to_string(),
            Compared::Modes => s.workers.transport.mode.as_str().to_string(),
        }
    }
}

/// One run's figures for the table.
struct Row {
    name: String,
    transfer: (f64, f64),
    e2e: (f64, f64),
    /// Prefill start to the KV in decode's blocks (`kv_ready`), p50 and p99.
    ready: (f64, f64),
    /// Push: the WRITE time hidden behind prefill (`push_hidden`), p50.
    hidden_p50: Option<f64>,
    post_p50: f64,
    notify_p50: f64,
    descriptors: f64,
    gbps: f64,
    cpu_per_gb: f64,
    failed: u64,
}

/// Runs the same workload once per setting compared (`runs`, resolved by `settings::bench`);
/// returns the comparison summary (one sweep point per run) and its table.
pub fn run(
    what: Compared,
    runs: &[BenchSettings],
    writer: &mut RunWriter,
    run_id: &str,
) -> anyhow::Result<(Summary, String)> {
    let plans: Vec<(String, &BenchSettings)> = runs.iter().map(|s| (what.name_of(s), s)).collect();
    let Some((_, first)) = plans.first() else {
        anyhow::bail!("{} needs at least one run", what.flag());
    };
    let mut summary = Summary::new(run_id, crate::report::summary::now_rfc3339(), first.scenario());
    summary.scenario.name = Some(what.flag().trim_start_matches("--").into());
    summary.environment = crate::host::Environment::detect();
    let mut points = Vec::new();
    let mut rows = Vec::new();
    for (i, (name, settings)) in plans.iter().enumerate() {
        if let Some(sig) = crate::interrupt::requested() {
            let left: Vec<&str> = plans[i..].iter().map(|(n, _)| n.as_str()).collect();
            summary.notes.push(format!("interrupted by {}: {} did not run", sig.name(), left.join(", ")));
            summary.partial = true;
            break;
        }
        crate::output::note!("kvx bench {}: {name} ({}/{})", what.flag(), i + 1, plans.len());
        let cpu0 = cpu_seconds();
        let s = bench::run(settings, writer, &format!("{run_id}-{name}"), run_for_calibration)?;
        summary.partial |= s.partial;
        let cpu = cpu_seconds() - cpu0;
        let gb = s.bytes_read as f64 / 1e9;
        let cpu_per_gb = if gb > 0.0 { cpu / gb } else { 0.0 };
        let stage = |st: &str| s.stages.get(st).map(|x| (x.p50_us / 1e3, x.p99_us / 1e3)).unwrap_or_default();
        let (t50, t99) = stage("transfer");
        let (e50, e99) = stage("e2e");
        summary.absorb(&s);
        rows.push(Row {
            name: name.clone(),
            transfer: (t50, t99),
            e2e: (e50, e99),
            ready: stage(crate::pipeline::bench::READY),
            hidden_p50: s.stages.get("push_hidden").map(|x| x.p50_us / 1e3),
            post_p50: stage("post").0,
            notify_p50: stage("notify").0,
            descriptors: s.descriptors_per_request.raw,
            gbps: s.throughput_gbps,
            cpu_per_gb,
            failed: s.requests_failed,
        });
        let mut params = BTreeMap::new();
        let key = match what {
            Compared::Transports => "transport",
            Compared::Modes => "mode",
        };
        params.insert(key.into(), json!(name));
        params.insert("cpu_s_per_gb".into(), json!(cpu_per_gb));
        if let Some(b) = &s.cuda_batch {
            params.insert("cuda_batch_paths".into(), json!(b.paths));
        }
        points.push(SweepPoint {
            label: name.clone(),
            series: Some(name.clone()),
            params,
            block_size: Some(settings.pair().p.block_tokens),
            bytes_per_descriptor: None,
            throughput_gbps: s.throughput_gbps,
            requests_per_s: s.requests_per_s,
            transfer_p50_us: Some(t50 * 1e3),
            e2e_p50_us: Some(e50 * 1e3),
            kv_ready_p50_us: s.stages.get(crate::pipeline::bench::READY).map(|t| t.p50_us),
            transfer_bandwidth: s.transfer_bandwidth.clone(),
            descriptors_per_request: Some(s.descriptors_per_request),
            requests_ok: s.requests_ok,
            requests_failed: s.requests_failed,
        });
    }
    let table = match what {
        Compared::Transports => transports_table(&rows),
        Compared::Modes => modes_table(&rows),
    };
    let groups: Vec<Bars> = rows
        .iter()
        .map(|r| Bars {
            label: r.name.clone(),
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
    };
    let svg = bars_svg(title, &groups)?;
    write_atomic(&writer.dir().join(file), svg.as_bytes())?;
    summary.sweep = Some(points);
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    Ok((summary, table))
}

fn failed_suffix(failed: u64) -> String {
    if failed > 0 { format!(" ({failed} failed)") } else { String::new() }
}

/// The connector table in the shape of vLLM's guide, measured, plus what is not measured.
fn transports_table(rows: &[Row]) -> String {
    let mut t = new_table(
        Style::Terminal,
        &["connector", "transfer p50/p99 ms", "e2e p50/p99 ms", "throughput GB/s", "CPU s per GB", "needs"],
    );
    for r in rows {
        let label = match r.name.as_str() {
            "ucx" => "ucx (NixlConnector's model)",
            "storage" => "storage (SharedStorageConnector's model)",
            "multi" => "multi: ucx, then storage (MultiConnector's model)",
            "cuda-batch" => "cuda-batch (one batched copy per peer)",
            other => other,
        };
        t.add_row(vec![
            format!("{label}{}", failed_suffix(r.failed)),
            format!("{:.2} / {:.2}", r.transfer.0, r.transfer.1),
            format!("{:.2} / {:.2}", r.e2e.0, r.e2e.1),
            format!("{:.3}", r.gbps),
            format!("{:.2}", r.cpu_per_gb),
            needs(&r.name).to_string(),
        ]);
    }
    for (name, guide, why) in NOT_MEASURED {
        t.add_row(vec![
            (*name).to_string(),
            "not measured".into(),
            "not measured".into(),
            (*guide).to_string(),
            "-".into(),
            (*why).to_string(),
        ]);
    }
    format!("\nConnectors, measured on this machine (same workload each)\n{t}\n")
}

/// Pull against push: what each moves and how fast, and the ratio to the first run.
fn modes_table(rows: &[Row]) -> String {
    let mut t = new_table(
        Style::Terminal,
        &[
            "mode",
            "throughput GB/s",
            "vs first",
            "KV ready p50/p99 ms",
            "transfer p50/p99 ms",
            "hidden p50 ms",
            "e2e p50/p99 ms",
            "post p50 ms",
            "notify p50 ms",
            "descriptors/request",
            "CPU s per GB",
        ],
    );
    let base = rows.first().map_or(0.0, |r| r.gbps);
    for r in rows {
        let label = match r.name.as_str() {
            "pull" => "pull (NixlConnector: decode READs)",
            "push" => "push (NixlPushConnector: prefill WRITEs)",
            other => other,
        };
        t.add_row(vec![
            format!("{label}{}", failed_suffix(r.failed)),
            format!("{:.3}", r.gbps),
            if base > 0.0 { format!("{:.2}x", r.gbps / base) } else { "-".into() },
            format!("{:.2} / {:.2}", r.ready.0, r.ready.1),
            format!("{:.2} / {:.2}", r.transfer.0, r.transfer.1),
            r.hidden_p50.map_or_else(|| "-".into(), |h| format!("{h:.2}")),
            format!("{:.2} / {:.2}", r.e2e.0, r.e2e.1),
            format!("{:.3}", r.post_p50),
            format!("{:.3}", r.notify_p50),
            format!("{:.0}", r.descriptors),
            format!("{:.2}", r.cpu_per_gb),
        ]);
    }
    format!(
        "\nPull and push, measured on this machine (same workload each). KV ready = from sending the \
         prefill leg to the KV in every decode rank's blocks (prefill, handoff, transfer): the figure that \
         compares the modes. Push: post = decode's registration, transfer = registration to the last \
         WRITE's notification (the prefill ranks' posting, transfer, flush and notification inside it), \
         hidden = WRITE time spent while prefill still computed (--overlap layers), notify = 0 (the \
         notifications are part of the transfer); descriptors count duplicate WRITEs of replicated heads.\n{t}\n"
    )
}
