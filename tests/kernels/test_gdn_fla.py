"""GDN prefill through fla-core (kernels/gdn_fla.py): the dispatcher falls back to our token-loop kernel,
saying why, wherever fla cannot run (always in the CPU test venv, which must not have fla); on a GPU
host with fla-core installed, fla's chunked kernel with our slot pools must equal the reference
(outputs and the states left in the slots) and pass the dispatcher's self-check."""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest
import torch

# first: gdn_cases keeps transformers off fla / causal_conv1d (their CUDA-only kernels)
from tests.kernels.gdn_cases import DEV, TOL, cu, gate_inputs, gdn_inputs, ids, state_pool
from freetoken_core.env import KernelEnv  # noqa: E402
from freetoken_core.kernels import gdn_fla  # noqa: E402
from freetoken_core.kernels import gdn_ref as ref  # noqa: E402

LENS, SLOTS_, FRESH = [7, 2, 13], [3, 6, 5], [False, True, False]


def _case(dtype=torch.float32, device=DEV, Hk=2, Hv=4, dk=16, dv=16, lens=LENS, slots=SLOTS_, fresh=FRESH):
    q, k, v, _, _ = gdn_inputs(sum(lens), Hk, Hv, dk, dv, dtype=dtype, device=device)
    a, b, A_log, dt_bias, w, z = gate_inputs(sum(lens), Hv, dv, dtype=dtype, device=device)
    pool = state_pool(Hv, dk, dv, device=device)
    if device != DEV:
        pool = pool.to(device)
    args = (q, k, v, a, b, cu(lens, device), pool, ids(slots, device), ids(fresh, device, torch.bool))
    return args, dict(gating=(A_log, dt_bias), out_norm=(w, z, 1e-6))


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / y.float().norm())


def test_prefill_falls_back_to_our_kernel_and_says_why(caplog, monkeypatch):
    """Without fla (CPU, or a CUDA host without the `gpu` extra) or with FREETOKEN_FLA_PREFILL=0,
    gdn_prefill is gdn.gdn_varlen exactly: the reference's token loop."""
    if gdn_fla.gdn.fla_available():
        pytest.skip("fla-core runs here: the fallback is the switch's, tested below")
    args, kw = _case()
    pool_ref = args[6].clone()
    monkeypatch.setattr(gdn_fla, "FLA_MIN_ROWS", 0)  # a prefill long enough to ask for fla
    gdn_fla._say_once.cache_clear()
    with caplog.at_level(logging.INFO, logger=gdn_fla.__name__):
        o = gdn_fla.gdn_prefill(*args, **kw)
    assert "fla-core is not installed" in caplog.text
    o_ref = ref.gdn_varlen_ref(*args[:6], pool_ref, *args[7:], chunk_size=None, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(args[6], pool_ref, **TOL)

    monkeypatch.setattr(gdn_fla, "kernel_env", lambda: KernelEnv(fla_prefill=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=gdn_fla.__name__):
        assert not gdn_fla.fla_prefill_usable(args[0], args[2], args[6])
    assert "FREETOKEN_FLA_PREFILL=0" in caplog.text


def test_the_switch_is_declared_and_on_by_default():
    assert KernelEnv().fla_prefill is True and KernelEnv.variable("fla_prefill") == "FREETOKEN_FLA_PREFILL"


@pytest.fixture
def real_fla():
    """fla importable for one test on a GPU host: gdn_cases blocked it (sys.modules["fla"] = None) so that
    transformers' reference stays on its torch path; that module was imported already, so lifting the
    block here changes nothing for it. The block is put back afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    saved = {n: m for n, m in sys.modules.items() if n == "fla" or n.startswith("fla.")}
    for n in saved:
        del sys.modules[n]
    if importlib.util.find_spec("fla") is None:
        sys.modules.update(saved)
        pytest.skip("fla-core is not installed (pip install -e '.[gpu]')")
    gdn_fla.gdn.fla_available.cache_clear()
    yield
    for n in [n for n in sys.modules if n == "fla" or n.startswith("fla.")]:
        del sys.modules[n]
    sys.modules.update(saved)
    gdn_fla.gdn.fla_available.cache_clear()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_fla_prefill_equals_the_reference_qwen36_bf16(real_fla, pool_dtype):
    lens, slots, fresh = [300, 1, 2, 1000], [1, 2, 3, 4], [True, False, False, True]
    args, kw = _case(torch.bfloat16, "cuda", Hk=16, Hv=32, dk=128, dv=128, lens=lens, slots=slots, fresh=fresh)
    pool = args[6].to(pool_dtype)
    pool_ref = pool.clone()
    o = gdn_fla.fla_gdn_varlen(*args[:6], pool, *args[7:], **kw)
    o_ref = ref.gdn_varlen_ref(*args[:6], pool_ref, *args[7:], **kw)
    assert _rel(o, o_ref) < 1e-2
    assert _rel(pool[args[7]], pool_ref[args[7]]) < 1e-2
    untouched = [i for i in range(pool.shape[0]) if i not in slots]
    assert torch.equal(pool[untouched], pool_ref[untouched])


def test_gpu_dispatcher_takes_fla_after_its_self_check(real_fla, caplog):
    args, kw = _case(torch.bfloat16, "cuda", Hk=16, Hv=32, dk=128, dv=128, lens=[600, 1, 40])
    gdn_fla._fla_agrees.cache_clear()
    with caplog.at_level(logging.INFO, logger=gdn_fla.__name__):
        assert gdn_fla.fla_prefill_usable(args[0], args[2], args[6])
    assert "using fla-core's chunked kernel" in caplog.text
    pool_a, pool_b = args[6].clone(), args[6].clone()
    o = gdn_fla.gdn_prefill(*args[:6], pool_a, *args[7:], **kw)
    o_fla = gdn_fla.fla_gdn_varlen(*args[:6], pool_b, *args[7:], **kw)
    assert torch.equal(o, o_fla) and torch.equal(pool_a, pool_b)
    # a short step (decode rows mixed in, a small chunk) stays on our kernel
    short, kw = _case(torch.bfloat16, "cuda", Hk=16, Hv=32, dk=128, dv=128, lens=[5, 1, 9])
    pool_c, pool_d = short[6].clone(), short[6].clone()
    o_short = gdn_fla.gdn_prefill(*short[:6], pool_c, *short[7:], **kw)
    o_ours = gdn_fla.gdn.gdn_varlen(*short[:6], pool_d, *short[7:], **kw)
    assert torch.equal(o_short, o_ours) and torch.equal(pool_c, pool_d)
