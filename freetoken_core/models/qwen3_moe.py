"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k RMSNorm) with sparse MoE MLPs.

Layer i is sparse when `i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`, a dense
MLP of `intermediate_size` elsewhere (transformers' rule). The router renormalises the top-k
weights only when the checkpoint's `norm_topk_prob` says so (the config class defaults to False).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..layers.moe import SparseMoeBlock
from .base import DENSE_PACKED, CausalLM
from .blocks import Attention, DecoderLayer, DenseMLP, check_silu
from .weights import WeightRule, packed_rules

# Per-expert checkpoint tensors -> the stacked weights (before the dense renames, which would
# otherwise turn `experts.3.gate_proj` into `experts.3.gate_up_proj`).
EXPERT_RULES = (
    WeightRule(r"\.experts\.(?P<expert>\d+)\.gate_proj\.weight$", ".experts.gate_up_proj", 0),
    WeightRule(r"\.experts\.(?P<expert>\d+)\.up_proj\.weight$", ".experts.gate_up_proj", 1),
    WeightRule(r"\.experts\.(?P<expert>\d+)\.down_proj\.weight$", ".experts.down_proj", None),
)


def num_experts_of(config: Any) -> int:
    """transformers 5 writes the count as `num_local_experts` in config.json, 4.x as `num_experts`."""
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not n:
        raise ValueError("the MoE config gives no expert count (num_experts / num_local_experts)")
    return int(n)


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer_id not in (getattr(config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0


class Qwen3MoeForCausalLM(CausalLM):
    weight_rules = EXPERT_RULES + packed_rules(DENSE_PACKED)

    def make_layer(self, layer_id: int, rotary: Any) -> nn.Module:
        cfg = self.config
        check_silu(cfg)
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen3-MoE with use_sliding_window=true is not supported")
        b = bool(getattr(cfg, "attention_bias", False))
        attn = Attention(cfg, layer_id, rotary, self.dtype, qkv_bias=b, o_bias=b, qk_norm=True)
        if is_sparse_layer(cfg, layer_id):
            mlp: nn.Module = SparseMoeBlock(
                cfg.hidden_size, num_experts_of(cfg), int(cfg.num_experts_per_tok), cfg.moe_intermediate_size,
                bool(getattr(cfg, "norm_topk_prob", False)), self.dtype, self.expert_device,
            )
        else:
            mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, self.dtype)
        return DecoderLayer(cfg, attn, mlp, self.dtype)
