"""Two batch-1 decode fusions of the gated-delta-net layer, each behind an env.py switch (off by default):

- the conv update inside the recurrence (`gdn.gdn_decode_with_conv`, FREETOKEN_GDN_FUSED_CONV) against the
  unfused sequence (`conv1d_update` then `gdn_recurrent_update`) over consecutive steps: outputs and both
  state pools, untouched slots included, and the per-key-head counters back at 0 after every launch;
- the gated output norm inside out_proj's GEMV (`gdn_out_gemv.gdn_out_norm_gemv`, FREETOKEN_GDN_OUT_NORM_GEMV)
  against its reference and against the unfused kernels (`gated_rmsnorm` then `gemv`);
- the layer's dispatch: the same results with the switches on and off (on CPU the layer runs the torch
  references either way; on a GPU host, Qwen3.6's shapes in bf16 take the fused kernels).

Kernels run under Triton's interpreter on CPU (fp32 and fp16), compiled on a GPU host.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

# first: gdn_cases keeps transformers off fla / causal_conv1d (their CUDA-only kernels)
from tests.kernels.gdn_cases import DEV, K_CONV, SLOTS, TOL, _gen, conv_inputs, gate_inputs, ids, needs_cuda, state_pool
from freetoken_core import core  # noqa: E402
from freetoken_core.env import KernelEnv, kernel_env, triton_interpreted  # noqa: E402
from freetoken_core.kernels import causal_conv1d as conv_k  # noqa: E402
from freetoken_core.kernels import gdn  # noqa: E402
from freetoken_core.kernels import gdn_out_gemv  # noqa: E402
from freetoken_core.kernels import gdn_ref as ref  # noqa: E402
from freetoken_core.kernels.gemv import gemv, gemv_config  # noqa: E402
from freetoken_core.kvcache.linear_state import LinearStatePool, LinearStateStep  # noqa: E402
from freetoken_core.layers.gdn import GatedDeltaNet  # noqa: E402

HK, HV, DK = 2, 4, 16
# (slots, num_rows): one request; a padded request on the dummy slot 0 that keeps its state; two padded
# requests sharing slot 0 and writing it, as the graph runner pads (num_rows = 1 everywhere)
CASES = {"b1": ([5], [1]), "b3": ([3, 0, 6], [1, 0, 1]), "b4_padded": ([3, 0, 6, 0], [1, 1, 1, 1])}


def _unfused(x, w, b, cpool, a, bb, spool, slots, num_rows, kw):
    y = conv_k.conv1d_update(x, w, b, cpool, slots, num_rows, 1, True)
    B, key = x.shape[0], HK * DK
    q, k, v = y[:, :key].view(B, HK, DK), y[:, key:2 * key].view(B, HK, DK), y[:, 2 * key:].view(B, HV, -1)
    return gdn.gdn_recurrent_update(q, k, v, a, bb, spool, slots, num_rows, 1, True, **kw)


# Tiles: dv 16 at BV 16 is one program per head (the norm in the epilogue); BV 8 two v blocks, so four
# programs read each key head's q/k channels; dv 32 at the table's BV 16 two v blocks, the norm a separate
# launch. Every case, dtype, bias and tile appears, not their full product (the interpreter is slow).
FP32, FP16 = torch.float32, torch.float16


@pytest.mark.parametrize("case,dtype,bias,dv,block_v", [
    ("b1", FP32, False, 16, None), ("b1", FP16, True, 32, None),
    ("b3", FP32, True, 16, 8), ("b3", FP16, False, 16, None),
    ("b4_padded", FP16, True, 16, 8),
])
def test_fused_conv_equals_conv_then_recurrence(case, dtype, bias, dv, block_v):
    slots_l, rows_l = CASES[case]
    slots, num_rows = ids(slots_l), ids(rows_l)
    B, C, steps = len(slots_l), 2 * HK * DK + HV * dv, 3
    _, w, b, cpool = conv_inputs(B, C, dtype=dtype, bias=bias)
    spool = state_pool(HV, DK, dv)
    cpool_u, spool_u = cpool.clone(), spool.clone()
    cpool_r, spool_r = cpool.clone(), spool.clone()
    before = (cpool.clone(), spool.clone())
    arrivals = gdn.conv_arrival_counters(cpool, HK)
    real = [i for i, s in enumerate(slots_l) if s != 0]  # padded rows' outputs and slot 0 are garbage
    for step in range(steps):
        x = conv_inputs(B, C, dtype=dtype, seed=10 + step)[0]
        a, bb, A_log, dt_bias, nw, z = gate_inputs(B, HV, dv, dtype=dtype, seed=step)
        kw = dict(gating=(A_log, dt_bias), out_norm=(nw, z, 1e-6))
        o = gdn.gdn_decode_with_conv(x, w, b, cpool, a, bb, spool, slots, num_rows, HK, arrivals, **kw,
                                     block_v=block_v)
        o_u = _unfused(x, w, b, cpool_u, a, bb, spool_u, slots, num_rows, dict(kw, block_v=block_v))
        o_r = ref.gdn_decode_with_conv_ref(x, w, b, cpool_r, a, bb, spool_r, slots, num_rows, HK, **kw)
        assert torch.count_nonzero(arrivals) == 0  # every launch leaves its counters at 0
        # the same operations in the same order as the unfused kernels
        torch.testing.assert_close(o[real], o_u[real], **_fused_vs_unfused(o.dtype))
        tol = TOL if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
        torch.testing.assert_close(o[real], o_r[real], **tol)
        for got, unfused, want in ((cpool, cpool_u, cpool_r), (spool, spool_u, spool_r)):
            torch.testing.assert_close(got[1:], unfused[1:], **_fused_vs_unfused(got.dtype))
            torch.testing.assert_close(got[1:], want[1:], **(TOL if got.dtype == torch.float32 else tol))
    untouched = [s for s in range(1, SLOTS) if s not in slots_l]
    assert torch.equal(cpool[untouched], before[0][untouched]) and torch.equal(spool[untouched], before[1][untouched])
    if case == "b3":  # slot 0 (num_rows 0 there) keeps its states
        assert torch.equal(cpool[0], before[0][0]) and torch.equal(spool[0], before[1][0])


def _fused_vs_unfused(dtype: torch.dtype) -> dict:
    """Fused against unfused kernels: exact under the interpreter (same operations, same order); compiled, the
    fused kernel's fp32 arithmetic may be contracted into other FMAs (H200: 2 of 128 outputs 4e-8 apart)."""
    if triton_interpreted():
        return dict(atol=0, rtol=0)
    return dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)


