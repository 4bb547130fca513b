//! Parsers of the value syntaxes flags and bench-config files share: durations and named
//! choices. They return the reason as a string; the caller names the flag or key.

use std::time::Duration;

/// Parses `200ms`, `1s`, `1.5s`, `2m`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration like 200ms or 2s"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        "m" | "min" => n * 60.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?} (use ms, s, m)")),
    };
    if !secs.is_finite() || !(0.0..=1e7).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The value named `name` among `choices`; the error lists the names: `'x' is not a, b or c`.
pub fn choice<T: Copy>(name: &str, choices: &[(&str, T)]) -> Result<T, String> {
    let name = name.trim();
    choices
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, v)| v)
        .ok_or_else(|| format!("'{name}' is not {}", one_of(choices.iter().map(|(n, _)| *n))))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("200ms"), Ok(Duration::from_millis(200)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1h").is_err());
    }

    #[test]
    fn choices_name_the_alternatives() {
        let c = [("full", 1), ("sample", 2), ("off", 3)];
        assert_eq!(choice("sample", &c), Ok(2));
        assert_eq!(choice(" off ", &c), Ok(3));
        assert_eq!(choice("maybe", &c), Err("'maybe' is not full, sample or off".to_string()));
        assert_eq!(choice("x", &[("none", 0), ("peer", 1)]), Err("'x' is not none or peer".to_string()));
        assert_eq!(one_of(["pull"]), "pull");
    }
}
