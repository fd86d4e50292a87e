"""What the engine needs from any causal LM, and the base class every architecture builds on.

The engine sees four things: `forward(input_ids [T], positions [T]) -> hidden [T, H]` over the
concatenated rows of a step, `lm_head.logits(hidden)`, `cache_specs()` (one spec per layer, from
which it sizes its K/V pool and, on hybrid models, its linear-state pool) and `load_weights`.
Nothing else: no reaching into `layers[0]`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

import torch
from torch import nn

from ..attention.base import AttnLayout
from ..kvcache.spec import LayerCacheSpec, LinearStateSpec, attention_specs, linear_state_specs
from ..layers import ParallelLMHead, RMSNorm
from .blocks import DecoderModel
from .weights import WeightRule, load_checkpoint, packed_rules

log = logging.getLogger(__name__)

# The fused projections of every Llama-like block: checkpoint name -> (parameter name, shard).
DENSE_PACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class CausalLM(nn.Module):
    """A decoder stack (`self.model`, a DecoderModel) and its LM head. Subclasses build the layers
    (`make_layer`) and may extend `weight_rules` and `skip_weight`."""

    weight_rules: tuple[WeightRule, ...] = packed_rules(DENSE_PACKED)
    # checkpoint tensors this engine does not use, skipped by name prefix and counted in the log: the multi-token
    # prediction draft weights Qwen3-Next / Qwen3.5 / Qwen3.6 ship beside the target (FP8 scales included)
    unused_prefixes: tuple[str, ...] = ("mtp.",)
    norm_cls: type[nn.Module] = RMSNorm  # the final norm's (and the blocks', by default) class

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32,
                 expert_device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.expert_device = expert_device  # MoE models: where the routed experts' weights live
        self.model = DecoderModel(config, dtype, self.make_layer, self.norm_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, dtype,
            tied=self.model.embed_tokens if self.tie_word_embeddings else None,
        )

    def make_layer(self, layer_id: int, rotary: Any) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden rows [T, hidden]."""
        return self.model(input_ids, positions)

    # --- what the engine sizes its state from ----------------------------------------------
    def cache_specs(self) -> list[LayerCacheSpec]:
        return [layer.cache_spec() for layer in self.model.layers]

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_layers(self) -> int:
        return len(attention_specs(self.cache_specs()))

    def linear_state_specs(self) -> list[LinearStateSpec]:
        return linear_state_specs(self.cache_specs())

    def attn_layout(self) -> AttnLayout:
        """The head layout shared by the attention layers (one K/V pool)."""
        attn = attention_specs(self.cache_specs())
        if not attn:
            raise ValueError(f"{type(self).__name__} has no attention layer")
        s = attn[0]
        return AttnLayout(s.num_heads, s.num_kv_heads, s.head_dim, s.scale)

    def ensure_positions(self, max_seq_len: int) -> None:
        """Rotary tables cover max_position_embeddings; the engine calls this when it allows longer sequences."""
        self.model.rotary_emb.ensure_positions(max_seq_len)

    # --- weight loading ---------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; raise if any parameter is left unset."""
        self._skipped: Counter[str] = Counter()
        load_checkpoint(self, weights, self.weight_rules, self.skip_weight)
        if self._skipped:
            log.info("skipped %d checkpoint tensors this model does not use (%s)", sum(self._skipped.values()),
                     ", ".join(f"{prefix}*: {n}" for prefix, n in sorted(self._skipped.items())))

    def skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        prefix = next((p for p in self.unused_prefixes if name.startswith(p)), None)
        if prefix is not None:
            self._skipped[prefix] += 1
            return True
        # Some tied checkpoints still store lm_head.weight (a copy of the embedding).
        return self.tie_word_embeddings and name == "lm_head.weight"
