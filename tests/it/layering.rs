//! The module layout holds: no two files import each other (directly or around a circle),
//! nothing below `cli` imports `cli`, nothing but `cli` imports `diagnose`, and `settings`
//! imports nothing that runs or reports (`pipeline`, `serve`, `report`, `diagnose`). Reads
//! `src/` as text: every `use` and every inline `crate::`/`super::` path, resolved to the file
//! that defines the module it names. A folder's `mod.rs` (and `lib.rs`) declares its children, so references to it are not
//! counted as imports.
//!
//! And the files stay readable: none is over [`MAX_LINES`] lines, and every module with
//! children is a folder with a `mod.rs` (never an `x.rs` beside a folder `x/`).

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
            } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("tests.rs") {
                // A `tests.rs` is a folder's unit tests (`#[cfg(test)] mod tests;`), which may
                // reach anywhere, as inline test modules may.
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
fn nothing_but_cli_imports_diagnose() {
    let graph = imports(&src());
    let offenders: Vec<String> = graph
        .iter()
        .filter(|(m, _)| !matches!(m.first().map(String::as_str), Some("cli" | "bin" | "diagnose")))
        .filter(|(_, to)| to.iter().any(|t| t.first().is_some_and(|s| s == "diagnose")))
        .map(|(m, _)| m.join("/"))
        .collect();
    assert!(
        offenders.is_empty(),
        "these import diagnose (move what they share below it, into config/, transfer/ or report/): {offenders:?}"
    );
}

/// Settings resolve what the user asked for into `config/`'s types; they import nothing that
/// runs or reports, so a command's settings resolve (and are tested) without starting anything.
#[test]
fn settings_import_nothing_that_runs_or_reports() {
    let graph = imports(&src());
    let offenders: Vec<String> = graph
        .iter()
        .filter(|(m, _)| m.first().is_some_and(|s| s == "settings"))
        .flat_map(|(m, to)| {
            to.iter()
                .filter(|t| {
                    matches!(
                        t.first().map(String::as_str),
                        Some("pipeline" | "serve" | "report" | "diagnose")
                    )
                })
                .map(move |t| format!("{} -> {}", m.join("/"), t.join("/")))
        })
        .collect();
    assert!(offenders.is_empty(), "settings import these (move the type into config/): {offenders:#?}");
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
    &["config"],
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

/// The longest a source file may be: past it, split the file along what its parts do.
const MAX_LINES: usize = 1_500;

/// Files over [`MAX_LINES`] whose split is under way elsewhere. Each must still be over the
/// limit: once it is split, take it off this list.
const SPLIT_PENDING: &[&str] = &[];

/// Every `.rs` file under `dir`, as paths relative to `src`.
fn rust_files(dir: &Path, src: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, src, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p.strip_prefix(src).expect("under src").to_path_buf());
        }
    }
}

/// The files over `max` lines (with their counts), and the pending ones that are not.
fn too_long(src: &Path, max: usize, pending: &[&str]) -> (Vec<String>, Vec<String>) {
    let mut files = Vec::new();
    rust_files(src, src, &mut files);
    files.sort();
    let mut over = Vec::new();
    let mut split = Vec::new();
    for rel in files {
        let lines = std::fs::read_to_string(src.join(&rel)).expect("readable source").lines().count();
        let name = rel.to_string_lossy().replace('\\', "/");
        match (lines > max, pending.contains(&name.as_str())) {
            (true, false) => over.push(format!("{name} ({lines} lines)")),
            (false, true) => split.push(name),
            _ => {}
        }
    }
    (over, split)
}

/// Folders `x/` with a file `x.rs` beside them (relative to `src`).
fn mixed_module_styles(src: &Path) -> Vec<String> {
    fn walk(dir: &Path, src: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.with_extension("rs").is_file() {
                    let rel = p.strip_prefix(src).expect("under src").to_string_lossy().replace('\\', "/");
                    out.push(format!("{rel}.rs beside {rel}/"));
                }
                walk(&p, src, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(src, src, &mut out);
    out.sort();
    out
}

#[test]
fn no_source_file_is_over_the_line_limit() {
    let (over, split) = too_long(&src(), MAX_LINES, SPLIT_PENDING);
    assert!(
        over.is_empty(),
        "files over {MAX_LINES} lines (split each into a folder of files cut along what the code does): \
         {over:?}"
    );
    assert!(split.is_empty(), "split already, take them off SPLIT_PENDING: {split:?}");
}

#[test]
fn one_module_style_folder_and_mod_rs() {
    let mixed = mixed_module_styles(&src());
    assert!(mixed.is_empty(), "move each x.rs to x/mod.rs (`git mv`), as the rest of the crate: {mixed:?}");
}

#[test]
fn the_size_and_style_checks_see_what_they_look_for() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path();
    std::fs::create_dir_all(root.join("a/b")).expect("folders");
    std::fs::write(root.join("a.rs"), "mod b;\n").expect("a.rs");
    std::fs::write(root.join("a/b.rs"), "fn f() {}\n".repeat(11)).expect("a/b.rs");
    std::fs::write(root.join("a/b/mod.rs"), "").expect("a/b/mod.rs");
    std::fs::write(root.join("short.rs"), "fn f() {}\n".repeat(10)).expect("short.rs");
    assert_eq!(mixed_module_styles(root), ["a.rs beside a/", "a/b.rs beside a/b/"]);
    let (over, split) = too_long(root, 10, &["short.rs"]);
    assert_eq!(over, ["a/b.rs (11 lines)"]);
    assert_eq!(split, ["short.rs"], "a pending file under the limit is reported");
    assert_eq!(too_long(root, 11, &[]), (Vec::new(), Vec::new()));
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
