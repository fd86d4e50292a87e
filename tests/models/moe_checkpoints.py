"""Tiny random Qwen3-MoE checkpoints written by transformers' `save_pretrained`, in both expert
layouts (one tensor per expert, or the stacked `experts.gate_up_proj` / `experts.down_proj`), and
transformers' own greedy decoding of them (the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import randomize_

MOE_VOCAB = 256


def tiny_moe_config(**overrides: Any):
    from transformers import Qwen3MoeConfig

    cfg = dict(
        vocab_size=MOE_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg.update(overrides)
    return Qwen3MoeConfig(**cfg)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the stacked layout ([E, 2I, H] gate first, [E, H, I])."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".experts.")
        if len(parts) == 2 and parts[1].split(".")[0].isdigit():
            e, proj = parts[1].split(".")[:2]
            groups.setdefault(parts[0], {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for prefix, experts in groups.items():
        order = sorted(experts)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in order])
        out[f"{prefix}.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    return out


def _unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def make_tiny_moe(tmp_path: Path, layout: str = "per_expert", seed: int = 0, **config_kw: Any) -> Path:
    """Save a random tiny Qwen3-MoE; `layout` "per_expert" or "stacked" rewrites the experts' tensors
    in that layout (whatever transformers itself wrote). Routers get a wide init so top-k has no
    near-ties that 1e-6 noise could flip."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(**config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)
    name = "-".join(f"{k}{v}" for k, v in sorted(config_kw.items())) or "default"
    out = Path(tmp_path) / f"tiny-qwen3moe-{layout}-{name}-{seed}".replace(" ", "").replace(",", "_")
    model.save_pretrained(out)
    file = out / "model.safetensors"
    tensors = load_file(file)
    tensors = _stack_experts(tensors) if layout == "stacked" else _unstack_experts(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return out


PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9] * 6, list(range(20, 57)), [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]]
MAX_NEW = 10


def hf_model(path):
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.float32, local_files_only=True, attn_implementation="eager")
    try:  # exact fp32 needs transformers' eager experts (its grouped_mm default differs by ~1e-6)
        return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw).eval()
    except (TypeError, ValueError):
        return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def hf_greedy(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids, out = torch.tensor([prompt]), []
            for _ in range(n):
                nxt = int(model(ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(out)
    return outs
