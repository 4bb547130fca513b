#!/usr/bin/env bash
# GPU acceptance run: where kvx stands on device memory on this machine, in one command.
#
#   scripts/gpu-check.sh [--ucx-lib PATH] [--out DIR]
#
# Runs, each step recorded and never stopping the others:
#   1. kvx doctor (CUDA driver, devices, UCX with CUDA, a cuda_ipc read between two processes)
#   2. kvx xfer --mem cuda over 8 KiB..16 MiB at 1, 32, 64 and 128 reads in flight
#   3. kvx bench --mem cuda --p-tp 8 --d-tp 2 (and kvx xfer --mem cuda at the bench's descriptor size)
#   4. peers, each against a kvx run made like for like, with every difference that remains
#      printed beside the ratio:
#      a. ucx_perftest -t ucp_get -m cuda,cuda (from the UCX given) against kvx xfer --hot
#         --inflight 1 (one buffer, one GET at a time, as ucx_perftest) on the same UCX library
#      b. NIXL VRAM READs (scripts/peers/nixl_peer.py, if python3 imports nixl and torch: one
#         transfer of 64 MiB of B-byte blocks, error mode peer) against kvx xfer --err-mode peer
#         --sizes B --inflight 64MiB/B --working-set 64MiB, on NIXL's own UCX library when kvx
#         can load it (else kvx's, said beside the ratio)
#   5. --transport cuda-batch (one batched copy per peer over CUDA IPC): kvx bench with every byte
#      verified; kvx xfer at 8 KiB..16 MiB, up to 10,240 reads a batch (a P8->D2 70B request's
#      per peer); kvx bench --p-tp 8 --d-tp 2 --compare-transports ucx,cuda-batch; each with kvx's
#      gather-copy kernel (the default) and with the driver's batch API (--batch-copy api); the
#      same comparison with each request alone (--concurrency 1)
#   6. every --batch-copy path (kernel, api, api-v2, api-v1, per-copy) at 8 KiB x 10,240, verified,
#      16-byte aligned and not (--misalign 3: both sides agree modulo 16; --misalign 0,1: they
#      differ), with the unaligned/aligned ratios; a path this driver lacks is recorded skipped
#   7. kvx bench --mem cuda --p-tp 8 --d-tp 2 --mode push (prefill ranks WRITE), against the
#      same shape pulled (step 3)
#  7b. hostbuf and hybrid: host buffers on device memory (--compare-kv-buffer-device cuda,cpu);
#      hybrid models on device memory (Qwen3-Next P4->D2 every byte checked, over UCX and over
#      --transport cuda-batch; Nemotron-H direct
#      against host buffers with kvx's three switches; Falcon-H1 P1->D2 and P2->D1 by vLLM's
#      state slices, where exit 1 naming the wrong bytes is the expected outcome, and with
#      --state-slices exact; gpt-oss-120b's sliding window P2->D2)
#   8. launches: cuda-batch P8->D2 Llama-3.1-70B (8 KiB descriptors) with one batch per request
#      per decode rank (--batch-launch rank) and one per peer (peer), at --concurrency 1 and 2,
#      and the same under MPS when nvidia-cuda-mps-control can start it; and P8->D1 (one decode
#      rank alone on the GPU) for what sharing the GPU costs
#  8b. device: step 8's runs (and P8->D2 every byte verified) with --batch-descriptors device:
#      the plan's region table and block ids uploaded, a kernel makes the gather kernel's
#      descriptors on the GPU
#   9. serve: kvx serve-engine --mem cuda (prefill and decode, TP 2 each, short leases) behind
#      kvx serve-proxy, driven by kvx load for GPU_CHECK_SERVE_SECONDS, while prefill legs that
#      no decode ever reads are sent straight to the prefill engine (their leases expire and
#      their blocks are reused); then each engine's /metrics: KV usage, blocks held, leases
#      expired, bytes verified and verify failures, and the leaks each engine reports on exit
#  10. gate: the GPU preset (bench-configs/gpu.toml) run as a baseline, again unchanged, and
#      again with --slowdown 0.15, each judged by kvx gate --thresholds bench-configs/gates-gpu.toml
#      (and against results/baseline-gpu.json when it exists)
#  11. mps: step 8's runs (concurrency 1 and 2, GPU_CHECK_MPS_LAUNCHES) under the MPS control
#      daemon, when it starts
# and prints a table of ratios: kvx vs NIXL and ucx_perftest (like for like), kvx vs the same-run
# device copy at 16 MiB, bench vs xfer, cuda-batch vs UCX cuda_ipc, a request's span-based
# bandwidth (summary.json's transfer_bandwidth.span_gbps: all ranks' bytes over the wall span
# from the first rank's start to the last rank's end) against the device's bandwidth, unaligned
# vs aligned per batch-copy path. What one H100 gave: docs/gpu-h100.md (no figures kept); the H200 runs: results/gpu-nvidia-h200-*.
# Needs no network.
#
# Results: every step's command, status (ok, failed or skipped: a step skipped for the budget is
# never ok), seconds, and the JSON kvx printed, with the card's name, the driver and the ratio
# table, go to one file, $OUT/gpu-check.json. It is meant to be committed as
# results/gpu-<card>-<date>.json (the script prints that name); paths in it are made relative
# ($OUT, a bundle's directory as kvx-bundle, the repository, $HOME).
#
# Environment:
#   KVX_BIN        a kvx binary to use (the GPU host may have no Rust); default: ./kvx in a bundle
#                  of scripts/bundle.sh, else build one with `cargo build --release --features cuda`
#   KVX_UCX_LIB    libucp.so.0 of a UCX built with CUDA, or the unpacked wheel directory of
#                  libucx-cu12/libucx-cu13 (same as --ucx-lib); default: kvx's own search (.ucx/)
#   UCX_PERFTEST   ucx_perftest to use as a peer; default: bin/ucx_perftest beside the UCX library
#   PYTHON         python3 with nixl and torch for the NIXL peer; default: python3
#   GPU_CHECK_OUT  where reports go; default: target/gpu-check/<time>
#   GPU_CHECK_BATCH_COPIES  which --batch-copy ways step 5 measures; default: "kernel api"
#   GPU_CHECK_PATHS  which --batch-copy paths step 6 measures; default: "kernel api api-v2 api-v1 per-copy"
#   GPU_CHECK_STEPS  which steps to run, by name: doctor xfer bench perftest nixl batch paths push
#                  hostbuf hybrid launch device serve gate mps (default: all of them, in that order)
#   GPU_CHECK_MPS_LAUNCHES  which --batch-launch ways step 11 runs under MPS; default: "rank peer auto"
#   GPU_CHECK_MPS_DESCRIPTORS  where step 11's runs make their descriptors: host, device or both
#                  ("host device"); default: host
#   GPU_CHECK_SERVE_SECONDS  how long step 9's load runs (default: 600). Where one command may
#                  run 10 minutes at most, 600 s of load does not fit beside the engines' start:
#                  scripts/gpu-session.sh starts the step detached in one command and collects it
#                  in the next, issued while the machine is still held
#   GPU_CHECK_BUDGET  seconds: steps that would start later than this are skipped (default: none).
#                  Every kvx step also has its own time limit, after which it gets SIGINT (kvx
#                  then keeps what it measured) and, 5 s later, SIGKILL.
set -uo pipefail
cd "$(dirname "$0")/.."

UCX_ARG="${KVX_UCX_LIB:-}"
OUT="${GPU_CHECK_OUT:-target/gpu-check/$(date +%Y%m%d-%H%M%S)}"
while [ $# -gt 0 ]; do
  case "$1" in
    --ucx-lib) UCX_ARG="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STATUS="$OUT/status.tsv"
# GPU_CHECK_STEPS=none runs nothing: it re-makes the ratio table and gpu-check.json from what
# --out already holds (a run cut short before its summary, read back on another machine).
[ "${GPU_CHECK_STEPS:-}" = none ] || : > "$STATUS"

now_ms() { date +%s%3N; }

