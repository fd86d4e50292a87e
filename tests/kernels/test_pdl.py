"""Programmatic dependent launch switch (freetoken_core/kernels/pdl.py): never on CPU or under the interpreter."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import pdl


def test_pdl_is_off_for_cpu_tensors():
    x = torch.zeros(4)
    assert not pdl.use_pdl(x)
    assert pdl.pdl_launch(x) == {"USE_PDL": False}  # no launch_pdl keyword: plain launches
    assert not pdl.device_uses_pdl(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_needs_hopper_and_the_switch(monkeypatch):
    x = torch.zeros(4, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.use_pdl(x) == (hopper and pdl.ENABLED)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_launch(x) == {"USE_PDL": False}


def _env_with(**switches):
    from dataclasses import replace

    from freetoken_core.env import kernel_env

    env = replace(kernel_env(), **switches)
    return lambda: env


def test_attention_kernels_release_first_only_with_the_switch(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.setattr(pdl, "kernel_env", _env_with(attn_early_release=False))
    assert pdl.pdl_launch_attention(x) == {"USE_PDL": False, "RELEASE_FIRST": False}
    monkeypatch.setattr(pdl, "kernel_env", _env_with(attn_early_release=True))
    assert pdl.pdl_launch_attention(x) == {"USE_PDL": False, "RELEASE_FIRST": True}


def test_the_early_release_switch_is_read_from_the_environment(monkeypatch):
    from freetoken_core.env import KernelEnv

    monkeypatch.delenv("FREETOKEN_ATTN_EARLY_RELEASE", raising=False)
    assert KernelEnv.from_environ().attn_early_release is False  # off until measured faster
    monkeypatch.setenv("FREETOKEN_ATTN_EARLY_RELEASE", "1")
    assert KernelEnv.from_environ().attn_early_release is True


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _HOPPER, reason="needs a Hopper GPU (PDL)")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_is_identical_with_the_attention_kernels_released_first(tmp_path, monkeypatch, arch):
    """bf16 batch 1 through the decode graphs, where the o_proj runs on the PDL GEMV right after the attention
    kernels: releasing it before their wait changes when its blocks start, never what they compute."""
    from freetoken_core import LLM, SamplingParams

    if arch == "llama":
        from tests.conftest import make_tiny_model

        path = make_tiny_model(tmp_path, arch="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                               max_position_embeddings=2048)
    else:
        from tests.models.moe_checkpoints import make_tiny_moe

        path = make_tiny_moe(tmp_path, "per_expert", num_experts_per_tok=4, norm_topk_prob=True)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 300))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for early in (False, True):
        monkeypatch.setattr(pdl, "kernel_env", _env_with(attn_early_release=early))
        llm = LLM(str(path), dtype="bfloat16", device="cuda", page_size=16, max_running_req=1, max_seq_len=1024,
                  memory_fraction=0.2)
        assert llm.scheduler.engine.graph_runner is not None
        outs[early] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
