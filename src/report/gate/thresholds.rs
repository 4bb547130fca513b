//! What the gate is configured with ([`Thresholds`]): the metrics it compares, which way is
//! better, how a threshold is read, the noise rule's settings and the calibration figures;
//! the built-in defaults (`bench-configs/gates.toml`, compiled in) with a user's file laid
//! over them, every bad value refused naming the file.

use serde::{Deserialize, Serialize};

use crate::report::ReportError;

/// The built-in thresholds: `bench-configs/gates.toml`, compiled in.
pub const BUILTIN_THRESHOLDS: &str = include_str!("../../../bench-configs/gates.toml");
const BUILTIN_NAME: &str = "built-in defaults (bench-configs/gates.toml)";

/// Which way is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Higher,
    Lower,
}

/// How a threshold is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Threshold is a fraction of the baseline.
    Relative,
    /// Threshold is an amount in the metric's units.
    Absolute,
}

/// One gated (or shown) metric.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricRule {
    pub name: String,
    pub better: Better,
    pub kind: Kind,
    pub threshold: f64,
    pub normalize: bool,
    pub enforce: bool,
    pub required: bool,
}

/// Everything the gate is configured with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Thresholds {
    pub noise_z: f64,
    pub min_noise: f64,
    pub calibration: Vec<String>,
    pub rules: Vec<MetricRule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    noise_z: Option<f64>,
    min_noise: Option<f64>,
    calibration: Option<Vec<String>>,
    #[serde(default)]
    replace_defaults: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRule {
    name: String,
    better: Better,
    kind: Option<Kind>,
    threshold: f64,
    normalize: Option<bool>,
    enforce: Option<bool>,
    required: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ThresholdsFile {
    settings: Option<FileSettings>,
    #[serde(default)]
    metric: Vec<FileRule>,
}

impl Thresholds {
    /// The built-in defaults.
    pub fn builtin() -> Result<Self, ReportError> {
        Self::overlay(None, BUILTIN_THRESHOLDS, BUILTIN_NAME)
    }

    /// The built-in defaults with a user's file laid over them (see `bench-configs/gates.toml`).
    pub fn with_file(text: &str, source_name: &str) -> Result<Self, ReportError> {
        Self::overlay(Some(Self::builtin()?), text, source_name)
    }

    fn overlay(base: Option<Thresholds>, text: &str, source_name: &str) -> Result<Self, ReportError> {
        let bad = |reason: String| ReportError::Thresholds { source_name: source_name.to_string(), reason };
        let file: ThresholdsFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        let replace = file.settings.as_ref().is_some_and(|s| s.replace_defaults);
        let mut out = base.unwrap_or(Thresholds {
            noise_z: 2.0,
            min_noise: 0.0,
            calibration: vec!["ucx_loopback_gbps".into()],
            rules: Vec::new(),
        });
        if replace {
            out.rules.clear();
        }
        if let Some(s) = file.settings {
            if let Some(z) = s.noise_z {
                if !(z.is_finite() && z >= 0.0) {
                    return Err(bad(format!("settings.noise_z must be a number >= 0, not {z}")));
                }
                out.noise_z = z;
            }
            if let Some(m) = s.min_noise {
                if !(m.is_finite() && (0.0..1.0).contains(&m)) {
                    return Err(bad(format!("settings.min_noise must be a fraction in [0, 1), not {m}")));
                }
                out.min_noise = m;
            }
            if let Some(c) = s.calibration {
                out.calibration = c;
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for r in file.metric {
            if r.name.trim().is_empty() {
                return Err(bad("a [[metric]] has an empty name".into()));
            }
            if !seen.insert(r.name.clone()) {
                return Err(bad(format!("metric `{}` is listed twice", r.name)));
            }
            if !(r.threshold.is_finite() && r.threshold >= 0.0) {
                return Err(bad(format!(
                    "metric `{}`: threshold must be a number >= 0, not {}",
                    r.name, r.threshold
                )));
            }
            let kind = r.kind.unwrap_or(Kind::Relative);
            if kind == Kind::Absolute && r.normalize == Some(true) {
                return Err(bad(format!("metric `{}`: an absolute metric cannot be normalised", r.name)));
            }
            let rule = MetricRule {
                name: r.name,
                better: r.better,
                kind,
                threshold: r.threshold,
                normalize: r.normalize.unwrap_or(kind == Kind::Relative),
                enforce: r.enforce.unwrap_or(true),
                required: r.required.unwrap_or(true),
            };
            match out.rules.iter_mut().find(|x| x.name == rule.name) {
                Some(slot) => *slot = rule,
                None => out.rules.push(rule),
            }
        }
        if out.rules.is_empty() {
            return Err(bad("no [[metric]] to gate on".into()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::report::gate::fixtures::{doc, gate, th};
    use crate::report::gate::{Doc, MetricVerdict, Verdict, evaluate};

    #[test]
    fn builtin_thresholds_are_what_the_docs_say() {
        let t = th();
        assert_eq!(t.noise_z, 2.0);
        assert_eq!(t.calibration, vec!["ucx_loopback_gbps"]);
        let gated: Vec<&str> = t.rules.iter().filter(|r| r.enforce).map(|r| r.name.as_str()).collect();
        assert_eq!(
            gated,
            vec![
                "throughput_gbps",
                "stages.transfer.p50_us",
                "stages.e2e.p50_us",
                "descriptors_per_request.coalesced",
                "requests_failed",
                "verify_failures",
                "blocks_leaked"
            ]
        );
        let tput = &t.rules[0];
        assert_eq!(
            (tput.better, tput.kind, tput.threshold, tput.normalize),
            (Better::Higher, Kind::Relative, 0.10, true)
        );
    }

    #[test]
    fn goodput_of_serving_runs_is_a_metric_a_thresholds_file_can_gate() {
        let mut b = doc(&[10.0], 10.0);
        let mut c = doc(&[10.0], 10.0);
        b["goodput"] = json!({"slo_ms": {"ttft": 200.0}, "requests": 100, "good": 100, "share": 1.0, "requests_per_s": 50.0});
        c["goodput"] = json!({"slo_ms": {"ttft": 200.0}, "requests": 100, "good": 60, "share": 0.6, "requests_per_s": 30.0});
        // Not in the built-in rules (bench runs have no SLO): a thresholds file adds it.
        assert!(gate(&b, &c).metrics.iter().all(|m| !m.metric.starts_with("goodput")));
        let file = "[[metric]]\nname = \"goodput.share\"\nbetter = \"higher\"\nthreshold = 0.05\nnormalize = false\n\
                    [[metric]]\nname = \"goodput.requests_per_s\"\nbetter = \"higher\"\nthreshold = 0.1\nnormalize = false\nenforce = false\n";
        let th = Thresholds::with_file(file, "t.toml").expect("valid");
        let r = evaluate(
            Doc { path: Path::new("b.json"), value: &b },
            Doc { path: Path::new("c.json"), value: &c },
            &th,
        )
        .expect("evaluate");
        let g = r.metrics.iter().find(|m| m.metric == "goodput.share").expect("listed");
        assert_eq!((g.baseline, g.current, g.verdict), (Some(1.0), Some(0.6), MetricVerdict::Regression));
        assert!(g.fails());
        assert_eq!(r.verdict, Verdict::Regression);
        let rate = r.metrics.iter().find(|m| m.metric == "goodput.requests_per_s").expect("listed");
        assert!(!rate.fails(), "shown, not gated");
    }

    #[test]
    fn user_file_overlays_the_defaults() {
        let t = Thresholds::with_file(
            "[settings]\nnoise_z = 3\n[[metric]]\nname = \"throughput_gbps\"\nbetter = \"higher\"\nthreshold = 0.05\n\
             [[metric]]\nname = \"stages.plan.p50_us\"\nbetter = \"lower\"\nthreshold = 0.5\n",
            "t.toml",
        )
        .expect("parse");
        assert_eq!(t.noise_z, 3.0);
        assert_eq!(t.rules[0].threshold, 0.05);
        assert_eq!(t.rules.last().map(|r| r.name.as_str()), Some("stages.plan.p50_us"));
        assert_eq!(t.rules.len(), th().rules.len() + 1);
        let only = Thresholds::with_file(
            "[settings]\nreplace_defaults = true\n[[metric]]\nname = \"x\"\nbetter = \"lower\"\nthreshold = 1\n",
            "t.toml",
        )
        .expect("parse");
        assert_eq!(only.rules.len(), 1);
    }

    #[test]
    fn bad_threshold_files_say_what_is_wrong() {
        for (text, needle) in [
            ("[[metric]]\nname = \"a\"\nbetter = \"sideways\"\nthreshold = 1\n", "sideways"),
            ("[[metric]]\nname = \"a\"\nbetter = \"lower\"\nthreshold = -1\n", "threshold must be"),
            (
                "[[metric]]\nname = \"a\"\nbetter = \"lower\"\nthreshold = 1\nkind = \"absolute\"\nnormalize = true\n",
                "absolute",
            ),
            (
                "[[metric]]\nname = \"a\"\nbetter = \"lower\"\nthreshold = 1\n[[metric]]\nname = \"a\"\nbetter = \"lower\"\nthreshold = 1\n",
                "twice",
            ),
            ("[settings]\nnoise_z = -2\n", "noise_z"),
            ("[settings]\nbogus = 1\n", "bogus"),
            ("[settings]\nreplace_defaults = true\n", "no [[metric]]"),
        ] {
            let e = Thresholds::with_file(text, "t.toml").expect_err(text);
            assert!(e.to_string().contains(needle), "{text}: {e}");
            assert!(e.to_string().contains("t.toml"), "{e}");
        }
    }
}
