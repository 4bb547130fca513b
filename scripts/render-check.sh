#!/usr/bin/env bash
# Renders each kind of report.html once in a headless Chromium, by hand (not part of CI):
# a bench run (the quick start), a sweep, a comparison (--compare-transports with --rounds),
# a gate verdict (kvx gate --html-file) and two saved runs (kvx report A B --html). Each page is
# printed to PDF and screenshot to PNG with the browser cut off from every network (its own
# network namespace, where `unshare` can make one). What happened and how big each page is
# goes to results/docs/render-check/: `render.txt` (the browser's version, each page's bytes,
# figures and the sizes of its PDF and PNG) and `pages.json` (the same as data, quoted by
# docs/charts.md). The PDFs and PNGs stay in a temp dir (KEEP=DIR keeps them in DIR).
#
#   apt-get install -y chromium      # Debian's; the script says so and exits 2 without it
#   scripts/render-check.sh
#
# The runs are small: seconds each on host memory, the sweep a handful of points.
set -euo pipefail
cd "$(dirname "$0")/.."
KVX=${KVX:-target/release/kvx}
OUT=results/docs/render-check
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ]; then
  echo "render-check: no chromium here (Debian: apt-get install -y chromium)" >&2
  exit 2
fi
work=${KEEP:-$(mktemp -d)}
mkdir -p "$work" "$OUT"
runs="$work/runs"
rm -rf "$runs"

# The browser, with no network at all where a namespace can be had, else pointed at a proxy
# that does not exist (no request leaves either way).
offline=(unshare --net)
if ! unshare --net true 2>/dev/null; then
  offline=()
  no_net=(--proxy-server=127.0.0.1:9 --proxy-bypass-list='<-loopback>')
else
  no_net=()
fi
browse() {
  "${offline[@]}" "$CHROMIUM" --headless --disable-gpu --no-sandbox --hide-scrollbars \
    --no-first-run --disable-extensions --disable-background-networking "${no_net[@]}" "$@" 2>>"$work/chromium.log"
}

# The newest run directory under $runs.
newest() { ls -td "$runs"/*/ | head -1; }

echo "render-check: runs under $runs" >&2
"$KVX" bench --p-tp 8 --d-tp 2 --results-dir "$runs" >/dev/null
bench=$(newest)
"$KVX" bench --p-tp 8 --d-tp 2 --results-dir "$runs" >/dev/null
again=$(newest)
cat >"$work/sweep.toml" <<'EOF'
# Concurrency against bandwidth and the transfer span, predicted beside measured.
name = "concurrency-sweep"
model = "llama-3.1-8b"
p_tp = 2
d_tp = 2
prompt_len = 2048
requests = 12
warmup = 2

[sweep]
concurrency = [1, 2, 4, 8]
EOF
"$KVX" bench --sweep "$work/sweep.toml" --rates results/prediction/rates-ucx-r1.json --results-dir "$runs" >/dev/null
sweep=$(newest)
"$KVX" bench --p-tp 2 --d-tp 2 --model llama-3.1-8b --compare-transports ucx,storage --rounds 2 \
  --requests 10 --results-dir "$runs" >/dev/null
compare=$(newest)
gate_page="$work/gate.html"
set +e
"$KVX" gate --baseline "$bench" --current "$again" --html-file "$gate_page" >/dev/null
gate_status=$?
set -e
[ "$gate_status" -le 1 ] || { echo "render-check: kvx gate could not decide ($gate_status)" >&2; exit 1; }
"$KVX" report "$bench" "$again" --html --charts-dir "$work" >/dev/null
pair=$(ls "$work"/compare-*.html)

version=$("$CHROMIUM" --version 2>/dev/null || echo unknown)
{
  echo "browser: $version (headless; network: ${offline[*]:-proxy to a closed port})"
  echo "page | bytes | figures | loads from elsewhere | pdf bytes | pdf pages | png bytes | browser exit"
} >"$OUT/render.txt"
json="{\"browser\": \"$version\", \"gate_exit\": $gate_status, \"pages\": {"
sep=""
for kind in bench sweep compare gate pair; do
  case $kind in
    bench) page="$bench/report.html" ;;
    sweep) page="$sweep/report.html" ;;
    compare) page="$compare/report.html" ;;
    gate) page="$gate_page" ;;
    pair) page="$pair" ;;
  esac
  bytes=$(stat -c %s "$page")
  figures=$({ grep -o '<figure ' "$page" || true; } | wc -l)
  # src=, href=, url( and @import: what could make a browser ask for something.
  loads=$({ grep -o -i -E '<script|src=|href=|url\(|@import' "$page" || true; } | wc -l)
  set +e
  browse --print-to-pdf="$work/$kind.pdf" --no-pdf-header-footer "file://$page"
  pdf_exit=$?
  browse --screenshot="$work/$kind.png" --window-size=1100,2600 "file://$page"
  png_exit=$?
  set -e
  pdf_bytes=$(stat -c %s "$work/$kind.pdf" 2>/dev/null || echo 0)
  pdf_pages=$(python3 -c 'import re,sys; print(len(re.findall(rb"/Type\s*/Page(?!s)", open(sys.argv[1], "rb").read())))' \
    "$work/$kind.pdf" 2>/dev/null || echo 0)
  png_bytes=$(stat -c %s "$work/$kind.png" 2>/dev/null || echo 0)
  echo "$kind | $bytes | $figures | $loads | $pdf_bytes | $pdf_pages | $png_bytes | $pdf_exit/$png_exit" >>"$OUT/render.txt"
  json+="$sep\"$kind\": {\"bytes\": $bytes, \"figures\": $figures, \"loads\": $loads, \"pdf_bytes\": $pdf_bytes, \"pdf_pages\": $pdf_pages, \"png_bytes\": $png_bytes, \"browser_exit\": $((pdf_exit + png_exit))}"
  sep=", "
done
json+="}}"
echo "$json" | python3 -m json.tool >"$OUT/pages.json"
cat "$OUT/render.txt"
echo "render-check: PDFs and PNGs in $work" >&2
