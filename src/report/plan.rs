//! `kvx plan`'s views of a planned request ([`render`]): the descriptor pairs each decode rank
//! posts for one request (or, with `--mode push`, each prefill rank's WRITEs into the decode
//! ranks' blocks), and what posting them costs on each transport; as tables here, as JSON in
//! `plan_json`. Pure: `layouts::request` plans the request, `cli::plan` prints what this returns.

use super::numbers::bytes_text;
use super::prediction::{ProfileInput, Simulator, export_profile, plan_text};
use super::table::wrapped_table;
use crate::layouts::compat::PairSpec;
use crate::layouts::posting::{PathCost, PostPath, PostRates};
use crate::layouts::read_plan::{Pair, RequestBlocks};
use crate::layouts::request::{Planned, PushRankPlan, RankPlan};
use crate::topology::push_map::DRankPushView;

/// How `kvx plan` shows a planned request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanView {
    /// One line of JSON.
    Json,
    /// The tables, with at most `show_pairs` pairs per READ or WRITE of a uniform plan.
    Table { show_pairs: usize },
}

/// The planned request as `view` asks, ready to print.
pub fn render(planned: &Planned, view: PlanView) -> serde_json::Result<String> {
    let show_pairs = match view {
        PlanView::Json => return Ok(format!("{}\n", super::plan_json::json(planned)?)),
        PlanView::Table { show_pairs } => show_pairs,
    };
    Ok(match planned {
        Planned::UniformPull(p) => {
            let mut text = render_pull(&p.request.pair, &p.request.blocks, &p.plans, show_pairs);
            text.push_str(&render_posting(&p.costs, &p.rates));
            text.push_str(&plan_text(&p.predictions, "decode"));
            text
        }
        Planned::UniformPush(p) => {
            let mut text = render_push(&p.request.pair, &p.request.blocks, &p.plans, &p.views, show_pairs);
            text.push_str(&plan_text(&p.predictions, "prefill"));
            text
        }
        Planned::HybridPull(p) => {
            let mut text = render_hybrid(&p.name, &p.planner, &p.plan, p.d_rank);
            text.push_str(&render_posting(&p.costs, &p.rates));
            text.push_str(&plan_text(&p.predictions, "decode"));
            text
        }
        Planned::HybridPush(p) => {
            let rows: Vec<(u32, &crate::layouts::hybrid::write_plan::HybridWrite)> =
                p.writes.iter().flat_map(|(pr, ws)| ws.iter().map(move |w| (*pr, w))).collect();
            let mut text = render_hybrid_push(&p.name, &p.planner, &p.plan, &rows, &p.waits, &p.notif);
            text.push_str(&plan_text(&p.predictions, "prefill"));
            text
        }
    })
}

/// `kvx plan --export`: the planned request's prediction as `sim`'s profile (the ucx model
/// where the rates file has one, else the first path it fitted). `Err` says what is missing.
pub fn export(planned: &Planned, sim: Simulator) -> Result<String, String> {
    let uniform = |pair: &PairSpec, blocks: &RequestBlocks| {
        (
            pair.model.name.clone(),
            format!("P tp {} -> D tp {}", pair.p.tp, pair.d.tp),
            blocks.remote.len() as u64 * u64::from(pair.p.block_tokens),
        )
    };
    let hybrid = |name: &str,
                  planner: &crate::layouts::hybrid::HybridPlanner,
                  plan: &crate::layouts::hybrid::HybridPlan| {
        (
            name.to_string(),
            format!("P tp {} -> D tp {}", planner.config.p.tp, planner.config.d.tp),
            u64::from(plan.tokens.prompt_tokens),
        )
    };
    let (predictions, rates, (name, pair, tokens)) = match planned {
        Planned::UniformPull(p) => (&p.predictions, &p.rates, uniform(&p.request.pair, &p.request.blocks)),
        Planned::UniformPush(p) => (&p.predictions, &p.rates, uniform(&p.request.pair, &p.request.blocks)),
        Planned::HybridPull(p) => (&p.predictions, &p.rates, hybrid(&p.name, &p.planner, &p.plan)),
        Planned::HybridPush(p) => (&p.predictions, &p.rates, hybrid(&p.name, &p.planner, &p.plan)),
    };
    let (path, prediction) = predictions
        .iter()
        .find(|(p, _)| *p == PostPath::Ucx)
        .or(predictions.first())
        .ok_or("needs a fitted model: --rates FILE written by kvx calibrate")?;
    let model = rates.of(*path).model.as_ref().ok_or("the rates file has no fitted model")?;
    let input = ProfileInput {
        model_name: &name,
        pair,
        tokens,
        path: *path,
        prediction,
        model,
        provenance: vec![rates.of(*path).post_source.text()],
    };
    Ok(export_profile(sim, &input))
}

