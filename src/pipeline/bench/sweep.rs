//! `kvx bench --sweep FILE`: the job `settings::sweep` resolved ([`SweepJob`]: every point
//! with its settings, or why they were rejected) and its runner: one bench per point, one row
//! per point in the report (plus a chart of bandwidth against message size). A point the
//! planning core rejected is reported, not fatal.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::config::sweep::{SweepJob, text};
use crate::pipeline::bench::{self, XferRunner};
use crate::report::files::RunWriter;
use crate::report::summary::Summary;

/// Runs every point (`xfer` measures each bench's calibration); returns the sweep summary.
pub fn run(
    plan: &SweepJob,
    writer: &mut RunWriter,
    run_id: &str,
    xfer: XferRunner,
) -> anyhow::Result<Summary> {
    let Some(first) = plan.points.iter().find_map(|p| p.settings.as_ref().ok()) else {
        anyhow::bail!("every point of the sweep is rejected");
    };
    let mut summary = Summary::new(
        run_id,
        crate::report::summary::now_rfc3339(),
        crate::report::scenario::bench_scenario(first),
    );
    summary.scenario.name = Some(plan.name.clone());
    summary.environment = crate::host::Environment::detect();
    let mut out = Vec::new();
    let n = plan.points.len();
    for (i, planned) in plan.points.iter().enumerate() {
        if let Some(sig) = crate::interrupt::requested() {
            summary.notes.push(format!("interrupted by {}: points {}..{n} did not run", sig.name(), i + 1));
            summary.partial = true;
            break;
        }
        let label = planned.label();
        let params: BTreeMap<String, Value> = planned.point.iter().cloned().collect();
        let series = plan.series_axis.as_ref().and_then(|a| params.get(a)).map(text);
        crate::output::note!("kvx bench --sweep: point {}/{n}: {label}", i + 1);
        let settings = match &planned.settings {
            Ok(s) => s,
            Err(e) => {
                crate::output::note!("  rejected: {e}");
                summary.notes.push(format!("{label}: rejected: {e}"));
                continue;
            }
        };
        let s = bench::run(settings, writer, &format!("{run_id}-p{i}"), xfer)?;
        summary.absorb(&s);
        summary.partial |= s.partial;
        let descs = s.descriptors_per_request;
        out.push(crate::report::summary::SweepPoint {
            label,
            series,
            params,
            block_size: settings.pair().p.block_tokens.into(),
            bytes_per_descriptor: (descs.raw > 0.0).then(|| s.bytes_per_request / descs.raw),
            throughput_gbps: s.throughput_gbps,
            requests_per_s: s.requests_per_s,
            transfer_p50_us: s.stages.get("transfer").map(|t| t.p50_us),
            e2e_p50_us: s.stages.get("e2e").map(|t| t.p50_us),
            kv_ready_p50_us: s.stages.get(bench::READY).map(|t| t.p50_us),
            transfer_bandwidth: s.transfer_bandwidth.clone(),
            descriptors_per_request: Some(descs),
            requests_ok: s.requests_ok,
            requests_failed: s.requests_failed,
            predicted_span_p50_us: s.prediction.as_ref().map(|p| p.transfer_span_p50_us),
            measured_span_p50_us: s.prediction.as_ref().map(|p| p.measured_transfer_span_p50_us),
        });
    }
    summary.sweep = Some(out);
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    Ok(summary)
}
