"""Shared inputs of the gated-delta-net kernel tests (test_gdn.py, test_causal_conv1d.py): random
inputs of the recurrence, the gates and the conv, slot pools, and transformers' qwen3_next module
(its torch path: the math the models must match)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

# Installed, fla / causal_conv1d make transformers take their (CUDA-only) kernels: force its torch path.
for _name in ("fla", "causal_conv1d"):
    if _name not in sys.modules and importlib.util.find_spec(_name) is not None:
        sys.modules[_name] = None

from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402,F401  (the tests' reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # kernels: interpreted on CPU, compiled on a GPU host
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
K_CONV = 4
SLOTS = 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gdn_inputs(T: int, Hk: int = 2, Hv: int = 4, dk: int = 16, dv: int = 16, dtype=torch.float32,
               device: str = DEV, seed: int = 0):
    """q, k, v in `dtype`, g fp32 (as the model computes it), beta in `dtype`; g spans weak to strong decay."""
    gen = _gen(seed)
    q, k = torch.randn(T, Hk, dk, generator=gen), torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen) * 2.0)
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    return (*(x.to(device, dtype) for x in (q, k, v)), g.to(device), beta.to(device, dtype))


def gate_inputs(T: int, Hv: int = 4, dv: int = 16, dtype=torch.float32, device: str = DEV, seed: int = 7):
    """in_proj_ba's raw a, b [T, Hv] (a spans softplus's threshold and its log1p tail), A_log and
    dt_bias [Hv], and the output norm's weight [dv] and gate z [T, Hv, dv]."""
    gen = _gen(seed)
    a = torch.randn(T, Hv, generator=gen) * 8.0
    a[0, 0], a[-1, -1] = 25.0, -40.0
    b = torch.randn(T, Hv, generator=gen) * 2.0
    A_log = torch.rand(Hv, generator=gen).mul(16).add(0.01).log()
    dt_bias = torch.randn(Hv, generator=gen)
    w = 1 + 0.3 * torch.randn(dv, generator=gen)
    z = torch.randn(T, Hv, dv, generator=gen)
    return tuple(x.to(device, dtype) for x in (a, b, A_log, dt_bias, w, z))


def state_pool(Hv: int = 4, dk: int = 16, dv: int = 16, dtype=torch.float32, device: str = DEV, seed: int = 1):
    return (0.5 * torch.randn(SLOTS, Hv, dk, dv, generator=_gen(seed))).to(device, dtype)


def conv_inputs(T: int, C: int, dtype=torch.float32, device: str = DEV, seed: int = 2, bias: bool = True):
    gen = _gen(seed)
    x = torch.randn(T, C, generator=gen).to(device, dtype)
    w = (0.5 * torch.randn(C, K_CONV, generator=gen)).to(device, dtype)
    b = (0.5 * torch.randn(C, generator=gen)).to(device, dtype) if bias else None
    pool = torch.randn(SLOTS, C, K_CONV - 1, generator=gen).to(device, dtype)
    return x, w, b, pool


def cu(lens: list[int], device: str = DEV) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def ids(values: list, device: str = DEV, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, device=device, dtype=dtype)


def _hf_gdn(fn, q, k, v, g, beta, state, **kw):
    # q/k repeated to the value heads here: transformers 5.24 repeats inside, 5.17 (the GPU host) in the layer
    rep = v.shape[-2] // q.shape[-2]
    q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    o, s = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
              output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return o[0], s[0]


TOL = dict(atol=2e-5, rtol=2e-5)
# decode / verify cases: R rows per request, rows each request keeps, its slot
R_ROWS, NUM_ROWS, UPD_SLOTS = 4, [0, 4, 1, 3], [2, 7, 0, 5]


def _update_case(R: int):
    # R = 1: plain decode, a padded request on the dummy slot 0; R = 4: every num_rows in 0..R
    if R == 1:
        return [3, 0, 6], [1, 0, 1]
    return UPD_SLOTS, NUM_ROWS
