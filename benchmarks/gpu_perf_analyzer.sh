#!/usr/bin/env bash
# perf_analyzer against the ensemble served by tritonserver on the GPU test host (see README).
#   source .gpu-bundle/setup.sh && bash benchmarks/gpu_perf_analyzer.sh MODEL_DIR [EXTRA --param ...]
# MODEL_DIR may hold only config.json + tokenizer files with `--param load_format=dummy` (random
# weights of the real shape: same speed, meaningless text).
set -euo pipefail
model=$1; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
# the Python-backend stub ignores PYTHONPATH: make freetoken_core importable by its python3
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "$repo" > "$site/freetoken_repo.pth"
[ -f /tmp/ft-site/pytriton/__init__.py ] || touch /tmp/ft-site/pytriton/__init__.py
python3 -m freetoken_core.cli serve --model-path "$model" --device cuda --dtype bfloat16 \
  --max-running-req 64 --http-port 8000 --grpc-port 8001 --metrics-port 8002 "$@" > /tmp/serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
ready() { python3 -c 'import urllib.request as u; u.urlopen("http://localhost:8000/v2/models/ensemble/ready", timeout=2)' 2>/dev/null; }
for _ in $(seq 1 240); do
  ready && break
  kill -0 $server 2>/dev/null || { tail -40 /tmp/serve.log; exit 1; }
  sleep 1
done
ready || { tail -40 /tmp/serve.log; exit 1; }
echo "server ready"
for c in 1 8 32; do
  perf_analyzer -m ensemble -u localhost:8001 -i grpc --streaming \
    --input-data "$repo/client_examples/perf_analyzer_input.json" \
    --concurrency-range "$c" --measurement-interval 8000 --stability-percentage 50 2>&1 \
    | grep -E "Concurrency|Throughput|Avg latency|p50|p99|Response Throughput" || true
done
python3 -c 'import urllib.request as u; print(u.urlopen("http://localhost:8002/metrics").read().decode())' | grep -E "^freetoken_" | head -12 || true
