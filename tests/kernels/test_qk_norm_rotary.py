"""q/k RMSNorm + rotary in one launch (`kernels/qk_norm_rotary.py`) against its plain-torch reference and
against the unfused kernels it replaces (`fused_ops.rmsnorm` x 2 + `fused_ops.rotary`).

CPU: Triton's interpreter, fp32 and fp16 (its bf16 arithmetic is wrong), tiny shapes. GPU (skipped
without CUDA): bf16/fp16 at Qwen3 shapes, the Attention dispatch, and a CUDA-graph replay.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from freetoken_core.kernels import fused_ops as ops
from freetoken_core.kernels.qk_norm_rotary import qk_norm_rotary
from freetoken_core.kernels.qk_norm_rotary_ref import qk_norm_rotary_reference, zero_centered_rms_norm_torch
from freetoken_core.layers.norm import ZeroCenteredRMSNorm
from freetoken_core.layers.rotary import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape: int, dtype: torch.dtype, device: str = DEV, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _case(head_dim: int, rot_dim: int, num_q: int, num_kv: int, dtype: torch.dtype, device: str = DEV,
          num_tokens: int = 4, gated: bool = False, zero_centered: bool = False):
    """q/k as the model passes them: strided views of one fused QKV row ([q | gate] per head if gated)."""
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": rot_dim / head_dim}
    rope = RotaryEmbedding(head_dim, 600, params, dtype).to(device)
    assert rope.rot_dim == rot_dim
    t, qw = num_tokens, (2 if gated else 1) * num_q * head_dim
    qkv = 2.0 * _randn(t, qw + 2 * num_kv * head_dim, dtype=dtype, device=device)
    q = qkv[:, :qw].view(t, num_q, -1)[..., :head_dim]  # gated: a [T, H, 2D] slice
    k = qkv[:, qw: qw + num_kv * head_dim].view(t, num_kv, head_dim)
    centre = 0.0 if zero_centered else 1.0  # zero-centred checkpoints store w - 1
    wq = (centre + 0.3 * _randn(head_dim, dtype=torch.float32, seed=1)).to(device, dtype)
    wk = (centre + 0.3 * _randn(head_dim, dtype=torch.float32, seed=2)).to(device, dtype)
    positions = torch.arange(t, device=device) * 137 % 600  # rows of several requests
    return rope, positions, q, k, wq, wk


def _assert_ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Half precision: the same rounding points, so only rare last-place flips from the fp32 rstd."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    assert (got != want).float().mean().item() <= 0.02


CASES = [  # head_dim, rot_dim, num_q, num_kv, gated
    (16, 16, 4, 2, False),  # full rotary, GQA
    (24, 16, 3, 1, False),  # partial rotary, head_dim not a power of two
    (32, 8, 2, 2, True),  # Qwen3-Next-like: partial rotary (1/4), q a strided slice of [T, H, 2D]
    (16, 12, 2, 1, False),  # a non-power-of-two half (6)
]


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv,gated", CASES)
def test_matches_reference(head_dim, rot_dim, num_q, num_kv, gated, dtype, zero_centered):
    rope, pos, q, k, wq, wk = _case(head_dim, rot_dim, num_q, num_kv, dtype, gated=gated, zero_centered=zero_centered)
    q_in, k_in = q.clone(), k.clone()
    args = (pos, q, k, wq, wk, 1e-6, 1e-5, rope.cos_sin_cache, rot_dim, zero_centered)
    got_q, got_k = qk_norm_rotary(*args)
    ref_q, ref_k = qk_norm_rotary_reference(*args)
    assert got_q.shape == (q.shape[0], num_q, head_dim) and got_q.is_contiguous() and got_k.is_contiguous()
    _assert_ulp_close(got_q, ref_q)
    _assert_ulp_close(got_k, ref_k)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # inputs untouched


def _unfused(pos, q, k, wq, wk, eps, cos_sin, rot_dim, zero_centered):
    """The unfused CUDA path: the RMSNorm kernel on q and on k, then the rotary kernel."""
    kw = dict(zero_centered=True) if zero_centered else {}
    return ops.rotary(pos, ops.rmsnorm(q, wq, eps, **kw), ops.rmsnorm(k, wk, eps, **kw), cos_sin, rot_dim)


def _rmsnorm_kernel_has_zero_centered() -> bool:
    return "zero_centered" in inspect.signature(ops.rmsnorm).parameters


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv,gated", CASES[:3])
def test_bit_identical_to_the_unfused_kernels(head_dim, rot_dim, num_q, num_kv, gated, dtype, zero_centered):
    """Same rounding points and the same per-head reduction as rmsnorm + rmsnorm + rotary: equal bits."""
    if zero_centered and not _rmsnorm_kernel_has_zero_centered():
        pytest.skip("fused_ops.rmsnorm has no zero-centred form here")
    rope, pos, q, k, wq, wk = _case(head_dim, rot_dim, num_q, num_kv, dtype, gated=gated, zero_centered=zero_centered)
    got = qk_norm_rotary(pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, rot_dim, zero_centered)
    want = _unfused(pos, q, k, wq, wk, 1e-6, rope.cos_sin_cache, rot_dim, zero_centered)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_several_heads_per_program(dtype):
    """Past _ONE_HEAD_MAX_TOKENS tokens a program takes a block of heads (the prefill grid)."""
    rope, pos, q, k, wq, wk = _case(16, 16, 6, 2, dtype, num_tokens=66)
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 16)
    for g, w in zip(qk_norm_rotary(*args), qk_norm_rotary_reference(*args)):
        _assert_ulp_close(g, w)


def test_zero_centered_reference_is_the_layer_formula():
    """The reference's zero-centred norm must stay the layer's (layers/norm.py), bit for bit."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = ZeroCenteredRMSNorm(24, 1e-6, dtype)
        norm.weight.data.copy_(0.3 * _randn(24, dtype=torch.float32, device="cpu", seed=1))
        x = _randn(5, 3, 24, dtype=dtype, device="cpu")
        torch.testing.assert_close(zero_centered_rms_norm_torch(x, norm.weight, 1e-6), norm(x), atol=0, rtol=0)