# record STEP STATUS MS JSON NOTE COMMAND: one line of $STATUS (tab-separated; STATUS is ok,
# failed or skipped; MS the step's milliseconds; JSON the file holding kvx's JSON, or "").
record() {
  local note="${5//$'\t'/ }" cmd="${6//$'\t'/ }"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${note//$'\n'/ }" "${cmd//$'\n'/ }" >> "$STATUS"
  echo "gpu-check: $1: $2${5:+ ($5)}"
}

# The UCX: a libucp.so.0, or a wheel directory holding libucx/lib/libucp.so.0.
UCX_LIB=""
if [ -n "$UCX_ARG" ]; then
  if [ -d "$UCX_ARG" ]; then
    UCX_LIB="$(find -L "$UCX_ARG" -name 'libucp.so.0' -path '*lib*' 2>/dev/null | head -n1)"
    [ -z "$UCX_LIB" ] && { echo "gpu-check: no libucp.so.0 under $UCX_ARG (unpack the libucx-cu12/cu13 wheel there)" >&2; exit 2; }
  else
    UCX_LIB="$UCX_ARG"
  fi
  [ -e "$UCX_LIB" ] || { echo "gpu-check: $UCX_LIB does not exist (change --ucx-lib or KVX_UCX_LIB)" >&2; exit 2; }
fi
UCX_FLAGS=()
[ -n "$UCX_LIB" ] && UCX_FLAGS=(--ucx-lib "$UCX_LIB")

# The kvx binary: KVX_BIN, else the one of a bundle (scripts/bundle.sh), else a build.
if [ -z "${KVX_BIN:-}" ] && [ ! -f Cargo.toml ] && [ -x ./kvx ]; then
  KVX_BIN=./kvx
fi
if [ -n "${KVX_BIN:-}" ]; then
  KVX="$KVX_BIN"
  [ -x "$KVX" ] || { echo "gpu-check: KVX_BIN=$KVX is not executable" >&2; exit 2; }
else
  export PATH="$HOME/.cargo/bin:$PATH"
  t0=$(now_ms)
  if ! cargo build --release --features cuda --bins >"$OUT/build.log" 2>&1; then
    record build failed $(($(now_ms) - t0)) "" "see $OUT/build.log; or give a binary with KVX_BIN=path" \
      "cargo build --release --features cuda --bins"
    exit 2
  fi
  KVX=target/release/kvx
fi
[ "${GPU_CHECK_STEPS:-}" = none ] || record build ok 0 "" "$KVX" ""

START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET:-0}"
STEPS=" ${GPU_CHECK_STEPS:-doctor xfer bench perftest nixl batch paths push hostbuf hybrid launch device serve gate mps} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
k() { # $1 time limit in seconds, then kvx's arguments
  local limit="$1"; shift
  timeout -s INT -k 5 "$limit" "$KVX" "$@"
}
over() { # true once the budget is spent: records the step $1 (command $2) as skipped
  if [ "$BUDGET" -gt 0 ] && [ $((SECONDS - START)) -ge "$BUDGET" ]; then
    record "$1" skipped 0 "" "skipped: GPU_CHECK_BUDGET=$BUDGET s spent" "${2:-}"
    return 0
  fi
  return 1
}
first_error() { # the first line of $1 that says what went wrong
  grep -m1 -E "${2:-error|warning|verification}" "$1" 2>/dev/null | cut -c1-200
}
# step NAME LIMIT OUT [kvx arguments...]: runs kvx with stdout to OUT (its JSON) and stderr to
# OUT's .err, records the step (skipped when the budget is spent); returns kvx's exit status
# (2 when skipped). EXPECT_RC=N in its environment: exit N is the expected outcome (ok).
step() {
  local name="$1" limit="$2" out="$3"; shift 3
  local cmd="kvx $*"
  if over "$name" "$cmd"; then return 2; fi
  local t0 rc status note
  t0=$(now_ms)
  k "$limit" "$@" >"$out" 2>"${out%.json}.err"
  rc=$?
  status=ok
  note="$(first_error "${out%.json}.err")"
  if [ "$rc" -ne 0 ] && [ "$rc" -eq "${EXPECT_RC:-0}" ]; then
    # A run meant to fail (vLLM's own rule misplacing bytes): ok when it fails as it should.
    note="exit $rc as expected${note:+: $note}"
  elif [ "$rc" -ne 0 ]; then
    status=failed
    note="exit $rc${note:+: $note}"
    # A path the driver does not have is not a failure of kvx: it said so, by name.
    if grep -q 'does not have or refuses' "${out%.json}.err" 2>/dev/null; then
      status=skipped
      note="not in this driver: $(first_error "${out%.json}.err" 'forces')"
    fi
  fi
  record "$name" "$status" $(($(now_ms) - t0)) "$out" "$note" "$cmd"
  return "$rc"
}

# 1. doctor
want doctor && step doctor 60 "$OUT/doctor.json" doctor "${UCX_FLAGS[@]}" --format json
want doctor && { k 30 doctor "${UCX_FLAGS[@]}" --no-self-test 2>/dev/null | grep -E '^(ok|warn|missing|fail) +cuda' || true; }

# 2. xfer on device memory
want xfer && step "xfer --mem cuda" 90 "$OUT/xfer.json" xfer --mem cuda --device 0 "${UCX_FLAGS[@]}" \
  --sizes 8KiB,64KiB,256KiB,1MiB,16MiB --inflight 1,32,64,128 --duration 500ms --format json

# 3. bench on device memory: KV pools on GPU 0 (every rank, as on a one-GPU host)
if (want bench || want push) && step "bench --mem cuda --p-tp 8 --d-tp 2" 120 "$OUT/bench.json" bench --mem cuda --p-tp 8 --d-tp 2 \
  "${UCX_FLAGS[@]}" --results-dir "$OUT/bench" --format json; then
  desc="$("$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(int(((d.get("calibration") or {}).get("descriptor_bytes")) or 0))' "$OUT/bench.json" 2>/dev/null || echo 0)"
  if [ "${desc:-0}" -gt 0 ] && want bench; then
    step "xfer --mem cuda at the bench's descriptor size ($desc B)" 60 "$OUT/xfer-bench-size.json" \
      xfer --mem cuda --device 0 "${UCX_FLAGS[@]}" --sizes "$desc" --inflight 64 --format json
  fi
fi

# 4a. ucx_perftest peer (GET, device memory both sides, one buffer, one GET at a time), and kvx
#     the same way (--hot --inflight 1) on the library beside that ucx_perftest.
PERFTEST="${UCX_PERFTEST:-}"
perftest_skipped=0
want perftest || { perftest_skipped=1; PERFTEST=/nonexistent; }
over "ucx_perftest" "ucx_perftest -t ucp_get -m cuda,cuda" && perftest_skipped=1 && PERFTEST=/nonexistent
for lib in "$UCX_LIB" .ucx/libucx/lib/libucp.so.0; do
  [ -n "$PERFTEST" ] && break
  [ -n "$lib" ] && [ -x "$(dirname "$lib")/../bin/ucx_perftest" ] && PERFTEST="$(dirname "$lib")/../bin/ucx_perftest"
done
if [ -n "$PERFTEST" ] && [ -x "$PERFTEST" ]; then
  : > "$OUT/perftest.csv"
  t0=$(now_ms)
  for size in 65536 1048576 16777216; do
    port=$((20000 + RANDOM % 20000))
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y LD_LIBRARY_PATH="$(dirname "$PERFTEST")/../lib:${LD_LIBRARY_PATH:-}" \
      timeout 60 "$PERFTEST" -p "$port" -m cuda,cuda >/dev/null 2>&1 &
    server=$!
    out=""
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      out="$(UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y LD_LIBRARY_PATH="$(dirname "$PERFTEST")/../lib:${LD_LIBRARY_PATH:-}" \
        timeout 30 "$PERFTEST" localhost -p "$port" -t ucp_get -m cuda,cuda -s "$size" -n 5000 2>&1)" && break
      out=""
      sleep 0.5 # the server binds asynchronously; retried a bounded number of times
    done
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    # "Final:" row: iterations, 3 latency columns, bandwidth average and overall (MB/s, 2^20 B).
    mbs="$(printf '%s\n' "$out" | awk '/Final:/ {print $7}')"
    [ -n "$mbs" ] && echo "$size,$mbs" >> "$OUT/perftest.csv"
  done
  cmd="ucx_perftest -t ucp_get -m cuda,cuda -s {65536,1048576,16777216} -n 5000"
  if [ -s "$OUT/perftest.csv" ]; then
    record "ucx_perftest -t ucp_get -m cuda,cuda" ok $(($(now_ms) - t0)) "" "$OUT/perftest.csv" "$cmd"
  else
    record "ucx_perftest -t ucp_get -m cuda,cuda" failed $(($(now_ms) - t0)) "" "no result: run it by hand to see why" "$cmd"
  fi
  # kvx like ucx_perftest: its library (the one beside it), one buffer, one GET in flight.
  PERF_LIB="$(dirname "$PERFTEST")/../lib/libucp.so.0"
  [ -e "$PERF_LIB" ] || PERF_LIB="$UCX_LIB"
  PERF_FLAGS=()
  [ -n "$PERF_LIB" ] && PERF_FLAGS=(--ucx-lib "$PERF_LIB")
  step "xfer --mem cuda like ucx_perftest (--hot --inflight 1)" 60 "$OUT/xfer-like-perftest.json" \
    xfer --mem cuda --device 0 "${PERF_FLAGS[@]}" --hot --inflight 1 --sizes 64KiB,1MiB,16MiB --err-mode none \
    --duration 500ms --format json
