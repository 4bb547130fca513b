//! The compatibility hash both sides of a handshake compare before anything else.
//!
//! vLLM hashes a small set of configuration factors as
//! `sha256(json.dumps(factors, sort_keys=True))` and refuses a peer whose hash differs.
//! kvx reproduces that byte for byte (Python's default separators `", "` and `": "`,
//! `ensure_ascii` escaping and Python's float `repr`), so it can compute the hash a vLLM
//! engine advertises, and it also ships its own factors inside its metadata so that a
//! mismatch can be explained factor by factor instead of by two opaque hex strings.
//!
//! Owns: factor sets, canonical JSON, the hash, factor diffs. Must not know about sockets.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A named set of configuration factors, hashed as vLLM hashes its own.
///
/// Keys are kept sorted (Python's `sort_keys=True` orders by code point, which is the
/// byte order of UTF-8, i.e. `String`'s `Ord`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CompatFactors(BTreeMap<String, Value>);

/// The model and engine factors every vLLM version's compatibility hash takes.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmModelFactors {
    pub vllm_version: String,
    pub nixl_connector_version: u64,
    pub model: String,
    /// As Python prints a torch dtype, e.g. `torch.bfloat16`.
    pub dtype: String,
    /// Total KV heads of the model, not per rank.
    pub num_kv_heads: u64,
    pub head_size: u64,
    pub num_hidden_layers: u64,
    pub attn_backend_name: String,
    pub cache_dtype: String,
}

/// Inputs of vLLM 0.33's `compute_nixl_compatibility_hash`.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmFactorsV033 {
    pub common: VllmModelFactors,
    pub is_hma_enabled: bool,
    /// `None` hashes as JSON `null`, as vLLM does without speculative decoding.
    pub speculative_config: Option<Value>,
    /// `pull` or `push`.
    pub transfer_mode: String,
}

/// Inputs of vLLM 0.19.1's compatibility hash (`cross_layers_blocks` instead of
/// `speculative_config` and `transfer_mode`).
#[derive(Debug, Clone, PartialEq)]
pub struct VllmFactorsV019 {
    pub common: VllmModelFactors,
    pub cross_layers_blocks: bool,
    pub is_hma_enabled: bool,
}

/// What kvx engines hash. Like vLLM, TP size, block size and the exact layout are left
/// out on purpose: they may differ between P and D and are validated by the planning
/// core's rules after the handshake, with its own messages.
#[derive(Debug, Clone, PartialEq)]
pub struct KvxFactors {
    /// Version of kvx's metadata format (see `KVX_METADATA_FORMAT`).
    pub kvx_format_version: u32,
    pub model: String,
    pub dtype: String,
    pub num_kv_heads: u64,
    pub head_size: u64,
    pub num_hidden_layers: u64,
    pub cache_dtype: String,
    /// Which family of layouts the engine speaks, e.g. `v0.33` (K‖V packed) or
    /// `classic` (0.19's separate K and V regions); layouts of one family interoperate.
    pub layout_family: String,
    /// `pull` (D reads) is the only mode kvx implements.
    pub transfer_mode: String,
}

/// One factor that differs between two factor sets (`None`: absent on that side).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FactorDiff {
    pub name: String,
    pub local: Option<Value>,
    pub remote: Option<Value>,
}

impl fmt::Display for FactorDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<Value>| match v {
            Some(v) => v.to_string(),
            None => "(absent)".to_owned(),
        };
        write!(f, "{} (local {}, remote {})", self.name, show(&self.local), show(&self.remote))
    }
}

/// Factor JSON that is not a flat object of JSON values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("compatibility factors are not a JSON object: {reason}")]
pub struct FactorsParseError {
    pub reason: String,
}

