//! Which protocol UCX chose for each operation and memory-type pair ("zero-copy over
//! cma/memory", "software emulation over sysv/memory"), so that reports can name it and a
//! slow path is never silent.
//!
//! UCX (1.15 and later, protocols v2) does not return this through its API:
//! `ucp_ep_print_info` lists the endpoint's lanes and its active-message protocols, but a
//! GET's protocol lives in the remote key's configuration. What UCX offers is
//! `PROTO_INFO`: every selection is printed as a table to UCX's log stream (stdout unless
//! `UCX_LOG_FILE` says otherwise), and with `PROTO_INFO_DIR` also written as one Graphviz
//! file per message-size range (`<context>_<op and memory types>_<from>_<to>.dot`, whose
//! first node is labelled `"<description>\n<lanes>"`). Setting them per context with
//! `ucp_config_modify` would print the tables into kvx's stdout (its JSON reports), and
//! the log file is fixed when UCX loads, so kvx sets all three in the environment of the
//! processes it starts ([`capture_env`]): `kvx xfer` runs its measuring process that way,
//! and [`super::Context::protocols`] reads the files ([`read_dir`]) after the reads.
//! [`parse_log`] reads the log table (what a user sees with `UCX_PROTO_INFO=y`).
//!
//! UCX 1.13 (protocols v1 by default) writes neither: there the protocol is unknown.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The one-sided operation that moves KV blocks: decode's GET (pull mode, `kvx xfer`) or
/// prefill's PUT (push mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rma {
    Get,
    Put,
}

impl Rma {
    /// As UCX's protocol reports name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rma::Get => "get",
            Rma::Put => "put",
        }
    }

    /// The UCX call that posts one.
    pub(super) fn call_name(self) -> &'static str {
        match self {
            Rma::Get => "ucp_get_nbx",
            Rma::Put => "ucp_put_nbx",
        }
    }
}

/// One protocol selection for a range of message sizes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtoSelection {
    /// `get`, `put`, or UCX's own words for other operations.
    pub op: String,
    /// Memory the operation writes into (GET) or reads from (PUT), as UCX names it,
    /// e.g. `host memory`, `cuda/GPU0` (`cuda GPU0` from file names).
    pub local: String,
    /// The peer's memory, e.g. `host`, `cuda/dev[0]`.
    pub remote: String,
    /// Message sizes, e.g. `0..inf`, `1..8220`.
    pub range: String,
    /// UCX's description, e.g. `zero-copy`, `software emulation`.
    pub description: String,
    /// Transport and device, e.g. `cma/memory`, `cuda_ipc/cuda`.
    pub config: String,
}

impl ProtoSelection {
    /// Whether UCX emulates the operation in software (the target must progress, and
    /// the bytes travel through bounce buffers: the slow path).
    pub fn is_emulated(&self) -> bool {
        self.description.to_ascii_lowercase().contains("emulation")
    }

    fn sort_key(&self) -> u64 {
        parse_units(self.range.split("..").next().unwrap_or("0")).unwrap_or(0)
    }
}

/// The memory type a UCX memory name starts with: `host`, `cuda`, `cuda-managed`, ...
pub fn memory_kind(name: &str) -> String {
    let n = name.trim().to_ascii_lowercase().replace(['_', '/'], " ");
    if n.starts_with("cuda managed") || n.starts_with("cuda-managed") {
        return "cuda-managed".into();
    }
    n.split([' ', '[']).next().unwrap_or("").to_string()
}

/// The selections of one operation and memory-type pair, ranges merged where the choice
/// is the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtoUse {
    pub op: String,
    pub local: String,
    pub remote: String,
    pub choices: Vec<ProtoChoice>,
    /// Some range is software-emulated.
    pub emulated: bool,
}

/// One choice over a range of sizes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtoChoice {
    pub range: String,
    pub description: String,
    pub config: String,
}

