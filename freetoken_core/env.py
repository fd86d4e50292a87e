"""Every FREETOKEN_* kernel switch, declared once, typed, read once.

The kernel modules and the layers that dispatch to them ask `kernel_env()` instead of reading
`os.environ` themselves, so a switch means the same thing everywhere and is read at one moment.
This file also decides `TRITON_INTERPRET`: Triton picks interpreted or compiled mode when it is
first imported, and without a CUDA device its kernels run only under the interpreter
(`configure_triton`, called by `freetoken_core/__init__.py` and by `kernels/__init__.py`).

Only kernel switches live here. The `FREETOKEN_<FIELD>` overrides of `EngineConfig` fields (model
path, dtype, batch sizes...) belong to the serving launcher (`serving/params.py`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelEnv:
    """The kernel switches: most default to on (set one to 0 for an A/B run); those that default to off
    say why beside them (not yet measured faster on the GPU)."""

    fused_ops: bool = True  # FREETOKEN_FUSED_OPS: fused RMSNorm / rotary / SiLU-and-mul Triton kernels
    gemv: bool = True  # FREETOKEN_GEMV: the one-row GEMV and the multi-row verify GEMM
    norm_gemv: bool = True  # FREETOKEN_NORM_GEMV: RMSNorm fused into the one-row QKV and MoE router GEMVs
    pdl: bool = True  # FREETOKEN_PDL: programmatic dependent launch of the decode kernels (Hopper)
    cpu_packed_linear: bool = True  # FREETOKEN_CPU_PACKED_LINEAR: oneDNN-prepacked CPU weights
    fused_moe: bool = True  # FREETOKEN_FUSED_MOE: Triton fused-MoE kernels on CUDA (else the torch path)
    decode_fused_merge: bool = False  # FREETOKEN_DECODE_FUSED_MERGE: split-KV decode merges in-kernel (1 launch)
    # FREETOKEN_FUSED_SHARED_EXPERT: a shared expert stacked into the routed ones (one top-k, k + 1 routes; CUDA,
    # resident experts): one top-k instead of two (Qwen3.6 batch-1 row of benchmarks/RESULTS.md).
    fused_shared_expert: bool = True
    fla_prefill: bool = True  # FREETOKEN_FLA_PREFILL: fla-core's chunked GDN prefill on CUDA (if installed and checked)
    # Batch-1 decode launches folded into their neighbours, each measured on its own (fused-launch rows of
    # benchmarks/RESULTS.md): the three that won are on, the two measured slower stay off.
    # FREETOKEN_ROUTER_TOPK_FUSED: the MoE router's top-k in the router GEMV's launch (its last program ranks)
    router_topk_fused: bool = False
    # FREETOKEN_GDN_FUSED_CONV: the GDN decode conv1d update inside the recurrence kernel (measured slower, before
    # its conv state moved ahead of the PDL wait: not re-measured)
    gdn_fused_conv: bool = False
    # FREETOKEN_GDN_OUT_NORM_GEMV: the GDN gated output norm inside the out_proj GEMV (one row)
    gdn_out_norm_gemv: bool = True
    # FREETOKEN_ROTARY_STORE_KV: the decode K/V cache store inside the q/k norm + rotary kernel
    rotary_store_kv: bool = True
    # FREETOKEN_ATTN_GATE_GEMV: the gated attention's o * sigmoid(gate) inside the o_proj GEMV (one row)
    attn_gate_gemv: bool = True
    # FREETOKEN_FP8_KEEP: block-FP8 weights stay FP8 in the layers (values + scale_inv, run by kernels/fp8_*.py)
    # instead of being dequantized at load. auto: on CUDA devices (half the memory and the bytes a step reads;
    # benchmarks/RESULTS.md "Block-FP8"); 1: also on the CPU under Triton's interpreter (tests); 0: never
    fp8_keep: str = "auto"

    @staticmethod
    def variable(field_name: str) -> str:
        return "FREETOKEN_" + field_name.upper()

    @classmethod
    def from_environ(cls) -> "KernelEnv":
        return cls(**{f.name: (_choice(cls.variable(f.name), f.default, _CHOICES[f.name]) if f.name in _CHOICES
                               else _flag(cls.variable(f.name), f.default)) for f in fields(cls)})


# The switches that take a word instead of on/off
_CHOICES = {"fp8_keep": ("auto", "1", "0")}


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = (os.environ.get(name) or default).strip().lower()
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


@functools.cache
def kernel_env() -> KernelEnv:
    """The switches as the process started with them (read on first use, then fixed)."""
    return KernelEnv.from_environ()


def cuda_device_present() -> bool:
    # Checked without initialising CUDA: this runs before anything imports triton.
    return os.path.exists("/dev/nvidia0")


def configure_triton() -> None:
    """Turn on Triton's interpreter where there is no GPU (unless the user set TRITON_INTERPRET).
    Must run before the first `import triton`; calling it again is harmless."""
    if not cuda_device_present():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the interpreter (CPU tensors; fp32/fp16 only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