def test_fused_conv_checks_its_inputs():
    dv = 16
    C = 2 * HK * DK + HV * dv
    x, w, _, cpool = conv_inputs(2, C)
    a, bb, A_log, dt_bias, _, _ = gate_inputs(2, HV, dv)
    spool, slots, rows = state_pool(HV, DK, dv), ids([1, 2]), ids([1, 1])
    with pytest.raises(AssertionError, match="key heads"):  # a row count that is not one per request
        gdn.gdn_decode_with_conv(torch.cat([x, x]), w, None, cpool, a, bb, spool, slots, rows, HK)
    with pytest.raises(AssertionError, match="int32 counters"):
        gdn.gdn_decode_with_conv(x, w, None, cpool, a, bb, spool, slots, rows, HK, torch.zeros(SLOTS, HK))
    # without counters it allocates its own (eager use)
    o = gdn.gdn_decode_with_conv(x, w, None, cpool.clone(), a, bb, spool.clone(), slots, rows, HK,
                                 gating=(A_log, dt_bias))
    o_r = ref.gdn_decode_with_conv_ref(x, w, None, cpool.clone(), a, bb, spool.clone(), slots, rows, HK,
                                       gating=(A_log, dt_bias))
    torch.testing.assert_close(o, o_r, **TOL)


# ------------------------------------------------------------------------- out norm inside the GEMV


def _out_inputs(H, dv, n, dtype, seed=0):
    gen = _gen(seed)
    o = torch.randn(1, H, dv, generator=gen).to(DEV, dtype)
    z = torch.randn(1, H, 2 * dv, generator=gen).to(DEV, dtype)[..., :dv]  # strided: a view of in_proj's row
    nw = (1 + 0.3 * torch.randn(dv, generator=gen)).to(DEV, dtype)
    w = (0.1 * torch.randn(n, H * dv, generator=gen)).to(DEV, dtype)
    bias = torch.randn(n, generator=gen).to(DEV, dtype)
    return o, z, nw, w, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,heads", [(6, 4), (8, 4), (8, None)])  # 6 heads in steps of 4: a partial last tile
