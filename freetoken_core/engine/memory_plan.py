"""The bytes behind `moe_strategy=auto` (moe/residency.py), measured before any weight is read.

The weights are counted from the model built on the meta device (no memory, no checkpoint): the real bytes the
layers will hold (FP8 + scales where a layer keeps FP8, the compute dtype where it dequantizes at load), this rank's
shard under tensor parallelism. The activations are an estimate from the widest projection of a step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import EngineConfig
from ..kvcache.linear_state import STATE_DTYPES, LinearStatePool
from ..moe.residency import KV_RESERVE_TOKENS_PER_REQ, ResidencyPlan

# Library workspaces (cuBLAS, Triton), the sampler's buffers and allocator fragmentation beside a step's activations
RUNTIME_HEADROOM_BYTES = 512 << 20


def meta_model(hf_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from ..models.registry import get_model_class

    with torch.device("meta"):
        return get_model_class(hf_config)(hf_config, dtype)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """One row's activations at the widest point of a layer: the residual stream and norms (a few hidden rows) and
    the widest projection output (fused QKV, gate/up, or top-k experts' gate/up)."""
    from ..layers.linear import Linear
    from ..layers.moe import SparseMoeBlock

    hidden = int(model.config.hidden_size)
    widest = max((m.out_features for m in model.modules() if isinstance(m, Linear)), default=hidden)
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            widest = max(widest, m.top_k * 2 * m.experts.intermediate_size)
    return (6 * hidden + 2 * widest) * torch.empty((), dtype=dtype).element_size()


def residency_plan(config: EngineConfig, hf_config: Any, dtype: torch.dtype, free_bytes: int,
                   cuda_graph: bool | None = None) -> ResidencyPlan:
    """Whether the routed experts can stay on a device with `free_bytes` free, and the numbers behind it.
    `cuda_graph`: whether decode will be captured (None: as the config asks)."""
    from ..layers.moe import StackedExperts

    from ..models.quant import hold_fp8_weights, keeps_fp8, weight_format

    model = meta_model(hf_config, dtype)
    fmt = weight_format(hf_config, config.model_path, config.quantization)
    if keeps_fp8(fmt, "cuda"):  # the layers that will hold FP8 (resident experts too), as load_model makes them
        hold_fp8_weights(model, fmt)
    experts = _nbytes(t for m in model.modules() if isinstance(m, StackedExperts)
                      for t in (*m.parameters(), *m.buffers()))
    dense = _nbytes(model.parameters()) + _nbytes(model.buffers()) - experts
    elem = torch.empty((), dtype=dtype).element_size()
    text = getattr(hf_config, "text_config", None) or hf_config
    model_max = int(getattr(text, "max_position_embeddings", 0) or 32768)
    max_seq_len = config.max_seq_len or min(model_max, 32768)
    tokens = config.max_running_req * min(KV_RESERVE_TOKENS_PER_REQ, max_seq_len)
    layout = model.attn_layout()
    kv_per_token = 2 * model.num_kv_layers * layout.num_kv_heads * layout.head_dim * elem
    specs = model.linear_state_specs()
    linear_state = (LinearStatePool.bytes_per_slot(specs, dtype, STATE_DTYPES[config.linear_state_dtype])
                    * (config.max_running_req + 1) if specs else 0)
    per_token = activation_bytes_per_token(model, dtype)
    vocab = int(text.vocab_size)
    decode_rows = min(config.cuda_graph_max_bs or config.max_running_req, config.max_running_req) \
        * config.decode_rows()
    graph_pool = 0
    if config.cuda_graph if cuda_graph is None else cuda_graph:  # the captured decode steps (fp32 logits of every row) and prefill steps share one pool
        graph_pool = decode_rows * (per_token + 4 * vocab) + config.prefill_graph_max_tokens * per_token
    workspace = config.max_extend_tokens * per_token + config.max_running_req * 4 * vocab + RUNTIME_HEADROOM_BYTES
    return ResidencyPlan(free_bytes, dense, experts, graph_pool, workspace, tokens * kv_per_token + linear_state,
                         tokens)
