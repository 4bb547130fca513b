//! `--rates`, `--post-ns` and `--ceiling-gbps` (`kvx plan`): the user's measured posting costs
//! and bandwidth ceilings, over the built-in ones of `layouts::posting`, resolved into
//! [`PostRates`]. A `--rates` file (a `kvx xfer --format json` report, or the JSON of
//! `scripts/gpu-check.sh`) is laid over the built-in rates, then single figures over that.
//!
//! Syntax: comma-separated `KEY=NUMBER`, keys `ucx`, `cuda-ipc`, `cuda-batch` (and, for
//! `--post-ns` only, `cuda-batch-call`: the fixed cost of one batched call). Each key at most
//! once; every error names the flag.

use super::parse::one_of;
use crate::error::ConfigError;
use crate::layouts::posting::{PostPath, PostRates, RateSource};

/// `--rates`' help, one text for every command that takes it (`kvx plan`, `kvx bench`).
pub const RATES_HELP: &str = "A rates file: one written by kvx calibrate, whose fitted model predicts transfer times (kvx plan: each posting rank and the request's span; kvx bench: beside the measured ones, in the report and summary.json's prediction); for kvx plan's posting table also a kvx xfer --format json report (UCX on host or device memory, or --transport cuda-batch) or the JSON that scripts/gpu-check.sh writes";

/// Most nanoseconds one descriptor or call may be said to cost (one second).
const MAX_NS: f64 = 1e9;
/// Highest bandwidth ceiling accepted, GB/s.
const MAX_GBPS: f64 = 1e5;
/// Smallest cost or ceiling accepted (1 ps per descriptor, 1 MB/s): a smaller one, down to
/// 1e-320, would print transfer times of "inf s".
const MIN_VALUE: f64 = 1e-3;
const CALL_KEY: &str = "cuda-batch-call";

/// The built-in rates with the given measurements in their place.
pub fn resolve_rates(
    rates_file: Option<&std::path::Path>,
    post_ns: &[String],
    ceiling_gbps: &[String],
) -> Result<PostRates, ConfigError> {
    let mut rates = PostRates::default();
    if let Some(path) = rates_file {
        let name = path.display().to_string();
        let text = crate::input::read_text(path)
            .map_err(|e| ConfigError::new("--rates", format!("cannot read {name}: {e}")))?;
        crate::layouts::rates::apply(&name, &text, &mut rates).map_err(|e| ConfigError::new("--rates", e))?;
    }
    let post_keys: Vec<&str> = PostPath::ALL.iter().map(|p| p.key()).chain([CALL_KEY]).collect();
    for (key, v) in entries("--post-ns", post_ns, &post_keys, MAX_NS, "nanoseconds")? {
        match PostPath::ALL.iter().find(|p| p.key() == key) {
            Some(&path) => {
                let r = rates.of_mut(path);
                r.ns_per_descriptor = v;
                r.post_source = RateSource::User;
            }
            None => {
                rates.cuda_batch.ns_per_call = v;
                rates.cuda_batch.post_source = RateSource::User;
            }
        }
    }
    let ceiling_keys: Vec<&str> = PostPath::ALL.iter().map(|p| p.key()).collect();
    for (key, v) in entries("--ceiling-gbps", ceiling_gbps, &ceiling_keys, MAX_GBPS, "GB/s")? {
        if let Some(&path) = PostPath::ALL.iter().find(|p| p.key() == key) {
            let r = rates.of_mut(path);
            r.ceiling_gbps = v;
            r.ceiling_source = RateSource::User;
        }
    }
    Ok(rates)
}

