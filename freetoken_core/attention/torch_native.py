"""Plain-torch attention over the paged cache: works on CPU and CUDA, the reference for every
fast backend. Requests are padded to one [B, max_q] x [B, max_kv] problem per step and run by
`scaled_dot_product_attention` with a boolean mask (causal within the request, nothing past its
length)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Batch
from .base import AttnBackend, BackendInfo


@dataclass
class TorchAttnMetadata:
    kv_slots: torch.Tensor  # [B, max_kv] flat cache slots of each request's keys (padding: any valid slot)
    q_index: torch.Tensor  # [B, max_q] row of the batch for each padded query (padding: 0)
    q_valid: torch.Tensor  # [B, max_q] bool
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool: True = attend
    one_row_each: bool = False  # every request runs exactly one row (decode): no query padding
    mask_needed: bool = True  # False when every key of every row is visible (one decoding request)


def build_torch_metadata(batch: Batch, page_table: torch.Tensor, page_size: int) -> TorchAttnMetadata:
    dev = page_table.device
    extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    seq = prefix + extend
    max_q, max_kv = int(extend.max()), int(seq.max())
    rows = torch.tensor([r.table_row for r in batch.reqs], dtype=torch.int64, device=dev)
    pos_k = torch.arange(max_kv, device=dev)
    kv_slots = page_table[rows][:, pos_k // page_size].to(torch.int64) * page_size + pos_k % page_size
    starts = torch.cumsum(extend, 0) - extend
    i = torch.arange(max_q)
    q_valid = i[None, :] < extend[:, None]
    q_index = torch.where(q_valid, starts[:, None] + i[None, :], torch.zeros((), dtype=torch.int64))
    q_pos = prefix[:, None] + i[None, :]  # absolute position of each query
    j = torch.arange(max_kv)
    mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < seq[:, None, None])
    mask |= ~q_valid[:, :, None] & (j == 0)[None, None, :]  # padded queries see one key: no NaN rows
    return TorchAttnMetadata(kv_slots, q_index.to(dev), q_valid.to(dev), mask[:, None].to(dev), one_row_each=max_q == 1,
                             mask_needed=not (max_q == 1 and len(batch.reqs) == 1))


class TorchNativeBackend(AttnBackend):
    info = BackendInfo(
        name="torch",
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
    )

    def prepare_metadata(self, batch: Batch) -> None:
        batch.attn_metadata = build_torch_metadata(batch, self.page_table, self.page_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md: TorchAttnMetadata = batch.attn_metadata
        self.kv_cache.store(layer_id, batch.out_loc, k, v)
        kf, vf = self.kv_cache.flat(layer_id)
        # decode: rows are already one per request, so skip the query gather and scatter
        qp = (q[:, None] if md.one_row_each else q[md.q_index]).transpose(1, 2)  # [B, H, max_q, D]
        kp = kf[md.kv_slots].transpose(1, 2)  # [B, Hkv, max_kv, D]
        vp = vf[md.kv_slots].transpose(1, 2)
        if kp.dtype != q.dtype:
            kp, vp = kp.to(q.dtype), vp.to(q.dtype)
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=md.mask if md.mask_needed else None, scale=self.layout.scale,
            enable_gqa=self.layout.num_heads != self.layout.num_kv_heads,
        )
        out = out[:, :, 0] if md.one_row_each else out.transpose(1, 2)[md.q_valid]  # [T, H, D] in row order
        return out.reshape(out.shape[0], -1)
