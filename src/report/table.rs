//! Pure text exporters of a summary: comfy-table tables for the terminal, or the same tables
//! as Markdown (numbers read as `numbers` formats them).
//!
//! Owns how figures read to a person (units, precision, order). Must not do I/O: callers print
//! or write the returned strings.

use crate::transfer::cuda_batch::{BatchDescriptors, BatchLaunch, BatchPath};
use crate::vocab::kinds::VerifyMode;
use comfy_table::{CellAlignment, ContentArrangement, Table, TableStyle, presets};

pub use super::numbers::{fmt_bytes, fmt_f, fmt_ratio};
use super::summary::{
    STAGES, Summary, Waterfall, display_value, ordered_stage_names, ratio, vllm_metrics_line,
};

/// Where a table will be shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Box-drawing characters, for a terminal.
    Terminal,
    /// GitHub-flavoured Markdown tables.
    Markdown,
}

impl Style {
    fn preset(self) -> TableStyle {
        match self {
            Style::Terminal => presets::UTF8_FULL_CONDENSED,
            Style::Markdown => presets::ASCII_MARKDOWN,
        }
    }
}

/// An empty table in `style`. Widths never depend on the terminal, so output is the same in a
/// TTY, a pipe and a snapshot.
pub fn new_table(style: Style, header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(style.preset()).set_content_arrangement(ContentArrangement::Disabled).force_no_tty();
    t.set_header(header.to_vec());
    t
}

/// A table of `kvx topo` and `kvx plan`: UTF-8 condensed, cells wrapped to the terminal's width
/// when stdout is one (left as they are on a pipe).
pub fn wrapped_table(header: Vec<&str>) -> Table {
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED).set_content_arrangement(ContentArrangement::Dynamic);
    t.set_header(header);
    t
}

/// Right-aligns columns `from..` (the numbers).
pub fn align_numbers(t: &mut Table, from: usize) {
    for c in t.column_iter_mut().skip(from) {
        c.set_cell_alignment(CellAlignment::Right);
    }
}

/// A section: a title line (a heading in Markdown), then the table.
pub fn section(title: &str, table: &Table, style: Style) -> String {
    match style {
        Style::Terminal => format!("{title}\n{table}\n"),
        Style::Markdown => format!("### {title}\n\n{table}\n"),
    }
}