impl std::fmt::Display for ProtoUse {
    /// `get host<-host: zero-copy cma/memory`, or with ranges when they differ:
    /// `get cuda<-cuda: 0..8K software emulation sysv/memory, 8K..inf zero-copy cuda_ipc/cuda`.
    /// The arrow points where the bytes go: into local memory for a GET, out of it for a PUT
    /// (`put host->host`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let arrow = if self.op == Rma::Put.as_str() { "->" } else { "<-" };
        write!(f, "{} {}{arrow}{}: ", self.op, memory_kind(&self.local), memory_kind(&self.remote))?;
        let one = self.choices.len() == 1;
        for (i, c) in self.choices.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if !one {
                write!(f, "{} ", c.range)?;
            }
            write!(f, "{} {}", c.description, c.config)?;
        }
        Ok(())
    }
}

/// Groups selections by (op, local, remote), in order of first appearance, and merges
/// adjacent ranges that chose the same protocol.
pub fn summarize(selections: &[ProtoSelection]) -> Vec<ProtoUse> {
    let mut order: Vec<(String, String, String)> = Vec::new();
    let mut groups: BTreeMap<(String, String, String), Vec<&ProtoSelection>> = BTreeMap::new();
    for s in selections {
        let key = (s.op.clone(), s.local.clone(), s.remote.clone());
        if !groups.contains_key(&key) {
            order.push(key.clone());
        }
        groups.entry(key).or_default().push(s);
    }
    order
        .into_iter()
        .map(|key| {
            let mut sels = groups.remove(&key).unwrap_or_default();
            sels.sort_by_key(|s| s.sort_key());
            let mut choices: Vec<ProtoChoice> = Vec::new();
            for s in &sels {
                match choices.last_mut() {
                    Some(last) if last.description == s.description && last.config == s.config => {
                        let start = last.range.split("..").next().unwrap_or("0").to_string();
                        let end = s.range.split("..").nth(1).unwrap_or("inf");
                        last.range = format!("{start}..{end}");
                    }
                    _ => choices.push(ProtoChoice {
                        range: s.range.clone(),
                        description: s.description.clone(),
                        config: s.config.clone(),
                    }),
                }
            }
            ProtoUse {
                emulated: sels.iter().any(|s| s.is_emulated()),
                op: key.0,
                local: key.1,
                remote: key.2,
                choices,
            }
        })
        .collect()
}

/// `8221`, `inf`, `64K`, `1M` (UCX's memory units) as bytes (`inf` = `u64::MAX`).
fn parse_units(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("inf") {
        return Some(u64::MAX);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim_end_matches(['b', 'B']) {
        "" => 1,
        "K" | "k" => 1 << 10,
        "M" | "m" => 1 << 20,
        "G" | "g" => 1 << 30,
        "T" | "t" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Splits "get into X from Y" / "put from X to Y" (words separated by spaces or, in
/// file names, underscores) into (op, local, remote).
fn split_operation(words: &[&str]) -> (String, String, String) {
    let find = |w: &str| words.iter().position(|x| *x == w);
    let join = |ws: &[&str]| ws.iter().filter(|w| !w.is_empty()).copied().collect::<Vec<_>>().join(" ");
    if let (Some(into), Some(from)) = (find("into"), find("from"))
        && into < from
    {
        return (op_name(&join(&words[..into])), join(&words[into + 1..from]), join(&words[from + 1..]));
    }
    if let (Some(from), Some(to)) = (find("from"), find("to"))
        && from < to
    {
        return (op_name(&join(&words[..from])), join(&words[from + 1..to]), join(&words[to + 1..]));
    }
    (op_name(&join(words)), String::new(), String::new())
}

/// `remote memory read by ucp_get*` -> `get`; `get` -> `get`.
fn op_name(s: &str) -> String {
    if s.contains("ucp_get") || s == "get" {
        "get".into()
    } else if s.contains("ucp_put") || s == "put" {
        "put".into()
    } else {
        s.trim().to_string()
    }
}

/// Reads the selections UCX wrote to `dir` (`PROTO_INFO_DIR`); an absent or empty
/// directory gives none.
pub fn read_dir(dir: &Path) -> Vec<ProtoSelection> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<(String, String)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".dot") {
                return None;
            }
            let text = std::fs::read_to_string(e.path()).ok()?;
            Some((name, text))
        })
        .collect();
    files.sort();
    files.iter().filter_map(|(name, text)| parse_dot(name, text)).collect()
}

