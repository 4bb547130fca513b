//! Lock-free counters, gauges and fixed-bucket histograms, and the Prometheus text
//! exposition (format 0.0.4, the one vLLM's `prometheus_client` serves) used by the engine's
//! and the proxy's `/metrics`.
//!
//! Owns only in-memory recording and rendering; it never decides what is measured. Names may
//! contain `:` (vLLM's `vllm:` prefix), which the text format allows.
//!
//! Hand-written rather than a crate because the exposition must match vLLM's (colon names,
//! classic text format rather than OpenMetrics) and the whole surface is a few dozen lines.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

/// Content type of the Prometheus text exposition format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bucket upper bounds (seconds) for request-level latencies (TTFT, end to end, proxy legs).
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// Bucket upper bounds (seconds) for KV stages, which run from microseconds (plan) to
/// seconds (a large read on a loaded machine).
pub const KV_STAGE_BUCKETS_S: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (in-flight requests, held blocks).
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn dec(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A histogram with fixed bucket bounds in seconds. Recording is two relaxed atomic adds
/// plus a short linear scan, cheap enough for the proxy's hot path.
#[derive(Debug)]
pub struct Histogram {
    bounds_s: &'static [f64],
    /// Non-cumulative count per bucket; the last slot is `+Inf`.
    counts: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn new(bounds_s: &'static [f64]) -> Self {
        let counts = (0..=bounds_s.len()).map(|_| AtomicU64::new(0)).collect();
        Self { bounds_s, counts, sum_ns: AtomicU64::new(0) }
    }

    /// Latency histogram with [`LATENCY_BUCKETS_S`].
    pub fn latency() -> Self {
        Self::new(LATENCY_BUCKETS_S)
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let idx = self.bounds_s.iter().position(|&b| s <= b).unwrap_or(self.bounds_s.len());
        self.counts[idx].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = Vec::with_capacity(self.bounds_s.len());
        let mut acc = 0u64;
        for (i, &b) in self.bounds_s.iter().enumerate() {
            acc += self.counts[i].load(Ordering::Relaxed);
            cumulative.push((b, acc));
        }
        acc += self.counts[self.bounds_s.len()].load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets: cumulative,
            count: acc,
            sum_s: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// A point-in-time copy of a [`Histogram`]: cumulative counts per upper bound.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound in seconds, cumulative count)`, ascending; `+Inf` is `count`.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_s: f64,
}

/// Builds one Prometheus text exposition. Each metric family gets its `# HELP` and `# TYPE`
/// lines once, before its first sample.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
    last_family: String,
}

/// A label set written as `{k="v",...}`; values are escaped per the text format.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        if self.last_family != name {
            let _ = writeln!(self.out, "# HELP {name} {help}");
            let _ = writeln!(self.out, "# TYPE {name} {kind}");
            self.last_family = name.to_string();
        }
    }

    fn labels(&mut self, labels: Labels<'_>, extra: Option<(&str, &str)>) {
        if labels.is_empty() && extra.is_none() {
            return;
        }
        self.out.push('{');
        let mut first = true;
        for (k, v) in labels.iter().copied().chain(extra) {
            if !first {
                self.out.push(',');
            }
            first = false;
            self.out.push_str(k);
            self.out.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => self.out.push_str("\\\\"),
                    '"' => self.out.push_str("\\\""),
                    '\n' => self.out.push_str("\\n"),
                    c => self.out.push(c),
                }
            }
            self.out.push('"');
        }
        self.out.push('}');
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: Labels<'_>, value: u64) {
        self.header(name, "counter", help);
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {value}");
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: Labels<'_>, value: f64) {
        self.header(name, "gauge", help);
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", fmt_f64(value));
    }

    pub fn histogram(&mut self, name: &str, help: &str, labels: Labels<'_>, h: &HistogramSnapshot) {
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        for &(le, c) in &h.buckets {
            self.out.push_str(&bucket);
            self.labels(labels, Some(("le", &fmt_f64(le))));
            let _ = writeln!(self.out, " {c}");
        }
        self.out.push_str(&bucket);
        self.labels(labels, Some(("le", "+Inf")));
        let _ = writeln!(self.out, " {}", h.count);
        self.out.push_str(name);
        self.out.push_str("_sum");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", fmt_f64(h.sum_s));
        self.out.push_str(name);
        self.out.push_str("_count");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", h.count);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// Formats like Python's `repr(float)` for the values we emit: integers keep a `.0`.
fn fmt_f64(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 { format!("{v:.1}") } else { format!("{v}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_sums() {
        let h = Histogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        let s = h.snapshot();
        assert_eq!(s.buckets, vec![(0.001, 1), (0.01, 2)]);
        assert_eq!(s.count, 3);
        assert!((s.sum_s - 1.0055).abs() < 1e-9);
    }

    #[test]
    fn exposition_has_one_header_per_family_and_escapes_labels() {
        let mut e = Exposition::new();
        e.counter("vllm:x_total", "X.", &[("model_name", "a\"b")], 1);
        e.counter("vllm:x_total", "X.", &[("model_name", "c")], 2);
        let h = Histogram::new(&[0.5]);
        h.observe(Duration::from_millis(100));
        e.histogram("kvx:h_seconds", "H.", &[], &h.snapshot());
        let text = e.finish();
        assert_eq!(text.matches("# TYPE vllm:x_total counter").count(), 1);
        assert!(text.contains("vllm:x_total{model_name=\"a\\\"b\"} 1\n"));
        assert!(text.contains("kvx:h_seconds_bucket{le=\"0.5\"} 1\n"));
        assert!(text.contains("kvx:h_seconds_bucket{le=\"+Inf\"} 1\n"));
        assert!(text.contains("kvx:h_seconds_count 1\n"));
    }
}