elif [ "$perftest_skipped" -eq 0 ]; then
  record "ucx_perftest" skipped 0 "" "skipped: no ucx_perftest (set UCX_PERFTEST or --ucx-lib to a wheel)" ""
fi

# 4b. NIXL peer on VRAM (its default error mode, peer; one transfer of 64 MiB of B-byte blocks
#     from the first 64 MiB of the peer's region), then kvx made the same: --err-mode peer, the
#     same block size, 64 MiB / B reads per batch over a 64 MiB working set, on NIXL's own UCX
#     library when kvx can load it.
NIXL_SIZES="8192 65536 262144 1048576 16777216"
NIXL_XFER=67108864
nixl_ok=0
if ! want nixl || over "nixl" "scripts/peers/nixl_peer.py"; then
  :
elif "$PY" -c 'import torch, sys; import importlib.util as u; sys.exit(0 if torch.cuda.is_available() and any(u.find_spec(m) for m in ("nixl", "nixl_cu13", "nixl_cu12")) else 1)' 2>/dev/null; then
  t0=$(now_ms)
  NIXL_PEER_MEM=VRAM UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout -k 5 180 "$PY" scripts/peers/nixl_peer.py \
    --sizes "$(echo "$NIXL_SIZES" | tr ' ' ',')" --region 268435456 --xfer-bytes "$NIXL_XFER" \
    --err-mode peer >"$OUT/nixl.csv" 2>"$OUT/nixl.err"
  rc=$?
  if [ "$rc" -eq 0 ]; then nixl_ok=1; st=ok; else st=failed; fi
  record "nixl VRAM READ" "$st" $(($(now_ms) - t0)) "" "$OUT/nixl.csv" \
    "NIXL_PEER_MEM=VRAM scripts/peers/nixl_peer.py --sizes $(echo "$NIXL_SIZES" | tr ' ' ',') --region 268435456 --xfer-bytes $NIXL_XFER --err-mode peer"
else
  record "nixl" skipped 0 "" "skipped: $PY cannot import nixl and torch with CUDA" ""
fi
if [ "$nixl_ok" -eq 1 ]; then
  # The libucp.so NIXL's wheel bundles (its name may carry a hash), if there is one.
  NIXL_UCX="$("$PY" - <<'EOF' 2>/dev/null
import glob, importlib.util as u, os
for m in ("nixl", "nixl_cu13", "nixl_cu12"):
    s = u.find_spec(m)
    if not s or not s.submodule_search_locations:
        continue
    pkg = list(s.submodule_search_locations)[0]
    site = os.path.dirname(pkg)
    for pat in (os.path.join(pkg, "**", "libucp*.so*"), os.path.join(site, "*" + m + "*libs*", "**", "libucp*.so*")):
        hits = sorted(h for h in glob.glob(pat, recursive=True) if os.path.isfile(h))
        if hits:
            print(hits[0])
            raise SystemExit
EOF
)"
  echo "${NIXL_UCX:-}" > "$OUT/nixl-ucx.txt"
  for size in $NIXL_SIZES; do
    depth=$((NIXL_XFER / size))
    args=(xfer --mem cuda --device 0 --err-mode peer --sizes "$size" --inflight "$depth" --working-set "$NIXL_XFER"
      --duration 1s --format json)
    if [ -n "$NIXL_UCX" ] && step "xfer --mem cuda like NIXL @ $size B (NIXL's UCX)" 60 "$OUT/xfer-like-nixl-$size.json" \
      "${args[@]}" --ucx-lib "$NIXL_UCX"; then
      continue
    fi
    step "xfer --mem cuda like NIXL @ $size B (kvx's UCX)" 60 "$OUT/xfer-like-nixl-$size.json" "${args[@]}" "${UCX_FLAGS[@]}"
  done
fi

# 5. cuda-batch: each batch one batched copy from the peer's pool mapped with CUDA IPC (no UCX),
#    at the same depths as step 2, then the P8->D2 request against UCX in one comparison.
want batch && step "bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --verify full" 120 "$OUT/verify.json" \
  bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --verify full --results-dir "$OUT/verify" --format json
want batch && for copy in ${GPU_CHECK_BATCH_COPIES:-kernel api}; do
  sfx=""; [ "$copy" = kernel ] && sfx="-kernel"
  step "xfer --transport cuda-batch --batch-copy $copy --mem cuda" 90 "$OUT/xfer-batch$sfx.json" \
    xfer --transport cuda-batch --batch-copy "$copy" --mem cuda --device 0 --sizes 8KiB,64KiB,1MiB,16MiB \
    --inflight 1,32,128,1024,10240 --duration 500ms --format json
  step "bench --mem cuda --p-tp 8 --d-tp 2 --compare-transports ucx,cuda-batch --batch-copy $copy" 150 \
    "$OUT/compare$sfx.json" bench --mem cuda --p-tp 8 --d-tp 2 --compare-transports ucx,cuda-batch \
    --batch-copy "$copy" "${UCX_FLAGS[@]}" --results-dir "$OUT/compare$sfx" --format json
done

# Each request alone (--concurrency 1): no other request's fill or reads share the GPU with
# its reads, which on a one-GPU host all ranks do.
want batch && step "bench --mem cuda --p-tp 8 --d-tp 2 --compare-transports ucx,cuda-batch --concurrency 1" 150 \
  "$OUT/compare-c1.json" bench --mem cuda --p-tp 8 --d-tp 2 --compare-transports ucx,cuda-batch --concurrency 1 \
  "${UCX_FLAGS[@]}" --results-dir "$OUT/compare-c1" --format json

# 6. Every batch-copy path, forced, at 8 KiB x 10,240 (a P8->D2 request's reads per peer),
#    verified, aligned and not: --misalign 3 (local and remote agree modulo 16: the kernel's byte
#    head and tail around a 16-byte body) and --misalign 0,1 (they differ: narrower units).
want paths && for copy in ${GPU_CHECK_PATHS:-kernel api api-v2 api-v1 per-copy}; do
  for align in aligned 3 0,1; do
    mis=(); label="16-byte aligned"
    [ "$align" != aligned ] && mis=(--misalign "$align") && label="--misalign $align"
    step "xfer --transport cuda-batch --batch-copy $copy 8KiB $label" 60 \
      "$OUT/xfer-path-$copy-${align/,/-}.json" xfer --transport cuda-batch --batch-copy "$copy" --mem cuda \
      --device 0 --sizes 8KiB --inflight 10240 --duration 300ms "${mis[@]}" --format json
  done
done

# 7. Push mode on device memory: prefill ranks WRITE with ucp_put (cuda_ipc PUT zero-copy is on
#    by default, with or without NVLink).
want push && step "bench --mem cuda --p-tp 8 --d-tp 2 --mode push" 120 "$OUT/push.json" \
  bench --mem cuda --p-tp 8 --d-tp 2 --mode push "${UCX_FLAGS[@]}" --results-dir "$OUT/push" --format json

# 7b. Host buffers on device memory (--kv-buffer-device cpu): the pools on the GPU, each rank's
#     host buffer beside it; the two copies (device to host on prefill, host to device on decode)
#     are stages, against the direct path in the same invocation; every byte verified in decode's
#     device pool.
want hostbuf && step "bench --mem cuda --p-tp 8 --d-tp 2 --compare-kv-buffer-device cuda,cpu" 200 "$OUT/hostbuf.json" \
  bench --mem cuda --p-tp 8 --d-tp 2 --compare-kv-buffer-device cuda,cpu --verify full --requests 20 \
  "${UCX_FLAGS[@]}" --results-dir "$OUT/hostbuf" --format json

# 7b. Hybrid models on device memory: Qwen3-Next P4->D2 (GDN state beside attention) read
#     from the KV cache, every byte checked; Nemotron-H through host buffers (device/host copies
#     through pinned memory) with kvx's three switches against the direct path in one run, every
#     block checked in decode's KV cache after the copy.
want hybrid && step "bench --mem cuda hybrid-qwen3-next P4->D2" 200 "$OUT/hybrid.json" \
  bench --mem cuda --config bench-configs/hybrid-qwen3-next.toml --verify full "${UCX_FLAGS[@]}" \
  --results-dir "$OUT/hybrid" --format json
