"""What the engine resolved from its EngineConfig and the machine: the values it runs with.

The caller's `EngineConfig` stays as given; where the engine decides otherwise (no CUDA graphs with
tensor parallelism, a smaller batch for an expert pool, k + 1 rows per request under speculation),
the decision is here. Not `messages.EngineStats` (the running counters)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(frozen=True)
class ResolvedEngineConfig:
    device: str  # e.g. "cuda:0", "cpu"
    dtype: str  # the model's torch dtype, e.g. "torch.bfloat16"
    max_seq_len: int  # longest sequence a page-table row holds
    max_req_len: int  # longest request: max_seq_len less the rows a widened step adds
    decode_rows_per_req: int  # query rows per request per decode step (k + 1 under speculation)
    max_running_req: int  # after the MoE expert pool's batch clamp
    num_pages: int  # usable K/V pages (the dummy page not counted)
    page_size: int
    attention_backend: str
    moe_strategy: str  # resident | offload | cpu | hybrid, or "none" for a dense model
    cuda_graph: bool  # decode steps replay captured CUDA graphs
    cuda_graph_max_bs: int  # the largest captured decode batch (0 without graphs)
    verify_cuda_graph: bool  # speculative verify steps replay captured graphs too
    tensor_parallel_size: int

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())