/// The pull view: one row per READ (and per notification-only peer), then the totals.
fn render_pull(pair: &PairSpec, blocks: &RequestBlocks, plans: &[RankPlan], show_pairs: usize) -> String {
    let mut out = heading(
        pair,
        blocks,
        "kvx plan",
        "",
        "to fill",
        if blocks.local.is_empty() { " (full prefix hit: notifications only)" } else { "" },
    );
    let mut table = wrapped_table(vec![
        "D rank",
        "P rank",
        "descriptors",
        "coalesced",
        "bytes",
        "notif",
        "first pairs (local, remote, len)",
    ]);
    let mut totals = Totals::default();
    for (plan, co) in plans {
        for (i, read) in plan.reads.iter().enumerate() {
            let n_co = co.get(i).map_or(0, Vec::len);
            let notif = read.notif_msg.clone();
            table.add_row(totals.row([plan.d_rank, read.p_rank], &read.pairs, n_co, notif, show_pairs));
        }
        for n in &plan.notifs_only {
            table.add_row(vec![
                plan.d_rank.to_string(),
                n.p_rank.to_string(),
                "0".into(),
                "0".into(),
                "-".into(),
                format!("{} (notification only)", n.msg),
                String::new(),
            ]);
        }
    }
    out.push_str(&table.to_string());
    out.push_str(&totals.line());
    out
}

/// The push view: one row per WRITE, the totals, then what each decode rank waits for.
fn render_push(
    pair: &PairSpec,
    blocks: &RequestBlocks,
    plans: &[PushRankPlan],
    views: &[DRankPushView],
    show_pairs: usize,
) -> String {
    let mut out = heading(
        pair,
        blocks,
        "kvx plan --mode push",
        " (NixlPushConnector)",
        "registered",
        if blocks.local.is_empty() {
            " (full prefix hit: decode registers nothing, prefill writes nothing and frees on lease expiry)"
        } else {
            ""
        },
    );
    let mut table = wrapped_table(vec![
        "P rank",
        "D rank",
        "descriptors",
        "coalesced",
        "bytes",
        "notif",
        "first pairs (local = P, remote = D, len)",
    ]);
    let mut totals = Totals::default();
    for (plan, co) in plans {
        for (i, w) in plan.writes.iter().enumerate() {
            let n_co = co.get(i).map_or(0, Vec::len);
            let notif = match w.duplicate_of {
                Some(o) => format!("{} (same bytes as P{o})", w.notif_msg),
                None => w.notif_msg.clone(),
            };
            table.add_row(totals.row([plan.p_rank, w.d_rank], &w.pairs, n_co, notif, show_pairs));
        }
    }
    out.push_str(&table.to_string());
    out.push_str(&totals.line());
    let waits: Vec<String> = views
        .iter()
        .map(|d| {
            let writers: Vec<String> = d.writers.iter().map(|p| format!("P{p}")).collect();
            format!("D{} <- {} ({} notifications)", d.d_rank, writers.join(","), d.expected_notifs)
        })
        .collect();
    out.push_str(&format!("decode waits: {}\n", waits.join("; ")));
    out
}

/// The two lines both views open with: the pair and its rules, then the request's blocks
/// (`decode` says what the decode blocks are for, `empty` what an empty request means).
fn heading(
    pair: &PairSpec,
    blocks: &RequestBlocks,
    command: &str,
    rules: &str,
    decode: &str,
    empty: &str,
) -> String {
    format!(
        "{command}: P tp {} -> D tp {}  |  {}  |  layouts {} / {}  |  vLLM {} rules{rules}\n\
         request: {} prefill blocks, {} decode blocks {decode}{empty}\n",
        pair.p.tp,
        pair.d.tp,
        pair.model.name,
        pair.p.layout,
        pair.d.layout,
        pair.version,
        blocks.remote.len(),
        blocks.local.len(),
    )
}

