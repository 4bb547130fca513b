//! The module layout holds: no two files import each other (directly or around a circle),
//! nothing below `cli` imports `cli`, and nothing but `cli` and `settings` (which resolves its
//! commands' settings) imports `diagnose`. Reads `src/` as text: every `use` and every inline
//! `crate::`/`super::` path, resolved to the file that defines the module it names. A
//! folder's `mod.rs` (and `lib.rs`) declares its children, so references to it are not
//! counted as imports.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`["pipeline", "bench"]`) to file (`pipeline/bench.rs`), for every file in `src/`.
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, src: &Path, out: &mut BTreeMap<Vec<String>, PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, src, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src).expect("under src").to_path_buf();
                let mut m: Vec<String> =
                    rel.with_extension("").iter().map(|c| c.to_string_lossy().into_owned()).collect();
                if m.last().is_some_and(|l| l == "mod" || l == "lib") {
                    m.pop();
                }
                out.insert(m, rel);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, src, &mut out);
    out
}

/// `a::{b, c::{d, e}}` -> `a::b`, `a::c::d`, `a::c::e`.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else { return vec![tree.to_string()] };
    let (prefix, rest) = tree.split_at(open);
    let inner = rest.strip_prefix('{').and_then(|r| r.trim_end().strip_suffix('}')).unwrap_or("");
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for ch in inner.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    parts.push(cur);
    parts
        .iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p))
        .map(|p| format!("{prefix}{p}"))
        .collect()
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Every path a file's code names: `use` trees, and inline `crate::...`/`super::...` paths.
fn paths(code: &str) -> Vec<String> {
    // A file's unit tests may reach anywhere (a settings test parses the real command line);
    // the layers are about the code that ships.
    let code = code.split("#[cfg(test)]\nmod tests").next().unwrap_or(code);
    let code: String =
        code.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut out = Vec::new();
    let starts_word = |i: usize| code[..i].chars().next_back().is_none_or(|c| !is_ident(c) && c != '$');
    for (i, _) in code.match_indices("use ") {
        if starts_word(i)
            && let Some(end) = code[i..].find(';')
        {
            out.extend(expand(&code[i + 4..i + end]));
        }
    }
    for head in ["crate::", "super::"] {
        for (i, _) in code.match_indices(head) {
            if starts_word(i) {
                let len = code[i..].find(|c: char| !(is_ident(c) || c == ':')).unwrap_or(code.len() - i);
                let path = code[i..i + len].trim_end_matches(':');
                // `use super::{...}` is read above; a bare head names nothing more here.
                if path.contains("::") {
                    out.push(path.to_string());
                }
            }
        }
    }
    out
}

