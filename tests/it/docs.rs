//! Every figure in README.md and docs/ comes from a committed results file.
//!
//! A measured figure stands in a marker naming its source, and this test recomputes it:
//!
//! - inline: `<!--fig FILE#PATH FMT-->5.27<!--/fig-->`, or a ratio of two sources
//!   `<!--fig FILE#PATH / FILE#PATH FMT-->1.03x<!--/fig-->`. `FILE` is relative to the
//!   repository; `PATH` walks the JSON (`stages.e2e.p50_us`, `repeats.0.throughput_gbps`,
//!   `results[size_bytes=8192].gbps`: the first element whose field has that value). `FMT` is
//!   `[*SCALE][,]DIGITS[x|%]`: multiply by SCALE, thousands separators, DIGITS decimals, then
//!   an `x` (ratios) or a percentage (`%`: times 100).
//! - block: a line `<!--figs FILE-->` (or `<!--figs FILE lines=A-B-->`), then a fenced block
//!   whose lines (after an optional first `$ command` line) are FILE's, then `<!--/figs-->`:
//!   sample output shown as it was printed.
//!
//! Outside markers, code spans and fenced blocks, a number with a unit of measurement (GB/s,
//! MB/s, ms, us, ns, a ratio such as `1.5x`, a percentage) fails the test: it would be a figure
//! typed by hand. A setting or an outside fact that reads like one is wrapped in
//! `<!--given-->...<!--/given-->`. Fenced blocks are not scanned: sample output of measured
//! runs goes in a `figs` block; deterministic output (`kvx topo`, `layout`, `plan`) may stand.
//!
//! `scripts/docs-figures.sh` (`KVX_DOCS_UPDATE=1`) rewrites each marker's text from its source
//! instead of failing, after `scripts/docs-runs.sh` measured again.

use std::path::PathBuf;

use regex::Regex;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The documents the rule covers: README.md and every Markdown file under docs/.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// A number format: `[*SCALE][,]DIGITS[x|%]`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Format {
    scale: f64,
    thousands: bool,
    digits: usize,
    suffix: Option<char>,
}

fn parse_format(f: &str) -> Result<Format, String> {
    let mut rest = f;
    let mut scale = 1.0;
    if let Some(r) = rest.strip_prefix('*') {
        let end =
            r.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '-')).unwrap_or(r.len());
        scale = r[..end].parse().map_err(|e| format!("scale in `{f}`: {e}"))?;
        rest = &r[end..];
    }
    let thousands = rest.starts_with(',');
    rest = rest.trim_start_matches(',');
    let suffix = rest.chars().last().filter(|c| *c == 'x' || *c == '%');
    if suffix.is_some() {
        rest = &rest[..rest.len() - 1];
    }
    let digits = rest.parse().map_err(|e| format!("digits in `{f}`: {e}"))?;
    Ok(Format { scale, thousands, digits, suffix })
}

fn render(v: f64, f: Format) -> String {
    let v = v * f.scale * if f.suffix == Some('%') { 100.0 } else { 1.0 };
    let mut s = format!("{v:.*}", f.digits);
    if f.thousands {
        let (int, frac) =
            s.split_once('.').map_or((s.clone(), None), |(i, d)| (i.to_string(), Some(d.to_string())));
        let (sign, digits) = int.strip_prefix('-').map_or(("", int.as_str()), |d| ("-", d));
        let mut grouped = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                grouped.push(',');
            }
            grouped.push(c);
        }
        s = format!("{sign}{grouped}{}", frac.map_or(String::new(), |d| format!(".{d}")));
    }
    if let Some(c) = f.suffix {
        s.push(c);
    }
    s
}

/// `a.b.0.c[k=v].d` into a JSON value.
fn walk<'v>(v: &'v Value, path: &str) -> Result<&'v Value, String> {
    let mut cur = v;
    let seg = Regex::new(r"^([^.\[]+)(?:\[([^=\]]+)=([^\]]+)\])?$").expect("regex");
    for part in path.split('.') {
        let c = seg.captures(part).ok_or_else(|| format!("bad path segment `{part}` in `{path}`"))?;
        let key = &c[1];
        cur = match cur {
            Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get(i)),
            Value::Object(o) => o.get(key),
            _ => None,
        }
        .ok_or_else(|| format!("`{key}` not found (path `{path}`)"))?;
        if let (Some(k), Some(want)) = (c.get(2), c.get(3)) {
            let items = cur.as_array().ok_or_else(|| format!("`{key}` is not a list (path `{path}`)"))?;
            cur = items
                .iter()
                .find(|it| match &it[k.as_str()] {
                    Value::String(s) => s == want.as_str(),
                    other => {
                        other.as_f64().is_some_and(|x| want.as_str().parse::<f64>().is_ok_and(|w| w == x))
                    }
                })
                .ok_or_else(|| {
                    format!("no element of `{key}` with {}={} (path `{path}`)", k.as_str(), want.as_str())
                })?;
        }
    }
    Ok(cur)
}