/// `KEY=NUMBER` entries, each key once, numbers in `(0, max]`.
fn entries<'a>(
    flag: &str,
    items: &'a [String],
    keys: &[&str],
    max: f64,
    unit: &str,
) -> Result<Vec<(&'a str, f64)>, ConfigError> {
    let mut out: Vec<(&str, f64)> = Vec::new();
    for item in items.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let (key, value) = item.split_once('=').map(|(k, v)| (k.trim(), v.trim())).ok_or_else(|| {
            ConfigError::new(
                flag,
                format!("'{item}' is not KEY=NUMBER (keys: {})", one_of(keys.iter().copied())),
            )
        })?;
        if !keys.contains(&key) {
            return Err(ConfigError::new(flag, format!("'{key}' is not {}", one_of(keys.iter().copied()))));
        }
        if out.iter().any(|(k, _)| *k == key) {
            return Err(ConfigError::new(flag, format!("'{key}' is given twice")));
        }
        let v: f64 =
            value.parse().ok().filter(|v: &f64| v.is_finite() && (MIN_VALUE..=max).contains(v)).ok_or_else(
                || {
                    ConfigError::new(
                        flag,
                        format!("{key}={value}: give a number of {unit} from {MIN_VALUE} up to {max}"),
                    )
                },
            )?;
        out.push((key, v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(s: &str) -> Vec<String> {
        s.split(',').map(str::to_string).collect()
    }

    #[test]
    fn measured_rates_replace_the_defaults_and_say_so() {
        let r = resolve_rates(
            None,
            &list("ucx=80,cuda-ipc=5000,cuda-batch=90,cuda-batch-call=7000"),
            &list("cuda-batch=900"),
        )
        .expect("valid");
        assert_eq!(r.ucx.ns_per_descriptor, 80.0);
        assert_eq!(r.cuda_ipc.ns_per_descriptor, 5000.0);
        assert_eq!((r.cuda_batch.ns_per_descriptor, r.cuda_batch.ns_per_call), (90.0, 7000.0));
        assert_eq!(r.cuda_batch.post_source, RateSource::User);
        assert_eq!(r.cuda_batch.ceiling_gbps, 900.0);
        assert_eq!(r.cuda_batch.ceiling_source, RateSource::User);
        // What was not given keeps its default and its source.
        assert_eq!(r.cuda_ipc.ceiling_gbps, PostRates::default().cuda_ipc.ceiling_gbps);
        assert!(matches!(r.cuda_ipc.ceiling_source, RateSource::File { .. }));
        assert_eq!(resolve_rates(None, &[], &[]).expect("defaults"), PostRates::default());
    }

    #[test]
    fn a_rates_file_replaces_what_it_measured_and_names_itself() {
        let dir = tempfile::tempdir().expect("tmp");
        let f = dir.path().join("xfer.json");
        std::fs::write(
            &f,
            r#"{"memory": {"kind": "host"}, "transport": "ucx", "results": [{"size_bytes": 8192, "inflight": 64, "post_us": 6.4, "gbps": 2.0}]}"#,
        )
        .expect("write");
        let r = resolve_rates(Some(&f), &[], &list("ucx=9")).expect("valid");
        assert!((r.ucx.ns_per_descriptor - 100.0).abs() < 1e-9);
        assert!(
            r.ucx.post_source.text().starts_with(&f.display().to_string()),
            "{}",
            r.ucx.post_source.text()
        );
        assert_eq!(
            (r.ucx.ceiling_gbps, &r.ucx.ceiling_source),
            (9.0, &RateSource::User),
            "flags win over the file"
        );
        assert_eq!(r.cuda_batch, PostRates::default().cuda_batch, "what the file lacks stays built in");
        let e = resolve_rates(Some(&dir.path().join("none.json")), &[], &[]).expect_err("missing");
        assert_eq!(e.flag, "--rates");
        std::fs::write(&f, "{}").expect("write");
        let e = resolve_rates(Some(&f), &[], &[]).expect_err("no rates");
        assert!(e.reason.contains("no kvx xfer report"), "{}", e.reason);
    }

    #[test]
    fn bad_rates_name_the_flag_and_the_problem() {
        let cases = [
            (
                list("nccl=5"),
                vec![],
                "--post-ns",
                "'nccl' is not ucx, cuda-ipc, cuda-batch or cuda-batch-call",
            ),
            (list("ucx"), vec![], "--post-ns", "not KEY=NUMBER"),
            (list("ucx=-1"), vec![], "--post-ns", "from 0.001"),
            (list("ucx=NaN"), vec![], "--post-ns", "from 0.001"),
            (list("ucx=1,ucx=2"), vec![], "--post-ns", "twice"),
            (vec![], list("cuda-batch-call=5"), "--ceiling-gbps", "is not ucx, cuda-ipc or cuda-batch"),
            (vec![], list("cuda-ipc=1e9"), "--ceiling-gbps", "up to"),
            (vec![], list("ucx=1e-320"), "--ceiling-gbps", "from 0.001"),
            (vec![], list("ucx=1e308"), "--ceiling-gbps", "up to"),
            (list("ucx=1e-320"), vec![], "--post-ns", "from 0.001"),
        ];
        for (post, ceiling, flag, why) in cases {
            let e = resolve_rates(None, &post, &ceiling).expect_err(why);
            assert_eq!(e.flag, flag, "{e:?}");
            assert!(e.reason.contains(why), "{}: {}", why, e.reason);
        }
    }
}
