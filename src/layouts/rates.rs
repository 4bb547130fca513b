//! Posting rates and ceilings read from results files, each with the file and line it stands on.
//!
//! `kvx plan`'s rates are data from measurements, never constants typed in: the built-in ones
//! come from two committed results files compiled into kvx ([`BUILTIN`]: `kvx xfer` on this
//! project's CPU host, and `scripts/gpu-check.sh` on an H200, whose card every GPU rate
//! names), and a user's own file
//! ([`Knob::Rates`]) is read the same way. Two kinds of file are understood, found anywhere inside the JSON (so a
//! `scripts/gpu-check.sh` JSON that holds `kvx xfer` reports works as it stands):
//!
//! - a `kvx xfer` report in JSON (`results[]` with `size_bytes`, `inflight`, `post_us`,
//!   `gbps`): over UCX, the posting cost per GET is the smallest size's `post_us / inflight`
//!   (host memory: `ucx`; device memory: `cuda-ipc`) and the ceiling is the largest size's
//!   `gbps`; over the `cuda-batch` transport, the cost per descriptor and per batch are the
//!   slope and intercept of `post_us` against `inflight` at the smallest size, and the ceiling
//!   is the largest size's `bulk_copy_gbps` (else `gbps`).
//! - a rates file (`{"paths": {"cuda-batch": {"ns_per_descriptor": .., "ns_per_call": ..,
//!   "ceiling_gbps": ..}}, "provenance": ".."}`): figures transcribed with their provenance,
//!   for measurements whose raw output was not kept; its `note` (else `provenance`) follows
//!   every rate taken from it.
//!
//! Pure: callers hand over the file's name and text.

use serde_json::Value;

use super::posting::{PathRate, PostPath, PostRates, RateSource};
use super::predict::{RATES_VERSION, TransferModel};
use crate::vocab::knob::Knob;

/// The files the built-in rates come from, as committed (path, text).
pub const BUILTIN: [(&str, &str); 2] = [
    ("results/docs/xfer-rates/out.txt", include_str!("../../results/docs/xfer-rates/out.txt")),
    (
        "results/gpu-nvidia-h200-2026-11-28b.json",
        include_str!("../../results/gpu-nvidia-h200-2026-11-28b.json"),
    ),
];

/// The line (1-based) of the first line at or after `from` that holds `"key": ` and whose
/// number is `value`; else the first line holding the key; else 1.
fn line_of(text: &str, from: usize, key: &str, value: f64) -> usize {
    let needle = format!("\"{key}\":");
    let hits: Vec<(usize, &str)> =
        text.lines().enumerate().skip(from.saturating_sub(1)).filter(|(_, l)| l.contains(&needle)).collect();
    let same = |l: &str| {
        l.split_once(&needle)
            .and_then(|(_, v)| v.trim().trim_end_matches(',').parse::<f64>().ok())
            .is_some_and(|v| (v - value).abs() <= 1e-9 * value.abs().max(1.0))
    };
    hits.iter().find(|(_, l)| same(l)).or(hits.first()).map_or(1, |(i, _)| i + 1)
}

/// The line where the `results[]` entry of this size (and depth) starts.
fn result_line(text: &str, size: u64, inflight: u64) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let size_hit = format!("\"size_bytes\": {size}");
    let depth_hit = format!("\"inflight\": {inflight}");
    (0..lines.len())
        .find(|&i| {
            lines[i].contains(&size_hit)
                && lines[i..(i + 3).min(lines.len())].iter().any(|l| l.contains(&depth_hit))
        })
        .map_or(1, |i| i + 1)
}

fn num(v: &Value, key: &str) -> Option<f64> {
    // 1e-3 at least (1 ps per descriptor, 1 MB/s): a smaller figure would print times of "inf s".
    v.get(key).and_then(Value::as_f64).filter(|x| x.is_finite() && *x >= 1e-3)
}

