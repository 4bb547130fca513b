//! The TTFT waterfall: a client's time to first token split into the stages of the P/D
//! serving path, from the client's own timestamps and the `Server-Timing` entries the
//! engines and the proxy returned with that request (`serve::timing`).
//!
//! The stages tile the interval from sending the request to reading its first token:
//!
//! ```text
//! client send ───────────────────────────── headers ──── first token
//! | proxy (HTTP hops + proxy work) | P queue | P compute | D admission | handshake |
//!   KV transfer | notification | verify | first decode step | other |
//! ```
//!
//! `proxy` is the time to the response headers less the engines' own totals (every HTTP hop
//! between client, proxy and engines, and the proxy's work); the engine stages are what the
//! engines measured; `first_decode_step` is the client's time from the headers to the first
//! token (the decode step that makes it, and its way through the proxy); `other` is the
//! engines' time outside their named stages (parsing, building responses, task wake-ups).
//! So for every request the stages add up to its TTFT exactly, and `other` says how much the
//! named stages leave unexplained.
//!
//! Owns the stages, the aggregate [`Waterfall`] a summary carries, and its table; the
//! per-request split from `Server-Timing` entries is `serve::timing::breakdown`. Pure: no
//! I/O, no clock.

use std::time::Duration;

use comfy_table::Table;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::recorder::{new_auto_histogram, record_into, stage_stats};
use super::summary::StageStats;
use super::table::{Style, align_numbers, fmt_f, new_table};

/// The stages, in order, with what each covers.
pub const STAGES: [(&str, &str); 10] = [
    ("proxy", "HTTP hops client <-> proxy <-> engines and the proxy's own work"),
    ("prefill_queue", "prefill engine: waiting for admission"),
    ("prefill_compute", "prefill engine: prefill and KV blocks filled and held"),
    ("decode_admission", "decode engine: waiting for admission"),
    ("handshake", "decode engine: side-channel handshake (first contact only)"),
    ("kv_transfer", "decode engine: KV reads (queue, plan, post, read)"),
    ("notification", "decode engine: notifying the prefill engine"),
    ("verify", "decode engine: checking the bytes read"),
    ("first_decode_step", "decode step of the first token and its way to the client"),
    ("other", "engine time outside the named stages"),
];

/// Number of stages.
pub const N: usize = STAGES.len();

/// One request's TTFT split into [`STAGES`], nanoseconds.
pub type Breakdown = [u64; N];

/// One stacked bar of the chart: a request's (or the mean) stages.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WaterfallBar {
    /// `mean`, `p50 request`, `p90 request`, `p99 request`.
    pub label: String,
    pub ttft_us: f64,
    /// Per stage, in [`STAGES`] order.
    pub stages_us: Vec<f64>,
}

/// Percentiles of one stage over the requests (zeros included: a stage a request did not go
/// through took it no time).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WaterfallStage {
    pub name: String,
    #[serde(flatten)]
    pub stats: StageStats,
}

/// The waterfall of a run's measured streaming requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Waterfall {
    /// Requests with a breakdown.
    pub requests: u64,
    /// Client-side TTFT of those requests.
    pub ttft: StageStats,
    pub stages: Vec<WaterfallStage>,
    /// The mean request, then the requests at the TTFT percentiles: each bar adds up to its TTFT.
    pub bars: Vec<WaterfallBar>,
    /// Sum of the stages' p50s, and its distance from the TTFT p50 as a fraction of it (p50s
    /// of parts need not add up to the p50 of the whole; a small distance means the table's
    /// p50 column reads as a waterfall too).
    pub stage_p50_sum_us: f64,
    pub stage_p50_sum_error: f64,
    /// The p50 request's `other` stage as a fraction of its TTFT: what the named stages leave
    /// unexplained.
    pub unattributed_share_p50: f64,
}

/// Collects breakdowns, then builds the [`Waterfall`].
#[derive(Debug, Default)]
pub struct WaterfallBuilder {
    rows: Vec<(u64, Breakdown)>,
}

