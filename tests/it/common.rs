//! Helpers shared by the integration tests.

use std::path::PathBuf;
use std::time::Duration;

/// Hard timeout for any command a test runs.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(120);

/// The oracle directory: `../shared/oracle` beside the project if present, else the copy
/// under `tests/fixtures/oracle`.
pub fn oracle_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/oracle");
    if shared.join("rank_maps.json").exists() { shared } else { root.join("tests/fixtures/oracle") }
}

/// Reads and parses one oracle file.
pub fn oracle(name: &str) -> serde_json::Value {
    let path = oracle_dir().join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// The `kvx` binary under test, with a hard timeout.
pub fn kvx() -> assert_cmd::Command {
    let mut cmd = assert_cmd::Command::cargo_bin("kvx").expect("kvx binary is built");
    cmd.timeout(CMD_TIMEOUT);
    cmd
}