fn number(src: &str) -> Result<f64, String> {
    let (file, path) = src.split_once('#').ok_or_else(|| format!("`{src}` names no #PATH"))?;
    let text = std::fs::read_to_string(root().join(file)).map_err(|e| format!("{file}: {e}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{file}: {e}"))?;
    walk(&v, path)?.as_f64().ok_or_else(|| format!("{src} is not a number"))
}

/// The text a `fig` marker's spec gives.
fn figure(spec: &str) -> Result<String, String> {
    let words: Vec<&str> = spec.split_whitespace().collect();
    let (value, fmt) = match words.as_slice() {
        [a, f] => (number(a)?, f),
        [a, "/", b, f] => {
            let d = number(b)?;
            if d == 0.0 {
                return Err(format!("{b} is 0"));
            }
            (number(a)? / d, f)
        }
        _ => return Err(format!("`{spec}`: expected `FILE#PATH FMT` or `FILE#PATH / FILE#PATH FMT`")),
    };
    Ok(render(value, parse_format(fmt)?))
}

/// The lines a `figs` marker's spec gives: `FILE`, or `FILE lines=A-B` (1-based, inclusive),
/// trailing spaces trimmed.
fn block(spec: &str) -> Result<String, String> {
    let (file, range) = match spec.split_once(" lines=") {
        Some((f, r)) => {
            let (a, b) = r.trim().split_once('-').ok_or_else(|| format!("`lines={r}` is not A-B"))?;
            let n = |x: &str| x.parse::<usize>().map_err(|e| format!("`lines={r}`: {e}"));
            (f.trim(), Some((n(a)?, n(b)?)))
        }
        None => (spec, None),
    };
    let text = std::fs::read_to_string(root().join(file)).map_err(|e| format!("{file}: {e}"))?;
    let lines: Vec<&str> = text.lines().collect();
    let (a, b) = range.unwrap_or((1, lines.len()));
    if a == 0 || a > b || b > lines.len() {
        return Err(format!("{file} has {} lines; lines={a}-{b} is outside it", lines.len()));
    }
    Ok(lines[a - 1..b].iter().map(|l| format!("{}\n", l.trim_end())).collect())
}

/// What a document should read, and every problem found on the way.
fn expected(doc: &str) -> (String, Vec<String>) {
    let mut problems = Vec::new();
    let fig = Regex::new(r"(?s)<!--fig ([^>]*?)-->(.*?)<!--/fig-->").expect("regex");
    let text = fig
        .replace_all(doc, |c: &regex::Captures<'_>| match figure(&c[1]) {
            Ok(t) => format!("<!--fig {}-->{t}<!--/fig-->", &c[1]),
            Err(e) => {
                problems.push(format!("fig {}: {e}", &c[1]));
                c[0].to_string()
            }
        })
        .into_owned();
    let figs = Regex::new(r"(?s)<!--figs ([^>]*?)-->\n(```[^\n]*\n)(\$ [^\n]*\n)?(.*?)```\n<!--/figs-->")
        .expect("regex");
    let text = figs
        .replace_all(&text, |c: &regex::Captures<'_>| {
            let spec = c[1].trim();
            match block(spec) {
                Ok(body) => {
                    let cmd = c.get(3).map_or("", |m| m.as_str());
                    format!("<!--figs {spec}-->\n{}{cmd}{body}```\n<!--/figs-->", &c[2])
                }
                Err(e) => {
                    problems.push(format!("figs {spec}: {e}"));
                    c[0].to_string()
                }
            }
        })
        .into_owned();
    (text, problems)
}

