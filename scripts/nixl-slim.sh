#!/usr/bin/env bash
# Packs the NIXL wheel the NIXL peer needs (scripts/peers/nixl_peer.py: UCX backend, VRAM) into
# a tar.xz small enough to carry beside the kvx bundle to a GPU host with no network (a device
# call takes 64 MiB in all; the whole nixl-cu13 1.5.1 wheel is 59 MB): the wheel unpacked as a
# Python path entry, without the expert-parallel extension (nixl_ep_*) and without the backend
# plugins other than UCX, which the peer never loads.
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .gpu nixl-cu13==1.5.1
#   scripts/nixl-slim.sh .gpu/nixl_cu13-1.5.1-*.whl .gpu/nixl-slim.tar.xz && rm .gpu/nixl_cu13-*.whl
#
# scripts/gpu-session.sh unpacks .gpu/nixl-slim.tar.xz (when it is there) and puts it on
# PYTHONPATH, so scripts/gpu-check.sh's step nixl finds nixl_cu13 (the GPU host brings torch).
set -euo pipefail
[ $# -eq 2 ] || { sed -n '2,14p' "$0"; exit 2; }
wheel="$1" out="$2"
[ -f "$wheel" ] || { echo "nixl-slim: no wheel at $wheel" >&2; exit 2; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
python3 -m zipfile -e "$wheel" "$stage" || { echo "nixl-slim: $wheel is not a wheel (zip)" >&2; exit 2; }
rm -rf "$stage"/nixl_ep_*
found=0
for d in "$stage"/.nixl_*.mesonpy.libs/plugins "$stage"/nixl_*.libs/nixl; do
  [ -d "$d" ] || continue
  [ -f "$d/libplugin_UCX.so" ] && found=1
  find "$d" -type f ! -name 'libplugin_UCX.so' -delete
done
[ "$found" -eq 1 ] || { echo "nixl-slim: no UCX plugin in $wheel (a NIXL wheel with its plugins is needed)" >&2; exit 2; }
mkdir -p "$(dirname "$out")"
tar -C "$stage" -cJf "$out" .
echo "nixl-slim: $out ($(du -h "$out" | cut -f1))"