impl CompatFactors {
    /// An empty set; add factors with [`CompatFactors::with`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) one factor.
    #[must_use]
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.0.insert(name.into(), value.into());
        self
    }

    /// The factors every vLLM version hashes.
    fn vllm_common(f: &VllmModelFactors) -> Self {
        Self::new()
            .with("vllm_version", f.vllm_version.as_str())
            .with("nixl_connector_version", f.nixl_connector_version)
            .with("model", f.model.as_str())
            .with("dtype", f.dtype.as_str())
            .with("num_kv_heads", f.num_kv_heads)
            .with("head_size", f.head_size)
            .with("num_hidden_layers", f.num_hidden_layers)
            .with("attn_backend_name", f.attn_backend_name.as_str())
            .with("cache_dtype", f.cache_dtype.as_str())
    }

    pub fn vllm_v0_33(f: &VllmFactorsV033) -> Self {
        Self::vllm_common(&f.common)
            .with("is_hma_enabled", f.is_hma_enabled)
            .with("speculative_config", f.speculative_config.clone().unwrap_or(Value::Null))
            .with("transfer_mode", f.transfer_mode.as_str())
    }

    pub fn vllm_v0_19(f: &VllmFactorsV019) -> Self {
        Self::vllm_common(&f.common)
            .with("cross_layers_blocks", f.cross_layers_blocks)
            .with("is_hma_enabled", f.is_hma_enabled)
    }

    pub fn kvx(f: &KvxFactors) -> Self {
        Self::new()
            .with("kvx_format_version", f.kvx_format_version)
            .with("model", f.model.as_str())
            .with("dtype", f.dtype.as_str())
            .with("num_kv_heads", f.num_kv_heads)
            .with("head_size", f.head_size)
            .with("num_hidden_layers", f.num_hidden_layers)
            .with("cache_dtype", f.cache_dtype.as_str())
            .with("layout_family", f.layout_family.as_str())
            .with("transfer_mode", f.transfer_mode.as_str())
    }

    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `json.dumps(factors, sort_keys=True)` exactly as CPython prints it.
    pub fn canonical_json(&self) -> String {
        let mut out = String::new();
        write_object(&mut out, &self.0);
        out
    }

    /// Lower-case hex SHA-256 of [`CompatFactors::canonical_json`].
    pub fn hash_hex(&self) -> String {
        hex::encode(Sha256::digest(self.canonical_json().as_bytes()))
    }

    /// Parses factors from JSON (canonical or not); the inverse of `canonical_json`.
    pub fn from_json(text: &str) -> Result<Self, FactorsParseError> {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => Ok(Self(map.into_iter().collect())),
            Ok(other) => Err(FactorsParseError { reason: format!("found {}", json_kind(&other)) }),
            Err(e) => Err(FactorsParseError { reason: e.to_string() }),
        }
    }
}

/// Factors that differ between `local` and `remote`, in name order; empty when equal.
pub fn diff(local: &CompatFactors, remote: &CompatFactors) -> Vec<FactorDiff> {
    let names: std::collections::BTreeSet<&String> = local.0.keys().chain(remote.0.keys()).collect();
    names
        .into_iter()
        .filter_map(|name| {
            let (l, r) = (local.0.get(name), remote.0.get(name));
            // Compare as the hash sees them: 1 and 1.0 print differently, so they differ.
            let same = match (l, r) {
                (Some(a), Some(b)) => canonical_value(a) == canonical_value(b),
                (None, None) => true,
                _ => false,
            };
            (!same).then(|| FactorDiff { name: name.clone(), local: l.cloned(), remote: r.cloned() })
        })
        .collect()
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn canonical_value(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v);
    out
}

fn write_object<'a>(out: &mut String, entries: impl IntoIterator<Item = (&'a String, &'a Value)>) {
    let mut sorted: Vec<(&String, &Value)> = entries.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    out.push('{');
    for (i, (k, v)) in sorted.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_string(out, k);
        out.push_str(": ");
        write_value(out, v);
    }
    out.push('}');
}

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                let _ = write!(out, "{u}");
            } else if let Some(i) = n.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Some(f) = n.as_f64() {
                out.push_str(&python_float_repr(f));
            }
        }
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => write_object(out, map),
    }
}

