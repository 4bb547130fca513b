//! Every figure in README.md and docs/ comes from a committed results file.
//!
//! A measured figure stands in a marker naming its source, and this test recomputes it:
//!
//! - inline: `<!--fig FILE#PATH FMT-->5.27<!--/fig-->`, or a ratio of two sources
//!   `<!--fig FILE#PATH / FILE#PATH FMT-->1.03x<!--/fig-->`. `FILE` is relative to the
//!   repository; `PATH` walks the JSON (`stages.e2e.p50_us`, `repeats.0.throughput_gbps`,
//!   `results[size_bytes=8192].gbps`: the first element whose field has that value). `FMT` is
//!   `[*SCALE][,]DIGITS[x|%]`: multiply by SCALE, thousands separators, DIGITS decimals, then
//!   an `x` (ratios) or a percentage (`%`: times 100). A last word `meets=T` or `misses=T`
//!   (`<!--fig FILE#PATH / FILE#PATH 2x meets=0.5-->`) is a claim against a target: the
//!   unrounded value must be at least T (meets) or below it (misses), so a figure shown as
//!   `0.50x` that is 0.4975 cannot be said to meet 0.5.
//! - block: a line `<!--figs FILE-->` (or `<!--figs FILE lines=A-B-->`), then a fenced block
//!   whose lines (after an optional first `$ command` line) are FILE's, then `<!--/figs-->`:
//!   sample output shown as it was printed.
//! - deterministic output: a plain fenced block whose first line is `$ kvx topo|layout|plan
//!   ...` (a pipe into `head`, `tail`, `sed` or `grep` allowed) is run by the current binary
//!   from the repository's root, and its output (stdout and stderr) must be the block's lines.
//!
//! Outside markers, code spans and fenced blocks, a number with a unit fails the test: it would
//! be a figure typed by hand. Units: rates (GB/s, MB/s), times (s, ms, us, ns, minutes),
//! sizes (KB, MB, GB, KiB, MiB, GiB, ...), ratios (`1.5x`), percentages, and counts of what
//! kvx measures (`20 requests`, `81,920 descriptors`, blocks, leases, runs, pairs, bytes, ...).
//! A setting or an outside fact that reads like one is wrapped in
//! `<!--given SOURCE-->...<!--/given-->`, where SOURCE names where it comes from (a flag's
//! default, a test's bound such as `tests/it/signals.rs`, a vLLM document): a `given` without a
//! source, or whose source is under `results/` (kvx's own measurements go in `fig` markers), or
//! that wraps a `fig` marker, fails.
//!
//! `scripts/docs-figures.sh` (`KVX_DOCS_UPDATE=1`) rewrites each marker's text and each
//! deterministic block from its source instead of failing, after `scripts/docs-runs.sh`
//! measured again.
//!
//! The guide's shape is checked here too: README.md at most 250 lines, each page under docs/
//! at most 400, every page reachable from README.md by Markdown links, and every link to a
//! page (and to a heading in it) resolves.

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