def test_zero_tokens_launch_nothing():
    e = dict(device=DEV)
    w = torch.ones(8, **e)
    rq, rk = qk_norm_rotary(torch.empty(0, dtype=torch.long, **e), torch.empty(0, 2, 8, **e),
                            torch.empty(0, 1, 8, **e), w, w, 1e-6, 1e-6, torch.ones(4, 8, **e), 8)
    assert rq.shape == (0, 2, 8) and rk.shape == (0, 1, 8)


# ---------------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv,gated", [
    (128, 128, 32, 4, False),  # Qwen3-30B-A3B
    (256, 64, 16, 2, True),  # Qwen3-Next / Qwen3.6 gated attention (partial rotary 0.25)
])
def test_gpu_matches_reference_and_unfused(head_dim, rot_dim, num_q, num_kv, gated, num_tokens, dtype,
                                           zero_centered):
    rope, pos, q, k, wq, wk = _case(head_dim, rot_dim, num_q, num_kv, dtype, "cuda", num_tokens, gated, zero_centered)
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, rot_dim, zero_centered)
    got = qk_norm_rotary(*args)
    for g, w in zip(got, qk_norm_rotary_reference(*args)):
        _assert_ulp_close(g, w)
    if not zero_centered or _rmsnorm_kernel_has_zero_centered():  # the unfused CUDA path: same rounding points
        for g, w in zip(got, _unfused(pos, q, k, wq, wk, 1e-6, rope.cos_sin_cache, rot_dim, zero_centered)):
            _assert_ulp_close(g, w)


