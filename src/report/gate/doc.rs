//! A summary document handed to the gate ([`Doc`]: its JSON and where it came from, for
//! messages) and dotted paths into one (`stages.e2e.p50_us`).

use std::path::Path;

use serde_json::Value;

/// A document to compare, with where it came from (for messages).
#[derive(Debug, Clone, Copy)]
pub struct Doc<'a> {
    pub path: &'a Path,
    pub value: &'a Value,
}

pub(super) fn lookup<'v>(doc: &'v Value, path: &str) -> Option<&'v Value> {
    path.split('.').try_fold(doc, |v, part| v.get(part))
}

pub(super) fn lookup_f64(doc: &Value, path: &str) -> Option<f64> {
    lookup(doc, path)?.as_f64().filter(|x| x.is_finite())
}
