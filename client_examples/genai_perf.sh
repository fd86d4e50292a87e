#!/usr/bin/env bash
# genai-perf against the ensemble. Both of genai-perf's Triton payload styles work unchanged: --backend
# tensorrtllm (text_input, max_tokens, min_length, stream) and --backend vllm (text_input, sampling_parameters
# JSON, exclude_input_in_output, stream).
#   bash client_examples/genai_perf.sh [HOST:GRPC_PORT] [TOKENIZER_DIR] [tensorrtllm|vllm]
# genai-perf and the perf_analyzer it drives come with `pip install -e '.[perf]'` where perf_analyzer's wheel
# runs (glibc >= 2.38); where it does not, this script says what to use instead (perf_tools.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/perf_tools.sh"
require_perf_analyzer
if ! command -v genai-perf >/dev/null; then
  echo "genai-perf is not installed: pip install genai-perf==0.0.16 (or -e '.[perf]', which brings perf_analyzer too)" >&2
  exit 1
fi
URL=${1:-localhost:8001}
TOKENIZER=${2:-$(freetoken-core fetch-model | tail -1)}   # a local directory: no model hub needed
BACKEND=${3:-tensorrtllm}
genai-perf profile -m ensemble --service-kind triton --backend "$BACKEND" -u "$URL" \
  --tokenizer "$TOKENIZER" --streaming \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 128 --output-tokens-stddev 0 --output-tokens-mean-deterministic \
  --concurrency 16 --measurement-interval 10000