want hybrid && step "bench --mem cuda hybrid-qwen3-next P4->D2 --transport cuda-batch" 200 "$OUT/hybrid-batch.json" \
  bench --mem cuda --config bench-configs/hybrid-qwen3-next.toml --transport cuda-batch --verify full \
  --results-dir "$OUT/hybrid-batch" --format json
want hybrid && step "bench --mem cuda nemotron-h-8b --compare-kv-buffer-device cuda,cpu (three switches)" 200 \
  "$OUT/hybrid-hostbuf.json" bench --mem cuda --model nemotron-h-8b --p-tp 1 --d-tp 1 --prompt-len 2000 \
  --requests 8 --concurrency 1 --compare-kv-buffer-device cuda,cpu --host-copy per-group \
  --host-state-page padded --host-descriptors per-group --verify full "${UCX_FLAGS[@]}" \
  --results-dir "$OUT/hybrid-hostbuf" --format json
# Falcon-H1 (Mamba2 n_groups 1 below a TP size): vLLM 0.33's state slices land wrong at P1->D2
# and P2->D1 (exit 1, the bytes named), --state-slices exact verifies; gpt-oss's window group.
if want hybrid; then
  for pd in 1:2 2:1; do
    hp="${pd%:*}" hd="${pd#*:}"
    EXPECT_RC=1 step "bench --mem cuda falcon-h1-7b P$hp->D$hd (vLLM's state slices: exit 1 expected)" 150 \
      "$OUT/hybrid-falcon-p${hp}d$hd-vllm.json" bench --mem cuda --model falcon-h1-7b --p-tp "$hp" --d-tp "$hd" \
      --prompt-len 2000 --requests 2 --warmup 0 --verify full "${UCX_FLAGS[@]}" \
      --results-dir "$OUT/hybrid-falcon-p${hp}d$hd-vllm" --format json
    step "bench --mem cuda falcon-h1-7b P$hp->D$hd --state-slices exact" 150 "$OUT/hybrid-falcon-p${hp}d$hd-exact.json" \
      bench --mem cuda --model falcon-h1-7b --p-tp "$hp" --d-tp "$hd" --prompt-len 2000 --requests 2 --warmup 0 \
      --verify full --state-slices exact "${UCX_FLAGS[@]}" --results-dir "$OUT/hybrid-falcon-p${hp}d$hd-exact" --format json
  done
  step "bench --mem cuda gpt-oss-120b P2->D2 (sliding window)" 150 "$OUT/hybrid-gptoss.json" bench --mem cuda \
    --model gpt-oss-120b --p-tp 2 --d-tp 2 --prompt-len 4096 --requests 4 --verify full "${UCX_FLAGS[@]}" \
    --results-dir "$OUT/hybrid-gptoss" --format json
fi

# 8. Launches per request: cuda-batch P8->D2 Llama-3.1-70B (8 KiB descriptors, two decode
#    ranks sharing the one GPU), one batch per request per decode rank (rank, the default) or
#    one per prefill peer (peer), each request alone and two at a time. Each summary carries the
#    request's wall-span bandwidth and the same-run device bandwidth (calibration).
launch_bench() { # NAME-SUFFIX LAUNCH CONCURRENCY LABEL [KVX-FLAG...]
  local sfx="$1" launch="$2" c="$3" label="$4"
  shift 4
  step "bench cuda-batch P8->D2 70B --batch-launch $launch --concurrency $c$label" 150 "$OUT/launch-$launch-c$c$sfx.json" \
    bench --mem cuda --p-tp 8 --d-tp 2 --model llama-3.1-70b --transport cuda-batch --batch-launch "$launch" \
    --concurrency "$c" --requests 40 --warmup 4 "$@" --results-dir "$OUT/launch-$launch-c$c$sfx" --format json
}
if want launch; then
  # Where a rank's time goes at 8 KiB (pack, fill, post, complete), at a P8->D2 70B request's
  # descriptors per peer (10,240) and per decode rank (40,960).
  step "xfer --transport cuda-batch --batch-copy kernel 8KiB x1024,10240,40960 (posting breakdown)" 60 \
    "$OUT/xfer-post-breakdown.json" xfer --transport cuda-batch --batch-copy kernel --mem cuda --device 0 \
    --sizes 8KiB --inflight 1024,10240,40960 --duration 300ms --format json
  for c in 1 2; do
    for launch in rank peer; do launch_bench "" "$launch" "$c" ""; done
  done
  # The same request read by one decode rank alone (P8->D1: no second process on the GPU), to
  # tell what sharing the GPU costs from what the path costs.
  step "bench cuda-batch P8->D1 70B --batch-launch rank --concurrency 1 (one decode rank)" 150 \
    "$OUT/launch-rank-c1-d1.json" bench --mem cuda --p-tp 8 --d-tp 1 --model llama-3.1-70b \
    --transport cuda-batch --batch-launch rank --concurrency 1 --requests 40 --warmup 4 \
    --results-dir "$OUT/launch-rank-c1-d1" --format json
fi

# 8b. Descriptors made on the device (--batch-descriptors device): the plan's region table and
#     the request's block ids uploaded, kvx_grid_expand writes the gather kernel's descriptors.
#     Every byte verified once, then step 8's runs with it.
if want device; then
  step "bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --batch-descriptors device --verify full" 120 \
    "$OUT/device-verify.json" bench --mem cuda --p-tp 8 --d-tp 2 --transport cuda-batch --batch-descriptors device \
    --verify full --results-dir "$OUT/device-verify" --format json
  for c in 1 2; do
    for launch in rank peer; do
      launch_bench "-dev" "$launch" "$c" " --batch-descriptors device" --batch-descriptors device
    done
  done
  step "bench cuda-batch P8->D1 70B --batch-launch rank --concurrency 1 --batch-descriptors device (one decode rank)" 150 \
    "$OUT/launch-rank-c1-d1-dev.json" bench --mem cuda --p-tp 8 --d-tp 1 --model llama-3.1-70b \
    --transport cuda-batch --batch-launch rank --concurrency 1 --requests 40 --warmup 4 --batch-descriptors device \
    --results-dir "$OUT/launch-rank-c1-d1-dev" --format json
fi

# 9. serve-engine --mem cuda behind serve-proxy under kvx load, with orphaned prefill legs whose
#    leases expire (2 s) so that their blocks are reused.
SERVE_S="${GPU_CHECK_SERVE_SECONDS:-600}"
SERVE_MEM="${GPU_CHECK_SERVE_MEM:-cuda}" # host: the same step without a GPU (to try the script)
serve_step() {
  local d="$OUT/serve" t0 pids=() p_url d_url x_url rc status note
  mkdir -p "$d"
  t0=$(now_ms)
  # url FILE: the address a server printed as its first stdout line, waited for up to 60 s.
  url() {
    local i line
    for i in $(seq 1 600); do
      line="$(head -n1 "$1" 2>/dev/null)"
      [[ "$line" == "listening on "* ]] && { echo "${line#listening on }"; return 0; }
      sleep 0.1 # the server binds asynchronously; bounded
    done
    return 1
  }
  local common=(--tp 2 --mem "$SERVE_MEM" "${UCX_FLAGS[@]}" --port 0)
  "$KVX" serve-engine --role prefill --side-channel-port 0 --lease 2s "${common[@]}" >"$d/prefill.out" 2>"$d/prefill.err" &
  pids+=($!)
  "$KVX" serve-engine --role decode --verify full "${common[@]}" >"$d/decode.out" 2>"$d/decode.err" &
  pids+=($!)
  p_url="$(url "$d/prefill.out")" && d_url="$(url "$d/decode.out")"
  if [ -n "${p_url:-}" ] && [ -n "${d_url:-}" ]; then
    "$KVX" serve-proxy --port 0 --prefiller-hosts "$(echo "$p_url" | sed 's#http://##; s#:.*##')" \
      --prefiller-ports "${p_url##*:}" --decoder-hosts "$(echo "$d_url" | sed 's#http://##; s#:.*##')" \
      --decoder-ports "${d_url##*:}" >"$d/proxy.out" 2>"$d/proxy.err" &
    pids+=($!)
    x_url="$(url "$d/proxy.out")"
  fi
  if [ -z "${x_url:-}" ]; then
    record "serve-engine --mem $SERVE_MEM behind serve-proxy" failed $(($(now_ms) - t0)) "" \
      "a server did not start: see $d/*.err" "kvx serve-engine/serve-proxy"
    kill -INT "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
    return 1
  fi
  # Orphans: prefill legs sent straight to the prefill engine, never read by a decode engine.
  "$PY" - "$p_url" "$d/orphans.stop" >"$d/orphans.txt" 2>&1 <<'EOF' &
import json, os, sys, time, urllib.request
url, stop = sys.argv[1], sys.argv[2]
body = json.dumps({"prompt": "orphan " * 200, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}).encode()
sent = ok = 0
while not os.path.exists(stop):
    sent += 1
    try:
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            ok += r.status == 200
    except Exception as e:
        print("orphan request failed:", e)
    time.sleep(0.5)
print(f"orphans sent {sent}, accepted {ok}")
EOF
  local orphans=$!
  k $((SERVE_S + 60)) load --url "$x_url" --duration "$SERVE_S" --concurrency 4 --format json \
    --results-dir "$d/load" >"$d/load.json" 2>"$d/load.err"
  rc=$?
  touch "$d/orphans.stop"; wait "$orphans"
  sleep 4 # past the last orphan's 2 s lease, so its blocks are back
  for e in prefill:"$p_url" decode:"$d_url"; do
    "$PY" - "${e#*:}" >"$d/${e%%:*}.metrics" 2>&1 <<'EOF' || true
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=10).read().decode())
EOF
  done
  kill -TERM "${pids[@]}" 2>/dev/null
  local p rcs=()
  for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
  "$PY" - "$d" "$rc" "${rcs[*]}" >"$d/serve.json" <<'EOF'
