#!/usr/bin/env bash
# Measures kvx gate's false-alarm and detection rates on this machine: N runs of the CI preset
# with the build unchanged (every one should pass), and N runs with a setting that costs at
# least 15% (every one should be flagged). Usage:
#   scripts/gate-check.sh [N] [SLOWDOWN_FLAGS...]      (defaults: 20, --slowdown 0.15)
# PRESET and BASELINE choose the preset and its baseline (defaults: bench-configs/ci.toml and
# results/baseline.json; the hybrid one: bench-configs/ci-hybrid.toml, results/baseline-hybrid.json).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
shift || true
SLOW=("$@")
[ ${#SLOW[@]} -gt 0 ] || SLOW=(--slowdown 0.15)
KVX=${KVX:-./target/release/kvx}
PRESET=${PRESET:-bench-configs/ci.toml}
BASELINE=${BASELINE:-results/baseline.json}
OUT=$(mktemp -d)
pass=0; alarm=0; flagged=0; missed=0; errors=0
run() { # $1 = label, rest = extra bench flags; prints the gate's exit code
  local dir="$OUT/$1"
  mkdir -p "$dir"
  "$KVX" bench --config "$PRESET" --results-dir "$dir" --format json "${@:2}" > "$dir/summary.json" 2> "$dir/bench.log" || { echo 2; return; }
  "$KVX" gate --baseline "$BASELINE" --current "$dir/summary.json" > "$dir/gate.txt" 2>&1
  echo $?
}
for i in $(seq 1 "$N"); do
  rc=$(run "same-$i")
  case $rc in 0) pass=$((pass+1));; 1) alarm=$((alarm+1));; *) errors=$((errors+1));; esac
  echo "unchanged run $i: gate exit $rc"
done
for i in $(seq 1 "$N"); do
  rc=$(run "slow-$i" "${SLOW[@]}")
  case $rc in 1) flagged=$((flagged+1));; 0) missed=$((missed+1));; *) errors=$((errors+1));; esac
  echo "slowed run $i (${SLOW[*]}): gate exit $rc"
done
echo "unchanged build: $pass of $N passed, $alarm false alarms"
echo "slowdown (${SLOW[*]}): $flagged of $N flagged, $missed missed"
echo "errors: $errors   (runs kept in $OUT)"
# The counts as JSON too (COUNTS=FILE), for a results file the docs can quote.
if [ -n "${COUNTS:-}" ]; then
  printf '{"preset": "%s", "baseline": "%s", "runs": %s, "slowdown": "%s", "unchanged_passed": %s, "false_alarms": %s, "slowed_flagged": %s, "slowed_missed": %s, "errors": %s}\n' \
    "$PRESET" "$BASELINE" "$N" "${SLOW[*]}" "$pass" "$alarm" "$flagged" "$missed" "$errors" > "$COUNTS"
fi
