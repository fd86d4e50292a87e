"""FP8 weights kept in the layers (FREETOKEN_FP8_KEEP=1; on CPU through the Triton
interpreter's FP8 kernels in fp32) against the same checkpoint dequantized at load (the CPU default): the math is
the same dequantized weight, so logits agree to fp32 rounding and greedy tokens are equal. Tiny Qwen3 dense (every
fused segment on whole 128-row blocks), Qwen3-MoE and the Qwen3.5-MoE wrapper, page sizes 1 and 4; on CUDA (bf16)
the same comparison (CUDA graphs, n-gram verify steps); load_format="dummy" with quantization="fp8" (the
benchmark's random FP8 shapes); a fused segment inside a block; the FP8 shared expert stacked with FP8 experts;
16-bit prefills past 16 rows, which quantize the activations (w8a8), held to that rounding."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import write_fp8_pair
from harness import ModelHarness
from moe_checkpoints import make_tiny_moe

from freetoken_core import LLM, SamplingParams
from freetoken_core.env import kernel_env, triton_interpreted
from freetoken_core.kernels.fp8_ref import FP8_DTYPE
from freetoken_core.layers.fp8 import Fp8Held
from freetoken_core.models import load_model
from tests.conftest import make_tiny_model

# q 256 | k 128 | v 128 and gate 512 | up 512: every segment starts on a 128-row scale block
DENSE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2)
MOE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, decoder_sparse_step=2,
           mlp_only_layers=[0], num_hidden_layers=2, norm_topk_prob=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 41))]  # 5 and 21 rows: the rows GEMM and the GEMM
MAX_NEW = 4
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # where a loaded model holds FP8 (without running it)
# FP8 kernels on CPU tensors run only under Triton's interpreter (a host without CUDA); the CUDA test covers the GPU
needs_interpreter = pytest.mark.skipif(not triton_interpreted(), reason="FP8 kernels on CPU tensors need the "
                                       "Triton interpreter (a host without CUDA)")


def set_keep(monkeypatch, value: str) -> None:
    monkeypatch.setenv("FREETOKEN_FP8_KEEP", value)
    kernel_env.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_kernel_env():
    yield
    kernel_env.cache_clear()


def held_layers(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Fp8Held) and m.fp8_block is not None]


def load_both(monkeypatch, path, dtype, device):
    models = []
    for keep in ("1", "0"):
        set_keep(monkeypatch, keep)
        models.append(load_model(str(path), dtype, device, progress=False))
    return models


def prefill_and_decode_logits(model, prompt: list[int]) -> torch.Tensor:
    """Prefill logits of the whole prompt, then one decode row (the one-row GEMVs)."""
    h = ModelHarness(model)
    rid = h.add_request(prompt)
    first = h.logits([rid], [prompt])
    nxt = int(first[-1].argmax())
    return torch.cat([first[-1:], h.logits([rid], [[nxt]])[-1:]])


def greedy(monkeypatch, path, keep: str, dtype: str, page_size: int) -> list[list[int]]:
    set_keep(monkeypatch, keep)
    llm = LLM(path, dtype=dtype, page_size=page_size, max_running_req=2, num_pages=64, cuda_graph=False)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]


def check_kept_matches_dequantized(monkeypatch, path, expect_held: set[str], device: str, dtype: torch.dtype,
                                   tol: float, w8a8_tol: float | None = None) -> None:
    """Prefill and one decode row's logits of the kept and the dequantized model within `tol` of the largest logit;
    with `w8a8_tol`, a prompt past 16 rows (its 16-bit prefill quantizes the activations per token and 128 columns,
    kernels/fp8_gemm.py) within that instead: e4m3's 3 mantissa bits move a tiny model's logits by several percent,
    where a scale on the wrong block moves them by their own size."""
    kept, dense = load_both(monkeypatch, path, dtype, device)
    assert expect_held <= set(held_layers(kept)), held_layers(kept)
    assert not held_layers(dense)
    for name in expect_held:
        mod = kept.get_submodule(name)
        assert all(v.dtype == FP8_DTYPE and s.dtype == torch.float32 for v, s in mod.fp8_tensors())
    for prompt in PROMPTS:
        a, b = (prefill_and_decode_logits(m, prompt).float() for m in (kept, dense))
        bound = w8a8_tol if w8a8_tol is not None and len(prompt) > 16 else tol
        assert (a - b).abs().max() <= bound * b.abs().max(), (prompt, (a - b).abs().max(), b.abs().max())


DENSE_HELD = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_up_proj",
              "model.layers.1.mlp.down_proj"}
MOE_HELD = {"model.layers.1.mlp.experts", "model.layers.0.mlp.gate_up_proj", "model.layers.1.self_attn.o_proj"}


@needs_interpreter
def test_fp16_prefill_runs_w8a8_within_activation_rounding(tmp_path, monkeypatch):
    # 16-bit activations: the 5-row prompt runs the weight-only GEMVs (within fp16 rounding), the 21-row prefill the
    # w8a8 GEMM (7.6% of the largest logit on this checkpoint)
    fp8, _ = write_fp8_pair(make_tiny_model(tmp_path, arch="qwen3", **DENSE))
    check_kept_matches_dequantized(monkeypatch, fp8, DENSE_HELD, "cpu", torch.float16, 5e-3, w8a8_tol=0.15)


@needs_interpreter
def test_qwen3_dense_fp8_kept_matches_dequantized(tmp_path, monkeypatch):
    fp8, _ = write_fp8_pair(make_tiny_model(tmp_path, arch="qwen3", **DENSE))
    check_kept_matches_dequantized(monkeypatch, fp8, DENSE_HELD, "cpu", torch.float32, 1e-4)
    for page_size in (1, 4):
        assert greedy(monkeypatch, fp8, "1", "float32", page_size) == greedy(monkeypatch, fp8, "0", "float32",
                                                                             page_size)


@needs_interpreter
def test_qwen3_moe_fp8_kept_matches_dequantized(tmp_path, monkeypatch):
    fp8, _ = write_fp8_pair(make_tiny_moe(tmp_path, "per_expert", **MOE))
    check_kept_matches_dequantized(monkeypatch, fp8, MOE_HELD, "cpu", torch.float32, 1e-4)
    for page_size in (1, 4):
        assert greedy(monkeypatch, fp8, "1", "float32", page_size) == greedy(monkeypatch, fp8, "0", "float32",
                                                                             page_size)


def test_segment_inside_a_block_dequantizes_that_layer(tmp_path, monkeypatch):
    """k/v of 64 rows: the fused QKV's k starts inside a 128-row block: that layer alone stays dense."""
    fp8, _ = write_fp8_pair(make_tiny_model(tmp_path, arch="qwen3", **{**DENSE, "num_key_value_heads": 1}))
    set_keep(monkeypatch, "1")
    model = load_model(str(fp8), torch.float32, DEV, progress=False)
    held = set(held_layers(model))
    assert "model.layers.0.self_attn.qkv_proj" not in held and "model.layers.0.self_attn.o_proj" in held
    assert model.get_submodule("model.layers.0.self_attn.qkv_proj").weight.dtype == torch.float32


