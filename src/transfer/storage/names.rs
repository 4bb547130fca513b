//! File names of published requests, and the lease sweep.
//!
//! Engine and request ids arrive over the wire, so they never reach the filesystem raw:
//! every byte outside `[A-Za-z0-9_-]` is percent-encoded (so `.`, `/` and `%` cannot form a
//! path component or a separator), an encoding longer than `MAX_NAME_PART` is replaced by
//! `~` and the SHA-256 of the id (the header keeps the full id, so a reader still checks
//! it), and empty ids, ids with a NUL byte and ids over `MAX_ID_BYTES` are refused. The
//! encoding is injective, so two ids never share a file.
//!
//! ```text
//! <engine>.<request>.p<rank>.kvx                   a published request, complete
//! .<engine>.<request>.p<rank>.kvx.<uuid>.tmp       being written (never opened by readers)
//! ```

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::StorageError;

/// Longest id (bytes) kvx accepts.
pub const MAX_ID_BYTES: usize = 1024;
/// Longest encoded id kept verbatim in a file name; longer ones are hashed.
pub const MAX_NAME_PART: usize = 80;
/// Suffix of a complete file.
pub const SUFFIX: &str = "kvx";
/// Suffix of a file being written.
pub const TMP_SUFFIX: &str = "tmp";

/// The file-name form of an engine or request id (`what` names it in errors).
pub fn encode_id(what: &'static str, id: &str) -> Result<String, StorageError> {
    let bad = |reason: String| StorageError::BadId { what, id: shorten(id), reason };
    if id.is_empty() {
        return Err(bad("it is empty".into()));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(bad(format!("it is {} bytes long; at most {MAX_ID_BYTES} are accepted", id.len())));
    }
    if id.contains('\0') {
        return Err(bad("it contains a NUL byte".into()));
    }
    let mut s = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            s.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(s, "%{b:02X}");
        }
    }
    if s.len() > MAX_NAME_PART {
        s = format!("~{}", hex::encode(Sha256::digest(id.as_bytes())));
    }
    Ok(s)
}

/// An id cut to a length that is safe to print in an error.
fn shorten(id: &str) -> String {
    const KEEP: usize = 64;
    if id.len() <= KEEP {
        return id.to_string();
    }
    let mut end = KEEP;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &id[..end], id.len())
}

/// The file name of one published (engine, request, prefill rank).
pub fn file_name(engine_id: &str, request_id: &str, p_rank: u32) -> Result<String, StorageError> {
    Ok(format!(
        "{}.{}.p{p_rank}.{SUFFIX}",
        encode_id("engine id", engine_id)?,
        encode_id("request id", request_id)?
    ))
}

/// Where the complete file of one (engine, request, prefill rank) lives under `dir`.
pub fn request_path(
    dir: &Path,
    engine_id: &str,
    request_id: &str,
    p_rank: u32,
) -> Result<PathBuf, StorageError> {
    Ok(dir.join(file_name(engine_id, request_id, p_rank)?))
}

/// A unique temporary name for writing `final_name`.
pub fn tmp_name(final_name: &str) -> String {
    format!(".{final_name}.{}.{TMP_SUFFIX}", uuid::Uuid::new_v4().simple())
}

/// What a name in the directory is, if it is kvx's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedName<'a> {
    pub engine: &'a str,
    pub request: &'a str,
    pub p_rank: u32,
    pub tmp: bool,
}

/// Parses a directory entry's name; `None` for anything kvx did not write.
pub fn parse_name(name: &str) -> Option<ParsedName<'_>> {
    let (tmp, rest) = match name.strip_prefix('.') {
        Some(rest) => {
            let rest = rest.strip_suffix(TMP_SUFFIX)?.strip_suffix('.')?;
            // Drop the uuid part.
            let (rest, _uuid) = rest.rsplit_once('.')?;
            (true, rest)
        }
        None => (false, name),
    };
    let parts: Vec<&str> = rest.split('.').collect();
    let [engine, request, rank, suffix] = parts.as_slice() else {
        return None;
    };
    if *suffix != SUFFIX || engine.is_empty() || request.is_empty() {
        return None;
    }
    let p_rank = rank.strip_prefix('p')?.parse().ok()?;
    Some(ParsedName { engine, request, p_rank, tmp })
}