@pytest.mark.parametrize("with_bias", [False, True])
def test_out_norm_gemv_matches_reference(dtype, H, heads, with_bias):
    dv, n = 16, 40  # n not a multiple of block_n
    o, z, nw, w, bias = _out_inputs(H, dv, n, dtype)
    bias = bias if with_bias else None
    got = gdn_out_gemv.gdn_out_norm_gemv(o, z, nw, 1e-6, w, bias, block_n=16, heads=heads, num_warps=4,
                                         num_stages=2)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, ref.gdn_out_norm_gemv_ref(o, z, nw, 1e-6, w, bias), **tol)
    if heads is not None:  # the unfused kernels with the same K tile: the same sums
        unfused = gemv(gdn.gated_rmsnorm(o, z, nw, 1e-6).view(1, H * dv), w, bias, block_n=16, block_k=heads * dv,
                       num_warps=4, num_stages=2)
        torch.testing.assert_close(got, unfused, atol=0, rtol=0)


def test_out_norm_gemv_requirements():
    o, z, nw, w, _ = _out_inputs(4, 24, 8, torch.float32)
    with pytest.raises(AssertionError, match="power of two"):  # dv = 24: a K tile of whole heads needs 2^k
        gdn_out_gemv.gdn_out_norm_gemv(o, z, nw, 1e-6, w)
    o, z, nw, w, _ = _out_inputs(4, 16, 8, torch.float32)
    with pytest.raises(AssertionError, match="one row"):
        gdn_out_gemv.gdn_out_norm_gemv(torch.cat([o, o]), torch.cat([z, z]), nw, 1e-6, w)
    with pytest.raises(AssertionError, match="power of two"):
        gdn_out_gemv.gdn_out_norm_gemv(o, z, nw, 1e-6, w, heads=3)
    cfg = gdn_out_gemv.gdn_out_gemv_config(2048, 32, 128)  # Qwen3.6's out_proj: gemv's tile in whole heads
    base = gemv_config(2048, 4096)
    assert cfg["block_n"] == base["block_n"] and cfg["heads"] * 128 <= max(base["block_k"], 128) < cfg["heads"] * 256


# --------------------------------------------------------------------------------- layer dispatch


@contextlib.contextmanager
def _switches(monkeypatch, on: bool):
    """FREETOKEN_GDN_FUSED_CONV / FREETOKEN_GDN_OUT_NORM_GEMV set for the block, the defaults restored after."""
    try:
        with monkeypatch.context() as m:
            for name in ("gdn_fused_conv", "gdn_out_norm_gemv"):
                m.setenv(KernelEnv.variable(name), "1" if on else "0")
            kernel_env.cache_clear()
            yield
    finally:
        kernel_env.cache_clear()


def _layer(dtype, device, Hk, Hv, dk, dv, hidden, seed=0):
    cfg = SimpleNamespace(linear_num_key_heads=Hk, linear_num_value_heads=Hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, linear_conv_kernel_dim=K_CONV, hidden_size=hidden,
                          rms_norm_eps=1e-6)
    layer = GatedDeltaNet(cfg, 0, dtype)
    gen = _gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name == "A_log":
                r = torch.rand(p.shape, generator=gen).mul(16).add(0.01).log()
            elif name == "norm.weight":
                r = 1 + 0.3 * r
            elif p.dim() == 2:
                r = r / p.shape[1] ** 0.5
            elif name == "conv1d.weight":
                r = 0.5 * r
            p.copy_(r.to(dtype))
    return layer.to(device)


def _decode_steps(layer, slots, steps, device, dtype, seed=0):
    """`steps` decode steps of the layer from random in_proj rows; returns the outputs and the final pools."""
    spec = layer.cache_spec()
    pool = LinearStatePool([spec], SLOTS, dtype, torch.float32, torch.device(device))
    gen = _gen(seed)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=gen).to(dtype))
    pool.recurrent[0].copy_(0.5 * torch.randn(pool.recurrent[0].shape, generator=gen))
    B = len(slots)
    width = spec.conv_dim + layer.value_dim + 2 * layer.num_v_heads
    st = LinearStateStep(pool, ids(slots, device, torch.int64), varlen=False,
                         num_rows=ids([1] * B, device, torch.int64), rows_per_req=1, write_state=True)
    saved = core._CTX
    core.set_context(core.Context(kv_cache=None, attn_backend=None, linear_state=st))
    try:
        outs = [layer.attend(None, torch.randn(B, width, generator=gen).to(device, dtype)) for _ in range(steps)]
    finally:
        core.set_context(saved)
    return outs, pool


