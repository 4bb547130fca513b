//! Helpers of the UCX integration tests: where the two UCX builds are, and how a test
//! says it was skipped.

use std::path::PathBuf;

pub fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Says why a test did not run (part of) its body. Written straight to the process's
/// stderr, which the test harness does not capture, so the skip shows in every test run
/// (and in scripts/test.sh's log) instead of passing silently.
pub fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
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
