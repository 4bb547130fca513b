//! What the gate checks about the runs themselves, not their metrics: the same work in both
//! (scenario keys that change it, [`work_differences`]: refused otherwise), a partial run
//! (refused without `--allow-partial`, [`refuse_partial`]), whether a run may become the
//! baseline ([`update_refusal`]), and the notes on what else differs (scenario, machine, UCX
//! transports).

use serde_json::Value;

use super::doc::{Doc, lookup};
use crate::report::summary::{Summary, display_value};

/// Scenario keys whose difference changes the work a run does, with the value a summary
/// written before the key existed meant (`None`: compared only when both runs have it).
const WORK_KEYS: &[(&str, Option<&str>)] = &[
    ("model", None),
    ("p_tp", None),
    ("d_tp", None),
    ("p_layout", None),
    ("d_layout", None),
    ("p_block_size", None),
    ("d_block_size", None),
    ("prompt_len", None),
    ("prefix_hit", None),
    ("alloc", None),
    ("requests", None),
    ("duration_s", None),
    ("concurrency", None),
    ("rate_rps", None),
    ("inflight", None),
    ("verify", None),
    ("transport", Some("ucx")),
    ("mem", Some("host")),
    ("mode", Some("pull")),
    ("coalesce", None),
    ("vllm_rules", None),
    ("progress", None),
    ("overlap", None),
    ("dispatch", None),
    ("rank_start", Some("free")),
];

/// `key baseline -> current` for each work-changing scenario key the runs disagree on.
pub(super) fn work_differences(baseline: &Value, current: &Value) -> Vec<String> {
    let show = |v: Option<&Value>| v.filter(|v| !v.is_null()).map_or_else(|| "-".into(), display_value);
    let mut out = Vec::new();
    for (key, old_default) in WORK_KEYS {
        let get = |doc: &Value| {
            doc.get("scenario")
                .and_then(|s| s.get(*key))
                .filter(|v| !v.is_null())
                .cloned()
                .or_else(|| old_default.map(|d| Value::String(d.to_string())))
        };
        let (b, c) = (get(baseline), get(current));
        if b.is_some() && c.is_some() && b != c {
            out.push(format!("{key} {} -> {}", show(b.as_ref()), show(c.as_ref())));
        }
    }
    out
}

/// A partial run offered to the gate without `--allow-partial`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {side} summary {} is a partial run (\"partial\": true): it was interrupted or failed \
     half-way, so it measured fewer requests than its scenario asks for and its figures are not a \
     whole run's; gate a run that finished, or pass --allow-partial to use it anyway",
    path.display()
)]
pub struct PartialRun {
    /// `baseline` or `current`.
    pub side: &'static str,
    pub path: std::path::PathBuf,
}

/// Refuses a summary marked `"partial": true`; the caller skips this under `--allow-partial`
/// (and `context_notes` then says the run is partial).
pub fn refuse_partial(side: &'static str, doc: Doc<'_>) -> Result<(), PartialRun> {
    if is_partial(doc.value) {
        return Err(PartialRun { side, path: doc.path.to_path_buf() });
    }
    Ok(())
}

/// True when a summary says it is partial.
pub fn is_partial(doc: &Value) -> bool {
    doc.get("partial").and_then(Value::as_bool) == Some(true)
}

/// Differences between the runs that a reader of the verdict should know about.
pub(crate) fn context_notes(baseline: &Value, current: &Value) -> Vec<String> {
    let mut notes = Vec::new();
    if is_partial(current) {
        notes.push("the current run is partial (it did not finish)".into());
    }
    if is_partial(baseline) {
        notes.push("the baseline is a partial run".into());
    }
    let empty = serde_json::Map::new();
    let obj =
        |v: &Value, k: &str| v.get(k).and_then(Value::as_object).cloned().unwrap_or_else(|| empty.clone());
    let (sb, sc) = (obj(baseline, "scenario"), obj(current, "scenario"));
    let keys: std::collections::BTreeSet<&String> = sb.keys().chain(sc.keys()).collect();
    let changed: Vec<String> = keys
        .into_iter()
        .filter(|k| sb.get(*k) != sc.get(*k))
        .map(|k| {
            let show =
                |v: Option<&Value>| v.filter(|v| !v.is_null()).map_or_else(|| "-".into(), display_value);
            format!("{k} {} -> {}", show(sb.get(k)), show(sc.get(k)))
        })
        .collect();
    if !changed.is_empty() {
        notes.push(format!("the scenario differs from the baseline's: {}", changed.join(", ")));
    }
    let (eb, ec) = (obj(baseline, "environment"), obj(current, "environment"));
    for k in ["hostname", "cpu_model", "cores"] {
        if eb.get(k).is_some() && ec.get(k).is_some() && eb.get(k) != ec.get(k) {
            notes.push(format!(
                "different machine: {k} {} -> {}",
                eb.get(k).map_or_else(String::new, display_value),
                ec.get(k).map_or_else(String::new, display_value)
            ));
        }
    }
    let transports = |v: &Value| lookup(v, "ucx.transports").cloned();
    if transports(baseline).is_some() && transports(baseline) != transports(current) {
        let show = |v: Option<Value>| v.map_or_else(String::new, |v| display_value(&v));
        notes.push(format!(
            "UCX selected other transports: {} -> {}",
            show(transports(baseline)),
            show(transports(current))
        ));
    }
    notes
}

