#!/usr/bin/env bash
# Installs what kvx needs on a Debian machine (run as root, or with sudo available) and
# builds it. Idempotent: packages already present are not reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

# System packages: UCX (Debian's 1.13 as the fallback transport library, headers for the
# ABI check, ucx_perftest as a peer), a C compiler for the layout probe, pkg-config,
# python3/pip to fetch the modern UCX wheel, python3-venv for the peers' venv, iproute2 for
# the two-namespace test.
PKGS=(build-essential pkg-config libucx0 libucx-dev ucx-utils python3 python3-pip python3-venv unzip curl ca-certificates iproute2 procps)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Rust toolchain (edition 2024 needs a recent cargo; Debian's is too old).
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "setup: installing Rust with rustup"
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi

# The modern UCX (zero-copy cma GET for user memory, CUDA transports) into .ucx/.
if [ -x scripts/setup-ucx.sh ]; then scripts/setup-ucx.sh; fi
# NIXL's C API (kvx --transport nixl) and Python package (the NIXL peers) into .nixl/.
if [ -x scripts/setup-nixl.sh ]; then scripts/setup-nixl.sh; fi
# The NIXL/vLLM peers' venv (.venv-peers/) and vLLM 0.33.0's Python files (.vllm-033/).
if [ -x scripts/setup-peers.sh ]; then scripts/setup-peers.sh; fi

cargo build --release --locked --bins
