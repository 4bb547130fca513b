//! `kvx bench --compare-transports ucx,storage,multi`: the same workload on each transport,
//! one table in the shape of vLLM's connector guide, but measured — plus the connectors kvx
//! cannot measure on a machine like this one, and why.

use std::collections::BTreeMap;

use serde_json::json;

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
        _ => "",
    }
}

/// Connectors of vLLM's guide kvx does not measure here, with the reason.
const NOT_MEASURED: &[(&str, &str, &str)] = &[
    ("PyNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("P2pNcclConnector", "medium (vLLM's guide)", "needs NVIDIA GPUs and NCCL: no GPU on this machine"),
    ("LMCacheConnectorV1", "variable (vLLM's guide)", "needs an LMCache server (external service) and GPUs"),
];

/// Runs the same workload on each transport (`runs`, resolved by `settings::bench`); returns
/// the comparison summary (one sweep point per transport) and its table.
pub fn run(
    runs: &[BenchSettings],
    writer: &mut RunWriter,
    run_id: &str,
) -> anyhow::Result<(Summary, String)> {
    let plans: Vec<(String, &BenchSettings)> =
        runs.iter().map(|s| (s.workers.transport.kind.as_str().to_string(), s)).collect();
    let Some((_, first)) = plans.first() else {
        anyhow::bail!("--compare-transports needs at least one of ucx, storage, multi");
    };
    let mut summary = Summary::new(run_id, crate::report::summary::now_rfc3339(), first.scenario());
    summary.scenario.name = Some("compare-transports".into());
    summary.environment = crate::report::summary::Environment::detect();
    let mut points = Vec::new();
    let mut rows = Vec::new();
    for (i, (name, settings)) in plans.iter().enumerate() {
        if let Some(sig) = crate::interrupt::requested() {
            let left: Vec<&str> = plans[i..].iter().map(|(n, _)| n.as_str()).collect();
            summary.notes.push(format!("interrupted by {}: {} did not run", sig.name(), left.join(", ")));
            summary.partial = true;
            break;
        }
        crate::output::note!("kvx bench --compare-transports: {name} ({}/{})", i + 1, plans.len());
        let cpu0 = cpu_seconds();
        let s = bench::run(settings, writer, &format!("{run_id}-{name}"))?;
        summary.partial |= s.partial;
        let cpu = cpu_seconds() - cpu0;
        let gb = s.bytes_read as f64 / 1e9;
        let cpu_per_gb = if gb > 0.0 { cpu / gb } else { 0.0 };
        let stage = |st: &str| s.stages.get(st).map(|x| (x.p50_us / 1e3, x.p99_us / 1e3)).unwrap_or_default();
        let (t50, t99) = stage("transfer");
        let (e50, e99) = stage("e2e");
        summary.absorb(&s);
        rows.push((name.clone(), t50, t99, e50, e99, s.throughput_gbps, cpu_per_gb, s.requests_failed));
        let mut params = BTreeMap::new();
        params.insert("transport".into(), json!(name));
        params.insert("cpu_s_per_gb".into(), json!(cpu_per_gb));
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
            descriptors_per_request: Some(s.descriptors_per_request),
            requests_ok: s.requests_ok,
            requests_failed: s.requests_failed,
        });
    }
    let mut t = new_table(
        Style::Terminal,
        &["connector", "transfer p50/p99 ms", "e2e p50/p99 ms", "throughput GB/s", "CPU s per GB", "needs"],
    );
    for (name, t50, t99, e50, e99, gbps, cpu, failed) in &rows {
        let label = match name.as_str() {
            "ucx" => "ucx (NixlConnector's model)",
            "storage" => "storage (SharedStorageConnector's model)",
            "multi" => "multi: ucx, then storage (MultiConnector's model)",
            other => other,
        };
        let fail = if *failed > 0 { format!(" ({failed} failed)") } else { String::new() };
        t.add_row(vec![
            format!("{label}{fail}"),
            format!("{t50:.2} / {t99:.2}"),
            format!("{e50:.2} / {e99:.2}"),
            format!("{gbps:.3}"),
            format!("{cpu:.2}"),
            needs(name).to_string(),
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
    let table = format!("\nConnectors, measured on this machine (same workload each)\n{t}\n");
    let groups: Vec<Bars> = rows
        .iter()
        .map(|(name, t50, _, e50, _, gbps, cpu, _)| Bars {
            label: name.clone(),
            values: vec![
                ("throughput GB/s".into(), *gbps),
                ("transfer p50 ms".into(), *t50),
                ("e2e p50 ms".into(), *e50),
                ("CPU s per GB".into(), *cpu),
            ],
        })
        .collect();
    let svg = bars_svg("Transports on the same workload", &groups)?;
    write_atomic(&writer.dir().join("transports.svg"), svg.as_bytes())?;
    summary.sweep = Some(points);
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    Ok((summary, table))
}
