"""Llama-family decoder: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head
q/k RMSNorm). GQA, an explicit `head_dim`, and tied embeddings come from the HF config.

The engine calls `forward(input_ids [T], positions [T]) -> hidden [T, hidden]` with the rows of
every request in the step concatenated; attention reads the step's batch and backend from
`get_context()`, so the model itself holds no per-request state.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..attention.base import AttnLayout
from ..core import get_context
from ..layers import (
    Linear, MergedLinear, ParallelLMHead, QKVLinear, RMSNorm, RotaryEmbedding, VocabEmbedding, rope_parameters,
    silu_and_mul,
)
from ..layers.norm_linear import norm_linear


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                                  bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.rotary = rotary  # shared by all layers (registered once, on the model)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The rest of the block after the fused QKV projection (the decoder layer runs that one
        together with its RMSNorm)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        ctx = get_context()
        o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary, dtype, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(config, dtype, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm runs fused with the projection after it (one launch at batch-1 decode on CUDA)
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn.attend(positions, qkv)
        act, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual, gated=True)
        return self.mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        # Not a submodule of each layer: one cos/sin table for the whole model.
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters(config), dtype, config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, dtype, qkv_bias, o_bias, qk_norm, mlp_bias)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Checkpoint names of the projections we fuse: (fused name, checkpoint name, shard).
    stacked_params = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype, **self.bias_and_norm(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype,
            tied=self.model.embed_tokens if self.tie_word_embeddings else None,
        )

    @staticmethod
    def bias_and_norm(config: Any) -> dict[str, bool]:
        """Llama: `attention_bias` covers q/k/v and o; `mlp_bias` the MLP."""
        b = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=b, o_bias=b, qk_norm=False, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def attn_layout(self) -> AttnLayout:
        attn = self.model.layers[0].self_attn
        return AttnLayout(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.head_dim ** -0.5)

    def ensure_positions(self, max_seq_len: int) -> None:
        """Rotary tables cover max_position_embeddings; the engine calls this when it allows longer sequences."""
        self.model.rotary_emb.ensure_positions(max_seq_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden rows [T, hidden]."""
        return self.model(input_ids, positions)

    # --- weight loading ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; raise if any parameter is left unset."""
        params = dict(self.named_parameters())  # tied lm_head.weight is listed once, as embed_tokens
        expected = self._expected_shards()
        loaded: set[tuple[str, Any]] = set()
        for name, tensor in weights:
            if self._skip(name):
                continue
            for fused, ckpt, shard in self.stacked_params:
                if ckpt in name:
                    pname = name.replace(ckpt, fused)
                    break
            else:
                pname, shard = name, None
            if pname not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[pname]
            module = self.get_submodule(pname.rsplit(".", 1)[0])
            loader = getattr(module, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add((pname, shard))
        missing = sorted(f"{p}[{s}]" if s is not None else p for p, s in expected - loaded)
        if missing:
            more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{more}")

    def _skip(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        # Some tied checkpoints still store lm_head.weight (a copy of the embedding).
        return self.tie_word_embeddings and name == "lm_head.weight"

    def _expected_shards(self) -> set[tuple[str, Any]]:
        out: set[tuple[str, Any]] = set()
        for pname, _ in self.named_parameters():
            if ".qkv_proj." in pname:
                out.update((pname, s) for s in ("q", "k", "v"))
            elif ".gate_up_proj." in pname:
                out.update((pname, s) for s in (0, 1))
            else:
                out.add((pname, None))
        return out


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def bias_and_norm(config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return dict(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def bias_and_norm(config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=true is not supported")
        b = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=b, o_bias=b, qk_norm=True, mlp_bias=False)
