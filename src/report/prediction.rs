//! Predictions of the fitted transfer-time model (`layouts::predict`) beside measurements,
//! and the profiles simulators take:
//!
//! - [`bench_prediction`]: a `kvx bench` run's predicted transfer (each decode rank's
//!   descriptors and bytes per request, as the run's plan gave them) against its measured one,
//!   for `summary.json`'s `prediction`;
//! - [`calibrate_text`]: what `kvx calibrate` fitted;
//! - [`plan_text`]: `kvx plan --rates`'s prediction section;
//! - [`export_profile`]: the prediction in a simulator's own terms (llm-d's inference
//!   simulator, Dynamo's mocker), with the provenance in comments.
//!
//! Pure: never measures, reads nothing.

use super::summary::{BenchPrediction, ClosedLoopBound, RankPredicted, Summary};
use crate::layouts::posting::PostPath;
use crate::layouts::predict::{BatchFit, RankLoad, RequestPrediction, TermChange, TransferModel};

const US: f64 = 1e3;

/// The run's predicted transfer against its measured one; `None` for a run this model does not
/// describe (no transfer measured, a push run: its posting ranks are the prefill ranks,
/// whose bytes the summary does not split).
pub fn bench_prediction(
    s: &Summary,
    model: &TransferModel,
    path: PostPath,
    rates: &str,
) -> Option<BenchPrediction> {
    if s.scenario.extra.mode.is_some_and(|m| m == crate::topology::TransferMode::Push) {
        return None;
    }
    let span = s.stages.get("transfer_span")?;
    let rank_stats = s.stages.get("transfer");
    let coalesced = s.scenario.extra.coalesce.unwrap_or(false) || path == PostPath::CudaBatch;
    let descs = if coalesced { s.descriptors_per_request.coalesced } else { s.descriptors_per_request.raw };
    let decode: Vec<_> = s.per_rank.iter().filter(|r| r.role == "decode" && r.requests > 0).collect();
    if decode.is_empty() || s.bytes_per_request <= 0.0 {
        return None;
    }
    // Each rank's share of the request's bytes; its descriptors in the same share (every rank
    // of a pair reads the same blocks of its own heads).
    let loads: Vec<RankLoad> = decode
        .iter()
        .map(|r| {
            let bytes = r.bytes / r.requests;
            let share = bytes as f64 / s.bytes_per_request;
            let descriptors = (descs * share).round() as u64;
            let peers = if path == PostPath::CudaBatch { 1 } else { descriptors };
            RankLoad { rank: r.rank, descriptors, calls: peers, bytes }
        })
        .collect();
    let readers = u32::try_from(loads.len()).unwrap_or(u32::MAX);
    let p = model.predict_request(&loads, readers);
    let skew = s.transfer_bandwidth.as_ref().and_then(|b| b.start_skew_us).map(|x| x.p50);
    let predicted_us = p.span_ns / US;
    let closed = ranks_start_free(s)
        .then(|| closed_loop(s.scenario.concurrency.unwrap_or(1), busiest_us(&p), span.p50_us))
        .flatten();
    let ratio = |m: f64| if predicted_us > 0.0 { m / predicted_us } else { 0.0 };
    Some(BenchPrediction {
        transport: path.key().to_string(),
        rates: rates.to_string(),
        readers,
        bound: p.bound.as_str().to_string(),
        transfer_span_p50_us: predicted_us,
        transfer_span_p90_us: predicted_us,
        measured_transfer_span_p50_us: span.p50_us,
        measured_transfer_span_p90_us: span.p90_us,
        ratio: ratio(span.p50_us),
        ratio_p90: ratio(span.p90_us),
        ranks: p
            .ranks
            .iter()
            .map(|r| RankPredicted {
                rank: r.rank,
                descriptors: r.descriptors,
                bytes: r.bytes,
                fixed_us: r.fixed_ns / US,
                post_us: r.post_ns / US,
                bytes_us: r.bytes_ns / US,
                transfer_us: r.total_ns / US,
                bound: r.bound.as_str().to_string(),
            })
            .collect(),
        measured_rank_transfer_p50_us: rank_stats.map_or(0.0, |t| t.p50_us),
        measured_rank_transfer_p90_us: rank_stats.map_or(0.0, |t| t.p90_us),
        extrapolated: p.extrapolated,
        shared_host: shared_host(s, readers),
        measured_start_skew_p50_us: skew,
        span_includes: start_skew(s, skew, span.p50_us),
        closed_loop: closed,
    })
}