import json, os, re, sys
d, load_rc, server_rcs = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split()]
def metrics(role):
    out = {}
    try:
        for line in open(os.path.join(d, role + ".metrics")):
            m = re.match(r'^([a-z_:]+)(\{[^}]*\})?\s+([-0-9.eE+naif]+)$', line.strip())
            if m and not line.startswith("#"):
                out.setdefault(m.group(1), 0.0)
                out[m.group(1)] += float(m.group(3))
    except OSError:
        pass
    return out
def stopped(role):
    # "KV workers stopped blocks_leaked=N leases_expired=M" on the engine's stderr at exit.
    try:
        text = open(os.path.join(d, role + ".err")).read()
    except OSError:
        return {}
    m = re.findall(r"KV workers stopped blocks_leaked=(\d+) leases_expired=(\d+)", text)
    return {"blocks_leaked": int(m[-1][0]), "leases_expired": int(m[-1][1])} if m else {}
try:
    load = json.load(open(os.path.join(d, "load.json")))
except Exception:
    load = {}
keys = ["vllm:kv_cache_usage_perc", "kvx:kv_blocks_held", "kvx:kv_blocks_in_use", "kvx:kv_leases_expired_total",
        "kvx:kv_blocks_read_total", "kvx:kv_bytes_read_total", "kvx:kv_bytes_verified_total", "kvx:kv_verify_failures_total", "kvx:kv_loads_total",
        "kvx:kv_load_failures_total", "kvx:request_errors_total"]
out = {"load_exit": load_rc, "server_exits": server_rcs,
       "requests_ok": load.get("requests_ok"), "requests_failed": load.get("requests_failed"),
       "duration_s": load.get("duration_s"),
       "orphans": open(os.path.join(d, "orphans.txt")).read().strip().splitlines()[-1:],
       "prefill": {"metrics_at_end": {k: v for k, v in metrics("prefill").items() if k in keys}, "at_exit": stopped("prefill")},
       "decode": {"metrics_at_end": {k: v for k, v in metrics("decode").items() if k in keys}, "at_exit": stopped("decode")}}
problems = []
if load_rc != 0 or (out["requests_failed"] or 0) > 0 or not out["requests_ok"]:
    problems.append(f"load exit {load_rc}, {out['requests_failed']} failed, {out['requests_ok']} ok")
for role in ("prefill", "decode"):
    m, x = out[role]["metrics_at_end"], out[role]["at_exit"]
    if m.get("vllm:kv_cache_usage_perc", 1.0) != 0.0:
        problems.append(f"{role}: KV usage {m.get('vllm:kv_cache_usage_perc')} at the end, not idle")
    if m.get("kvx:kv_verify_failures_total", 0) > 0:
        problems.append(f"{role}: {m['kvx:kv_verify_failures_total']:.0f} verify failures")
    if x.get("blocks_leaked", 1) != 0:
        problems.append(f"{role}: blocks leaked at exit: {x.get('blocks_leaked', 'not reported')}")
if out["prefill"]["at_exit"].get("leases_expired", 0) == 0:
    problems.append("no lease expired (the orphaned prefill legs did not reach the prefill engine)")
if out["decode"]["metrics_at_end"].get("kvx:kv_bytes_verified_total", 0) <= 0:
    problems.append("the decode engine verified no bytes")
if any(server_rcs):
    problems.append(f"servers exited {server_rcs} on SIGTERM (0 expected)")
out["problems"] = problems
json.dump(out, sys.stdout, indent=1)
print()
sys.exit(1 if problems else 0)
EOF
  rc=$?
  status=ok; note=""
  [ "$rc" -ne 0 ] && status=failed && note="$("$PY" -c 'import json,sys; print("; ".join(json.load(open(sys.argv[1]))["problems"]))' "$d/serve.json" 2>/dev/null)"
  record "serve-engine --mem $SERVE_MEM behind serve-proxy, kvx load ${SERVE_S}s + orphaned prefill legs" "$status" \
    $(($(now_ms) - t0)) "$d/serve.json" "$note" \
    "kvx serve-engine --role prefill|decode --tp 2 --mem $SERVE_MEM --lease 2s; kvx serve-proxy; kvx load --duration ${SERVE_S}s --concurrency 4"
}
if want serve && ! over serve "kvx serve-engine --mem $SERVE_MEM"; then serve_step; fi

# 10. The GPU gate: the preset as a baseline (more repeats), again unchanged, and again slowed
#     by 15% (--slowdown 0.15); kvx gate with the GPU thresholds must pass the first and flag
#     the second. Against a committed results/baseline-gpu.json too, when there is one.
gate_judge() { # NAME TAG BASELINE CURRENT EXPECTED-EXIT (- for none): verdict in $OUT/TAG-verdict.json
  local t0 rc status note v="$OUT/$2-verdict"
  shift
  [ -s "$2" ] && [ -s "$3" ] || { record "$1" skipped 0 "" "skipped: a run it needs did not finish" ""; return; }
  t0=$(now_ms)
  "$KVX" gate --baseline "$2" --current "$3" --thresholds bench-configs/gates-gpu.toml --format json \
    >"$v.json" 2>"$v.err"
  rc=$?
  status=ok; note="kvx gate exit $rc, as expected"
  if [ "$4" = "-" ]; then
    note="kvx gate exit $rc (0 pass, 1 regression): informational"
  elif [ "$rc" -ne "$4" ]; then
    status=failed; note="kvx gate exit $rc, expected $4"
  fi
  record "$1" "$status" $(($(now_ms) - t0)) "$v.json" "$note" \
    "kvx gate --baseline $2 --current $3 --thresholds bench-configs/gates-gpu.toml"
}
if want gate; then
  G=(bench --config bench-configs/gpu.toml "${UCX_FLAGS[@]}" --format json)
  step "gate: GPU preset as the baseline (--repeat 8)" 240 "$OUT/gate-base.json" "${G[@]}" --repeat 8 \
    --results-dir "$OUT/gate-base"
  step "gate: GPU preset, unchanged" 200 "$OUT/gate-same.json" "${G[@]}" --results-dir "$OUT/gate-same"
  step "gate: GPU preset, --slowdown 0.15" 200 "$OUT/gate-slow.json" "${G[@]}" --slowdown 0.15 \
    --results-dir "$OUT/gate-slow"
  gate_judge "kvx gate: unchanged vs the same-session baseline (pass expected)" gate-same \
    "$OUT/gate-base.json" "$OUT/gate-same.json" 0
  gate_judge "kvx gate: --slowdown 0.15 vs the same-session baseline (regression expected)" gate-slow \
    "$OUT/gate-base.json" "$OUT/gate-slow.json" 1
  # The committed baseline was made on another machine (of the same kind, at best): its verdict
  # is shown, not judged (on two H200s the unchanged preset differed by 11-17%: a GPU host's CI
  # makes its own baseline with `kvx gate --update`).
  if [ -f results/baseline-gpu.json ]; then
    gate_judge "kvx gate: unchanged vs results/baseline-gpu.json (made on another machine)" gate-committed \
      results/baseline-gpu.json "$OUT/gate-same.json" -
  fi
fi