/// Why a run must not become the baseline without `--force`, if it must not. A partial run is
/// not judged here: it needs `--allow-partial` ([`refuse_partial`]), not `--force`.
pub fn update_refusal(current: &Summary) -> Option<String> {
    let mut why = Vec::new();
    if current.requests_ok == 0 {
        why.push("it has no successful request".to_string());
    }
    if current.requests_failed > 0 {
        why.push(format!("{} requests failed", current.requests_failed));
    }
    if current.verify_failures > 0 {
        why.push(format!("{} verification failures", current.verify_failures));
    }
    if current.blocks_leaked > 0 {
        why.push(format!("{} blocks leaked", current.blocks_leaked));
    }
    (!why.is_empty()).then(|| format!("the current run is not a clean run: {}", why.join(", ")))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::report::gate::evaluate;
    use crate::report::gate::fixtures::{doc, gate, th};

    #[test]
    fn a_run_of_another_scenario_is_refused_not_passed() {
        let mut b = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        b["scenario"] = json!({"model": "llama-3.1-8b", "p_tp": 2, "d_tp": 1, "repeat": 14, "name": "ci"});
        for (key, value) in [
            ("model", json!("llama-3.1-70b")),
            ("p_tp", json!(4)),
            ("mode", json!("push")),
            ("transport", json!("storage")),
        ] {
            let mut c = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
            c["scenario"] = b["scenario"].clone();
            c["scenario"][key] = value;
            let e = evaluate(
                Doc { path: Path::new("b"), value: &b },
                Doc { path: Path::new("c"), value: &c },
                &th(),
            )
            .expect_err(key);
            assert!(e.to_string().contains(&format!("{key} ")), "{key}: {e}");
        }
        // What does not change the work (repeats, name, seed) and a key the baseline predates
        // at its old meaning (`mode` pull) still compare.
        let mut c = doc(&[10.0, 10.2, 9.9, 10.1, 9.8], 10.0);
        c["scenario"] = json!({"model": "llama-3.1-8b", "p_tp": 2, "d_tp": 1, "repeat": 7, "name": "other", "seed": 3, "mode": "pull"});
        assert!(
            evaluate(Doc { path: Path::new("b"), value: &b }, Doc { path: Path::new("c"), value: &c }, &th())
                .is_ok()
        );
    }

    #[test]
    fn scenario_and_machine_changes_that_keep_the_work_are_noted() {
        let mut b = doc(&[10.0], 10.0);
        let mut c = doc(&[10.0], 10.0);
        b["scenario"] = json!({"p_tp": 8, "seed": 1, "repeat": 14});
        c["scenario"] = json!({"p_tp": 8, "seed": 2, "repeat": 7});
        b["environment"] = json!({"hostname": "a"});
        c["environment"] = json!({"hostname": "b"});
        let r = gate(&b, &c);
        assert!(r.notes.iter().any(|n| n.contains("seed 1 -> 2")), "{:?}", r.notes);
        assert!(r.notes.iter().any(|n| n.contains("hostname a -> b")), "{:?}", r.notes);
    }

    #[test]
    fn update_is_refused_for_unclean_runs() {
        let mut s = Summary::new("r", "t", Default::default());
        assert!(update_refusal(&s).is_some_and(|w| w.contains("no successful request")));
        s.requests_ok = 10;
        assert_eq!(update_refusal(&s), None);
        // Partial is --allow-partial's business (refuse_partial), not --force's.
        s.partial = true;
        assert_eq!(update_refusal(&s), None);
        s.verify_failures = 2;
        let why = update_refusal(&s).expect("refused");
        assert!(why.contains("2 verification failures") && !why.contains("partial"), "{why}");
    }

    #[test]
    fn partial_runs_are_refused_naming_the_file_and_the_flag() {
        let mut d = doc(&[10.0], 10.0);
        assert_eq!(refuse_partial("current", Doc { path: Path::new("c.json"), value: &d }), Ok(()));
        d["partial"] = json!(false);
        assert_eq!(refuse_partial("current", Doc { path: Path::new("c.json"), value: &d }), Ok(()));
        d["partial"] = json!(true);
        let e = refuse_partial("baseline", Doc { path: Path::new("dir/b.json"), value: &d })
            .expect_err("partial");
        assert_eq!(e.side, "baseline");
        let text = e.to_string();
        assert!(text.starts_with("the baseline summary dir/b.json is a partial run"), "{text}");
        assert!(text.contains("fewer requests") && text.contains("--allow-partial"), "{text}");
        // Allowed, it is judged, with a note.
        let r = gate(&d, &doc(&[10.0], 10.0));
        assert!(r.notes.iter().any(|n| n == "the baseline is a partial run"), "{:?}", r.notes);
    }
}
