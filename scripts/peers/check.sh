#!/usr/bin/env bash
# Runs the NIXL P/D peers against each other and against vLLM 0.33.0's own workers, on
# loopback, and says which pairs pass. Needs scripts/setup-peers.sh; the vLLM pairs need
# vLLM's wrapped workers (real_prefill.py, real_decode.py) in VLLM_PEER_DIR (default
# ../shared/vllm-peer beside the project) and are skipped without them.
#
#   scripts/peers/check.sh            # every pair; exit 0 when all pass
#   scripts/peers/check.sh -v         # also print each command and its JSON lines
#
# A pair passes when every decode rank prints finished, not failed, pattern_ok (every byte
# checked) and the prefill prints finished_sending with the request. vLLM's wrapped workers end
# without os._exit and are killed by NIXL's exit handlers here (status 139), so their status
# is not used: their JSON line is.
set -uo pipefail
cd "$(dirname "$0")/../.."

verbose=0
[ "${1:-}" = "-v" ] && verbose=1
PY=.venv-peers/bin/python
PEER="$PY scripts/peers/nixl_pd_peer.py"
VDIR="${VLLM_PEER_DIR:-../shared/vllm-peer}"
export NIXL_LOG_LEVEL="${NIXL_LOG_LEVEL:-WARN}" VLLM_033_SRC="${VLLM_033_SRC:-$PWD/.vllm-033/vllm}"
[ -x "$PY" ] || { echo "check: run scripts/setup-peers.sh first" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0

# pair NAME PREFILL_CMD DECODE_CMD... : DECODE_CMDs name the side channel port as PORT.
pair() {
  local name=$1 pre=$2; shift 2
  local out="$tmp/p.out" port i pids=() ok=1
  # Each process runs in a subshell of its own so the shell's "Segmentation fault" notice for
  # vLLM's workers lands in that process's stderr file, not on the terminal.
  ($pre; exit $?) >"$out" 2>"$tmp/p.err" &
  local ppid=$!
  for _ in $(seq 300); do grep -q side_channel "$out" 2>/dev/null && break; sleep 0.1; done
  port=$(grep -o '127\.0\.0\.1:[0-9]*' "$out" | head -1 | cut -d: -f2)
  if [ -z "$port" ]; then
    echo "FAIL $name: the prefill printed no side channel"; cat "$tmp/p.err" >&2
    kill "$ppid" 2>/dev/null; wait "$ppid" 2>/dev/null; fails=$((fails + 1)); return
  fi
  [ "$verbose" = 1 ] && { echo "\$ $pre"; head -1 "$out"; }
  i=0
  for d in "$@"; do
    (${d//PORT/$port}; exit $?) >"$tmp/d$i.out" 2>"$tmp/d$i.err" &
    pids+=($!); i=$((i + 1))
  done
  i=0
  for d in "$@"; do
    wait "${pids[$i]}" 2>/dev/null
    [ "$verbose" = 1 ] && { echo "\$ ${d//PORT/$port}"; cat "$tmp/d$i.out"; }
    grep -q '"finished": true, "failed": false, "pattern_ok": true' "$tmp/d$i.out" || {
      ok=0; echo "  decode $i: $(tail -1 "$tmp/d$i.out")"; grep -v '^$' "$tmp/d$i.err" | tail -3; }
    i=$((i + 1))
  done
  wait "$ppid" 2>/dev/null
  [ "$verbose" = 1 ] && tail -n +2 "$out"
  grep -q '"finished_sending": \["req-P"\]' "$out" || {
    ok=0; echo "  prefill: $(tail -1 "$out")"; grep -v '^$' "$tmp/p.err" | tail -3; }
  if [ "$ok" = 1 ]; then echo "ok   $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}

D="$PEER decode --port PORT --engine-id P-peer --request-id req-P --blocks 0,7,15 --check-pattern"
pair "peer P tp1 -> peer D tp1" "$PEER prefill --request-id req-P" "$D"
pair "peer P tp2 -> peer D tp1" "$PEER prefill --request-id req-P --tp 2" "$D --remote-tp 2 --tp 1"
pair "peer P tp1 -> peer D tp2 (ranks 0, 1)" "$PEER prefill --request-id req-P" \
  "$D --tp 2 --tp-rank 0" "$D --tp 2 --tp-rank 1"
pair "peer P tp4 -> peer D tp2 (ranks 0, 1)" "$PEER prefill --request-id req-P --tp 4" \
  "$D --remote-tp 4 --tp 2 --tp-rank 0" "$D --remote-tp 4 --tp 2 --tp-rank 1"
pair "peer P tp2 -> peer D tp4 (ranks 0-3)" "$PEER prefill --request-id req-P --tp 2" \
  "$D --remote-tp 2 --tp 4 --tp-rank 0" "$D --remote-tp 2 --tp 4 --tp-rank 1" \
  "$D --remote-tp 2 --tp 4 --tp-rank 2" "$D --remote-tp 2 --tp 4 --tp-rank 3"

if [ -f "$VDIR/real_prefill.py" ] && [ -f "$VLLM_033_SRC/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py" ]; then
  pair "vLLM P tp1 -> peer D tp1" "$PY $VDIR/real_prefill.py --request-id req-P" \
    "$PEER decode --port PORT --engine-id P-real-vllm --request-id req-P --blocks 0,7,15 --check-pattern"
  pair "peer P tp1 -> vLLM D tp1" "$PEER prefill --request-id req-P" \
    "$PY $VDIR/real_decode.py --port PORT --engine-id P-peer --request-id req-P --blocks 0,7,15 --check-pattern"
  # real_decode.py is vLLM's rank 0; the peer is rank 1: P frees after both ("req-P:2").
  pair "peer P tp1 -> vLLM D rank 0 + peer D rank 1 (tp2)" "$PEER prefill --request-id req-P" \
    "$PY $VDIR/real_decode.py --port PORT --engine-id P-peer --request-id req-P --blocks 0,7,15 --tp 2 --check-pattern" \
    "$D --tp 2 --tp-rank 1"
else
  echo "skip vLLM pairs: no $VDIR/real_prefill.py or no $VLLM_033_SRC (scripts/setup-peers.sh)"
fi

[ "$fails" = 0 ] && echo "check: all pairs passed" || echo "check: $fails pair(s) failed"
[ "$fails" = 0 ]
