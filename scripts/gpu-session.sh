#!/usr/bin/env bash
# One GPU session's device calls, each one command: the 600 s serve run (scripts/gpu-check.sh
# step serve) started detached in the first call and collected in the next, with other steps
# run beside it and after it. For a device machine lent for minutes, whose one command runs
# 10 minutes at most and which stays held ~30 s after a command (so the next call must follow
# at once).
#
#   scripts/gpu-session.sh start [STEP...]     call 1: unpack the bundle, start serve detached,
#                                              run STEPs (gpu-check step names) beside it, then
#                                              hold until GPU_SESSION_HOLD seconds (default 565)
#   scripts/gpu-session.sh collect [STEP...]   call 2: wait for serve (GPU_SESSION_WAIT, 200 s
#                                              at most), keep its results, then run STEPs alone
#   scripts/gpu-session.sh run STEP...         any later call: STEPs alone
#
# The bundle (scripts/bundle.sh --out .gpu/kvx-bundle.tar.xz, with .gpu/ in .git/info/exclude
# and carried) is unpacked once per machine to /tmp/kvx-gpu-session. Serve runs from the
# bundle's own copy of gpu-check.sh: each call copies the tree afresh, which must not change a
# script bash is still reading. Each call writes what it has to $OUT (the device tool's folder;
# else GPU_SESSION_OUT): gpu-check.json and the printed table per part (start-*, serve-*,
# collect-*, run-*), and a tar.gz of each part's reports. STEP names and what they run:
# scripts/gpu-check.sh's header. Steps run beside serve share the GPU with it: their times are
# contended, say so with their numbers (serve's results record when it ran).
#
# The NIXL peer (step nixl) needs nixl_cu13 importable beside the host's torch: carry
# .gpu/nixl-slim.tar.xz (scripts/nixl-slim.sh; 17 MB for nixl-cu13 1.5.1) and it is unpacked
# once per machine and put on PYTHONPATH.
#
# Environment: GPU_CHECK_SERVE_SECONDS (default 600), GPU_CHECK_* as gpu-check.sh takes them
# (GPU_CHECK_MPS_LAUNCHES, GPU_CHECK_PATHS, ...), GPU_SESSION_BUNDLE (default
# .gpu/kvx-bundle.tar.xz), GPU_SESSION_NIXL (default .gpu/nixl-slim.tar.xz),
# GPU_SESSION_SERVE_MEM (default cuda; host tries this script without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
ROOT=/tmp/kvx-gpu-session
DEST="${OUT:-${GPU_SESSION_OUT:-$ROOT/out}}"
mkdir -p "$DEST"
BUNDLE="${GPU_SESSION_BUNDLE:-.gpu/kvx-bundle.tar.xz}"
cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  start|collect|run) ;;
  *) sed -n '2,31p' "$0"; exit 2 ;;
esac

if [ ! -x "$ROOT/kvx-bundle/kvx" ]; then
  [ -f "$BUNDLE" ] || { echo "gpu-session: no bundle at $BUNDLE (scripts/bundle.sh --out $BUNDLE, and carry it)" >&2; exit 2; }
  mkdir -p "$ROOT" && tar xf "$BUNDLE" -C "$ROOT" || exit 2
fi
export KVX_BIN="$ROOT/kvx-bundle/kvx" KVX_UCX_LIB="$ROOT/kvx-bundle/.ucx/libucx/lib/libucp.so.0"
# The NIXL peer's Python package, when carried (scripts/nixl-slim.sh), on the Python path.
NIXL_SLIM="${GPU_SESSION_NIXL:-.gpu/nixl-slim.tar.xz}"
if [ -f "$NIXL_SLIM" ] && [ ! -d "$ROOT/nixl" ]; then
  mkdir -p "$ROOT/nixl" && tar xf "$NIXL_SLIM" -C "$ROOT/nixl" || echo "gpu-session: could not unpack $NIXL_SLIM" >&2
fi
[ -d "$ROOT/nixl" ] && export PYTHONPATH="$ROOT/nixl${PYTHONPATH:+:$PYTHONPATH}"
head -n1 "$ROOT/kvx-bundle/BUNDLE.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null

# keep NAME DIR: a part's results file, table and reports into $DEST.
keep() {
  cp "$2/gpu-check.json" "$DEST/$1.json" 2>/dev/null
  tar czf "$DEST/$1-reports.tgz" -C "$(dirname "$2")" "$(basename "$2")" 2>/dev/null
}
# steps NAME STEP...: gpu-check.sh with those steps, alone or beside serve.
steps() {
  local name="$1"; shift
  [ $# -gt 0 ] || return 0
  GPU_CHECK_STEPS="$*" scripts/gpu-check.sh --out "$ROOT/$name" >"$DEST/$name.txt" 2>&1
  echo "$name ($*): exit $? at $((SECONDS - T0)) s"
  keep "$name" "$ROOT/$name"
}

case "$cmd" in
  start)
    rm -rf "$ROOT/serve" "$ROOT/serve.done"
    setsid bash -c "GPU_CHECK_STEPS=serve GPU_CHECK_SERVE_MEM=${GPU_SESSION_SERVE_MEM:-cuda} \
      '$ROOT/kvx-bundle/scripts/gpu-check.sh' --out '$ROOT/serve' >'$ROOT/serve.log' 2>&1; touch '$ROOT/serve.done'" \
      </dev/null >/dev/null 2>&1 &
    echo "serve started (${GPU_CHECK_SERVE_SECONDS:-600} s of load), detached"
    steps start "$@"
    hold="${GPU_SESSION_HOLD:-565}"
    while [ $((SECONDS - T0)) -lt "$hold" ] && [ ! -f "$ROOT/serve.done" ]; do sleep 1; done
    cp "$ROOT/serve.log" "$DEST/serve-partial.txt" 2>/dev/null
    echo "start ends at $((SECONDS - T0)) s; serve $([ -f "$ROOT/serve.done" ] && echo done || echo 'still running: call collect now')"
    ;;
  collect)
    wait_s="${GPU_SESSION_WAIT:-200}"
    while [ ! -f "$ROOT/serve.done" ] && [ $((SECONDS - T0)) -lt "$wait_s" ]; do sleep 1; done
    if [ -f "$ROOT/serve.done" ]; then
      cp "$ROOT/serve.log" "$DEST/serve.txt"
      keep serve "$ROOT/serve"
      tail -n 12 "$ROOT/serve.log"
    else
      echo "gpu-session: serve has not finished after ${wait_s} s (was start called on this machine?)" >&2
    fi
    steps collect "$@"
    ;;
  run)
    steps "run-$(date +%H%M%S)" "$@"
    ;;
esac
echo "gpu-session $cmd: $((SECONDS - T0)) s; results in $DEST"
