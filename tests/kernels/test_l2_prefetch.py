"""The L2 prefetch from the batch-1 norm + GEMV (kernels/l2_prefetch.py, FREETOKEN_L2_PREFETCH).

CPU: when a launch prefetches (never on the CPU or with the switch off), the kernel arguments, which layers
prefetch what (`plan_l2_prefetch`), and the whole compile of the prefetching helper for sm_90 (Triton -> PTX
-> ptxas, no GPU needed). The norm + GEMV kernel's PREFETCH branch also passes the sm_90 frontend with every
recorded launch (tests/sm90_frontend.py). GPU (skipped without CUDA): bit-identical GEMV results and greedy
output with the prefetch on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from freetoken_core.env import KernelEnv, kernel_env
from freetoken_core.kernels import l2_prefetch
from freetoken_core.models.blocks import Attention, DecoderLayer, plan_l2_prefetch
from freetoken_core.models.loader import load_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _prefetch(monkeypatch, on: bool):
    """FREETOKEN_L2_PREFETCH set for the block, the default restored after."""
    try:
        with monkeypatch.context() as m:
            m.setenv(KernelEnv.variable("l2_prefetch"), "1" if on else "0")
            kernel_env.cache_clear()
            yield
    finally:
        kernel_env.cache_clear()


def test_no_prefetch_on_the_cpu_or_without_a_weight(monkeypatch):
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with _prefetch(monkeypatch, True):
        assert kernel_env().l2_prefetch
        assert l2_prefetch.prefetch_target(w, x) is None  # CPU (and the interpreter has no inline PTX)
        assert l2_prefetch.prefetch_target(None, x) is None


@needs_cuda
def test_prefetch_target_on_cuda(monkeypatch):
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(256, 64, dtype=torch.bfloat16, device="cuda")
    with _prefetch(monkeypatch, False):
        assert l2_prefetch.prefetch_target(w, x) is None
    with _prefetch(monkeypatch, True):
        t = l2_prefetch.prefetch_target(w, x)
        if torch.cuda.get_device_capability()[0] < 9:
            assert t is None
            return
        assert t is not None and t.dtype == torch.uint8 and t.numel() == w.numel() * 2
        assert t.data_ptr() == w.data_ptr()
        assert l2_prefetch.prefetch_target(w.t(), x) is None  # not one block of rows
        big = torch.cuda.get_device_properties(0).L2_cache_size  # bytes: bf16 elements of twice the L2
        assert l2_prefetch.prefetch_target(torch.empty(big, dtype=torch.bfloat16, device="cuda"), x) is None


def test_no_expert_prefetch_on_the_cpu(monkeypatch):
    w2 = torch.zeros(4, 64, 32, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with _prefetch(monkeypatch, True):
        assert l2_prefetch.expert_rows_target(w2, x, 2) is None
        assert l2_prefetch.expert_rows_target(None, x, 2) is None


@needs_cuda
def test_expert_rows_target_on_cuda(monkeypatch):
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
    w2 = torch.zeros(16, 64, 32, dtype=torch.bfloat16, device="cuda")
    with _prefetch(monkeypatch, False):
        assert l2_prefetch.expert_rows_target(w2, x, 8) is None
    with _prefetch(monkeypatch, True):
        t = l2_prefetch.expert_rows_target(w2, x, 8)
        if torch.cuda.get_device_capability()[0] < 9:
            assert t is None
            return
        assert t is not None and t.numel() == w2.numel() * 2 and t.data_ptr() == w2.data_ptr()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        too_many_routes = l2 // (64 * 32 * 2) + 1  # their blocks together would fill the whole L2
        assert l2_prefetch.expert_rows_target(w2, x, too_many_routes) is None


@needs_cuda
def test_fused_moe_decode_is_bit_identical_with_the_down_prefetch(monkeypatch):
    from freetoken_core.kernels.moe_gemv import fused_moe_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 64, 2048, 768, 8
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ids = torch.randperm(e, device="cuda", generator=g)[:k].to(torch.int32).view(1, k)
    weights = torch.rand(1, k, device="cuda", generator=g)
    want = fused_moe_decode(x, w13, w2, weights, ids)
    with _prefetch(monkeypatch, True):
        got = fused_moe_decode(x, w13, w2, weights, ids)
    assert torch.equal(got, want)


@needs_cuda
def test_prefix_target_keeps_what_half_the_l2_holds(monkeypatch):
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    big = torch.empty(l2, dtype=torch.bfloat16, device="cuda")  # twice the L2
    small = torch.empty(1024, 64, dtype=torch.bfloat16, device="cuda")
    with _prefetch(monkeypatch, True):
        if torch.cuda.get_device_capability()[0] < 9:
            assert l2_prefetch.prefix_target(big, x) is None
            return
        t = l2_prefetch.prefix_target(big, x)
        assert t is not None and t.data_ptr() == big.data_ptr() and t.numel() == int(0.5 * l2) // 16 * 16
        assert l2_prefetch.prefix_target(small, x).numel() == small.numel() * 2


@needs_cuda
def test_topk_is_identical_with_the_prefetch(monkeypatch):
    from freetoken_core.kernels.moe_router import topk_softmax

    logits = torch.randn(1, 129, device="cuda")
    nxt = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16)
    want = topk_softmax(logits, 8, True, shared_expert=True)
    with _prefetch(monkeypatch, True):
        got = topk_softmax(logits, 8, True, shared_expert=True, prefetch=nxt)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_launch_args():
    y = torch.zeros(1)
    off = l2_prefetch.launch_args(None, y)
    assert off["pf_ptr"] is y and off["pf_bytes"] == 0 and off["PREFETCH"] is False
    t = torch.zeros(100, dtype=torch.uint8)
    on = l2_prefetch.launch_args(t, y)
    assert on["pf_ptr"] is t and on["pf_bytes"] == 96 and on["PREFETCH"] is True  # whole 16-byte pieces only


@pytest.mark.parametrize("kind", ["llama", "qwen3_5_moe"])
def test_each_layer_prefetches_its_own_output_projection(tmp_path, kind):
    if kind == "llama":
        from tests.conftest import make_tiny_model

        path = make_tiny_model(tmp_path)
    else:
        from tests.models.hybrid_checkpoints import make_tiny_hybrid

        path = make_tiny_hybrid(tmp_path, kind)
    model = load_model(str(path), torch.float32, "cpu", progress=False)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert all(layer.mixer.in_proj.l2_prefetch is None for layer in layers)
    shared = [layer.mlp for layer in layers if hasattr(layer.mlp, "shared_expert")]
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "next_weight_prefetch")]
    assert plan_l2_prefetch(model) == len(layers) + len(shared) + len([i for i in moe if i + 1 < len(layers)]) > 0
    for layer in layers:
        assert layer.mixer.in_proj.l2_prefetch is layer.mixer.out_proj.weight
    kinds = {type(layer.mixer) for layer in layers}
    assert Attention in kinds and (kind == "llama" or len(kinds) == 2)  # the hybrid's GDN layers too
    # a shared expert's gate/up is read at every step: its router's launch prefetches it
    assert (kind == "llama") == (not shared) == (not moe)
    for block in shared:
        assert block.gate.l2_prefetch is block.shared_expert.gate_up_proj.weight
    # a MoE block's top-k prefetches the next layer's input projection (GDN in_proj or QKV)
    for i in moe:
        nxt = layers[i + 1].mixer.in_proj.weight if i + 1 < len(layers) else None
        assert layers[i].mlp.next_weight_prefetch is nxt


def test_a_moe_without_a_shared_expert(tmp_path):
    from tests.models.moe_checkpoints import make_tiny_moe

    model = load_model(str(make_tiny_moe(tmp_path)), torch.float32, "cpu", progress=False)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    moe = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "next_weight_prefetch")]
    assert moe and moe[-1] == len(layers) - 1
    assert plan_l2_prefetch(model) == len(layers) + len(moe) - 1  # the last block has no next layer
    for i in moe[:-1]:
        assert layers[i].mlp.gate.l2_prefetch is None  # nothing is read whatever the routing
        assert layers[i].mlp.next_weight_prefetch is layers[i + 1].mixer.in_proj.weight
    assert layers[-1].mlp.next_weight_prefetch is None


def test_expert_weights_stream_evict_first_with_the_prefetch(monkeypatch):
    from freetoken_core.kernels import moe_gemv

    with _prefetch(monkeypatch, False):
        assert moe_gemv.expert_weight_eviction() == ""
    with _prefetch(monkeypatch, True):
        assert moe_gemv.expert_weight_eviction() == "evict_first"


_COMPILE = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    from freetoken_core.kernels.norm_gemv import _norm_gemv_kernel

    ptrs = ["x_ptr", "r_ptr", "g_ptr", "w_ptr", "b_ptr", "y_ptr", "h_ptr", "n_ptr", "route_w_ptr", "route_i_ptr",
            "count_ptr"]
    signature = {**{p: "*bf16" for p in ptrs}, "N": "i32", "K": "i32", "stride_wn": "i32", "up_offset": "i32",
                 "eps": "fp32", "pf_ptr": "*u8", "pf_bytes": "i32"}
    constexprs = dict(NORM=True, HAS_RESIDUAL=True, HAS_BIAS=False, GATED=False, BLOCK_N=8, BLOCK_K=512, EVEN_K=True,
                      USE_PDL=True, ZERO_CENTERED=False, WRITE_NORMED=False, TOP_K=0, RENORMALIZE=False, SHARED=False,
                      BLOCK_E=1, BLOCK_TK=1, PREFETCH=True, PF_LANES=128)
    signature.update({name: "constexpr" for name in constexprs})
    k = triton.compile(ASTSource(_norm_gemv_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=3))
    print("PTX", "cp.async.bulk.prefetch.L2.global" in k.asm["ptx"], "CUBIN", len(k.asm["cubin"]))

    from freetoken_core.kernels.moe_gemv import _moe_gemv_gate_up_kernel
    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i32", "act_ptr": "*bf16", "w2_ptr": "*u8",
                 "w2_expert_bytes": "i32", "I": "i32", "H": "i32", "stride_xt": "i32", "stride_we": "i32",
                 "stride_wn": "i32", "stride_ar": "i32"}
    constexprs = dict(TOP_K=8, BLOCK_N=4, BLOCK_K=256, EVEN_K=True, USE_PDL=True, W_EVICT="evict_first",
                      PREFETCH_DOWN=True, PF_LANES=128)
    signature.update({name: "constexpr" for name in constexprs})
    k = triton.compile(ASTSource(_moe_gemv_gate_up_kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=2))
    ptx = k.asm["ptx"]
    print("PTX", "cp.async.bulk.prefetch.L2.global" in ptx and "L2::evict_first" in ptx, "CUBIN", len(k.asm["cubin"]))
""")


