"""Tiny random gated-delta-net hybrids written by transformers' `save_pretrained`: Qwen3-Next and
Qwen3.5-MoE (the published vision-language wrapper form, `Qwen3_5MoeForConditionalGeneration`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.conftest import randomize_

# transformers imports these at import time if installed and then fails on CPU: force its torch path
for _name in ("fla", "causal_conv1d"):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _widen_routers_(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)
            if name.endswith("A_log"):  # decays in a realistic range (exp(A_log) ~ 0.05 .. 1.5)
                p.copy_(torch.linspace(-3.0, 0.4, p.numel()).view_as(p))


def make_tiny_hybrid(tmp_path: Path, kind: str = "qwen3_next", seed: int = 0, **overrides: Any) -> Path:
    """kind: "qwen3_next" (Qwen3NextForCausalLM), "qwen3_5" (Qwen3_5ForCausalLM, dense) or "qwen3_5_moe"
    (Qwen3_5MoeForConditionalGeneration, the published vision-language form)."""
    from transformers import AutoModelForCausalLM

    cfg_kw = {**_COMMON, **overrides}
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        config = Qwen3NextConfig(intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=[1], partial_rotary_factor=0.5, **cfg_kw)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif kind == "qwen3_5":  # dense Qwen3.5, text model
        from transformers import Qwen3_5TextConfig

        text = {k: v for k, v in cfg_kw.items() if "expert" not in k}
        config = Qwen3_5TextConfig(intermediate_size=96, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **text)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif kind == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        text = dict(cfg_kw, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                             "mrope_section": [2, 1, 1]})
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2)
        config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch.float32)
    else:
        raise ValueError(kind)
    randomize_(model, seed)
    _widen_routers_(model)
    out = Path(tmp_path) / f"tiny-{kind}-{seed}"
    model.save_pretrained(out)
    return out


PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9] * 7, list(range(20, 57)), [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]]
MAX_NEW = 10


def hf_model(path, kind: str):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    cls = Qwen3_5MoeForConditionalGeneration if kind == "qwen3_5_moe" else AutoModelForCausalLM
    kw = dict(dtype=torch.float32, local_files_only=True, attn_implementation="eager")
    try:
        return cls.from_pretrained(path, experts_implementation="eager", **kw).eval()
    except (TypeError, ValueError):
        return cls.from_pretrained(path, **kw).eval()


def hf_greedy(path, kind: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(path, kind)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, out = torch.tensor([prompt]), []
            for _ in range(n):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(out)
    return outs
