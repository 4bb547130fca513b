#!/usr/bin/env bash
# Measures kvx gate's false-alarm and detection rates on this machine: N runs of the CI preset
# with the build unchanged (every one should pass), and N runs with a setting that costs at
# least 15% (every one should be flagged). Usage:
#   scripts/gate-check.sh [N] [SLOWDOWN_FLAGS...]      (defaults: 20, --slowdown 0.15)
# PRESET and BASELINE choose the preset and its baseline (defaults: bench-configs/ci.toml and
# results/baseline.json; the hybrid one: bench-configs/ci-hybrid.toml, results/baseline-hybrid.json).
# REFERENCE=KVX_BINARY gates each run against a run of that build made just before or after it
# on this machine (alternating which goes first), as step 2 of scripts/ci-gate.sh does, instead
# of against BASELINE. THRESHOLDS="FILE ..." judges every run with each file laid over the
# built-in thresholds (`-` for the built-in ones alone); the first decides the printed verdicts.
# COUNTS=FILE writes the counts as JSON (the first thresholds' at the top, all under
# `by_thresholds`), for a results file the docs can quote.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
shift || true
SLOW=("$@")
[ ${#SLOW[@]} -gt 0 ] || SLOW=(--slowdown 0.15)
KVX=${KVX:-./target/release/kvx}
PRESET=${PRESET:-bench-configs/ci.toml}
BASELINE=${BASELINE:-results/baseline.json}
REFERENCE=${REFERENCE:-}
read -r -a TH <<< "${THRESHOLDS:--}"
OUT=$(mktemp -d)
declare -A pass alarm flagged missed
for t in "${TH[@]}"; do pass[$t]=0; alarm[$t]=0; flagged[$t]=0; missed[$t]=0; done
errors=0
k=0
bench() { # $1 = binary, $2 = dir, rest = extra flags
  mkdir -p "$2"
  "$1" bench --config "$PRESET" --results-dir "$2" --format json "${@:3}" > "$2/summary.json" 2> "$2/bench.log"
}
run() { # $1 = label, rest = extra bench flags; sets RCS: the gate's exit code per thresholds file
  local dir="$OUT/$1" base="$BASELINE" ok=1
  k=$((k + 1))
  if [ -n "$REFERENCE" ]; then
    base="$OUT/$1/reference/summary.json"
    if [ $((k % 2)) -eq 1 ]; then
      bench "$REFERENCE" "$OUT/$1/reference" && bench "$KVX" "$dir" "${@:2}" || ok=0
    else
      bench "$KVX" "$dir" "${@:2}" && bench "$REFERENCE" "$OUT/$1/reference" || ok=0
    fi
  else
    bench "$KVX" "$dir" "${@:2}" || ok=0
  fi
  local i=0
  RCS=()
  for t in "${TH[@]}"; do
    i=$((i + 1))
    if [ "$ok" = 0 ]; then RCS+=(2); continue; fi
    local extra=()
    [ "$t" = - ] || extra=(--thresholds "$t")
    "$KVX" gate --baseline "$base" --current "$dir/summary.json" "${extra[@]}" > "$dir/gate-$i.txt" 2>&1
    RCS+=($?)
  done
}
tally() { # $1 = unchanged|slowed, rest = one exit code per thresholds file
  local kind=$1 i=0
  shift
  for rc in "$@"; do
    local t=${TH[$i]}
    i=$((i + 1))
    case $kind:$rc in
      unchanged:0) pass[$t]=$((pass[$t] + 1));; unchanged:1) alarm[$t]=$((alarm[$t] + 1));;
      slowed:1) flagged[$t]=$((flagged[$t] + 1));; slowed:0) missed[$t]=$((missed[$t] + 1));;
      *) [ "$i" -eq 1 ] && errors=$((errors + 1));;
    esac
  done
}
for i in $(seq 1 "$N"); do
  run "same-$i"
  tally unchanged "${RCS[@]}"
  echo "unchanged run $i: gate exit ${RCS[*]}"
done
for i in $(seq 1 "$N"); do
  run "slow-$i" "${SLOW[@]}"
  tally slowed "${RCS[@]}"
  echo "slowed run $i (${SLOW[*]}): gate exit ${RCS[*]}"
done
against=${REFERENCE:+a run of $REFERENCE beside each}
against=${against:-$BASELINE}
for t in "${TH[@]}"; do
  echo "thresholds ${t/#-/built-in}, against $against:"
  echo "  unchanged build: ${pass[$t]} of $N passed, ${alarm[$t]} false alarms"
  echo "  slowdown (${SLOW[*]}): ${flagged[$t]} of $N flagged, ${missed[$t]} missed"
done
echo "errors: $errors   (runs kept in $OUT)"
if [ -n "${COUNTS:-}" ]; then
  t0=${TH[0]}
  by=""
  for t in "${TH[@]}"; do
    by+="${by:+, }\"$t\": {\"unchanged_passed\": ${pass[$t]}, \"false_alarms\": ${alarm[$t]}, \"slowed_flagged\": ${flagged[$t]}, \"slowed_missed\": ${missed[$t]}}"
  done
  ref=${REFERENCE:+beside each run: a run of the reference build}
  printf '{"preset": "%s", "baseline": "%s", "runs": %s, "slowdown": "%s", "unchanged_passed": %s, "false_alarms": %s, "slowed_flagged": %s, "slowed_missed": %s, "errors": %s, "by_thresholds": {%s}}\n' \
    "$PRESET" "${ref:-$BASELINE}" "$N" "${SLOW[*]}" "${pass[$t0]}" "${alarm[$t0]}" "${flagged[$t0]}" "${missed[$t0]}" "$errors" "$by" > "$COUNTS"
fi
