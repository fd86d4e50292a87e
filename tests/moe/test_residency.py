"""moe_strategy=auto's decision (moe/residency.py, engine/memory_plan.py): experts resident whenever the device holds
them beside the dense weights, the CUDA-graph pool, the prefill workspace and a K/V reserve of max_running_req x
4,096 tokens, whatever memory_fraction says."""

from __future__ import annotations

import torch

from freetoken_core.config import EngineConfig
from freetoken_core.engine.memory_plan import residency_plan
from freetoken_core.moe.residency import ResidencyPlan

GiB = 1 << 30
H100_FREE = 79 * GiB  # an 80 GB H100 (79.2 GiB) after the CUDA context


def qwen3_30b_a3b_config():
    """Qwen/Qwen3-30B-A3B's shape (config.json of the release)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                         max_position_embeddings=40960, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def test_the_numbers_decide():
    # bf16 Qwen3-30B-A3B: 61 GB of weights, 58 GB (54 GiB) of them experts; 32 requests x 4096 tokens of K/V (12 GiB)
    plan = ResidencyPlan(H100_FREE, dense_bytes=3 * 10**9, expert_bytes=58 * 10**9, graph_pool_bytes=GiB // 4,
                         workspace_bytes=GiB, kv_reserve_bytes=12 * GiB, kv_reserve_tokens=32 * 4096)
    assert plan.need_bytes == 61 * 10**9 + 13 * GiB + GiB // 4 and plan.resident
    smaller = ResidencyPlan(**{**plan.__dict__, "free_bytes": plan.need_bytes - 1})
    assert not smaller.resident
    line = plan.describe()
    for part in ("resident", "79.0 GiB free", "dense weights 2.8", "experts 54.0", "CUDA-graph pool 0.25",
                 "prefill workspace 1.00", "K/V reserve 12.0 (131072 tokens)"):
        assert part in line, part


def test_bf16_qwen3_30b_a3b_is_resident_on_an_80_gb_card_whatever_memory_fraction():
    cfg = qwen3_30b_a3b_config()
    for fraction in (0.85, 0.8, 0.3):
        plan = residency_plan(EngineConfig("unused", memory_fraction=fraction), cfg, torch.bfloat16, H100_FREE)
        assert plan.resident, plan.describe()
    assert plan.expert_bytes == 48 * 128 * 3 * 2048 * 768 * 2  # 58.0 GB
    assert abs(plan.dense_bytes - 3.09e9) < 0.01e9  # attention, embeddings, LM head, norms, routers, rotary table
    # K/V: 48 layers x 4 KV heads x 128 x 2 (K and V) x 2 bytes = 96 KiB a token
    assert plan.kv_reserve_tokens == 32 * 4096 and plan.kv_reserve_bytes == 32 * 4096 * 96 * 1024


def test_too_little_room_offloads():
    cfg = qwen3_30b_a3b_config()
    assert not residency_plan(EngineConfig("unused"), cfg, torch.bfloat16, 48 * GiB).resident
    # the K/V reserve counts: 128 requests x 4096 tokens of K/V (48 GiB) do not fit beside 57 GiB of weights
    plan = residency_plan(EngineConfig("unused", max_running_req=128), cfg, torch.bfloat16, H100_FREE)
    assert not plan.resident and plan.kv_reserve_bytes == 48 * GiB
    # a short max_seq_len caps each request's reserve
    assert residency_plan(EngineConfig("unused", max_running_req=128, max_seq_len=1024), cfg, torch.bfloat16,
                          H100_FREE).resident


def test_a_hybrid_counts_its_linear_state_in_the_reserve():
    """A Qwen3.6-35B-A3B-like shape (gated-delta-net layers, 256 experts): bf16 experts 64 GB, resident on 80 GB."""
    from transformers import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                               num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, max_position_embeddings=262144)
    cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    plan = residency_plan(EngineConfig("unused"), cfg, torch.bfloat16, H100_FREE)
    assert plan.expert_bytes == 40 * 256 * 3 * 2048 * 512 * 2
    kv_only = 32 * 4096 * 2 * 10 * 2 * 256 * 2  # 10 attention layers' K/V
    per_slot = 30 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)  # conv (bf16) + fp32 recurrent state
    assert plan.kv_reserve_bytes == kv_only + 33 * per_slot
    assert plan.resident, plan.describe()


def test_fp8_counts_fp8_bytes_and_scales(monkeypatch):
    """quantization="fp8" on CUDA (FREETOKEN_FP8_KEEP=auto): experts and projections counted as e4m3 values plus
    fp32 block scales, the router, embeddings, LM head and norms in bf16."""
    from freetoken_core.env import kernel_env

    monkeypatch.setenv("FREETOKEN_FP8_KEEP", "auto")
    kernel_env.cache_clear()
    cfg = qwen3_30b_a3b_config()
    bf16 = residency_plan(EngineConfig("unused"), cfg, torch.bfloat16, H100_FREE)
    fp8 = residency_plan(EngineConfig("unused", quantization="fp8"), cfg, torch.bfloat16, H100_FREE)
    # per expert: gate|up [1536, 2048] and down [2048, 768] in bytes, scales [12, 16] and [16, 6] in fp32
    assert fp8.expert_bytes == 48 * 128 * (3 * 2048 * 768 + (12 * 16 + 16 * 6) * 4)  # 29.0 GB
    # attention: qkv [5120, 2048] and o [2048, 4096] per layer, half their bf16 bytes plus scales
    attn_bf16 = 48 * (5120 * 2048 + 2048 * 4096) * 2
    attn_fp8 = 48 * ((5120 * 2048 + 2048 * 4096) + (40 * 16 + 16 * 32) * 4)
    assert bf16.dense_bytes - fp8.dense_bytes == attn_bf16 - attn_fp8
    kernel_env.cache_clear()


def test_auto_offload_gets_what_the_device_holds_beside_the_rest():
    """auto -> offload without a budget: the expert cache takes the free memory the rest leaves (a budget that was
    given stands; a device that holds not even the rest is a MemoryError that says why)."""
    import pytest

    from freetoken_core.moe.residency import auto_strategy

    plan = ResidencyPlan(40 * GiB, dense_bytes=3 * GiB, expert_bytes=54 * GiB, graph_pool_bytes=GiB // 4,
                         workspace_bytes=GiB, kv_reserve_bytes=12 * GiB, kv_reserve_tokens=32 * 4096)
    assert not plan.resident and plan.expert_budget_bytes == 40 * GiB - (3 + 1 + 12) * GiB - GiB // 4
    strategy, cache_gb = auto_strategy(plan, budget_given=False)
    assert strategy == "offload" and cache_gb == 23.75
    assert auto_strategy(plan, budget_given=True) == ("offload", None)
    resident = ResidencyPlan(**{**plan.__dict__, "free_bytes": plan.need_bytes})
    assert auto_strategy(resident, budget_given=False) == ("resident", None)
    full = ResidencyPlan(**{**plan.__dict__, "free_bytes": 16 * GiB})
    assert full.expert_budget_bytes == 0
    with pytest.raises(MemoryError, match="does not fit this device even with every routed expert offloaded"):
        auto_strategy(full, budget_given=False)
