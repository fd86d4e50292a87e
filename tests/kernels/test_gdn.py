"""Gated-delta-net kernels (`kernels/gdn.py`) and their plain-torch references (`kernels/gdn_ref.py`); the
causal conv1d alone is in test_causal_conv1d.py.

The references are checked against transformers' qwen3_next torch path (the math the models must
match), the chunked form against the token loop, the varlen/update forms against one sequence at a
time. The Triton kernels are checked against the references under the interpreter on CPU (fp32, a
little fp16: the interpreter's bf16 is broken) with ragged shapes, and compiled on a GPU host, where
the CUDA-only tests add bf16 activations, Qwen3.6 shapes and a CUDA-graph capture/replay.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

# first: gdn_cases keeps transformers off fla / causal_conv1d (their CUDA-only kernels)
from tests.kernels.gdn_cases import (
    DEV, K_CONV, NUM_ROWS, R_ROWS, SLOTS, TOL, UPD_SLOTS, _gen, _hf_gdn, _update_case, conv_inputs, cu, gate_inputs,
    gdn_inputs, hf, ids, needs_cuda, state_pool,
)
from freetoken_core.kernels import causal_conv1d as conv_k  # noqa: E402
from freetoken_core.kernels import causal_conv1d_ref as conv_ref  # noqa: E402
from freetoken_core.kernels import gdn  # noqa: E402
from freetoken_core.kernels import gdn_ref as ref  # noqa: E402


# ------------------------------------------------------------------------- references vs transformers


def test_l2norm_matches_transformers():
    x = torch.randn(5, 3, 24, generator=_gen(0))
    torch.testing.assert_close(ref.l2norm(x), hf.l2norm(x), atol=0, rtol=0)


@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_ref_matches_transformers(with_state):
    q, k, v, g, beta = gdn_inputs(9, device="cpu")
    s0 = state_pool(device="cpu")[3] if with_state else None
    o, s = ref.recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
    o_hf, s_hf = _hf_gdn(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_hf, **TOL)
    torch.testing.assert_close(s, s_hf, **TOL)


@pytest.mark.parametrize("T", [1, 37, 70])
def test_chunk_ref_matches_transformers(T):
    q, k, v, g, beta = gdn_inputs(T, device="cpu")
    s0 = state_pool(device="cpu")[2]
    o, s = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=16)
    o_hf, s_hf = _hf_gdn(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=16)
    torch.testing.assert_close(o, o_hf, **TOL)
    torch.testing.assert_close(s, s_hf, **TOL)


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (64, 64), (100, 64), (37, 16), (48, 16)])
def test_chunk_equals_recurrent(T, chunk):
    q, k, v, g, beta = gdn_inputs(T, dk=32, dv=16, device="cpu", seed=T)
    s0 = state_pool(dk=32, dv=16, device="cpu")[1]
    o_c, s_c = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=chunk)
    o_r, s_r = ref.recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, None])
def test_varlen_ref_matches_per_sequence(chunk_size):
    lens, slots, fresh = [7, 2, 0, 13], [3, 6, 1, 5], [False, True, True, False]
    q, k, v, g, beta = gdn_inputs(sum(lens), device="cpu")
    pool = state_pool(device="cpu")
    before = pool.clone()
    o = ref.gdn_varlen_ref(q, k, v, g, beta, cu(lens, "cpu"), pool, ids(slots, "cpu"), ids(fresh, "cpu", torch.bool),
                           chunk_size=chunk_size)
    start = 0
    for n, slot, z in zip(lens, slots, fresh):
        rows = (x[start:start + n] for x in (q, k, v, g, beta))
        o_i, s_i = ref.recurrent_gated_delta_rule_ref(*rows, state=None if z else before[slot])
        torch.testing.assert_close(o[start:start + n], o_i, **TOL)
        torch.testing.assert_close(pool[slot], s_i, **TOL)
        start += n
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


# The R-row update references against the varlen ones: outputs of all R rows from the slot's state,
# and (write_state) the state after the first num_rows rows.


def test_gdn_update_ref_matches_varlen():
    B = len(NUM_ROWS)
    q, k, v, g, beta = gdn_inputs(B * R_ROWS, device="cpu")
    pool = state_pool(device="cpu")
    before = pool.clone()
    o = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool, ids(UPD_SLOTS, "cpu"), ids(NUM_ROWS, "cpu"), R_ROWS)
    for i, (n, slot) in enumerate(zip(NUM_ROWS, UPD_SLOTS)):
        rows = [x[i * R_ROWS:(i + 1) * R_ROWS] for x in (q, k, v, g, beta)]
        o_i, _ = ref.recurrent_gated_delta_rule_ref(*rows, state=before[slot])
        _, s_i = ref.recurrent_gated_delta_rule_ref(*(x[:n] for x in rows), state=before[slot])
        torch.testing.assert_close(o[i * R_ROWS:(i + 1) * R_ROWS], o_i, **TOL)
        torch.testing.assert_close(pool[slot], s_i, **TOL)


def test_gating_ref_matches_transformers():
    """transformers' Qwen3NextGatedDeltaNet: beta = b.sigmoid(),
    g = -A_log.float().exp() * softplus(a.float() + dt_bias)."""
    for dtype in (torch.float32, torch.bfloat16):
        a, b, A_log, dt_bias, _, _ = gate_inputs(5, dtype=dtype, device="cpu")
        g, beta = ref.gdn_gating_ref(a, b, A_log, dt_bias)
        assert g.dtype == torch.float32 and beta.dtype == dtype
        torch.testing.assert_close(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias), atol=0, rtol=0)
        torch.testing.assert_close(beta, b.sigmoid(), atol=0, rtol=0)


def test_gated_rmsnorm_ref_matches_transformers():
    for dtype in (torch.float32, torch.bfloat16):
        _, _, _, _, w, z = gate_inputs(3, dtype=dtype, device="cpu")
        x = torch.randn(3, 4, 16, generator=_gen(1)).to(dtype)
        norm = hf.Qwen3NextRMSNormGated(16, eps=1e-6).to(dtype)
        norm.weight.data.copy_(w)
        torch.testing.assert_close(ref.gated_rmsnorm_ref(x, z, w, 1e-6), norm(x, z), atol=0, rtol=0)


def test_update_ref_with_gating_and_out_norm_is_the_unfused_sequence():
    B = len(NUM_ROWS)
    q, k, v, _, _ = gdn_inputs(B * R_ROWS, device="cpu")
    a, b, A_log, dt_bias, w, z = gate_inputs(B * R_ROWS, device="cpu")
    pool, pool2 = state_pool(device="cpu"), state_pool(device="cpu")
    args = (ids(UPD_SLOTS, "cpu"), ids(NUM_ROWS, "cpu"), R_ROWS)
    got = ref.gdn_recurrent_update_ref(q, k, v, a, b, pool, *args, gating=(A_log, dt_bias), out_norm=(w, z, 1e-6))
    g, beta = ref.gdn_gating_ref(a, b, A_log, dt_bias)
    o = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool2, *args)
    torch.testing.assert_close(got, ref.gated_rmsnorm_ref(o, z, w, 1e-6), atol=0, rtol=0)
    assert torch.equal(pool, pool2)


def test_bf16_state_pool_ref():
    """A bf16 pool: loaded to fp32, computed in fp32, stored rounded (CPU torch bf16 is exact)."""
    B = len(NUM_ROWS)
    q, k, v, g, beta = gdn_inputs(B * R_ROWS, device="cpu")
    pool16 = state_pool(device="cpu").to(torch.bfloat16)
    pool32 = pool16.float()
    slots, n = ids(UPD_SLOTS, "cpu"), ids(NUM_ROWS, "cpu")
    o16 = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool16, slots, n, R_ROWS)
    o32 = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool32, slots, n, R_ROWS)
    assert pool16.dtype == torch.bfloat16
    torch.testing.assert_close(o16, o32, atol=0, rtol=0)  # same fp32 start, so the same outputs
    assert torch.equal(pool16, pool32.to(torch.bfloat16))  # and the state rounded once
    lens = [5, 2, 9]
    q, k, v, g, beta = gdn_inputs(sum(lens), device="cpu", seed=3)
    p16 = pool16.clone()
    p32 = p16.float()
    o16 = ref.gdn_varlen_ref(q, k, v, g, beta, cu(lens, "cpu"), p16, ids([1, 4, 6], "cpu"))
    o32 = ref.gdn_varlen_ref(q, k, v, g, beta, cu(lens, "cpu"), p32, ids([1, 4, 6], "cpu"))
    torch.testing.assert_close(o16, o32, atol=0, rtol=0)
    assert torch.equal(p16, p32.to(torch.bfloat16))


# ------------------------------------------------------------------- Triton kernels vs references


@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("write_state", [True, False])
@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 32), (24, 40)])
def test_gdn_recurrent_update_kernel(R, write_state, dk, dv):
    slots, num_rows = _update_case(R)
    B = len(slots)
    q, k, v, g, beta = gdn_inputs(B * R, dk=dk, dv=dv, seed=R + dk)
    pool = state_pool(dk=dk, dv=dv)
    pool_ref, before = pool.clone(), pool.clone()
    args = (ids(slots), ids(num_rows), R, write_state)
    o = gdn.gdn_recurrent_update(q, k, v, g, beta, pool, *args)
    o_ref = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool_ref, *args)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)
    if not write_state:
        assert torch.equal(pool, before)


@pytest.mark.parametrize("R,write_state", [(1, True), (4, True), (4, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_v", [None, 32])  # dv = 24: BV 8 (a separate norm launch) or 32 (fused epilogue)
def test_gdn_update_kernel_gating_and_out_norm(R, write_state, dtype, block_v):
    """Raw a, b gated in the kernel and the gated output norm, fused (one program per head) or not."""
    slots, num_rows = _update_case(R)
    B, Hv, dk, dv = len(slots), 4, 16, 24
    q, k, v, _, _ = gdn_inputs(B * R, dk=dk, dv=dv, dtype=dtype, seed=R)
    a, b, A_log, dt_bias, w, z = gate_inputs(B * R, Hv, dv, dtype=dtype)
    zs = torch.cat([z, z], dim=-1)[..., :dv]  # a strided view, as the model's slice of in_proj_qkvz
    pool = state_pool(dk=dk, dv=dv)
    pool_ref = pool.clone()
    args = (ids(slots), ids(num_rows), R, write_state)
    kw = dict(gating=(A_log, dt_bias), out_norm=(w, zs, 1e-6))
    o = gdn.gdn_recurrent_update(q, k, v, a, b, pool, *args, **kw, block_v=block_v or 8)
    o_ref = ref.gdn_recurrent_update_ref(q, k, v, a, b, pool_ref, *args, **kw)
    assert o.is_contiguous()
    tol = TOL if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(pool, pool_ref, **(TOL if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rmsnorm_kernel(dtype):
    T, H, D = 2, 40, 40  # D not a power of two; 32 heads per program: two head blocks, the second partial
    _, _, _, _, w, z = gate_inputs(T, H, D, dtype=dtype)
    x = torch.randn(T, H, 2 * D, generator=_gen(3)).to(DEV, dtype)[..., D:]  # strided
    got = gdn.gated_rmsnorm(x, z, w, 1e-6)
    assert got.is_contiguous() and got.shape == (T, H, D)
    want = ref.gated_rmsnorm_ref(x, z, w, 1e-6)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    flat = gdn.gated_rmsnorm(x[0], z[0], w, 1e-6)  # [N, D] rows: one head each
    torch.testing.assert_close(flat, want[0], **tol)


def test_gdn_varlen_kernel_gating_and_out_norm():
    lens, slots, fresh = [5, 0, 3], [3, 6, 1], [False, True, True]
    q, k, v, _, _ = gdn_inputs(sum(lens), dk=16, dv=16)
    a, b, A_log, dt_bias, w, z = gate_inputs(sum(lens), 4, 16)
    pool = state_pool(dk=16, dv=16)
    pool_ref = pool.clone()
    seqs, slot_ids, fresh_ids = cu(lens), ids(slots), ids(fresh, dtype=torch.bool)
    kw = dict(gating=(A_log, dt_bias), out_norm=(w, z, 1e-6))
    o = gdn.gdn_varlen(q, k, v, a, b, seqs, pool, slot_ids, fresh_ids, **kw)
    o_ref = ref.gdn_varlen_ref(q, k, v, a, b, seqs, pool_ref, slot_ids, fresh_ids, chunk_size=None, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_varlen_kernel(dtype):
    lens, slots, fresh = [7, 2, 0, 13], [3, 6, 1, 5], [False, True, True, False]
    q, k, v, g, beta = gdn_inputs(sum(lens), dk=32, dv=16, dtype=dtype)
    pool = state_pool(dk=32, dv=16)
    pool_ref = pool.clone()
    seqs, slot_ids, fresh_ids = cu(lens), ids(slots), ids(fresh, dtype=torch.bool)
    o = gdn.gdn_varlen(q, k, v, g, beta, seqs, pool, slot_ids, fresh_ids)
    o_ref = ref.gdn_varlen_ref(q, k, v, g, beta, seqs, pool_ref, slot_ids, fresh_ids, chunk_size=None)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(pool, pool_ref, **TOL)


def test_gdn_kernels_take_strided_views():
    """q/k/v as slices of one fused [T, 2*Hk*dk + Hv*dv] row (the conv output), g/beta of a [T, 2*Hv] one."""
    T, Hk, Hv, dk, dv = 6, 2, 4, 16, 16
    q, k, v, g, beta = gdn_inputs(T)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs = fused[:, :Hk * dk].view(T, Hk, dk)
    ks = fused[:, Hk * dk:2 * Hk * dk].view(T, Hk, dk)
    vs = fused[:, 2 * Hk * dk:].view(T, Hv, dv)
    gb = torch.cat([g, beta], dim=1)
    pool, pool_ref = state_pool(), state_pool()
    args = (ids([2, 5, 1]), ids([2, 0, 1]), 2, True)
    o = gdn.gdn_recurrent_update(qs, ks, vs, gb[:, :Hv], gb[:, Hv:], pool, *args)
    o_ref = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool_ref, *args)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("raw_gates", [False, True])
def test_verify_then_replay_equals_sequential_decode(impl, raw_gates):
    """Speculative verify: one pass over R rows without writing, then a replay of the same inputs with
    num_rows = accepted count. Request i accepts a = i + 1 rows: every a in 1..R in one batch. The
    replay must leave exactly the state of a plain decode of the first a rows, and verify's outputs
    for those rows must be the decode's outputs."""
    R, Hk, Hv, dk, dv, C = 4, 2, 4, 16, 16, 40
    slots, accepted = ids([3, 1, 6, 4]), ids([1, 2, 3, 4])
    B = slots.shape[0]
    upd = gdn.gdn_recurrent_update if impl == "triton" else ref.gdn_recurrent_update_ref
    conv = conv_k.conv1d_update if impl == "triton" else conv_ref.conv1d_update_ref
    q, k, v, g, beta = gdn_inputs(B * R, Hk, Hv, dk, dv, seed=5)
    kw = {}
    if raw_gates:  # the layer's way: a, b of in_proj_ba, gated in the kernel (saved raw for the replay)
        g, beta, A_log, dt_bias, _, _ = gate_inputs(B * R, Hv, dv, seed=5)
        kw = dict(gating=(A_log, dt_bias))
    x, w, b, cpool = conv_inputs(B * R, C, seed=6)
    spool = state_pool(Hv, dk, dv)
    spool_seq, cpool_seq = spool.clone(), cpool.clone()
    before = (spool.clone(), cpool.clone())

    o_ver = upd(q, k, v, g, beta, spool, slots, accepted, R, False, **kw)
    y_ver = conv(x, w, b, cpool, slots, accepted, R, False)
    assert torch.equal(spool, before[0]) and torch.equal(cpool, before[1])
    upd(q, k, v, g, beta, spool, slots, accepted, R, True, **kw)
    conv(x, w, b, cpool, slots, accepted, R, True)

    for r in range(R):  # plain decode, row r of every request; requests past their count do not write
        rows = torch.arange(B, device=DEV) * R + r
        live = (accepted > r).to(torch.int32)
        o_r = upd(q[rows], k[rows], v[rows], g[rows], beta[rows], spool_seq, slots, live, 1, True, **kw)
        y_r = conv(x[rows], w, b, cpool_seq, slots, live, 1, True)
        keep = live.bool()
        torch.testing.assert_close(o_ver[rows][keep], o_r[keep], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(y_ver[rows][keep], y_r[keep], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(spool, spool_seq, atol=1e-6, rtol=1e-6)
    assert torch.equal(cpool, cpool_seq)


def test_fla_available_is_false_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert gdn.fla_available() is False
    assert "fla" not in sys.modules or sys.modules["fla"] is None


# ------------------------------------------------------------------------------------- GPU only

QWEN36 = dict(Hk=16, Hv=32, dk=128, dv=128)
QWEN36_C = 2 * 16 * 128 + 32 * 128
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("B,R", [(1, 1), (64, 1), (8, 5), (64, 4)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_update_kernels_qwen36_shapes(B, R, pool_dtype):
    slots = torch.randperm(B, generator=_gen(B)).to(DEV, torch.int32) + 1
    num_rows = torch.randint(0, R + 1, (B,), generator=_gen(R)).to(DEV, torch.int32)
    q, k, v, g, beta = gdn_inputs(B * R, **QWEN36, dtype=torch.bfloat16)
    pool = (0.5 * torch.randn(B + 1, 32, 128, 128, device=DEV)).to(pool_dtype)
    pool_ref = pool.clone()
    o = gdn.gdn_recurrent_update(q, k, v, g, beta, pool, slots, num_rows, R, True)
    o_ref = ref.gdn_recurrent_update_ref(q, k, v, g, beta, pool_ref, slots, num_rows, R, True)
    torch.testing.assert_close(o, o_ref, **BF16_TOL)
    torch.testing.assert_close(pool.float(), pool_ref.float(), atol=1e-4 if pool_dtype == torch.float32 else 2e-2,
                               rtol=1e-4 if pool_dtype == torch.float32 else 2e-2)
    x, w, b, _ = conv_inputs(B * R, QWEN36_C, dtype=torch.bfloat16, bias=False)
    cpool = torch.randn(B + 1, QWEN36_C, K_CONV - 1, device=DEV, dtype=torch.bfloat16)
    cpool_ref = cpool.clone()
    y = conv_k.conv1d_update(x, w, None, cpool, slots, num_rows, R, True)
    y_ref = conv_ref.conv1d_update_ref(x, w, None, cpool_ref, slots, num_rows, R, True)
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    assert torch.equal(cpool, cpool_ref)


@needs_cuda
@pytest.mark.parametrize("B,R", [(1, 1), (64, 1), (8, 5)])
@pytest.mark.parametrize("block_v", [None, 16, 128])  # the table's choice, a separate norm launch, the fused epilogue
def test_gpu_gating_and_out_norm_qwen36_bf16(B, R, block_v):
    """The layer's call: raw a, b and the gated output norm in the recurrence, bf16 activations."""
    slots = torch.randperm(B, generator=_gen(B)).to(DEV, torch.int32) + 1
    num_rows = torch.randint(0, R + 1, (B,), generator=_gen(R)).to(DEV, torch.int32)
    q, k, v, _, _ = gdn_inputs(B * R, **QWEN36, dtype=torch.bfloat16)
    a, b, A_log, dt_bias, w, z = gate_inputs(B * R, 32, 128, dtype=torch.bfloat16)
    pool = 0.5 * torch.randn(B + 1, 32, 128, 128, device=DEV)
    pool_ref = pool.clone()
    kw = dict(gating=(A_log, dt_bias), out_norm=(w, z, 1e-6))
    o = gdn.gdn_recurrent_update(q, k, v, a, b, pool, slots, num_rows, R, True, **kw, block_v=block_v,
                                 num_warps=None if block_v != 128 else 8)
    o_ref = ref.gdn_recurrent_update_ref(q, k, v, a, b, pool_ref, slots, num_rows, R, True, **kw)
    torch.testing.assert_close(o, o_ref, **BF16_TOL)
    torch.testing.assert_close(pool, pool_ref, atol=1e-4, rtol=1e-4)
    x = torch.randn(B * R, 32, 128, device=DEV, dtype=torch.bfloat16)
    torch.testing.assert_close(gdn.gated_rmsnorm(x, z, w, 1e-6), ref.gated_rmsnorm_ref(x, z, w, 1e-6), **BF16_TOL)


@needs_cuda
def test_gpu_varlen_kernels_bf16():
    lens, slots, fresh = [300, 1, 2, 1000], [1, 2, 3, 4], [True, False, False, True]
    q, k, v, g, beta = gdn_inputs(sum(lens), **QWEN36, dtype=torch.bfloat16)
    pool = 0.5 * torch.randn(5, 32, 128, 128, device=DEV)
    pool_ref = pool.clone()
    seqs, slot_ids, fresh_ids = cu(lens), ids(slots), ids(fresh, dtype=torch.bool)
    o = gdn.gdn_varlen(q, k, v, g, beta, seqs, pool, slot_ids, fresh_ids)
    o_ref = ref.gdn_varlen_ref(q, k, v, g, beta, seqs, pool_ref, slot_ids, fresh_ids)  # the chunked form
    torch.testing.assert_close(o, o_ref, **BF16_TOL)
    torch.testing.assert_close(pool, pool_ref, atol=1e-3, rtol=1e-3)
    x, w, b, _ = conv_inputs(sum(lens), QWEN36_C, dtype=torch.bfloat16)
    cpool = torch.randn(5, QWEN36_C, K_CONV - 1, device=DEV, dtype=torch.bfloat16)
    cpool_ref = cpool.clone()
    y = conv_k.causal_conv1d_varlen(x, w, b, seqs, cpool, slot_ids, fresh_ids)
    y_ref = conv_ref.causal_conv1d_varlen_ref(x, w, b, seqs, cpool_ref, slot_ids, fresh_ids)
    torch.testing.assert_close(y, y_ref, **BF16_TOL)
    assert torch.equal(cpool, cpool_ref)


@needs_cuda
@pytest.mark.parametrize("R,write_state", [(1, True), (4, False), (4, True)])
def test_gpu_update_kernels_in_cuda_graph(R, write_state):
    """Captured once with static buffers; replayed with new inputs, slots and counts copied in."""
    B = 16
    q, k, v, _, _ = gdn_inputs(B * R, **QWEN36, dtype=torch.bfloat16)
    g, beta, A_log, dt_bias, nw, z = gate_inputs(B * R, 32, 128, dtype=torch.bfloat16)  # raw a, b: the layer's call
    x, w, _, _ = conv_inputs(B * R, QWEN36_C, dtype=torch.bfloat16, bias=False)
    static = [t.clone() for t in (q, k, v, g, beta, x)]
    kw = dict(gating=(A_log, dt_bias), out_norm=(nw, z, 1e-6))
    slots = torch.arange(1, B + 1, device=DEV, dtype=torch.int32)
    num_rows = torch.full((B,), R, device=DEV, dtype=torch.int32)
    pool = torch.randn(2 * B + 1, 32, 128, 128, device=DEV) * 0.5
    cpool = torch.randn(2 * B + 1, QWEN36_C, K_CONV - 1, device=DEV, dtype=torch.bfloat16)

    def step():
        y = conv_k.conv1d_update(static[5], w, None, cpool, slots, num_rows, R, write_state)
        o = gdn.gdn_recurrent_update(*static[:5], pool, slots, num_rows, R, write_state, **kw)
        return o, y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture, on scratch copies of the pools
        saved = (pool.clone(), cpool.clone())
        step()
        pool.copy_(saved[0])
        cpool.copy_(saved[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    new = (*gdn_inputs(B * R, **QWEN36, dtype=torch.bfloat16, seed=9)[:3],
           *gate_inputs(B * R, 32, 128, dtype=torch.bfloat16, seed=9)[:2])
    new_x = conv_inputs(B * R, QWEN36_C, dtype=torch.bfloat16, seed=9)[0]
    for t, n in zip(static, (*new, new_x)):
        t.copy_(n)
    slots.copy_(torch.randperm(2 * B, generator=_gen(3))[:B].to(DEV, torch.int32) + 1)
    num_rows.copy_(torch.randint(0, R + 1, (B,), generator=_gen(4)).to(DEV, torch.int32))
    pool_ref, cpool_ref = pool.clone(), cpool.clone()
    graph.replay()
    o_ref = ref.gdn_recurrent_update_ref(*new, pool_ref, slots, num_rows, R, write_state, **kw)
    y_ref = conv_ref.conv1d_update_ref(new_x, w, None, cpool_ref, slots, num_rows, R, write_state)
    torch.testing.assert_close(out[0], o_ref, **BF16_TOL)
    torch.testing.assert_close(out[1], y_ref, **BF16_TOL)
    torch.testing.assert_close(pool, pool_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(cpool, cpool_ref)