# 11. MPS (last: a daemon that misbehaves must not cost the steps above): step 8's runs again with the MPS control daemon started, when it can be; then it is stopped.
if want mps && ! over mps "nvidia-cuda-mps-control -d"; then
  MPS_DIR="$(mktemp -d)"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>"$OUT/mps.err"; then
    record "MPS control daemon started" ok 0 "" "" "nvidia-cuda-mps-control -d"
    for c in 1 2; do
      for launch in ${GPU_CHECK_MPS_LAUNCHES:-rank peer auto}; do
        for made in ${GPU_CHECK_MPS_DESCRIPTORS:-host}; do
          if [ "$made" = device ]; then
            launch_bench "-dev-mps" "$launch" "$c" " --batch-descriptors device under MPS" --batch-descriptors device
          else
            launch_bench "-mps" "$launch" "$c" " under MPS"
          fi
        done
      done
    done
    echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null 2>&1
    cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUT/mps-control.log" 2>/dev/null
  else
    record "MPS" skipped 0 "" "skipped: nvidia-cuda-mps-control $(command -v nvidia-cuda-mps-control >/dev/null && echo "could not start: $(head -c 200 "$OUT/mps.err")" || echo "not found")" ""
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

# The card, for the results file's name.
CARD="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1)"
KVX_VERSION="$("$KVX" --version 2>/dev/null | head -n1)"
# The commit the binary was built from: a bundle says so beside its kvx (BUNDLE.txt); else the
# checkout's (a binary built from it).
COMMIT="$(sed -n 's/.*(commit \([0-9a-f]*\)).*/\1/p' "$(dirname "$KVX")/BUNDLE.txt" 2>/dev/null | head -n1)"
[ -n "$COMMIT" ] || COMMIT="$(git rev-parse --short HEAD 2>/dev/null || true)"

# Ratios and the results file.
GPU_CHECK_CARD="$CARD" GPU_CHECK_DRIVER="$DRIVER" GPU_CHECK_KVX="$KVX_VERSION" GPU_CHECK_COMMIT="$COMMIT" \
GPU_CHECK_UCX="$UCX_LIB" GPU_CHECK_NIXL_XFER="$NIXL_XFER" GPU_CHECK_REPO="$PWD" \
GPU_CHECK_BUNDLE="$([ -f "$(dirname "$KVX")/BUNDLE.txt" ] && cd "$(dirname "$KVX")" && pwd)" \
"$PY" - "$OUT" <<'EOF' || echo "gpu-check: python3 is needed for the ratio table and gpu-check.json; reports are in $OUT"
import csv, datetime, json, os, re, sys
out = sys.argv[1]
env = os.environ.get
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except Exception:
        return None
def fmt(x):
    return "-" if x is None else f"{x:.2f}"
def div(a, b):
    return a / b if a and b else None
def uses(rep):
    return ", ".join(f"{u['op']} {u['local']}<-{u['remote']}: " + ", ".join(f"{c['description']} {c['config']}" for c in u["choices"])
                     for u in (((rep or {}).get("ucx") or {}).get("protocols") or {}).get("uses", [])) or "unknown"
rows = []  # (what, kvx GB/s, peer GB/s, ratio, target, differences)
def row(what, k, p, target="", diffs=()):
    rows.append((what, k, p, div(k, p), target, list(diffs)))

xfer = load("xfer.json")
best = {}      # size -> best GB/s over in-flight depths
ceiling = {}   # size -> (gbps, ratio) at the deepest in-flight
if xfer:
    for r in xfer["results"]:
        s = r["size_bytes"]
        best[s] = max(best.get(s, 0.0), r["gbps"])
        if s not in ceiling or r["inflight"] >= ceiling[s][2]:
            ceiling[s] = (r["gbps"], r.get("ratio_to_ceiling"), r["inflight"])
    print("kvx xfer --mem cuda: protocols:", uses(xfer) if uses(xfer) != "unknown" else xfer["ucx"]["protocols"].get("note"))
    for w in xfer.get("warnings", []):
        print("  warning:", w)

# NIXL, like for like: per block size, kvx with NIXL's error mode, block size, blocks per transfer
# and bytes; every setting that still differs is listed beside the ratio.
nixl, nixl_blocks, nixl_head = {}, {}, ""
try:
    with open(os.path.join(out, "nixl.csv")) as f:
        for line in f:
            if line.startswith("# mem="):
                nixl_head = line[2:].strip()
        f.seek(0)
        for r in csv.reader(l for l in f if not l.startswith("#")):
            if r and r[0].isdigit():
                nixl[int(r[0])] = float(r[4])
                nixl_blocks[int(r[0])] = int(r[1])
except OSError:
    pass
nixl_ucx = ""
try:
    nixl_ucx = open(os.path.join(out, "nixl-ucx.txt")).read().strip()
except OSError:
    pass
nixl_err = (re.search(r"err_mode=(\w+)", nixl_head) or [None, "peer"])[1]
for s in sorted(nixl):
    x = load(f"xfer-like-nixl-{s}.json")
    r = (x or {}).get("results", [{}])[0] if x and x.get("results") else {}
    k = r.get("gbps")
    diffs = []
    if x:
        if x["ucx"]["err_mode"] != nixl_err:
            diffs.append(f"error mode: kvx {x['ucx']['err_mode']}, NIXL {nixl_err}")
        if r.get("inflight") != nixl_blocks.get(s):
            diffs.append(f"descriptors per batch: kvx {r.get('inflight')}, NIXL {nixl_blocks.get(s)}")
        ws, nb = x["memory"]["working_set_bytes"], int(env("GPU_CHECK_NIXL_XFER", "0"))
        if ws != nb:
            diffs.append(f"bytes read over: kvx {ws}, NIXL {nb}")
        lib = x["ucx"]["library"]
        if not nixl_ucx or os.path.realpath(lib) != os.path.realpath(nixl_ucx):
            diffs.append(f"UCX library: kvx {os.path.basename(lib)} {x['ucx']['version']}, NIXL "
                         + (f"its bundled {os.path.basename(nixl_ucx)}" if nixl_ucx else "its bundled UCX (not found)"))
        diffs.append(f"progress: kvx --progress {x['ucx']['progress']} (its target process serves in its own loop), "
                     "NIXL's target agent a progress thread")
    row(f"kvx / NIXL VRAM READ @ {s >> 10} KiB x{nixl_blocks.get(s)}", k, nixl.get(s), ">= 1.5", diffs)

# ucx_perftest, like for like: one buffer, one GET at a time, the library beside it.
perf = {}
try:
    with open(os.path.join(out, "perftest.csv")) as f:
        for r in csv.reader(f):
            perf[int(r[0])] = float(r[1]) * 1048576 / 1e9
except OSError:
    pass
lp = load("xfer-like-perftest.json")
lpk = {r["size_bytes"]: r["gbps"] for r in (lp or {}).get("results", [])}
for s in sorted(perf):
    diffs = ["memory: kvx cuMemAlloc buffers registered by kvx, ucx_perftest its own allocation",
             "GETs: kvx --inflight 1 batches of one GET, ucx_perftest -n 5000 iterations"]
    if lp and lp["ucx"]["err_mode"] != "none":
        diffs.append(f"error mode: kvx {lp['ucx']['err_mode']}, ucx_perftest none")
    row(f"kvx / ucx_perftest ucp_get @ {s >> 10} KiB (hot, 1 in flight)", lpk.get(s), perf.get(s), "", diffs)

g, ratio, depth = ceiling.get(16777216, (None, None, 0))
rows.append((f"kvx / device copy @ 16 MiB x{depth}", g, None, ratio, ">= 0.8", []))
bench, same = load("bench.json"), load("xfer-bench-size.json")
b = bench.get("throughput_gbps") if bench else None
x = same["results"][0]["gbps"] if same and same.get("results") else None
if bench:
    cal = bench.get("calibration") or {}
    # The bench's own same-run reference (same descriptor size and depth), when it calibrated.
    x = cal.get("xfer_same_size_gbps") or x
    print(f"kvx bench --mem cuda: {bench['requests_ok']} ok, {bench['requests_failed']} failed, "
          f"{bench['verify_failures']} verify failures, {bench['blocks_leaked']} blocks leaked; protocols:", uses(bench))
    for w in bench.get("warnings", []):
        print("  warning:", w)
row("bench / xfer at the descriptor size", b, x, ">= 0.8")
bw = ((bench or {}).get("calibration") or {}).get("device_bandwidth_gbps")

def span_p50(*docs):
    """transfer_bandwidth.span_gbps.p50 of the first document (a summary or a sweep point) with it."""
    for d in docs:
        for src in (d or {}, (d or {}).get("params") or {}):
            t = src.get("transfer_bandwidth")
            if isinstance(t, dict) and isinstance(t.get("span_gbps"), dict):
                return t["span_gbps"].get("p50")
    return None
UNAVAILABLE = "unavailable: the summary has no transfer_bandwidth.span_gbps (a kvx without the wall-span rule)"

