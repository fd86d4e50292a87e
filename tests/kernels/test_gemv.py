"""One-row GEMV kernel (kernels/gemv.py) vs its plain-torch reference, and the Linear dispatch (the
norm-fused GEMVs: test_norm_gemv.py).

CPU: under TRITON_INTERPRET=1 in fp32 and fp16 with small ragged shapes. GPU (skipped without
CUDA): bf16 on Llama-3-8B projection shapes, and a Linear layer taking the kernel inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import gemv as triton_gemv
from freetoken_core.layers.gemv_policy import GEMV_MIN_ELEMENTS, use_gemv_for_all_sizes
from freetoken_core.layers.linear import Linear
from freetoken_core.kernels.gemv import gemv, gemv_reference, rows_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape: int, dtype: torch.dtype, device: str = DEV, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
def test_gemv_matches_reference(dtype, bias, k):
    n = 72  # not a multiple of block_n
    x = _randn(1, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2) * 0.1
    b = _randn(n, dtype=dtype, seed=3) if bias else None
    got = gemv(x, w, b, block_n=16, block_k=64, num_warps=4, num_stages=2)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, gemv_reference(x, w, b), **tol)


def test_gemv_takes_one_row_only():
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.zeros(2, 32, device=DEV), torch.zeros(16, 32, device=DEV), block_n=16, block_k=32)


def test_dispatch_rule():
    big = GEMV_MIN_ELEMENTS
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    one = torch.empty(1, 4096, dtype=torch.bfloat16)
    assert not triton_gemv.use_gemv(one, w, big)  # CPU tensors stay on torch
    if torch.cuda.is_available():
        assert triton_gemv.use_gemv(one.cuda(), w.cuda(), big)
        assert not triton_gemv.use_gemv(torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"), w.cuda(), big)
        assert not triton_gemv.use_gemv(one.cuda().float(), w.cuda().float(), big)
        small = torch.empty(576, 576, dtype=torch.bfloat16, device="cuda")
        one_small = torch.empty(1, 576, dtype=torch.bfloat16, device="cuda")
        assert not triton_gemv.use_gemv(one_small, small, big)
        assert triton_gemv.use_gemv(one_small, small, 0)


def test_use_gemv_for_all_sizes_lowers_every_linear_layer():
    from freetoken_core.layers import MergedLinear, QKVLinear

    model = torch.nn.Sequential(Linear(8, 8), QKVLinear(8, 2, 1, 4), MergedLinear(8, [4, 4]), torch.nn.LayerNorm(8))
    assert all(m.gemv_min_elements == GEMV_MIN_ELEMENTS for m in model[:3])
    assert use_gemv_for_all_sizes(model) == 3
    assert all(m.gemv_min_elements == 0 and not m.rows_gemm for m in model[:3])
    use_gemv_for_all_sizes(model, rows=True)
    assert all(m.rows_gemm for m in model[:3])


def test_use_gemv_for_all_sizes_lowers_the_lm_head_too():
    from freetoken_core.layers.embedding import ParallelLMHead, VocabEmbedding

    emb = VocabEmbedding(64, 8)
    model = torch.nn.ModuleList([emb, ParallelLMHead(64, 8), ParallelLMHead(64, 8, tied=emb), Linear(8, 8)])
    assert model[1].gemv_min_elements == GEMV_MIN_ELEMENTS
    assert use_gemv_for_all_sizes(model) == 3  # two heads and the Linear; the embedding has no GEMV
    assert model[1].gemv_min_elements == 0 and model[2].gemv_min_elements == 0


@needs_cuda
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_one_row_logits_take_the_gemv(tied, monkeypatch):
    from freetoken_core.layers.embedding import ParallelLMHead, VocabEmbedding

    emb = VocabEmbedding(1000, 576, dtype=torch.bfloat16).cuda()
    head = ParallelLMHead(1000, 576, dtype=torch.bfloat16, tied=emb if tied else None).cuda()
    head.weight.data.normal_(0, 0.02)
    calls = []
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **k: calls.append(1) or gemv(*a, **k))
    x = torch.randn(1, 576, device="cuda", dtype=torch.bfloat16)
    assert head.logits(x).dtype == torch.float32 and not calls  # 576k elements: under the default bar
    use_gemv_for_all_sizes(head)
    got = head.logits(x)
    assert calls and got.dtype == torch.float32 and got.shape == (1, 1000)
    torch.testing.assert_close(got, gemv_reference(x, head.weight).float(), atol=1e-2, rtol=1e-2)
    head.logits(torch.randn(3, 576, device="cuda", dtype=torch.bfloat16))  # rows > 1: cuBLAS
    assert len(calls) == 1


# --- a few rows (speculative verify steps) -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
@pytest.mark.parametrize("bias", [False, True])
def test_rows_gemm_matches_reference(dtype, m, k, bias):
    n = 72  # not a multiple of block_n
    x = _randn(m, k, dtype=dtype, seed=11)
    w = _randn(n, k, dtype=dtype, seed=12) * 0.1
    b = _randn(n, dtype=dtype, seed=13) if bias else None
    got = rows_gemm(x, w, b, block_n=32, block_k=64)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, gemv_reference(x, w, b), **tol)


@pytest.mark.parametrize("block_n", [16, 64])  # tile widths other than the one above
def test_rows_gemm_tile_widths(block_n):
    x = _randn(5, 200, dtype=torch.float32, seed=16)
    w = _randn(72, 200, dtype=torch.float32, seed=17) * 0.1
    torch.testing.assert_close(rows_gemm(x, w, block_n=block_n, block_k=64), gemv_reference(x, w), atol=1e-3, rtol=1e-3)


def test_rows_gemm_dispatch_rule():
    w = torch.empty(576, 576, dtype=torch.bfloat16)
    rows = torch.empty(9, 576, dtype=torch.bfloat16)
    assert not triton_gemv.use_rows_gemm(rows, w, 0)  # CPU tensors stay on torch
    if torch.cuda.is_available():
        w, rows = w.cuda(), rows.cuda()
        assert triton_gemv.use_rows_gemm(rows, w, 0)
        assert not triton_gemv.use_rows_gemm(rows, w, GEMV_MIN_ELEMENTS)  # only where the engine lowered the bar
        assert not triton_gemv.use_rows_gemm(rows[:1], w, 0)  # one row: the GEMV
        assert not triton_gemv.use_rows_gemm(torch.empty(17, 576, dtype=torch.bfloat16, device="cuda"), w, 0)
        big = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")  # Llama-3-8B's o_proj: cuBLAS is faster
        assert not triton_gemv.use_rows_gemm(torch.empty(9, 4096, dtype=torch.bfloat16, device="cuda"), big, 0)


@needs_cuda
@pytest.mark.parametrize("m", [2, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (6144, 4096)])
def test_rows_gemm_bf16_shapes(m, n, k):
    x = _randn(m, k, dtype=torch.bfloat16, seed=14)
    w = _randn(n, k, dtype=torch.bfloat16, seed=15) * 0.02
    torch.testing.assert_close(rows_gemm(x, w), gemv_reference(x, w), atol=1e-2, rtol=1e-2)


def _replayed_in_a_graph(lin: Linear, x: torch.Tensor, new_x: torch.Tensor) -> torch.Tensor:
    """lin captured in a CUDA graph on a copy of x, then replayed on new_x: the graph's output."""
    static_x = x.clone()
    lin(static_x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = lin(static_x)
    static_x.copy_(new_x)
    g.replay()
    return static_y


@needs_cuda
def test_linear_uses_rows_gemm_in_a_cuda_graph():
    lin = Linear(576, 960, dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    use_gemv_for_all_sizes(lin, rows=True)
    x = torch.randn(9, 576, device="cuda", dtype=torch.bfloat16)
    replayed = _replayed_in_a_graph(lin, x, x * 2)
    torch.testing.assert_close(replayed, gemv_reference(x * 2, lin.weight), atol=1e-2, rtol=1e-2)


@needs_cuda
# 8B projections, and SmolLM2's (K = 576 / 1536: not a multiple of the K block, so the first tile
# that a PDL launch loads before waiting is a masked one)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (960, 576), (3072, 576), (576, 1536)])
def test_gemv_bf16_8b_shapes(n, k):
    x = _randn(1, k, dtype=torch.bfloat16, seed=4)
    w = _randn(n, k, dtype=torch.bfloat16, seed=5) * 0.02
    torch.testing.assert_close(gemv(x, w), gemv_reference(x, w), atol=1e-2, rtol=1e-2)


@needs_cuda
def test_linear_uses_gemv_in_a_cuda_graph():
    lin = Linear(4096, 4096, dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert triton_gemv.use_gemv(x, lin.weight, lin.gemv_min_elements)
    eager = lin(x)
    torch.testing.assert_close(_replayed_in_a_graph(lin, x, x * 2), lin(x * 2))
    torch.testing.assert_close(eager, gemv_reference(x, lin.weight), atol=1e-2, rtol=1e-2)


# --- RMSNorm (+ residual add) fused into the GEMV, optionally with SiLU-and-mul ------------------


# --- the gated attention's o_proj: o * sigmoid(gate) applied to the input row (FREETOKEN_ATTN_GATE_GEMV) ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
@pytest.mark.parametrize("bias", [False, True])
def test_gated_gemv_matches_reference(dtype, k, bias):
    n = 72
    x = _randn(1, k, dtype=dtype, seed=21)
    gate = 3.0 * _randn(1, k, dtype=dtype, seed=22)  # sigmoid over its whole range
    w = _randn(n, k, dtype=dtype, seed=23) * 0.1
    b = _randn(n, dtype=dtype, seed=24) if bias else None
    got = gemv(x, w, b, block_n=16, block_k=64, num_warps=4, num_stages=2, gate=gate)
    want = gemv_reference(x, w, b, gate=gate)
    torch.testing.assert_close(want, gemv_reference(x * torch.sigmoid(gate), w, b), atol=0, rtol=0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("d", [16, 12])  # heads that fill K tiles of 32 evenly / straddle them
def test_gated_gemv_reads_a_strided_gate_in_place(d):
    """The gate as Attention.split_query leaves it: [1, H, D] heads of the [q | gate] rows, 2D apart."""
    heads, k_tile = 5, 32
    rows = _randn(1, heads, 2 * d, dtype=torch.float16, seed=31)
    gate = rows[..., d:]
    x = _randn(1, heads * d, dtype=torch.float16, seed=32)
    w = _randn(40, heads * d, dtype=torch.float16, seed=33) * 0.1
    got = gemv(x, w, block_n=16, block_k=k_tile, gate=gate)
    contiguous = gemv(x, w, block_n=16, block_k=k_tile, gate=gate.reshape(1, -1))
    torch.testing.assert_close(got, contiguous, atol=0, rtol=0)
    torch.testing.assert_close(got, gemv_reference(x, w, gate=gate), atol=2e-2, rtol=1e-2)


def test_gated_gemv_rounds_like_torch_per_element():
    """W = I: each output is one input element, so the transformed row itself is compared. fp16 under the
    interpreter (numpy's exp vs torch's: allow a rare last-place flip); on the GPU the bf16 test is exact."""
    k = 128
    x = _randn(1, k, dtype=torch.float16, seed=41)
    gate = 4.0 * _randn(1, k, dtype=torch.float16, seed=42)
    eye = torch.eye(k, dtype=torch.float16, device=DEV)
    got = gemv(x, eye, block_n=16, block_k=64, gate=gate)
    want = x * torch.sigmoid(gate)
    assert (got != want).float().mean().item() <= 0.02
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_gated_gemv_checks_the_gate():
    x = torch.zeros(1, 32, device=DEV)
    w = torch.zeros(16, 32, device=DEV)
    with pytest.raises(AssertionError, match="does not fit"):
        gemv(x, w, block_n=16, block_k=32, gate=torch.zeros(1, 16, device=DEV))
    with pytest.raises(AssertionError, match="does not fit"):
        gemv(x, w, block_n=16, block_k=32, gate=torch.zeros(1, 32, device=DEV, dtype=torch.float16))


@needs_cuda
@pytest.mark.parametrize("heads,d", [(16, 256), (32, 128)])  # Qwen3.6's o_proj input (4096), a 32 x 128 one
def test_gpu_gated_gemv_bf16_is_the_unfused_path_bit_for_bit(heads, d):
    """bf16 at Qwen3.6's o_proj (2048 x 4096, its measured tile): equal bits to the unfused path (torch's
    sigmoid and multiply, then the same GEMV), and with W = I the gated row itself equals torch's."""
    k = heads * d
    rows = _randn(1, heads, 2 * d, dtype=torch.bfloat16, seed=51) * 4.0
    gate = rows[..., d:]
    o = _randn(1, k, dtype=torch.bfloat16, seed=52)
    w = _randn(2048, k, dtype=torch.bfloat16, seed=53) * 0.02
    unfused = o * torch.sigmoid(gate.reshape(1, -1))
    torch.testing.assert_close(gemv(o, w, gate=gate), gemv(unfused, w), atol=0, rtol=0)
    torch.testing.assert_close(gemv(o, w, gate=gate), gemv_reference(o, w, gate=gate), atol=3e-2, rtol=2e-2)
    # every bf16 gate value in [-64, 64] through the sigmoid and the product (past that sigmoid's tail
    # nears fp32's subnormals, where flush-to-zero choices rather than rounding would be tested)
    sweep = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    sweep = sweep[torch.isfinite(sweep) & (sweep.float().abs() <= 64.0)].cuda()
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    for start in range(0, sweep.numel(), k):
        g = sweep[start: start + k]
        g = torch.cat([g, g.new_zeros(k - g.numel())]).view(1, k)
        x = _randn(1, k, dtype=torch.bfloat16, seed=start)
        torch.testing.assert_close(gemv(x, eye, gate=g), x * torch.sigmoid(g), atol=0, rtol=0)


@needs_cuda
def test_gpu_gated_gemv_replays_in_a_cuda_graph():
    heads, d = 16, 256
    rows = torch.randn(1, heads, 2 * d, dtype=torch.bfloat16, device="cuda")
    o = torch.randn(1, heads * d, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, heads * d, dtype=torch.bfloat16, device="cuda") * 0.02
    gemv(o, w, gate=rows[..., d:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(o, w, gate=rows[..., d:])
    rows.copy_(torch.randn_like(rows))
    o.copy_(torch.randn_like(o))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, gemv(o * torch.sigmoid(rows[..., d:].reshape(1, -1)), w), atol=0, rtol=0)