/// The text a `fig` marker's spec gives; an error when a claim (`meets=T`, `misses=T`) does not
/// hold.
fn figure(spec: &str) -> Result<String, String> {
    let mut words: Vec<&str> = spec.split_whitespace().collect();
    let claim = match words.last().copied() {
        Some(w) if w.starts_with("meets=") || w.starts_with("misses=") => {
            words.pop();
            let (ge, t) = match w.strip_prefix("meets=") {
                Some(t) => (true, t),
                None => (false, &w["misses=".len()..]),
            };
            let t: f64 = t.parse().map_err(|e| format!("claim `{w}` in `{spec}`: {e}"))?;
            Some((ge, t, w))
        }
        _ => None,
    };
    let (value, fmt) = match words.as_slice() {
        [a, f] => (number(a)?, *f),
        [a, "/", b, f] => {
            let d = number(b)?;
            if d == 0.0 {
                return Err(format!("{b} is 0"));
            }
            (number(a)? / d, *f)
        }
        _ => return Err(format!("`{spec}`: expected `FILE#PATH FMT` or `FILE#PATH / FILE#PATH FMT`")),
    };
    let fmt = parse_format(fmt)?;
    if let Some((ge, t, w)) = claim {
        // The claim is on the value as shown before rounding: scale and percent applied.
        let shown = value * fmt.scale * if fmt.suffix == Some('%') { 100.0 } else { 1.0 };
        if (shown >= t) != ge {
            return Err(format!("the text claims `{w}`, but the unrounded value is {shown}"));
        }
    }
    Ok(render(value, fmt))
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

/// What is wrong with the `given` markers of a document: one without a source, one whose
/// source is a results file (kvx's own measurements are `fig` markers), one around a `fig`.
fn bad_givens(doc: &str) -> Vec<String> {
    let given = Regex::new(r"(?s)<!--given(.*?)-->(.*?)<!--/given-->").expect("regex");
    given
        .captures_iter(doc)
        .filter_map(|c| {
            let source = c[1].trim();
            let body = c[2].trim();
            let line = doc[..c.get(0).map_or(0, |m| m.start())].matches('\n').count() + 1;
            let why = if source.is_empty() {
                "names no source (write `<!--given SOURCE-->`)"
            } else if source.contains("results/") {
                "names a results file: a kvx measurement goes in a `fig` marker"
            } else if body.contains("<!--fig") {
                "wraps a `fig` marker"
            } else {
                return None;
            };
            Some(format!("line {line}: `given` {why}: {}", &c[0]))
        })
        .collect()
}

/// Numbers with a unit of measurement in prose: outside markers, code spans and fences.
fn unsourced(doc: &str) -> Vec<String> {
    let strip = [r"(?s)```.*?```", r"(?s)<!--fig [^>]*?-->.*?<!--/fig-->", r"`[^`]*`"];
    let keep_lines = |c: &regex::Captures<'_>| "\n".repeat(c[0].matches('\n').count());
    let mut prose = doc.to_string();
    for re in strip {
        // Keep the line count, so findings point at their line.
        prose = Regex::new(re).expect("regex").replace_all(&prose, keep_lines).into_owned();
    }
    // A `given` with a proper source hides its text; any other keeps it, so its figure is found.
    prose = Regex::new(r"(?s)<!--given(.*?)-->(.*?)<!--/given-->")
        .expect("regex")
        .replace_all(&prose, |c: &regex::Captures<'_>| {
            let source = c[1].trim();
            if source.is_empty() || source.contains("results/") || c[2].contains("<!--fig") {
                c[2].to_string()
            } else {
                keep_lines(c)
            }
        })
        .into_owned();
    prose = Regex::new(r"(?s)<!--.*?-->").expect("regex").replace_all(&prose, keep_lines).into_owned();
    let measured = Regex::new(concat!(
        r"(?:^|[^\w.,/])(\d(?:[\d,]*\d)?(?:\.\d+)?(?:",
        r"\s?(?:GB/s|MB/s|TB/s|Gb/s|KiB|MiB|GiB|TiB|PiB|KB|MB|GB|TB|ms|us|µs|ns|s|sec|seconds?|min|minutes?|hours?)",
        r"|\s(?:bytes|requests/s|requests|descriptors|blocks|batches|leases|runs|pairs|repeats|models|engines|disagreements|failures)",
        r"|x|%))(?:$|[^\w/])",
    ))
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

/// The binary's output for a deterministic block's `$ kvx ...` line, run from the root.
fn run_block(cmd: &str) -> Result<String, String> {
    let bin = env!("CARGO_BIN_EXE_kvx");
    let rest = cmd.strip_prefix("kvx ").ok_or_else(|| format!("`{cmd}` does not start with kvx"))?;
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("'{bin}' {rest} 2>&1"))
        .current_dir(root())
        .env_remove("KVX_UCX_LIB")
        .output()
        .map_err(|e| format!("`{cmd}`: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().map(|l| format!("{}\n", l.trim_end())).collect())
}

/// A document with each deterministic block (`$ kvx topo|layout|plan ...`, outside `figs`
/// markers) as the current binary prints it, and the commands that could not run. A block may
/// hold several commands, each `$ ` line followed by its output.
fn regenerated(doc: &str) -> (String, Vec<String>) {
    let mut problems = Vec::new();
    let re = Regex::new(r"(?s)(<!--figs [^>]*-->\n)?```([^\n]*)\n(\$ kvx (?:topo|layout|plan)\b.*?)```")
        .expect("regex");
    let text = re
        .replace_all(doc, |c: &regex::Captures<'_>| {
            if c.get(1).is_some() {
                return c[0].to_string();
            }
            let mut out = format!("```{}\n", &c[2]);
            for line in c[3].lines().filter(|l| l.starts_with("$ ")) {
                let cmd = &line[2..];
                let deterministic = ["kvx topo", "kvx layout", "kvx plan"].iter().any(|k| cmd.starts_with(k));
                let pipes_ok = cmd.split('|').skip(1).all(|p| {
                    let p = p.trim_start();
                    ["head", "tail", "sed", "grep"].iter().any(|t| p.starts_with(t))
                });
                if !deterministic || !pipes_ok {
                    problems.push(format!(
                        "`{cmd}`: a deterministic block runs kvx topo, layout or plan, piped only into head, tail, sed, grep"
                    ));
                    return c[0].to_string();
                }
                match run_block(cmd) {
                    Ok(body) => out.push_str(&format!("$ {cmd}\n{body}")),
                    Err(e) => {
                        problems.push(e);
                        return c[0].to_string();
                    }
                }
            }
            out.push_str("```");
            out
        })
        .into_owned();
    (text, problems)
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
        let (want, problems) = regenerated(&want);
        failures.extend(problems.into_iter().map(|p| format!("{name}: {p}")));
        failures.extend(bad_givens(&doc).into_iter().map(|p| format!("{name}: {p}")));
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
                    "{name}: figures or sample blocks differ from their sources (scripts/docs-figures.sh rewrites them):\n{}",
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
    assert!(unsourced(
        "`--duration 500ms` and <!--given the default of --itl-ms-->15 ms<!--/given--> and 3 x 20 and P8->D2"
    )
    .is_empty());
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

#[test]
fn a_number_in_seconds_a_size_or_a_count_typed_or_changed_by_hand_is_caught() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("r.json");
    std::fs::write(&file, r#"{"serve": {"seconds": 150.2, "requests_ok": 2436, "bytes": 93000000}}"#)
        .expect("write");
    let rel = file.display();
    let good = format!(
        "<!--fig {rel}#serve.requests_ok 0-->2436<!--/fig--> requests in <!--fig {rel}#serve.seconds 0-->150<!--/fig--> s, \
         <!--fig {rel}#serve.bytes *0.000001,1-->93.0<!--/fig--> MB each"
    );
    assert_eq!(expected(&good), (good.clone(), vec![]));
    assert!(unsourced(&good).is_empty(), "{:?}", unsourced(&good));
    let changed = good.replace("-->150<", "-->151<");
    assert_ne!(
        expected(&changed).0,
        changed,
        "a number in seconds changed by hand is restored, so the test fails"
    );
    for typed in [
        "runs end within 0.25 s of the fault",
        "it ran for 600 s",
        "a step takes 10 minutes",
        "93.0 MB per request",
        "about 7 MB",
        "pools of 2 GiB",
        "40 requests ok",
        "the same 81,920 descriptors",
        "590 leases expired",
        "6.82 requests/s",
    ] {
        assert_eq!(unsourced(typed).len(), 1, "`{typed}` is a typed figure");
    }
    for fine in [
        "Llama-3.1-70B and 8B-70B models",
        "16-byte loads",
        "P8->D2, 2026-11-28, second session",
        "one block in 16",
    ] {
        assert!(unsourced(fine).is_empty(), "`{fine}`: {:?}", unsourced(fine));
    }
}

#[test]
fn a_given_around_a_kvx_figure_is_caught() {
    let sourced = "<!--given the test's bound, tests/it/signals.rs-->5 s<!--/given-->";
    assert!(bad_givens(sourced).is_empty() && unsourced(sourced).is_empty());
    let bare = "within <!--given-->0.01x<!--/given--> of run 4";
    assert_eq!(bad_givens(bare).len(), 1, "a given without a source");
    assert_eq!(unsourced(bare).len(), 1, "and its figure counts as typed");
    let results = "within <!--given results/gpu-figures.json-->0.01x<!--/given--> of run 4";
    assert_eq!(bad_givens(results).len(), 1, "a given whose source is a results file");
    assert_eq!(unsourced(results).len(), 1);
    let wrapping = "<!--given a flag--><!--fig results/docs/xfer/out.txt#results.0.gbps 2-->5.02<!--/fig--> GB/s<!--/given-->";
    assert_eq!(bad_givens(wrapping).len(), 1, "a given around a fig marker");
}

#[test]
fn a_claim_against_a_target_uses_the_unrounded_value() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("r.json");
    std::fs::write(&file, r#"{"a": 0.4975, "b": 1.0}"#).expect("write");
    let rel = file.display();
    assert_eq!(figure(&format!("{rel}#a / {rel}#b 2x")).as_deref(), Ok("0.50x"), "shown rounded up");
    assert!(figure(&format!("{rel}#a / {rel}#b 2x meets=0.5")).is_err(), "but it does not meet 0.5");
    assert_eq!(figure(&format!("{rel}#a / {rel}#b 2x misses=0.5")).as_deref(), Ok("0.50x"));
    assert_eq!(
        figure(&format!("{rel}#a 2% meets=49.7")).as_deref(),
        Ok("49.75%"),
        "claims read the shown scale"
    );
}

#[test]
fn a_sample_block_drifting_from_its_file_or_from_the_binary_is_caught() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("out.txt");
    std::fs::write(&file, "requests ok 40\n").expect("write");
    let good = format!("<!--figs {}-->\n```\nrequests ok 40\n```\n<!--/figs-->\n", file.display());
    assert_eq!(expected(&good), (good.clone(), vec![]));
    let drifted = good.replace("40", "41");
    assert_ne!(expected(&drifted).0, drifted, "a sample block edited by hand differs from its file");
    let cmd = "kvx topo --p-tp 2 --d-tp 1 --num-kv-heads 8 | head -3";
    let body = run_block(cmd).expect("kvx topo runs");
    assert!(body.lines().count() == 3 && body.contains("P tp 2 -> D tp 1"), "{body}");
    let block = format!("```\n$ {cmd}\n{body}```\n");
    assert_eq!(regenerated(&block), (block.clone(), vec![]));
    let edited = block.replacen("D tp 1", "D tp 4", 1);
    assert_ne!(regenerated(&edited).0, edited, "a deterministic block that drifted from the binary's output");
    let in_figs =
        format!("<!--figs {}-->\n```\n$ {cmd}\nrequests ok 40\n```\n<!--/figs-->\n", file.display());
    assert_eq!(regenerated(&in_figs).0, in_figs, "a figs block is compared with its file, not run");
    assert_eq!(regenerated("```\n$ kvx topo --p-tp 2 | sh\n```\n").1.len(), 1, "only head, tail, sed, grep");
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Links to Markdown files (and their anchors) from one document, fenced blocks left out.
fn md_links(doc: &str) -> Vec<(String, Option<String>)> {
    let prose = Regex::new(r"(?s)```.*?```").expect("regex").replace_all(doc, "");
    let link = Regex::new(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)").expect("regex");
    link.captures_iter(&prose)
        .filter(|c| !c[1].contains("://"))
        .filter(|c| c[1].is_empty() || c[1].ends_with(".md"))
        .map(|c| (c[1].to_string(), c.get(2).map(|m| m.as_str().to_string())))
        .collect()
}

#[test]
fn the_guide_is_short_every_page_is_reachable_from_the_readme_and_every_link_resolves() {
    let mut failures = Vec::new();
    for path in documents() {
        let name = path.strip_prefix(root()).unwrap_or(&path).display().to_string();
        let lines = std::fs::read_to_string(&path).expect("read").lines().count();
        let limit = if name == "README.md" { 250 } else { 400 };
        if lines > limit {
            failures.push(format!("{name}: {lines} lines, more than {limit}"));
        }
    }
    let heading = Regex::new(r"(?m)^#{1,6} (.*)$").expect("regex");
    let anchors = |p: &PathBuf| -> Vec<String> {
        let doc = std::fs::read_to_string(p).unwrap_or_default();
        let doc = Regex::new(r"(?s)```.*?```").expect("regex").replace_all(&doc, "").into_owned();
        heading.captures_iter(&doc).map(|c| slug(&c[1])).collect()
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut todo = vec![root().join("README.md")];
    while let Some(p) = todo.pop() {
        let Ok(canon) = p.canonicalize() else { continue };
        if !seen.insert(canon.clone()) {
            continue;
        }
        let doc = std::fs::read_to_string(&canon).expect("read");
        let name = canon.strip_prefix(root()).unwrap_or(&canon).display().to_string();
        for (target, anchor) in md_links(&doc) {
            let t =
                if target.is_empty() { canon.clone() } else { canon.parent().expect("dir").join(&target) };
            if !t.exists() {
                failures.push(format!("{name}: link to `{target}`, which does not exist"));
                continue;
            }
            if let Some(a) = anchor.filter(|a| !a.is_empty())
                && !anchors(&t).contains(&a)
            {
                failures.push(format!("{name}: link to `{target}#{a}`: no such heading"));
            }
            if t.extension().is_some_and(|x| x == "md") {
                todo.push(t);
            }
        }
    }
    for path in documents() {
        let canon = path.canonicalize().expect("canon");
        if !seen.contains(&canon) {
            failures.push(format!("{}: not reachable from README.md by links", path.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