# cuda-batch (issue 16): the same sizes and depths as UCX's step 2, and the P8->D2 request, with
# the batch API and with the gather kernel; the faster at 8 KiB should be the default.
at8 = {}
for copy, sfx in (("api", ""), ("kernel", "-kernel")):
    xb = load(f"xfer-batch{sfx}.json")
    if xb:
        cb = xb.get("cuda_batch") or {}
        print(f"kvx xfer --transport cuda-batch --batch-copy {copy}: {cb.get('driver_call', '?')} ({cb.get('path', '?')}), "
              f"{cb.get('calls_per_batch', 0):.0f} call(s) per batch")
        bbest, bceil = {}, {}
        for r in xb["results"]:
            s = r["size_bytes"]
            bbest[s] = max(bbest.get(s, 0.0), r["gbps"])
            if s not in bceil or r["inflight"] >= bceil[s][2]:
                bceil[s] = (r["gbps"], r.get("ratio_to_ceiling"), r["inflight"], r.get("post_us"))
        at8[copy] = bbest.get(8192)
        for s, target in ((8192, ">= 10"), (65536, ""), (1048576, ">= 0.9"), (16777216, ">= 0.9")):
            row(f"cuda-batch {copy} / UCX cuda_ipc xfer @ {s >> 10} KiB", bbest.get(s), best.get(s), target,
                ["best over depths on both sides"])
        g8, r8, d8, p8 = bceil.get(8192, (None, None, 0, None))
        bulk8 = next((r for r in xb["results"] if r["size_bytes"] == 8192 and r["inflight"] == d8), {})
        rows.append((f"cuda-batch {copy} / one device copy of the batch @ 8 KiB x{d8}", g8,
                     bulk8.get("bulk_copy_gbps"), bulk8.get("ratio_to_bulk_copy"), ">= 0.3", []))
        if p8 and d8:
            print(f"  posting at 8 KiB x{d8}: {p8:.1f} us per batch, {p8 * 1e3 / d8:.0f} ns per descriptor "
                  f"(kvx plan --post-ns cuda-batch={p8 * 1e3 / d8:.0f})")
    cmp = load(f"compare{sfx}.json")
    if cmp and cmp.get("sweep"):
        pts = {p["label"]: p for p in cmp["sweep"]}
        u, c = pts.get("ucx"), pts.get("cuda-batch")
        ug, cg = (u or {}).get("throughput_gbps"), (c or {}).get("throughput_gbps")
        for name, p in (("ucx", u), ("cuda-batch", c)):
            if p:
                print(f"kvx bench --compare-transports ucx,cuda-batch --batch-copy {copy}: {name}: {p['requests_ok']} ok, "
                      f"{p['requests_failed']} failed, {fmt(p['throughput_gbps'])} GB/s {p['params'].get('cuda_batch_paths', '')}")
        row(f"bench P8->D2 run: cuda-batch {copy} / ucx", cg, ug, ">= 10")
        cbi = cmp.get("cuda_batch") or {}
        if cbi:
            print(f"  per request: {cbi.get('calls_per_request', 0):.1f} calls, {cbi.get('copies_per_request', 0):.0f} copies, "
                  f"{cbi.get('descriptors_per_request', 0):.0f} descriptors ({cbi.get('unaligned_descriptors_per_request', 0):.0f} "
                  f"not 16-byte aligned), {cbi.get('post_ns_per_descriptor', 0):.0f} ns posting per descriptor")
        # A request's bandwidth by the wall-span rule (all its ranks' bytes over first start to
        # last end), not summed bytes over one rank's time.
        us, cs = span_p50(u), span_p50(c)
        if us is None or cs is None:
            print(f"  bench P8->D2 request span bandwidth, cuda-batch {copy}: {UNAVAILABLE}")
        row(f"bench P8->D2 request span p50: cuda-batch {copy} / ucx", cs, us, ">= 10")
        row(f"bench P8->D2 request span p50: cuda-batch {copy} / device bandwidth", cs, bw, ">= 0.3")
c1 = load("compare-c1.json")
if c1 and c1.get("sweep"):
    pts = {p["label"]: p for p in c1["sweep"]}
    for name in ("ucx", "cuda-batch"):
        p = pts.get(name)
        if p:
            print(f"kvx bench --compare-transports ucx,cuda-batch --concurrency 1: {name}: {p['requests_ok']} ok, "
                  f"{p['requests_failed']} failed, {fmt(p['throughput_gbps'])} GB/s, transfer p50 {p.get('transfer_p50_us') or 0:.0f} us")
    u1, c1s = span_p50(pts.get("ucx")), span_p50(pts.get("cuda-batch"))
    if u1 is None or c1s is None:
        print(f"  bench P8->D2 alone, request span bandwidth: {UNAVAILABLE}")
    row("bench P8->D2 alone (--concurrency 1) request span p50: cuda-batch / ucx", c1s, u1, ">= 10")
    row("bench P8->D2 alone (--concurrency 1) request span p50: cuda-batch / device bandwidth", c1s, bw, ">= 0.3")
if bench:
    s = span_p50(bench)
    if s is None:
        print(f"kvx bench --mem cuda request span bandwidth: {UNAVAILABLE}")
    row("bench --mem cuda (ucx) request span p50 / device bandwidth", s, bw, "")

# Every batch-copy path, aligned and not (issue 22: unaligned within 2x of aligned).
for copy in (env("GPU_CHECK_PATHS") or "kernel api api-v2 api-v1 per-copy").split():
    al = load(f"xfer-path-{copy}-aligned.json")
    r0 = (al or {}).get("results", [{}])[0] if al and al.get("results") else {}
    path = ((al or {}).get("cuda_batch") or {}).get("path")
    path = f" ({path})" if path else ""
    if al:
        print(f"kvx xfer --batch-copy {copy}{path}, 8 KiB x{r0.get('inflight')}: {fmt(r0.get('gbps'))} GB/s aligned, "
              f"{r0.get('verified_batches')} of {r0.get('timed_batches')} timed batches verified")
    for tag, what in (("3", "--misalign 3 (agree mod 16)"), ("0-1", "--misalign 0,1 (differ mod 16)")):
        un = load(f"xfer-path-{copy}-{tag}.json")
        r1 = (un or {}).get("results", [{}])[0] if un and un.get("results") else {}
        if un:
            print(f"  {what}: {fmt(r1.get('gbps'))} GB/s, {r1.get('unaligned_descriptors', 0) // max(1, r1.get('timed_batches') or 1)} "
                  f"unaligned descriptors per batch, {r1.get('verified_batches')} of {r1.get('timed_batches')} timed batches verified")
        row(f"cuda-batch {copy}{path} @ 8 KiB: {what} / aligned", r1.get("gbps"), r0.get("gbps"), ">= 0.5")

push = load("push.json")
if push and bench:
    row("push / pull bench P8->D2 (same shape, UCX on device memory)", push.get("throughput_gbps"),
        bench.get("throughput_gbps"), "0.9-1.1")
    row("push / pull bench P8->D2 request span p50", span_p50(push), span_p50(bench), "")

# Host buffers (step 7b): the two copies as stages, the staged run against the direct one.
hb = load("hostbuf.json")
if hb and hb.get("sweep"):
    pts = {p.get("label"): p for p in hb["sweep"]}
    for label, p in pts.items():
        prm = p.get("params") or {}
        print(f"kvx bench --mem cuda --kv-buffer-device {label}: {p.get('requests_ok')} ok, {p.get('requests_failed')} failed, "
              f"{fmt(p.get('throughput_gbps'))} GB/s, KV ready p50 {fmt(p.get('kv_ready_p50_us'))} us"
              + (f", save_to_host p50 {fmt(prm.get('save_to_host_p50_us'))} us, sync_to_device p50 "
                 f"{fmt(prm.get('sync_to_device_p50_us'))} us" if label == "cpu" else ""))
    print(f"  whole run: {hb.get('verify_failures')} verify failures, {hb.get('blocks_leaked')} leaked, "
          f"{hb.get('bytes_verified')} bytes verified")
    if "cpu" in pts and "cuda" in pts:
        row("host buffer / direct (--kv-buffer-device cpu / cuda), throughput", pts["cpu"].get("throughput_gbps"),
            pts["cuda"].get("throughput_gbps"), "")

