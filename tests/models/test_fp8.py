"""Block-FP8 checkpoints in the published layout (Qwen3 dense, Qwen3-MoE in both expert layouts, Qwen3-Next, the
Qwen3.5-MoE vision-language wrapper; fp32 and bf16 scales; full and partial 128-blocks): the engine's greedy tokens
equal transformers fp32 on a plain checkpoint of the same dequantized weights, batched under max_running_req,
chunked, page sizes 1 and 4, with and without n-gram speculation. Plus EngineConfig.quantization="fp8" on an
unquantized checkpoint, and the loader's errors."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import QUANT_CONFIG, write_fp8_pair
from harness import ModelHarness
from hybrid_checkpoints import hf_greedy as hybrid_hf_greedy
from hybrid_checkpoints import make_tiny_hybrid
from moe_checkpoints import MAX_NEW, PROMPTS, hf_greedy, make_tiny_moe
from safetensors.torch import load_file, save_file

from freetoken_core import LLM, SamplingParams
from freetoken_core.kernels.fp8_ref import dequantize_block_fp8, quantize_block_fp8
from freetoken_core.models import load_model
from tests.conftest import make_tiny_model

# Qwen3 with 128 hidden: q/o/gate/up/down in whole 128-blocks; intermediate 192 cuts the MLP's blocks
DENSE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
# moe_intermediate 128: whole blocks per expert; the dense layer's 96 and the 32-row k/v cut blocks
MOE = dict(hidden_size=128, moe_intermediate_size=128, decoder_sparse_step=2, mlp_only_layers=[0],
           num_hidden_layers=4, norm_topk_prob=True)


def engine_greedy_matches(path, expected: list[list[int]]) -> None:
    """All prompts submitted together (max_running_req 3 < 5 prompts), prefill chunked under 7 tokens; page size 1
    plain and page size 4 with n-gram speculation."""
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    for page_size, spec in ((1, None), (4, "ngram")):
        llm = LLM(path, dtype="float32", page_size=page_size, max_running_req=3, max_extend_tokens=7, num_pages=256,
                  speculative=spec, num_speculative_tokens=3)
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == expected, f"page_size {page_size}, speculative {spec}"
        if spec is not None:
            assert sum(o.spec_proposed for o in outs) > 0  # the verify path really ran
        assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


@pytest.mark.parametrize("intermediate,scale_dtype", [(256, torch.float32), (192, torch.bfloat16)],
                         ids=["full-blocks-fp32-scales", "partial-blocks-bf16-scales"])
def test_qwen3_dense_fp8_matches_transformers(tmp_path, intermediate, scale_dtype):
    plain = make_tiny_model(tmp_path, arch="qwen3", intermediate_size=intermediate, **DENSE)
    fp8, ref = write_fp8_pair(plain, scale_dtype)
    keys = load_file(fp8 / "model.safetensors")
    assert keys["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert keys["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == scale_dtype
    engine_greedy_matches(fp8, hf_greedy(ref, PROMPTS, MAX_NEW))


@pytest.mark.parametrize("layout,scale_dtype", [("per_expert", torch.float32), ("stacked", torch.bfloat16)])
def test_qwen3_moe_fp8_matches_transformers(tmp_path, layout, scale_dtype):
    plain = make_tiny_moe(tmp_path, layout, **MOE)
    fp8, ref = write_fp8_pair(plain, scale_dtype)
    keys = load_file(fp8 / "model.safetensors")
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    assert (stacked + "_scale_inv" in keys) == (layout == "stacked")
    assert keys["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays plain
    if layout == "stacked":  # transformers reads the per-expert layout: the same weights (same seed), whose
        # 128-row gate and up blocks are the stack's blocks
        _, ref = write_fp8_pair(make_tiny_moe(tmp_path / "ref", "per_expert", **MOE), scale_dtype)
    engine_greedy_matches(fp8, hf_greedy(ref, PROMPTS, MAX_NEW))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_fp8_matches_transformers(tmp_path, kind):
    plain = make_tiny_hybrid(tmp_path, kind, hidden_size=128)
    # the MTP draft weights the releases ship (FP8 with their scales) are skipped on load
    mtp = {"mtp.fc.weight": torch.randn(128, 256), "mtp.layers.0.mlp.down_proj.weight": torch.randn(128, 128)}
    fp8, ref = write_fp8_pair(plain, torch.bfloat16 if kind == "qwen3_next" else torch.float32, extra_fp8=mtp)
    keys = load_file(fp8 / "model.safetensors")
    assert "mtp.fc.weight_scale_inv" in keys
    scaled = [k for k in keys if k.endswith("_scale_inv")]
    assert any(".experts." in k for k in scaled) and any("linear_attn.out_proj" in k for k in scaled)
    assert any(k.endswith("in_proj_a.weight") or k.endswith("in_proj_ba.weight") for k in keys)
    assert not any(("in_proj_a." in k or "in_proj_ba." in k) and k.endswith("_scale_inv") for k in keys)
    engine_greedy_matches(fp8, hybrid_hf_greedy(ref, kind, PROMPTS, MAX_NEW))


def test_fp8_weights_load_as_their_dequantized_values(tmp_path):
    plain = make_tiny_model(tmp_path, arch="qwen3", intermediate_size=192, **DENSE)
    fp8, ref = write_fp8_pair(plain, torch.bfloat16)
    got, want = (load_model(str(p), torch.float32, "cpu", progress=False) for p in (fp8, ref))
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), name


def prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    h = ModelHarness(model)
    return h.logits([h.add_request(prompt)], [prompt])


def test_quantization_fp8_on_an_unquantized_checkpoint(tmp_path):
    plain = make_tiny_model(tmp_path, arch="qwen3", intermediate_size=192, **DENSE)
    base = load_model(str(plain), torch.float32, "cpu", progress=False)
    quant = load_model(str(plain), torch.float32, "cpu", progress=False, quantization="fp8")
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        w = base.get_parameter(name)
        assert torch.equal(quant.get_parameter(name), dequantize_block_fp8(*quantize_block_fp8(w))), name
    # embeddings, norms and the LM head stay as they are (what vLLM's --quantization fp8 leaves too)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(quant.get_parameter(name), base.get_parameter(name)), name
    prompt = list(range(3, 40))
    logits = [prefill_logits(m, prompt) for m in (base, quant)]
    # quantized (not equal), within FP8's error: e4m3 rounds each weight by up to 2^-4 (rms ~3%), compounded over
    # the 14 projections of two random layers
    rel = (logits[0] - logits[1]).norm() / logits[0].norm()
    assert 0 < rel < 0.15
    # first greedy tokens through the engine agree
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = [LLM(plain, dtype="float32", num_pages=64, **kw).generate(PROMPTS, params) for kw in ({}, {"quantization": "fp8"})]
    assert [o.token_ids[0] for o in outs[0]] == [o.token_ids[0] for o in outs[1]]


def test_mtp_tensors_of_a_plain_text_checkpoint_are_skipped(tmp_path, caplog):
    path = make_tiny_hybrid(tmp_path, "qwen3_next")
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.norm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="freetoken_core.models.base"):
        load_model(str(path), torch.float32, "cpu", progress=False)
    assert "skipped 2 checkpoint tensors" in caplog.text and "mtp.*: 2" in caplog.text


def _set_quant_config(path, **qc) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    (dict(QUANT_CONFIG, weight_block_size=[64, 64]), r"weight_block_size \[64, 64\] is not supported"),
    (dict(QUANT_CONFIG, activation_scheme="static"), "activation_scheme 'static' is not supported"),
])
def test_unsupported_fp8_variants_are_refused(tmp_path, qc, message):
    path = make_tiny_model(tmp_path, arch="qwen3", **DENSE)
    _set_quant_config(path, **qc)
    with pytest.raises(ValueError, match=message):
        load_model(str(path), torch.float32, "cpu", progress=False)


def test_unpaired_fp8_tensors_are_named(tmp_path):
    plain = make_tiny_model(tmp_path, arch="qwen3", **DENSE)
    fp8, _ = write_fp8_pair(plain)
    tensors = load_file(fp8 / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"without their _scale_inv block scales: model\.layers\.1\.self_attn\.o_proj"):
        load_model(str(fp8), torch.float32, "cpu", progress=False)
    # float8 weights in a checkpoint whose config.json does not say fp8
    _set_quant_config(fp8)
    with pytest.raises(ValueError, match="is float8 but config.json has no fp8 quantization_config"):
        load_model(str(fp8), torch.float32, "cpu", progress=False)


@pytest.mark.parametrize("name,quantized", [
    ("model.layers.0.self_attn.q_proj.weight", True),
    ("model.layers.0.mlp.experts.7.down_proj.weight", True),
    ("model.layers.0.mlp.experts.gate_up_proj", True),
    ("model.layers.0.mlp.shared_expert.up_proj.weight", True),
    ("model.layers.0.linear_attn.in_proj_qkvz.weight", True),
    ("model.layers.0.linear_attn.out_proj.weight", True),
    ("model.layers.0.mlp.gate.weight", False),
    ("model.layers.0.mlp.shared_expert_gate.weight", False),
    ("model.layers.0.linear_attn.in_proj_ba.weight", False),
    ("model.layers.0.linear_attn.in_proj_a.weight", False),
    ("model.layers.0.linear_attn.conv1d.weight", False),
    ("model.layers.0.self_attn.q_norm.weight", False),
    ("model.embed_tokens.weight", False),
    ("lm_head.weight", False),
    ("model.layers.0.self_attn.o_proj.bias", False),
])
def test_quantization_fp8_quantizes_what_the_releases_do(name, quantized):
    from freetoken_core.models.quant import is_quantizable

    assert is_quantizable(name, torch.zeros(4, 4, 4 if "conv1d" in name else 1).squeeze(-1)) == quantized
