"""Attention through flash-attn's paged-KV entry points (optional: only when `flash_attn` imports).

flash-attn reads a paged cache laid out [num_blocks, page_block_size, Hkv, D] with a
`block_table` [B, max_blocks_per_seq] int32: the same layout and table as ours, so each step
passes `page_table[rows]`. Its paged kernels need page_block_size to be a multiple of 256
(documented in flash_attn_with_kvcache); other page sizes are refused at construction.

- decode / verify (R rows per request): `flash_attn_with_kvcache(q [B, R, H, D], ...,
  cache_seqlens, block_table, causal=True)`.
- prefill: `flash_attn_varlen_func(q [T, H, D], k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, ...,
  causal=True, block_table=...)`, cu_seqlens_k counting cached + new keys.
Both align the causal mask to the end of the keys (query i of n sees keys up to kv_len - n + i),
which is our "prefix + i" since the new K/V are stored first (KVCache.store).

flash-attn-4 (the CuTe-DSL build: pure Python, kernels compiled at first use; it installs
`flash_attn.cute`) is taken when flash-attn 2.x is absent: every phase goes through its
`flash_attn_varlen_func(q [T, H, D], k_cache, v_cache, cu_seqlens_q, seqused_k=<keys per request>,
page_table=...)` (with a page table it takes per-request key counts, not cu_seqlens_k), any page
size. Its TMA page loads read whole pages, rows past a request's keys included: they must be
finite, and ours are (the cache is zero-initialised and only ever holds K/V).

Neither is installed on CI or on the GPU image; without both the backend refuses at start and says
how to install one (import_flash_attn). tests/attention/test_optional_backends_gpu.py runs it where
one is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core import Batch
from ..kvcache.pool import KVCache
from .base import AttnBackend, AttnLayout, BackendInfo

FA_PAGE_MULTIPLE = 256


FA_INSTALL_HINT = (
    "install flash-attn 2.x, built against this torch and CUDA: `pip install flash-attn --no-build-isolation` "
    "(PyPI has only its source: the build needs nvcc and takes hours; prebuilt wheels for some torch/CUDA pairs "
    "are on github.com/Dao-AILab/flash-attention/releases); or flash-attn-4, the CuTe-DSL build (pure Python, "
    "kernels compiled at first use): `pip install flash-attn-4`; or use attention_backend='triton' (the default "
    "on CUDA) or 'torch'"
)


@dataclass(frozen=True)
class FlashAttnAPI:
    version: int  # 2: flash-attn 2.x; 4: flash-attn-4 (CuTe DSL)
    varlen: Any  # flash_attn_varlen_func of that version
    with_kvcache: Any = None  # flash-attn 2.x only


def import_flash_attn() -> FlashAttnAPI:
    """flash-attn 2.x's paged-KV entry points, else flash-attn-4's, or ImportError saying how to get one."""
    try:
        import flash_attn
    except ImportError as e:
        raise ImportError(f"attention backend 'fa' needs the `flash_attn` package, which is not installed: "
                          f"{FA_INSTALL_HINT}") from e
    if hasattr(flash_attn, "flash_attn_with_kvcache") and hasattr(flash_attn, "flash_attn_varlen_func"):
        return FlashAttnAPI(2, flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache)
    try:  # flash-attn-4 installs `flash_attn` as a namespace package holding `cute`
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (a missing CuTe DSL, a broken install: say which)
        version = getattr(flash_attn, "__version__", "unknown version")
        raise ImportError(
            f"attention backend 'fa' needs flash-attn 2.x's paged-KV API or flash-attn-4's `flash_attn.cute`; the "
            f"installed `flash_attn` ({version}) has neither ({type(e).__name__}: {e}): {FA_INSTALL_HINT}") from e
    return FlashAttnAPI(4, flash_attn_varlen_func)


@dataclass
class FlashAttnMetadata:
    block_table: torch.Tensor  # [B, pages_per_row] int32
    seq_lens: torch.Tensor  # [B] int32
    rows_per_req: int
    cu_seqlens_q: torch.Tensor | None = None  # prefill: [B + 1] int32
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


def _cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


class FlashAttnBackend(AttnBackend):
    info = BackendInfo(
        name="fa",
        devices=("cuda",),
        dtypes=(torch.float16, torch.bfloat16),
        supports_page_size_gt1=True,
        supports_cuda_graph=False,
    )

    def __init__(self, layout: AttnLayout, kv_cache: KVCache, page_table: torch.Tensor) -> None:
        self.api = import_flash_attn()
        super().__init__(layout, kv_cache, page_table)
        if kv_cache.device.type != "cuda":
            raise ValueError("attention backend 'fa' runs on CUDA only; use 'torch' on CPU")
        if self.api.version == 2 and self.page_size % FA_PAGE_MULTIPLE:
            raise ValueError(
                f"attention backend 'fa' with flash-attn 2.x needs page_size to be a multiple of {FA_PAGE_MULTIPLE} "
                f"(flash-attn's paged KV limit), got {self.page_size}"
            )

    def prepare_metadata(self, batch: Batch) -> None:
        dev = self.page_table.device
        rows = torch.tensor([r.table_row for r in batch.reqs], dtype=torch.int64).to(dev, non_blocking=True)
        seq_lens = batch.seq_lens
        if self.api.version == 4:  # one varlen call for every phase: per-request query rows and key counts
            ints = torch.tensor([_cumsum0(batch.extend_lens), seq_lens + [0]], dtype=torch.int32).to(dev, non_blocking=True)
            batch.attn_metadata = FlashAttnMetadata(
                block_table=self.page_table[rows], seq_lens=ints[1, :-1], rows_per_req=1, cu_seqlens_q=ints[0],
                max_seqlen_q=max(batch.extend_lens), max_seqlen_k=max(seq_lens),
            )
            return
        if batch.phase == "prefill":
            ints = torch.tensor(
                [seq_lens, _cumsum0(batch.extend_lens)[1:], _cumsum0(seq_lens)[1:]], dtype=torch.int32
            ).to(dev, non_blocking=True)
            zero = torch.zeros(1, dtype=torch.int32, device=dev)
            batch.attn_metadata = FlashAttnMetadata(
                block_table=self.page_table[rows], seq_lens=ints[0], rows_per_req=1,
                cu_seqlens_q=torch.cat([zero, ints[1]]), cu_seqlens_k=torch.cat([zero, ints[2]]),
                max_seqlen_q=max(batch.extend_lens), max_seqlen_k=max(seq_lens),
            )
            return
        rows_per_req = 1 if batch.phase == "decode" else batch.rows_per_req
        batch.attn_metadata = FlashAttnMetadata(
            block_table=self.page_table[rows],
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            rows_per_req=rows_per_req,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        self.kv_cache.store(layer_id, batch.out_loc, k, v)
        md: FlashAttnMetadata = batch.attn_metadata
        k_cache, v_cache = self.kv_cache.layer(layer_id)
        num_rows, num_heads, head_dim = q.shape
        if self.api.version == 4:
            out, _lse = self.api.varlen(
                q.contiguous(), k_cache, v_cache, cu_seqlens_q=md.cu_seqlens_q, seqused_k=md.seq_lens,
                max_seqlen_q=md.max_seqlen_q, max_seqlen_k=md.max_seqlen_k, page_table=md.block_table,
                softmax_scale=self.layout.scale, causal=True,
            )
        elif md.cu_seqlens_q is not None:
            out = self.api.varlen(
                q.contiguous(), k_cache, v_cache, md.cu_seqlens_q, md.cu_seqlens_k, md.max_seqlen_q,
                md.max_seqlen_k, softmax_scale=self.layout.scale, causal=True, block_table=md.block_table,
            )
        else:
            qb = q.contiguous().view(-1, md.rows_per_req, num_heads, head_dim)
            out = self.api.with_kvcache(
                qb, k_cache, v_cache, cache_seqlens=md.seq_lens, block_table=md.block_table,
                softmax_scale=self.layout.scale, causal=True,
            )
        return out.reshape(num_rows, num_heads * head_dim)
