"""Our Llama/Qwen2/Qwen3 forward (paged cache, concatenated requests) vs transformers on the same
random weights, fp32."""

from __future__ import annotations

import pytest
import torch
from harness import ModelHarness
from transformers import AutoModelForCausalLM

from freetoken_core.models import load_model

ATOL = 1e-4


def hf_logits(path, seqs: list[list[int]], dtype=torch.float32) -> list[torch.Tensor]:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        return [ref(torch.tensor([s])).logits[0].float() for s in seqs]


def run_and_compare(path, dtype=torch.float32, atol=ATOL, page_size=4) -> None:
    """Two requests of different lengths: prefill together, one decode step, then a mixed step
    (a 3-token chunk beside a 1-token row). Every row's logits must match transformers' logits at
    the same position of the full sequence."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, 256, (16,), generator=g).tolist()
    b = torch.randint(3, 256, (9,), generator=g).tolist()
    ref_a, ref_b = hf_logits(path, [a, b], dtype)

    model = load_model(str(path), dtype, "cpu", progress=False)
    h = ModelHarness(model, page_size=page_size)
    ra, rb = h.add_request(a[:11]), h.add_request(b[:6])
    steps = [([a[:11], b[:6]], (0, 0)), ([a[11:12], b[6:7]], (11, 6)), ([a[12:15], b[7:8]], (12, 7))]
    for toks, (pa, pb) in steps:
        out = h.logits([ra, rb], toks)
        na = len(toks[0])
        torch.testing.assert_close(out[:na], ref_a[pa:pa + na], atol=atol, rtol=0)
        torch.testing.assert_close(out[na:], ref_b[pb:pb + len(toks[1])], atol=atol, rtol=0)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_gqa_matches_transformers(tiny_model_factory, tie):
    run_and_compare(tiny_model_factory(arch="llama", tie=tie))


def test_llama3_rope_scaling_matches_transformers(tiny_model_factory):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    run_and_compare(tiny_model_factory(arch="llama", rope_scaling=scaling, rope_theta=500000.0))


def test_qwen2_bias_matches_transformers(tiny_model_factory):
    path = tiny_model_factory(arch="qwen2")
    model = load_model(str(path), torch.float32, "cpu", progress=False)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    run_and_compare(path)


def test_qwen3_qk_norm_head_dim_matches_transformers(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3", head_dim=32)  # 32 != hidden 64 / 4 heads
    model = load_model(str(path), torch.float32, "cpu", progress=False)
    layout = model.attn_layout()
    assert (layout.num_heads, layout.num_kv_heads, layout.head_dim) == (4, 2, 32)
    assert layout.scale == pytest.approx(32 ** -0.5)
    run_and_compare(path, page_size=1)


def test_sharded_checkpoint_matches_transformers(tiny_model_factory):
    path = tiny_model_factory(arch="llama", sharded=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    run_and_compare(path)


def test_bf16_loading(tiny_model_factory):
    path = tiny_model_factory(arch="qwen3", tie=True)
    model = load_model(str(path), torch.bfloat16, "cpu", progress=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: shared, not copied
    # bf16 vs transformers' own bf16 forward: same rounding points, so agreement is close though not exact.
    seq = list(range(3, 20))
    (ref,) = hf_logits(path, [seq], torch.bfloat16)
    (ref32,) = hf_logits(path, [seq], torch.float32)
    h = ModelHarness(model)
    out = h.logits([h.add_request(seq)], [seq])
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.1 * ref32.abs().max()
    assert (out.argmax(-1) == ref32.argmax(-1)).float().mean() > 0.8


def test_bf16_checkpoint_loads_as_fp32(tiny_model_factory):
    path = tiny_model_factory(arch="llama", dtype=torch.bfloat16)
    model = load_model(str(path), "float32", "cpu", progress=False)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # bf16 -> fp32 is exact, so transformers loading the same file in fp32 agrees to fp32 precision.
    run_and_compare(path)
