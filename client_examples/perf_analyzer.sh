#!/usr/bin/env bash
# perf_analyzer (pip install perf-analyzer; its wheel needs glibc >= 2.38) against the ensemble over
# gRPC streaming, at concurrency 1, 8 and 32. The input file holds text prompts with max_tokens 128
# and ignore_eos, so every request generates the same number of tokens.
#   client_examples/perf_analyzer.sh [HOST:GRPC_PORT]
URL=${1:-localhost:8001}
HERE=$(cd "$(dirname "$0")" && pwd)
for C in 1 8 32; do
  perf_analyzer -m ensemble -u "$URL" -i grpc --streaming \
    --input-data "$HERE/perf_analyzer_input.json" \
    --concurrency-range "$C" --measurement-interval 10000 --stability-percentage 25
done
