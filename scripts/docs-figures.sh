#!/usr/bin/env bash
# Rewrites every sourced figure in README.md and docs/ from its results file (the markers
# `<!--fig FILE#PATH FMT-->` and `<!--figs FILE-->`, see tests/it/docs.rs), after
# scripts/docs-runs.sh (or a GPU run's scripts/gpu-check.sh) measured again. The docs test
# then passes; review the diff and commit it with the results files.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
# The GPU figures: derived from the committed gpu-check results (scripts/gpu-figures.py).
gpu=(results/gpu-*-[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*.json)
if [ -e "${gpu[0]}" ] && command -v python3 >/dev/null; then
  python3 scripts/gpu-figures.py "${gpu[@]}" > results/gpu-figures.json
fi
KVX_DOCS_UPDATE=1 cargo test --release --locked --test it -- docs:: --quiet
git --no-pager diff --stat -- README.md docs/
