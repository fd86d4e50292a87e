#!/usr/bin/env bash
# FP8 kept on the GPU (issue 54): correctness first, then batch-1 speed of the FP8 path beside the bf16 baseline,
# same card, same call. Run from the repository root on the lent GPU with the image's python3:
#   bash benchmarks/gpu_fp8_check.sh [shape, default qwen3-30b-a3b] [batch sizes, default 1]
# (~6 min for the 30B at batch 1: two engine starts with random weights, 256 tokens each.)
set -uo pipefail
SHAPE=${1:-qwen3-30b-a3b}
BS=${2:-1}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# the FP8 kernels on the GPU against their references, then tiny Qwen3 dense / MoE / Qwen3.5-MoE with FP8 kept
# against the dequantized bf16 path (CUDA graphs on, page sizes 1 and 4)
timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py \
  tests/kernels/test_fp8_moe.py tests/kernels/test_fp8_sm90.py tests/models/test_fp8_keep.py || exit 1
for quant in fp8 bf16; do
  timeout 420 python3 benchmarks/bench_decode.py --shapes "$SHAPE" --bs "$BS" --prompts 16 --page-size 1 \
    --out-tokens 256 --prefill 0 $([ "$quant" = fp8 ] && echo --quant fp8)
done