/// What was run and where: run id, scenario fields, environment and UCX.
pub fn scenario_table(s: &Summary, style: Style) -> Table {
    let mut t = new_table(style, &["field", "value"]);
    t.add_row(vec!["run".to_string(), s.run_id.clone()]);
    t.add_row(vec!["started".to_string(), s.started_at.clone()]);
    if s.partial {
        t.add_row(vec!["status".to_string(), "PARTIAL (run did not finish)".to_string()]);
    }
    for (k, v) in s.scenario.fields() {
        t.add_row(vec![k, v]);
    }
    let e = &s.environment;
    let host = [e.hostname.as_str(), e.cpu_model.as_str()]
        .iter()
        .filter(|x| !x.is_empty())
        .copied()
        .collect::<Vec<_>>();
    if !host.is_empty() {
        t.add_row(vec!["host".to_string(), host.join(", ")]);
    }
    if e.cores > 0 || e.memory_bytes > 0 {
        t.add_row(vec![
            "cores, memory".to_string(),
            format!("{}, {}", e.cores, fmt_bytes(e.memory_bytes as f64)),
        ]);
    }
    if !e.os.is_empty() {
        let os = if e.kernel.is_empty() { e.os.clone() } else { format!("{} ({})", e.os, e.kernel) };
        t.add_row(vec!["os".to_string(), os]);
    }
    if let Some(l) = &e.launcher {
        t.add_row(vec!["launcher".to_string(), l.describe()]);
    }
    t.add_row(vec!["kvx".to_string(), s.kvx_version.clone()]);
    let u = &s.ucx;
    if !u.version.is_empty() || !u.library.is_empty() {
        t.add_row(vec!["ucx".to_string(), format!("{} ({})", u.version, u.library)]);
    }
    if !u.transports.is_empty() {
        t.add_row(vec!["ucx transports".to_string(), u.transports.join(", ")]);
    }
    if let Some(m) = &u.err_mode {
        t.add_row(vec!["ucx err mode".to_string(), m.clone()]);
    }
    if let Some(p) = &u.protocols {
        t.add_row(vec!["ucx protocols".to_string(), p.summary()]);
    }
    for setting in &u.settings {
        t.add_row(vec!["ucx setting".to_string(), setting.clone()]);
    }
    for n in &s.notes {
        t.add_row(vec!["note".to_string(), n.clone()]);
    }
    for w in &s.warnings {
        t.add_row(vec!["WARNING".to_string(), w.clone()]);
    }
    for (k, v) in &s.counters {
        t.add_row(vec![k.replace('_', " "), v.to_string()]);
    }
    if let Some(b) = &s.cuda_batch {
        t.add_row(vec![
            "cuda-batch".to_string(),
            format!(
                "{} ({}), one batch per {}{}: {:.1} calls, {:.0} descriptors planned / {:.0} copied \
                 (runs merged; {:.0} planned not 16-byte aligned) per request; posting {:.0} ns per \
                 descriptor, {:.1} us per call; per decode rank and request: pack {:.0} us, post {:.0} \
                 us, wait {:.0} us",
                names(&b.paths, BatchPath::as_str, ", "),
                b.driver_calls.join(", "),
                if b.launches.is_empty() {
                    "peer".to_string()
                } else {
                    names(&b.launches, BatchLaunch::as_str, ", ")
                },
                // Named only where some were made on the device (`--batch-descriptors device`).
                if b.descriptors_made_on.contains(&BatchDescriptors::Device) {
                    format!(
                        ", descriptors made on the {}",
                        names(&b.descriptors_made_on, BatchDescriptors::as_str, " and ")
                    )
                } else {
                    String::new()
                },
                b.calls_per_request,
                b.descriptors_per_request,
                b.copies_per_request,
                b.unaligned_descriptors_per_request,
                b.post_ns_per_descriptor,
                b.post_us_per_call,
                b.pack_us_per_rank,
                b.post_us_per_rank,
                b.wait_us_per_rank
            ),
        ]);
    }
    t
}

/// Typed values by name, joined.
fn names<T: Copy>(values: &[T], name: fn(T) -> &'static str, sep: &str) -> String {
    values.iter().map(|&v| name(v)).collect::<Vec<_>>().join(sep)
}

/// Latency percentiles per stage, in microseconds.
pub fn stage_table(s: &Summary, style: Style) -> Table {
    let mut t =
        new_table(style, &["stage", "count", "mean us", "p50 us", "p90 us", "p99 us", "p99.9 us", "max us"]);
    for name in ordered_stage_names(&s.stages) {
        let st = &s.stages[name];
        t.add_row(vec![
            name.to_string(),
            st.count.to_string(),
            fmt_f(st.mean_us),
            fmt_f(st.p50_us),
            fmt_f(st.p90_us),
            fmt_f(st.p99_us),
            fmt_f(st.p999_us),
            fmt_f(st.max_us),
        ]);
    }
    align_numbers(&mut t, 1);
    t
}