@needs_cuda
def test_gpu_replays_in_a_cuda_graph():
    rope, pos, q, k, wq, wk = _case(128, 128, 32, 4, torch.bfloat16, "cuda", 1)

    def step():
        return qk_norm_rotary(pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 128)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn_like(q))
    pos.fill_(321)
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(out, step()):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.parametrize("gated", [False, True])
def test_attention_fused_call_equals_its_unfused_modules(gated):
    """Attention.attend's fused call (weights, eps, rot_dim, the norm's form) against q_norm, k_norm,
    rotary; on CUDA it is what attend takes, on CPU attend keeps the modules (torch)."""
    from types import SimpleNamespace

    from freetoken_core.layers import RMSNorm
    from freetoken_core.models.blocks import Attention

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=128,
                          rms_norm_eps=1e-6)
    rot = 8 if gated else 32
    params = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": rot / 32}
    with torch.device(DEV):
        rope = RotaryEmbedding(32, 4096, params, dtype)
        attn = Attention(cfg, 0, rope, dtype, qk_norm=True, q_outputs_per_head=2 if gated else 1,
                         norm_cls=ZeroCenteredRMSNorm if gated else RMSNorm)
    for i, norm in enumerate((attn.q_norm, attn.k_norm)):
        norm.weight.data.copy_(0.3 * _randn(32, dtype=dtype, seed=5 + i))
    qkv = _randn(3, attn.qkv_proj.q_size + 2 * attn.qkv_proj.kv_size, dtype=dtype)
    q, k, _ = attn.qkv_proj.split(qkv)
    q, _ = attn.split_query(q.view(3, -1, 32))
    k = k.view(3, 2, 32)
    pos = torch.tensor([0, 77, 4000], device=DEV)
    assert attn._fuses_qk_norm_rotary(q) == (DEV == "cuda")
    got = attn._qk_norm_rotary(pos, q, k)
    want = attn.rotary(pos, attn.q_norm(q), attn.k_norm(k))  # the unfused path of this device
    for g, w in zip(got, want):
        _assert_ulp_close(g, w)


# ------------------------------------------------------- the K/V cache store in the same launch (kv_out)


def _kv_case(head_dim: int, rot_dim: int, num_q: int, num_kv: int, dtype: torch.dtype, page_size: int,
             device: str = DEV, num_tokens: int = 3, gated: bool = False, cache_dtype: torch.dtype | None = None,
             loc_dtype: torch.dtype = torch.int64):
    """A `_case` plus v (a view of the same fused row), random paged caches and the rows' flat slots."""
    rope, pos, q, k, wq, wk = _case(head_dim, rot_dim, num_q, num_kv, dtype, device, num_tokens, gated)
    # v: the block after k in the same fused QKV rows (`_case` leaves room for it)
    v = k.as_strided(k.shape, k.stride(), k.storage_offset() + num_kv * head_dim)
    num_pages = (2 * num_tokens) // page_size + 3
    shape = (num_pages, page_size, num_kv, head_dim)
    k_cache = _randn(*shape, dtype=cache_dtype or dtype, device=device, seed=7)
    v_cache = _randn(*shape, dtype=cache_dtype or dtype, device=device, seed=8)
    g = torch.Generator().manual_seed(9)
    # distinct slots off the dummy page, spread over the pages (a slot inside a page when page_size > 1)
    loc = (torch.randperm((num_pages - 1) * page_size, generator=g)[:num_tokens] + page_size).to(device, loc_dtype)
    return rope, pos, q, k, v, wq, wk, k_cache, v_cache, loc


KV_CASES = [  # head_dim, rot_dim, num_q, num_kv, gated
    (16, 16, 4, 2, False),
    (32, 8, 2, 2, True),  # gated q, partial rotary (the pass-through lanes are stored too)
    (24, 16, 3, 1, False),  # head_dim not a power of two
]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv,gated", KV_CASES)
def test_kv_out_equals_store_kv_after_the_kernel(head_dim, rot_dim, num_q, num_kv, gated, dtype, page_size):
    """With kv_out: the same q/k outputs and, in every page and slot (touched or not), exactly what the
    backend's store_kv writes from them."""
    from freetoken_core.attention.triton.store_kv import store_kv

    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(head_dim, rot_dim, num_q, num_kv, dtype, page_size,
                                                        gated=gated)
    want_kc, want_vc = kc.clone(), vc.clone()
    args = (pos, q, k, wq, wk, 1e-6, 1e-5, rope.cos_sin_cache, rot_dim)
    want_q, want_k = qk_norm_rotary(*args)
    store_kv(want_k, v, want_kc, want_vc, loc)
    got_q, got_k = qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    for got, want in ((got_q, want_q), (got_k, want_k), (kc, want_kc), (vc, want_vc)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_kv_out_matches_reference(page_size, zero_centered):
    """Against the plain-torch reference's own store (`qk_norm_rotary_reference(..., kv_out=...)`); an
    fp32 cache under an fp16 model: the values converted as store_kv converts them; int32 slots."""
    from freetoken_core.attention.triton import reference as attn_ref

    dtype = torch.float16
    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(32, 8, 2, 2, dtype, page_size, gated=True,
                                                        cache_dtype=torch.float32, loc_dtype=torch.int32)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 8, zero_centered)
    got_q, got_k = qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    ref_q, ref_k = qk_norm_rotary_reference(*args, v=v, kv_out=(ref_kc, ref_vc, loc))
    _assert_ulp_close(got_q, ref_q)
    _assert_ulp_close(got_k, ref_k)
    torch.testing.assert_close(vc, ref_vc, atol=0, rtol=0)  # v: a copy
    flat = kc.view(-1, *kc.shape[2:])
    torch.testing.assert_close(flat[loc.long()], got_k.float(), atol=0, rtol=0)  # the kernel's k, converted
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[loc.long().cpu()] = False
    torch.testing.assert_close(flat[untouched], ref_kc.view(-1, *kc.shape[2:])[untouched], atol=0, rtol=0)
    attn_ref.store_kv_reference(got_k, v, ref_kc, ref_vc, loc)  # and that is the reference store of it
    torch.testing.assert_close(kc, ref_kc, atol=0, rtol=0)


