#!/usr/bin/env bash
# Sets up what the NIXL/vLLM peers (scripts/peers/nixl_pd_peer.py, and vLLM's own workers
# wrapped as real_prefill.py / real_decode.py) need, inside the project only:
#   .venv-peers/   a Python 3.11 venv with nixl-cu12 (NIXL's Python API, its UCX backend) and
#                  numpy, msgspec, pyzmq, regex
#   .vllm-033/     vLLM 0.33.0's Python files from its wheel (no compiled extensions, no
#                  C/CUDA sources, no vllm-rs binary): VLLM_033_SRC=.vllm-033/vllm
#
#   scripts/setup-peers.sh            # install the pinned versions (idempotent, quiet)
#   scripts/setup-peers.sh --force    # reinstall both
#   PEERS_PYTHON=/usr/bin/python3.11 scripts/setup-peers.sh   # the interpreter for the venv
#
# nixl-cu12's wheel is built for CPython 3.11 only, so the venv must be a 3.11 one (python3.11
# if there is one, else python3).
# Versions are pinned to the ones checked together here; nixl-cu12 is installed without its
# dependencies (they would pull torch and the CUDA wheels, which the peers do not use).
set -euo pipefail
cd "$(dirname "$0")/.."

# python3.11 if there is one (python3 may be another version), else python3.
PY="${PEERS_PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  if command -v python3.11 >/dev/null; then PY=python3.11; fi
fi
VENV=.venv-peers
VLLM_DEST=.vllm-033
NIXL_VERSION=1.5.1
VLLM_VERSION=0.33.0
PKGS=(numpy==2.3.5 msgspec==0.23.0 pyzmq==27.3.0 regex==2026.12.2)
VENV_MARKER="$VENV/.installed-peers-nixl-$NIXL_VERSION-$(printf '%s\n' "${PKGS[@]}" | cksum | cut -d' ' -f1)"
VLLM_MARKER="$VLLM_DEST/.installed-vllm-$VLLM_VERSION"
# The file the peers load first: if it is missing, the unpacked tree is not usable.
VLLM_PROBE="$VLLM_DEST/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"
force=0
[ "${1:-}" = "--force" ] && force=1

venv_ok() { [ -f "$VENV_MARKER" ] && [ -x "$VENV/bin/python" ]; }
vllm_ok() { [ -f "$VLLM_MARKER" ] && [ -f "$VLLM_PROBE" ]; }

if [ "$force" = 0 ] && venv_ok && vllm_ok; then
  exit 0
fi

command -v "$PY" >/dev/null || { echo "setup-peers: $PY is required (apt-get install python3 python3-venv)" >&2; exit 1; }
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$pyver" != 3.11 ]; then
  echo "setup-peers: nixl-cu12==$NIXL_VERSION needs CPython 3.11, $PY is $pyver (install python3.11 or set PEERS_PYTHON)" >&2
  exit 1