impl WaterfallBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add(&mut self, ttft: Duration, b: Breakdown) {
        self.rows.push((u64::try_from(ttft.as_nanos()).unwrap_or(u64::MAX), b));
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The waterfall, or `None` with no request.
    pub fn finish(mut self) -> Option<Waterfall> {
        if self.rows.is_empty() {
            return None;
        }
        let us = |v: u64| v as f64 / 1e3;
        let mut ttft_h: Histogram<u64> = new_auto_histogram();
        let mut hs: Vec<Histogram<u64>> = (0..N).map(|_| new_auto_histogram()).collect();
        for (t, b) in &self.rows {
            record_into(&mut ttft_h, *t);
            for (h, v) in hs.iter_mut().zip(b) {
                record_into(h, *v);
            }
        }
        let stages: Vec<WaterfallStage> = STAGES
            .iter()
            .zip(&hs)
            .map(|((name, _), h)| WaterfallStage { name: (*name).to_string(), stats: stage_stats(h) })
            .collect();
        let n = self.rows.len() as f64;
        let mut bars = vec![WaterfallBar {
            label: "mean".into(),
            ttft_us: self.rows.iter().map(|(t, _)| us(*t)).sum::<f64>() / n,
            stages_us: (0..N).map(|i| self.rows.iter().map(|(_, b)| us(b[i])).sum::<f64>() / n).collect(),
        }];
        self.rows.sort_by_key(|(t, _)| *t);
        for (label, q) in [("p50 request", 0.50), ("p90 request", 0.90), ("p99 request", 0.99)] {
            // Nearest rank: the request whose TTFT is the q-quantile.
            let idx = ((q * n).ceil() as usize).clamp(1, self.rows.len()) - 1;
            let (t, b) = &self.rows[idx];
            bars.push(WaterfallBar {
                label: label.into(),
                ttft_us: us(*t),
                stages_us: b.iter().map(|v| us(*v)).collect(),
            });
        }
        let ttft = stage_stats(&ttft_h);
        let sum_p50: f64 = stages.iter().map(|s| s.stats.p50_us).sum();
        let p50_bar = &bars[1];
        Some(Waterfall {
            requests: self.rows.len() as u64,
            ttft,
            stages,
            stage_p50_sum_us: sum_p50,
            stage_p50_sum_error: if ttft.p50_us > 0.0 { (sum_p50 - ttft.p50_us) / ttft.p50_us } else { 0.0 },
            unattributed_share_p50: if p50_bar.ttft_us > 0.0 {
                p50_bar.stages_us[N - 1] / p50_bar.ttft_us
            } else {
                0.0
            },
            bars,
        })
    }
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
    fn the_waterfall_adds_up_per_bar() {
        let mut w = WaterfallBuilder::new();
        for i in 1..=100u64 {
            let mut b: Breakdown = [0; N];
            b[0] = 1000 * i;
            b[5] = 2000;
            b[8] = 10_000;
            let ttft = b.iter().sum::<u64>();
            w.add(Duration::from_nanos(ttft), b);
        }
        let w = w.finish().expect("rows");
        assert_eq!(w.requests, 100);
        assert_eq!(w.bars.len(), 4);
        for bar in &w.bars {
            let sum: f64 = bar.stages_us.iter().sum();
            assert!((sum - bar.ttft_us).abs() < 1e-6, "{bar:?}");
        }
        assert_eq!(w.bars[1].ttft_us, 62.0, "nearest rank: the 50th request");
        assert_eq!(w.stages[5].stats.p50_us, 2.0);
        assert!(w.stage_p50_sum_error.abs() < 0.01, "{}", w.stage_p50_sum_error);
        let text = waterfall_table(&w, Style::Terminal).to_string();
        assert!(text.contains("first_decode_step") && text.contains("ttft (client)"), "{text}");
        assert!(waterfall_note(&w).contains("sum of stage p50s"));
        assert!(WaterfallBuilder::new().finish().is_none());
    }
}
