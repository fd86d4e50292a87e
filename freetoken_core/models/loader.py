"""load_model: config.json + safetensors (one file or index-sharded) -> a ready model on a device.

Parameters are allocated directly in the target dtype on the target device and filled tensor by
tensor from `safe_open` (memory-mapped), so peak host memory stays near one tensor, not the model.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..layers.fp8 import Fp8Held, fill_fp8_normal_
from .quant import checkpoint_stream, hold_fp8_weights, keeps_fp8, weight_format
from .registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """'auto' -> bf16 on CUDA, fp32 on CPU; otherwise float32/bfloat16/float16 and their short names."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPE_NAMES[name]


def check_model_path(model_path: str | Path) -> Path:
    path = Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} has no config.json (expected a Hugging Face model directory)")
    return path


def load_config(model_path: str | Path):
    """The HF config object, read from the local directory only (never the hub)."""
    from transformers import AutoConfig  # late: `import freetoken_core.models` stays cheap

    return AutoConfig.from_pretrained(str(check_model_path(model_path)), local_files_only=True)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path} (model.safetensors or model.safetensors.index.json)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"missing checkpoint shard(s) listed in the index: {', '.join(missing)}")
    return files


def iter_safetensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, cpu tensor) for every tensor of every shard, with a progress bar over tensors."""
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc=f"Loading weights ({len(files)} shard{'s' if len(files) > 1 else ''})",
              unit="tensor", disable=not progress) as bar:
        for h in handles:
            for name in h.keys():
                yield name, h.get_tensor(name)
                bar.update(1)


# Host tensors larger than this are filled with one random block of this many values, repeated (init_dummy_weights_);
# a prime, so that consecutive experts start at different offsets of the block
DUMMY_TILE_ELEMENTS = 4_194_301


def fill_normal_(p: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """N(0, std) values. On the host, past DUMMY_TILE_ELEMENTS, a random block repeated over the tensor: the host
    banks of an offloaded MoE (58 GB for Qwen3-30B-A3B) took minutes to draw value by value; a copy takes seconds."""
    n = p.numel()
    if p.device.type != "cpu" or n <= DUMMY_TILE_ELEMENTS or not p.is_contiguous():
        p.normal_(0.0, std, generator=generator)
        return
    tile = torch.empty(DUMMY_TILE_ELEMENTS, dtype=p.dtype).normal_(0.0, std, generator=generator)
    flat, whole = p.view(-1), n // DUMMY_TILE_ELEMENTS
    flat[: whole * DUMMY_TILE_ELEMENTS].view(whole, DUMMY_TILE_ELEMENTS).copy_(tile.expand(whole, -1))
    flat[whole * DUMMY_TILE_ELEMENTS:].copy_(tile[: n - whole * DUMMY_TILE_ELEMENTS])


def init_dummy_weights_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (benchmarks of real model shapes without checkpoints):
    norms 1, biases 0, everything else N(0, 0.02), drawn on the parameters' own device."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        fp8_held: set[int] = set()
        for m in model.modules():  # FP8-held layers: a quantized N(0, 0.02) weight, values and block scales
            for values, scale in m.fp8_tensors() if isinstance(m, Fp8Held) else []:
                fill_fp8_normal_(values, scale, m.fp8_block, 0.02,
                                 gen.setdefault(values.device, torch.Generator(device=values.device).manual_seed(seed)))
                fp8_held.add(id(values))
            for dense in m.fp8_dense_tensors() if isinstance(m, Fp8Held) else []:
                fill_normal_(dense, 0.02, gen.setdefault(dense.device, torch.Generator(device=dense.device).manual_seed(seed)))
        for name, p in model.named_parameters():
            if id(p) in fp8_held:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                fill_normal_(p, 0.02, gen.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed)))


def pack_cpu_weights(model: torch.nn.Module) -> None:
    """Prepack every linear layer's weight for oneDNN (a no-op where unavailable)."""
    for m in model.modules():
        if hasattr(m, "pack_for_cpu"):
            m.pack_for_cpu()


def load_model(model_path: str, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", progress: bool = True, load_format: str = "auto",
               expert_device: torch.device | str | None = None, quantization: str | None = None,
               fp8_host_experts: bool = False) -> torch.nn.Module:
    """load_format "auto" reads safetensors; "dummy" needs only config.json and draws random weights.
    expert_device: MoE models keep their routed experts there (the host, for offloaded strategies).
    fp8_host_experts: experts on expert_device stay block FP8 there too (moe_strategy offload: the device slots run
    the FP8 kernels); otherwise host experts dequantize (the cpu and hybrid executors compute dense).
    quantization: None (the checkpoint's own quantization_config) or "fp8" (block-quantize an unquantized one);
    block-FP8 weights stay FP8 in the layers that can run them where `keeps_fp8` says so (CUDA), else dequantize
    (layers/fp8.py); with load_format "dummy" such layers get random FP8 values and block scales directly."""
    path = check_model_path(model_path)
    device = torch.device(device)
    dtype = parse_dtype(dtype, device)
    config = load_config(path)
    fmt = weight_format(config, path, quantization)  # refuses every other quantization by name, before any read
    cls = get_model_class(config)
    t0 = time.perf_counter()
    with torch.device(device):
        model = cls(config, dtype, expert_device=expert_device) if expert_device is not None else cls(config, dtype)
    held = 0
    if keeps_fp8(fmt, device):  # FP8 weights stay FP8 (host experts only for offload: see fp8_host_experts)
        held, _ = hold_fp8_weights(model, fmt, experts=expert_device is None or fp8_host_experts)
    if load_format == "dummy":
        init_dummy_weights_(model)
    elif load_format == "auto":
        model.load_weights(checkpoint_stream(iter_safetensors(safetensors_files(path), progress), config, fmt))
    else:
        raise ValueError(f"unknown load_format {load_format!r}; use auto or dummy")
    model.eval()
    if device.type == "cpu":
        pack_cpu_weights(model)
    logger.info("loaded %s (%s, %s%s) from %s in %.1f s", cls.__name__, dtype, device,
                "" if fmt is None else f", block-FP8 {list(fmt.block)} weights: "
                f"{sum(isinstance(m, Fp8Held) and m.fp8_block is not None for m in model.modules())} of {held} "
                f"layers chosen kept in FP8, the rest dequantized at load", path,
                time.perf_counter() - t0)
    return model
