"""Shared fixtures: the real default model (SmolLM2-135M, converted once into the cache) and tiny
random Hugging Face models (Llama / Qwen2 / Qwen3) saved to temporary directories."""

from __future__ import annotations

import os

# No model hub, ever: everything a test loads is local.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Triton picks interpreted or compiled mode when `triton` is first imported (transformers imports
# it early): without a GPU, the Triton-language kernels run only under the interpreter.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_VOCAB = 256


def pytest_sessionstart(session):
    # every interpreted kernel launch recorded for tests/test_sm90_frontend.py
    from tests import triton_launches

    triton_launches.install()


def pytest_collection_modifyitems(config, items):
    # tests marked runs_last (the sm_90 frontend check of the launches the others made) go last, in order
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)


def tiny_config(arch: str = "llama", tie: bool = False, head_dim: int | None = None,
                rope_scaling: dict[str, Any] | None = None, **overrides: Any):
    """A tiny GQA config (4 query heads, 2 KV heads) of the given family."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    raise ValueError(f"unknown tiny arch {arch!r}")


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """HF init leaves norms at 1 and biases at 0 and weights tiny: a model that mis-loads a norm or
    a bias, or ignores rotary, would still match. Give every parameter a distinctive random value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r * (1.5 / p.shape[-1] ** 0.5))


def make_tiny_model(tmp_path: Path, arch: str = "llama", tie: bool = False, sharded: bool = False,
                    dtype: torch.dtype = torch.float32, seed: int = 0, **config_kw: Any) -> Path:
    """Build a random tiny HF model, save it (safetensors) under tmp_path, return the directory."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, tie=tie, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.to(dtype)
    out = Path(tmp_path) / f"tiny-{arch}-{'tied' if tie else 'untied'}{'-sharded' if sharded else ''}-{seed}"
    model.save_pretrained(out, max_shard_size="40KB" if sharded else "5GB")
    return out


@pytest.fixture
def tiny_model_factory(tmp_path: Path) -> Callable[..., Path]:
    def make(**kw: Any) -> Path:
        return make_tiny_model(tmp_path, **kw)

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The converted SmolLM2-135M-Instruct directory (fetched and converted on first use, ~30 s)."""
    from freetoken_core.models.gguf import default_model_path

    return default_model_path()
