//! Helpers of the UCX integration tests: where the two UCX builds are, and how a test
//! says it was skipped.

use std::path::PathBuf;

pub fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A part of the host a test needs, which may be missing here: a test without it says so with
/// [`skip`]. Names as `KVX_REQUIRE` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The project's UCX (`.ucx/`, scripts/setup-ucx.sh).
    Ucx,
    /// Debian's UCX (`libucx0`, `libucx-dev`).
    SystemUcx,
    /// A GPU with its driver (and a UCX with CUDA).
    Gpu,
    /// A host without a GPU: the checks of what kvx says when there is none.
    NoGpu,
    /// Network namespaces (root and `ip`).
    Netns,
    /// A tmpfs to fill (root).
    Tmpfs,
    /// A Python with vllm==0.33.0 (`.venv-vllm`, `KVX_VLLM_PYTHON`).
    Vllm,
    /// vLLM's own NIXL workers (`../shared/vllm-peer`, `KVX_SHARED_DIR`).
    VllmPeer,
}

impl Part {
    const ALL: [Part; 8] = [
        Part::Ucx,
        Part::SystemUcx,
        Part::Gpu,
        Part::NoGpu,
        Part::Netns,
        Part::Tmpfs,
        Part::Vllm,
        Part::VllmPeer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Part::Ucx => "ucx",
            Part::SystemUcx => "system-ucx",
            Part::Gpu => "gpu",
            Part::NoGpu => "no-gpu",
            Part::Netns => "netns",
            Part::Tmpfs => "tmpfs",
            Part::Vllm => "vllm",
            Part::VllmPeer => "vllm-peer",
        }
    }

    /// The UCX build a label of [`ucx_builds`] names.
    pub fn of_build(label: &str) -> Part {
        if label == "system" { Part::SystemUcx } else { Part::Ucx }
    }
}

/// What CI requires when `KVX_REQUIRE` is not set: the parts scripts/setup.sh installs (NIXL's
/// tests never skip: without it they fail).
const CI_REQUIRES: &[Part] = &[Part::Ucx, Part::SystemUcx];

/// The parts this run must have: `KVX_REQUIRE` (comma-separated names; `nixl` is accepted and
/// always required), else [`CI_REQUIRES`] where `CI=true`, else none.
pub fn required(require: Option<&str>, ci: bool) -> Result<Vec<Part>, String> {
    let Some(list) = require else {
        return Ok(if ci { CI_REQUIRES.to_vec() } else { vec![] });
    };
    let mut parts = vec![];
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty() && *n != "nixl") {
        let part = Part::ALL.iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Part::ALL.iter().map(|p| p.name()).collect();
            format!("KVX_REQUIRE names `{name}`, which is none of nixl, {}", names.join(", "))
        })?;
        parts.push(*part);
    }
    Ok(parts)
}

/// Says why a test did not run (part of) its body, for want of `part`. Written straight to the
/// process's stderr (the harness does not capture it) and appended to `KVX_SKIP_LOG` (which
/// scripts/test.sh counts in its summary), so a skip never passes silently. Where `part` is
/// required (`KVX_REQUIRE`, or CI), the test fails instead, naming it.
pub fn skip(part: Part, why: &str) {
    use std::io::Write;
    let require = std::env::var("KVX_REQUIRE").ok();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let parts = required(require.as_deref(), ci).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !parts.contains(&part),
        "{} is required here (KVX_REQUIRE, or CI=true) but missing: {why}",
        part.name()
    );
    let line = format!("SKIPPED [{}]: {why}\n", part.name());
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(log) = std::env::var_os("KVX_SKIP_LOG") {
        // One write of one short line to a file opened for appending: lines from tests running
        // at once do not interleave.
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

#[test]
fn required_parts_come_from_kvx_require_or_ci() {
    assert_eq!(required(None, false), Ok(vec![]));
    assert_eq!(required(None, true), Ok(vec![Part::Ucx, Part::SystemUcx]));
    assert_eq!(required(Some("ucx,nixl"), false), Ok(vec![Part::Ucx]));
    assert_eq!(required(Some(""), true), Ok(vec![]), "an empty list requires nothing, even in CI");
    let err = required(Some("ucx,cuda"), false).expect_err("unknown name");
    assert!(err.contains("`cuda`") && err.contains("system-ucx"), "{err}");
}

/// The UCX builds transfer tests run against: (label, libucp path), or why one is missing.
pub fn ucx_builds() -> Vec<(&'static str, Result<PathBuf, String>)> {
    let project = project_root().join(".ucx/libucx/lib/libucp.so.0");
    let system = [
        "/usr/lib/x86_64-linux-gnu/libucp.so.0",
        "/usr/lib/aarch64-linux-gnu/libucp.so.0",
        "/usr/lib64/libucp.so.0",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file());
    vec![
        (
            "project",
            if project.is_file() {
                Ok(project)
            } else {
                Err("the project's UCX (.ucx/) is not installed: run scripts/setup-ucx.sh".to_string())
            },
        ),
        (
            "system",
            system
                .ok_or_else(|| "Debian's libucp.so.0 is not installed: apt-get install libucx0".to_string()),
        ),
    ]
}
