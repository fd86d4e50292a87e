#!/usr/bin/env bash
# perf_analyzer against the ensemble over gRPC streaming, at concurrency 1, 8 and 32. The input file holds text
# prompts with max_tokens 128 and ignore_eos, so every request generates the same number of tokens.
#   bash client_examples/perf_analyzer.sh [HOST:GRPC_PORT]
# perf_analyzer comes with `pip install -e '.[perf]'` where its wheel runs (glibc >= 2.38); where it does not,
# this script says what to use instead (perf_tools.sh).
set -euo pipefail
URL=${1:-localhost:8001}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/perf_tools.sh"
require_perf_analyzer
for C in 1 8 32; do
  "$PERF_ANALYZER" -m ensemble -u "$URL" -i grpc --streaming \
    --input-data "$HERE/perf_analyzer_input.json" \
    --concurrency-range "$C" --measurement-interval 10000 --stability-percentage 25
done
