"""Qwen3-MoE against transformers on the same tiny random checkpoints (fp32): logits row by row
through the paged cache, and greedy tokens through the whole engine (batched, chunked prefill, page
sizes 1 and 4, overlap, speculation), in both expert layouts; plus the loader's errors."""

from __future__ import annotations

import json

import pytest
import torch
from harness import ModelHarness
from moe_checkpoints import MAX_NEW, PROMPTS, hf_greedy, hf_model, make_tiny_moe
from safetensors.torch import load_file, save_file

from freetoken_core import LLM, SamplingParams
from freetoken_core.layers.moe import SparseMoeBlock
from freetoken_core.models import load_model

CONFIGS = {
    "sparse-every-layer": dict(),
    "step2-mlp-only-0-renorm": dict(decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=True, num_hidden_layers=4),
    "top4-renorm": dict(num_experts_per_tok=4, norm_topk_prob=True),
}


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_layer_kinds_and_both_layouts_load(tmp_path, layout):
    path = make_tiny_moe(tmp_path, layout, **CONFIGS["step2-mlp-only-0-renorm"])
    keys = load_file(path / "model.safetensors").keys()
    assert any(".experts.gate_up_proj" in k for k in keys) == (layout == "stacked")
    model = load_model(str(path), torch.float32, "cpu", progress=False)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds == [False, True, False, True]  # layer 0 is mlp_only; then every second layer
    assert all(layer.mlp.renormalize for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))


def test_logits_match_transformers_through_the_paged_cache(tmp_path):
    path = make_tiny_moe(tmp_path, "per_expert", **CONFIGS["step2-mlp-only-0-renorm"])
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, 256, (16,), generator=g).tolist()
    b = torch.randint(3, 256, (9,), generator=g).tolist()
    ref = hf_model(path)
    with torch.no_grad():
        ref_a, ref_b = (ref(torch.tensor([s])).logits[0] for s in (a, b))
    h = ModelHarness(load_model(str(path), torch.float32, "cpu", progress=False), page_size=4)
    ra, rb = h.add_request(a[:11]), h.add_request(b[:6])
    for toks, (pa, pb) in (([a[:11], b[:6]], (0, 0)), ([a[11:12], b[6:7]], (11, 6)), ([a[12:15], b[7:8]], (12, 7))):
        out = h.logits([ra, rb], toks)
        na = len(toks[0])
        torch.testing.assert_close(out[:na], ref_a[pa:pa + na], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[na:], ref_b[pb:pb + len(toks[1])], atol=1e-4, rtol=0)


# the stacked layout on one config: past loading it is the same weights and the same code
GREEDY_CASES = [(name, "per_expert") for name in CONFIGS] + [("step2-mlp-only-0-renorm", "stacked")]


@pytest.mark.parametrize("name,layout", GREEDY_CASES, ids=[f"{n}-{lay}" for n, lay in GREEDY_CASES])
def test_greedy_matches_transformers(tmp_path, name, layout):
    path = make_tiny_moe(tmp_path, layout, **CONFIGS[name])
    ref_path = path if layout == "per_expert" else make_tiny_moe(tmp_path, "per_expert", **CONFIGS[name])
    expected = hf_greedy(ref_path, PROMPTS, MAX_NEW)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(path, dtype="float32", page_size=16, max_running_req=4, num_pages=64)
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    # together: fewer rows than prompts, chunked prefill under a 7-token budget, page sizes 1 and 4
    for page_size, overlap in ((1, False), (4, True)):
        llm = LLM(path, dtype="float32", page_size=page_size, max_running_req=3, max_extend_tokens=7, num_pages=256,
                  overlap_schedule=overlap)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "overlap"])
def test_speculation_is_token_identical(tmp_path, pipelined):
    path = make_tiny_moe(tmp_path, "per_expert", **CONFIGS["top4-renorm"])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(path, dtype="float32", page_size=4, num_pages=400, max_running_req=3)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec = LLM(path, dtype="float32", page_size=4, num_pages=400, max_running_req=3, speculative="ngram",
               num_speculative_tokens=3, overlap_schedule=pipelined or None)
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec_proposed for o in outs) > 0  # the verify path really ran
    assert spec.scheduler.cache.num_free_pages == spec.scheduler.cache.num_total_pages


def test_missing_expert_weight_is_named(tmp_path):
    path = make_tiny_moe(tmp_path, "per_expert")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj\[expert 3, 1\]"):
        load_model(str(path), torch.float32, "cpu", progress=False)


def test_unexpected_expert_tensor_is_named(tmp_path):
    path = make_tiny_moe(tmp_path, "per_expert")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)  # only 8 experts (0..7)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="expert index 8 is out of range"):
        load_model(str(path), torch.float32, "cpu", progress=False)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "modelopt", "mxfp4", "bitsandbytes"])
def test_other_quantized_checkpoint_is_refused_by_method(tmp_path, method):
    path = make_tiny_moe(tmp_path, "per_expert")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"quantized with {method}.*block FP8"):
        load_model(str(path), torch.float32, "cpu", progress=False)
