"""Attention through flashinfer's paged wrappers (optional: only when `flashinfer` imports).

Our KV layout is flashinfer's NHD paged layout ([num_pages, page_size, Hkv, D] per layer, k and v
separate), so the cache is passed as-is. flashinfer describes each request's pages in CSR form:
`indptr` [B + 1] (page offsets), `indices` (page ids, request after request) and `last_page_len`
[B] (1..page_size). Decode batches use BatchDecodeWithPagedKVCacheWrapper; prefill and verify
batches use BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask is aligned to the end
of the keys (query i of n sees keys up to kv_len - n + i): exactly our "prefix + i".

`plan` runs once per step (it reads the CPU-side lengths); `run` once per layer. New K/V are
written with KVCache.store.

CUDA graphs: decode only (rows_per_req = 1), flashinfer's documented way (as SGLang does): one
decode wrapper per captured batch size, built with `use_cuda_graph=True` over static indptr /
indices / last-page-length buffers; `plan` runs on the host before the capture and before every
replay and copies the step's CSR into those buffers, so the captured kernels read the new lengths.
Padding rows of a graph batch attend one key on the dummy page. Verify steps (rows_per_req > 1)
and prefill run eagerly through the prefill wrapper. flashinfer is on neither CI nor the GPU
image: tests/attention/test_optional_backends_gpu.py runs where it is installed (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core import Batch
from ..kvcache.pool import KVCache
from .base import AttnBackend, AttnLayout, BackendInfo

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented example size


def import_flashinfer() -> Any:
    """flashinfer's paged wrappers, or ImportError saying how to get them."""
    hint = ("`pip install flashinfer-python` (pure Python: it JIT-compiles its kernels with nvcc on first use, "
            "so the CUDA toolkit must be installed; `flashinfer-cubin` adds prebuilt kernels); or use "
            "attention_backend='triton' (the default on CUDA) or 'torch'")
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(f"attention backend 'flashinfer' needs the `flashinfer` package, which is not "
                          f"installed: {hint}") from e
    missing = [n for n in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
               if not hasattr(flashinfer, n)]
    if missing:
        raise ImportError(f"attention backend 'flashinfer' needs `flashinfer` with {', '.join(missing)}; the "
                          f"installed {getattr(flashinfer, '__version__', 'version')} has none: {hint}")
    return flashinfer


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned decode or prefill wrapper


def paged_kv_csr(batch: Batch, page_table: torch.Tensor, page_size: int, pad_rows: int = 0, pad_row: int = 0):
    """(indptr [B+1] cpu, indices [total pages] on the table's device, last_page_len [B] cpu), int32.
    `pad_rows` more entries (CUDA-graph padding) each hold one key on the first page of `pad_row`."""
    pages_per_row = page_table.shape[1]
    indptr, flat, last = [0], [], []
    rows = [(req.table_row, seq) for req, seq in zip(batch.reqs, batch.seq_lens)] + [(pad_row, 1)] * pad_rows
    for table_row, seq in rows:
        n = (seq + page_size - 1) // page_size
        flat.extend(range(table_row * pages_per_row, table_row * pages_per_row + n))
        indptr.append(indptr[-1] + n)
        last.append(seq - (n - 1) * page_size)
    flat_idx = torch.tensor(flat, dtype=torch.int64).to(page_table.device, non_blocking=True)
    indices = page_table.view(-1)[flat_idx]  # a device gather: no sync
    return (torch.tensor(indptr, dtype=torch.int32), indices, torch.tensor(last, dtype=torch.int32))


class FlashInferBackend(AttnBackend):
    info = BackendInfo(
        name="flashinfer",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        supports_page_size_gt1=True,
        supports_cuda_graph=True,  # decode graphs; verify graphs are not captured (uniform_extend_graph False)
    )

    def __init__(self, layout: AttnLayout, kv_cache: KVCache, page_table: torch.Tensor) -> None:
        flashinfer = import_flashinfer()
        super().__init__(layout, kv_cache, page_table)
        if kv_cache.device.type != "cuda":
            raise ValueError("attention backend 'flashinfer' runs on CUDA only; use 'torch' on CPU")
        self.dtype = kv_cache.shape.dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_cache.device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._flashinfer = flashinfer
        self._graph_wrappers: dict[int, Any] = {}  # captured batch size -> its use_cuda_graph decode wrapper
        self._dummy_row = page_table.shape[0] - 1  # CacheManager's last row: all dummy pages

    def _plan_decode(self, wrapper: Any, batch: Batch, pad_rows: int = 0) -> None:
        ly = self.layout
        indptr, indices, last = paged_kv_csr(batch, self.page_table, self.page_size, pad_rows, self._dummy_row)
        wrapper.plan(
            indptr, indices, last, ly.num_heads, ly.num_kv_heads, ly.head_dim, self.page_size,
            pos_encoding_mode="NONE", sm_scale=ly.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        batch.attn_metadata = FlashInferMetadata(wrapper)

    def prepare_metadata(self, batch: Batch) -> None:
        ly = self.layout
        if batch.phase == "decode":
            self._plan_decode(self.decode_wrapper, batch)
            return
        indptr, indices, last = paged_kv_csr(batch, self.page_table, self.page_size)
        qo_indptr = torch.zeros(batch.size + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.int32), 0)
        self.prefill_wrapper.plan(
            qo_indptr, indptr, indices, last, ly.num_heads, ly.num_kv_heads, ly.head_dim, self.page_size,
            causal=True, sm_scale=ly.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        batch.attn_metadata = FlashInferMetadata(self.prefill_wrapper)

    # --- CUDA graphs (decode) -------------------------------------------------------------------
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int], rows_per_req: int = 1) -> None:
        if rows_per_req != 1:
            raise NotImplementedError("attention backend 'flashinfer' captures decode graphs only (rows_per_req=1); "
                                      "verify steps run eagerly")
        pages_per_row = self.page_table.shape[1]
        dev = self.page_table.device
        for bs in bs_list:
            if bs in self._graph_wrappers:  # graphs captured earlier read its buffers: keep them
                continue
            self._graph_wrappers[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(bs * pages_per_row, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev),
            )

    def _graph_wrapper(self, batch: Batch) -> tuple[Any, int]:
        if batch.phase != "decode" or batch.rows_per_req != 1:
            raise RuntimeError(f"attention backend 'flashinfer' has no {batch.phase} graphs "
                               f"(rows_per_req={batch.rows_per_req})")
        bs = batch.padded_size or batch.size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            raise RuntimeError(f"no flashinfer graph wrapper for batch size {bs}: init_capture_graph was not called for it")
        return wrapper, bs - batch.size

    def prepare_for_capture(self, batch: Batch) -> None:
        wrapper, pad = self._graph_wrapper(batch)
        self._plan_decode(wrapper, batch, pad)

    def prepare_for_replay(self, batch: Batch) -> None:
        wrapper, pad = self._graph_wrapper(batch)
        self._plan_decode(wrapper, batch, pad)  # host plan; copies the CSR into the captured buffers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        self.kv_cache.store(layer_id, batch.out_loc, k, v)
        md: FlashInferMetadata = batch.attn_metadata
        out = md.wrapper.run(q.contiguous(), self.kv_cache.layer(layer_id))  # [T, H, D]
        return out.reshape(out.shape[0], -1)
