#!/usr/bin/env bash
# Checks that the image builds from a clean clone. With podman or docker (and an engine
# behind it) it builds the Containerfile. Without one it says so and runs the Containerfile's
# steps itself instead: a fresh `git clone` of this repository's HEAD into a temp directory,
# each RUN of the build stage after `WORKDIR /src` executed there as written (the stage's
# apt-get line is replaced by a check that its packages are installed here), then the final
# stage's COPY lines emulated into an image directory and its kvx run (`kvx --version`,
# `kvx doctor --no-self-test`) with the image's ENV. That is not a container build: the
# host's toolchain and libraries stand in for the base images'.
#   scripts/container-check.sh            # keep nothing; KEEP=1 keeps the directory
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

for engine in podman docker; do
  if command -v "$engine" >/dev/null && "$engine" info >/dev/null 2>&1; then
    echo "container-check: building with $engine from a clean clone"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    git clone --quiet --no-hardlinks "$repo" "$tmp/src"
    "$engine" build -t kvx:check -f "$tmp/src/Containerfile" "$tmp/src"
    "$engine" run --rm kvx:check --version
    exit 0
  fi
done

tmp=$(mktemp -d)
if [ "${KEEP:-0}" = 1 ]; then echo "container-check: keeping $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
echo "container-check: no container engine here (podman/docker missing or not running): NOT a"
echo "container-check: container build. Running the Containerfile's steps in a clean clone instead:"
echo "container-check: $tmp/src (HEAD $(git rev-parse --short HEAD)), this host's toolchain standing in"
git clone --quiet --no-hardlinks "$repo" "$tmp/src"

# The build stage's packages, in place of its apt-get line.
pkgs=$(sed -n 's/^RUN apt-get update && apt-get install -y --no-install-recommends \([^&]*\)&&.*/\1/p' Containerfile | head -1)
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || { echo "container-check: package $p (the build stage installs it) is missing here" >&2; exit 1; }
done
echo "container-check: build-stage packages present: $pkgs"

# The build stage's RUN lines after WORKDIR /src, as written, in the clone.
awk '/^FROM /{stage++} stage==1 && /^WORKDIR \/src/{on=1; next} stage==1 && on && /^RUN /{sub(/^RUN /,""); print}' Containerfile >"$tmp/steps"
[ -s "$tmp/steps" ] || { echo "container-check: no RUN steps found in Containerfile" >&2; exit 1; }
while IFS= read -r step; do
  echo "container-check: RUN $step"
  start=$(date +%s)
  (cd "$tmp/src" && CARGO_TARGET_DIR="$tmp/src/target" bash -euo pipefail -c "$step")
  echo "container-check: ... done in $(($(date +%s) - start)) s"
done <"$tmp/steps"

# The final stage's COPY --from=build lines into an image directory, then its kvx.
img="$tmp/image"
grep '^COPY --from=build ' Containerfile | while read -r _ _ from to; do
  mkdir -p "$img$(dirname "$to")"
  cp -a "$tmp$from" "$img$to"
  echo "container-check: COPY $from -> $to"
done
export KVX_UCX_DIR="$img/opt/kvx/.ucx" KVX_NIXL_DIR="$img/opt/kvx/.nixl"
"$img/usr/local/bin/kvx" --version
(cd "$tmp" && "$img/usr/local/bin/kvx" doctor --no-self-test)
echo "container-check: ok: the Containerfile's steps built kvx, UCX and NIXL from a clean clone (no container engine was used)"
