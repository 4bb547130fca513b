//! `kvx bench --sweep FILE`: the cartesian product of the axes in a config file's `[sweep]`
//! table, one bench per point, one row per point in the report (plus a chart of bandwidth
//! against message size). A point the planning core rejects is reported, not fatal.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::bench::{BenchArgs, BenchFile, resolve};
use crate::error::ConfigError;
use crate::pipeline::bench::{self, BenchSettings};
use crate::report::files::RunWriter;
use crate::report::summary::{Summary, SweepPoint};

/// The axes a sweep may vary, in the order points are enumerated.
pub const AXES: &[&str] = &[
    "model",
    "tp",
    "p_tp",
    "d_tp",
    "layout",
    "block_size",
    "prompt_len",
    "alloc",
    "prefix_hit",
    "concurrency",
    "inflight",
];

/// One point: axis name to value.
pub type Point = Vec<(String, Value)>;

fn to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The points of a sweep file, and the axis that names chart series.
pub fn points(path: &Path) -> Result<(Vec<Point>, Option<String>), ConfigError> {
    let file = BenchFile::load(path).map_err(|e| ConfigError::new("--sweep", e.reason))?;
    let Some(table) = file.sweep else {
        return Err(ConfigError::new("--sweep", format!("{} has no [sweep] table of axes", path.display())));
    };
    let mut series = None;
    let mut axes: Vec<(String, Vec<Value>)> = Vec::new();
    for (k, v) in &table {
        if k == "series" {
            series = v.as_str().map(str::to_string);
            continue;
        }
        if !AXES.contains(&k.as_str()) {
            return Err(ConfigError::new(
                "--sweep",
                format!("unknown sweep axis '{k}'; axes: {}", AXES.join(", ")),
            ));
        }
        let values: Vec<Value> = match v {
            toml::Value::Array(a) => a.iter().map(to_json).collect(),
            other => vec![to_json(other)],
        };
        if values.is_empty() {
            return Err(ConfigError::new("--sweep", format!("sweep axis '{k}' has no values")));
        }
        axes.push((k.clone(), values));
    }
    axes.sort_by_key(|(k, _)| AXES.iter().position(|a| a == k));
    let mut out: Vec<Point> = vec![vec![]];
    for (k, values) in &axes {
        out = out
            .into_iter()
            .flat_map(|p| {
                values.iter().map(move |v| {
                    let mut q = p.clone();
                    q.push((k.clone(), v.clone()));
                    q
                })
            })
            .collect();
    }
    if out.len() > 10_000 {
        return Err(ConfigError::new("--sweep", format!("{} points is too many (at most 10000)", out.len())));
    }
    Ok((out, series))
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The bench flags of one point: the base flags with the point's axes set.
fn args_for(base: &BenchArgs, point: &Point) -> Result<BenchArgs, ConfigError> {
    let mut a = base.clone();
    a.config = base.sweep.clone();
    a.sweep = None;
    for (k, v) in point {
        let t = text(v);
        let num = |flag: &str| -> Result<u32, ConfigError> {
            t.parse::<u32>()
                .map_err(|_| ConfigError::new("--sweep", format!("{flag} value '{t}' is not a number")))
        };
        match k.as_str() {
            "model" => a.model.model = Some(t),
            "tp" => {
                let (p, d) = t.split_once([':', 'x']).ok_or_else(|| {
                    ConfigError::new("--sweep", format!("tp value '{t}' is not P:D, e.g. \"8:2\""))
                })?;
                a.pair.p_tp =
                    Some(p.trim().parse().map_err(|_| ConfigError::new("--sweep", format!("tp '{t}'")))?);
                a.pair.d_tp =
                    Some(d.trim().parse().map_err(|_| ConfigError::new("--sweep", format!("tp '{t}'")))?);
            }
            "p_tp" => a.pair.p_tp = Some(num("p_tp")?),
            "d_tp" => a.pair.d_tp = Some(num("d_tp")?),
            "layout" => a.pair.layout = Some(t),
            "block_size" => a.pair.block_size = Some(num("block_size")?),
            "prompt_len" => a.prompt_len = Some(t),
            "alloc" => a.alloc = Some(t),
            "prefix_hit" => {
                a.prefix_hit =
                    Some(t.parse().map_err(|_| ConfigError::new("--sweep", format!("prefix_hit '{t}'")))?);
            }
            "concurrency" => a.concurrency = Some(num("concurrency")?),
            "inflight" => a.inflight = Some(num("inflight")?),
            other => return Err(ConfigError::new("--sweep", format!("unknown axis {other}"))),
        }
    }
    Ok(a)
}

fn label(point: &Point) -> String {
    point.iter().map(|(k, v)| format!("{k}={}", text(v))).collect::<Vec<_>>().join(" ")
}

/// Runs every point; returns the sweep summary.
pub fn run(args: &BenchArgs, writer: &mut RunWriter, run_id: &str) -> anyhow::Result<Summary> {
    let path = args.sweep.as_deref().ok_or_else(|| anyhow::anyhow!("--sweep FILE is required"))?;
    let (points, series_axis) = points(path)?;
    // Resolve every point first: bad files fail before any process starts.
    let resolved: Vec<(Point, Result<BenchSettings, ConfigError>)> =
        points.into_iter().map(|p| (p.clone(), args_for(args, &p).and_then(|a| resolve(&a)))).collect();
    let name = path.file_stem().map_or_else(|| "sweep".into(), |s| s.to_string_lossy().to_string());
    let first_ok = resolved.iter().find_map(|(_, r)| r.as_ref().ok()).cloned();
    let Some(first) = first_ok else {
        let why = resolved
            .first()
            .and_then(|(_, r)| r.as_ref().err())
            .map_or_else(String::new, ToString::to_string);
        anyhow::bail!("every point of {} is rejected; the first: {why}", path.display());
    };
    let mut summary = Summary::new(run_id, crate::report::summary::now_rfc3339(), first.scenario());
    summary.scenario.name = Some(name);
    summary.environment = crate::report::summary::Environment::detect();
    let mut out = Vec::new();
    let n = resolved.len();
    for (i, (point, settings)) in resolved.into_iter().enumerate() {
        let params: BTreeMap<String, Value> = point.iter().cloned().collect();
        let series = series_axis.as_ref().and_then(|a| params.get(a)).map(text);
        crate::output::note!("kvx bench --sweep: point {}/{n}: {}", i + 1, label(&point));
        let settings = match settings {
            Ok(s) => s,
            Err(e) => {
                crate::output::note!("  rejected: {e}");
                summary.notes.push(format!("{}: rejected: {e}", label(&point)));
                continue;
            }
        };
        let s = bench::run(&settings, writer, &format!("{run_id}-p{i}"))?;
        summary.absorb(&s);
        let descs = s.descriptors_per_request;
        out.push(SweepPoint {
            label: label(&point),
            series,
            params,
            block_size: settings.pair.p.block_tokens.into(),
            bytes_per_descriptor: (descs.raw > 0.0).then(|| s.bytes_per_request / descs.raw),
            throughput_gbps: s.throughput_gbps,
            requests_per_s: s.requests_per_s,
            transfer_p50_us: s.stages.get("transfer").map(|t| t.p50_us),
            e2e_p50_us: s.stages.get("e2e").map(|t| t.p50_us),
            descriptors_per_request: Some(descs),
            requests_ok: s.requests_ok,
            requests_failed: s.requests_failed,
        });
    }
    summary.sweep = Some(out);
    summary.finished_at = Some(crate::report::summary::now_rfc3339());
    Ok(summary)
}