/// Descriptors, coalesced descriptors and bytes over a view's rows.
#[derive(Default)]
struct Totals {
    descriptors: usize,
    coalesced: usize,
    bytes: u64,
}

impl Totals {
    /// A READ's or WRITE's row (`ranks`: the posting rank, then its peer), counted.
    fn row(
        &mut self,
        ranks: [u32; 2],
        pairs: &[Pair],
        coalesced: usize,
        notif: String,
        show: usize,
    ) -> Vec<String> {
        let bytes: u64 = pairs.iter().map(|p| p.len).sum();
        self.descriptors += pairs.len();
        self.coalesced += coalesced;
        self.bytes += bytes;
        let first: Vec<String> =
            pairs.iter().take(show).map(|p| format!("({}, {}, {})", p.local, p.remote, p.len)).collect();
        let more = pairs.len().saturating_sub(show);
        vec![
            ranks[0].to_string(),
            ranks[1].to_string(),
            pairs.len().to_string(),
            coalesced.to_string(),
            bytes_text(bytes),
            notif,
            if more > 0 { format!("{} ... +{more}", first.join(" ")) } else { first.join(" ") },
        ]
    }

    fn line(&self) -> String {
        let (raw, co) = (self.descriptors, self.coalesced);
        format!(
            "\ntotal: {raw} descriptors ({co} coalesced, {:.1}x fewer), {}\n",
            if co > 0 { raw as f64 / co as f64 } else { 1.0 },
            bytes_text(self.bytes)
        )
    }
}

