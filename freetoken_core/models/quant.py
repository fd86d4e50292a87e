"""config.json `quantization_config` (or EngineConfig.quantization) -> the layers' weight format, and the
checkpoint stream in that format.

Supported: block FP8 as the official FP8 releases publish it (Qwen/Qwen3-30B-A3B-FP8, Qwen/Qwen3.6-35B-A3B-FP8):
`quant_method "fp8"`, `weight_block_size [128, 128]`, dynamic activations. `X.weight` is float8_e4m3fn and
`X.weight_scale_inv` its block scales (fused expert stacks: `experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`);
a tensor without a scale is plain, whatever `modules_to_not_convert` says. Every other method is refused by name
before any tensor is read.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ..env import kernel_env, triton_interpreted
from ..kernels.fp8_ref import DEFAULT_BLOCK, FP8_DTYPE
from ..layers.fp8 import Fp8BlockFormat, Fp8BlockWeight, Fp8Held

logger = logging.getLogger(__name__)

SUPPORTED = ('block FP8 (config.json quantization_config quant_method "fp8" with weight_block_size [128, 128] and '
             'activation_scheme "dynamic", or EngineConfig.quantization="fp8" on an unquantized checkpoint)')
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CHOICES = (None, "fp8")

# What the FP8 releases keep in full precision, by checkpoint name: embeddings, the LM head, every norm, the MoE
# router and shared-expert gate, the GDN layers' small a/b projections, conv and decay parameters (and the vision
# tower and MTP draft weights, which this engine skips anyway).
_FULL_PRECISION = re.compile(
    r"embed_tokens|lm_head|norm|\.mlp\.gate\.|shared_expert_gate|in_proj_a\.|in_proj_b\.|in_proj_ba\.|conv1d|"
    r"A_log|dt_bias|visual|^mtp\.")
_QUANTIZABLE = re.compile(r"(\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def quantization_method(config: Any) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method) or "an unnamed method")


def _qc_field(config: Any, name: str, default: Any = None) -> Any:
    qc = config.quantization_config
    return qc.get(name, default) if isinstance(qc, dict) else getattr(qc, name, default)


def weight_format(config: Any, path: Any, quantization: str | None = None) -> Fp8BlockFormat | None:
    """The checkpoint's FP8 format, the format `quantization="fp8"` asks for, or None (plain weights). Raises,
    naming the method, for every quantization this engine does not load."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"EngineConfig.quantization {quantization!r} is not supported; use None (the checkpoint's "
                         f"own quantization_config) or 'fp8'")
    method = quantization_method(config)
    if method is None:
        return Fp8BlockFormat() if quantization == "fp8" else None
    if method != "fp8":
        raise ValueError(f"{path}: the checkpoint is quantized with {method} (config.json quantization_config."
                         f"quant_method); freetoken_core loads {SUPPORTED}, and bfloat16 / float16 / float32 "
                         f"checkpoints: use the unquantized or the FP8 release of this model")
    block = _qc_field(config, "weight_block_size")
    if block is None:
        raise ValueError(f"{path}: quant_method fp8 without weight_block_size (per-tensor FP8) is not supported; "
                         f"freetoken_core loads {SUPPORTED}")
    if [int(b) for b in block] != list(DEFAULT_BLOCK):
        raise ValueError(f"{path}: quantization_config.weight_block_size {list(block)} is not supported; "
                         f"freetoken_core loads {SUPPORTED}")
    scheme = _qc_field(config, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{path}: quantization_config.activation_scheme {scheme!r} is not supported; "
                         f"freetoken_core loads {SUPPORTED}")
    return Fp8BlockFormat(tuple(int(b) for b in block))