/// The file a path leads to from module `from` (`None`: outside the crate, or a `mod.rs`).
fn target(path: &str, from: &[String], files: &BTreeMap<Vec<String>, PathBuf>) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").map(|s| s.split(" as ").next().unwrap_or("").trim()).collect();
    let (mut at, mut rest): (Vec<String>, &[&str]) = match segs.first() {
        Some(&"crate") => (Vec::new(), &segs[1..]),
        Some(&"super" | &"self") => (from.to_vec(), &segs[..]),
        _ => return None,
    };
    while let Some((&s, tail)) = rest.split_first() {
        match s {
            "super" => {
                at.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = tail;
    }
    let mut best = None;
    for n in 0..=rest.len() {
        let mut m = at.clone();
        m.extend(rest[..n].iter().map(|s| s.to_string()));
        if files.contains_key(&m) {
            best = Some(m);
        }
    }
    let best = best?;
    let file = files.get(&best)?;
    (!(file.ends_with("mod.rs") || file.ends_with("lib.rs"))).then_some(best)
}

/// File-to-file imports, leaving out folders' `mod.rs` and `lib.rs`.
fn imports(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let files = modules(src);
    let mut graph = BTreeMap::new();
    for (m, rel) in &files {
        if rel.ends_with("mod.rs") || rel.ends_with("lib.rs") {
            continue;
        }
        let code = std::fs::read_to_string(src.join(rel)).expect("readable source");
        let to: BTreeSet<Vec<String>> =
            paths(&code).iter().filter_map(|p| target(p, m, &files)).filter(|t| t != m).collect();
        graph.insert(m.clone(), to);
    }
    graph
}

/// One circle of imports, if there is any.
fn find_cycle(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        n: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        done: &mut BTreeSet<Vec<String>>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        if let Some(i) = stack.iter().position(|s| s == n) {
            let mut circle = stack[i..].to_vec();
            circle.push(n.clone());
            return Some(circle);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.clone());
        for next in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.clone());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_two_files_import_each_other() {
    let graph = imports(&src());
    assert!(graph.len() > 50, "the scan found the sources ({} files)", graph.len());
    if let Some(circle) = find_cycle(&graph) {
        let names: Vec<String> = circle.iter().map(|m| m.join("/")).collect();
        panic!("import circle: {} (move the shared piece into a file both can import)", names.join(" -> "));
    }
}

#[test]
fn nothing_below_cli_imports_cli() {
    let graph = imports(&src());
    let offenders: Vec<String> = graph
        .iter()
        .filter(|(m, _)| !matches!(m.first().map(String::as_str), Some("cli" | "bin")))
        .filter(|(_, to)| to.iter().any(|t| t.first().is_some_and(|s| s == "cli")))
        .map(|(m, _)| m.join("/"))
        .collect();
    assert!(offenders.is_empty(), "these import cli (settings take plain inputs instead): {offenders:?}");
}

#[test]
fn nothing_but_cli_and_settings_imports_diagnose() {
    let graph = imports(&src());
    let offenders: Vec<String> = graph
        .iter()
        .filter(|(m, _)| {
            !matches!(m.first().map(String::as_str), Some("cli" | "bin" | "settings" | "diagnose"))
        })
        .filter(|(_, to)| to.iter().any(|t| t.first().is_some_and(|s| s == "diagnose")))
        .map(|(m, _)| m.join("/"))
        .collect();
    assert!(
        offenders.is_empty(),
        "these import diagnose (move what they share below it, into transfer/ or report/): {offenders:?}"
    );
}

#[test]
fn the_scan_sees_circles_and_imports() {
    let files: BTreeMap<Vec<String>, PathBuf> = [
        (vec!["a".to_string(), "x".to_string()], PathBuf::from("a/x.rs")),
        (vec!["a".to_string(), "y".to_string()], PathBuf::from("a/y.rs")),
        (vec!["a".to_string()], PathBuf::from("a/mod.rs")),
    ]
    .into_iter()
    .collect();
    let from = vec!["a".to_string(), "x".to_string()];
    assert_eq!(expand("super::{y::{One, Two}, z}"), ["super::y::One", "super::y::Two", "super::z"]);
    assert_eq!(target("super::y::One", &from, &files), Some(vec!["a".into(), "y".into()]));
    assert_eq!(target("crate::a::y", &from, &files), Some(vec!["a".into(), "y".into()]));
    assert_eq!(target("crate::a::Error", &from, &files), None, "an item of a/mod.rs");
    assert_eq!(target("std::fs", &from, &files), None);
    let code = "use super::{y::One, Two};\nfn f() { crate::a::y::g(); } // use crate::a::x;\n";
    assert_eq!(paths(code), ["super::y::One", "super::Two", "crate::a::y::g"]);
    let x = vec!["x".to_string()];
    let y = vec!["y".to_string()];
    let circle: BTreeMap<_, _> =
        [(x.clone(), BTreeSet::from([y.clone()])), (y.clone(), BTreeSet::from([x.clone()]))].into();
    assert!(find_cycle(&circle).is_some());
    let line: BTreeMap<_, _> = [(x, BTreeSet::from([y.clone()])), (y, BTreeSet::new())].into();
    assert_eq!(find_cycle(&line), None);
}

/// The floors of the house, lowest first: a file may import files of its own folder and of
/// the floors below its own, never above (STYLE.md's module map; lib.rs's `# Layout`).
const FLOORS: &[&[&str]] = &[
    &["vocab", "error", "output", "interrupt", "clock", "host", "input"],
    &["topology"],
    &["layouts"],
    &["transfer"],
    &["report"],
    &["pipeline"],
    &["serve", "diagnose"],
    &["settings"],
    &["cli"],
    &["bin"],
];

fn floor(m: &[String]) -> Option<usize> {
    let top = m.first()?;
    FLOORS.iter().position(|f| f.contains(&top.as_str()))
}

/// The top-level module a path names (`crate::report::Summary` -> `report`), relative paths
/// resolved from `from`; `None` for paths outside the crate.
fn top_module(path: &str, from: &[String]) -> Option<String> {
    let segs: Vec<&str> = path.split("::").map(str::trim).collect();
    let mut at: Vec<String> = match segs.first() {
        Some(&"crate") => return segs.get(1).map(|s| s.to_string()),
        Some(&"super" | &"self") => from.to_vec(),
        _ => return None,
    };
    for s in &segs {
        match *s {
            "super" => {
                at.pop();
            }
            "self" => {}
            other => {
                at.push(other.to_string());
                break;
            }
        }
    }
    at.first().cloned()
}

#[test]
fn imports_point_down_the_floors() {
    let src = src();
    let mut unknown = BTreeSet::new();
    let mut up = BTreeSet::new();
    for (m, rel) in modules(&src) {
        if rel.ends_with("lib.rs") {
            continue;
        }
        let Some(from) = floor(&m) else {
            unknown.insert(m.join("/"));
            continue;
        };
        let code = std::fs::read_to_string(src.join(&rel)).expect("readable source");
        // A folder's mod.rs speaks for the folder: `super::` from it starts at the folder.
        let here: Vec<String> = if rel.ends_with("mod.rs") {
            m.iter().cloned().chain([String::new()]).collect()
        } else {
            m.clone()
        };
        for p in paths(&code) {
            let Some(top) = top_module(&p, &here) else { continue };
            if top.is_empty() || Some(&top) == m.first() {
                continue;
            }
            match FLOORS.iter().position(|f| f.contains(&top.as_str())) {
                Some(f) if f > from || (f == from && from > 0) => {
                    up.insert(format!("{} -> {top}", m.join("/")));
                }
                Some(_) => {}
                None => {
                    unknown.insert(top);
                }
            }
        }
    }
    assert!(unknown.is_empty(), "modules on no floor (add them to FLOORS): {unknown:?}");
    assert!(up.is_empty(), "imports pointing up (move the shared piece down): {up:#?}");
}

/// Flags of vLLM's own CLI that vLLM's messages name, which the core quotes word for word
/// (`Refusal::vllm_message`): vLLM's words, not kvx's flags.
const VLLM_FLAGS: &[&str] = &["--disable-prefix-caching", "--kv-transfer-config"];

/// The flag names (`--word`) a text spells, in order.
fn flag_names(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (i, _) in text.match_indices("--") {
        let before = i.checked_sub(1).map(|j| bytes[j]);
        let starts = before.is_none_or(|b| b != b'-' && !b.is_ascii_alphanumeric());
        if starts && bytes.get(i + 2).is_some_and(u8::is_ascii_lowercase) {
            let len = text[i + 2..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
                .unwrap_or(text.len() - i - 2);
            out.push(text[i..i + 2 + len].to_string());
        }
    }
    out
}

/// The code of a file that ships: all of it up to its unit tests (`#[cfg(test)] mod ...`).
fn shipped(code: &str) -> &str {
    code.split("#[cfg(test)]\nmod ").next().unwrap_or(code)
}

/// The core speaks in kvx's types, not flags: a rule of `topology` or `layouts` that must name
/// what the user can change returns a `Knob`, which settings spells as a flag, and the core's
/// choices get their clap parsers in settings. So no flag name and no `clap` in the code of
/// either (comments and doc text included: they are read as the core's word on a setting).
#[test]
fn the_core_names_no_flag_and_no_clap() {
    let src = src();
    let mut offenders = Vec::new();
    let mut scanned = 0;
    for (m, rel) in modules(&src) {
        if !matches!(m.first().map(String::as_str), Some("topology" | "layouts")) {
            continue;
        }
        scanned += 1;
        let code = std::fs::read_to_string(src.join(&rel)).expect("readable source");
        for (n, line) in shipped(&code).lines().enumerate() {
            let flags: Vec<String> =
                flag_names(line).into_iter().filter(|f| !VLLM_FLAGS.contains(&f.as_str())).collect();
            let clap = line.split(|c: char| !is_ident(c)).any(|w| w == "clap");
            if !flags.is_empty() || clap {
                offenders.push(format!("{}:{}: {}", rel.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(scanned > 20, "the scan found the core's files ({scanned})");
    assert!(
        offenders.is_empty(),
        "the core names flags or clap (return a vocab::knob::Knob, which settings::knobs spells; \
         give a choice its clap::ValueEnum in settings::choices):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_flag_scan_sees_flags() {
    assert_eq!(flag_names("raise --p-tp to 4, or --mode pull"), ["--p-tp", "--mode"]);
    assert_eq!(flag_names("\"--d-block-size\","), ["--d-block-size"]);
    assert!(flag_names("// ---- a--b --X -- 2").is_empty());
    let code = "fn f() {}\n#[cfg(test)]\nmod tests {\n    const F: &str = \"--tp\";\n}\n";
    assert!(flag_names(shipped(code)).is_empty());
}
