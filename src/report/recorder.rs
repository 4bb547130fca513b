//! [`StageRecorder`]: raw latency samples per stage, in nanoseconds, in hdrhistogram.
//!
//! Owns the recording and merging of samples and their compact wire form (hdrhistogram's V2
//! deflate encoding, base64 in text formats) so workers in other processes can ship what they
//! recorded to the orchestrator. Percentiles come from hdrhistogram only. Must not time
//! anything itself: callers measure and hand over durations.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use hdrhistogram::Histogram;
use hdrhistogram::serialization::{Deserializer, Serializer as _, V2DeflateSerializer};
use serde::{Deserialize, Serialize};

use super::ReportError;
use super::summary::{Stage, StageStats};

/// Significant decimal digits kept by every histogram: 0.1% relative error at any magnitude,
/// enough for p99.9 and small enough (a few KiB compressed) to ship per worker.
const SIGFIG: u8 = 3;

/// Samples per stage. Histograms resize themselves, so any duration can be recorded.
#[derive(Debug, Clone, Default)]
pub struct StageRecorder {
    hists: BTreeMap<String, Histogram<u64>>,
}

fn new_histogram() -> Histogram<u64> {
    // `new` makes an auto-resizing histogram, which only fails for sigfig > 5.
    Histogram::new(SIGFIG).unwrap_or_else(|_| unreachable!("sigfig {SIGFIG} is valid"))
}

/// Records into an auto-resizing histogram (which grows to fit); if growing ever fails, the
/// sample is clamped to the largest trackable value rather than lost.
pub(crate) fn record_into(h: &mut Histogram<u64>, value: u64) {
    if h.record(value).is_err() {
        h.saturating_record(value);
    }
}

/// A fresh auto-resizing histogram with kvx's precision.
pub(crate) fn new_auto_histogram() -> Histogram<u64> {
    new_histogram()
}

impl StageRecorder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one sample of `stage`.
    pub fn record_ns(&mut self, stage: &str, latency_ns: u64) {
        record_into(self.hists.entry(stage.to_string()).or_insert_with(new_histogram), latency_ns);
    }

    /// Records one sample of a known stage.
    pub fn record(&mut self, stage: Stage, latency: Duration) {
        self.record_ns(stage.as_str(), u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Adds every sample of `other` (e.g. another worker's) into this recorder.
    pub fn merge(&mut self, other: &StageRecorder) -> Result<(), ReportError> {
        for (stage, h) in &other.hists {
            self.hists
                .entry(stage.clone())
                .or_insert_with(new_histogram)
                .add(h)
                .map_err(|e| ReportError::Histogram(format!("merging stage `{stage}`: {e:?}")))?;
        }
        Ok(())
    }

    /// The histogram of a stage, if it has samples.
    pub fn histogram(&self, stage: &str) -> Option<&Histogram<u64>> {
        self.hists.get(stage).filter(|h| !h.is_empty())
    }

    pub fn is_empty(&self) -> bool {
        self.hists.values().all(Histogram::is_empty)
    }

    /// Percentiles of every stage with at least one sample.
    pub fn stats(&self) -> BTreeMap<String, StageStats> {
        self.hists.iter().filter(|(_, h)| !h.is_empty()).map(|(k, h)| (k.clone(), stage_stats(h))).collect()
    }

    /// Each stage's histogram in hdrhistogram's V2 deflate encoding.
    pub fn to_wire(&self) -> Result<BTreeMap<String, Vec<u8>>, ReportError> {
        let mut out = BTreeMap::new();
        for (stage, h) in &self.hists {
            let mut buf = Vec::new();
            V2DeflateSerializer::new()
                .serialize(h, &mut buf)
                .map_err(|e| ReportError::Histogram(format!("encoding stage `{stage}`: {e}")))?;
            out.insert(stage.clone(), buf);
        }
        Ok(out)
    }

    /// The inverse of [`StageRecorder::to_wire`].
    pub fn from_wire(wire: &BTreeMap<String, Vec<u8>>) -> Result<Self, ReportError> {
        let mut hists = BTreeMap::new();
        for (stage, bytes) in wire {
            let mut h: Histogram<u64> = Deserializer::new()
                .deserialize(&mut bytes.as_slice())
                .map_err(|e| ReportError::Histogram(format!("decoding stage `{stage}`: {e:?}")))?;
            // Samples merged in later may exceed the sender's range.
            h.auto(true);
            hists.insert(stage.clone(), h);
        }
        Ok(StageRecorder { hists })
    }
}

/// Serialized as a map of stage name to base64 of the V2 deflate encoding, so it fits JSON and
/// msgpack alike.
impl Serialize for StageRecorder {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let wire = self.to_wire().map_err(serde::ser::Error::custom)?;
        let b64: BTreeMap<String, String> =
            wire.into_iter().map(|(k, v)| (k, base64::engine::general_purpose::STANDARD.encode(v))).collect();
        b64.serialize(s)
    }
}

impl<'de> Deserialize<'de> for StageRecorder {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let b64 = BTreeMap::<String, String>::deserialize(d)?;
        let mut wire = BTreeMap::new();
        for (k, v) in b64 {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(v.as_bytes())
                .map_err(|e| serde::de::Error::custom(format!("stage `{k}`: {e}")))?;
            wire.insert(k, bytes);
        }
        StageRecorder::from_wire(&wire).map_err(serde::de::Error::custom)
    }
}