/// Throughput, bytes and descriptors, with the same-run ceilings next to them.
pub fn throughput_table(s: &Summary, style: Style) -> Table {
    let mut t = new_table(style, &["metric", "value"]);
    t.add_row(vec!["throughput".to_string(), format!("{} GB/s", fmt_f(s.throughput_gbps))]);
    if let Some(c) = &s.calibration {
        let size = |key: &str| c.extra.get(key).and_then(serde_json::Value::as_f64).map(fmt_bytes);
        let loopback = size("loopback_bytes")
            .map_or("ucx loopback read".to_string(), |b| format!("ucx loopback read of {b}"));
        let same = size("descriptor_bytes")
            .map_or("kvx xfer, same descriptors".to_string(), |b| format!("kvx xfer of {b} descriptors"));
        for (name, v) in [
            ("memcpy".to_string(), c.memcpy_gbps),
            ("device copy, same descriptors".to_string(), c.figure("device_copy_gbps")),
            (
                size("device_bandwidth_bytes")
                    .map_or("device bandwidth".to_string(), |b| format!("device bandwidth (one {b} copy)")),
                c.figure("device_bandwidth_gbps"),
            ),
            (loopback, c.ucx_loopback_gbps),
            // A hybrid run's reads mix sizes: the mix is its like figure, not one region's block.
            (same, c.figure("xfer_same_size_gbps").filter(|_| c.figure("xfer_mix_gbps").is_none())),
            (xfer_mix_name(c), c.figure("xfer_mix_gbps")),
        ] {
            if let Some(v) = v.filter(|v| *v > 0.0) {
                t.add_row(vec![
                    format!("  vs {name} ({} GB/s)", fmt_f(v)),
                    fmt_ratio(ratio(s.throughput_gbps, v)),
                ]);
            }
        }
    }
    t.add_row(vec!["requests/s".to_string(), fmt_f(s.requests_per_s)]);
    t.add_row(vec!["bytes read".to_string(), fmt_bytes(s.bytes_read as f64)]);
    t.add_row(vec!["bytes/request".to_string(), fmt_bytes(s.bytes_per_request)]);
    let d = s.descriptors_per_request;
    if d.raw > 0.0 {
        t.add_row(vec!["descriptors/request (raw)".to_string(), fmt_f(d.raw)]);
        t.add_row(vec!["descriptors/request (coalesced)".to_string(), fmt_f(d.coalesced)]);
    }
    if d.coalesced > 0.0 {
        t.add_row(vec!["bytes/descriptor".to_string(), fmt_bytes(s.bytes_per_request / d.coalesced)]);
    }
    t.add_row(vec!["measured time".to_string(), format!("{} s", fmt_f(s.duration_s))]);
    align_numbers(&mut t, 1);
    t
}

/// The reference a hybrid run's transfers are compared with: `kvx xfer` at each descriptor
/// size of the plan, weighted by the bytes each carries.
fn xfer_mix_name(c: &super::summary::Calibration) -> String {
    let sizes: Vec<u64> = c
        .extra
        .get("xfer_mix")
        .and_then(serde_json::Value::as_array)
        .map(|m| m.iter().filter_map(|d| d.get("descriptor_bytes")?.as_u64()).collect())
        .unwrap_or_default();
    let share =
        c.figure("xfer_mix_share").filter(|s| *s < 0.9995).map(|s| format!(", {:.1}% of them", s * 100.0));
    match (sizes.iter().min(), sizes.iter().max()) {
        (Some(&lo), Some(&hi)) => format!(
            "kvx xfer at the plan's {} descriptor sizes, {}-{}, by bytes{}",
            sizes.len(),
            fmt_bytes(lo as f64),
            fmt_bytes(hi as f64),
            share.unwrap_or_default()
        ),
        _ => "kvx xfer at the plan's descriptor sizes".to_string(),
    }
}