/// One `PROTO_INFO_DIR` file: `<context>_cfg_<n>_<operation>_<from>_<to>.dot`, first node
/// labelled `"<description>\n<config>"`.
pub fn parse_dot(file_name: &str, text: &str) -> Option<ProtoSelection> {
    let stem = file_name.strip_suffix(".dot")?;
    let mut tail = stem.rsplitn(3, '_');
    let end = tail.next()?;
    let start = tail.next()?;
    let rest = tail.next()?;
    parse_units(start)?;
    parse_units(end)?;
    // The context part ends with "cfg_<n>", e.g. "ucp_context_0_intra_node_cfg_0".
    let words: Vec<&str> = rest.split('_').collect();
    let cfg = words.iter().position(|w| *w == "cfg")?;
    let op_words = words.get(cfg + 2..)?;
    let (op, local, remote) = split_operation(op_words);
    let label = text.lines().find_map(|l| {
        let l = l.trim();
        if !l.starts_with("node0 ") {
            return None;
        }
        let after = l.split_once("label=\"")?.1;
        Some(after.split_once('"')?.0.to_string())
    })?;
    let (description, config) = label.split_once("\\n").unwrap_or((label.as_str(), ""));
    Some(ProtoSelection {
        op,
        local,
        remote,
        range: format!("{start}..{end}"),
        description: description.trim().to_string(),
        config: config.trim().to_string(),
    })
}

