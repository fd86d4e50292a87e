#!/usr/bin/env bash
# Our decode beside FreeToken 0.2.1's, alternating, on the same GPU in one call (issue 12's "like with like":
# same shape, random bf16 weights, page size 1, 256 new tokens; ours is bench_decode.py's rate, FreeToken's
# run_freetoken.py's N / (t[N+1] - t[1])).
#
#   bash benchmarks/dev/gpu_peer_ab.sh SHAPE BATCH PROMPT [ROUNDS]     e.g.  qwen3-30b-a3b 1 16 2;  qwen3-30b-a3b 64 128 2
#   QUANT=fp8 bash benchmarks/dev/gpu_peer_ab.sh ...    block-FP8 weights on both sides (FreeToken's via peer_fp8.py)
#
# Needs the peer's files in .peer/ (FreeToken 0.2.1's wheel and dependencies and its run_freetoken.py; git-ignored,
# so carry it to the GPU host). Per-run logs go to $OUT (default .gpu-run/peer); one line per run is printed.
set -uo pipefail
SHAPE=$1 BS=$2 PROMPT=$3 ROUNDS=${4:-2}
OUT=${OUT:-.gpu-run/peer}
SITE=${FT_SITE:-/tmp/ftsite}
QUANT=${QUANT:-none}
OURS_QUANT=() PEER=.peer/run_freetoken.py
if [ "$QUANT" = fp8 ]; then OURS_QUANT=(--quant fp8); PEER=benchmarks/dev/peer_fp8.py; fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d "$SITE/freetoken" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .peer/whl/*.whl > "$OUT/pip.txt" 2>&1 || { echo "peer install failed: $OUT/pip.txt"; exit 1; }
for r in $(seq 1 "$ROUNDS"); do
  log=$OUT/ours_${SHAPE}_${QUANT}_bs${BS}_r$r.txt
  PYTHONPATH=$PWD timeout 300 python3 benchmarks/bench_decode.py --shapes "$SHAPE" --bs "$BS" --prompts "$PROMPT" \
    --page-size 1 --out-tokens 256 --prefill 0 "${OURS_QUANT[@]}" > "$log" 2>&1
  echo "ours r$r rc=$? $(grep "^| $SHAPE" "$log")"
  log=$OUT/freetoken_${SHAPE}_${QUANT}_bs${BS}_r$r.txt
  PYTHONPATH=$SITE timeout 300 python3 "$PEER" --shape "$SHAPE" --batch "$BS" --max-running-req "$BS" \
    --prompt-tokens "$PROMPT" --new-tokens 256 --repeats 3 > "$log" 2>&1
  echo "freetoken r$r rc=$? $(grep RESULT "$log")"
done