/// Per-request transfer bandwidth by the wall-span rule, beside each rank's own (see
/// [`super::bandwidth`]); with device memory, the request span's share of the device's
/// bandwidth measured in the same run.
pub fn bandwidth_table(s: &Summary, style: Style) -> Option<Table> {
    let b = s.transfer_bandwidth.as_ref()?;
    let device = s.calibration.as_ref().and_then(|c| c.figure("device_bandwidth_gbps"));
    // One rank's reads against one `kvx xfer` pair at the same descriptor sizes (a request's
    // span moves several ranks at once: no like figure).
    let mix = s.calibration.as_ref().and_then(|c| c.figure("xfer_mix_gbps"));
    let mut head = vec!["GB/s per request", "count", "p10", "p50", "p90", "mean"];
    if device.is_some() {
        head.push("p50 vs device bandwidth");
    }
    let mix_head = mix.map(|g| format!("p50 vs kvx xfer, plan's sizes ({} GB/s)", fmt_f(g)));
    if let Some(h) = &mix_head {
        head.push(h);
    }
    let mut t = new_table(style, &head);
    let mut row = |name: &str, x: &super::bandwidth::Spread, per_rank: bool| {
        let mut r = vec![
            name.to_string(),
            x.count.to_string(),
            fmt_f(x.p10),
            fmt_f(x.p50),
            fmt_f(x.p90),
            fmt_f(x.mean),
        ];
        if let Some(d) = device {
            r.push(fmt_ratio(ratio(x.p50, d)));
        }
        if let Some(g) = mix {
            r.push(if per_rank { fmt_ratio(ratio(x.p50, g)) } else { String::new() });
        }
        t.add_row(r);
    };
    if let Some(x) = &b.span_gbps {
        row("request: all ranks' bytes / wall span", x, false);
    }
    row("each rank: its bytes / its own time", &b.rank_gbps, true);
    if let Some(x) = &b.rank_busy_gbps {
        row("each rank, whole run: its bytes / its time transferring", x, true);
    }
    align_numbers(&mut t, 1);
    Some(t)
}

/// What the verification row claims, as strong as the check: the mode that chose the bytes.
fn verified_label(s: &Summary) -> String {
    // A hybrid model through host buffers is checked in each decode rank's KV cache after the
    // copy into it: every block of the request, not the bytes the READs moved.
    // (`host_copy` is a setting of exactly those runs; `state_slices` of every hybrid run, the
    // serving path's too, which reports no parts.)
    let cache = s.scenario.extra.host_copy.is_some();
    let hybrid = !s.hybrid_parts.is_empty() || s.scenario.extra.state_slices.is_some();
    match s.scenario.verify {
        Some(VerifyMode::Full) if cache => {
            "bytes verified (every byte of the request's blocks in the KV caches)".to_string()
        }
        Some(VerifyMode::Sample) if cache => format!(
            "bytes verified (sampled layer blocks of the KV caches; {:.1}% as many bytes as read)",
            100.0 * ratio(s.bytes_verified as f64, s.bytes_read as f64)
        ),
        Some(VerifyMode::Full) => "bytes verified (every byte read)".to_string(),
        Some(VerifyMode::Sample) => format!(
            // A hybrid model's sample is one block in 16 of each layer (prefill fills those).
            "bytes verified (sampled {}, {:.1}% of bytes read)",
            if hybrid { "layer blocks" } else { "blocks" },
            100.0 * ratio(s.bytes_verified as f64, s.bytes_read as f64)
        ),
        Some(VerifyMode::Off) => "bytes verified (verification off)".to_string(),
        None => "bytes verified".to_string(),
    }
}

/// Outcomes, failures by cause, verification and block accounting.
pub fn failures_table(s: &Summary, style: Style) -> Table {
    let mut t = new_table(style, &["metric", "value"]);
    t.add_row(vec!["requests ok".to_string(), s.requests_ok.to_string()]);
    t.add_row(vec!["requests failed".to_string(), s.requests_failed.to_string()]);
    t.add_row(vec!["requests recomputed".to_string(), s.requests_recomputed.to_string()]);
    for (cause, n) in &s.failures_by_cause {
        t.add_row(vec![format!("  cause: {cause}"), n.to_string()]);
    }
    t.add_row(vec![
        verified_label(s),
        format!("{} of {}", fmt_bytes(s.bytes_verified as f64), fmt_bytes(s.bytes_read as f64)),
    ]);
    if s.bytes_padding_read > 0 {
        t.add_row(vec![
            "  read as group padding (no layer's data)".to_string(),
            fmt_bytes(s.bytes_padding_read as f64),
        ]);
    }
    t.add_row(vec!["verify failures".to_string(), s.verify_failures.to_string()]);
    t.add_row(vec!["blocks leaked".to_string(), s.blocks_leaked.to_string()]);
    t.add_row(vec!["blocks freed by lease expiry".to_string(), s.blocks_expired.to_string()]);
    align_numbers(&mut t, 1);
    t
}