fi
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  echo "setup-peers: the venv module is missing (apt-get install python3-venv)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# (a) the venv, made in place (a venv is not relocatable: its scripts name their own path);
# the marker is written last, so an install that fails is redone on the next run.
if [ "$force" = 1 ] || ! venv_ok; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  pipq() { "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
  if ! pipq install --no-deps "nixl-cu12==$NIXL_VERSION" 2>"$tmp/pip.err" \
      || ! pipq install "${PKGS[@]}" 2>>"$tmp/pip.err"; then
    cat "$tmp/pip.err" >&2
    echo "setup-peers: pip could not install nixl-cu12==$NIXL_VERSION ${PKGS[*]} into $VENV" >&2
    exit 1
  fi
  # As setup-nixl.sh: the expert-parallel extension (nixl_ep_cu12, about 100 MB) and the
  # backend plugins other than UCX and POSIX are never loaded by the peers.
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site"/nixl_ep_cu12
  for d in "$site/.nixl_cu12.mesonpy.libs/plugins" "$site/nixl_cu12.libs/nixl"; do
    [ -d "$d" ] || continue
    find "$d" -type f ! -name 'libplugin_UCX.so' ! -name 'libplugin_POSIX.so' -delete
  done
  # The check leaves with os._exit: NIXL 1.5.1's bundled libnl can crash in exit finalizers.
  if ! NIXL_LOG_LEVEL=WARN "$VENV/bin/python" - >"$tmp/check.err" 2>&1 <<'EOF'
import os, sys
import msgspec, numpy, regex, zmq  # noqa: F401
from nixl_cu12._api import nixl_agent, nixl_agent_config
a = nixl_agent("setup-peers-check", nixl_agent_config(backends=[]))
ok = "UCX" in a.get_plugin_list()
sys.stdout.flush()
os._exit(0 if ok else 3)
EOF
  then
    cat "$tmp/check.err" >&2
    echo "setup-peers: $VENV does not import nixl-cu12 with its UCX plugin (see above)" >&2
    exit 1
  fi
  touch "$VENV_MARKER"
fi

# (b) vLLM's Python files. The wheel (about 340 MB) is only downloaded, never installed: its
# dependencies (torch, CUDA) are not wanted; the wrapped workers load the few files they run.
if [ "$force" = 1 ] || ! vllm_ok; then
  dl() {
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-cache-dir \
      --no-deps --only-binary=:all: --dest "$tmp" "$@" "vllm==$VLLM_VERSION"
  }
  # The wheel is tagged cp38-abi3 manylinux_2_28; a pip that does not match the host to it
  # (older glibc, say) is given the target explicitly.
  if ! dl 2>"$tmp/pip.err" && ! dl --python-version 3.11 --implementation cp --abi abi3 \
      --platform manylinux_2_28_x86_64 2>>"$tmp/pip.err"; then
    cat "$tmp/pip.err" >&2
    echo "setup-peers: could not download vllm==$VLLM_VERSION from PyPI" >&2
    exit 1
  fi
  wheel=$(ls "$tmp"/vllm-"$VLLM_VERSION"-*.whl)
  mkdir -p "$tmp/w"
  # Only Python (and the data files beside it); compiled extensions, the vllm-rs binary and
  # the C/CUDA kernel sources are about 120 MB the peers never read.
  excl=('*.so' 'vllm/vllm-rs' '*.h' '*.hpp' '*.cuh' '*.cu' '*.inl' '*.cpp')
  if command -v unzip >/dev/null; then
    unzip -q -o "$wheel" 'vllm/*' -x "${excl[@]}" -d "$tmp/w"
  else
    "$VENV/bin/python" - "$wheel" "$tmp/w" "${excl[@]}" <<'EOF'
import fnmatch, sys, zipfile
wheel, dest, excl = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/")
             and not any(fnmatch.fnmatch(n, p) for p in excl)]
    z.extractall(dest, names)
EOF
  fi
  rm -f "$wheel"
  [ -f "$tmp/w/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py" ] || {
    echo "setup-peers: vllm==$VLLM_VERSION's wheel has no NIXL connector where expected (layout changed?)" >&2
    exit 1
  }
  rm -rf "$VLLM_DEST.new"
  mkdir -p "$VLLM_DEST.new"
  mv "$tmp/w/vllm" "$VLLM_DEST.new/"
  touch "$VLLM_DEST.new/.installed-vllm-$VLLM_VERSION"
  rm -rf "$VLLM_DEST"
  mv "$VLLM_DEST.new" "$VLLM_DEST"
fi

echo "setup-peers: $VENV ($(du -sh "$VENV" | cut -f1), nixl-cu12 $NIXL_VERSION) and $VLLM_DEST/vllm ($(du -sh "$VLLM_DEST" | cut -f1), vLLM $VLLM_VERSION) ready in $((SECONDS - start)) s"
