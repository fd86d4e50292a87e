"""Llama-family decoders: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head
q/k RMSNorm). GQA, an explicit `head_dim`, and tied embeddings come from the HF config."""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import CausalLM
from .blocks import Attention, DecoderLayer, DenseMLP, check_silu


class LlamaForCausalLM(CausalLM):
    def make_layer(self, layer_id: int, rotary: Any) -> nn.Module:
        cfg, opts = self.config, self.block_options(self.config)
        check_silu(cfg)
        attn = Attention(cfg, layer_id, rotary, self.dtype, opts["qkv_bias"], opts["o_bias"], opts["qk_norm"])
        mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, self.dtype, opts["mlp_bias"])
        return DecoderLayer(cfg, attn, mlp, self.dtype)

    @staticmethod
    def block_options(config: Any) -> dict[str, bool]:
        """Llama: `attention_bias` covers q/k/v and o; `mlp_bias` the MLP."""
        b = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=b, o_bias=b, qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def block_options(config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def block_options(config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        b = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=b, o_bias=b, qk_norm=True, mlp_bias=False)
