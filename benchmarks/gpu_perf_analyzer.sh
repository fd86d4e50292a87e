#!/usr/bin/env bash
# perf_analyzer (C++ client: not the limit) against the served engine on the GPU test host, issue 13:
# the ensemble and the `freetoken` model alone (input_ids), gRPC streaming, concurrency 1 16 64 128.
#   source .gpu-bundle/setup.sh && bash benchmarks/gpu_perf_analyzer.sh MODEL_DIR [EXTRA serve args ...]
#   CONCURRENCY="1 16 64 128" OUT_TOKENS=128 MAX_RUNNING=128 bash benchmarks/gpu_perf_analyzer.sh ...
# MODEL_DIR may hold only config.json + tokenizer files with `--param load_format=dummy` (random
# weights of the real shape: same speed, meaningless text). Prints one table row per target and
# concurrency: requests/s, responses/s, tokens per response (= requests/s x OUT_TOKENS / responses/s),
# latency p50/p99 of a whole request (perf_analyzer 2.60 gives no TTFT/ITL for streams: genai-perf does,
# client_examples/genai_perf.sh).
set -euo pipefail
model=$1; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
conc=${CONCURRENCY:-"1 16 64 128"}
out_tokens=${OUT_TOKENS:-128}
max_running=${MAX_RUNNING:-128}
work=$(mktemp -d /tmp/ft-pa-XXXX)
# the Python-backend stub ignores PYTHONPATH: make freetoken_core importable by its python3
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "$repo" > "$site/freetoken_repo.pth"
[ -f /tmp/ft-site/pytriton/__init__.py ] || touch /tmp/ft-site/pytriton/__init__.py 2>/dev/null || true
python3 "$repo/benchmarks/pa_summary.py" inputs "$work" "$out_tokens"
python3 -m freetoken_core.cli serve --model-path "$model" --device cuda --dtype bfloat16 \
  --max-running-req "$max_running" --http-port 8000 --grpc-port 8001 --metrics-port 8002 "$@" > "$work/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
ready() { python3 -c 'import urllib.request as u; u.urlopen("http://localhost:8000/v2/models/ensemble/ready", timeout=2)' 2>/dev/null; }
for _ in $(seq 1 240); do
  ready && break
  kill -0 $server 2>/dev/null || { tail -40 "$work/serve.log"; exit 1; }
  sleep 1
done
ready || { tail -40 "$work/serve.log"; exit 1; }
echo "server ready"
for target in ensemble freetoken; do
  for c in $conc; do
    perf_analyzer -m "$target" -u localhost:8001 -i grpc --streaming \
      --input-data "$work/$target.json" --concurrency-range "$c" \
      --measurement-interval 8000 --stability-percentage 50 --percentile 50 \
      -f "$work/$target-$c.csv" --verbose-csv > "$work/$target-$c.txt" 2>&1 || tail -5 "$work/$target-$c.txt"
  done
done
python3 "$repo/benchmarks/pa_summary.py" table "$work" "$out_tokens" $conc
python3 -c 'import urllib.request as u; print(u.urlopen("http://localhost:8002/metrics").read().decode())' \
  | grep -E "^freetoken_|^nv_inference_(exec|request_success).*detokenizer" | head -16 || true
