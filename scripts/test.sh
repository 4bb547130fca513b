#!/usr/bin/env bash
# Runs kvx's whole test suite. Transfer tests run once per UCX build found on this host
# (the project's own modern UCX and Debian's system UCX).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
cargo test --release --locked --all-targets --no-fail-fast 2>&1 | tee target/test-output.log | grep -E '^(test result|running|     Running|error|failures|---- )|FAILED|panicked' || true
if grep -qE 'test result: FAILED|error(\[|:)' target/test-output.log; then
  echo "kvx tests: FAILED"; exit 1
fi
passed=$(grep -oE '[0-9]+ passed' target/test-output.log | awk '{s+=$1} END {print s+0}')
failed=$(grep -oE '[0-9]+ failed' target/test-output.log | awk '{s+=$1} END {print s+0}')
ignored=$(grep -oE '[0-9]+ ignored' target/test-output.log | awk '{s+=$1} END {print s+0}')
echo "kvx tests: ${passed} passed, ${failed} failed, ${ignored} ignored"