/// A hybrid model: what a request read per KV cache group and part (attention pages, each
/// state part), averaged over the requests that ended ok, with each part's share of the bytes.
pub fn hybrid_parts_table(s: &Summary, style: Style) -> Option<Table> {
    if s.hybrid_parts.is_empty() || s.requests_ok == 0 {
        return None;
    }
    let total: u64 = s.hybrid_parts.iter().map(|p| p.bytes).sum();
    let n = s.requests_ok as f64;
    let clipped = s.hybrid_parts.iter().any(|p| p.clipped_bytes > 0);
    let mut head = vec!["group", "kind", "part", "bytes/request", "descriptors/request", "share of bytes"];
    if clipped {
        head.push("not sent (clipping)/request");
    }
    let mut t = new_table(style, &head);
    for p in &s.hybrid_parts {
        let mut row = vec![
            p.group.to_string(),
            p.kind.clone(),
            p.part.clone(),
            fmt_bytes(p.bytes as f64 / n),
            format!("{:.1}", p.descriptors as f64 / n),
            format!("{:.1}%", 100.0 * ratio(p.bytes as f64, total as f64)),
        ];
        if clipped {
            row.push(fmt_bytes(p.clipped_bytes as f64 / n));
        }
        t.add_row(row);
    }
    align_numbers(&mut t, 3);
    Some(t)
}

/// Throughput per rank, when the run reports it.
pub fn per_rank_table(s: &Summary, style: Style) -> Option<Table> {
    if s.per_rank.is_empty() {
        return None;
    }
    let mut t = new_table(style, &["rank", "GB/s over the run", "bytes", "requests"]);
    for r in &s.per_rank {
        t.add_row(vec![
            format!("{}{}", r.role, r.rank),
            fmt_f(r.throughput_gbps),
            fmt_bytes(r.bytes as f64),
            r.requests.to_string(),
        ]);
    }
    align_numbers(&mut t, 1);
    Some(t)
}

/// Headline figures of each repeat.
pub fn repeats_table(s: &Summary, style: Style) -> Option<Table> {
    if s.repeats.is_empty() {
        return None;
    }
    let mut t =
        new_table(style, &["repeat", "GB/s", "requests/s", "ok", "failed", "e2e p50 us", "e2e p99 us"]);
    for r in &s.repeats {
        let e2e = r.stages.get("e2e");
        t.add_row(vec![
            r.index.to_string(),
            fmt_f(r.throughput_gbps),
            fmt_f(r.requests_per_s),
            r.requests_ok.to_string(),
            r.requests_failed.to_string(),
            e2e.map_or("-".into(), |e| fmt_f(e.p50_us)),
            e2e.map_or("-".into(), |e| fmt_f(e.p99_us)),
        ]);
    }
    align_numbers(&mut t, 1);
    Some(t)
}

/// One row per sweep point: its parameters and headline figures.
pub fn sweep_table(s: &Summary, style: Style) -> Option<Table> {
    let points = s.sweep.as_deref().filter(|p| !p.is_empty())?;
    let params: std::collections::BTreeSet<&str> =
        points.iter().flat_map(|p| p.params.keys().map(String::as_str)).collect();
    let mut header: Vec<&str> = vec!["point"];
    header.extend(params.iter().copied());
    header.extend(["GB/s", "requests/s", "transfer p50 us", "e2e p50 us", "desc/req", "bytes/desc"]);
    // `--rates`: predicted beside measured at every point.
    let predicted = points.iter().any(|p| p.predicted_span_p50_us.is_some());
    if predicted {
        header.extend(["span p50 us predicted", "measured", "measured / predicted"]);
    }
    let mut t = new_table(style, &header);
    for p in points {
        let mut row = vec![p.label.clone()];
        row.extend(params.iter().map(|k| p.params.get(*k).map_or_else(|| "-".into(), display_value)));
        row.extend([
            fmt_f(p.throughput_gbps),
            fmt_f(p.requests_per_s),
            p.transfer_p50_us.map_or("-".into(), fmt_f),
            p.e2e_p50_us.map_or("-".into(), fmt_f),
            p.descriptors_per_request.map_or("-".into(), |d| fmt_f(d.coalesced)),
            p.bytes_per_descriptor.map_or("-".into(), fmt_bytes),
        ]);
        if predicted {
            let (pr, m) = (p.predicted_span_p50_us, p.measured_span_p50_us);
            row.extend([
                pr.map_or("-".into(), fmt_f),
                m.map_or("-".into(), fmt_f),
                match (pr, m) {
                    (Some(pr), Some(m)) if pr > 0.0 => format!("{:.3}", m / pr),
                    _ => "-".into(),
                },
            ]);
        }
        t.add_row(row);
    }
    align_numbers(&mut t, 1 + params.len());
    Some(t)
}