/// Every `kvx xfer` report and rates file inside `v`, outermost first.
fn reports<'v>(v: &'v Value, out: &mut Vec<&'v Value>) {
    let is_report = v.get("results").is_some_and(Value::is_array) && v.get("memory").is_some();
    let is_rates = v.get("paths").is_some_and(Value::is_object);
    if is_report || is_rates {
        out.push(v);
        return;
    }
    match v {
        Value::Object(o) => o.values().for_each(|x| reports(x, out)),
        Value::Array(a) => a.iter().for_each(|x| reports(x, out)),
        _ => {}
    }
}

fn source(path: &str, line: usize, detail: String) -> RateSource {
    RateSource::File { path: path.to_string(), line, detail }
}

/// Lays the rates `text` gives over `rates`; returns the paths it set. An error says what
/// the file lacks.
pub fn apply(path: &str, text: &str, rates: &mut PostRates) -> Result<Vec<PostPath>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("{path} is not JSON: {e}"))?;
    check_calibrated(path, &v)?;
    let mut found = Vec::new();
    reports(&v, &mut found);
    let mut set = Vec::new();
    for r in found {
        if let Some(paths) = r.get("paths").and_then(Value::as_object) {
            set.extend(apply_rates_file(path, text, r, paths, rates)?);
        } else {
            set.extend(apply_xfer(path, text, r, rates)?);
        }
    }
    if set.is_empty() {
        return Err(format!(
            "{path} holds no kvx xfer report (`results` with `post_us`) and no rates (`paths`)"
        ));
    }
    set.sort();
    set.dedup();
    // A GPU check's file names its card: every rate taken from it says which.
    if let Some(card) = v.get("card").and_then(Value::as_str) {
        for &p in &set {
            let r = rates.of_mut(p);
            for s in [&mut r.post_source, &mut r.ceiling_source] {
                if let RateSource::File { path: from, detail, .. } = s
                    && from == path
                {
                    detail.push_str(&format!(" (on an {card})"));
                }
            }
        }
    }
    Ok(set)
}

/// The provenance fields a `kvx calibrate` rates file must carry.
pub const PROVENANCE_FIELDS: [&str; 5] = ["command", "host", "kvx_version", "ucx_version", "date"];

/// A `kvx calibrate` rates file (one with `kvx_rates_version`, or with a fitted `model` in a
/// path) is read strictly: its version, its provenance and each path's model, every error
/// naming the field.
fn check_calibrated(path: &str, v: &Value) -> Result<(), String> {
    let has_model = v
        .get("paths")
        .and_then(Value::as_object)
        .is_some_and(|ps| ps.values().any(|p| p.get("model").is_some()));
    let Some(version) = v.get("kvx_rates_version") else {
        return if has_model {
            Err(format!("{path}: `kvx_rates_version` is missing (a rates file of kvx calibrate carries it)"))
        } else {
            Ok(())
        };
    };
    if version.as_u64() != Some(RATES_VERSION) {
        return Err(format!(
            "{path}: `kvx_rates_version` is {version}, this kvx reads version {RATES_VERSION}: run kvx calibrate again"
        ));
    }
    let prov = v.get("provenance").and_then(Value::as_object).ok_or_else(|| {
        format!("{path}: `provenance` is missing or not an object (command, host, versions, date)")
    })?;
    for f in PROVENANCE_FIELDS {
        if !prov.get(f).is_some_and(Value::is_string) {
            return Err(format!("{path}: `provenance.{f}` is missing or not a string"));
        }
    }
    let paths =
        v.get("paths").and_then(Value::as_object).ok_or_else(|| format!("{path}: `paths` is missing"))?;
    if paths.is_empty() {
        return Err(format!("{path}: `paths` names no transport"));
    }
    for (key, p) in paths {
        model_of(path, key, p)?;
    }
    Ok(())
}

