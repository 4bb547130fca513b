#!/usr/bin/env bash
# Installs NIXL's C API (libnixl_capi.so, which `kvx --transport nixl` opens at run time) and
# its Python package (the NIXL peers import it) from PyPI's nixl-cu12 wheel into
# <project>/.nixl/.
#
#   scripts/setup-nixl.sh            # install the pinned version (idempotent, quiet)
#   scripts/setup-nixl.sh --force    # reinstall
#   NIXL_WHEEL_VERSION=1.5.1 scripts/setup-nixl.sh --force
#
# Layout after install (the wheel's own: the libraries' rpaths are relative, libnixl.so looks
# for its plugins in ./plugins beside itself, the UCX plugin finds UCX in ../../nixl_cu12.libs):
#   .nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so, libnixl.so, ...
#   .nixl/.nixl_cu12.mesonpy.libs/plugins/libplugin_UCX.so, libplugin_POSIX.so
#   .nixl/nixl_cu12.libs/        NIXL's own UCX and the other bundled dependencies
#   .nixl/nixl_cu12/             the Python package (PYTHONPATH=.nixl; it needs numpy)
#   .nixl/nixl_cu12-<version>.dist-info/   the wheel's metadata (kvx reads the version from it)
# The other backend plugins, the telemetry exporters and the expert-parallel extension
# (nixl_ep_cu12) are left out: kvx and its peers only use UCX (POSIX is kept for file tests).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${NIXL_WHEEL_VERSION:-1.5.1}"
DEST=.nixl
LIBS=.nixl_cu12.mesonpy.libs
MARKER="$DEST/.installed-nixl-cu12-$VERSION"
force=0
[ "${1:-}" = "--force" ] && force=1

check_install() {
  # The C API must open (every bundled dependency resolves through the rpaths) and find the
  # UCX plugin; the agent is created without backends, so nothing is started.
  NIXL_LOG_LEVEL=WARN python3 - "$PWD/$DEST/$LIBS/libnixl_capi.so" <<'EOF'
import ctypes, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError as e:
    sys.exit(f"cannot open {sys.argv[1]}: {e}")
agent, plugins, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
if lib.nixl_capi_create_agent(b"kvx-setup-check", ctypes.byref(agent)) != 0:
    sys.exit("nixl_capi_create_agent failed")
names = []
if lib.nixl_capi_get_available_plugins(agent, ctypes.byref(plugins)) == 0:
    lib.nixl_capi_string_list_size(plugins, ctypes.byref(n))
    for i in range(n.value):
        s = ctypes.c_char_p()
        if lib.nixl_capi_string_list_get(plugins, ctypes.c_size_t(i), ctypes.byref(s)) == 0:
            names.append(s.value.decode())
    lib.nixl_capi_destroy_string_list(plugins)
lib.nixl_capi_destroy_agent(agent)
if "UCX" not in names:
    sys.exit(f"the UCX plugin was not found (plugins: {names or 'none'})")
EOF
}

if [ "$force" = 0 ] && [ -f "$MARKER" ] && [ -f "$DEST/$LIBS/libnixl_capi.so" ]; then
  exit 0
fi

command -v python3 >/dev/null || { echo "setup-nixl: python3 is required (apt-get install python3 python3-pip)" >&2; exit 1; }
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "setup-nixl: pip is required (apt-get install python3-pip)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The wheel is tagged cp311 only; kvx uses its C library, not its Python extension, so the
# target is named explicitly and any local Python can fetch it. `pip download` only fetches,
# so PEP 668 (externally managed Python) does not apply; --break-system-packages is retried
# only if a pip refuses anyway.
dl() {
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 --dest "$tmp" "$@" \
    "nixl-cu12==$VERSION"
}
if ! dl 2>"$tmp/pip.err"; then
  if grep -q externally-managed "$tmp/pip.err" && dl --break-system-packages 2>"$tmp/pip.err"; then :; else
    cat "$tmp/pip.err" >&2
    echo "setup-nixl: could not download nixl-cu12==$VERSION from PyPI" >&2
    exit 1
  fi
fi
wheel=$(ls "$tmp"/nixl_cu12-*.whl)

mkdir -p "$tmp/w"
if command -v unzip >/dev/null; then
  unzip -q -o "$wheel" "$LIBS/*" 'nixl_cu12.libs/*' 'nixl_cu12/*' 'nixl_cu12-*.dist-info/*' -d "$tmp/w"
else
  python3 -m zipfile -e "$wheel" "$tmp/w"
  rm -rf "$tmp"/w/nixl_ep_cu12* "$tmp"/w/nixl_cu12-*.data "$tmp"/w/nixl_cu12.scripts
fi
# Plugins: UCX and POSIX only. The wheel carries a second copy of the plugins in
# nixl_cu12.libs/nixl/ that libnixl.so does not load from; it is pruned the same way.
for d in "$tmp/w/$LIBS/plugins" "$tmp/w/nixl_cu12.libs/nixl"; do
  [ -d "$d" ] || continue
  find "$d" -type f ! -name 'libplugin_UCX.so' ! -name 'libplugin_POSIX.so' -delete
done
[ -f "$tmp/w/$LIBS/plugins/libplugin_UCX.so" ] || {
  echo "setup-nixl: nixl-cu12==$VERSION has no $LIBS/plugins/libplugin_UCX.so (layout changed?)" >&2
  exit 1
}
# libtool archives are not needed to load UCX's modules at run time.
find "$tmp/w" -name '*.la' -delete

rm -rf "$DEST.new"
mkdir -p "$DEST.new"
mv "$tmp/w/$LIBS" "$tmp/w/nixl_cu12.libs" "$tmp/w/nixl_cu12" "$tmp"/w/nixl_cu12-*.dist-info "$DEST.new/"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"

if ! err=$(check_install 2>&1); then
  echo "$err" >&2
  echo "setup-nixl: NIXL $VERSION unpacked in $DEST but its C API does not work (see above); kvx --transport nixl will not run" >&2
  exit 1
fi
touch "$MARKER"
echo "setup-nixl: NIXL $VERSION installed in $DEST ($(du -sh "$DEST" | cut -f1))"
