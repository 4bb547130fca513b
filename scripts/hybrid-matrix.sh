#!/usr/bin/env bash
# Every hybrid preset at every TP pair (1, 2, 4, 8 on each side) through `kvx bench`: vLLM's
# refusal (exit 2), every request verified (exit 0), or bytes landing wrong by vLLM's rules
# (exit 1, rerun with --state-slices exact where the switch applies). One line per run in
# results/docs/hybrid-matrix/out.txt (preset, P, D, exit, ok, failed, verify failures, leaked,
# bytes verified of bytes read, and the first line of the error or wrong bytes).
#
# MODE=push runs push mode (vLLM's push connector) into results/docs/hybrid-matrix-push/, and
# reruns a pair that lands wrong with both switches (--state-slices exact --push-attention
# every-rank).
#
#   [MODE=pull|push] scripts/hybrid-matrix.sh [PRESET ...]     (no names: every hybrid preset)
set -uo pipefail
cd "$(dirname "$0")/.."
KVX=${KVX:-target/release/kvx}
MODE=${MODE:-pull}
OUT=results/docs/hybrid-matrix
[ "$MODE" = pull ] || OUT=results/docs/hybrid-matrix-$MODE
mkdir -p "$OUT"
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(qwen3-next-80b-a3b nemotron-h-8b granite-4.0-h-tiny jamba-v0.1 falcon-h1-7b gpt-oss-120b gemma-3-4b)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "preset p_tp d_tp state_slices exit ok failed verify_failures leaked verified/read first_error" >"$OUT/out.txt"
for m in "${presets[@]}"; do
  for p in 1 2 4 8; do
    for d in 1 2 4 8; do
      for slices in vllm exact; do
        status=0
        extra=()
        [ "$MODE" = push ] && extra=(--mode push)
        [ "$MODE" = push ] && [ "$slices" = exact ] && extra+=(--push-attention every-rank)
        "$KVX" bench --model "$m" --p-tp "$p" --d-tp "$d" --prompt-len 600 --requests 3 --warmup 0 \
          --concurrency 1 --verify full --state-slices "$slices" "${extra[@]}" --results-dir "$tmp" --format json \
          >"$tmp/s.json" 2>"$tmp/err.txt" || status=$?
        line=$(python3 - "$tmp/s.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(d["requests_ok"], d["requests_failed"], d["verify_failures"], d["blocks_leaked"],
          f'{d["bytes_verified"]}/{d["bytes_read"]}')
except Exception:
    print("- - - - -")
PY
)
        err=$(grep -m1 -E '^error|verification failed' "$tmp/err.txt" | sed 's/^ *//' | cut -c1-160)
        label=$slices
        [ "$MODE" = push ] && [ "$slices" = exact ] && label=exact,every-rank
        echo "$m $p $d $label $status $line ${err:--}" >>"$OUT/out.txt"
        # The switch only where vLLM's rule read wrong bytes.
        [ "$status" = 1 ] || break
      done
    done
  done
done
cat "$OUT/out.txt"
