"""Layers vs transformers' reference code (RMSNorm, rotary) and plain formulas."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from freetoken_core.layers import MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_fused_residual_matches_transformers(dtype):
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 32, generator=g).to(dtype), torch.randn(5, 32, generator=g).to(dtype)
    ref = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    ours = RMSNorm(32, 1e-5, dtype)
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(dtype)
    ref.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    with torch.no_grad():
        # bf16: same fp32 math and rounding points as transformers, so bit-identical.
        tol = 0 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(ours(x), ref(x), atol=tol, rtol=tol)
        normed, new_res = ours(x, res)
        torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
        torch.testing.assert_close(normed, ref(x + res), atol=1e-6, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_rotary_matches_transformers_at_scattered_positions(scaling):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_scaling=scaling)
    ref = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(16, 512, rope_parameters(cfg), torch.float32, cfg)
    positions = torch.tensor([0, 1, 2, 300, 7, 511, 45])  # rows of several requests
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, 16, generator=g), torch.randn(7, 2, 16, generator=g)
    cos, sin = ref(q, positions[None])
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = ours(positions, q, k)
    torch.testing.assert_close(oq, rq[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="dynamic"):
        RotaryEmbedding(16, 64, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, torch.float32)


def test_fused_linears_load_shards_in_place():
    qkv = QKVLinear(8, num_heads=2, num_kv_heads=1, head_dim=4, bias=True, dtype=torch.float32)
    parts = {s: torch.randn(qkv.shard_rows(s)[1], 8) for s in ("q", "k", "v")}
    for s, t in parts.items():
        qkv.weight_loader(qkv.weight, t, s)
    x = torch.randn(3, 8)
    qkv.bias.data.zero_()
    q, k, v = qkv.split(qkv(x))
    for got, s in ((q, "q"), (k, "k"), (v, "v")):
        torch.testing.assert_close(got, x @ parts[s].T)
    gu = MergedLinear(8, [6, 6], dtype=torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        gu.weight_loader(gu.weight, torch.randn(5, 8), 0)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_rotary_table_grows_on_request():
    params = {"rope_type": "default", "rope_theta": 1e4}
    short = RotaryEmbedding(16, 8, params, torch.float32)
    long = RotaryEmbedding(16, 64, params, torch.float32)
    short.ensure_positions(64)
    assert short.max_positions == 64
    torch.testing.assert_close(short.cos_sin_cache, long.cos_sin_cache, atol=0, rtol=0)
