"""Block-FP8 checkpoints in the published layout (quant_method "fp8", weight_block_size [128, 128]), written from
a plain tiny checkpoint, beside a plain checkpoint of the same dequantized weights (the transformers reference:
its own FP8 loading refuses partial blocks and leaves the vision-language wrapper's scales unapplied)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken_core.kernels.fp8_ref import dequantize_block_fp8, quantize_block_fp8

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# what the releases quantize: the projections and the expert stacks; not the router (`mlp.gate`), the shared
# expert's gate, the GDN a/b projections, norms, embeddings, the LM head or the vision tower
_QUANTIZED = re.compile(r"(_proj(_qkvz?|_z)?\.weight|experts\.gate_up_proj|experts\.down_proj)$")
_KEPT = re.compile(r"in_proj_a\.|in_proj_b\.|in_proj_ba\.|shared_expert_gate|visual")


def is_quantized_in_release(name: str) -> bool:
    return _QUANTIZED.search(name) is not None and _KEPT.search(name) is None


def write_fp8_pair(plain: Path, scale_dtype: torch.dtype = torch.float32,
                   extra_fp8: dict[str, torch.Tensor] | None = None) -> tuple[Path, Path]:
    """-> (the FP8 checkpoint, the plain checkpoint of its dequantized weights). `extra_fp8`: more tensors to
    store quantized in the FP8 checkpoint only (e.g. MTP draft weights the engine must skip)."""
    fp8_dir, ref_dir = plain.with_name(plain.name + "-fp8"), plain.with_name(plain.name + "-fp8-dequantized")
    for out in (fp8_dir, ref_dir):
        shutil.copytree(plain, out, dirs_exist_ok=True)
        for f in out.glob("*.safetensors*"):
            f.unlink()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(plain.glob("*.safetensors")):
        tensors.update(load_file(f))
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized_in_release(name):
            w, s = quantize_block_fp8(t)
            fp8[name], fp8[name + "_scale_inv"] = w, s.to(scale_dtype)
            dequantized[name] = dequantize_block_fp8(w, s.to(scale_dtype), dtype=torch.float32)
        else:
            fp8[name] = dequantized[name] = t
    for name, t in (extra_fp8 or {}).items():
        w, s = quantize_block_fp8(t)
        fp8[name], fp8[name + "_scale_inv"] = w, s.to(scale_dtype)
    save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, ref_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = dict(QUANT_CONFIG, modules_to_not_convert=["lm_head"])  # partial, like releases
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp8_dir, ref_dir
