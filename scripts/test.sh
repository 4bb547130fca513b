#!/usr/bin/env bash
# Runs kvx's whole test suite (unit tests, and the integration tests that drive the real kvx
# binary, real UCX, real ZMQ, real HTTP and real processes). Transfer tests run against every
# UCX build found on this host: the project's own (.ucx/, from scripts/setup-ucx.sh) and
# Debian's system UCX. A part of the host a test needs that is missing (a UCX build, a GPU,
# network namespaces, vLLM) is reported as SKIPPED with the reason and counted in the summary;
# with CI=true the parts scripts/setup.sh installs are required, and KVX_REQUIRE=ucx,... names
# them explicitly: a required part that is missing fails its tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
mkdir -p target
# Everything the tests start (kvx runs, engines, workers) keeps its temp files here, not in
# /tmp: a test that kills kvx on purpose leaves nothing where the user would see it.
export TMPDIR="$PWD/target/test-tmp"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
export KVX_SKIP_LOG="$PWD/target/test-skips.log"
rm -f "$KVX_SKIP_LOG"
cargo test --release --locked --lib --bins --tests --no-fail-fast 2>&1 | tee target/test-output.log
status=${PIPESTATUS[0]}
echo
echo "== test summary =="
grep -E '^test result:' target/test-output.log
passed=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')
ignored=$(grep -E '^test result:' target/test-output.log | grep -oE '[0-9]+ ignored' | awk '{s+=$1} END {print s+0}')
skipped=0
if [ -s "$KVX_SKIP_LOG" ]; then
    skipped=$(wc -l <"$KVX_SKIP_LOG")
    echo "skipped (a part of this host missing; not a pass):"
    sort "$KVX_SKIP_LOG" | uniq -c | sed 's/^/  /'
fi
echo "kvx tests: ${passed} passed, ${skipped} skipped, ${failed} failed, ${ignored} ignored (cargo exit ${status})"
exit "$status"
