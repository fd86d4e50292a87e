"""The attention-backend interface: per-batch metadata, per-layer attention over the paged cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..core import Batch
from ..kvcache.pool import KVCache


@dataclass(frozen=True)
class BackendInfo:
    name: str
    devices: tuple[str, ...]  # "cpu", "cuda"
    dtypes: tuple[torch.dtype, ...]
    supports_page_size_gt1: bool = True
    supports_cuda_graph: bool = False
    uniform_extend_graph: bool = False  # can capture decode/verify graphs with rows_per_req > 1
    lengths_on_device: bool = False  # implements set_lengths_on_device (pipelined speculation)


@dataclass
class AttnLayout:
    """What every backend needs to know about the model's attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttnBackend(ABC):
    info: BackendInfo

    def __init__(self, layout: AttnLayout, kv_cache: KVCache, page_table: torch.Tensor) -> None:
        self.layout = layout
        self.kv_cache = kv_cache
        self.page_table = page_table  # [rows, pages_per_row] int32 on the model's device
        self.page_size = kv_cache.page_size

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Fill `batch.attn_metadata` once per step (before any layer runs)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for the batch's new rows. Writes k/v into the cache at
        `batch.out_loc`, attends each row causally over its request's cached prefix plus the new rows,
        and returns [T, H * D]."""

    # CUDA-graph hooks (engine/graph.py). Backends that cannot capture keep these defaults.
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int], rows_per_req: int = 1) -> None:
        raise NotImplementedError(f"attention backend {self.info.name!r} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError

    def set_lengths_on_device(self, batch: Batch, seq_lens: torch.Tensor, table_rows: torch.Tensor) -> None:
        """Inside a captured graph: write the per-request key lengths and page-table rows that
        `prepare_for_replay` would copy from the host, computed by earlier ops of the same graph
        (device-resident speculative steps, `spec/pipeline.py`). Backends that can say so in
        `BackendInfo.lengths_on_device`; with the others speculation verifies synchronously."""
        raise NotImplementedError(f"attention backend {self.info.name!r} cannot take lengths computed on the device")
