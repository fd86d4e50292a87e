"""Gated-delta-net hybrids: Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5 / Qwen3.6
(`Qwen3_5MoeForCausalLM`, `Qwen3_5ForCausalLM`, and their vision-language checkpoints
`Qwen3_5MoeForConditionalGeneration` / `Qwen3_5ForConditionalGeneration`, text part only).

`layer_types` (or `full_attention_interval`) picks each layer's token mixer: a gated-delta-net
(`linear_attn`, a linear-state slot per request) or gated full attention (`self_attn`: q_proj emits
[q | gate] per head, zero-centred q/k RMSNorm, partial NeoX rotary, o_proj(attn * sigmoid(gate)),
K/V pages). MLPs are MoE with a sigmoid-gated shared expert (Qwen3-Next: where `mlp_only_layers` /
`decoder_sparse_step` say; Qwen3.5-MoE: every layer) or dense. Every RMSNorm is zero-centred
(`(1 + w)`) except the GDN output norm.

Vision-language checkpoints keep the text model under `model.language_model.*` beside `model.visual.*`
and the config under `text_config`: the vision tower is skipped by name (image inputs are not
supported), as are the multi-token-prediction draft weights (`mtp.*`, for a later MTP drafter); both
are logged, so the strict loader still refuses anything else it does not know.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import Linear, ZeroCenteredRMSNorm
from ..layers.gdn import GatedDeltaNet
from ..layers.moe import SparseMoeBlock
from .base import DENSE_PACKED, CausalLM
from .blocks import Attention, DecoderLayer, DenseMLP, check_silu
from .qwen3_moe import EXPERT_RULES, is_sparse_layer, num_experts_of
from .weights import WeightRule, packed_rules

# Qwen3.5's separate GDN projections -> segments of the one flat [q | k | v | z | b | a] in_proj;
# Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba are de-interleaved by the layer.
GDN_RULES = (
    WeightRule(r"\.in_proj_qkv\.", ".in_proj.", (0, 1, 2)),
    WeightRule(r"\.in_proj_z\.", ".in_proj.", 3),
    WeightRule(r"\.in_proj_b\.", ".in_proj.", 4),
    WeightRule(r"\.in_proj_a\.", ".in_proj.", 5),
    WeightRule(r"\.in_proj_qkvz\.weight$", ".in_proj.weight", ("grouped", (0, 1, 2, 3))),
    WeightRule(r"\.in_proj_ba\.weight$", ".in_proj.weight", ("grouped", (4, 5))),
)


def layer_types_of(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if not types:
        interval = int(getattr(config, "full_attention_interval", 4) or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unknown layer_types {unknown}; supported: full_attention, linear_attention")
    return list(types)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    `fuse_shared_expert` (the engine calls it on CUDA with resident experts, FREETOKEN_FUSED_SHARED_EXPERT)
    stacks the shared expert after the E routed ones and its gate after the router's rows, so the
    layer is router GEMV -> top-k (k + 1 routes, the last the shared expert at sigmoid(gate)) -> the
    two expert launches: at batch 1 about seven launches fewer per layer (the shared expert's three
    GEMVs, its gate's sigmoid, the product, the sum). The parameters stay, as views of the stacks."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_intermediate_size: int, dtype: torch.dtype, expert_device: torch.device | str | None = None) -> None:
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, renormalize, dtype, expert_device)
        self.shared_expert = DenseMLP(hidden_size, shared_intermediate_size, dtype)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, dtype=dtype)
        self.shared_fused = False

    def can_fuse_shared_expert(self) -> bool:
        ex = self.experts
        sh = self.shared_expert
        # FP8-held experts stack with an FP8-held shared expert of the same blocks (their scales stack too)
        return (ex.executor is None and ex.fp8_block == sh.gate_up_proj.fp8_block == sh.down_proj.fp8_block
                and ex.gate_up_proj.device == self.shared_expert.down_proj.weight.device
                and self.shared_expert.down_proj.weight.shape == ex.down_proj.shape[1:]
                and self.gate.bias is None and self.shared_expert_gate.bias is None)

    def fuse_shared_expert(self) -> bool:
        """Stack the shared expert into the routed experts (see the class); False where it cannot be
        (offloaded experts, another intermediate size, a tensor-parallel shard)."""
        if self.shared_fused:
            return True
        if not self.can_fuse_shared_expert():
            return False
        ex, sh = self.experts, self.shared_expert
        e = ex.num_experts
        with torch.no_grad():
            w13 = torch.cat([ex.gate_up_proj.data, sh.gate_up_proj.weight.data[None]])
            w2 = torch.cat([ex.down_proj.data, sh.down_proj.weight.data[None]])
            router = torch.cat([self.gate.weight.data, self.shared_expert_gate.weight.data])
            if ex.fp8_block is not None:
                s13 = torch.cat([ex.gate_up_proj_scale_inv, sh.gate_up_proj.weight_scale_inv[None]])
                s2 = torch.cat([ex.down_proj_scale_inv, sh.down_proj.weight_scale_inv[None]])
                ex.gate_up_proj_scale_inv, sh.gate_up_proj.weight_scale_inv = s13[:e], s13[e]
                ex.down_proj_scale_inv, sh.down_proj.weight_scale_inv = s2[:e], s2[e]
                ex.scales_with_shared = (s13, s2)
        # the parameters become views of the stacks: no second copy of any weight
        ex.gate_up_proj, sh.gate_up_proj.weight = nn.Parameter(w13[:e], False), nn.Parameter(w13[e], False)
        ex.down_proj, sh.down_proj.weight = nn.Parameter(w2[:e], False), nn.Parameter(w2[e], False)
        self.gate.weight, self.shared_expert_gate.weight = nn.Parameter(router, False), nn.Parameter(router[e:], False)
        self.gate.out_features = e + 1
        for linear in (self.gate, self.shared_expert_gate, sh.gate_up_proj, sh.down_proj):
            if getattr(linear, "packed", None) is not None:  # a CPU model's prepacked copy (models/loader.py)
                linear.pack_for_cpu()
        ex.stack_with_shared = (w13, w2)
        self.shared_fused = True
        return True

    @property
    def routes_shared_expert(self) -> bool:  # stacked: router + shared gate in one GEMV, one top-k, k + 1 routes
        return self.shared_fused

    def from_routes(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.shared_fused:
            return self.experts(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, weights, ids) + shared


class Qwen3NextForCausalLM(CausalLM):
    weight_rules = EXPERT_RULES + GDN_RULES + packed_rules(DENSE_PACKED)
    norm_cls = ZeroCenteredRMSNorm
    always_sparse = False  # Qwen3-Next follows mlp_only_layers / decoder_sparse_step
    always_renormalize = False  # ... and norm_topk_prob

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32,
                 expert_device: torch.device | str | None = None) -> None:
        config = getattr(config, "text_config", None) or config
        self.layer_types = layer_types_of(config)
        super().__init__(config, dtype, expert_device)

    def make_layer(self, layer_id: int, rotary: Any) -> nn.Module:
        cfg = self.config
        check_silu(cfg)
        kind = self.layer_types[layer_id]
        index = self.layer_types[:layer_id].count(kind)  # K/V-pool or state-pool index
        if kind == "linear_attention":
            mixer: nn.Module = GatedDeltaNet(cfg, index, self.dtype)
            name = "linear_attn"
        else:
            b = bool(getattr(cfg, "attention_bias", False))
            mixer = Attention(cfg, index, rotary, self.dtype, qkv_bias=b, o_bias=b, qk_norm=True,
                              norm_cls=ZeroCenteredRMSNorm, q_outputs_per_head=2)
            name = "self_attn"
        return DecoderLayer(cfg, mixer, self.make_mlp(layer_id), self.dtype, name, ZeroCenteredRMSNorm)

    def make_mlp(self, layer_id: int) -> nn.Module:
        cfg = self.config
        n_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
        if n_experts and (self.always_sparse or is_sparse_layer(cfg, layer_id)):
            renorm = self.always_renormalize or bool(getattr(cfg, "norm_topk_prob", False))
            return SharedExpertMoeBlock(cfg.hidden_size, num_experts_of(cfg), int(cfg.num_experts_per_tok),
                                        cfg.moe_intermediate_size, renorm, cfg.shared_expert_intermediate_size,
                                        self.dtype, self.expert_device)
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, self.dtype)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Dense Qwen3.5 (text): dense MLPs everywhere, the GDN projections stored in pieces."""


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 / Qwen3.6 MoE (text): every MLP sparse, routing weights always renormalised."""

    always_sparse = True
    always_renormalize = True


class _VisionLanguageText:
    """The text part of a vision-language checkpoint: `model.language_model.*` -> `model.*`; the vision tower is
    skipped by name (and counted in the log) like the MTP draft weights."""

    weight_rules = (WeightRule(r"^model\.language_model\.", "model."),)
    unused_prefixes = ("model.visual.", "visual.", "mtp.")

    def load_weights(self, weights) -> None:
        # rename first, then the architecture's own rules see the text model's usual names
        renamed = ((n.replace("model.language_model.", "model.", 1), t) for n, t in weights)
        super().load_weights(renamed)  # type: ignore[misc]


class Qwen3_5MoeForConditionalGeneration(_VisionLanguageText, Qwen3_5MoeForCausalLM):
    weight_rules = Qwen3_5MoeForCausalLM.weight_rules


class Qwen3_5ForConditionalGeneration(_VisionLanguageText, Qwen3_5ForCausalLM):
    weight_rules = Qwen3_5ForCausalLM.weight_rules