/// The fitted model of path `key` of a rates file, checked: every figure finite, rates and
/// ranges positive.
fn model_of(path: &str, key: &str, p: &Value) -> Result<TransferModel, String> {
    let m = p.get("model").ok_or_else(|| format!("{path}: `paths.{key}.model` is missing"))?;
    let model: TransferModel =
        serde_json::from_value(m.clone()).map_err(|e| format!("{path}: `paths.{key}.model`: {e}"))?;
    let bad = |field: &str| format!("{path}: `paths.{key}.model.{field}` must be a finite number above 0");
    let nonneg = |x: f64| x.is_finite() && x >= 0.0;
    if !(model.gbps.is_finite() && model.gbps > 0.0) {
        return Err(bad("gbps"));
    }
    if !(model.ceiling_gbps.is_finite() && model.ceiling_gbps > 0.0) {
        return Err(bad("ceiling_gbps"));
    }
    for (f, x) in [
        ("fixed_ns", model.fixed_ns),
        ("ns_per_descriptor", model.ns_per_descriptor),
        ("ns_per_call", model.ns_per_call),
    ] {
        if !nonneg(x) {
            return Err(format!("{path}: `paths.{key}.model.{f}` must be a finite number, 0 or more"));
        }
    }
    for (i, r) in model.concurrency.iter().enumerate() {
        if r.readers == 0 || !(r.gbps.is_finite() && r.gbps > 0.0) || !nonneg(r.ns_per_descriptor) {
            return Err(format!(
                "{path}: `paths.{key}.model.concurrency[{i}]` needs readers >= 1, gbps > 0 and ns_per_descriptor >= 0"
            ));
        }
    }
    let f = &model.fitted;
    if f.min_descriptor_bytes == 0 || f.max_descriptor_bytes < f.min_descriptor_bytes || f.max_readers == 0 {
        return Err(format!("{path}: `paths.{key}.model.fitted` is not a range (min <= max, both above 0)"));
    }
    Ok(model)
}

fn apply_rates_file(
    path: &str,
    text: &str,
    r: &Value,
    paths: &serde_json::Map<String, Value>,
    rates: &mut PostRates,
) -> Result<Vec<PostPath>, String> {
    // The short note if there is one (the file's `provenance` says the rest).
    let provenance = ["note", "provenance"]
        .iter()
        .find_map(|k| r.get(*k).and_then(Value::as_str))
        .unwrap_or("no provenance given");
    let mut set = Vec::new();
    for (key, p) in paths {
        let post = PostPath::ALL
            .into_iter()
            .find(|x| x.key() == key)
            .ok_or_else(|| format!("{path}: unknown path `{key}` (known: ucx, cuda-ipc, cuda-batch)"))?;
        let rate = rates.of_mut(post);
        let start = text.lines().position(|l| l.contains(&format!("\"{key}\":"))).map_or(1, |i| i + 1);
        if let Some(ns) = num(p, "ns_per_descriptor") {
            rate.ns_per_descriptor = ns;
            rate.ns_per_call = num(p, "ns_per_call").unwrap_or(0.0);
            let how = p.get("how").and_then(Value::as_str).unwrap_or_default();
            rate.post_source =
                source(path, line_of(text, start, "ns_per_descriptor", ns), format!("{how} ({provenance})"));
        }
        if let Some(g) = num(p, "ceiling_gbps") {
            rate.ceiling_gbps = g;
            let how = p.get("ceiling_how").and_then(Value::as_str).unwrap_or_default();
            rate.ceiling_source =
                source(path, line_of(text, start, "ceiling_gbps", g), format!("{how} ({provenance})"));
        }
        if p.get("model").is_some() {
            rate.model = Some(model_of(path, key, p)?);
        }
        set.push(post);
    }
    Ok(set)
}

