//! Per-request stage timings carried in the standard `Server-Timing` response header
//! (`name;dur=<milliseconds>`, comma-separated): how the engines and the proxy tell the client
//! where a request's time went, so `kvx load` can join them to its own TTFT without a side
//! channel. The header belongs to the response of the one request it describes (the proxy
//! sends both legs the same `X-Request-Id` and passes both engines' entries on with its own),
//! so the join is by request, across processes, with no clock shared between them: every
//! entry is a duration measured on one host's monotonic clock.
//!
//! Owns the entry names, the header's formatting and parsing. Clients that do not know the
//! header ignore it (it is in the Fetch standard; browsers show it in their dev tools).

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use crate::report::waterfall::{Breakdown, N};

/// The header name.
pub const SERVER_TIMING: &str = "server-timing";

/// Prefill engine (P/D handoff): waiting for admission (`--max-num-seqs`).
pub const PREFILL_QUEUE: &str = "prefill_queue";
/// Prefill engine: the prefill itself (simulated compute, filling and holding the KV blocks).
pub const PREFILL_COMPUTE: &str = "prefill_compute";
/// Prefill engine: from the request's arrival to its response.
pub const PREFILL_TOTAL: &str = "prefill_total";
/// Decode engine: waiting for admission.
pub const DECODE_ADMISSION: &str = "decode_admission";
/// Decode engine: side-channel handshake with the prefill engine (first contact only).
pub const KV_HANDSHAKE: &str = "kv_handshake";
/// Decode engine: reading the KV blocks (queue, plan, post and the reads themselves).
pub const KV_TRANSFER: &str = "kv_transfer";
/// Decode engine: notifying the prefill engine that its blocks can go.
pub const KV_NOTIFY: &str = "kv_notify";
/// Decode engine: checking what was read against what the prefill engine wrote.
pub const KV_VERIFY: &str = "kv_verify";
/// Decode engine: from the request's arrival to its response headers.
pub const DECODE_TOTAL: &str = "decode_total";
/// Any engine generating tokens: its inter-token latency setting (0: pacing off).
pub const ITL: &str = "itl";
/// An engine serving a request on its own (no P/D): admission, prefill, arrival to headers.
pub const LOCAL_QUEUE: &str = "local_queue";
pub const LOCAL_PREFILL: &str = "local_prefill";
pub const LOCAL_TOTAL: &str = "local_total";
/// The proxy: from the client's request to the decode engine's response headers.
pub const PROXY_TOTAL: &str = "proxy_total";

/// Entries of one `Server-Timing` header, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerTiming {
    entries: Vec<(String, f64)>,
}

