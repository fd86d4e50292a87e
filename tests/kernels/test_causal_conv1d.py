"""The causal depthwise conv1d of gated-delta-net layers: the references (`kernels/causal_conv1d_ref.py`)
against transformers' qwen3_next torch path and against each other (update vs varlen), and the Triton
kernels (`kernels/causal_conv1d.py`) against the references (interpreter on CPU, compiled on a GPU host).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# first: gdn_cases keeps transformers off fla / causal_conv1d (their CUDA-only kernels)
from tests.kernels.gdn_cases import K_CONV, NUM_ROWS, R_ROWS, TOL, UPD_SLOTS, _update_case, conv_inputs, cu, hf, ids
from freetoken_core.kernels import causal_conv1d as conv_k  # noqa: E402
from freetoken_core.kernels import causal_conv1d_ref as conv_ref  # noqa: E402


def test_conv_varlen_ref_matches_transformers():
    lens, slots, fresh = [6, 2, 11], [4, 2, 7], [True, False, False]  # 2 < K-1: the state shifts
    C = 24
    x, w, b, pool = conv_inputs(sum(lens), C, device="cpu")
    before = pool.clone()
    y = conv_ref.causal_conv1d_varlen_ref(x, w, b, cu(lens, "cpu"), pool, ids(slots, "cpu"),
                                          ids(fresh, "cpu", torch.bool))
    start = 0
    for n, slot, z in zip(lens, slots, fresh):
        xs = x[start:start + n].t()[None]  # [1, C, n]
        if z:
            y_hf = hf.causal_conv1d_fn(xs, w, b, activation="silu")
            state_hf = F.pad(xs, (K_CONV - 1, 0))[..., -(K_CONV - 1):]
        else:
            state_hf = before[slot][None].clone()
            y_hf = hf.causal_conv1d_update(xs, state_hf, w, b, activation="silu")
        torch.testing.assert_close(y[start:start + n], y_hf[0].t(), **TOL)
        torch.testing.assert_close(pool[slot], state_hf[0], atol=0, rtol=0)
        start += n


def test_conv_update_ref_decode_matches_transformers():
    C, B, steps = 24, 3, 5
    x, w, b, pool = conv_inputs(B * steps, C, device="cpu")
    slots = ids([5, 1, 3], "cpu")
    state_hf = pool[slots].clone()
    for t in range(steps):
        xt = x[t * B:(t + 1) * B]
        y = conv_ref.conv1d_update_ref(xt, w, b, pool, slots, ids([1] * B, "cpu"), 1)
        y_hf = hf.causal_conv1d_update(xt[:, :, None], state_hf, w, b, activation="silu")
        torch.testing.assert_close(y, y_hf[:, :, 0], **TOL)
        torch.testing.assert_close(pool[slots], state_hf, atol=0, rtol=0)


def test_conv_update_ref_matches_varlen():
    B, C = len(NUM_ROWS), 24
    x, w, b, pool = conv_inputs(B * R_ROWS, C, device="cpu")
    pool_v = pool.clone()
    y = conv_ref.conv1d_update_ref(x, w, b, pool, ids(UPD_SLOTS, "cpu"), ids(NUM_ROWS, "cpu"), R_ROWS)
    y_v = conv_ref.causal_conv1d_varlen_ref(x, w, b, cu([R_ROWS] * B, "cpu"), pool_v.clone(), ids(UPD_SLOTS, "cpu"))
    torch.testing.assert_close(y, y_v, **TOL)
    conv_ref.causal_conv1d_varlen_ref(x[[i * R_ROWS + r for i, n in enumerate(NUM_ROWS) for r in range(n)]], w, b,
                                 cu(NUM_ROWS, "cpu"), pool_v, ids(UPD_SLOTS, "cpu"))
    assert torch.equal(pool, pool_v)


@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("write_state", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_update_kernel(R, write_state, bias):
    slots, num_rows = _update_case(R)
    C = 72  # two channel blocks, the second partly masked
    x, w, b, pool = conv_inputs(len(slots) * R, C, bias=bias, seed=R)
    pool_ref, before = pool.clone(), pool.clone()
    args = (ids(slots), ids(num_rows), R, write_state)
    y = conv_k.conv1d_update(x, w, b, pool, *args)
    y_ref = conv_ref.conv1d_update_ref(x, w, b, pool_ref, *args)
    torch.testing.assert_close(y, y_ref, **TOL)
    assert torch.equal(pool, pool_ref)  # the state is a copy of inputs: exact
    if not write_state:
        assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_varlen_kernel(dtype):
    lens, slots, fresh = [6, 2, 0, 11], [4, 2, 3, 7], [True, False, True, False]  # T = 19: two token blocks
    C = 72
    x, w, b, pool = conv_inputs(sum(lens), C, dtype=dtype)
    pool_ref = pool.clone()
    seqs, slot_ids, fresh_ids = cu(lens), ids(slots), ids(fresh, dtype=torch.bool)
    y = conv_k.causal_conv1d_varlen(x, w, b, seqs, pool, slot_ids, fresh_ids)
    y_ref = conv_ref.causal_conv1d_varlen_ref(x, w, b, seqs, pool_ref, slot_ids, fresh_ids)
    tol = TOL if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(y, y_ref, **tol)
    assert torch.equal(pool, pool_ref)
