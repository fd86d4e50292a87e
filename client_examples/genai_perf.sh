#!/usr/bin/env bash
# genai-perf (pip install genai-perf) against the ensemble. Both of genai-perf's Triton payload
# styles work unchanged: --backend tensorrtllm (text_input, max_tokens, min_length, stream) and
# --backend vllm (text_input, sampling_parameters JSON, exclude_input_in_output, stream).
#   client_examples/genai_perf.sh [HOST:GRPC_PORT] [TOKENIZER_DIR] [tensorrtllm|vllm]
URL=${1:-localhost:8001}
TOKENIZER=${2:-$(freetoken-core fetch-model | tail -1)}   # a local directory: no model hub needed
BACKEND=${3:-tensorrtllm}
genai-perf profile -m ensemble --service-kind triton --backend "$BACKEND" -u "$URL" \
  --tokenizer "$TOKENIZER" --streaming \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 128 --output-tokens-stddev 0 --output-tokens-mean-deterministic \
  --concurrency 16 --measurement-interval 10000