/// Python's `ensure_ascii=True` string encoding: everything outside printable ASCII is
/// escaped, non-BMP characters as UTF-16 surrogate pairs, hex in lower case.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// CPython's `float.__repr__`: shortest round-trip digits, positional notation when the
/// decimal exponent is in [-4, 16), scientific (`1e+16`, `1e-05`) otherwise.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // Rust's `{:e}` also prints the shortest round-trip digits: "d[.ddd]e<exp>".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat(point.unsigned_abs() as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            let (int, frac) = digits.split_at(point as usize);
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn canonical_json_matches_python_for_floats() {
        let f = CompatFactors::new()
            .with("a", 1.0)
            .with("b", 1e16)
            .with("c", 1e-5)
            .with("d", 0.0001)
            .with("e", -0.0)
            .with("f", 123456789012345680.0)
            .with("g", 1e15)
            .with("h", 0.1)
            .with("i", 2.5e-7)
            .with("j", f64::MAX)
            .with("k", 5e-324);
        // Printed by CPython 3: json.dumps(..., sort_keys=True).
        let python = r#"{"a": 1.0, "b": 1e+16, "c": 1e-05, "d": 0.0001, "e": -0.0, "f": 1.2345678901234568e+17, "g": 1000000000000000.0, "h": 0.1, "i": 2.5e-07, "j": 1.7976931348623157e+308, "k": 5e-324}"#;
        assert_eq!(f.canonical_json(), python);
        assert_eq!(f.hash_hex(), "2b48b6776b39932594bd66a678c1a4acad88734125d7b23002e896540c56bf24");
    }

    #[test]
    fn canonical_json_matches_python_for_strings_nesting_and_ints() {
        let f = CompatFactors::new()
            .with("s", "caf\u{e9} \u{1F600} \"q\" \\ \n\t\u{1}\u{7f}/")
            .with("z", Value::Null)
            .with("t", true)
            .with("n", json!([1, {"b": 2, "a": []}]))
            .with("neg", -42)
            .with("big", u64::MAX);
        let python = r#"{"big": 18446744073709551615, "n": [1, {"a": [], "b": 2}], "neg": -42, "s": "caf\u00e9 \ud83d\ude00 \"q\" \\ \n\t\u0001\u007f/", "t": true, "z": null}"#;
        assert_eq!(f.canonical_json(), python);
        assert_eq!(f.hash_hex(), "d6e94c5923010b094965e3012c04a33a2e78463e5c19fe6d797c689805cc50a1");
    }

    #[test]
    fn float_repr_edges() {
        assert_eq!(python_float_repr(0.0), "0.0");
        assert_eq!(python_float_repr(-1.5), "-1.5");
        assert_eq!(python_float_repr(1234.5), "1234.5");
        assert_eq!(python_float_repr(1e-4), "0.0001");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(1e100), "1e+100");
        assert_eq!(python_float_repr(f64::INFINITY), "Infinity");
    }

    #[test]
    fn json_round_trip_keeps_the_hash() {
        let f = CompatFactors::new().with("x", 1.25).with("y", "é").with("z", json!({"k": [true, null]}));
        let back = CompatFactors::from_json(&f.canonical_json()).expect("parses");
        assert_eq!(back.hash_hex(), f.hash_hex());
        assert!(CompatFactors::from_json("[1]").is_err());
        assert!(CompatFactors::from_json("{").is_err());
    }

    #[test]
    fn diff_names_each_differing_factor() {
        let a = CompatFactors::new().with("dtype", "torch.bfloat16").with("heads", 8).with("only_a", 1);
        let b = CompatFactors::new().with("dtype", "torch.float16").with("heads", 8).with("only_b", 2);
        let d = diff(&a, &b);
        let names: Vec<&str> = d.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["dtype", "only_a", "only_b"]);
        assert_eq!(d[0].local, Some(json!("torch.bfloat16")));
        assert_eq!(d[0].remote, Some(json!("torch.float16")));
        assert_eq!(d[1].remote, None);
        assert_eq!(d[2].local, None);
        assert_eq!(d[0].to_string(), r#"dtype (local "torch.bfloat16", remote "torch.float16")"#);
        assert!(diff(&a, &a).is_empty());
        // The hash distinguishes 1 from 1.0, so the diff does too.
        assert_eq!(diff(&CompatFactors::new().with("x", 1), &CompatFactors::new().with("x", 1.0)).len(), 1);
    }
}
