#!/usr/bin/env bash
# fla-core for the lent GPU (issue 15): the device image has no fla-core and its machine reaches no package
# registry, so the `gpu` extra's GDN prefill kernel (kernels/gdn_fla.py) has never run there. This puts fla-core
# and its one dependency (einops; pure Python, ~14 MB unpacked: carry it without .gpu-bundle, 52 MB, to stay under
# the 64 MiB a call carries) into .gpu-fla/ (git-ignored), built here with the
# project's own pip; carry it to the device and put it on the path:
#   bash benchmarks/dev/gpu_fla_bundle.sh
#   device, carry [".gpu-fla"]:  export PYTHONPATH=$PWD:$PWD/.gpu-fla && python3 -m pytest -q tests/kernels/test_gdn_fla.py \
#     && python3 benchmarks/bench_decode.py --shapes qwen3.6-35b-a3b --bs 1 --prompts 128 --out-tokens 16 --prefill 8192
# (bench_decode's prefill row then runs fla's chunked kernel, after its self-check against ours passes: the log says.)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
pip=${PIP:-$repo/.venv/bin/pip}
rm -rf "$repo/.gpu-fla"
"$pip" install --quiet --no-deps --target "$repo/.gpu-fla" "fla-core>=0.6" einops
du -sh "$repo/.gpu-fla"