/// Every table of a run, in reading order, then the vLLM metrics line.
/// Goodput: the objectives, requests within all of them, their share and rate.
pub fn goodput_table(g: &super::slo::Goodput, style: Style) -> Table {
    let mut t = new_table(style, &["slo", "requests", "within slo", "share", "goodput req/s"]);
    t.add_row(vec![
        g.describe(),
        g.requests.to_string(),
        g.good.to_string(),
        format!("{:.1}%", g.share * 100.0),
        fmt_f(g.requests_per_s),
    ]);
    align_numbers(&mut t, 1);
    t
}

/// `--rates`: predicted beside measured, per request span and per decode rank.
fn prediction_table(p: &super::summary::BenchPrediction, style: Style) -> Table {
    let mut t = new_table(style, &["transfer", "predicted us", "measured us", "measured / predicted"]);
    let ratio = |m: f64, pr: f64| if pr > 0.0 { format!("{:.3}", m / pr) } else { "-".into() };
    t.add_row(vec![
        "request span p50".into(),
        format!("{:.0}", p.transfer_span_p50_us),
        format!("{:.0}", p.measured_transfer_span_p50_us),
        ratio(p.measured_transfer_span_p50_us, p.transfer_span_p50_us),
    ]);
    t.add_row(vec![
        "request span p90".into(),
        format!("{:.0}", p.transfer_span_p90_us),
        format!("{:.0}", p.measured_transfer_span_p90_us),
        ratio(p.measured_transfer_span_p90_us, p.transfer_span_p90_us),
    ]);
    if let Some(b) = &p.closed_loop {
        t.add_row(vec![
            format!("request span p50, at most ({} at once x busiest rank)", b.concurrency),
            format!("{:.0}", b.span_max_us),
            format!("{:.0}", p.measured_transfer_span_p50_us),
            ratio(p.measured_transfer_span_p50_us, b.span_max_us),
        ]);
    }
    let busiest = p.ranks.iter().map(|r| r.transfer_us).fold(0.0, f64::max);
    for (label, m) in
        [("rank p50", p.measured_rank_transfer_p50_us), ("rank p90", p.measured_rank_transfer_p90_us)]
    {
        t.add_row(vec![
            format!("{label} (busiest rank predicted)"),
            format!("{busiest:.0}"),
            format!("{m:.0}"),
            ratio(m, busiest),
        ]);
    }
    if let Some(skew) = p.measured_start_skew_p50_us {
        t.add_row(vec![
            "ranks' start skew p50 (last start - first)".into(),
            "0".into(),
            format!("{skew:.0}"),
            "-".into(),
        ]);
    }
    for r in &p.ranks {
        t.add_row(vec![
            format!(
                "decode rank {}: fixed {:.0} + posting {:.0} + bytes {:.0}",
                r.rank, r.fixed_us, r.post_us, r.bytes_us
            ),
            format!("{:.0}", r.transfer_us),
            "-".into(),
            r.bound.clone(),
        ]);
    }
    t
}

