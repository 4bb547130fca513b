//! Parsers of the value syntaxes flags and bench-config files share: durations, sizes and
//! named choices. They return the reason as a string; the caller names the flag or key. The `opt_*`
//! functions read the same syntaxes from a config file (serde's `deserialize_with`), so a key
//! takes exactly what its flag takes: a choice is spelled as its flag's values (clap's
//! `ValueEnum`), a duration as `--timeout` takes it.

use std::str::FromStr;
use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Deserializer};

use crate::config::bench::{MAX_PROMPT, PromptLens};
use crate::error::ConfigError;

/// Most runtime worker threads a serving or load process takes (`--threads`): far past any
/// machine's cores, far below what spawning costs before the process can serve.
pub const MAX_THREADS: usize = 1024;

/// `--threads N`: 1 to [`MAX_THREADS`], refused at parse time (before a runtime is built for it).
pub fn parse_threads(s: &str) -> Result<usize, String> {
    let n: u128 = s.trim().parse().map_err(|_| format!("{s:?} is not a thread count"))?;
    match usize::try_from(n) {
        Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!("{n} threads: give 1 to {MAX_THREADS} (the runtime's worker threads)")),
    }
}

/// What [`parse_duration`] takes, for its errors.
pub const DURATION_UNITS: &str = "units: ns, us, ms, s, m; a bare number is seconds";

/// Parses `250ns`, `200us`, `200ms`, `1s`, `1.5s`, `2m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 =
        num.parse().map_err(|_| format!("{s:?} is not a duration like 200ms or 2s ({DURATION_UNITS})"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        "ns" => n / 1e9,
        "m" | "min" => n * 60.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?} ({DURATION_UNITS})")),
    };
    if !secs.is_finite() || !(0.0..=1e7).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Longest time any flag takes, in seconds (about 116 days): what `parse_duration` accepts.
pub const MAX_SECONDS: f64 = 1e7;

/// A flag given in seconds (a number): finite, at least a nanosecond and at most [`MAX_SECONDS`], as a
/// `Duration` (a larger one would overflow it, and no run waits that long on purpose).
pub fn seconds(flag: &str, v: f64) -> Result<Duration, crate::error::ConfigError> {
    // Below a nanosecond a Duration is zero: no wait at all, which no flag means.
    if v.is_finite() && (1e-9..=MAX_SECONDS).contains(&v) {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(crate::error::ConfigError::new(
            flag,
            format!("must be > 0 and at most {MAX_SECONDS:e} seconds, got {v:e}"),
        ))
    }
}

/// Slowest and fastest open-loop arrival rate, requests per second: a slower one would put
/// its first request days away (and its gaps past what a `Duration` holds).
pub const RATE_RANGE: std::ops::RangeInclusive<f64> = 1e-3..=1e6;

/// An open-loop rate flag (`--rate`), checked against [`RATE_RANGE`].
pub fn rate(flag: &str, r: f64) -> Result<f64, crate::error::ConfigError> {
    if r.is_finite() && RATE_RANGE.contains(&r) {
        Ok(r)
    } else {
        Err(crate::error::ConfigError::new(
            flag,
            format!(
                "must be {:e} to {:e} requests per second, got {r:e}",
                RATE_RANGE.start(),
                RATE_RANGE.end()
            ),
        ))
    }
}

/// A request body limit (`--max-body-size`): from 1 KiB (an empty chat request fits) to 4 GiB.
pub fn body_limit(flag: &str, bytes: u64) -> Result<usize, crate::error::ConfigError> {
    match usize::try_from(bytes) {
        Ok(b) if (1 << 10..=4 << 30).contains(&bytes) => Ok(b),
        _ => Err(crate::error::ConfigError::new(
            flag,
            format!("must be between 1KiB and 4GiB, got {bytes} bytes"),
        )),
    }
}

/// Parses `64KiB`, `1MiB`, `4096`, `1M`, `2GB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size like 64KiB, 1MiB or 4096"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "k" | "KiB" | "Ki" => 1 << 10,
        "M" | "MiB" | "Mi" => 1 << 20,
        "G" | "GiB" | "Gi" => 1 << 30,
        "kB" | "KB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("unknown size unit {other:?} in {s:?} (use KiB, MiB, GiB)")),
    };
    n.checked_mul(mult).filter(|&v| v > 0).ok_or_else(|| format!("{s:?} must be between 1 byte and 16 EiB"))
}

/// The value of a choice (a clap `ValueEnum`) named `name`, as its flag spells it (aliases
/// included); the error lists the names: `'x' is not a, b or c`.
pub fn named<T: ValueEnum>(name: &str) -> Result<T, String> {
    let name = name.trim();
    T::value_variants()
        .iter()
        .find(|v| v.to_possible_value().is_some_and(|p| p.matches(name, false)))
        .cloned()
        .ok_or_else(|| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value())
                .filter(|p| !p.is_hide_set())
                .map(|p| p.get_name().to_string())
                .collect();
            format!("'{name}' is not {}", one_of(names.iter().map(String::as_str)))
        })
}

/// A config file's choice (`verify = "full"`), spelled as its flag's values.
pub fn opt_choice<'de, D: Deserializer<'de>, T: ValueEnum>(d: D) -> Result<Option<T>, D::Error> {
    let name = String::deserialize(d)?;
    named(&name).map(Some).map_err(serde::de::Error::custom)
}

/// A config file's list of choices (`transports = ["ucx", "storage"]`).
pub fn opt_choices<'de, D: Deserializer<'de>, T: ValueEnum>(d: D) -> Result<Option<Vec<T>>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    names.iter().map(|n| named(n)).collect::<Result<_, _>>().map(Some).map_err(serde::de::Error::custom)
}