/// What a sweep removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Complete files whose lease had expired.
    pub expired: u64,
    /// Temporary files left by writers that never finished.
    pub abandoned: u64,
    pub bytes: u64,
}

/// Removes kvx files under `dir` last modified more than `lease` before `now`, keeping
/// only those `keep` rejects. Files that vanish meanwhile (released concurrently) are
/// skipped, so sweeps and releases may race.
pub fn sweep(
    dir: &Path,
    lease: Duration,
    now: SystemTime,
    mut keep: impl FnMut(&ParsedName<'_>) -> bool,
) -> Result<SweepStats, StorageError> {
    let io = |op: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| StorageError::Io { op, path, source }
    };
    let mut stats = SweepStats::default();
    for entry in fs::read_dir(dir).map_err(io("list", dir))? {
        let entry = entry.map_err(io("list", dir))?;
        let name = entry.file_name();
        let Some(parsed) = name.to_str().and_then(parse_name) else { continue };
        if keep(&parsed) {
            continue;
        }
        let path = entry.path();
        let meta = match entry.metadata() {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io("stat", &path)(e)),
        };
        let modified = meta.modified().map_err(io("stat", &path))?;
        // A clock that went backwards (or skew on a network filesystem) reads as "fresh".
        if now.duration_since(modified).unwrap_or_default() <= lease {
            continue;
        }
        match fs::remove_file(&path) {
            Ok(()) => {
                stats.bytes += meta.len();
                if parsed.tmp {
                    stats.abandoned += 1;
                } else {
                    stats.expired += 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove", &path)(e)),
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_ids_stay_one_component() {
        for id in ["../x", "/", "..", ".", "a/b", "a.b", "%2E", "~x", "é", " "] {
            let e = encode_id("request id", id).expect("encodable");
            assert!(!e.contains(['/', '.']) && !e.is_empty(), "{id:?} -> {e:?}");
        }
        assert_eq!(encode_id("request id", "../x").expect("ok"), "%2E%2E%2Fx");
        assert_eq!(encode_id("request id", "cmpl-ab_9").expect("ok"), "cmpl-ab_9");
    }

    #[test]
    fn encoding_is_injective_on_tricky_pairs() {
        let pairs = [("a.b", "a%2Eb"), ("a/b", "a%2Fb"), ("%", "%25"), ("~", "%7E")];
        for (x, y) in pairs {
            assert_ne!(encode_id("id", x).expect("ok"), encode_id("id", y).expect("ok"), "{x} vs {y}");
        }
    }

    #[test]
    fn refused_ids_say_why() {
        for (id, why) in [("", "empty"), ("a\0b", "NUL"), (&"x".repeat(MAX_ID_BYTES + 1)[..], "bytes long")] {
            let e = encode_id("request id", id).expect_err("refused").to_string();
            assert!(e.contains(why) && e.contains("request id"), "{e}");
            assert!(e.len() < 400, "error stays printable: {} bytes", e.len());
        }
    }

    #[test]
    fn long_ids_are_hashed_and_distinct() {
        let a = encode_id("id", &"a".repeat(300)).expect("ok");
        let b = encode_id("id", &format!("{}b", "a".repeat(299))).expect("ok");
        assert!(a.starts_with('~') && a.len() == 65);
        assert_ne!(a, b);
    }

    #[test]
    fn names_parse_back() {
        let f = file_name("eng", "../r", 7).expect("ok");
        let p = parse_name(&f).expect("kvx name");
        assert_eq!(p, ParsedName { engine: "eng", request: "%2E%2E%2Fr", p_rank: 7, tmp: false });
        let t = tmp_name(&f);
        assert_eq!(parse_name(&t).map(|p| (p.p_rank, p.tmp)), Some((7, true)));
        for other in ["notes.txt", "a.b.p1.kvy", ".a.b.p1.kvx", "a.b.px.kvx", "a..p1.kvx"] {
            assert_eq!(parse_name(other), None, "{other}");
        }
    }
}