/// Whether the run's decode ranks each started the next request as soon as they were free
/// (`--rank-start free`, and every run before kvx recorded it), rather than all together.
fn ranks_start_free(s: &Summary) -> bool {
    s.scenario.extra.rank_start != Some(crate::config::worker::RankStart::Together)
}

/// The busiest rank's predicted transfer (us).
fn busiest_us(p: &RequestPrediction) -> f64 {
    p.ranks.iter().map(|r| r.total_ns / US).fold(0.0, f64::max)
}

/// With `at_once` > 1 requests in a closed loop whose decode ranks each start the next request
/// as soon as they are free (`--rank-start free`), a request's span by the model: each decode
/// rank serves requests in turn, and a request is sent only once the one `at_once` before it finished
/// on every rank, so when it arrives a rank has at most `at_once - 1` requests left before it.
/// Its ranks start it at most `at_once - 1` transfers apart, and the span lies between one
/// busiest-rank transfer and `at_once` of them, plus each rank's own work per request beside the
/// transfer (its checks, notifications), which the model does not predict: a run with
/// `--verify full` can pass the top. Where in that range depends on how far the ranks drift
/// apart, which is the run's jitter, not a fitted term. `None` at one at a time.
fn closed_loop(at_once: u32, busiest_us: f64, measured_p50_us: f64) -> Option<ClosedLoopBound> {
    if at_once <= 1 || busiest_us <= 0.0 {
        return None;
    }
    let span_max_us = f64::from(at_once) * busiest_us;
    Some(ClosedLoopBound {
        concurrency: at_once,
        span_min_us: busiest_us,
        span_max_us,
        // Only the top is checked: a span under one predicted transfer is a transfer faster than
        // predicted (the ratio says by how much), not a loop the bound misses.
        measured_p50_at_most_max: measured_p50_us <= span_max_us,
    })
}

/// The ranks' start skew, said where it is 5% of the measured span p50 or more. The model's
/// point prediction is a request whose ranks start together. With several requests at once and
/// ranks that start as soon as they are free, each decode rank serves them in turn and starts
/// the next when its own part of the one before is done, so a request's ranks start apart, up
/// to the closed loop's bound (`closed_loop`); ranks that start together are told at once, and
/// what still parts them is the host.
fn start_skew(s: &Summary, skew_p50_us: Option<f64>, span_p50_us: f64) -> Vec<String> {
    let Some(skew) = skew_p50_us else { return Vec::new() };
    if span_p50_us <= 0.0 || skew < 0.05 * span_p50_us {
        return Vec::new();
    }
    let at_once = s.scenario.concurrency.unwrap_or(1);
    let why = if at_once > 1 && ranks_start_free(s) {
        format!(
            "with {at_once} requests at once each decode rank serves them in turn and starts the next \
             when its own part of the one before is done, so a request's ranks start up to {} \
             transfer{} apart (the closed loop's bound)",
            at_once - 1,
            if at_once > 2 { "s" } else { "" }
        )
    } else {
        "the ranks received or began the request at different times (a busy host)".to_string()
    };
    vec![format!(
        "start skew: a request's ranks started {} apart (p50), {:.0}% of its span: {why}; the model's \
         point prediction is ranks that start together",
        time_text(skew * 1e3),
        100.0 * skew / span_p50_us,
    )]
}

/// What kvx's own work put beside the measured transfers on the host. `--verify full` checks
/// every byte read (about what copying it costs on a host) and has the prefill ranks write
/// every byte first: with several requests at once, or several decode ranks of which some
/// finish early, that work runs while other transfers do and takes their cores and memory
/// bandwidth. A deployment's transfer has no such neighbour, and the model predicts that.
fn shared_host(s: &Summary, readers: u32) -> Vec<String> {
    let full = s.scenario.verify == Some(crate::vocab::kinds::VerifyMode::Full);
    let at_once = s.scenario.concurrency.unwrap_or(1);
    let mut out = Vec::new();
    if full && (at_once > 1 || readers > 1) {
        // Two requests at once: one's fill and check run beside the other's reads. One request
        // on several ranks: the fill is done before any reads, a rank done early checks.
        let (why, work) = if at_once > 1 {
            (format!("{at_once} requests at once"), "filling and checking every byte of one request")
        } else {
            (format!("{readers} decode ranks, some done before others"), "checking every byte a rank read")
        };
        out.push(format!(
            "--verify full with {why}: {work} ran while other transfers did, and the measured \
             spans include it (--verify sample measures the transfers with 1 block in 16 checked)"
        ));
    }
    out
}