/// Summary figures of one histogram of nanosecond samples.
pub fn stage_stats(h: &Histogram<u64>) -> StageStats {
    let us = |ns: u64| ns as f64 / 1e3;
    StageStats {
        count: h.len(),
        mean_us: h.mean() / 1e3,
        min_us: us(h.min()),
        p50_us: us(h.value_at_quantile(0.50)),
        p90_us: us(h.value_at_quantile(0.90)),
        p99_us: us(h.value_at_quantile(0.99)),
        p999_us: us(h.value_at_quantile(0.999)),
        max_us: us(h.max()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(range: std::ops::Range<u64>) -> StageRecorder {
        let mut r = StageRecorder::new();
        for v in range {
            r.record_ns("transfer", v * 1000);
        }
        r
    }

    #[test]
    fn percentiles_match_the_samples() {
        let r = filled(1..1001);
        let s = r.stats()["transfer"];
        assert_eq!(s.count, 1000);
        // 0.1% relative precision.
        assert!((s.p50_us - 500.0).abs() <= 0.5, "{s:?}");
        assert!((s.p90_us - 900.0).abs() <= 0.9, "{s:?}");
        assert!((s.p99_us - 990.0).abs() <= 1.0, "{s:?}");
        assert!((s.max_us - 1000.0).abs() <= 1.0, "{s:?}");
        assert!((s.mean_us - 500.5).abs() <= 0.5, "{s:?}");
        assert!((s.min_us - 1.0).abs() <= 0.01, "{s:?}");
    }

    #[test]
    fn merge_equals_recording_everything_in_one() {
        let mut a = filled(1..500);
        let b = filled(500..1001);
        a.record(Stage::Plan, Duration::from_micros(3));
        a.merge(&b).expect("merge");
        assert_eq!(a.stats()["transfer"], filled(1..1001).stats()["transfer"]);
        assert_eq!(a.stats()["plan"].count, 1);
    }

    #[test]
    fn wire_and_json_round_trip() {
        let mut r = filled(1..2000);
        r.record(Stage::E2e, Duration::from_secs(3600));
        let back = StageRecorder::from_wire(&r.to_wire().expect("wire")).expect("decode");
        assert_eq!(back.stats(), r.stats());
        let json = serde_json::to_string(&r).expect("json");
        let from_json: StageRecorder = serde_json::from_str(&json).expect("from json");
        assert_eq!(from_json.stats(), r.stats());
        // Decoded histograms still take samples beyond their old range.
        let mut grown = from_json;
        grown.record_ns("transfer", u64::MAX / 4);
        assert_eq!(grown.stats()["transfer"].count, 2000);
        let msgpack = rmp_serde::to_vec(&r).expect("msgpack");
        let from_mp: StageRecorder = rmp_serde::from_slice(&msgpack).expect("from msgpack");
        assert_eq!(from_mp.stats(), r.stats());
    }

    #[test]
    fn garbage_on_the_wire_is_an_error() {
        let mut wire = BTreeMap::new();
        wire.insert("transfer".to_string(), vec![1, 2, 3, 4]);
        assert!(matches!(StageRecorder::from_wire(&wire), Err(ReportError::Histogram(_))));
        assert!(serde_json::from_str::<StageRecorder>(r#"{"x":"not base64!"}"#).is_err());
    }

    #[test]
    fn empty_stages_are_left_out() {
        let r = StageRecorder::new();
        assert!(r.is_empty());
        assert!(r.stats().is_empty());
        assert!(r.histogram("transfer").is_none());
    }
}