def test_dummy_fp8_weights_are_fp8_with_realistic_scales(tmp_path, monkeypatch):
    plain = make_tiny_moe(tmp_path, "per_expert", **MOE)
    set_keep(monkeypatch, "1")
    model = load_model(str(plain), torch.float32, DEV, progress=False, load_format="dummy", quantization="fp8")
    experts = model.get_submodule("model.layers.1.mlp.experts")
    values, scale = experts.fp8_tensors()[0]
    assert values.dtype == FP8_DTYPE and values.float().abs().max() == 448  # each block's amax maps to e4m3's max
    # N(0, 0.02) blocks of 128 x 128: amax ~4.5 sigma, scale ~2e-4
    assert 1e-4 < scale.median() < 4e-4
    assert model.get_submodule("model.layers.1.mlp.gate").weight.dtype == torch.float32  # the router stays plain


HYBRID_HELD = {"model.layers.0.linear_attn.out_proj", "model.layers.2.self_attn.o_proj", "model.layers.1.mlp.experts",
               "model.layers.1.mlp.shared_expert.gate_up_proj"}


def tiny_fp8_checkpoint(tmp_path, kind: str):
    """(FP8 checkpoint, the layers that keep FP8) of a tiny Qwen3 dense, Qwen3-MoE or Qwen3.5-MoE (wrapper layout)."""
    if kind == "dense":
        return write_fp8_pair(make_tiny_model(tmp_path, arch="qwen3", **DENSE))[0], DENSE_HELD
    if kind == "moe":
        return write_fp8_pair(make_tiny_moe(tmp_path, "per_expert", **MOE))[0], MOE_HELD
    from hybrid_checkpoints import make_tiny_hybrid

    plain = make_tiny_hybrid(tmp_path, "qwen3_5_moe", hidden_size=128, moe_intermediate_size=128,
                             shared_expert_intermediate_size=128)
    return write_fp8_pair(plain)[0], HYBRID_HELD


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
def test_cuda_fp8_kept_matches_dequantized_bf16(tmp_path, monkeypatch, kind):
    fp8, held = tiny_fp8_checkpoint(tmp_path, kind)
    if kind != "hybrid":  # the harness runs attention-only models
        # bf16 activations: both paths round each projection's output to bf16, in different summation orders
        check_kept_matches_dequantized(monkeypatch, fp8, held, "cuda", torch.bfloat16, 3e-2, w8a8_tol=0.15)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    for page_size, spec in ((1, None), (4, "ngram")):  # as served: CUDA graphs, PDL, fused one-row launches, verify
        engine = dict(dtype="bfloat16", page_size=page_size, max_running_req=2, num_pages=64, speculative=spec,
                      num_speculative_tokens=3)
        set_keep(monkeypatch, "auto")
        llm = LLM(fp8, **engine)
        assert held <= set(held_layers(llm.scheduler.engine.model))  # CUDA keeps FP8 by default
        assert llm.scheduler.engine.graph_runner is not None
        kept = [o.token_ids for o in llm.generate(PROMPTS, params)]
        del llm
        set_keep(monkeypatch, "0")
        llm = LLM(fp8, **engine)
        assert not held_layers(llm.scheduler.engine.model)
        dense = [o.token_ids for o in llm.generate(PROMPTS, params)]
        del llm
        # first tokens agree; later ones may part where two logits are within bf16 rounding
        assert [t[0] for t in kept] == [t[0] for t in dense], (page_size, kept, dense)


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 3])
def test_fp8_shared_expert_stacks_with_fp8_experts(tokens):
    """An FP8-held shared expert stacked into FP8-held routed experts (values and scales): the same layer as the
    unstacked FP8 one and as its dequantized weights."""
    from freetoken_core.layers.fp8 import Fp8BlockWeight
    from freetoken_core.models.qwen3_next import SharedExpertMoeBlock

    h, e, inter = 128, 4, 128
    torch.manual_seed(0)
    block = SharedExpertMoeBlock(h, e, 2, inter, True, inter, torch.float32).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape) * (3.0 / h ** 0.5 if name.startswith("gate.") else p.shape[-1] ** -0.5))
        held = [block.experts, block.shared_expert.gate_up_proj, block.shared_expert.down_proj]
        for module in held:  # quantize, dequantize into the dense reference, then hold the FP8 form
            for name in module.fp8_names:
                q = Fp8BlockWeight.quantize(getattr(module, name).data)
                getattr(module, name).copy_(q.dequantize(torch.float32))
        x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens))
        dense = block(x)
        for module in held:
            weights = [Fp8BlockWeight.quantize(getattr(module, n).data) for n in module.fp8_names]
            assert module.hold_fp8((128, 128))
            for (values, scale), q in zip(module.fp8_tensors(), weights):
                values.copy_(q.weight)
                scale.copy_(q.scale_inv)
        unstacked = block(x)
        assert block.fuse_shared_expert()
        s13, s2 = block.experts.scales_with_shared
        assert s13.shape == (e + 1, 2, 1)
        assert block.shared_expert.down_proj.weight_scale_inv.data_ptr() == s2[e].data_ptr()  # views, no copy
        stacked = block(x)
    torch.testing.assert_close(unstacked, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stacked, unstacked, rtol=1e-4, atol=1e-4)


