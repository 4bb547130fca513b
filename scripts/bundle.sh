#!/usr/bin/env bash
# Packs kvx for a host that cannot build it or reach a package registry (an offline GPU host):
# the release binary (stripped), the project's UCX (.ucx/: PyPI's libucx-cu12, whose CUDA
# transports need only the driver's libcuda, so it serves CUDA 12 and 13 drivers alike), the
# GPU acceptance script and the NIXL peer, in one tar.xz.
#
#   scripts/bundle.sh [--out FILE]        # default: target/kvx-bundle.tar.xz
#
# On the other host (x86_64 Linux, glibc 2.36 or newer; no Rust, no network):
#   tar xf kvx-bundle.tar.xz && cd kvx-bundle
#   ./kvx doctor                          # finds .ucx/ beside itself
#   scripts/gpu-check.sh                  # the GPU acceptance run (uses ./kvx)
#
# Run scripts/setup.sh first (it installs .ucx/ and builds kvx); this script builds the release
# binary again only if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=target/kvx-bundle.tar.xz
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "bundle: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

[ -f .ucx/libucx/lib/libucp.so.0 ] || { echo "bundle: no .ucx/ here: run scripts/setup.sh (or scripts/setup-ucx.sh) first" >&2; exit 2; }
if [ ! -x target/release/kvx ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release --locked --bins
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/kvx-bundle"
mkdir -p "$root/scripts/peers"
cp target/release/kvx "$root/kvx"
cp -a .ucx "$root/.ucx"
cp scripts/gpu-check.sh "$root/scripts/"
cp scripts/peers/nixl_peer.py "$root/scripts/peers/"
# The GPU gate's preset and thresholds (gpu-check.sh step "gate"), and its committed baseline.
mkdir -p "$root/bench-configs" "$root/results"
cp bench-configs/gpu.toml bench-configs/gates-gpu.toml "$root/bench-configs/"
[ -f results/baseline-gpu.json ] && cp results/baseline-gpu.json "$root/results/"
# Debug info is most of the binary's and the libraries' size; nothing here needs it.
if command -v strip >/dev/null; then
  strip "$root/kvx"
  find "$root/.ucx" -type f -name '*.so*' -exec strip --strip-unneeded {} + 2>/dev/null || true
fi
version=$("$root/kvx" --version 2>/dev/null || echo kvx)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
cat > "$root/BUNDLE.txt" <<EOF
$version (commit $commit), packed $(date -u +%Y-%m-%dT%H:%M:%SZ)
UCX: $(ls -a .ucx | sed -n 's/^\.installed-//p')

  ./kvx doctor               what this host has (CUDA driver, devices, UCX with CUDA, cuda_ipc)
  ./kvx bench --p-tp 8 --d-tp 2
  ./kvx bench --mem cuda --p-tp 8 --d-tp 2
  scripts/gpu-check.sh       the GPU acceptance run: doctor, xfer and bench on device memory,
                             the ucx_perftest peer (.ucx/libucx/bin), NIXL when python3 has it
EOF
mkdir -p "$(dirname "$OUT")"
tar -C "$stage" -cJf "$OUT" kvx-bundle
echo "bundle: $OUT ($(du -h "$OUT" | cut -f1)): $version, commit $commit"