/// `850 ns`, `12.3 us`, `4.56 ms`, `1.23 s`.
fn time_text(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

/// A rate as it reads: three significant digits, no trailing zeros.
fn num_text(v: f64) -> String {
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

/// The posting-cost section of the table view: per transport, the busiest decode rank's
/// descriptors, posting time and bytes at the ceiling, then where each rate comes from.
fn render_posting(costs: &[PathCost], rates: &PostRates) -> String {
    let mut out = String::from(
        "\nposting cost per request (the busiest decode rank; each posts its own reads in parallel):\n",
    );
    let mut table = wrapped_table(vec![
        "transport",
        "memory",
        "D rank",
        "descriptors",
        "calls",
        "ns/desc",
        "post",
        "bytes at ceiling",
        "post-bound",
        "GB/s at most",
    ]);
    for c in costs {
        let rate = rates.of(c.transport);
        table.add_row(vec![
            c.transport.key().to_string(),
            c.memory.to_string(),
            c.d_rank.to_string(),
            c.descriptors.to_string(),
            c.calls.to_string(),
            num_text(rate.ns_per_descriptor),
            time_text(c.post_ns),
            format!("{} ({} GB/s)", time_text(c.copy_ns), num_text(rate.ceiling_gbps)),
            if c.post_bound { "yes".into() } else { "no".into() },
            format!("{:.2}", c.bound_gbps),
        ]);
    }
    out.push_str(&table.to_string());
    out.push('\n');
    for c in costs {
        let r = rates.of(c.transport);
        let call = if r.ns_per_call > 0.0 {
            format!(" + {} ns/call", num_text(r.ns_per_call))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{}: {} ns/desc{call} (from {}); ceiling {} GB/s (from {})\n",
            c.transport.key(),
            num_text(r.ns_per_descriptor),
            r.post_source.text(),
            num_text(r.ceiling_gbps),
            r.ceiling_source.text()
        ));
    }
    out
}

/// `kvx plan --scenario` of a hybrid case: the pair's block sizes, per KV cache group what
/// clipping kept of prefill's blocks, each decode rank's READs, and what vLLM's rules get wrong.
fn render_hybrid(
    name: &str,
    planner: &crate::layouts::hybrid::HybridPlanner,
    plan: &crate::layouts::hybrid::HybridPlan,
    only_d_rank: Option<u32>,
) -> String {
    let mut out = hybrid_heading("kvx plan", "hybrid", "read", name, planner, plan);
    let mut reads = wrapped_table(vec!["D rank", "P rank", "descriptors", "bytes", "notif"]);
    let (mut total_descs, mut total_bytes) = (0usize, 0u64);
    for dr in plan.d_ranks.iter().filter(|d| only_d_rank.is_none_or(|r| r == d.d_rank)) {
        for r in &dr.reads {
            let bytes = r.bytes();
            total_descs += r.pairs.len();
            total_bytes += bytes;
            reads.add_row(vec![
                dr.d_rank.to_string(),
                r.p_rank.to_string(),
                r.pairs.len().to_string(),
                bytes_text(bytes),
                r.notif_msg.clone(),
            ]);
        }
        for (p_rank, msg) in &dr.notifs_only {
            reads.add_row(vec![
                dr.d_rank.to_string(),
                p_rank.to_string(),
                "0".into(),
                "-".into(),
                format!("{msg} (notification only)"),
            ]);
        }
    }
    out.push_str(&reads.to_string());
    out.push_str(&format!("\ntotal: {total_descs} descriptors, {}\n", bytes_text(total_bytes)));
    out.push_str(&findings_text(plan));
    out
}

/// `kvx plan --mode push` of a hybrid model: each prefill rank's WRITEs (`writes`: prefill
/// rank, its WRITE), then what each decode rank waits for (`waits`: decode rank, the prefill
/// ranks that write into it, notifications it counts).
fn render_hybrid_push(
    name: &str,
    planner: &crate::layouts::hybrid::HybridPlanner,
    plan: &crate::layouts::hybrid::HybridPlan,
    writes: &[(u32, &crate::layouts::hybrid::write_plan::HybridWrite)],
    waits: &[(u32, Vec<u32>, u32)],
    notif: &str,
) -> String {
    let mut out =
        hybrid_heading("kvx plan --mode push", "hybrid, NixlPushConnector", "written", name, planner, plan);
    let mut table =
        wrapped_table(vec!["P rank", "D rank", "descriptors", "bytes", "notif", "what differs from pull"]);
    let (mut total_descs, mut total_bytes) = (0usize, 0u64);
    let mut skipped = Vec::new();
    for &(p_rank, w) in writes {
        let bytes = w.bytes();
        total_descs += w.pairs.len();
        total_bytes += bytes;
        let mut notes = Vec::new();
        if w.attention_skipped {
            notes.push("no attention (vLLM's rule, as read)".to_string());
            skipped.push(w.d_rank);
        }
        if w.duplicate_pairs > 0 {
            notes.push(format!("{} pairs write a head another prefill rank writes too", w.duplicate_pairs));
        }
        table.add_row(vec![
            p_rank.to_string(),
            w.d_rank.to_string(),
            w.pairs.len().to_string(),
            bytes_text(bytes),
            notif.to_string(),
            if notes.is_empty() { "-".to_string() } else { notes.join("; ") },
        ]);
    }
    out.push_str(&table.to_string());
    out.push_str(&format!("\ntotal: {total_descs} descriptors, {}\n", bytes_text(total_bytes)));
    let waits: Vec<String> = waits
        .iter()
        .map(|(d, writers, n)| {
            let writers: Vec<String> = writers.iter().map(|p| format!("P{p}")).collect();
            format!("D{d} <- {} ({n} notifications)", writers.join(","))
        })
        .collect();
    out.push_str(&format!("decode waits: {}\n", waits.join("; ")));
    skipped.sort_unstable();
    skipped.dedup();
    if !skipped.is_empty() {
        let ranks: Vec<String> = skipped.iter().map(|d| format!("D{d}")).collect();
        out.push_str(&format!(
            "\nvLLM 0.33's push writes attention into the first decode rank of each head only (as read from \
             push_worker.py, not run on vLLM): {} get their state but no attention. \
             --push-attention every-rank writes each rank's head, as pull reads it.\n",
            ranks.join(", ")
        ));
    }
    out.push_str(&findings_text(plan));
    out
}

/// The lines every hybrid view opens with: the command, the pair and the rules, the block
/// sizes and the request, then the groups and what clipping left out.
fn hybrid_heading(
    command: &str,
    connector: &str,
    moved: &str,
    name: &str,
    planner: &crate::layouts::hybrid::HybridPlanner,
    plan: &crate::layouts::hybrid::HybridPlan,
) -> String {
    let (p, d) = (&planner.p, &planner.d);
    let mut rules = format!("vLLM 0.33 rules ({connector})");
    if planner.config.state_slices == crate::layouts::hybrid::StateSlices::Exact {
        rules.push_str(", but state slices by kvx's exact rule (--state-slices exact)");
    }
    if planner.config.host_copy == crate::layouts::hybrid::HostCopyRule::PerGroup {
        rules.push_str(", but the host copy per group (--host-copy per-group)");
    }
    if planner.config.d.host_state_page_padded {
        rules.push_str(", but padded host state pages (--host-state-page padded)");
    }
    if planner.config.d.host_descriptors_per_group {
        rules.push_str(", but host attention descriptors per group (--host-descriptors per-group)");
    }
    if planner.config.push_attention == crate::layouts::hybrid::write_plan::PushAttention::EveryRank {
        rules.push_str(", but attention written into every decode rank (--push-attention every-rank)");
    }
    let mut out = format!(
        "{command}: {name}  |  P tp {} -> D tp {}  |  {rules}\n\
         block size P {} / D {} tokens (kernel blocks {} / {}), page P {} / D {}; {} prompt tokens, {} {moved}\n",
        p.config.tp,
        d.config.tp,
        p.sizing.block_tokens,
        d.sizing.block_tokens,
        p.kernel_block_tokens,
        d.kernel_block_tokens,
        bytes_text(p.sizing.page_bytes),
        bytes_text(d.sizing.page_bytes),
        plan.tokens.prompt_tokens,
        plan.tokens.d_external_tokens,
    );
    out.push_str(&engines_text(planner));
    let mut groups = wrapped_table(vec!["group", "kind", "layers", "prefill blocks", "sent", "clipped"]);
    for c in &plan.clipping {
        let g = p.groups.iter().find(|g| g.index == c.group);
        let kind = g.map_or_else(String::new, |g| match g.kind {
            crate::layouts::hybrid::geometry::GroupKind::SlidingWindow { window_tokens } => {
                format!("sliding window ({window_tokens} tokens)")
            }
            k => k.vllm_spec().trim_end_matches("Spec").to_string(),
        });
        groups.add_row(vec![
            c.group.to_string(),
            kind,
            g.map_or(0, |g| g.layers.len()).to_string(),
            c.raw_blocks.to_string(),
            c.sent_blocks.to_string(),
            c.raw_blocks.saturating_sub(c.sent_blocks).to_string(),
        ]);
    }
    out.push_str(&groups.to_string());
    out.push('\n');
    out
}

/// Where the two engines' geometry came from: derived by kvx (under which settings), or as a
/// case states it, with each field where kvx's own derivation differs.
pub fn engines_text(planner: &crate::layouts::hybrid::HybridPlanner) -> String {
    use crate::layouts::hybrid::model::StateKind;
    let e = &planner.config.p;
    let gdn = planner.p.state.as_ref().is_some_and(|s| s.kind == StateKind::Gdn);
    let mut settings = format!("{} attention", e.attention_backend.vllm_name());
    if gdn {
        settings.push_str(&format!(", GDN prefill {}", e.gdn_prefill.name()));
    }
    if planner.p.has_state() {
        settings.push_str(if e.prefix_caching { ", prefix caching on" } else { ", prefix caching off" });
    }
    let [ps, ds] = &planner.sources;
    if !ps.stated && !ds.stated {
        return format!("engines derived by kvx from the model ({settings})\n");
    }
    let mut out = String::from("engines as the case states them (planned as given); ");
    let diffs: Vec<String> = [ps, ds]
        .iter()
        .flat_map(|s| {
            let side = if s.side == crate::layouts::hybrid::geometry::Side::Prefill { "P" } else { "D" };
            let mut v: Vec<String> = s
                .differences
                .iter()
                .map(|d| format!("{side} {}: stated {}, kvx derives {}", d.field, d.stated, d.derived))
                .collect();
            if let Some(why) = &s.underivable {
                v.push(format!("{side}: kvx cannot derive it ({why})"));
            }
            v
        })
        .collect();
    if diffs.is_empty() {
        out.push_str(&format!("kvx derives the same ({settings})\n"));
    } else {
        out.push_str(&format!("kvx derives otherwise ({settings}):\n"));
        for d in diffs {
            out.push_str(&format!("  {d}\n"));
        }
    }
    out
}

/// Where vLLM's rules move the wrong bytes in `plan` (its findings include the planner's, those
/// that hold for every request); empty when nowhere.
fn findings_text(plan: &crate::layouts::hybrid::HybridPlan) -> String {
    if plan.findings.is_empty() {
        return String::new();
    }
    let mut out = format!("\nwhere vLLM 0.33's rules move the wrong bytes ({}):\n", plan.findings.len());
    for f in &plan.findings {
        out.push_str(&format!("  {f:?}\n"));
    }
    out
}
