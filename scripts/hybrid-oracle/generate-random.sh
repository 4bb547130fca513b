#!/usr/bin/env bash
# Regenerates the random batch of hybrid cases (random-specs.py, seeded) into one gzipped case
# file, compact JSON:
#   scripts/hybrid-oracle/generate-random.sh OUT.json.gz [SEED COUNT]
# Defaults: seed 1, 120 specs (the committed tests/fixtures/oracle/hybrid_random_v033.json.gz).
# SUMMARY=FILE also writes what the batch holds (cases, refusals, READ pairs) for the guide
# (results/docs/hybrid-oracle/random-summary.json).
# Needs what generate-all.sh needs (scripts/setup-peers.sh once, the shared harness).
set -euo pipefail
[ $# -eq 1 ] || [ $# -eq 3 ] || { echo "usage: $0 OUT.json.gz [SEED COUNT]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-$root/.venv-peers/bin/python}
[ -x "$PYTHON" ] || { echo "generate-random: $PYTHON missing (run scripts/setup-peers.sh or set PYTHON)" >&2; exit 1; }
seed=${2:-1}
count=${3:-120}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mapfile -t specs < <("$PYTHON" "$here/random-specs.py" "$seed" "$count")
"$PYTHON" "$here/hybrid.py" --quiet --out "$tmp/cases.json" "${specs[@]}"
"$PYTHON" - "$tmp/cases.json" "$1" "${SUMMARY:-}" "$seed" "$count" <<'PY'
import gzip, json, sys
doc = json.load(open(sys.argv[1]))
with open(sys.argv[2], "wb") as out:  # no name, no time in the header: byte-reproducible
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as f:
        f.write(json.dumps(doc, separators=(",", ":")).encode())
cases = doc["cases"]
refused = sum(1 for c in cases if any("handshake_rejected" in d for d in c.get("d_ranks", [])))
pairs = sum(len(r["pairs[label,local_off,remote_off,len]"]) for c in cases for d in c.get("d_ranks", []) for r in d.get("reads", []))
if sys.argv[3]:
    summary = {"generated_by": f"scripts/hybrid-oracle/generate-random.sh (seed {sys.argv[4]}, {sys.argv[5]} specs)",
               "cases": len(cases), "refused": refused, "read_pairs": pairs}
    json.dump(summary, open(sys.argv[3], "w"), indent=2)
print(f"generate-random: {len(cases)} cases ({refused} refused), {pairs} READ pairs: {sys.argv[2]}")
PY
