"""A text checkpoint that carries its multi-token-prediction tensors (`mtp.*`, FP8 scales included, as the
Qwen3-Next / Qwen3.5 / Qwen3.6 releases do) loads for every architecture: they are skipped and counted in
the log until an MTP drafter reads them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_core.models.loader import load_model
from tests.conftest import make_tiny_model
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.models.moe_checkpoints import make_tiny_moe

CHECKPOINTS = {
    "llama": lambda p: make_tiny_model(p, arch="llama"),
    "qwen2": lambda p: make_tiny_model(p, arch="qwen2"),
    "qwen3": lambda p: make_tiny_model(p, arch="qwen3"),
    "qwen3_moe": lambda p: make_tiny_moe(p, "per_expert"),
    "qwen3_next": lambda p: make_tiny_hybrid(p, "qwen3_next"),
    "qwen3_5": lambda p: make_tiny_hybrid(p, "qwen3_5"),
    "qwen3_5_moe": lambda p: make_tiny_hybrid(p, "qwen3_5_moe"),
}


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_mtp_tensors_are_skipped_and_logged(tmp_path, caplog, arch):
    path = CHECKPOINTS[arch](tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(8, 16).to(torch.float8_e4m3fn)
    tensors["mtp.fc.weight_scale_inv"] = torch.ones(1, 1)
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(8, 8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="freetoken_core.models.base"):
        model = load_model(str(path), torch.float32, "cpu", progress=False)
    assert "mtp.*: 3" in caplog.text  # (a vision-language checkpoint skips its vision tower too)
    assert not any(name.startswith("mtp") for name, _ in model.named_parameters())
