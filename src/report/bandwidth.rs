//! Transfer bandwidth per request, by the wall-span rule, next to each rank's own figure.
//!
//! A request read (or written) by several ranks moved the bytes of all of them; its bandwidth
//! is those bytes over its wall span, the first rank's start to the last rank's end on one
//! clock ([`crate::clock`]). Dividing the summed bytes by the slowest rank's own time instead
//! overstates it whenever the ranks do not run at the same moment (up to N times for N ranks
//! one after the other), so nothing here does. Each rank's own bandwidth (its bytes over its
//! own time) is kept beside it: that is what one rank's link moved.
//!
//! Pure: callers measure and hand the figures over.

use serde::{Deserialize, Serialize};

use crate::clock::{ClockSpan, wall_span_ns};

/// One rank's part of one request's transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankTransfer {
    /// The rank that moved it (decode rank in pull mode, prefill rank in push mode).
    pub rank: u32,
    pub bytes: u64,
    /// The rank's own transfer time, and the part of it spent posting.
    pub transfer_ns: u64,
    pub post_ns: u64,
    /// When it ran, if the rank stamped it.
    pub span: Option<ClockSpan>,
}

/// A distribution of per-request (or per-rank) figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub count: u64,
    pub mean: f64,
    pub min: f64,
    pub p10: f64,
    pub p50: f64,
    pub p90: f64,
    pub max: f64,
}

impl Spread {
    /// Nearest-rank percentiles of `values` (any order); `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Spread {
            count: v.len() as u64,
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            p10: at(0.10),
            p50: at(0.50),
            p90: at(0.90),
            max: v[v.len() - 1],
        })
    }
}

/// What a run's transfers moved per request, as `summary.json`'s `transfer_bandwidth`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferBandwidth {
    /// How the requests' spans were timed, or why they were not.
    pub clock: String,
    /// Per request: the bytes of all its ranks over its wall span (GB/s, 1e9 B/s). Absent when
    /// no request had its ranks on one clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_gbps: Option<Spread>,
    /// Per rank and request: the rank's bytes over its own transfer time (GB/s).
    pub rank_gbps: Spread,
    /// Per rank over the whole run: all its bytes over the time it spent transferring, its
    /// requests' spans merged (requests in flight together count once, where `rank_gbps`
    /// gives each request the whole of their shared time). Absent when no rank stamped its
    /// spans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_busy_gbps: Option<Spread>,
    /// Per rank and request: the rank's own transfer time (us), and its posting part.
    pub rank_transfer_us: Spread,
    #[serde(default)]
    pub rank_post_us: Spread,
    /// Per request of several ranks on one clock: the last rank's transfer start minus the
    /// first's (us). A request's wall span is this wait plus its slowest rank's transfer, at
    /// most. Absent when no such request was timed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_skew_us: Option<Spread>,
    /// Bytes of all ranks' transfers (the sum behind `rank_*`).
    pub rank_bytes: u64,
    /// Requests whose ranks were on several clocks (or unstamped): in `rank_*` only.
    #[serde(default)]
    pub requests_without_span: u64,
}

/// Accumulates successful requests' transfers; [`BandwidthTally::summary`] gives the figures.
#[derive(Debug, Clone, Default)]
pub struct BandwidthTally {
    span_gbps: Vec<f64>,
    rank_gbps: Vec<f64>,
    rank_us: Vec<f64>,
    rank_post_us: Vec<f64>,
    start_skew_us: Vec<f64>,
    rank_bytes: u64,
    without_span: u64,
    /// Per rank: its bytes and its transfers' spans (one rank's spans share its clock).
    busy: std::collections::BTreeMap<u32, (u64, Vec<(u64, u64)>)>,
}