/// A config file's value in its flag's own syntax (`FromStr`: `dtype = "bfloat16"`).
pub fn opt_parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr<Err = String>,
{
    let text = String::deserialize(d)?;
    text.parse().map(Some).map_err(serde::de::Error::custom)
}

/// A config file's duration (`lease = "10s"`), as the flags take it.
pub fn opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    parse_duration(&text).map(Some).map_err(serde::de::Error::custom)
}

/// A config file's value that may be written as a number or as text (`prompt_len = 512` or
/// `prompt_len = "1024..4096"`), as text.
pub fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Some(match toml::Value::deserialize(d)? {
        toml::Value::String(s) => s,
        other => other.to_string(),
    }))
}

/// `a`, `a or b`, `a, b or c`.
pub fn one_of<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    match names.split_last() {
        None => String::new(),
        Some((last, [])) => (*last).to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// `--prompt-len`: `N` or `A..B` tokens.
impl FromStr for PromptLens {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parse = |t: &str| -> Result<u32, String> {
            let n: u32 =
                t.trim().replace('_', "").parse().map_err(|_| format!("'{t}' is not a token count"))?;
            if n == 0 || n > MAX_PROMPT {
                return Err(format!("prompt length {n} is outside 1..={MAX_PROMPT}"));
            }
            Ok(n)
        };
        match s.split_once("..") {
            Some((a, b)) => {
                let (a, b) = (parse(a)?, parse(b.trim_start_matches('='))?);
                if a > b {
                    return Err(format!("range {a}..{b} is empty"));
                }
                Ok(if a == b { PromptLens::Fixed(a) } else { PromptLens::Uniform(a, b) })
            }
            None => Ok(PromptLens::Fixed(parse(s)?)),
        }
    }
}

/// `--prompt-lens FILE`: one length per line (blank lines and `#` comments skipped).
pub fn prompt_lens_file(path: &std::path::Path) -> Result<PromptLens, ConfigError> {
    let flag = "--prompt-lens";
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(flag, format!("cannot read {}: {e}", path.display())))?;
    let mut v = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.split('#').next().unwrap_or("").trim();
        if t.is_empty() {
            continue;
        }
        match t.parse::<PromptLens>() {
            Ok(PromptLens::Fixed(n)) => v.push(n),
            _ => {
                return Err(ConfigError::new(
                    flag,
                    format!(
                        "{} line {}: '{t}' is not a prompt length (1..={MAX_PROMPT})",
                        path.display(),
                        i + 1
                    ),
                ));
            }
        }
    }
    if v.is_empty() {
        return Err(ConfigError::new(flag, format!("{} has no prompt lengths", path.display())));
    }
    Ok(PromptLens::List(v))
}

#[cfg(test)]
mod tests {

    use proptest::prelude::*;

    proptest! {
        /// Any number given to a seconds or rate flag is a clear error or a value in range:
        /// never a panic (a Duration overflow), never out of range.
        #[test]
        fn numeric_flags_never_panic(v in prop_oneof![
            any::<f64>(),
            -1e12f64..1e12,
            Just(f64::MIN_POSITIVE), Just(1e-300), Just(1e300), Just(f64::NAN), Just(f64::INFINITY), Just(0.0), Just(-0.0),
        ]) {
            match seconds("--timeout", v) {
                Ok(d) => prop_assert!(d.as_secs_f64() > 0.0 && d.as_secs_f64() <= MAX_SECONDS),
                Err(e) => prop_assert!(e.to_string().contains("--timeout"), "{}", e),
            }
            match rate("--rate", v) {
                Ok(r) => prop_assert!(RATE_RANGE.contains(&r)),
                Err(e) => prop_assert!(e.to_string().contains("--rate"), "{}", e),
            }
            if let Ok(d) = parse_duration(&format!("{v}s")) {
                prop_assert!(d.as_secs_f64() <= 1e7);
            }
        }
    }
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1h").is_err());
        assert_eq!(parse_duration("250ns"), Ok(Duration::from_nanos(250)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("250"), Ok(Duration::from_secs(250)));
        let hint = parse_duration("5h").expect_err("hours");
        for unit in ["ns", "us", "ms", "s", "m", "bare number is seconds"] {
            assert!(hint.contains(unit), "{hint}");
        }
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("KiB").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }

    #[test]
    fn choices_name_the_alternatives() {
        use crate::transfer::ucx::ErrMode;
        use crate::vocab::kinds::VerifyMode;
        assert_eq!(named::<VerifyMode>("sample"), Ok(VerifyMode::Sample));
        assert_eq!(named::<VerifyMode>(" off "), Ok(VerifyMode::Off));
        assert_eq!(named::<VerifyMode>("maybe"), Err("'maybe' is not full, sample or off".to_string()));
        assert_eq!(named::<ErrMode>("x"), Err("'x' is not none or peer".to_string()));
        assert_eq!(one_of(["pull"]), "pull");
    }

    #[test]
    fn choices_of_a_value_enum_use_the_flag_s_spellings() {
        use crate::vocab::kinds::TransportKind;
        assert_eq!(named::<TransportKind>("cuda-batch"), Ok(TransportKind::CudaBatch));
        assert_eq!(named::<TransportKind>(" ucx "), Ok(TransportKind::Ucx));
        assert_eq!(
            named::<TransportKind>("nccl"),
            Err("'nccl' is not ucx, storage, multi, cuda-batch or nixl".to_string())
        );
    }
}