/// `12.3 us`, `4.56 ms`, `1.23 s`.
pub fn time_text(ns: f64) -> String {
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

/// What `kvx calibrate` fitted, and with `--compare` how each term moved.
pub fn calibrate_text(
    path: PostPath,
    m: &TransferModel,
    fit: &BatchFit,
    changes: Option<&[TermChange]>,
    out: &str,
) -> String {
    let mut s = format!(
        "kvx calibrate: {} ({} memory), fitted over {}..{} B per descriptor, up to {} readers at once\n\
         fixed {} per request, {} per descriptor{}, {:.2} GB/s alone (ceiling {:.2} GB/s); worst miss of the fit {:.1}%\n",
        path.key(),
        path.memory(),
        m.fitted.min_descriptor_bytes,
        m.fitted.max_descriptor_bytes,
        m.fitted.max_readers,
        time_text(m.fixed_ns),
        time_text(m.ns_per_descriptor),
        if m.ns_per_call > 0.0 { format!(" + {} per call", time_text(m.ns_per_call)) } else { String::new() },
        m.gbps,
        m.ceiling_gbps,
        100.0 * fit.max_rel_error,
    );
    for r in m.concurrency.iter().filter(|r| r.readers > 1) {
        s.push_str(&format!(
            "{} readers at once: {} per descriptor, {:.2} GB/s each\n",
            r.readers,
            time_text(r.ns_per_descriptor),
            r.gbps
        ));
    }
    if let Some(changes) = changes {
        let unstable: Vec<&str> = changes.iter().filter(|c| c.unstable).map(|c| c.term.as_str()).collect();
        s.push_str("compared with the earlier fit:\n");
        for c in changes {
            s.push_str(&format!(
                "  {:<40} {:>12.3} -> {:>12.3}  {:+.1}%{}\n",
                c.term,
                c.before,
                c.after,
                c.change_pct,
                if c.unstable { "  UNSTABLE" } else { "" }
            ));
        }
        if unstable.is_empty() {
            s.push_str("every term within 10% of the earlier fit\n");
        } else {
            s.push_str(&format!("unstable on this host (moved 10% or more): {}\n", unstable.join(", ")));
        }
    }
    s.push_str(&format!("rates: {out}\n"));
    s
}

/// `kvx plan --rates`'s prediction section: per path with a fitted model, each posting
/// rank's predicted transfer and the request's span, with the term that bounds it.
pub fn plan_text(predictions: &[(PostPath, RequestPrediction)], posting: &str) -> String {
    let mut s = String::new();
    for (path, p) in predictions {
        s.push_str(&format!(
            "\npredicted transfer ({}, {} memory; {} {posting} ranks at once): span {}, bound by {}\n",
            path.key(),
            path.memory(),
            p.readers,
            time_text(p.span_ns),
            p.bound.as_str()
        ));
        for r in &p.ranks {
            s.push_str(&format!(
                "  {posting} rank {}: {} = fixed {} + posting {} ({} descriptors) + bytes {} ({}) -> {}\n",
                r.rank,
                time_text(r.total_ns),
                time_text(r.fixed_ns),
                time_text(r.post_ns),
                r.descriptors,
                time_text(r.bytes_ns),
                super::numbers::bytes_text(r.bytes),
                r.bound.as_str()
            ));
        }
        if !p.extrapolated.is_empty() {
            s.push_str(&format!("  EXTRAPOLATED: {}\n", p.extrapolated.join("; ")));
        }
    }
    s
}

/// The simulators `kvx plan --export` writes a profile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simulator {
    /// llm-d's inference simulator (`llm-d-inference-sim`): its YAML config keys
    /// `kv-cache-transfer-latency` (constant) and `kv-cache-transfer-time-per-token`.
    LlmdSim,
    /// Dynamo's mocker (`python -m dynamo.mocker`): `--kv-transfer-bandwidth` (GB/s) and
    /// `--kv-bytes-per-token`.
    DynamoMocker,
}

/// What a profile is made of: the prediction of one request of `tokens` prompt tokens.
#[derive(Debug, Clone)]
pub struct ProfileInput<'a> {
    pub model_name: &'a str,
    pub pair: String,
    pub tokens: u64,
    pub path: PostPath,
    pub prediction: &'a RequestPrediction,
    pub model: &'a TransferModel,
    /// The rates file's provenance, one line each.
    pub provenance: Vec<String>,
}

