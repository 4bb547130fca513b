#!/usr/bin/env bash
# Runs kvx's whole test suite (unit tests, and the integration tests that drive the real kvx
# binary, real UCX, real ZMQ, real HTTP and real processes). Transfer tests run against every
# UCX build found on this host: the project's own (.ucx/, from scripts/setup-ucx.sh) and
# Debian's system UCX; a build that is missing is reported as SKIPPED with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p target
# Everything the tests start (kvx runs, engines, workers) keeps its temp files here, not in
# /tmp: a test that kills kvx on purpose leaves nothing where the user would see it.
export TMPDIR="$PWD/target/test-tmp"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
cargo test --release --locked --lib --bins --tests --no-fail-fast 2>&1 | tee target/test-output.log
status=${PIPESTATUS[0]}
echo
echo "== test summary =="
grep -E '^test result:' target/test-output.log
passed=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')
ignored=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ ignored' | awk '{s+=$1} END {print s+0}')
echo "kvx tests: ${passed} passed, ${failed} failed, ${ignored} ignored (cargo exit ${status})"
exit "$status"
