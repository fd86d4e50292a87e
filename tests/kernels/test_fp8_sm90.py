"""The FP8 GEMMs at their GPU tiles: correct under the interpreter, and compiled to an sm_90 cubin (tests/sm90_cubin.py,
no GPU needed) with their tl.dot on Hopper's wgmma, FP8 x FP8 (w8a8) as well as the weight-only bf16/fp16 one. The
weight tiles are [K, N] views of K-contiguous rows: the K-major B operand FP8 wgmma requires."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken_core.env import triton_interpreted
from freetoken_core.kernels.fp8_gemm import (
    FP8_GEMM_CONFIG, fp8_gemm_w8a8, fp8_gemm_weight_only, fp8_gemv_reference, w8a8_gemm_reference,
)
from freetoken_core.kernels.fp8_moe import fp8_fused_moe_grouped, fp8_fused_moe_reference, fp8_fused_moe_w8a8_reference
from tests import triton_launches
from tests.kernels.test_fp8_gemv import TOL, _randn, fp8_weight
from tests.kernels.test_fp8_moe import fp8_experts, routing

ROOT = Path(__file__).resolve().parents[2]
MOE_TILE = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=8, num_stages=3)


@pytest.mark.skipif(not triton_interpreted(), reason="records interpreted launches (a GPU compiles them itself)")
def test_fp8_gemms_at_gpu_tiles_compile_to_wgmma(tmp_path):
    # weight-only in fp16 (a half-precision tl.dot, as bf16 on the GPU); w8a8 from fp32 activations (its tl.dot is
    # FP8 x FP8 whatever they were), so that no half-precision rounding flips an FP8 rounding of the reference
    q, s = fp8_weight(256, 256)
    x = _randn(64, 256, seed=1)
    torch.testing.assert_close(fp8_gemm_w8a8(x, q, s, config=FP8_GEMM_CONFIG), w8a8_gemm_reference(x, q, s),
                               **TOL[torch.float32])
    torch.testing.assert_close(fp8_gemm_weight_only(x.half(), q, s, config=FP8_GEMM_CONFIG),
                               fp8_gemv_reference(x.half(), q, s), **TOL[torch.float16])
    q13, s13, q2, s2 = fp8_experts(2, 256, 128)
    xm = _randn(40, 256, seed=2, scale=0.3)  # outputs of a few units: fp16 rounds them finely
    w, ids = routing(40, 2, 2)
    for w8a8, ref, dtype in ((False, fp8_fused_moe_reference, torch.float16),
                             (True, fp8_fused_moe_w8a8_reference, torch.float32)):
        got = fp8_fused_moe_grouped(xm.to(dtype), q13, s13, q2, s2, w, ids, config=MOE_TILE, w8a8=w8a8)
        torch.testing.assert_close(got, ref(xm.to(dtype), q13, s13, q2, s2, w, ids), **TOL[dtype])
    tile_m = {"_fp8_gemm_kernel": FP8_GEMM_CONFIG["BLOCK_SIZE_M"], "_fp8_fused_moe_kernel": MOE_TILE["BLOCK_SIZE_M"]}
    launches = [r for r in triton_launches.recorded()
                if r["name"] in tile_m and r["args"]["BLOCK_SIZE_M"][1] == tile_m[r["name"]]]
    assert len(launches) == 6  # 2 dense GEMMs, 2 x (gate/up, down) grouped
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "tests.sm90_cubin", str(path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 6 and out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert all(r["wgmma"] for r in results), results
