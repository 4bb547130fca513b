#!/usr/bin/env bash
# Regenerates every generated hybrid case (both batches) into one case file:
#   scripts/hybrid-oracle/generate-all.sh OUT.json
# Needs scripts/setup-peers.sh run once (.venv-peers/, .vllm-033/) and the shared harness
# (<repo root>/../shared/vllm-peer, or KVX_SHARED_DIR). PYTHON and VLLM_033_SRC override the
# defaults (<repo root>/.venv-peers/bin/python, <repo root>/.vllm-033/vllm).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT.json" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PYTHON=${PYTHON:-$root/.venv-peers/bin/python}
[ -x "$PYTHON" ] || { echo "generate-all: $PYTHON missing (run scripts/setup-peers.sh or set PYTHON)" >&2; exit 1; }

# 44/48-block pools: the sizes these gpt-oss cases were first generated with (hybrid.py's
# default sizing now gives larger pools, which moves region offsets, not which blocks move).
pin=p_blocks=44,d_blocks=48

# Cases kvx agrees with vLLM on.
agree=(
  # Nemotron-H, Qwen3-Next (GDN), Jamba (Mamba1), Falcon-H1, granite-4.0-h-tiny, gpt-oss
  nemotronh:2:1 nemotronh:4:2 qwen3next:4:2 qwen3next:2:1 jamba:1:1 jamba:1:2 jamba:2:1
  falconh1:1:2 falconh1:2:1 granite:1:2 granite:2:1 "gptoss:2:1::$pin" "gptoss:1:4::$pin"
  # more TP pairs, FlashInfer-aligned GDN, Jamba with 16 layers, short prompts
  nemotronh:1:4 nemotronh:4:1 nemotronh:2:4
  qwen3next:1:2::gdn_align=64 qwen3next:2:1::gdn_align=64 qwen3next:4:2::gdn_align=64
  qwen3next:1:4 qwen3next:8:2 jamba:1:4 jamba:4:1 jamba:2:2 jamba:4:2
  jamba:1:2:mamba1_jamba16_P1_D2:n_layers=16 jamba:2:1:mamba1_jamba16_P2_D1:n_layers=16
  jamba:1:1:mamba1_jamba_short_P1_D1:prompt=50
  falconh1:1:4 falconh1:4:1 falconh1:2:2 falconh1:4:2 falconh1:1:1
  granite:1:4 granite:4:1 granite:1:8 granite:2:2
  "gptoss:2:2::$pin" "gptoss:4:1::$pin" "gptoss:1:8::$pin" "gptoss:8:1::$pin"
  "gptoss:2:1:swa_gptoss_short_P2_D1:prompt=60,$pin"
  # host buffers (kv_buffer_device cpu)
  "gptoss:1:2:swa_gptoss_hostbuf_P1_D2:hostbuf=1,$pin" "gptoss:2:1:swa_gptoss_hostbuf_P2_D1:hostbuf=1,$pin"
  nemotronh:1:2:mamba2_nemotronh_hostbuf_P1_D2:hostbuf=1 nemotronh:2:1:mamba2_nemotronh_hostbuf_P2_D1:hostbuf=1
  jamba:1:1:mamba1_jamba_hostbuf_P1_D1:hostbuf=1 jamba:1:2:mamba1_jamba_hostbuf_P1_D2:hostbuf=1
  qwen3next:1:2:gdn_qwen3next_hostbuf_P1_D2:hostbuf=1 qwen3next:4:2:gdn_qwen3next_hostbuf_P4_D2:hostbuf=1
  falconh1:1:2:mamba2_falconh1_hostbuf_P1_D2:hostbuf=1 granite:1:1:mamba2_granite_hostbuf_P1_D1:hostbuf=1
  # Gemma-3 (SWA 1024)
  gemma3:1:1 gemma3:1:2 gemma3:2:1 gemma3:2:4 gemma3:1:2:swa_gemma3_short_P1_D2:prompt=500
  gemma3:1:1:swa_gemma3_hostbuf_P1_D1:hostbuf=1
  # other layer counts
  jamba:1:2:mamba1_jamba6_P1_D2:n_layers=6 jamba:2:1:mamba1_jamba6_P2_D1:n_layers=6
  jamba:1:1:mamba1_jamba5_P1_D1:n_layers=5 jamba:4:1:mamba1_jamba6_P4_D1:n_layers=6
  falconh1:1:2:mamba2_falconh1_2l_P1_D2:n_layers=2 falconh1:2:1:mamba2_falconh1_6l_P2_D1:n_layers=6
  # TP 16 (refused by vLLM)
  jamba:1:16 jamba:16:2 jamba:2:16
)
# Cases kvx's check got wrong when first generated, fixed since (see README.md): a bare-assert
# refusal, and sliding-window models stated with blocks other than 16 tokens.
disagree=(
  gptoss:16:2
  gptoss:2:1:swa_gptoss_bs64_P2_D1:p_bs=64,d_bs=64,prompt=400
  gptoss:1:4:swa_gptoss_bs64_P1_D4:p_bs=64,d_bs=64,prompt=400
  gptoss:1:1:swa_gptoss_P16_D64_P1_D1:p_bs=16,d_bs=64,prompt=400
  gptoss:1:1:swa_gptoss_P64_D16_P1_D1:p_bs=64,d_bs=16,prompt=400
  gptoss:1:2:swa_gptoss_P16_D64_P1_D2:p_bs=16,d_bs=64,prompt=400
  gptoss:2:1:swa_gptoss_P16_D64_P2_D1:p_bs=16,d_bs=64,prompt=400
  gemma3:1:1:swa_gemma3_P16_D64_P1_D1:p_bs=16,d_bs=64
  gptoss:1:1:swa_gptoss_hostbuf_P16_D64:p_bs=16,d_bs=64,hostbuf=1
)

"$PYTHON" "$here/hybrid.py" --quiet --out "$1" "${agree[@]}" "${disagree[@]}"
# What the file holds, for the guide: cases, those refused at the handshake, READ pairs.
"$PYTHON" - "$1" "${1%.json}.summary.json" <<'PY'
import json, sys
cases = json.load(open(sys.argv[1]))["cases"]
ranks = [d for c in cases for d in c.get("d_ranks", [])]
summary = {
    "generated_by": "scripts/hybrid-oracle/generate-all.sh",
    "cases": len(cases),
    "refused": sum(1 for c in cases if any("handshake_rejected" in d for d in c.get("d_ranks", []))),
    "read_pairs": sum(len(r["pairs[label,local_off,remote_off,len]"]) for d in ranks for r in d.get("reads", [])),
}
json.dump(summary, open(sys.argv[2], "w"), indent=2)
print(f"generate-all: {summary['cases']} cases ({summary['refused']} refused), {summary['read_pairs']} READ pairs: {sys.argv[1]}")
PY
