"""Loader and registry: errors a user can cause, and what a checkpoint must contain."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_core.models import get_model_class, known_architectures, load_config, load_model, parse_dtype


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path .* does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unknown_architecture_lists_known_ones(tiny_model_factory):
    path = tiny_model_factory(arch="llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as e:
        load_model(str(path), torch.float32, "cpu")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value)


def test_registry_maps_architectures(tiny_model_factory):
    for arch, cls_name in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
        cfg = load_config(tiny_model_factory(arch=arch))
        assert get_model_class(cfg).__name__ == cls_name
    assert "LlamaForCausalLM" in known_architectures()


def test_missing_weight_is_named(tiny_model_factory):
    path = tiny_model_factory(arch="llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(str(path), torch.float32, "cpu", progress=False)


def test_missing_shard_is_named(tiny_model_factory):
    path = tiny_model_factory(arch="llama", sharded=True)
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(str(path), torch.float32, "cpu", progress=False)


def test_untied_and_tied_heads(tiny_model_factory):
    untied = load_model(str(tiny_model_factory(arch="llama", tie=False)), torch.float32, "cpu", progress=False)
    tied = load_model(str(tiny_model_factory(arch="llama", tie=True)), torch.float32, "cpu", progress=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("auto", "cpu") is torch.float32
    assert parse_dtype("auto", "cuda") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int4")


def test_dummy_host_tensors_repeat_one_random_block(monkeypatch):
    from freetoken_core.models import loader

    monkeypatch.setattr(loader, "DUMMY_TILE_ELEMENTS", 1009)
    big = torch.empty(8, 1000)  # 8000 values: 7 whole blocks and a partial one
    loader.fill_normal_(big, 0.02, torch.Generator().manual_seed(0))
    flat = big.view(-1)
    assert torch.equal(flat[1009:2018], flat[:1009]) and torch.equal(flat[7063:], flat[: 8000 - 7063])
    assert len(flat[:1009].unique()) > 1000 and 0.015 < float(flat.std()) < 0.025
    small = torch.empty(1009)  # at most one block: drawn value by value
    loader.fill_normal_(small, 0.02, torch.Generator().manual_seed(0))
    assert torch.equal(small, torch.empty(1009).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0)))