/// Nanoseconds covered by `spans` (any order), overlaps counted once.
fn covered_ns(spans: &mut [(u64, u64)]) -> u64 {
    spans.sort_unstable();
    let mut total = 0;
    let mut open: Option<(u64, u64)> = None;
    for &(start, end) in spans.iter() {
        match &mut open {
            Some((_, e)) if start <= *e => *e = (*e).max(end),
            _ => {
                if let Some((s, e)) = open {
                    total += e - s;
                }
                open = Some((start, end.max(start)));
            }
        }
    }
    total + open.map_or(0, |(s, e)| e - s)
}

/// GB/s of `bytes` over `ns` (0 for no time).
fn gbps(bytes: u64, ns: u64) -> f64 {
    if ns == 0 { 0.0 } else { bytes as f64 / ns as f64 }
}

impl BandwidthTally {
    /// Adds one request's ranks; returns its wall span in nanoseconds, if it has one.
    pub fn add(&mut self, ranks: &[RankTransfer]) -> Option<u64> {
        for r in ranks.iter().filter(|r| r.transfer_ns > 0) {
            self.rank_gbps.push(gbps(r.bytes, r.transfer_ns));
            self.rank_us.push(r.transfer_ns as f64 / 1e3);
            self.rank_post_us.push(r.post_ns as f64 / 1e3);
            self.rank_bytes += r.bytes;
            if let Some(span) = r.span {
                let (bytes, spans) = self.busy.entry(r.rank).or_default();
                *bytes += r.bytes;
                spans.push((span.start_ns, span.end_ns));
            }
        }
        let span = wall_span_ns(ranks.iter().map(|r| r.span)).filter(|&ns| ns > 0);
        match span {
            Some(ns) => {
                self.span_gbps.push(gbps(ranks.iter().map(|r| r.bytes).sum(), ns));
                // One clock (the span says so): the starts compare.
                let starts = ranks.iter().filter_map(|r| r.span.map(|s| s.start_ns));
                if ranks.len() > 1
                    && let (Some(first), Some(last)) = (starts.clone().min(), starts.max())
                {
                    self.start_skew_us.push((last - first) as f64 / 1e3);
                }
            }
            None if !ranks.is_empty() => self.without_span += 1,
            None => {}
        }
        span
    }