def test_layer_switches_leave_the_cpu_path_alone(monkeypatch):
    """CPU: the layer runs the torch references whatever the switches say (no launches to save there)."""
    layer = _layer(torch.float32, "cpu", 2, 4, 16, 16, 32)
    before = kernel_env()
    results = []
    for on in (False, True):
        with _switches(monkeypatch, on):
            assert kernel_env().gdn_fused_conv is on and kernel_env().gdn_out_norm_gemv is on
            results.append(_decode_steps(layer, [3], 2, "cpu", torch.float32))
    assert kernel_env() == before  # the process's switches back
    (outs_off, pool_off), (outs_on, pool_on) = results
    for a, b in zip(outs_off, outs_on):
        assert torch.equal(a, b)
    assert torch.equal(pool_off.conv[0], pool_on.conv[0]) and torch.equal(pool_off.recurrent[0], pool_on.recurrent[0])


# Qwen3.6's GDN layer: 16 key heads, 32 value heads of 128, conv kernel 4, hidden 2048
QWEN36_LAYER = dict(Hk=16, Hv=32, dk=128, dv=128, hidden=2048)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("slots", [[3], [3, 0, 6]])  # batch 1: both fusions; batch 3: the fused conv only
def test_gpu_layer_fused_decode_equals_unfused_qwen36_bf16(monkeypatch, slots):
    layer = _layer(torch.bfloat16, DEV, **QWEN36_LAYER)
    if len(slots) == 1:
        assert not gdn.fuses_out_norm(1, 32, 128)  # the batch-1 tile (BV 16) leaves the norm to out_proj's GEMV
    results = []
    for on in (False, True):
        with _switches(monkeypatch, on):
            results.append(_decode_steps(layer, slots, 3, DEV, torch.bfloat16))
    (outs_off, pool_off), (outs_on, pool_on) = results
    real = [i for i, s in enumerate(slots) if s != 0]
    for a, b in zip(outs_off, outs_on):
        torch.testing.assert_close(b[real], a[real], **BF16_TOL)
    assert torch.equal(pool_on.conv[0][1:], pool_off.conv[0][1:])
    torch.testing.assert_close(pool_on.recurrent[0][1:], pool_off.recurrent[0][1:], atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(layer._conv_arrivals) == 0


@needs_cuda
def test_gpu_fused_conv_in_cuda_graph_qwen36_bf16():
    """Captured once, replayed over several steps: the counters, never reset by the host, stay exact."""
    Hk, Hv, dk, dv = 16, 32, 128, 128
    C, B = 2 * Hk * dk + Hv * dv, 4
    x, w, _, _ = conv_inputs(B, C, dtype=torch.bfloat16, bias=False)
    a, bb, A_log, dt_bias, nw, z = gate_inputs(B, Hv, dv, dtype=torch.bfloat16)
    slots, rows = ids([1, 5, 0, 0]), ids([1, 1, 1, 1])  # two padded rows on the dummy slot
    cpool = torch.randn(SLOTS, C, K_CONV - 1, device=DEV, dtype=torch.bfloat16)
    spool = 0.5 * torch.randn(SLOTS, Hv, dk, dv, device=DEV)
    arrivals = gdn.conv_arrival_counters(cpool, Hk)
    kw = dict(gating=(A_log, dt_bias), out_norm=(nw, z, 1e-6))

    def step():
        return gdn.gdn_decode_with_conv(x, w, None, cpool, a, bb, spool, slots, rows, Hk, arrivals, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture, on scratch copies of the pools
        saved = (cpool.clone(), spool.clone())
        step()
        cpool.copy_(saved[0])
        spool.copy_(saved[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    cpool_u, spool_u = cpool.clone(), spool.clone()
    for s in range(3):
        x.copy_(conv_inputs(B, C, dtype=torch.bfloat16, seed=20 + s)[0])
        graph.replay()
        y = conv_k.conv1d_update(x, w, None, cpool_u, slots, rows, 1, True)
        key = Hk * dk
        o_u = gdn.gdn_recurrent_update(y[:, :key].view(B, Hk, dk), y[:, key:2 * key].view(B, Hk, dk),
                                       y[:, 2 * key:].view(B, Hv, dv), a, bb, spool_u, slots, rows, 1, True, **kw)
        torch.testing.assert_close(out[:2], o_u[:2], **BF16_TOL)
        assert torch.equal(cpool[1:], cpool_u[1:])
        torch.testing.assert_close(spool[1:], spool_u[1:], atol=1e-4, rtol=1e-4)
        assert torch.count_nonzero(arrivals) == 0


@needs_cuda
def test_gpu_out_norm_gemv_qwen36_bf16():
    o, z, nw, w, _ = _out_inputs(32, 128, 2048, torch.bfloat16)
    got = gdn_out_gemv.gdn_out_norm_gemv(o, z, nw, 1e-6, w)
    torch.testing.assert_close(got, ref.gdn_out_norm_gemv_ref(o, z, nw, 1e-6, w), **BF16_TOL)
