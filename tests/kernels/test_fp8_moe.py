"""Block-FP8 expert kernels (kernels/fp8_moe_gemv.py, kernels/fp8_moe.py) vs their plain-torch references: the
decode GEMVs (gate/up, both down variants, the stacked shared expert) and the grouped GEMM (weight-only and w8a8).
CPU: under TRITON_INTERPRET=1 in fp32 and fp16, with partial scale blocks (H = 200, I = 96: the up rows start
inside a block) and experts chosen by several tokens. GPU (skipped without CUDA): bf16 on the Qwen3-30B-A3B shape."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.fp8_moe import (
    fp8_fused_moe, fp8_fused_moe_grouped, fp8_fused_moe_reference, fp8_fused_moe_w8a8_reference,
)
from freetoken_core.kernels.fp8_moe_gemv import fp8_fused_moe_decode
from freetoken_core.kernels.fp8_ref import dequantize_block_fp8, quantize_block_fp8
from freetoken_core.kernels.fused_moe_ref import topk_softmax_ref
from tests.kernels.test_fp8_gemv import DEV, TOL, _randn, needs_cuda

E, H, I = 4, 200, 96


def fp8_experts(num_experts: int = E, hidden: int = H, inter: int = I, seed: int = 0):
    """Quantized random expert stacks whose experts (and blocks) differ in magnitude, on DEV."""
    mag = torch.logspace(-1, 1, num_experts).view(num_experts, 1, 1) ** 0.5
    w13 = _randn(num_experts, 2 * inter, hidden, seed=seed, scale=hidden ** -0.5).cpu() * mag
    w13[:, :, hidden // 2:] *= 0.25  # the second K block of scales differs from the first
    w2 = _randn(num_experts, hidden, inter, seed=seed + 1, scale=inter ** -0.5).cpu() * mag
    q13, s13 = quantize_block_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    return q13.to(DEV), s13.to(DEV), q2.to(DEV), s2.to(DEV)


def routing(num_tokens: int, top_k: int, num_experts: int = E, seed: int = 0):
    logits = _randn(num_tokens, num_experts, seed=seed + 7, scale=3.0)
    return topk_softmax_ref(logits, top_k, renormalize=True)


def test_the_reference_is_the_dequantized_experts():
    q13, s13, q2, s2 = fp8_experts()
    assert s13.shape == (E, 2, 2) and s2.shape == (E, 2, 1)
    x = _randn(3, H, seed=1)
    w, ids = routing(3, 2)
    out = fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids)
    e = ids[0, 0].item()
    h = x[0] @ dequantize_block_fp8(q13[e], s13[e]).t()
    y0 = (torch.nn.functional.silu(h[:I]) * h[I:]) @ dequantize_block_fp8(q2[e], s2[e]).t() * w[0, 0]
    e1 = ids[0, 1].item()
    h1 = x[0] @ dequantize_block_fp8(q13[e1], s13[e1]).t()
    y1 = (torch.nn.functional.silu(h1[:I]) * h1[I:]) @ dequantize_block_fp8(q2[e1], s2[e1]).t() * w[0, 1]
    torch.testing.assert_close(out[0], y0 + y1, atol=1e-5, rtol=1e-5)


# gate/up and the down tile: BLOCK_K 256, two scale columns a step; the down loop: 64, two steps a scale block
DECODE_TILES = {"gate_up": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=1),
                "down": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=1, routes="tile")}
DECODE_LOOP = {**DECODE_TILES, "down": dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1, routes="loop")}
GROUPED_TILE = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype,num_tokens,top_k,routes", [
    (torch.float32, 1, 2, "tile"), (torch.float32, 1, 2, "loop"),
    (torch.float32, 3, 3, "tile"), (torch.float32, 3, 3, "loop"),  # 3 tokens x 3 of 4 experts: every expert repeats
    (torch.float16, 3, 3, "tile"), (torch.float16, 2, 3, "loop"),
])
def test_fp8_decode_matches_reference(dtype, num_tokens, top_k, routes):
    q13, s13, q2, s2 = fp8_experts()
    x = _randn(num_tokens, H, dtype=dtype, seed=1)
    w, ids = routing(num_tokens, top_k)
    got = fp8_fused_moe_decode(x, q13, s13, q2, s2, w, ids, config=DECODE_TILES if routes == "tile" else DECODE_LOOP)
    torch.testing.assert_close(got, fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids), **TOL[dtype])


def test_fp8_decode_with_the_shared_expert_stacked_last():
    q13, s13, q2, s2 = fp8_experts(E + 1)
    x = _randn(2, H, seed=1)
    w, ids = routing(2, 2)
    ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1).contiguous()
    w = torch.cat([w, torch.sigmoid(_randn(2, 1, seed=5))], dim=1).contiguous()
    got = fp8_fused_moe_decode(x, q13, s13, q2, s2, w, ids, config=DECODE_LOOP, shared_last=True)
    torch.testing.assert_close(got, fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_grouped_weight_only_matches_reference(dtype):
    q13, s13, q2, s2 = fp8_experts()
    x = _randn(20, H, dtype=dtype, seed=2)
    w, ids = routing(20, 2, seed=1)
    got = fp8_fused_moe(x, q13, s13, q2, s2, w, ids, config=GROUPED_TILE, w8a8=False)  # 20 tokens: grouped
    torch.testing.assert_close(got, fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_grouped_mode_follows_the_activations_dtype(dtype):
    # w8a8 for 16-bit activations, weight-only (the reference math) for fp32 ones
    q13, s13, q2, s2 = fp8_experts()
    x = _randn(12, H, dtype=dtype, seed=4)
    w, ids = routing(12, 2, seed=3)
    reference = fp8_fused_moe_reference if dtype == torch.float32 else fp8_fused_moe_w8a8_reference
    got = fp8_fused_moe(x, q13, s13, q2, s2, w, ids, config=GROUPED_TILE)
    torch.testing.assert_close(got, reference(x, q13, s13, q2, s2, w, ids), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_grouped_w8a8_matches_reference(dtype):
    q13, s13, q2, s2 = fp8_experts()
    x = _randn(12, H, dtype=dtype, seed=3)
    w, ids = routing(12, 3, seed=2)
    got = fp8_fused_moe_grouped(x, q13, s13, q2, s2, w, ids, w8a8=True, config=GROUPED_TILE)
    torch.testing.assert_close(got, fp8_fused_moe_w8a8_reference(x, q13, s13, q2, s2, w, ids), **TOL[dtype])
    near = fp8_fused_moe_reference(x.float(), q13, s13, q2, s2, w, ids)
    assert (got.float() - near).norm() < 0.1 * near.norm()


def test_fp8_experts_refuse_a_bad_scale_grid():
    q13, s13, q2, s2 = fp8_experts()
    w, ids = routing(1, 2)
    with pytest.raises(ValueError, match="does not fit weight"):
        fp8_fused_moe(_randn(1, H), q13, s13[:, :1], q2, s2, w, ids)


def assert_close_bf16_experts(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 experts against their fp32-internal reference: the kernels round the intermediate activation to bf16
    (or to e4m3 per token group, w8a8) where the reference keeps fp32, so a rounding flipped there moves an output
    by several of its own ulps (0.25 on outputs up to 22.5 seen on an H100: two bf16 ulps there). Held to: 99.9% of
    elements within 3e-2 + 3e-2|want|, none off by more than 2% of the output's largest magnitude, and 1% of its
    norm overall."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    outside = err > 3e-2 + 3e-2 * want.abs()
    assert outside.float().mean() <= 1e-3, f"{int(outside.sum())} of {want.numel()} elements off by up to {err.max()}"
    assert err.max() <= 2e-2 * want.abs().max(), (err.max(), want.abs().max())
    assert (got - want).norm() <= 1e-2 * want.norm()


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 1000])
def test_fp8_experts_bf16_on_gpu(num_tokens):
    # the decode GEMVs (weight-only) up to 8 tokens, then the grouped GEMM: w8a8 in its few-rows and large tiles
    q13, s13, q2, s2 = fp8_experts(128, 2048, 768)
    x = _randn(num_tokens, 2048, dtype=torch.bfloat16, seed=1)
    w, ids = routing(num_tokens, 8, 128)
    reference = fp8_fused_moe_w8a8_reference if num_tokens > 8 else fp8_fused_moe_reference
    assert_close_bf16_experts(fp8_fused_moe(x, q13, s13, q2, s2, w, ids), reference(x, q13, s13, q2, s2, w, ids))
    if num_tokens > 8:
        got = fp8_fused_moe_grouped(x, q13, s13, q2, s2, w, ids, w8a8=False)
        assert_close_bf16_experts(got, fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids))