/// Numbers with a unit of measurement in prose: outside markers, code spans and fences.
fn unsourced(doc: &str) -> Vec<String> {
    let strip = [
        r"(?s)```.*?```",
        r"(?s)<!--fig [^>]*?-->.*?<!--/fig-->",
        r"(?s)<!--given-->.*?<!--/given-->",
        r"`[^`]*`",
        r"(?s)<!--.*?-->",
    ];
    let mut prose = doc.to_string();
    for re in strip {
        // Keep the line count, so findings point at their line.
        prose = Regex::new(re)
            .expect("regex")
            .replace_all(&prose, |c: &regex::Captures<'_>| "\n".repeat(c[0].matches('\n').count()))
            .into_owned();
    }
    let measured = Regex::new(
        r"(?:^|[^\w.,/])(\d[\d,]*(?:\.\d+)?(?:\s?(?:GB/s|MB/s|TB/s|Gb/s|ms|us|µs|ns)|x|%))(?:$|[^\w/])",
    )
    .expect("regex");
    prose
        .lines()
        .enumerate()
        .flat_map(|(i, line)| {
            measured
                .captures_iter(line)
                .map(move |c| format!("line {}: `{}` in: {}", i + 1, &c[1], line.trim()))
        })
        .collect()
}

#[test]
fn every_figure_in_the_docs_comes_from_a_committed_results_file() {
    let update = std::env::var_os("KVX_DOCS_UPDATE").is_some();
    let mut failures = Vec::new();
    for path in documents() {
        let name = path.strip_prefix(root()).unwrap_or(&path).display().to_string();
        let doc = std::fs::read_to_string(&path).expect("read doc");
        let (want, problems) = expected(&doc);
        failures.extend(problems.into_iter().map(|p| format!("{name}: {p}")));
        if want != doc {
            if update {
                std::fs::write(&path, &want).expect("write doc");
            } else {
                let diff: Vec<String> = doc
                    .lines()
                    .zip(want.lines())
                    .enumerate()
                    .filter(|(_, (a, b))| a != b)
                    .take(5)
                    .map(|(i, (a, b))| format!("  line {}:\n    is:       {a}\n    sourced:  {b}", i + 1))
                    .collect();
                failures.push(format!(
                    "{name}: figures differ from their sources (scripts/docs-figures.sh rewrites them):\n{}",
                    diff.join("\n")
                ));
            }
        }
        failures
            .extend(unsourced(&doc).into_iter().map(|u| format!("{name}: a figure without a source, {u}")));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_changed_digit_or_a_typed_figure_is_caught() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("r.json");
    std::fs::write(&file, r#"{"a": {"gbps": 5.274}, "list": [{"k": "x", "v": 2.0}]}"#).expect("write");
    let rel =
        file.strip_prefix(root()).map_or_else(|_| file.display().to_string(), |p| p.display().to_string());
    let good = format!("moved <!--fig {rel}#a.gbps 2-->5.27<!--/fig--> GB/s");
    assert_eq!(expected(&good), (good.clone(), vec![]));
    let changed = good.replace("5.27", "5.28");
    assert_eq!(
        expected(&changed).0,
        good,
        "one changed digit is restored from the source, so the test fails"
    );
    let ratio = format!("<!--fig {rel}#a.gbps / {rel}#list[k=x].v 2x-->2.64x<!--/fig-->");
    assert_eq!(expected(&ratio), (ratio.clone(), vec![]), "5.274 / 2.0 reads 2.64x");
    assert_eq!(figure(&format!("{rel}#a.gbps *1000,0")).as_deref(), Ok("5,274"));
    assert_eq!(figure(&format!("{rel}#list.0.v 1%")).as_deref(), Ok("200.0%"));
    assert!(figure(&format!("{rel}#a.nope 2")).is_err());
    assert!(unsourced("push moved 5.27 GB/s, 1.03x pull, 12% less, p50 3 ms").len() == 4);
    assert!(
        unsourced("`--duration 500ms` and <!--given-->15 ms<!--/given--> and 3 x 20 and P8->D2").is_empty()
    );
    assert!(unsourced(&good).is_empty());
}

#[test]
fn sample_output_blocks_match_their_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("out.txt");
    std::fs::write(&file, "line one  \nline two\n").expect("write");
    let f = file.display();
    let good = format!("<!--figs {f}-->\n```\n$ kvx bench\nline one\nline two\n```\n<!--/figs-->\n");
    assert_eq!(expected(&good), (good.clone(), vec![]));
    let edited = good.replace("two", "2");
    assert_eq!(expected(&edited).0, good);
    let missing = "<!--figs no/such/file-->\n```\nx\n```\n<!--/figs-->\n";
    assert_eq!(expected(missing).1.len(), 1);
    let part = format!("<!--figs {f} lines=2-2-->\n```\nline two\n```\n<!--/figs-->\n");
    assert_eq!(expected(&part), (part.clone(), vec![]));
    assert_eq!(expected(&part.replace("2-2", "2-3")).1.len(), 1, "a range past the end is named");
}
