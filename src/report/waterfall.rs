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
//! Owns the builder of the aggregate [`Waterfall`] a summary carries (whose types, with the
//! stages, are in `summary`), and its table; the
//! per-request split from `Server-Timing` entries is `serve::timing::breakdown`. Pure: no
//! I/O, no clock.

use std::time::Duration;

use hdrhistogram::Histogram;

use super::recorder::{new_auto_histogram, record_into, stage_stats};
// The data a summary carries lives with the summary's other types (the summary must not import
// the builder, which imports the recorder, which imports the summary).
pub use super::summary::{N, STAGES, Waterfall, WaterfallBar, WaterfallStage};

/// One request's TTFT split into [`STAGES`], nanoseconds.
pub type Breakdown = [u64; N];

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::table::{Style, waterfall_note, waterfall_table};

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
