#!/usr/bin/env bash
# Runs the host-memory measurements the README and docs/ quote, and keeps each one's output
# under results/docs/<name>/: `out.txt` (what the command printed on stdout), `summary.json`
# (its run's summary, for runs that write one) and `cmd` (the command). `xfer-rates` is also
# where `kvx plan`'s built-in host rates come from (src/layouts/rates.rs): rebuild after it. Figures in README.md and docs/ are read from
# these files by the docs check (tests/it/docs.rs); after running this, refresh them with
# `scripts/docs-figures.sh` and commit results/docs/ with the docs.
#
#   scripts/docs-runs.sh [NAME ...]     (no names: every run; see `runs` below)
#
# Measured on whatever machine runs it: commit the results of a quiet machine, and say which
# in the commit message. Paths of this machine are made relative to the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
KVX=${KVX:-target/release/kvx}
OUT=results/docs
root=$(pwd)

# name | kvx arguments (the results dir and output format are added) | the exit status the run
# must end with (default 0; a run that shows wrong bytes ends with 1, and its stderr is kept in
# `err.txt`)
runs() {
  cat <<'EOF'
bench-p8d2|bench --p-tp 8 --d-tp 2
verify-full|bench --p-tp 8 --d-tp 2 --verify full --repeat 5
verify-sample|bench --p-tp 8 --d-tp 2 --verify sample --repeat 5
compare-modes|bench --p-tp 8 --d-tp 2 --compare-modes pull,push --requests 20 --repeat 3
kv-buffer|bench --p-tp 8 --d-tp 2 --compare-kv-buffer-device cuda,cpu --requests 20 --repeat 3
overlap|bench --p-tp 8 --d-tp 2 --compare-modes pull,push --overlap layers --prefill-time-per-layer 2500us --concurrency 1 --requests 20 --repeat 3
serve-pull|bench --serve --p-tp 2 --d-tp 2 --model llama-3.1-8b --prompt-len 1024 --requests 60
serve-push-sequential|bench --serve --mode push --p-tp 2 --d-tp 2 --model llama-3.1-8b --prompt-len 1024 --requests 60
serve-push-concurrent|bench --serve --mode push --dispatch concurrent --p-tp 2 --d-tp 2 --model llama-3.1-8b --prompt-len 1024 --requests 60
compare-transports|bench --p-tp 2 --d-tp 2 --model llama-3.1-8b --compare-transports ucx,storage,multi --requests 20 --repeat 3
waterfall|bench --serve --p-tp 1 --d-tp 1 --model llama-3.1-8b --layers 2 --prompt-len 32 --requests 80 --concurrency 1
xfer|xfer --sizes 64KiB,1MiB --inflight 1,8
nixl-compare|bench --p-tp 8 --d-tp 2 --compare-transports ucx,nixl --rounds 5
nixl-xfer|xfer --compare-transports ucx,nixl --sizes 64KiB,1MiB --inflight 1,8,32 --rounds 3
nixl-xfer-reuse|xfer --compare-transports ucx,nixl --sizes 64KiB,1MiB --inflight 1,8,32 --nixl-requests reuse --rounds 3
xfer-rates|xfer --sizes 8KiB,1MiB --inflight 64 --duration 1s --format json
plan-p8d2|plan --p-tp 8 --d-tp 2 --model llama-3.1-70b --prompt-len 4096
hybrid-falcon-vllm|bench --model falcon-h1-7b --p-tp 1 --d-tp 2 --prompt-len 2000 --requests 2 --warmup 0|1
hybrid-falcon-exact|bench --model falcon-h1-7b --p-tp 1 --d-tp 2 --prompt-len 2000 --requests 2 --warmup 0 --state-slices exact
hybrid-falcon-p2d1-vllm|bench --model falcon-h1-7b --p-tp 2 --d-tp 1 --prompt-len 2000 --requests 2 --warmup 0|1
hybrid-falcon-p2d1-exact|bench --model falcon-h1-7b --p-tp 2 --d-tp 1 --prompt-len 2000 --requests 2 --warmup 0 --state-slices exact
serve-hybrid|bench --serve --model qwen3-next-80b-a3b --p-tp 2 --d-tp 1 --prompt-len 2048 --requests 40
hybrid-head-slots-lbnhc|bench --model tests/fixtures/hybrid-model-tiny-g8.toml --p-tp 8 --d-tp 1 --layout LBNHC --kernel-block-size 16 --no-prefix-caching --prompt-len 600 --requests 2 --warmup 0 --verify full|1
hybrid-head-slots-lbhnc|bench --model tests/fixtures/hybrid-model-tiny-g8.toml --p-tp 8 --d-tp 1 --layout LBHNC --kernel-block-size 16 --no-prefix-caching --prompt-len 600 --requests 2 --warmup 0 --verify full
hybrid-vs-xfer|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --verify full
hybrid-vs-xfer-sample|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --verify sample
hybrid-vs-xfer-unverified|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --verify off
hybrid-vs-xfer-c1|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --concurrency 1 --verify full
hybrid-vs-xfer-c1-sample|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --concurrency 1 --verify sample
hybrid-vs-xfer-c1-unverified|bench --config bench-configs/hybrid-qwen3-next.toml --requests 400 --concurrency 1 --verify off
hybrid-compare-modes|bench --model nemotron-h-8b --p-tp 2 --d-tp 1 --prompt-len 2000 --compare-modes pull,push --requests 20 --repeat 3
hybrid-push-attention-vllm|bench --mode push --model qwen3-next-80b-a3b --p-tp 1 --d-tp 4 --block-size 544 --prompt-len 2048 --requests 2 --warmup 0|1
hybrid-push-attention-every-rank|bench --mode push --model qwen3-next-80b-a3b --p-tp 1 --d-tp 4 --block-size 544 --prompt-len 2048 --requests 2 --warmup 0 --push-attention every-rank --verify full
hybrid-push-replicated-heads|bench --mode push --model qwen3-next-80b-a3b --p-tp 4 --d-tp 1 --block-size 544 --prompt-len 2048 --requests 2 --warmup 0 --verify full
hybrid-hostbuf-vllm|bench --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 --requests 2 --warmup 0 --kv-buffer-device cpu|1
hybrid-hostbuf-per-group|bench --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 --requests 2 --warmup 0 --kv-buffer-device cpu --host-copy per-group|1
hybrid-hostbuf-fixed|bench --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 --requests 2 --warmup 0 --kv-buffer-device cpu --host-copy per-group --host-state-page padded
hybrid-kv-buffer|bench --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 --requests 8 --concurrency 1 --compare-kv-buffer-device cuda,cpu --host-copy per-group --host-state-page padded
hybrid-kv-buffer-own|bench --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 --requests 8 --concurrency 1 --compare-kv-buffer-device cuda,cpu --host-copy per-group --host-state-page padded --host-descriptors per-group
EOF
}

