#!/usr/bin/env bash
# Installs a modern UCX (zero-copy cma GET for user memory, CUDA transports) from PyPI's
# libucx-cu12 wheel into <project>/.ucx/, where kvx finds it before the system's UCX.
#
#   scripts/setup-ucx.sh            # install the pinned version (idempotent, quiet)
#   scripts/setup-ucx.sh --force    # reinstall
#   UCX_WHEEL_VERSION=1.21.0 scripts/setup-ucx.sh --force
#
# Layout after install (the wheel's own, which UCX relies on: libucs derives its module
# directory, lib/ucx/, and the module file names, libuct_cma.so.0, from its own path):
#   .ucx/libucx/lib/libucp.so.0 ...   .ucx/libucx/lib/ucx/libuct_cma.so.0 ...
#   .ucx/libucx/bin/ucx_info, ucx_perftest   .ucx/libucx_cu12.libs/ (ucx_perftest's libgomp)
# Debian's libucx0 (1.13) stays installed as kvx's fallback.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${UCX_WHEEL_VERSION:-1.22.0}"
DEST=.ucx
MARKER="$DEST/.installed-libucx-cu12-$VERSION"
force=0
[ "${1:-}" = "--force" ] && force=1

check_install() {
  # cma must be found as a module, or GETs from user memory fall back to slower paths.
  LD_LIBRARY_PATH="$PWD/$DEST/libucx/lib" "$DEST/libucx/bin/ucx_info" -d 2>/dev/null | grep -q 'Transport: cma'
}

if [ "$force" = 0 ] && [ -f "$MARKER" ] && [ -f "$DEST/libucx/lib/libucp.so.0" ]; then
  exit 0
fi

command -v python3 >/dev/null || { echo "setup-ucx: python3 is required (apt-get install python3 python3-pip)" >&2; exit 1; }
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "setup-ucx: pip is required (apt-get install python3-pip)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# `pip download` only fetches the wheel, so PEP 668 (externally managed Python, newer
# Debian) does not apply; --break-system-packages is retried only if a pip refuses anyway.
dl() { python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$@" "libucx-cu12==$VERSION"; }
if ! dl 2>"$tmp/pip.err"; then
  if grep -q externally-managed "$tmp/pip.err" && dl --break-system-packages 2>"$tmp/pip.err"; then :; else
    cat "$tmp/pip.err" >&2
    echo "setup-ucx: could not download libucx-cu12==$VERSION from PyPI" >&2
    exit 1
  fi
fi
wheel=$(ls "$tmp"/libucx_cu12-*.whl)

mkdir -p "$tmp/w"
if command -v unzip >/dev/null; then
  unzip -q -o "$wheel" 'libucx/*' 'libucx_cu12.libs/*' -d "$tmp/w"
else
  python3 -m zipfile -e "$wheel" "$tmp/w"
  chmod +x "$tmp"/w/libucx/bin/* "$tmp"/w/libucx/lib/*.so* "$tmp"/w/libucx/lib/ucx/*.so* "$tmp"/w/libucx_cu12.libs/* 2>/dev/null || true
fi
# Static archives are not needed to load UCX at run time.
find "$tmp/w" \( -name '*.a' -o -name '*.la' \) -delete

rm -rf "$DEST.new"
mkdir -p "$DEST.new"
mv "$tmp/w/libucx" "$tmp/w/libucx_cu12.libs" "$DEST.new/"
touch "$DEST.new/.installed-libucx-cu12-$VERSION"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"

if ! check_install; then
  echo "setup-ucx: warning: UCX $VERSION installed in $DEST but its cma transport was not found" >&2
fi
echo "setup-ucx: UCX $VERSION installed in $DEST"