/// A Go duration string in microseconds, to the nanosecond (`13.607us`).
fn go_duration(ns: f64) -> String {
    format!("{:.3}us", ns.max(0.0) / 1e3)
}

/// The profile in the simulator's own terms, provenance in comments.
pub fn export_profile(sim: Simulator, x: &ProfileInput<'_>) -> String {
    let p = x.prediction;
    let bytes: u64 = p.ranks.iter().map(|r| r.bytes).sum();
    let slowest = p.ranks.iter().max_by(|a, b| a.total_ns.total_cmp(&b.total_ns));
    let fixed_ns = slowest.map_or(0.0, |r| r.fixed_ns);
    let per_token_ns = if x.tokens > 0 { (p.span_ns - fixed_ns).max(0.0) / x.tokens as f64 } else { 0.0 };
    // Bytes over the request's span: what the transfer achieves, posting included.
    let effective_gbps = if p.span_ns > 0.0 { bytes as f64 / p.span_ns } else { 0.0 };
    let mut head = vec![
        format!("KV transfer profile written by kvx {} (kvx plan --export)", env!("CARGO_PKG_VERSION")),
        format!(
            "{} {}, {} prompt tokens, {} ({} memory): predicted span {} ({} per token after the fixed {}), bound by {}",
            x.model_name,
            x.pair,
            x.tokens,
            x.path.key(),
            x.path.memory(),
            time_text(p.span_ns),
            time_text(per_token_ns),
            time_text(fixed_ns),
            p.bound.as_str()
        ),
        format!(
            "{} moved per request ({} per token as planned), {:.2} GB/s effective over the span",
            super::numbers::bytes_text(bytes),
            bytes.checked_div(x.tokens).unwrap_or(0),
            effective_gbps
        ),
        format!(
            "model: fixed {} + {} per descriptor + bytes at {:.2} GB/s alone ({} ranks at once on one host)",
            time_text(x.model.fixed_ns),
            time_text(x.model.ns_per_descriptor),
            x.model.gbps,
            p.readers
        ),
    ];
    if !p.extrapolated.is_empty() {
        head.push(format!("EXTRAPOLATED beyond the fit: {}", p.extrapolated.join("; ")));
    }
    head.extend(x.provenance.iter().map(|l| format!("rates: {l}")));
    let comments: String = head.iter().map(|l| format!("# {l}\n")).collect();
    match sim {
        Simulator::LlmdSim => format!(
            "{comments}# llm-d-inference-sim config (YAML; --config FILE). The per-token calculator charges\n\
             # kv-cache-transfer-time-per-token x prompt tokens; the constant one kv-cache-transfer-latency.\n\
             kv-cache-transfer-latency: {}\n\
             kv-cache-transfer-time-per-token: {}\n",
            go_duration(p.span_ns),
            go_duration(per_token_ns),
        ),
        Simulator::DynamoMocker => format!(
            "{comments}# Dynamo mocker arguments (python -m dynamo.mocker ... $(grep -v '^#' FILE)).\n\
             # --kv-transfer-bandwidth is the effective rate over the predicted span, posting included;\n\
             # --kv-bytes-per-token the bytes the plan moves per prompt token.\n\
             --kv-transfer-bandwidth {:.3}\n\
             --kv-bytes-per-token {}\n",
            effective_gbps,
            bytes.checked_div(x.tokens).unwrap_or(0),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::predict::{FittedRange, ReadersRate};

    fn model() -> TransferModel {
        TransferModel {
            fixed_ns: 1_000.0,
            ns_per_descriptor: 500.0,
            ns_per_call: 0.0,
            gbps: 5.0,
            ceiling_gbps: 5.0,
            concurrency: vec![ReadersRate { readers: 2, ns_per_descriptor: 500.0, gbps: 2.5 }],
            fitted: FittedRange { min_descriptor_bytes: 4096, max_descriptor_bytes: 4 << 20, max_readers: 2 },
        }
    }

    #[test]
    fn profiles_carry_the_prediction_in_each_simulators_terms() {
        let m = model();
        let loads = [RankLoad { rank: 0, descriptors: 1000, calls: 1000, bytes: 1000 * 65536 }];
        let p = m.predict_request(&loads, 1);
        let x = ProfileInput {
            model_name: "m",
            pair: "P tp 1 -> D tp 1".into(),
            tokens: 1000,
            path: PostPath::Ucx,
            prediction: &p,
            model: &m,
            provenance: vec!["kvx calibrate on host, date".into()],
        };
        let llmd = export_profile(Simulator::LlmdSim, &x);
        // (500 us posting + 13107.2 us bytes) / 1000 tokens = 13.6 us per token.
        assert!(llmd.contains("kv-cache-transfer-time-per-token: 13.607us"), "{llmd}");
        assert!(llmd.contains("kv-cache-transfer-latency: 13608.200us"), "{llmd}");
        assert!(llmd.lines().filter(|l| !l.starts_with('#')).count() == 2, "{llmd}");
        let dynamo = export_profile(Simulator::DynamoMocker, &x);
        assert!(dynamo.contains("--kv-bytes-per-token 65536"), "{dynamo}");
        assert!(dynamo.contains("--kv-transfer-bandwidth 4.816"), "{dynamo}");
        assert!(dynamo.contains("# rates: kvx calibrate on host, date"));
    }

    #[test]
    fn full_checks_beside_other_transfers_are_named_and_sampled_ones_are_not() {
        use crate::report::scenario::Scenario;
        use crate::vocab::kinds::VerifyMode;
        let run = |verify, concurrency| {
            let scenario =
                Scenario { verify: Some(verify), concurrency: Some(concurrency), ..Scenario::default() };
            Summary::new("r", "t", scenario)
        };
        let two_at_once = shared_host(&run(VerifyMode::Full, 2), 1);
        assert_eq!(two_at_once.len(), 1, "{two_at_once:?}");
        assert!(two_at_once[0].starts_with("--verify full with 2 requests at once"), "{two_at_once:?}");
        let four_ranks = shared_host(&run(VerifyMode::Full, 1), 4);
        assert!(four_ranks[0].contains("4 decode ranks"), "{four_ranks:?}");
        assert!(
            shared_host(&run(VerifyMode::Full, 1), 1).is_empty(),
            "one request, one rank: nothing beside it"
        );
        assert!(shared_host(&run(VerifyMode::Sample, 2), 2).is_empty(), "sampled checks are not named");
    }

    #[test]
    fn a_start_skew_of_5_percent_of_the_span_or_more_is_named_with_its_cause() {
        use crate::report::scenario::Scenario;
        let run = |concurrency| {
            let scenario = Scenario { concurrency: Some(concurrency), ..Scenario::default() };
            Summary::new("r", "t", scenario)
        };
        let two = start_skew(&run(2), Some(30_000.0), 100_000.0);
        assert_eq!(two.len(), 1, "{two:?}");
        assert!(
            two[0].starts_with("start skew: a request's ranks started 30.00 ms apart (p50), 30% of its span")
        );
        assert!(two[0].contains("with 2 requests at once each decode rank serves them in turn"), "{two:?}");
        assert!(two[0].contains("start up to 1 transfer apart"), "{two:?}");
        let three = start_skew(&run(3), Some(30_000.0), 100_000.0);
        assert!(three[0].contains("start up to 2 transfers apart"), "{three:?}");
        let one = start_skew(&run(1), Some(10_000.0), 100_000.0);
        assert!(one[0].contains("a busy host"), "{one:?}");
        let mut together = run(2);
        together.scenario.extra.rank_start = Some(crate::config::worker::RankStart::Together);
        let together = start_skew(&together, Some(10_000.0), 100_000.0);
        assert!(together[0].contains("a busy host"), "ranks told together: no queue to blame, {together:?}");
        assert!(start_skew(&run(2), Some(4_000.0), 100_000.0).is_empty(), "under 5% of the span: not named");
        assert!(start_skew(&run(2), None, 1.0).is_empty(), "no skew measured");
    }

    #[test]
    fn several_requests_at_once_are_bounded_by_as_many_transfers() {
        assert_eq!(closed_loop(1, 100.0, 150.0), None, "one at a time: the point prediction only");
        assert_eq!(closed_loop(2, 0.0, 150.0), None, "nothing predicted: no bound");
        let two = closed_loop(2, 100.0, 150.0).expect("two at once");
        assert_eq!((two.concurrency, two.span_min_us, two.span_max_us), (2, 100.0, 200.0));
        assert!(two.measured_p50_at_most_max);
        assert!(!closed_loop(2, 100.0, 200.5).expect("two").measured_p50_at_most_max, "past 2 transfers");
        assert!(closed_loop(4, 100.0, 390.0).expect("four").measured_p50_at_most_max);
        assert!(closed_loop(2, 100.0, 80.0).expect("two").measured_p50_at_most_max, "faster than predicted");
    }
}
