"""The RMSNorm-fused one-row GEMVs (kernels/norm_gemv.py) vs their plain-torch references, and the
layers that dispatch to them: norm_linear, the MoE router with its normed row and its top-k.

CPU: under TRITON_INTERPRET=1 in fp32 and fp16 with small ragged shapes. GPU (skipped without CUDA):
bf16 at real projection and router shapes, inside CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_gemv import DEV, _randn, needs_cuda  # the one-row GEMV tests' device and inputs

from freetoken_core.kernels import norm_gemv as triton_norm_gemv
from freetoken_core.layers.linear import Linear

# The fused ranking's softmax against topk_softmax's: compiled, the two kernels' exp may round 1 ulp apart
# (H200: 6e-8); the ids must match exactly.
ROUTE_WEIGHTS_TOL = dict(atol=2e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("k", [200, 256])

def test_norm_gemv_matches_reference(dtype, residual, gated, norm, k):
    n = 72  # output rows (per half when gated): not a multiple of block_n
    x = _randn(1, k, dtype=dtype, seed=1)
    r = _randn(1, k, dtype=dtype, seed=6) if residual else None
    g = 1 + 0.1 * _randn(k, dtype=dtype, seed=7) if norm else None
    w = _randn(2 * n if gated else n, k, dtype=dtype, seed=2) * 0.1
    b = _randn(w.shape[0], dtype=dtype, seed=3)
    got, h = triton_norm_gemv.norm_gemv(x, r, g, 1e-5, w, b, gated, block_n=16, block_k=64, num_warps=4, num_stages=2)
    want, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, b, gated)
    assert got.shape == (1, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)  # the new residual is exact
    if not residual:
        assert h is x


def test_norm_linear_cpu_path_is_the_unfused_sequence():
    from freetoken_core.layers import MergedLinear, RMSNorm, silu_and_mul
    from freetoken_core.layers.norm_linear import norm_linear

    norm = RMSNorm(64, 1e-5)
    norm.weight.data.normal_(1, 0.1)
    lin = MergedLinear(64, [48, 48])
    lin.weight.data.normal_(0, 0.1)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    y, h = norm_linear(norm, lin, x, r, gated=True)
    normed, want_h = norm(x, r)
    torch.testing.assert_close(y, silu_and_mul(lin(normed)))
    torch.testing.assert_close(h, want_h)
    y0, h0 = norm_linear(norm, lin, x, None)
    assert h0 is x
    torch.testing.assert_close(y0, lin(norm(x)))
    with pytest.raises(ValueError, match="gate | up"):
        norm_linear(norm, Linear(64, 96), x, r, gated=True)


@needs_cuda
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (14336, 4096, True), (960, 576, False)])
def test_norm_gemv_bf16_8b_shapes(n, k, gated):
    x = _randn(1, k, dtype=torch.bfloat16, seed=4)
    r = _randn(1, k, dtype=torch.bfloat16, seed=8)
    g = 1 + 0.1 * _randn(k, dtype=torch.bfloat16, seed=9)
    w = _randn(2 * n if gated else n, k, dtype=torch.bfloat16, seed=5) * 0.02
    got, h = triton_norm_gemv.norm_gemv(x, r, g, 1e-5, w, None, gated)
    want, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, None, gated)
    # the unfused path rounds the normed row to bf16 twice before the GEMV; the fused one does not
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)


@needs_cuda
def test_norm_linear_fused_in_a_cuda_graph():
    from freetoken_core.layers import MergedLinear, RMSNorm
    from freetoken_core.layers.norm_linear import norm_linear

    norm = RMSNorm(4096, 1e-5, torch.bfloat16).cuda()
    lin = MergedLinear(4096, [14336, 14336], dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    static_x, static_r = x.clone(), r.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y, static_h = norm_linear(norm, lin, static_x, static_r, gated=True)
    static_x.copy_(x * 2)
    g.replay()
    want, want_h = triton_norm_gemv.norm_gemv_reference(x * 2, r, norm.weight, 1e-5, lin.weight, None, True)
    torch.testing.assert_close(static_y, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(static_h, want_h, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("k", [200, 256])
def test_norm_gemv_normed_matches_reference(dtype, zero_centered, k):
    """The post-attention norm fused into the MoE router's GEMV: the logits, the normed row the experts
    take (rounded as the RMSNorm kernel rounds it) and the new residual."""
    from freetoken_core.kernels.fused_ops_ref import rms_norm_torch, zero_centered_rms_norm_torch

    n = 72  # router rows: not a multiple of block_n
    x, r = _randn(1, k, dtype=dtype, seed=11), _randn(1, k, dtype=dtype, seed=12)
    g = 0.1 * _randn(k, dtype=dtype, seed=13) + (0 if zero_centered else 1)
    w = _randn(n, k, dtype=dtype, seed=14) * 0.1
    logits, normed, h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-5, w, zero_centered=zero_centered)
    want_logits, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, None, zero_centered=zero_centered)
    want_normed = (zero_centered_rms_norm_torch if zero_centered else rms_norm_torch)(x + r, g, 1e-5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(logits, want_logits, **tol)
    # fp32: equal up to the order of the sum of squares; fp16: at most one rounding step apart
    torch.testing.assert_close(normed, want_normed, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                                       else dict(atol=2e-3, rtol=2e-3)))
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    assert normed.shape == x.shape and logits.shape == (1, n)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_moe_block_forward_with_norm_is_norm_then_block(zero_centered):
    """SparseMoeBlock.forward_with_norm (the decoder layer hands it the post-attention norm) computes
    block(norm(x + residual)) and returns x + residual, on CPU (the unfused sequence) and on one CUDA row
    (one launch for the norm and the router)."""
    from freetoken_core.layers import RMSNorm
    from freetoken_core.layers.moe import SparseMoeBlock
    from freetoken_core.layers.norm import ZeroCenteredRMSNorm

    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    hidden, experts = 256, 16
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(hidden, 1e-6, dtype).to(DEV)
    norm.weight.data.normal_(0 if zero_centered else 1, 0.1)
    block = SparseMoeBlock(hidden, experts, 4, 64, True, dtype).to(DEV)
    for p in block.parameters():
        p.data.normal_(0, 3.0 / hidden ** 0.5)
    for rows in (1, 3):
        x = torch.randn(rows, hidden, dtype=dtype, device=DEV)
        r = torch.randn(rows, hidden, dtype=dtype, device=DEV)
        with torch.no_grad():
            if rows == 1:
                # The fused router takes the normed row unrounded, the unfused one after its rounding to
                # bf16: a near-tie in the top-k would pick other experts. A router whose logits on this row
                # are 0.5 apart (E rows along the normed row, scaled -4..4) leaves no near-tie.
                hf = norm(x, r)[0].float()[0]
                spread = torch.linspace(-4, 4, experts, device=DEV)[torch.randperm(experts, device=DEV)]
                block.gate.weight.copy_((spread[:, None] * hf[None, :] / hf.dot(hf)).to(dtype))
            got, got_r = block.forward_with_norm(norm, x, r)
            h, want_r = norm(x, r)
            want = block(h)
        torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)
        torch.testing.assert_close(got, want, **(dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else {}))


@needs_cuda
@pytest.mark.parametrize("n", [128, 257])  # Qwen3-30B-A3B's router, Qwen3.6's with the shared gate stacked
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_gemv_normed_bf16_router_shapes(n, zero_centered):
    from freetoken_core.kernels.fused_ops import fused_add_rmsnorm

    k = 2048
    x, r = _randn(1, k, dtype=torch.bfloat16, seed=21), _randn(1, k, dtype=torch.bfloat16, seed=22)
    g = 0.1 * _randn(k, dtype=torch.bfloat16, seed=23) + (0 if zero_centered else 1)
    w = _randn(n, k, dtype=torch.bfloat16, seed=24) * 0.02
    logits, normed, h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-6, w, zero_centered=zero_centered)
    want_normed, want_h = fused_add_rmsnorm(x.clone(), r.clone(), g, 1e-6, zero_centered=zero_centered)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, atol=1e-2, rtol=1e-2)  # one bf16 step at most
    assert (normed == want_normed).float().mean() > 0.99
    want_logits, _ = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-6, w, None, zero_centered=zero_centered)
    torch.testing.assert_close(logits, want_logits, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_norm_gemv_routed_equals_router_then_topk(dtype, shared, renormalize):
    """FREETOKEN_ROUTER_TOPK_FUSED's kernel: the post-attention norm, the router GEMV and its top-k in one
    launch (the last program ranks the logits) gives the routes of norm_gemv_normed + topk_softmax exactly,
    and leaves its arrival counter at zero for the next launch."""
    from freetoken_core.kernels import moe_router

    k, experts, top_k = 256, 72, 4  # 72 (+1) router rows: several programs arrive
    n = experts + int(shared)
    x, r = _randn(1, k, dtype=dtype, seed=31), _randn(1, k, dtype=dtype, seed=32)
    g = 1 + 0.1 * _randn(k, dtype=dtype, seed=33)
    w = _randn(n, k, dtype=dtype, seed=34) * (3.0 / k ** 0.5)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    route = triton_norm_gemv.RouterTopK(top_k, renormalize, shared, counter)
    for step in range(2):  # a second launch on the same counter
        weights, ids, normed, h = triton_norm_gemv.norm_gemv_routed(x * (step + 1), r, g, 1e-5, w, route)
        logits, want_normed, want_h = triton_norm_gemv.norm_gemv_normed(x * (step + 1), r, g, 1e-5, w)
        want_w, want_ids = moe_router.topk_softmax(logits, top_k, renormalize, shared)
        assert weights.shape == ids.shape == (1, top_k + int(shared))
        torch.testing.assert_close(ids, want_ids, atol=0, rtol=0)
        torch.testing.assert_close(weights, want_w, **ROUTE_WEIGHTS_TOL)
        torch.testing.assert_close(normed, want_normed, atol=0, rtol=0)
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)
        assert counter.item() == 0


@needs_cuda
@pytest.mark.parametrize("experts,shared,zero_centered", [(128, False, False), (256, True, True)])
def test_norm_gemv_routed_bf16_router_shapes_in_a_cuda_graph(experts, shared, zero_centered):
    """The real router shapes (Qwen3-30B-A3B: 128 x 2048; Qwen3.6 with its shared gate: 257 x 2048) on the
    compiled kernel, captured once and replayed on new inputs: the routes equal the two-launch path's."""
    from freetoken_core.kernels import moe_router

    k, top_k = 2048, 8
    n = experts + int(shared)
    w = _randn(n, k, dtype=torch.bfloat16, seed=41) * (3.0 / k ** 0.5)
    g = 0.1 * _randn(k, dtype=torch.bfloat16, seed=42) + (0 if zero_centered else 1)
    route = triton_norm_gemv.RouterTopK(top_k, True, shared, torch.zeros(1, dtype=torch.int32, device="cuda"))
    x, r = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda"), torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
    triton_norm_gemv.norm_gemv_routed(x, r, g, 1e-6, w, route, zero_centered=zero_centered)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, normed, h = triton_norm_gemv.norm_gemv_routed(x, r, g, 1e-6, w, route, zero_centered=zero_centered)
    for seed in (43, 44, 45):
        x.copy_(_randn(1, k, dtype=torch.bfloat16, seed=seed))
        r.copy_(_randn(1, k, dtype=torch.bfloat16, seed=seed + 100))
        graph.replay()
        logits, want_normed, want_h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-6, w, zero_centered=zero_centered)
        want_w, want_ids = moe_router.topk_softmax(logits, top_k, True, shared)
        torch.testing.assert_close(ids, want_ids, atol=0, rtol=0)
        torch.testing.assert_close(weights, want_w, **ROUTE_WEIGHTS_TOL)
        torch.testing.assert_close(normed, want_normed, atol=0, rtol=0)
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    assert route.counter.item() == 0


@needs_cuda
def test_moe_block_routes_in_the_router_launch(monkeypatch):
    """SparseMoeBlock.forward_with_norm with FREETOKEN_ROUTER_TOPK_FUSED=1 on one bf16 row equals the
    switch off (the same logits, ranked in the router's launch instead of a top-k launch)."""
    from freetoken_core import env
    from freetoken_core.layers import RMSNorm
    from freetoken_core.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    norm = RMSNorm(2048, 1e-6, torch.bfloat16).cuda()
    block = SparseMoeBlock(2048, 128, 8, 768, True, torch.bfloat16).cuda()
    for p in block.parameters():
        p.data.normal_(0, 3.0 / 2048 ** 0.5)
    x, r = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda"), torch.randn(1, 2048, dtype=torch.bfloat16,
                                                                                  device="cuda")
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FREETOKEN_ROUTER_TOPK_FUSED", flag)
        env.kernel_env.cache_clear()
        with torch.no_grad():
            outs[flag] = block.forward_with_norm(norm, x, r)
    env.kernel_env.cache_clear()
    torch.testing.assert_close(outs["1"][0], outs["0"][0], atol=0, rtol=0)
    torch.testing.assert_close(outs["1"][1], outs["0"][1], atol=0, rtol=0)
