#!/usr/bin/env python3
"""Writes the accuracy table of docs/prediction.md between its `<!--table-->` lines, one fig
marker per figure, from results/prediction/table-<path>.json (scripts/predict-table.sh).
Run `KVX_DOCS_UPDATE=1 cargo test --release --test it docs::` after it to fill the markers."""
import json, sys

path = sys.argv[1] if len(sys.argv) > 1 else "ucx"
src = f"results/prediction/table-{path}.json"
doc = "docs/prediction.md"
t = json.load(open(src))
rows = ["| shape | model | P tp -> D tp | prompt tokens | at once | predicted p50 ms | measured p50 ms | measured / predicted p50 | p90 | bound |",
        "|---|---|---|---|---|---|---|---|---|---|"]
for i, r in enumerate(t["shapes"]):
    head = f"| {r['shape']} | {r['model']}{(' `' + r['flags'] + '`') if r.get('flags') else ''} | {r['p_tp']} -> {r['d_tp']} | {r['prompt_len']} | {r['concurrency']} |"
    if r.get("failed"):
        rows.append(head + " not measured (the run failed) | | | | |")
        continue
    f = lambda key, fmt: f"<!--fig {src}#shapes.{i}.{key} {fmt}-->0<!--/fig-->"
    rows.append(head + f" {f('predicted_span_p50_us', '*0.001,1')} | {f('measured_span_p50_us', '*0.001,1')} | {f('ratio_p50', '3')} | {f('ratio_p90', '3')} | {r['bound']} |")
text = open(doc).read()
a, b = text.index("<!--table-->\n"), text.index("<!--/table-->")
open(doc, "w").write(text[: a + len("<!--table-->\n")] + "\n".join(rows) + "\n" + text[b:])
