//! Lock-free counters, gauges and fixed-bucket histograms, and the Prometheus text
//! exposition (format 0.0.4, the one vLLM's `prometheus_client` serves) used by the engine's
//! and the proxy's `/metrics` and by `kvx bench --serve --metrics-port`.
//!
//! Owns only in-memory recording and rendering; it never decides what is measured. Names may
//! contain `:` (vLLM's `vllm:` prefix), which the text format allows. The bucket bounds of the
//! `vllm:*` families are vLLM's own (`vllm/v1/metrics/loggers.py`, and the NIXL connector's
//! `NixlPromMetrics` for `vllm:nixl_*`), so dashboards built for vLLM read kvx unchanged.
//!
//! Hand-written rather than a crate because the exposition must match vLLM's (colon names,
//! classic text format rather than OpenMetrics, Go-style float formatting of values and `le`
//! labels) and the whole surface is a few dozen lines.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

/// Content type of the Prometheus text exposition format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bucket upper bounds (seconds) for kvx's own request-level latencies (proxy legs).
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

/// `vllm:time_to_first_token_seconds` (vLLM's `TIME_TO_FIRST_TOKEN_BUCKETS`).
pub const VLLM_TTFT_BUCKETS_S: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];

/// `vllm:inter_token_latency_seconds` and `vllm:request_time_per_output_token_seconds`
/// (vLLM's `INTER_TOKEN_LATENCY_BUCKETS`).
pub const VLLM_ITL_BUCKETS_S: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// `vllm:e2e_request_latency_seconds` and the other request phase histograms (vLLM's
/// `REQUEST_LATENCY_BUCKETS`).
pub const VLLM_REQUEST_LATENCY_BUCKETS_S: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

/// `vllm:nixl_post_time_seconds` (the NIXL connector's time buckets).
pub const NIXL_POST_TIME_BUCKETS_S: &[f64] =
    &[0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];

/// `vllm:nixl_xfer_time_seconds`: the same list without its first bound, as vLLM builds it.
pub const NIXL_XFER_TIME_BUCKETS_S: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0];

/// `vllm:nixl_bytes_transferred`: `2^(10+i)` for odd `i` in 1..25, 2 KiB to 8 GiB.
pub const NIXL_BYTES_BUCKETS: &[f64] = &[
    2048.0,
    8192.0,
    32768.0,
    131072.0,
    524288.0,
    2097152.0,
    8388608.0,
    33554432.0,
    134217728.0,
    536870912.0,
    2147483648.0,
    8589934592.0,
];

/// `vllm:nixl_num_descriptors`.
pub const NIXL_DESCRIPTORS_BUCKETS: &[f64] =
    &[10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0, 50000.0];

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

/// A histogram with fixed bucket bounds (seconds for latencies, plain units for bytes and
/// counts). Recording is a few relaxed atomic operations plus a short linear scan, cheap
/// enough for the proxy's hot path.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative count per bucket; the last slot is `+Inf`.
    counts: Box<[AtomicU64]>,
    /// Sum of observed values, as `f64` bits.
    sum_bits: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self { bounds, counts, sum_bits: AtomicU64::new(0f64.to_bits()) }
    }

    /// Latency histogram with [`LATENCY_BUCKETS_S`].
    pub fn latency() -> Self {
        Self::new(LATENCY_BUCKETS_S)
    }

    /// Records a duration, in seconds.
    pub fn observe(&self, d: Duration) {
        self.observe_value(d.as_secs_f64());
    }

    /// Records a value in the histogram's own unit (bytes, descriptors, seconds).
    pub fn observe_value(&self, v: f64) {
        let idx = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        self.counts[idx].fetch_add(1, Ordering::Relaxed);
        let _ = self.sum_bits.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            Some((f64::from_bits(bits) + v).to_bits())
        });
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = Vec::with_capacity(self.bounds.len());
        let mut acc = 0u64;
        for (i, &b) in self.bounds.iter().enumerate() {
            acc += self.counts[i].load(Ordering::Relaxed);
            cumulative.push((b, acc));
        }
        acc += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets: cumulative,
            count: acc,
            sum_s: f64::from_bits(self.sum_bits.load(Ordering::Relaxed)),
        }
    }
}

/// A point-in-time copy of a [`Histogram`]: cumulative counts per upper bound.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound, cumulative count)`, ascending; `+Inf` is `count`.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    /// Sum of the observed values (seconds for latency histograms).
    pub sum_s: f64,
}

impl HistogramSnapshot {
    /// An empty snapshot over `bounds` (a family a backend does not record still has them).
    pub fn empty(bounds: &[f64]) -> Self {
        Self { buckets: bounds.iter().map(|&b| (b, 0)).collect(), count: 0, sum_s: 0.0 }
    }
}

/// The metric type of a family, as the `# TYPE` line names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

#[derive(Debug)]
struct Family {
    name: String,
    kind: Kind,
    help: String,
    samples: String,
}

/// Builds one Prometheus text exposition. Samples are grouped by family whatever order they
/// are added in (several engines can render into one exposition), and each family gets its
/// `# HELP` and `# TYPE` lines once, before its first sample.
#[derive(Debug, Default)]
pub struct Exposition {
    families: Vec<Family>,
}

