//! Service-level objectives and goodput: the share of requests that met every SLO, and how
//! many such requests a second the target served (vLLM benchmark_serving's `--goodput`, with
//! kvx's `--slo ttft=200ms,tpot=50ms` spelling; `itl` and `e2el` as well).
//!
//! Owns the SLO grammar, the per-request verdict and the [`Goodput`] figures a summary
//! carries (`goodput.share`, `goodput.requests_per_s` are paths the gate can compare). Pure:
//! no I/O, no clock.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::load::Slo;
use serde::{Deserialize, Serialize};

/// What one request measured, as the SLO check needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestTimes {
    /// False for a failed request: it meets no SLO.
    pub ok: bool,
    pub ttft: Option<Duration>,
    /// `None` with fewer than two tokens (vLLM counts its TPOT as 0).
    pub tpot: Option<Duration>,
    /// The longest gap between two streamed tokens; `None` with fewer than two.
    pub max_itl: Option<Duration>,
    pub e2el: Duration,
}

impl Slo {
    /// Parses `ttft=200ms,tpot=50ms` (also `ttft:200`, vLLM's spelling, where a bare number
    /// is milliseconds; `1s`, `250us` work too). The error says what to write.
    pub fn parse(s: &str) -> Result<Slo, String> {
        let mut slo = Slo::default();
        let items: Vec<&str> = s.split([',', ' ']).map(str::trim).filter(|i| !i.is_empty()).collect();
        if items.is_empty() {
            return Err("no objective given; write e.g. ttft=200ms,tpot=50ms (ttft, tpot, itl, e2el)".into());
        }
        for item in items {
            let (name, value) = item.split_once(['=', ':']).ok_or_else(|| {
                format!("`{item}` is not NAME=LIMIT; write e.g. ttft=200ms (ttft, tpot, itl, e2el)")
            })?;
            let value = value.trim();
            let d = match value.parse::<f64>() {
                Ok(ms) if ms.is_finite() && ms > 0.0 => Duration::try_from_secs_f64(ms / 1e3)
                    .map_err(|_| format!("`{item}`: {ms:e} ms is beyond any run"))?,
                Ok(_) => return Err(format!("`{item}`: the limit must be above zero")),
                Err(_) => humantime::parse_duration(value)
                    .map_err(|e| format!("`{item}`: `{value}` is not a duration like 200ms ({e})"))?,
            };
            if d.is_zero() {
                return Err(format!("`{item}`: the limit must be above zero"));
            }
            let slot = match name.trim().to_ascii_lowercase().as_str() {
                "ttft" => &mut slo.ttft,
                "tpot" => &mut slo.tpot,
                "itl" => &mut slo.itl,
                "e2el" | "e2e" => &mut slo.e2el,
                other => return Err(format!("unknown objective `{other}`: use ttft, tpot, itl or e2el")),
            };
            if slot.replace(d).is_some() {
                return Err(format!("`{}` is given twice", name.trim()));
            }
        }
        Ok(slo)
    }

    /// The limits in milliseconds by name (for JSON and tables).
    pub fn limits_ms(&self) -> BTreeMap<String, f64> {
        [("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl), ("e2el", self.e2el)]
            .into_iter()
            .filter_map(|(n, d)| d.map(|d| (n.to_string(), d.as_secs_f64() * 1e3)))
            .collect()
    }

    /// `ttft<=200ms, tpot<=50ms`.
    pub fn describe(&self) -> String {
        self.limits_ms().iter().map(|(n, ms)| format!("{n}<={ms}ms")).collect::<Vec<_>>().join(", ")
    }

    /// Whether a request met every objective.
    pub fn meets(&self, r: &RequestTimes) -> bool {
        let within =
            |limit: Option<Duration>, v: Option<Duration>| limit.is_none_or(|l| v.is_none_or(|v| v <= l));
        r.ok && within(self.ttft, r.ttft.or(Some(r.e2el)))
            && within(self.tpot, r.tpot)
            && within(self.itl, r.max_itl)
            && within(self.e2el, Some(r.e2el))
    }
}

/// Goodput of one target: requests within every SLO, their share and rate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// The objectives, in milliseconds, by name.
    pub slo_ms: BTreeMap<String, f64>,
    /// Measured requests (failed ones included).
    pub requests: u64,
    /// Requests that met every objective.
    pub good: u64,
    /// `good / requests`.
    pub share: f64,
    /// `good` over the measured wall time: requests per second within SLO.
    pub requests_per_s: f64,
}

impl Goodput {
    pub fn new(slo: &Slo, requests: u64, good: u64, duration_s: f64) -> Self {
        Self {
            slo_ms: slo.limits_ms(),
            requests,
            good,
            share: if requests > 0 { good as f64 / requests as f64 } else { 0.0 },
            requests_per_s: if duration_s > 0.0 { good as f64 / duration_s } else { 0.0 },
        }
    }

    /// `ttft<=200ms, tpot<=50ms`.
    pub fn describe(&self) -> String {
        self.slo_ms.iter().map(|(n, ms)| format!("{n}<={ms}ms")).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn parses_both_spellings_and_names_what_is_wrong() {
        let s = Slo::parse("ttft=200ms,tpot=50ms").expect("valid");
        assert_eq!((s.ttft, s.tpot, s.itl, s.e2el), (Some(ms(200)), Some(ms(50)), None, None));
        let s = Slo::parse("ttft:200 e2el:1.5s, itl=30").expect("vLLM's spelling");
        assert_eq!((s.ttft, s.itl, s.e2el), (Some(ms(200)), Some(ms(30)), Some(ms(1500))));
        assert_eq!(s.describe(), "e2el<=1500ms, itl<=30ms, ttft<=200ms");
        for (bad, says) in [
            ("", "no objective"),
            ("ttft", "NAME=LIMIT"),
            ("ttft=fast", "not a duration"),
            ("ttft=0ms", "above zero"),
            ("ttft=-5", "above zero"),
            ("latency=5ms", "unknown objective"),
            ("ttft=1ms,ttft=2ms", "twice"),
        ] {
            let e = Slo::parse(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_request_meets_every_objective_or_none() {
        let slo = Slo::parse("ttft=200ms,tpot=50ms,itl=80ms").expect("valid");
        let good = RequestTimes {
            ok: true,
            ttft: Some(ms(150)),
            tpot: Some(ms(40)),
            max_itl: Some(ms(80)),
            e2el: ms(900),
        };
        assert!(slo.meets(&good));
        assert!(!slo.meets(&RequestTimes { ttft: Some(ms(201)), ..good }));
        assert!(!slo.meets(&RequestTimes { tpot: Some(ms(51)), ..good }));
        assert!(!slo.meets(&RequestTimes { max_itl: Some(ms(81)), ..good }));
        assert!(!slo.meets(&RequestTimes { ok: false, ..good }), "a failed request meets nothing");
        // One token: no TPOT, no ITL, as vLLM counts them.
        assert!(slo.meets(&RequestTimes { tpot: None, max_itl: None, ..good }));
        // No TTFT measured (not streamed): the whole request is its first token.
        assert!(!slo.meets(&RequestTimes { ttft: None, e2el: ms(300), ..good }));
        let g = Goodput::new(&slo, 4, 3, 2.0);
        assert_eq!((g.share, g.requests_per_s), (0.75, 1.5));
        assert_eq!(g.slo_ms["ttft"], 200.0);
        assert_eq!(Goodput::new(&slo, 0, 0, 0.0).share, 0.0);
    }
}
