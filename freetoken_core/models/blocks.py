"""Blocks shared by the decoder architectures: attention, the dense gated MLP, the decoder layer
and the embed -> layers -> norm stack.

A decoder layer calls `self.mlp(h)` without knowing whether the MLP is dense or a mixture of
experts; an architecture file only picks the blocks per layer (`DecoderModel(config, make_layer)`).
Attention reads the step's batch and backend from `get_context()`, so no block holds per-request
state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..attention.base import KVStoreTarget
from ..core import Context, get_context
from ..env import kernel_env
from ..kvcache.spec import AttentionCacheSpec, LayerCacheSpec
from ..layers import (
    Linear, MergedLinear, QKVLinear, RMSNorm, RotaryEmbedding, VocabEmbedding, ZeroCenteredRMSNorm, rope_parameters,
    silu_and_mul,
)
from ..layers.norm_linear import norm_linear


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_silu(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")


class Attention(nn.Module):
    """GQA self-attention over the paged K/V pool: fused q/k/v projection, optional per-head q/k
    RMSNorm (Qwen3), rotary, the backend's paged attention, o_proj."""

    fuses_input_norm = True  # the decoder layer runs its input RMSNorm fused with qkv_proj

    def __init__(self, config: Any, kv_index: int, rotary: RotaryEmbedding, dtype: torch.dtype,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
                 norm_cls: type[nn.Module] = RMSNorm, q_outputs_per_head: int = 1) -> None:
        super().__init__()
        self.layer_id = kv_index  # the backend indexes the K/V pool by it
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        # q_outputs_per_head 2: q_proj emits [q | gate] per head (gated attention). Under tensor
        # parallelism the projection keeps this rank's heads, o_proj sums the ranks' outputs.
        self.qkv_proj = QKVLinear(config.hidden_size, num_heads * q_outputs_per_head, num_kv_heads,
                                  self.head_dim, bias=qkv_bias, dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads // q_outputs_per_head  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = Linear(num_heads * self.head_dim, config.hidden_size, bias=o_bias, dtype=dtype, parallel="row")
        self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.rotary = rotary  # shared by all layers (registered once, on the model)

    @property
    def in_proj(self) -> Linear:
        """The projection the decoder layer runs fused with its input RMSNorm."""
        return self.qkv_proj

    def cache_spec(self) -> AttentionCacheSpec:
        return AttentionCacheSpec(self.layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The rest of the block after the fused QKV projection (the decoder layer runs that one
        together with its RMSNorm)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q, gate = self.split_query(q.view(t, -1, self.head_dim))
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ctx = get_context()
        kv_target = None
        if self._fuses_qk_norm_rotary(q):
            kv_target = self._kv_store_target(ctx)
            q, k = self._qk_norm_rotary(positions, q, k, v if kv_target is not None else None, kv_target)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        if kv_target is not None:  # the rotary kernel wrote k/v into the cache: the backend skips its store
            o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch, kv_stored=True)
        else:
            o = ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch)
        if gate is not None:
            y = self._gated_o_proj(o, gate)
            if y is not None:
                return y
            o = o * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)

    def _fuses_qk_norm_rotary(self, q: torch.Tensor) -> bool:
        """CUDA with the fused ops on: q/k norm and rotary run as one kernel (3 launches -> 1). Only for
        the two norm formulas the kernel knows; CPU keeps the torch path (the reference)."""
        if self.q_norm is None or not q.is_cuda or type(self.q_norm) not in (RMSNorm, ZeroCenteredRMSNorm):
            return False
        from ..kernels import fused_ops  # first CUDA use: CPU users never load Triton

        return fused_ops.use_fused(q) and type(self.rotary) is RotaryEmbedding  # a subclass may rotate otherwise

    def _kv_store_target(self, ctx: Context) -> KVStoreTarget | None:
        """FREETOKEN_ROTARY_STORE_KV: where the fused q/k norm + rotary kernel stores this layer's new
        k/v itself (the backend's `kv_store_target`: Triton decode/verify steps), one launch fewer; None:
        the backend stores them."""
        if not kernel_env().rotary_store_kv:
            return None
        return ctx.attn_backend.kv_store_target(self.layer_id, ctx.batch)

    def _qk_norm_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor | None = None,
                        kv_out: KVStoreTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from ..kernels.qk_norm_rotary import qk_norm_rotary

        assert self.q_norm is not None and self.k_norm is not None
        return qk_norm_rotary(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                              self.k_norm.eps, self.rotary.cos_sin_cache, self.rotary.rot_dim,
                              zero_centered=isinstance(self.q_norm, ZeroCenteredRMSNorm), v=v, kv_out=kv_out)

    def _gated_o_proj(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
        """FREETOKEN_ATTN_GATE_GEMV: o_proj(o * sigmoid(gate)) for one CUDA row that o_proj sends to the
        Triton GEMV anyway, the gate applied to the GEMV's input row as it loads (rounded as the torch ops
        round it): a gate copy, a sigmoid and a multiply fewer. None: the caller takes the torch ops.
        Not under tensor parallelism (a row-parallel o_proj all-reduces after its GEMV)."""
        proj = self.o_proj
        if not kernel_env().attn_gate_gemv or not o.is_cuda or type(proj) is not Linear or proj.parallel is not None:
            return None
        if proj.fp8_block is not None:  # FP8 held: its GEMV takes the gate the same way
            if gate.dtype != o.dtype or o.dim() != 2 or o.shape[0] != 1 or o.stride(-1) != 1:
                return None
            from ..kernels.fp8_gemv import fp8_gemv

            return fp8_gemv(o, proj.weight, proj.weight_scale_inv, proj.bias, proj.fp8_block, gate=gate)
        from ..kernels import gemv as triton_gemv  # first CUDA use: CPU users never load Triton

        if gate.dtype != o.dtype or not triton_gemv.use_gemv(o, proj.weight, proj.gemv_min_elements):
            return None
        return triton_gemv.gemv(o, proj.weight, proj.bias, gate=gate)

    def split_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, H, D] -> (q, None); the gated attention's [T, H, 2D] -> (q, gate), both [T, H, D] views
        (the gate stays strided: the gated o_proj GEMV reads it in place)."""
        if q.shape[1] == self.num_heads:
            return q, None
        t = q.shape[0]
        q = q.reshape(t, self.num_heads, 2 * self.head_dim)
        return q[..., : self.head_dim], q[..., self.head_dim:]


class DenseMLP(nn.Module):
    """down(silu(gate x) * up x), with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias, dtype=dtype,
                                         parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, parallel="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: x + mixer(norm(x)), then + mlp(norm(x)). The residual stream is
    carried beside x so each norm adds it in the same kernel (vLLM/SGLang style). The token mixer
    is attention (`self_attn`) or, on hybrid models, a gated-delta-net (`linear_attn`): the
    checkpoint's names for them."""

    def __init__(self, config: Any, mixer: nn.Module, mlp: nn.Module, dtype: torch.dtype,
                 mixer_name: str = "self_attn", norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.mixer
        if getattr(mixer, "fuses_input_norm", False):
            # the input norm runs fused with the QKV projection (one launch at batch-1 decode on CUDA)
            qkv, residual = norm_linear(self.input_layernorm, mixer.in_proj, x, residual)
            x = mixer.attend(positions, qkv)
        else:
            if residual is None:
                h, residual = self.input_layernorm(x), x
            else:
                h, residual = self.input_layernorm(x, residual)
            x = mixer(positions, h)
        if getattr(self.mlp, "fuses_input_norm", False):  # the MoE router runs the norm in its own launch
            return self.mlp.forward_with_norm(self.post_attention_layernorm, x, residual)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual

    def cache_spec(self) -> LayerCacheSpec:
        return self.mixer.cache_spec()


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> final norm. `make_layer(i, rotary)` builds layer i."""

    def __init__(self, config: Any, dtype: torch.dtype,
                 make_layer: Callable[[int, RotaryEmbedding], nn.Module], norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        # Not a submodule of each layer: one cos/sin table for the whole model.
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters(config), dtype, config)
        self.layers = nn.ModuleList(make_layer(i, self.rotary_emb) for i in range(config.num_hidden_layers))
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x