def test_kv_out_with_several_heads_per_program():
    """Past _ONE_HEAD_MAX_TOKENS tokens a program takes a block of heads: the store follows."""
    from freetoken_core.attention.triton.store_kv import store_kv

    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(16, 16, 6, 3, torch.float32, 4, num_tokens=66)
    want_kc, want_vc = kc.clone(), vc.clone()
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 16)
    want = qk_norm_rotary(*args)
    store_kv(want[1], v, want_kc, want_vc, loc)
    got = qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    for g, w in zip((*got, kc, vc), (*want, want_kc, want_vc)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_kv_out_needs_v_and_a_matching_cache():
    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(16, 16, 4, 2, torch.float32, 1)
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 16)
    with pytest.raises(AssertionError, match="both v and kv_out"):
        qk_norm_rotary(*args, kv_out=(kc, vc, loc))
    with pytest.raises(AssertionError, match="does not hold"):
        qk_norm_rotary(*args, v=v, kv_out=(kc[..., :8], vc, loc))
    with pytest.raises(AssertionError, match="out_loc"):
        qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc[:1]))


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv,gated,zero_centered", [
    (128, 128, 32, 4, False, False),  # Qwen3-30B-A3B
    (256, 64, 16, 2, True, True),  # Qwen3.6 gated attention (partial rotary 0.25)
])
def test_gpu_kv_out_equals_store_kv(head_dim, rot_dim, num_q, num_kv, gated, zero_centered, num_tokens, page_size):
    from freetoken_core.attention.triton.store_kv import store_kv

    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(head_dim, rot_dim, num_q, num_kv, torch.bfloat16, page_size,
                                                        "cuda", num_tokens, gated)
    want_kc, want_vc = kc.clone(), vc.clone()
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, rot_dim, zero_centered)
    want = qk_norm_rotary(*args)
    store_kv(want[1], v, want_kc, want_vc, loc)
    got = qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    for g, w in zip((*got, kc, vc), (*want, want_kc, want_vc)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@needs_cuda
def test_gpu_kv_out_replays_in_a_cuda_graph():
    """The slots are read on the device: a replay with new out_loc values stores there."""
    from freetoken_core.attention.triton.store_kv import store_kv

    rope, pos, q, k, v, wq, wk, kc, vc, loc = _kv_case(256, 64, 16, 2, torch.bfloat16, 16, "cuda", 1, True)
    args = (pos, q, k, wq, wk, 1e-6, 1e-6, rope.cos_sin_cache, 64, True)
    qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qk_norm_rotary(*args, v=v, kv_out=(kc, vc, loc))
    q.copy_(torch.randn_like(q))
    v.copy_(torch.randn_like(v))
    loc.fill_(37)
    want_kc, want_vc = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    want = qk_norm_rotary(*args)
    store_kv(want[1], v, want_kc, want_vc, loc)
    for g, w in zip((*out, kc, vc), (*want, want_kc, want_vc)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