def paired_fp8_tensors(weights: Iterable[tuple[str, torch.Tensor]], fmt: Fp8BlockFormat
                       ) -> Iterator[tuple[str, torch.Tensor | Fp8BlockWeight]]:
    """A checkpoint stream with each float8 tensor and its `<name>_scale_inv` joined into one Fp8BlockWeight (in
    sorted safetensors files the scale comes right after its weight; anything else is buffered until its pair
    arrives). Plain tensors pass through. A weight without its scale, or a scale without its weight, is an error."""
    waiting_weight: dict[str, torch.Tensor] = {}
    waiting_scale: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in waiting_weight:
                yield base, Fp8BlockWeight(waiting_weight.pop(base), tensor, fmt.block)
            else:
                waiting_scale[base] = tensor
        elif tensor.dtype == FP8_DTYPE:
            if name in waiting_scale:
                yield name, Fp8BlockWeight(tensor, waiting_scale.pop(name), fmt.block)
            else:
                waiting_weight[name] = tensor
        else:
            yield name, tensor
    if waiting_weight:
        raise ValueError(f"float8 checkpoint tensor(s) without their {SCALE_SUFFIX} block scales: "
                         f"{', '.join(sorted(waiting_weight)[:8])}")
    if waiting_scale:
        raise ValueError(f"block scale(s) without their float8 weight: "
                         f"{', '.join(n + SCALE_SUFFIX for n in sorted(waiting_scale)[:8])}")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Whether the FP8 releases store this checkpoint tensor in FP8 (a projection's weight matrix)."""
    return (tensor.dim() >= 2 and tensor.is_floating_point() and _QUANTIZABLE.search(name) is not None
            and _FULL_PRECISION.search(name) is None)


def quantized_tensors(weights: Iterable[tuple[str, torch.Tensor]], fmt: Fp8BlockFormat
                      ) -> Iterator[tuple[str, torch.Tensor | Fp8BlockWeight]]:
    """An unquantized checkpoint stream with every projection weight quantized block-wise (quantization="fp8"),
    the rest (embeddings, norms, router, ...) as it is: the layout of the FP8 releases."""
    for name, tensor in weights:
        yield name, (Fp8BlockWeight.quantize(tensor, fmt.block) if is_quantizable(name, tensor) else tensor)


def checkpoint_stream(weights: Iterable[tuple[str, torch.Tensor]], config: Any, fmt: Fp8BlockFormat | None
                      ) -> Iterable[tuple[str, torch.Tensor | Fp8BlockWeight]]:
    """The stream the model loads: FP8 checkpoints paired with their scales, unquantized ones quantized when an FP8
    format was asked for, plain otherwise."""
    if fmt is None:
        return weights
    if quantization_method(config) == "fp8":
        return paired_fp8_tensors(weights, fmt)
    return quantized_tensors(weights, fmt)


def keeps_fp8(fmt: Fp8BlockFormat | None, device: torch.device | str) -> bool:
    """Whether FP8 weights stay FP8 in the layers on `device` (FREETOKEN_FP8_KEEP: auto = CUDA only; 1 = also on
    the CPU, where the FP8 kernels run only under Triton's interpreter: on a GPU host compiled kernels cannot read
    host tensors, so a CPU model there dequantizes)."""
    mode = kernel_env().fp8_keep
    on_cuda = torch.device(device).type == "cuda"
    return fmt is not None and ((on_cuda and mode != "0") or (mode == "1" and triton_interpreted()))


def hold_fp8_weights(model: nn.Module, fmt: Fp8BlockFormat, experts: bool = True) -> tuple[int, int]:
    """Switch every layer that can hold block-FP8 weights to FP8 storage before loading: the projections the FP8
    releases quantize (not the router, the shared-expert gate, ... `_FULL_PRECISION`), and the routed experts when
    `experts` (resident, or host banks the offload executors run in FP8). A checkpoint tensor that then arrives plain turns its
    layer back (`Fp8Held.drop_fp8`). Returns (layers held in FP8, layers left dense that could not hold them: each
    named once in the log)."""
    from ..layers.moe import StackedExperts

    held = 0
    refused: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Held) or _FULL_PRECISION.search(name + ".") is not None:
            continue
        if isinstance(module, StackedExperts) and not experts:
            continue
        reason = module.fp8_refusal(fmt.block)
        if reason is None and module.hold_fp8(fmt.block):
            held += 1
        else:
            refused.setdefault(str(reason), []).append(name)
    for reason, names in refused.items():  # once per reason, not per layer
        logger.info("%d layer(s) keep their weights dequantized (%s): %s%s", len(names), reason,
                    ", ".join(names[:3]), " ..." if len(names) > 3 else "")
    return held, sum(len(n) for n in refused.values())