/// The tables UCX prints with `UCX_PROTO_INFO=y`:
/// ```text
/// [1795577744.019100] [vm:16460:0]   | ucp_context_0 intra-node cfg#0                            |
/// [1795577744.019100] [vm:16460:0]   | remote memory read by ucp_get* into host memory from host |
/// [1795577744.019100] [vm:16460:0]   | 0..inf | zero-copy   | cma/memory                         |
/// ```
/// Other log lines are ignored.
pub fn parse_log(text: &str) -> Vec<ProtoSelection> {
    let mut out = Vec::new();
    let mut title: Option<(String, String, String)> = None;
    for line in text.lines() {
        let Some(body) = line.find('|').map(|i| line[i..].trim()) else { continue };
        if !body.ends_with('|') || body.len() < 2 {
            continue;
        }
        let cells: Vec<&str> = body[1..body.len() - 1].split('|').map(str::trim).collect();
        match cells.as_slice() {
            [one] => {
                let words: Vec<&str> = one.split_whitespace().collect();
                if words.contains(&"into") || words.contains(&"from") {
                    title = Some(split_operation(&words));
                }
            }
            [range, description, config] => {
                if *range == "Range" || !range.contains("..") {
                    continue;
                }
                if let Some((op, local, remote)) = &title {
                    out.push(ProtoSelection {
                        op: op.clone(),
                        local: local.clone(),
                        remote: remote.clone(),
                        range: (*range).to_string(),
                        description: (*description).to_string(),
                        config: (*config).to_string(),
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// What a report says about protocols: the selections, or why there are none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtoReport {
    pub uses: Vec<ProtoUse>,
    /// Why the protocols are unknown (absent when `uses` is filled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl ProtoReport {
    /// `get host<-host: zero-copy cma/memory; ...`, or the note.
    pub fn summary(&self) -> String {
        if self.uses.is_empty() {
            return format!("unknown ({})", self.note.as_deref().unwrap_or("not captured"));
        }
        self.uses.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    }

    /// The selections of the one-sided operation that moves KV blocks in this mode (GET when
    /// decode pulls, PUT when prefill pushes), not the active messages that carry
    /// notifications, nor selections UCX made for operations kvx does not issue (with device
    /// memory UCX 1.22 also prints a PUT from host memory, emulated, in a run that only reads).
    pub fn only(mut self, op: Rma) -> ProtoReport {
        self.uses.retain(|u| u.op == op.as_str());
        self
    }

    /// The selections of `op` for pairs where either side is device memory.
    pub fn device_uses(&self, op: Rma) -> impl Iterator<Item = &ProtoUse> {
        self.uses.iter().filter(move |u| {
            u.op == op.as_str()
                && (memory_kind(&u.local).starts_with("cuda") || memory_kind(&u.remote).starts_with("cuda"))
        })
    }
}

/// UCX's own switches for protocol reports and its log file.
pub const PROTO_INFO_ENV: &str = "UCX_PROTO_INFO";
pub const PROTO_INFO_DIR_ENV: &str = "UCX_PROTO_INFO_DIR";
pub const LOG_FILE_ENV: &str = "UCX_LOG_FILE";

/// The environment under which a kvx process started by kvx records the protocols its
/// UCX selects into `dir`: `UCX_PROTO_INFO=y`, `UCX_PROTO_INFO_DIR=dir/selections`, and
/// `UCX_LOG_FILE=dir/ucx.%p.log`, because UCX also prints each selection as a table to
/// its log stream, which is stdout unless redirected (kvx's reports go there). These are
/// read by UCX when it loads, so they must be set before the process starts. `dir` is
/// created if missing (UCX creates the last level of its directory only). `Err` says which
/// of them the user set (kvx then leaves UCX's output where the user asked), or why `dir`
/// cannot be made.
pub fn capture_env(dir: &Path) -> Result<Vec<(String, String)>, String> {
    if let Some(var) =
        [PROTO_INFO_ENV, PROTO_INFO_DIR_ENV, LOG_FILE_ENV].into_iter().find(|v| std::env::var_os(v).is_some())
    {
        return Err(format!("{var} is set in the environment"));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(vec![
        (PROTO_INFO_ENV.to_string(), "y".to_string()),
        (PROTO_INFO_DIR_ENV.to_string(), dir.join("selections").display().to_string()),
        (LOG_FILE_ENV.to_string(), dir.join("ucx.%p.log").display().to_string()),
    ])
}

/// Where this process's UCX writes its protocol selections, if it does (both
/// `UCX_PROTO_INFO` and `UCX_PROTO_INFO_DIR` set, by [`capture_env`] or by the user).
pub fn capture_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(PROTO_INFO_ENV)?;
    std::env::var_os(PROTO_INFO_DIR_ENV).filter(|d| !d.is_empty()).map(std::path::PathBuf::from)
}

/// The lines of the UCX log files in `dir` (`ucx.*.log`) that are not protocol tables:
/// UCX's own warnings and errors, which the user should still see.
pub fn log_messages(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<std::path::PathBuf> =
        entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "log")).collect();
    files.sort();
    files
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|text| {
            text.lines()
                .filter(|l| {
                    let body = l.trim();
                    // Table rows and borders follow the "[time] [host:pid:tid]" prefix.
                    let after = body.rsplit_once("] ").map_or(body, |(_, b)| b).trim_start();
                    !body.is_empty() && !after.starts_with('|') && !after.starts_with('+')
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ucx-proto")
    }

    #[test]
    fn dot_files_of_ucx_1_22_give_the_get_and_put_protocols() {
        let sels = read_dir(&fixtures().join("dot-1.22-host"));
        assert_eq!(sels.len(), 6, "{sels:#?}");
        let gets: Vec<&ProtoSelection> = sels.iter().filter(|s| s.op == "get").collect();
        assert_eq!(gets.len(), 3);
        assert!(gets.iter().all(|s| s.local == "host memory" && s.remote == "host"), "{gets:#?}");
        assert!(gets.iter().all(|s| s.description == "zero-copy" && s.config == "cma/memory"));
        let uses = summarize(&sels);
        let get = uses.iter().find(|u| u.op == "get").expect("get");
        assert_eq!(get.to_string(), "get host<-host: zero-copy cma/memory");
        assert_eq!(get.choices[0].range, "0..inf");
        assert!(!get.emulated);
        let put = uses.iter().find(|u| u.op == "put").expect("put");
        assert_eq!((put.local.as_str(), put.remote.as_str()), ("host memory", "host"));
        assert_eq!(put.to_string(), "put host->host: zero-copy cma/memory", "bytes leave local memory");
    }

    #[test]
    fn the_log_table_of_ucx_1_22_gives_the_same_protocols() {
        let text = std::fs::read_to_string(fixtures().join("proto-info-1.22-host.log")).expect("fixture");
        let sels = parse_log(&text);
        let get = summarize(&sels).into_iter().find(|u| u.op == "get").expect("get");
        assert_eq!(get.to_string(), "get host<-host: zero-copy cma/memory");
        assert_eq!(get.local, "host memory");
    }

    #[test]
    fn gpu_lines_from_the_h100_notes_are_recognised_as_emulated_or_zero_copy() {
        // The lines quoted in the project's GPU notes (kvx 296e604 on an H100, UCX 1.22).
        let slow = "\
[1.0] [gpu:1:0]   | ucp_context_0 intra-node cfg#2                              |
[1.0] [gpu:1:0]   | remote memory read by ucp_get* into cuda/GPU0 from cuda      |
[1.0] [gpu:1:0]   +--------+--------------------+-------------------------------+
[1.0] [gpu:1:0]   | 0..inf | software emulation | sysv/memory                   |
";
        let sels = parse_log(slow);
        assert_eq!(sels.len(), 1);
        assert_eq!((sels[0].local.as_str(), sels[0].remote.as_str()), ("cuda/GPU0", "cuda"));
        let u = &summarize(&sels)[0];
        assert!(u.emulated);
        assert_eq!(u.to_string(), "get cuda<-cuda: software emulation sysv/memory");
        let fast = "\
| remote memory read by ucp_get* into cuda/GPU0 from cuda/dev[0] |
| 0..inf | zero-copy | cuda_ipc/cuda |
";
        let u = &summarize(&parse_log(fast))[0];
        assert!(!u.emulated);
        assert_eq!(u.remote, "cuda/dev[0]");
        assert_eq!(u.to_string(), "get cuda<-cuda: zero-copy cuda_ipc/cuda");
        // The same selection as a PROTO_INFO_DIR file name (UCX replaces '/', '[', ']').
        let dot = parse_dot(
            "ucp_context_0_intra_node_cfg_2_get_into_cuda_GPU0_from_cuda_dev_0__0_inf.dot",
            "digraph {\n\tnode0 [label=\"zero-copy\\ncuda_ipc/cuda\" shape=box style=rounded]\n}\n",
        )
        .expect("parsed");
        assert_eq!((memory_kind(&dot.local), memory_kind(&dot.remote)), ("cuda".into(), "cuda".into()));
        assert_eq!((dot.description.as_str(), dot.config.as_str()), ("zero-copy", "cuda_ipc/cuda"));
    }

    #[test]
    fn ranges_merge_only_when_the_choice_is_the_same() {
        let sel = |range: &str, d: &str| ProtoSelection {
            op: "get".into(),
            local: "cuda/GPU0".into(),
            remote: "cuda".into(),
            range: range.into(),
            description: d.into(),
            config: "x".into(),
        };
        let u =
            &summarize(&[sel("8K..inf", "zero-copy"), sel("0..0", "copy-in"), sel("1..8191", "copy-in")])[0];
        assert_eq!(u.choices.len(), 2);
        assert_eq!(u.choices[0].range, "0..8191");
        assert_eq!(u.to_string(), "get cuda<-cuda: 0..8191 copy-in x, 8K..inf zero-copy x");
        assert_eq!(memory_kind("cuda_managed"), "cuda-managed");
        assert_eq!(memory_kind("host memory"), "host");
        assert!(parse_dot("garbage.dot", "").is_none());
        assert!(read_dir(Path::new("/nonexistent-kvx-dir")).is_empty());
    }
}