fn apply_xfer(path: &str, text: &str, r: &Value, rates: &mut PostRates) -> Result<Vec<PostPath>, String> {
    let results: Vec<&Value> = r["results"].as_array().map(|a| a.iter().collect()).unwrap_or_default();
    let size = |x: &Value| x.get("size_bytes").and_then(Value::as_u64).unwrap_or(0);
    let depth = |x: &Value| x.get("inflight").and_then(Value::as_u64).unwrap_or(0);
    let smallest = results
        .iter()
        .map(|x| size(x))
        .filter(|s| *s > 0)
        .min()
        .ok_or_else(|| format!("{path}: a kvx xfer report without results"))?;
    let largest = results.iter().map(|x| size(x)).max().unwrap_or(smallest);
    let mut small: Vec<&Value> = results
        .iter()
        .copied()
        .filter(|x| size(x) == smallest && depth(x) > 0 && num(x, "post_us").is_some())
        .collect();
    small.sort_by_key(|x| depth(x));
    let big = results.iter().copied().filter(|x| size(x) == largest).max_by_key(|x| depth(x));
    let device = r["memory"]["kind"].as_str() == Some("cuda");
    let batch = r["transport"].as_str() == Some("cuda-batch");
    let post = match (batch, device) {
        (true, _) => PostPath::CudaBatch,
        (false, true) => PostPath::CudaIpc,
        (false, false) => PostPath::Ucx,
    };
    let rate: &mut PathRate = rates.of_mut(post);
    let kib = |b: u64| format!("{} KiB", b / 1024);
    if batch {
        // post_us = (inflight * ns_per_descriptor + ns_per_call) / 1000, fitted through the
        // shallowest and deepest batch.
        let (Some(a), Some(b)) = (small.first(), small.last()) else {
            return Err(format!("{path}: a cuda-batch report without posting times"));
        };
        let (pa, pb) = (num(a, "post_us").unwrap_or(0.0) * 1e3, num(b, "post_us").unwrap_or(0.0) * 1e3);
        let (da, db) = (depth(a) as f64, depth(b) as f64);
        let per_desc = if db > da { ((pb - pa) / (db - da)).max(0.0) } else { 0.0 };
        rate.ns_per_descriptor = per_desc;
        rate.ns_per_call = (pa - per_desc * da).max(0.0);
        rate.post_source = source(
            path,
            line_of(text, result_line(text, smallest, depth(a)), "post_us", pa / 1e3),
            format!(
                "kvx xfer {} cuda-batch at {}: post_us {:.2} at {} descriptors, {:.2} at {}",
                Knob::Transport,
                kib(smallest),
                pa / 1e3,
                da,
                pb / 1e3,
                db
            ),
        );
    } else if let Some(a) = small.last() {
        let us = num(a, "post_us").unwrap_or(0.0);
        rate.ns_per_descriptor = us * 1e3 / depth(a) as f64;
        rate.ns_per_call = 0.0;
        rate.post_source = source(
            path,
            line_of(text, result_line(text, smallest, depth(a)), "post_us", us),
            format!(
                "kvx xfer at {} x{}: post_us {us:.2} per batch of {} GET{}",
                kib(smallest),
                depth(a),
                depth(a),
                if depth(a) == 1 { "" } else { "s" }
            ),
        );
    }
    if let Some(b) = big {
        let (key, g) = match (batch, num(b, "bulk_copy_gbps")) {
            (true, Some(g)) => ("bulk_copy_gbps", g),
            _ => ("gbps", num(b, "gbps").unwrap_or(0.0)),
        };
        if g > 0.0 {
            rate.ceiling_gbps = g;
            rate.ceiling_source = source(
                path,
                line_of(text, result_line(text, largest, depth(b)), key, g),
                format!("kvx xfer at {} x{}: {key} {g:.2}", kib(largest), depth(b)),
            );
        }
    }
    Ok(vec![post])
}

/// A rate nothing has given yet (each built-in file gives every one; a test checks it).
fn unset(why_unset: &str) -> PathRate {
    let why = || RateSource::File {
        path: "(none)".into(),
        line: 0,
        detail: format!("no built-in rate: {why_unset}"),
    };
    PathRate {
        ns_per_descriptor: 0.0,
        ns_per_call: 0.0,
        post_source: why(),
        ceiling_gbps: 0.0,
        ceiling_source: why(),
        model: None,
    }
}