pub fn render_summary(s: &Summary, style: Style) -> String {
    let mut out = String::new();
    if style == Style::Markdown {
        out.push_str(&format!("## kvx run {}\n\n", s.run_id));
    }
    out.push_str(&section("Scenario", &scenario_table(s, style), style));
    out.push('\n');
    if !s.stages.is_empty() {
        out.push_str(&section("Latency by stage", &stage_table(s, style), style));
        out.push('\n');
    }
    if let Some(w) = &s.waterfall {
        out.push_str(&section("TTFT waterfall", &waterfall_table(w, style), style));
        out.push_str(&waterfall_note(w));
        out.push_str("\n\n");
    }
    if let Some(g) = &s.goodput {
        out.push_str(&section("Goodput", &goodput_table(g, style), style));
        out.push('\n');
    }
    // A load run of an HTTP endpoint moved no KV: no zeros for figures it never measured.
    if s.measured_kv() {
        out.push_str(&section("Throughput, bytes, descriptors", &throughput_table(s, style), style));
        out.push('\n');
        if let (Some(t), Some(b)) = (bandwidth_table(s, style), &s.transfer_bandwidth) {
            out.push_str(&section("Transfer bandwidth", &t, style));
            let gap = if style == Style::Markdown { "\n" } else { "" };
            out.push_str(&format!("{gap}clock: {}\n\n", b.clock));
        }
    }
    if let Some(p) = &s.prediction {
        out.push_str(&section(
            "Predicted vs measured transfer (--rates)",
            &prediction_table(p, style),
            style,
        ));
        let mut line = format!(
            "model: {} from {}; {} decode ranks at once; bound by {}",
            p.transport, p.rates, p.readers, p.bound
        );
        if !p.extrapolated.is_empty() {
            line.push_str(&format!("; EXTRAPOLATED: {}", p.extrapolated.join("; ")));
        }
        for shared in &p.shared_host {
            line.push_str(&format!("\nshared host: {shared}"));
        }
        for held in &p.span_includes {
            line.push_str(&format!("\n{held}"));
        }
        if let Some(b) = &p.closed_loop {
            line.push_str(&format!(
                "\nclosed loop: with {} requests at once a request's span lies between one busiest-rank \
                 transfer and {} of them ({:.0} to {:.0} us), plus each rank's own checks and \
                 notifications; measured p50 {:.0} us, {}",
                b.concurrency,
                b.concurrency,
                b.span_min_us,
                b.span_max_us,
                p.measured_transfer_span_p50_us,
                if b.measured_p50_at_most_max { "within it" } else { "PAST IT" }
            ));
        }
        out.push_str(&format!("{line}\n\n"));
    }
    out.push_str(&section("Outcomes and verification", &failures_table(s, style), style));
    if let Some(t) = hybrid_parts_table(s, style) {
        out.push('\n');
        out.push_str(&section("KV cache groups and parts (per request, every decode rank)", &t, style));
    }
    if let Some(t) = per_rank_table(s, style) {
        out.push('\n');
        out.push_str(&section("Per rank", &t, style));
    }
    if let Some(t) = repeats_table(s, style) {
        out.push('\n');
        out.push_str(&section("Repeats", &t, style));
    }
    if let Some(t) = sweep_table(s, style) {
        out.push('\n');
        out.push_str(&section("Sweep", &t, style));
    }
    // The vLLM line describes one run's transfers; a sweep's points carry their own figures.
    if let Some(line) = vllm_metrics_line(s).filter(|_| s.measured_kv()) {
        out.push('\n');
        match style {
            Style::Terminal => out.push_str(&line),
            Style::Markdown => out.push_str(&format!("`{line}`")),
        }
        out.push('\n');
    }
    out
}

