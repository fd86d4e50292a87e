"""`architectures` in config.json -> model class. Entries are (module, class) strings so that adding
a model costs nothing to import until it is used."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("freetoken_core.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("freetoken_core.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("freetoken_core.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("freetoken_core.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("freetoken_core.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("freetoken_core.models.qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("freetoken_core.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("freetoken_core.models.qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("freetoken_core.models.qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    _MODELS[architecture] = (module, class_name)


def known_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: Any) -> type:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"known architectures: {', '.join(known_architectures())}"
    )