/// A label set written as `{k="v",...}`; values are escaped per the text format.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut String {
        let i = match self.families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.families.push(Family {
                    name: name.to_string(),
                    kind,
                    help: help.to_string(),
                    samples: String::new(),
                });
                self.families.len() - 1
            }
        };
        &mut self.families[i].samples
    }

    fn write_labels(out: &mut String, labels: Labels<'_>, extra: Option<(&str, &str)>) {
        if labels.is_empty() && extra.is_none() {
            return;
        }
        out.push('{');
        let mut first = true;
        for (k, v) in labels.iter().copied().chain(extra) {
            if !first {
                out.push(',');
            }
            first = false;
            out.push_str(k);
            out.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        out.push('}');
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: Labels<'_>, value: u64) {
        let out = self.family(name, Kind::Counter, help);
        out.push_str(name);
        Self::write_labels(out, labels, None);
        let _ = writeln!(out, " {}", go_float(value as f64));
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: Labels<'_>, value: f64) {
        let out = self.family(name, Kind::Gauge, help);
        out.push_str(name);
        Self::write_labels(out, labels, None);
        let _ = writeln!(out, " {}", go_float(value));
    }

    pub fn histogram(&mut self, name: &str, help: &str, labels: Labels<'_>, h: &HistogramSnapshot) {
        let out = self.family(name, Kind::Histogram, help);
        for &(le, c) in &h.buckets {
            out.push_str(name);
            out.push_str("_bucket");
            Self::write_labels(out, labels, Some(("le", &go_float(le))));
            let _ = writeln!(out, " {}", go_float(c as f64));
        }
        out.push_str(name);
        out.push_str("_bucket");
        Self::write_labels(out, labels, Some(("le", "+Inf")));
        let _ = writeln!(out, " {}", go_float(h.count as f64));
        out.push_str(name);
        out.push_str("_count");
        Self::write_labels(out, labels, None);
        let _ = writeln!(out, " {}", go_float(h.count as f64));
        out.push_str(name);
        out.push_str("_sum");
        Self::write_labels(out, labels, None);
        let _ = writeln!(out, " {}", go_float(h.sum_s));
    }

    pub fn finish(self) -> String {
        let mut out = String::new();
        for f in self.families {
            let help = f.help.replace('\\', "\\\\").replace('\n', "\\n");
            let _ = writeln!(out, "# HELP {} {help}", f.name);
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
            out.push_str(&f.samples);
        }
        out
    }
}

/// Formats a value the way `prometheus_client` does (`floatToGoString`): Python's `repr` of
/// the float, switching to an exponent once the integer part has more than six digits, as Go
/// does (`2048.0`, `0.005`, `2.097152e+06`, `+Inf`).
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf".into() } else { "-Inf".into() };
    }
    let s = py_repr(v);
    let Some(dot) = s.find('.') else { return s };
    if v > 0.0 && dot > 6 {
        let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
        let mantissa = format!("{}.{digits}", &s[..1]);
        let mantissa = mantissa.trim_end_matches(['0', '.']);
        return format!("{mantissa}e+0{}", dot - 1);
    }
    s
}

/// Python's `repr(float)` for finite values: shortest round-trip digits, `.0` on integers,
/// scientific notation from 1e16 and below 1e-4.
fn py_repr(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust's `{:e}` is shortest round-trip too: `1e16`, `1.5e-5`; Python writes `1e+16`.
        let s = format!("{v:e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        return format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    let s = format!("{v}");
    if s.contains('.') { s } else { format!("{s}.0") }
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
        let b = Histogram::new(NIXL_BYTES_BUCKETS);
        b.observe_value(8192.0);
        b.observe_value(9000.0);
        let s = b.snapshot();
        assert_eq!((s.buckets[1], s.buckets[2], s.count, s.sum_s), ((8192.0, 1), (32768.0, 2), 2, 17192.0));
    }

    #[test]
    fn exposition_groups_families_and_escapes_labels() {
        let mut e = Exposition::new();
        e.counter("vllm:x_total", "X.", &[("model_name", "a\"b")], 1);
        let h = Histogram::new(&[0.5]);
        h.observe(Duration::from_millis(100));
        e.histogram("kvx:h_seconds", "H.", &[], &h.snapshot());
        // A second engine's sample of the first family, added later, joins its family.
        e.counter("vllm:x_total", "X.", &[("model_name", "c")], 2);
        let text = e.finish();
        assert_eq!(text.matches("# TYPE vllm:x_total counter").count(), 1);
        assert!(
            text.starts_with(
                "# HELP vllm:x_total X.\n# TYPE vllm:x_total counter\nvllm:x_total{model_name=\"a\\\"b\"} 1.0\nvllm:x_total{model_name=\"c\"} 2.0\n"
            ),
            "{text}"
        );
        assert!(text.contains("kvx:h_seconds_bucket{le=\"0.5\"} 1.0\n"));
        assert!(text.contains("kvx:h_seconds_bucket{le=\"+Inf\"} 1.0\n"));
        assert!(text.contains("kvx:h_seconds_count 1.0\n"));
        assert!(text.contains("kvx:h_seconds_sum 0.1\n"));
    }

    #[test]
    fn floats_format_like_prometheus_client() {
        for (v, want) in [
            (0.0, "0.0"),
            (1.0, "1.0"),
            (0.005, "0.005"),
            (2048.0, "2048.0"),
            (131072.0, "131072.0"),
            (2097152.0, "2.097152e+06"),
            (8589934592.0, "8.589934592e+09"),
            (10000000.0, "1e+07"),
            (1e16, "1e+16"),
            (0.00001, "1e-05"),
            (2.5, "2.5"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(go_float(v), want, "{v}");
        }
    }
}
