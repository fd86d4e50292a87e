"""Per-layer cache specs: what each decoder layer needs the engine to keep between steps.

A model lists one spec per layer (`CausalLM.cache_specs`); the engine sizes its state from that
list instead of looking inside the model. Attention layers keep K/V in pages; the gated-delta-net
layers of hybrid models will add a fixed-size linear-state slot spec here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionCacheSpec:
    """A softmax-attention layer: K/V of every token in the paged pool, at index `kv_index`."""

    kv_index: int  # the layer's K/V buffers in the pool (attention layers are numbered 0..n-1)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


@dataclass(frozen=True)
class LinearStateSpec:
    """A gated-delta-net layer: a fixed-size state per request (no pages), at index `state_index`
    of the linear-state pool: a conv state [conv_dim, conv_kernel - 1] and a recurrent state
    [num_v_heads, head_k_dim, head_v_dim]."""

    state_index: int
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int


LayerCacheSpec = AttentionCacheSpec | LinearStateSpec


def linear_state_specs(specs: list[LayerCacheSpec]) -> list[LinearStateSpec]:
    out = sorted((s for s in specs if isinstance(s, LinearStateSpec)), key=lambda s: s.state_index)
    if [s.state_index for s in out] != list(range(len(out))):
        raise ValueError(f"linear-state layers must number their states 0..{len(out) - 1}, got "
                         f"{[s.state_index for s in out]}")
    return out


def attention_specs(specs: list[LayerCacheSpec]) -> list[AttentionCacheSpec]:
    """The attention layers, in K/V-pool order; every layer must share one head layout (one pool)."""
    attn = sorted((s for s in specs if isinstance(s, AttentionCacheSpec)), key=lambda s: s.kv_index)
    if [s.kv_index for s in attn] != list(range(len(attn))):
        raise ValueError(f"attention layers must number their K/V buffers 0..{len(attn) - 1}, got "
                         f"{[s.kv_index for s in attn]}")
    shapes = {(s.num_heads, s.num_kv_heads, s.head_dim, s.scale) for s in attn}
    if len(shapes) > 1:
        raise ValueError(f"attention layers with different head layouts are not supported: {sorted(shapes)}")
    return attn
