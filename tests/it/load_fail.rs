//! `kvx load` against a target that fails: bounded work and memory, backoff, the exit code.

use std::time::Duration;

use crate::common::kvx;

/// A loopback port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[test]
fn a_huge_concurrency_is_capped_by_the_requests_it_has_to_send() {
    // One worker per concurrency slot used to be spawned: 1e8 of them exhausted the memory.
    let url = format!("http://127.0.0.1:{}/", closed_port());
    let results = tempfile::tempdir().expect("temp dir");
    let out = kvx()
        .args(["load", "--url", &url, "--requests", "10", "--concurrency", "100000000"])
        .arg("--results-dir")
        .arg(results.path())
        .timeout(Duration::from_secs(60))
        .output()
        .expect("run kvx load");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(1), "every request failed, the run completed: {stderr}");
    assert!(stderr.contains("\"connect\": 10"), "all 10 requests were tried: {stderr}");
}

#[test]
fn a_failing_target_is_backed_off_not_hammered() {
    let url = format!("http://127.0.0.1:{}/", closed_port());
    let results = tempfile::tempdir().expect("temp dir");
    let out = kvx()
        .args(["load", "--url", &url, "--duration", "2", "--concurrency", "4", "--format", "json"])
        .arg("--results-dir")
        .arg(results.path())
        .timeout(Duration::from_secs(60))
        .output()
        .expect("run kvx load");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Without a backoff the 4 workers sent about 20,000 requests a second to a closed port.
    let errors: u64 = stderr
        .split("\"connect\": ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("error counts on stderr: {stderr}"));
    assert!(errors <= 4 * 10, "{errors} requests in 2 s to a closed port: {stderr}");
}