want=("$@")
runs | while IFS='|' read -r name args expect; do
  if [ ${#want[@]} -gt 0 ] && [[ ! " ${want[*]} " == *" $name "* ]]; then continue; fi
  dir="$OUT/$name"
  rm -rf "$dir" && mkdir -p "$dir/run"
  echo "docs-runs: $name: kvx $args" >&2
  echo "kvx $args" >"$dir/cmd"
  # shellcheck disable=SC2086
  if [[ $args == xfer* || $args == plan* ]]; then
    $KVX $args >"$dir/out.txt"
  else
    status=0
    $KVX $args --results-dir "$dir/run" >"$dir/out.txt" 2>"$dir/err.txt" || status=$?
    if [ "$status" != "${expect:-0}" ]; then
      echo "docs-runs: $name exited $status, not ${expect:-0}" >&2
      cat "$dir/err.txt" >&2
      exit 1
    fi
    [ "$status" = 0 ] && rm -f "$dir/err.txt"
    # One run directory, or one per compared mode or transport (named after its directory).
    mapfile -t sums < <(find "$dir/run" -name summary.json | sort)
    if [ ${#sums[@]} -eq 1 ]; then
      cp "${sums[0]}" "$dir/summary.json"
    else
      for s in "${sums[@]}"; do cp "$s" "$dir/$(basename "$(dirname "$s")").summary.json"; done
    fi
  fi
  rm -rf "$dir/run"
  # No path of this machine in a committed file.
  sed -i "s#$root/#./#g; s#$dir/run/#results/#g" "$dir"/*
done