/// The built-in rates: read from the committed results files kvx is built with
/// ([`BUILTIN`]), each rate naming its file and line.
impl Default for PostRates {
    fn default() -> Self {
        let mut rates =
            PostRates { ucx: unset("ucx"), cuda_ipc: unset("cuda-ipc"), cuda_batch: unset("cuda-batch") };
        for (path, text) in BUILTIN {
            if let Err(e) = apply(path, text, &mut rates) {
                // Only a broken build gets here: the rates left unset say why.
                for p in PostPath::ALL {
                    let r = rates.of_mut(p);
                    if r.ns_per_descriptor == 0.0 {
                        *r = unset(&e);
                    }
                }
            }
        }
        rates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_files_give_every_rate_with_its_line() {
        let r = PostRates::default();
        for path in PostPath::ALL {
            let rate = r.of(path);
            assert!(rate.ns_per_descriptor > 0.0 && rate.ceiling_gbps > 0.0, "{path:?}: {rate:?}");
            for s in [&rate.post_source, &rate.ceiling_source] {
                let RateSource::File { path: file, line, .. } = s else { panic!("{path:?}: {s:?}") };
                let (_, text) = BUILTIN.iter().find(|(p, _)| p == file).expect("a built-in file");
                assert!(*line >= 1 && *line <= text.lines().count(), "{file}:{line}");
            }
        }
        // Each figure stands on the line named.
        let ucx = &r.ucx;
        let RateSource::File { path, line, .. } = &ucx.ceiling_source else { panic!() };
        let (_, text) = BUILTIN.iter().find(|(p, _)| p == path).expect("file");
        let at = text.lines().nth(line - 1).expect("line");
        assert!(at.contains("\"gbps\":"), "{at}");
        assert!(r.cuda_batch.ns_per_call > 0.0);
    }

    #[test]
    fn an_xfer_report_gives_posting_per_get_and_the_largest_size_as_ceiling() {
        let text = r#"{
  "memory": {"kind": "host"},
  "transport": "ucx",
  "results": [
    {
      "size_bytes": 8192,
      "inflight": 64,
      "gbps": 3.1,
      "post_us": 4.8
    },
    {
      "size_bytes": 1048576,
      "inflight": 64,
      "gbps": 4.5,
      "post_us": 6.0
    }
  ]
}"#;
        let mut r = PostRates::default();
        assert_eq!(apply("mine.json", text, &mut r), Ok(vec![PostPath::Ucx]));
        assert!((r.ucx.ns_per_descriptor - 75.0).abs() < 1e-9);
        assert_eq!(r.ucx.ceiling_gbps, 4.5);
        assert!(matches!(&r.ucx.post_source, RateSource::File { path, line: 9, .. } if path == "mine.json"));
        assert!(matches!(&r.ucx.ceiling_source, RateSource::File { line: 14, .. }));
    }

    #[test]
    fn a_cuda_batch_report_gives_a_cost_per_descriptor_and_per_batch() {
        let text = r#"{"gpu": {"steps": [{"kvx": {"memory": {"kind": "cuda"}, "transport": "cuda-batch", "results": [
            {"size_bytes": 8192, "inflight": 1, "post_us": 4.7, "gbps": 1.0},
            {"size_bytes": 8192, "inflight": 10240, "post_us": 26.2, "gbps": 497.0, "bulk_copy_gbps": 1277.0}
        ]}}]}}"#;
        let mut r = PostRates::default();
        assert_eq!(apply("gpu.json", text, &mut r), Ok(vec![PostPath::CudaBatch]));
        assert!((r.cuda_batch.ns_per_descriptor - 21_500.0 / 10_239.0).abs() < 1e-9);
        assert!((r.cuda_batch.ns_per_call - (4_700.0 - 21_500.0 / 10_239.0)).abs() < 1e-6);
        assert_eq!(r.cuda_batch.ceiling_gbps, 1277.0);
    }

    #[test]
    fn a_file_without_rates_is_refused_by_name() {
        let mut r = PostRates::default();
        assert!(apply("x.json", "{\"a\": 1}", &mut r).is_err_and(|e| e.contains("x.json")));
        assert!(apply("x.json", "not json", &mut r).is_err_and(|e| e.contains("not JSON")));
        let bad = r#"{"paths": {"nvlink": {"ns_per_descriptor": 1}}}"#;
        assert!(apply("x.json", bad, &mut r).is_err_and(|e| e.contains("nvlink")));
    }
}
