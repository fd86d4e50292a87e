"""The attention-backend interface: per-batch metadata, per-layer attention over the paged cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

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
    prefill_graph: bool = False  # implements init_prefill_graph / prepare_prefill_graph (engine/prefill_graph.py)


@dataclass
class AttnLayout:
    """What every backend needs to know about the model's attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class KVStoreTarget(NamedTuple):
    """Where one layer's new K/V rows of a batch go, for a kernel that produces them to store them
    itself (FREETOKEN_ROTARY_STORE_KV: the q/k norm + rotary kernel) instead of the backend's store.
    A tuple so that kernels, which import nothing from attention/, can take it as (k_cache, v_cache,
    out_loc)."""

    k_cache: torch.Tensor  # [pages, page_size, Hkv, D] (KVCache's layout), in the cache's dtype
    v_cache: torch.Tensor
    out_loc: torch.Tensor  # [T] int32/int64: flat slot (page * page_size + offset) of each new row


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
        and returns [T, H * D]. Backends whose `kv_store_target` can return a target also take
        `kv_stored: bool = False`: True when the caller's kernel already wrote k/v there."""

    def kv_store_target(self, layer_id: int, batch: Batch) -> KVStoreTarget | None:
        """Where a kernel that produces layer `layer_id`'s new k/v rows may write them itself, laid out
        and converted exactly as this backend's own store would, or None when the backend (or this
        batch's phase) needs its own store. A caller that writes there says so: `forward(...,
        kv_stored=True)`. Default: None (the backend stores in forward)."""
        return None

    # CUDA-graph hooks (engine/graph.py). Backends that cannot capture keep these defaults.
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int], rows_per_req: int = 1) -> None:
        raise NotImplementedError(f"attention backend {self.info.name!r} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError

    def init_prefill_graph(self, max_reqs: int) -> None:
        """Static metadata for captured prefill steps of up to max_reqs requests (engine/prefill_graph.py);
        backends that can say so in `BackendInfo.prefill_graph`."""
        raise NotImplementedError(f"attention backend {self.info.name!r} cannot capture prefill steps")

    def prepare_prefill_graph(self, batch: Batch, num_rows: int) -> None:
        """Point `batch.attn_metadata` at the static prefill metadata, filled from the batch: its requests,
        then one padding request that owns rows [batch rows, num_rows) on the dummy page-table row (prefix
        0), then request slots without rows. Capture and every replay call it."""
        raise NotImplementedError

    def set_lengths_on_device(self, batch: Batch, seq_lens: torch.Tensor, table_rows: torch.Tensor) -> None:
        """Inside a captured graph: write the per-request key lengths and page-table rows that
        `prepare_for_replay` would copy from the host, computed by earlier ops of the same graph
        (device-resident speculative steps, `spec/pipeline.py`). Backends that can say so in
        `BackendInfo.lengths_on_device`; with the others speculation verifies synchronously."""
        raise NotImplementedError(f"attention backend {self.info.name!r} cannot take lengths computed on the device")