impl ServerTiming {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name;dur=<ms>`.
    pub fn push(&mut self, name: &str, d: Duration) -> &mut Self {
        self.entries.push((name.to_string(), d.as_secs_f64() * 1e3));
        self
    }

    /// Adds every entry of a header another server sent (the proxy passing the engines' on).
    pub fn extend_from(&mut self, headers: &HeaderMap) {
        for v in headers.get_all(SERVER_TIMING) {
            if let Ok(s) = v.to_str() {
                self.entries.extend(parse(s));
            }
        }
    }

    pub fn entries(&self) -> &[(String, f64)] {
        &self.entries
    }

    /// The header value (microsecond resolution), or `None` with no entries.
    pub fn header(&self) -> Option<HeaderValue> {
        if self.entries.is_empty() {
            return None;
        }
        let s: Vec<String> = self.entries.iter().map(|(n, ms)| format!("{n};dur={ms:.3}")).collect();
        HeaderValue::from_str(&s.join(", ")).ok()
    }
}

/// Parses a `Server-Timing` value: `name;dur=1.5;desc="x", other;dur=2`. Entries without a
/// duration, or with one that is not a number, are skipped.
pub fn parse(value: &str) -> Vec<(String, f64)> {
    value
        .split(',')
        .filter_map(|entry| {
            let mut parts = entry.split(';').map(str::trim);
            let name = parts.next().filter(|n| !n.is_empty())?;
            let dur = parts.find_map(|p| p.strip_prefix("dur="))?;
            let ms: f64 = dur.trim_matches('"').parse().ok()?;
            ms.is_finite().then(|| (name.to_string(), ms))
        })
        .collect()
}

/// All entries of every `Server-Timing` header in `headers`.
pub fn from_headers(headers: &HeaderMap) -> Vec<(String, f64)> {
    let mut st = ServerTiming::new();
    st.extend_from(headers);
    st.entries
}

fn ns(ms: f64) -> u64 {
    (ms.max(0.0) * 1e6).round() as u64
}

/// Splits one request's TTFT into [`STAGES`](crate::report::waterfall::STAGES) (see
/// `report::waterfall` for the boundaries). `to_headers`: from sending to the response headers; `entries`:
/// its `Server-Timing` (name, milliseconds). `None` when no kvx engine timed the request
/// (another server), so there is nothing to split.
pub fn breakdown(ttft: Duration, to_headers: Duration, entries: &[(String, f64)]) -> Option<Breakdown> {
    let get = |name: &str| entries.iter().find(|(n, _)| n == name).map(|(_, ms)| *ms);
    let sum = |names: &[&str]| names.iter().filter_map(|n| get(n)).sum::<f64>();
    let totals = [PREFILL_TOTAL, DECODE_TOTAL, LOCAL_TOTAL];
    if totals.iter().all(|n| get(n).is_none()) {
        return None;
    }
    let ttft_ns = u64::try_from(ttft.as_nanos()).unwrap_or(u64::MAX);
    let headers_ns = u64::try_from(to_headers.as_nanos()).unwrap_or(u64::MAX).min(ttft_ns);
    let mut b: Breakdown = [0; N];
    b[0] = headers_ns.saturating_sub(ns(sum(&totals)));
    b[1] = ns(sum(&[PREFILL_QUEUE, LOCAL_QUEUE]));
    b[2] = ns(sum(&[PREFILL_COMPUTE, LOCAL_PREFILL]));
    b[3] = ns(sum(&[DECODE_ADMISSION]));
    b[4] = ns(sum(&[KV_HANDSHAKE]));
    b[5] = ns(sum(&[KV_TRANSFER]));
    b[6] = ns(sum(&[KV_NOTIFY]));
    b[7] = ns(sum(&[KV_VERIFY]));
    b[8] = ttft_ns - headers_ns;
    let named: u64 = b[..N - 1].iter().sum();
    b[N - 1] = ttft_ns.saturating_sub(named);
    Some(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(entries: &[(&str, f64)]) -> Vec<(String, f64)> {
        entries.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn stages_tile_the_ttft() {
        let entries = e(&[
            (PREFILL_QUEUE, 0.1),
            (PREFILL_COMPUTE, 2.0),
            (PREFILL_TOTAL, 2.3),
            (KV_HANDSHAKE, 0.0),
            (KV_TRANSFER, 1.5),
            (KV_NOTIFY, 0.2),
            (KV_VERIFY, 0.3),
            (DECODE_ADMISSION, 0.05),
            (ITL, 15.0),
            (DECODE_TOTAL, 2.2),
            (PROXY_TOTAL, 5.0),
        ]);
        let b =
            breakdown(Duration::from_micros(20_600), Duration::from_micros(5_600), &entries).expect("kvx");
        // proxy: 5.6 - (2.3 + 2.2) = 1.1 ms; first step: 20.6 - 5.6 = 15 ms.
        assert_eq!(b[0], 1_100_000);
        assert_eq!(&b[1..8], &[100_000, 2_000_000, 50_000, 0, 1_500_000, 200_000, 300_000]);
        assert_eq!(b[8], 15_000_000);
        // other: the engines' 0.2 + 0.15 ms outside their stages.
        assert_eq!(b[9], 350_000);
        assert_eq!(b.iter().sum::<u64>(), 20_600_000);
        assert_eq!(breakdown(Duration::from_millis(1), Duration::ZERO, &e(&[("db", 1.0)])), None);
    }

    #[test]
    fn round_trips_and_skips_what_it_cannot_read() {
        let mut st = ServerTiming::new();
        st.push(PREFILL_QUEUE, Duration::from_micros(12)).push(KV_TRANSFER, Duration::from_millis(3));
        let h = st.header().expect("header");
        assert_eq!(h, "prefill_queue;dur=0.012, kv_transfer;dur=3.000");
        assert_eq!(parse(h.to_str().expect("ascii")), st.entries());
        assert_eq!(
            parse(r#"db;dur=53, app;desc="x";dur=47.2, cache;desc="hit", bad;dur=x, ;dur=1"#),
            vec![("db".to_string(), 53.0), ("app".to_string(), 47.2)]
        );
        assert_eq!(ServerTiming::new().header(), None);
    }
}
