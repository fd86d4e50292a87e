#!/usr/bin/env bash
# FP8 kept on the GPU (issue 54). Run from the repository root on the lent GPU with the image's python3, one mode a
# device call (each fits its 10 minutes):
#   bash benchmarks/dev/gpu_fp8_check.sh tests    the FP8 kernels against their references, then tiny Qwen3 dense / MoE /
#                                             Qwen3.5-MoE with FP8 kept against the dequantized bf16 path (CUDA graphs
#                                             on, page sizes 1 and 4), offloaded FP8 experts (pytest from the image, or
#                                             carry a --target install of pytest and put it on PYTHONPATH)
#   bash benchmarks/dev/gpu_fp8_check.sh bench [shape, default qwen3-30b-a3b] [batch sizes, default 1]
#                                             batch-1 decode (prompt 16, page size 1, 256 tokens) with --quant fp8,
#                                             then the bf16 baseline on the same card
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FREETOKEN_FP8_KEEP=auto
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-tests}" in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py \
      tests/kernels/test_fp8_moe.py tests/kernels/test_fp8_sm90.py tests/models/test_fp8_keep.py \
      tests/moe/test_fp8_offload.py ;;
  bench)
    for quant in fp8 bf16; do
      timeout 280 python3 benchmarks/bench_decode.py --shapes "${2:-qwen3-30b-a3b}" --bs "${3:-1}" --prompts 16 \
        --page-size 1 --out-tokens 256 --prefill 0 $([ "$quant" = fp8 ] && echo --quant fp8)
    done ;;
  *) echo "usage: $0 tests | bench [shape] [batch sizes]"; exit 2 ;;
esac