def test_hybrid_fp8_kept_matches_dequantized(tmp_path, monkeypatch):
    """Qwen3.5-MoE wrapper layout: GDN out_proj, gated-attention o_proj, FP8 experts and shared expert kept (GDN
    in_proj dequantized: its per-key-head layout mixes FP8 and plain rows)."""
    fp8, held = tiny_fp8_checkpoint(tmp_path, "hybrid")
    set_keep(monkeypatch, "1")
    llm = LLM(fp8, dtype="float32", page_size=4, max_running_req=2, num_pages=64)
    assert held <= set(held_layers(llm.scheduler.engine.model))
    assert "model.layers.0.linear_attn.in_proj" not in held_layers(llm.scheduler.engine.model)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    kept = [o.token_ids for o in llm.generate(PROMPTS, params)]
    set_keep(monkeypatch, "0")
    llm = LLM(fp8, dtype="float32", page_size=4, max_running_req=2, num_pages=64)
    assert kept == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_qwen3_5_gdn_in_proj_holds_fp8_with_a_dense_tail(tmp_path, monkeypatch):
    """GDN segments on whole 128-row blocks (key_dim 128, value_dim 256): q/k/v/z stay FP8, b and a (full precision in
    the checkpoint) a dense tail computed in the same one-row launch; greedy tokens equal the dequantized model's."""
    from hybrid_checkpoints import make_tiny_hybrid

    plain = make_tiny_hybrid(tmp_path, "qwen3_5_moe", hidden_size=128, moe_intermediate_size=128,
                             shared_expert_intermediate_size=128, linear_num_key_heads=2, linear_key_head_dim=64,
                             linear_num_value_heads=4, linear_value_head_dim=64)
    fp8 = write_fp8_pair(plain)[0]
    set_keep(monkeypatch, "1")
    model = load_model(str(fp8), torch.float32, DEV, progress=False)
    in_proj = model.get_submodule("model.layers.0.linear_attn.in_proj")
    assert in_proj.fp8_block is not None and in_proj.weight.shape == (768, 128)
    assert in_proj.weight_tail.dtype == torch.float32 and in_proj.weight_tail.shape == (8, 128)
    set_keep(monkeypatch, "0")
    dense = load_model(str(fp8), torch.float32, DEV, progress=False)
    want = dense.get_submodule("model.layers.0.linear_attn.in_proj").weight
    from freetoken_core.kernels.fp8_ref import dequantize_block_fp8

    got = torch.cat([dequantize_block_fp8(in_proj.weight, in_proj.weight_scale_inv), in_proj.weight_tail])
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same real weight, rows in the same order
    assert greedy(monkeypatch, fp8, "1", "float32", 1) == greedy(monkeypatch, fp8, "0", "float32", 1)


def test_cpu_models_keep_fp8_only_where_the_interpreter_runs_the_kernels(monkeypatch):
    """FREETOKEN_FP8_KEEP=1 on a GPU host: a CPU model dequantizes (compiled kernels cannot read host tensors);
    CUDA keeps FP8 under auto and 1, never under 0."""
    from freetoken_core.layers.fp8 import Fp8BlockFormat
    from freetoken_core.models import quant

    fmt = Fp8BlockFormat((128, 128))
    for interpreted in (True, False):
        monkeypatch.setattr(quant, "triton_interpreted", lambda: interpreted)
        for mode, cpu, cuda in (("0", False, False), ("auto", False, True), ("1", interpreted, True)):
            set_keep(monkeypatch, mode)
            assert (quant.keeps_fp8(fmt, "cpu"), quant.keeps_fp8(fmt, "cuda")) == (cpu, cuda), (mode, interpreted)
            assert not quant.keeps_fp8(None, "cuda")