/// Stage percentiles, with each stage's share of the mean TTFT.
pub fn waterfall_table(w: &Waterfall, style: Style) -> Table {
    let mut t = new_table(
        style,
        &["stage", "what it covers", "mean ms", "share", "p50 ms", "p90 ms", "p99 ms", "max ms"],
    );
    let mean_ttft = w.bars.first().map_or(0.0, |b| b.ttft_us);
    let ms = |v: f64| fmt_f(v / 1e3);
    for (i, s) in w.stages.iter().enumerate() {
        let share = if mean_ttft > 0.0 { s.stats.mean_us / mean_ttft * 100.0 } else { 0.0 };
        t.add_row(vec![
            s.name.clone(),
            STAGES.get(i).map_or("", |(_, d)| d).to_string(),
            ms(s.stats.mean_us),
            format!("{share:.1}%"),
            ms(s.stats.p50_us),
            ms(s.stats.p90_us),
            ms(s.stats.p99_us),
            ms(s.stats.max_us),
        ]);
    }
    t.add_row(vec![
        "ttft (client)".into(),
        format!("{} requests", w.requests),
        ms(w.ttft.mean_us),
        "100%".into(),
        ms(w.ttft.p50_us),
        ms(w.ttft.p90_us),
        ms(w.ttft.p99_us),
        ms(w.ttft.max_us),
    ]);
    align_numbers(&mut t, 2);
    t
}

/// One line under the table: how well the stages add up.
pub fn waterfall_note(w: &Waterfall) -> String {
    format!(
        "stages tile each request's TTFT; sum of stage p50s {} ms vs TTFT p50 {} ms ({:+.1}%); \
         unattributed (other) {:.1}% of the p50 request",
        fmt_f(w.stage_p50_sum_us / 1e3),
        fmt_f(w.ttft.p50_us / 1e3),
        w.stage_p50_sum_error * 100.0,
        w.unattributed_share_p50 * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_tables_are_markdown() {
        let mut s = Summary::new("r1", "t", Default::default());
        s.stages.insert("e2e".into(), Default::default());
        let md = render_summary(&s, Style::Markdown);
        assert!(md.starts_with("## kvx run r1"));
        assert!(md.contains("### Latency by stage"));
        assert!(md.contains("| stage | count |"), "{md}");
        assert!(md.contains("|---"), "{md}");
        assert!(!md.contains('│'));
    }

    #[test]
    fn the_environment_names_the_launcher_and_the_index_it_gave() {
        let mut s = Summary::new("r1", "t", Default::default());
        assert!(!scenario_table(&s, Style::Markdown).to_string().contains("launcher"));
        s.environment.launcher = Some(crate::vocab::launcher::Launcher::IndexedJob {
            completion_index: 0,
            hostname: Some("kvx-bench-0".into()),
        });
        let t = scenario_table(&s, Style::Markdown).to_string();
        assert!(t.contains("| launcher | Indexed Job, JOB_COMPLETION_INDEX=0, host kvx-bench-0 |"), "{t}");
        let json = serde_json::to_value(&s).expect("json");
        assert_eq!(json["environment"]["launcher"]["kind"], "indexed_job", "{json}");
    }

    #[test]
    fn the_cuda_batch_row_names_device_made_descriptors_only_when_there_are_some() {
        use crate::report::summary::CudaBatchInfo;
        use BatchDescriptors::{Device, Host};
        let row = |made: &[BatchDescriptors]| {
            let mut s = Summary::new("r1", "t", Default::default());
            s.cuda_batch = Some(CudaBatchInfo {
                paths: vec![BatchPath::Kernel],
                launches: vec![BatchLaunch::Rank],
                descriptors_made_on: made.to_vec(),
                ..CudaBatchInfo::default()
            });
            scenario_table(&s, Style::Markdown).to_string()
        };
        assert!(!row(&[Host]).contains("descriptors made on"), "{}", row(&[Host]));
        assert!(
            row(&[Device]).contains("one batch per rank, descriptors made on the device:"),
            "{}",
            row(&[Device])
        );
        assert!(row(&[Host, Device]).contains("made on the host and device"));
    }

    #[test]
    fn the_cuda_batch_row_states_descriptors_planned_and_copied() {
        use crate::report::summary::CudaBatchInfo;
        let mut s = Summary::new("r1", "t", Default::default());
        s.cuda_batch = Some(CudaBatchInfo {
            paths: vec![BatchPath::Kernel],
            descriptors_per_request: 81_920.0,
            copies_per_request: 20_480.0,
            ..CudaBatchInfo::default()
        });
        let row = scenario_table(&s, Style::Markdown).to_string();
        assert!(row.contains("81920 descriptors planned / 20480 copied"), "{row}");
    }
}