# Launches per request (step 8): a request's wall-span bandwidth against the same run's device
# copy, one batch per decode rank (rank) and one per peer (peer), alone and two at a time, and
# under MPS where it started.
for sfx, how in (("", ""), ("-mps", " under MPS"), ("-dev", " --batch-descriptors device"),
                 ("-dev-mps", " --batch-descriptors device under MPS")):
    for c, target in ((1, ">= 0.5"), (2, ">= 0.4")):
        got = {}
        for launch in ("rank", "peer", "auto"):
            lb = load(f"launch-{launch}-c{c}{sfx}.json")
            if not lb:
                continue
            dev = (lb.get("calibration") or {}).get("device_bandwidth_gbps")
            got[launch] = span_p50(lb)
            cbi = lb.get("cuda_batch") or {}
            print(f"kvx bench cuda-batch --batch-launch {launch} --concurrency {c}{how}: {lb['requests_ok']} ok, "
                  f"descriptors made on {'/'.join(cbi.get('descriptors_made_on') or ['host'])}, "
                  f"{lb['requests_failed']} failed, {lb['verify_failures']} verify failures, {lb['blocks_leaked']} leaked, "
                  f"launch used {'/'.join(cbi.get('launches') or ['peer'])}, "
                  f"{cbi.get('calls_per_request', 0):.1f} calls per request, {fmt(lb.get('throughput_gbps'))} GB/s, "
                  f"device {fmt(dev)} GB/s; per decode rank and request: pack {fmt(cbi.get('pack_us_per_rank'))} us, "
                  f"post {fmt(cbi.get('post_us_per_rank'))} us, wait {fmt(cbi.get('wait_us_per_rank'))} us")
            row(f"P8->D2 70B cuda-batch --batch-launch {launch} --concurrency {c}{how}: request span p50 / device bandwidth",
                got[launch], dev, target)
        if got.get("rank") and got.get("peer"):
            row(f"P8->D2 70B cuda-batch --concurrency {c}{how}: span p50, launch rank / peer", got["rank"], got["peer"], "")
for sfx, how in (("", ""), ("-dev", " --batch-descriptors device")):
    d1 = load(f"launch-rank-c1-d1{sfx}.json")
    if not d1:
        continue
    cbi = d1.get("cuda_batch") or {}
    dev = (d1.get("calibration") or {}).get("device_bandwidth_gbps")
    print(f"kvx bench cuda-batch P8->D1 --batch-launch rank --concurrency 1{how}: {d1['requests_ok']} ok, {d1['requests_failed']} failed, "
          f"{d1['verify_failures']} verify failures, {d1['blocks_leaked']} leaked; per decode rank and request: pack "
          f"{fmt(cbi.get('pack_us_per_rank'))} us, post {fmt(cbi.get('post_us_per_rank'))} us, wait {fmt(cbi.get('wait_us_per_rank'))} us")
    row(f"P8->D1 70B cuda-batch --batch-launch rank --concurrency 1{how} (one decode rank): request span p50 / device bandwidth",
        span_p50(d1), dev, "")
dv = load("device-verify.json")
if dv:
    print(f"kvx bench --transport cuda-batch --batch-descriptors device --verify full: {dv.get('requests_ok')} ok, "
          f"{dv.get('requests_failed')} failed, {dv.get('verify_failures')} verify failures, "
          f"{dv.get('bytes_verified')} bytes verified, {dv.get('blocks_leaked')} blocks leaked, "
          f"descriptors made on {'/'.join((dv.get('cuda_batch') or {}).get('descriptors_made_on') or ['host'])}")

serve = load("serve/serve.json")
if serve:
    print(f"serve-engine behind serve-proxy: load {serve.get('requests_ok')} ok, {serve.get('requests_failed')} failed "
          f"in {fmt(serve.get('duration_s'))} s; {serve.get('orphans')}; prefill at exit {serve['prefill'].get('at_exit')}; "
          f"decode at exit {serve['decode'].get('at_exit')}; problems: {serve.get('problems') or 'none'}")
for name in ("gate-same", "gate-slow", "gate-committed"):
    v = load(f"{name}-verdict.json")
    if v:
        print(f"kvx gate {name}: {v.get('verdict')}")

if push:
    print(f"kvx bench --mem cuda --mode push: {push['requests_ok']} ok, {push['requests_failed']} failed, "
          f"{push['verify_failures']} verify failures, {push['blocks_leaked']} blocks leaked, "
          f"{push['throughput_gbps']:.2f} GB/s; protocols:", uses(push).replace("<-", "->"))
    for w in push.get("warnings", []):
        print("  warning:", w)
ver = load("verify.json")
if ver:
    print(f"kvx bench --transport cuda-batch --verify full: {ver['requests_ok']} ok, {ver['requests_failed']} failed, "
          f"{ver['verify_failures']} verify failures, {ver['bytes_verified'] / 1e9:.1f} GB verified of "
          f"{ver['bytes_read'] / 1e9:.1f} GB read, {ver['blocks_leaked']} blocks leaked, "
          f"transfer p50 {((ver.get('stages') or {}).get('transfer') or {}).get('p50_us', 0):.0f} us")
if bw:
    print(f"device bandwidth (one 256 MiB device copy, bench calibration): {bw:.0f} GB/s")
if at8.get("api") and at8.get("kernel"):
    faster = max(at8, key=at8.get)
    print(f"cuda-batch at 8 KiB: kernel / api = {at8['kernel'] / at8['api']:.2f}: the {faster} is faster "
          f"(the default is kernel)")
# Rows with no figure on either side (their steps were skipped or failed) are left out.
rows = [r for r in rows if r[1] is not None or r[2] is not None]
w = max([len(r[0]) for r in rows] + [5])
print(f"\n{'ratio':<{w}}  {'kvx GB/s':>9}  {'peer GB/s':>9}  {'ratio':>6}  target")
for r in rows:
    print(f"{r[0]:<{w}}  {fmt(r[1]):>9}  {fmt(r[2]):>9}  {fmt(r[3]):>6}  {r[4]}")
    for d in r[5]:
        print(f"{'':<{w}}    differs: {d}")

# One results file: every step's command, status, seconds and kvx JSON.
repo, home = env("GPU_CHECK_REPO", ""), os.path.expanduser("~")
bundle = env("GPU_CHECK_BUNDLE", "")
def rel(text):
    text = text.replace(os.path.abspath(out), "$OUT").replace(out, "$OUT")
    if bundle:
        text = text.replace(bundle, "kvx-bundle")
    if repo:
        text = text.replace(repo + "/", "").replace(repo, ".")
    return text.replace(home, "~") if home and home != "/" else text
def scrub(v):
    if isinstance(v, str):
        return rel(v)
    if isinstance(v, list):
        return [scrub(x) for x in v]
    if isinstance(v, dict):
        return {k: scrub(x) for k, x in v.items()}
    return v
steps = []
print("\nsteps:")
with open(os.path.join(out, "status.tsv")) as f:
    for line in f:
        name, status, ms, jfile, note, cmd = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
        print(f"  {name}  {status}  {note}")
        st = {"step": name, "status": status, "seconds": round(int(ms or 0) / 1e3, 1), "command": rel(cmd), "note": rel(note)}
        if note.endswith(".csv") and os.path.isfile(note):
            with open(note) as c:  # a peer's own output (ucx_perftest, NIXL)
                st["output_csv"] = [l.rstrip("\n") for l in c]
        if jfile:
            try:
                with open(jfile) as j:
                    st["output"] = scrub(json.load(j))
            except Exception as e:
                st["output"] = None
                st["output_error"] = f"{os.path.basename(jfile)}: {e}"
        steps.append(st)
card = env("GPU_CHECK_CARD") or ""
if not card:
    doc = load("doctor.json") or {}
    for c in doc.get("checks", []):
        if c.get("name") == "cuda.devices" and c.get("verdict") == "ok":
            # "0: NVIDIA H100 80GB HBM3 (79.1 GiB), 1: ...": the first device's name.
            card = re.sub(r"^\d+: (.*?) \([\d.]+ GiB\).*$", r"\1", c.get("detail", ""))
card = card or "unknown-gpu"
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")[:40] or "unknown-gpu"
result = {
    "schema": "kvx-gpu-check/1",
    "date": date,
    "card": card,
    "driver": env("GPU_CHECK_DRIVER") or None,
    "kvx": env("GPU_CHECK_KVX") or None,
    "commit": env("GPU_CHECK_COMMIT") or None,
    "ucx_library": rel(env("GPU_CHECK_UCX") or "") or None,
    "steps": steps,
    "ratios": [{"what": r[0], "kvx_gbps": r[1], "peer_gbps": r[2], "ratio": r[3], "target": r[4], "differences": r[5]}
               for r in rows],
}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
print(f"\nreports: {out}")
print(f"results file: {out}/gpu-check.json; commit it as results/gpu-{slug}-{date}.json")
EOF
if grep -q "$(printf '\tfailed\t')" "$STATUS"; then exit 1; fi
exit 0