def test_the_prefetching_kernels_compile_to_sm90_cubins(tmp_path):
    """The whole compile (frontend, PTX, Triton's own ptxas) of the norm + GEMV and of the MoE gate/up GEMV with
    PDL and the prefetch on, for the H200, on a machine without a GPU: ptxas takes the helper's inline PTX."""
    script = tmp_path / "compile_probe.py"  # a file: triton.jit needs the kernels' source
    script.write_text(_COMPILE)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x.split() for x in out.stdout.splitlines() if x.startswith("PTX")]
    assert len(lines) == 2, out.stdout  # the norm + GEMV, then the MoE gate/up GEMV (evict-first loads too)
    for line in lines:
        assert line[1] == "True" and int(line[3]) > 0, line


@needs_cuda
def test_norm_gemv_is_bit_identical_with_the_prefetch(monkeypatch):
    from freetoken_core.kernels.norm_gemv import norm_gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.rand(2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    nxt = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    want = norm_gemv(x, r, nw, 1e-6, w)
    with _prefetch(monkeypatch, True):
        got = norm_gemv(x, r, nw, 1e-6, w, prefetch=nxt)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = norm_gemv(x, r, nw, 1e-6, w, prefetch=nxt)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in ((got, want), (captured, want)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_cuda
def test_engine_greedy_is_unchanged_with_the_prefetch(tmp_path, monkeypatch):
    from freetoken_core import LLM, SamplingParams
    from tests.models.hybrid_checkpoints import MAX_NEW, PROMPTS, make_tiny_hybrid

    path = make_tiny_hybrid(tmp_path, "qwen3_5_moe")
    outs = {}
    for on in (False, True):
        with _prefetch(monkeypatch, on):
            llm = LLM(path, dtype="bfloat16", device="cuda", page_size=4, max_running_req=1, num_pages=256)
            outs[on] = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
            del llm
    assert outs[True] == outs[False]
