//! `kvx bench --sweep FILE`: the cartesian product of the axes in a config file's `[sweep]`
//! table, each point resolved into its own bench settings before anything runs (the job,
//! [`SweepJob`], is `pipeline::sweep`'s, which runs it). A point the planning core rejects is
//! kept with its reason (the run reports it); a bad file, or a file whose every point is
//! rejected, is an error.

use std::path::Path;

use serde_json::Value;

use super::bench::{BenchFlags, resolve};
use super::env::ProcessEnv;
use super::layer;
use crate::config::sweep::{Point, SweepJob, SweepPoint, text};
use crate::error::ConfigError;
use crate::settings::env::results_root;

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

fn to_json(v: &toml::Value) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The points of a sweep file, and the axis that names chart series.
pub fn points(path: &Path) -> Result<(Vec<Point>, Option<String>), ConfigError> {
    // A value the file refuses would refuse every point.
    let file: BenchFlags = layer::load(path, "--sweep").map_err(|e| match e.flag.as_str() {
        "--sweep" => e,
        _ => ConfigError::new(
            "--sweep",
            format!("every point of {} is rejected; the first: {e}", path.display()),
        ),
    })?;
    let Some(table) = file.sweep_axes else {
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

/// The bench flags of one point: the base flags with the point's axes set, the sweep file as
/// the config file (a point's value stands where its flag would).
fn flags_for(base: &BenchFlags, path: &Path, point: &Point) -> Result<BenchFlags, ConfigError> {
    let mut a = base.clone();
    a.config = Some(path.to_path_buf());
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
            "layout" => a.pair.engine.layout = Some(t),
            "block_size" => a.pair.engine.block_size = Some(num("block_size")?),
            "prompt_len" => a.prompt.prompt_len = Some(t),
            "alloc" => a.alloc.alloc = Some(t.parse().map_err(|e| ConfigError::new("--alloc", e))?),
            "prefix_hit" => {
                a.prefix_hit.prefix_hit =
                    Some(t.parse().map_err(|_| ConfigError::new("--sweep", format!("prefix_hit '{t}'")))?);
            }
            "concurrency" => a.arrival.concurrency = Some(num("concurrency")?),
            "inflight" => a.inflight = Some(num("inflight")?),
            other => return Err(ConfigError::new("--sweep", format!("unknown axis {other}"))),
        }
    }
    Ok(a)
}

/// Resolves every point of the sweep file at `path` with the other flags as given.
pub fn resolve_job(flags: &BenchFlags, path: &Path, env: &ProcessEnv) -> Result<SweepJob, ConfigError> {
    let (points, series_axis) = points(path)?;
    let points: Vec<SweepPoint> = points
        .into_iter()
        .map(|point| {
            let settings = flags_for(flags, path, &point).and_then(|f| resolve(&f, env));
            SweepPoint { point, settings }
        })
        .collect();
    if let Some(first) = points.iter().find_map(|p| p.settings.as_ref().err())
        && points.iter().all(|p| p.settings.is_err())
    {
        return Err(ConfigError::new(
            "--sweep",
            format!("every point of {} is rejected; the first: {first}", path.display()),
        ));
    }
    Ok(SweepJob {
        name: path.file_stem().map_or_else(|| "sweep".into(), |s| s.to_string_lossy().to_string()),
        series_axis,
        points,
        results_root: results_root(flags.results_dir.as_deref(), env.results_dir.clone()),
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::path::PathBuf;

    use super::*;

    fn sweep_file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().expect("temp file");
        f.write_all(text.as_bytes()).expect("write");
        f
    }

    fn env() -> ProcessEnv {
        ProcessEnv {
            results_dir: None,
            stderr_is_terminal: false,
            launcher: Ok(None),
            exe: Ok(PathBuf::from("/usr/bin/kvx")),
        }
    }

    #[test]
    fn points_are_resolved_and_rejected_points_kept_with_their_reason() {
        let f = sweep_file(
            "model = \"llama-3.1-8b\"\nprompt_len = 256\n[sweep]\ntp = [\"2:2\", \"8:2\"]\n\
             layout = [\"LBHNC\", \"XYZ\"]\nseries = \"tp\"\n",
        );
        let plan = resolve_job(&BenchFlags::default(), f.path(), &env()).expect("a plan");
        assert_eq!(plan.series_axis.as_deref(), Some("tp"));
        let labels: Vec<String> = plan.points.iter().map(SweepPoint::label).collect();
        assert_eq!(
            labels,
            ["tp=2:2 layout=LBHNC", "tp=2:2 layout=XYZ", "tp=8:2 layout=LBHNC", "tp=8:2 layout=XYZ"]
        );
        let ok: Vec<bool> = plan.points.iter().map(|p| p.settings.is_ok()).collect();
        assert_eq!(ok, [true, false, true, false]);
        let s = plan.points[2].settings.as_ref().expect("valid point");
        assert_eq!((s.workers.pair.p.tp, s.workers.pair.d.tp), (8, 2));
        assert_eq!(s.workers.pair.model.name, "llama-3.1-8b", "the rest of the file is the config");
        let e = plan.points[1].settings.as_ref().expect_err("bad layout");
        assert_eq!(e.flag, "--layout", "a point's value stands where its flag would");
    }

    #[test]
    fn bad_files_fail_before_anything_runs() {
        for text in ["[sweep]\nwidth = [1]", "name = \"x\"", "[sweep]\ntp = []", "[sweep]\ntp = [\"8-2\"]"] {
            let f = sweep_file(text);
            let e = resolve_job(&BenchFlags::default(), f.path(), &env()).expect_err(text);
            assert_eq!(e.flag, "--sweep", "{text}: {e}");
        }
    }
}