    /// The run's figures; `None` when no request moved anything.
    pub fn summary(&self) -> Option<TransferBandwidth> {
        let rank_gbps = Spread::of(&self.rank_gbps)?;
        let span_gbps = Spread::of(&self.span_gbps);
        let clock = match (span_gbps.is_some(), self.without_span) {
            (true, 0) => "wall span on one host's CLOCK_MONOTONIC".to_string(),
            (true, n) => format!("wall span on one host's CLOCK_MONOTONIC; {n} requests on several clocks"),
            (false, _) => "ranks on several clocks: per-rank figures only".to_string(),
        };
        let busy: Vec<f64> = self
            .busy
            .values()
            .map(|(bytes, spans)| gbps(*bytes, covered_ns(&mut spans.clone())))
            .filter(|g| *g > 0.0)
            .collect();
        Some(TransferBandwidth {
            clock,
            span_gbps,
            rank_gbps,
            rank_busy_gbps: Spread::of(&busy),
            rank_transfer_us: Spread::of(&self.rank_us).unwrap_or_default(),
            rank_post_us: Spread::of(&self.rank_post_us).unwrap_or_default(),
            start_skew_us: Spread::of(&self.start_skew_us),
            rank_bytes: self.rank_bytes,
            requests_without_span: self.without_span,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(bytes: u64, start_ns: u64, end_ns: u64) -> RankTransfer {
        RankTransfer {
            rank: 0,
            bytes,
            transfer_ns: end_ns - start_ns,
            post_ns: 0,
            span: Some(ClockSpan { domain: 5, start_ns, end_ns }),
        }
    }

    #[test]
    fn two_ranks_one_after_the_other_halve_the_request_bandwidth() {
        // Each rank moves 1 GB in 1 s. Together at once: 2 GB/s. One after the other: the
        // request took 2 s, so 1 GB/s, although each rank alone still moved 1 GB/s.
        let mut at_once = BandwidthTally::default();
        at_once.add(&[rank(1_000_000_000, 0, 1_000_000_000), rank(1_000_000_000, 0, 1_000_000_000)]);
        let mut staggered = BandwidthTally::default();
        let span = staggered
            .add(&[rank(1_000_000_000, 0, 1_000_000_000), rank(1_000_000_000, 1_000_000_000, 2_000_000_000)]);
        assert_eq!(span, Some(2_000_000_000));
        let (a, s) = (at_once.summary().expect("figures"), staggered.summary().expect("figures"));
        assert_eq!(a.span_gbps.map(|x| x.p50), Some(2.0));
        assert_eq!(s.span_gbps.map(|x| x.p50), Some(1.0), "bandwidth halves when the ranks take turns");
        assert_eq!((a.rank_gbps.p50, s.rank_gbps.p50), (1.0, 1.0));
        assert_eq!(s.rank_transfer_us.p50, 1e6);
        assert_eq!(s.rank_bytes, 2_000_000_000);
        // The second rank started 1 s after the first: the span is that wait plus one transfer.
        assert_eq!(a.start_skew_us.map(|x| x.p50), Some(0.0));
        assert_eq!(s.start_skew_us.map(|x| x.p50), Some(1e6));
    }

    #[test]
    fn a_request_of_one_rank_has_no_start_skew() {
        let mut one = BandwidthTally::default();
        one.add(&[rank(1_000, 0, 1_000)]);
        assert_eq!(one.summary().expect("figures").start_skew_us, None);
    }

    #[test]
    fn a_rank_with_requests_in_flight_together_counts_their_shared_time_once() {
        // Rank 0 reads two requests of 1 GB at once over the same second, then one more alone:
        // each request's own figure is 1 GB/s, the rank moved 3 GB in 2 s. Rank 1 reads one
        // request of 1 GB in 0.5 s.
        let on =
            |r: u32, bytes: u64, start: u64, end: u64| RankTransfer { rank: r, ..rank(bytes, start, end) };
        let s = 1_000_000_000;
        let mut t = BandwidthTally::default();
        t.add(&[on(0, s, 0, s), on(1, s, 0, s / 2)]);
        t.add(&[on(0, s, 0, s)]);
        t.add(&[on(0, s, s, 2 * s)]);
        let b = t.summary().expect("figures");
        let busy = b.rank_busy_gbps.expect("spans stamped");
        assert_eq!((busy.count, busy.min, busy.max), (2, 1.5, 2.0));
        assert_eq!(b.rank_gbps.p50, 1.0, "per request, each had the rank for the whole second");
        assert_eq!(covered_ns(&mut [(5, 9), (0, 2), (1, 3), (9, 10)]), 8);
    }

    #[test]
    fn ranks_on_several_clocks_give_per_rank_figures_only() {
        let mut t = BandwidthTally::default();
        let mut other = rank(100, 0, 100);
        other.span = Some(ClockSpan { domain: 9, start_ns: 0, end_ns: 100 });
        assert_eq!(t.add(&[rank(100, 0, 100), other]), None);
        let s = t.summary().expect("figures");
        assert_eq!(s.span_gbps, None);
        assert_eq!(s.requests_without_span, 1);
        assert_eq!(s.rank_gbps.count, 2);
        assert!(s.clock.contains("per-rank figures only"), "{}", s.clock);
    }

    #[test]
    fn spreads_use_nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = Spread::of(&v).expect("values");
        assert_eq!((s.count, s.min, s.p10, s.p50, s.p90, s.max, s.mean), (10, 1.0, 1.0, 5.0, 9.0, 10.0, 5.5));
        assert_eq!(Spread::of(&[]), None);
        assert_eq!(BandwidthTally::default().summary(), None);
    }
}
