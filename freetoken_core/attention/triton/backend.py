"""TritonBackend: store_kv + paged decode (flash-decoding) or extend attention, all Triton kernels.

Per step, `prepare_metadata` sends the batch's integers to the device once (one copy); every layer
then launches store_kv and one attention kernel (decode/verify: the store can be the q/k norm +
rotary kernel's instead, `kv_store_target`). Decode and verify batches (R rows per request,
R = 1 for decode) use the decode kernel; prefill batches use the extend kernel.

Prefill graphs (engine/prefill_graph.py): `init_prefill_graph` / `prepare_prefill_graph` keep static copies
of the extend kernel's five per-request vectors, plus a padding request for the rows past the real ones.

CUDA graphs (engine/graph.py): `init_capture_graph` allocates static metadata and split scratch
for the largest batch; `prepare_for_capture` gives a capture batch metadata that views them; and
`prepare_for_replay` copies a real batch's lengths and table rows into them (padding rows point
at the dummy table row with R keys, which live on the dummy page). The decode grid depends only on
the padded batch size and a split count fixed per size from max_seq_len, never on the lengths;
with more than one split the splits merge inside the decode kernel (decode.py), so decode attention
is one launch per layer either way, its split tickets a static buffer that every launch leaves zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core import Batch, pinned, to_device
from ...kvcache.pool import KVCache
from ..base import AttnBackend, AttnLayout, BackendInfo, KVStoreTarget
from . import interpreter_on
from .decode import alloc_partials, alloc_split_counters, decode_attention, num_kv_splits
from .extend import extend_attention
from .store_kv import store_kv


@dataclass
class TritonAttnMetadata:
    phase: str
    rows_per_req: int
    table_rows: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32: cached + new keys of each request
    # decode / verify
    num_splits: int = 1
    part_out: torch.Tensor | None = None  # [B * R, H, S, D] fp32 split scratch (None when S == 1)
    part_lse: torch.Tensor | None = None
    split_counters: torch.Tensor | None = None  # [B * Hkv] int32 tickets of the in-kernel merge (S > 1)
    # prefill
    prefix_lens: torch.Tensor | None = None  # [B] int32
    extend_lens: torch.Tensor | None = None  # [B] int32
    q_starts: torch.Tensor | None = None  # [B] int32: first row of each request in q
    max_extend: int = 0


@dataclass
class _GraphBuffers:
    """Static state shared by the graphs of one rows_per_req."""

    max_bs: int
    max_seq_len: int
    ints: torch.Tensor  # [2, max_bs] int32: seq_lens, table_rows
    part_out: torch.Tensor
    part_lse: torch.Tensor
    split_counters: torch.Tensor  # [max_bs * Hkv] int32, zero; every decode launch leaves it zero
    metadata: dict[int, TritonAttnMetadata]  # per captured batch size


class TritonBackend(AttnBackend):
    info = BackendInfo(
        name="triton",
        devices=("cuda", "cpu"),  # cpu: under TRITON_INTERPRET=1, fp32/fp16 only
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        supports_page_size_gt1=True,
        supports_cuda_graph=True,
        uniform_extend_graph=True,
        lengths_on_device=True,
        prefill_graph=True,
    )

    def __init__(self, layout: AttnLayout, kv_cache: KVCache, page_table: torch.Tensor) -> None:
        super().__init__(layout, kv_cache, page_table)
        self.device = kv_cache.device
        if self.device.type == "cpu" and not interpreter_on():
            raise RuntimeError(
                "the triton attention backend on CPU needs TRITON_INTERPRET=1 set before "
                "freetoken_core.attention.triton is first imported (use attention_backend='torch' on CPU)"
            )
        if self.device.type == "cpu" and kv_cache.shape.dtype == torch.bfloat16:
            raise ValueError("the Triton interpreter computes bf16 wrongly: use float32 or float16 on CPU")
        if layout.num_heads % layout.num_kv_heads:
            raise ValueError(f"num_heads {layout.num_heads} is not a multiple of num_kv_heads {layout.num_kv_heads}")
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 4  # keeps interpreter runs small while still exercising the split path
        self.dummy_row = page_table.shape[0] - 1
        self._graphs: dict[int, _GraphBuffers] = {}
        self._prefill_ints: torch.Tensor | None = None  # [5, slots] int32: the captured prefill steps' metadata

    # --- metadata ---------------------------------------------------------------------------
    def _to_device(self, rows: list[list[int]]) -> torch.Tensor:
        """One host-to-device copy for all of a step's integer vectors."""
        return to_device(rows, torch.int32, self.device)

    @staticmethod
    def _rows_per_req(batch: Batch) -> int:
        return 1 if batch.phase == "decode" else batch.rows_per_req

    def prepare_metadata(self, batch: Batch) -> None:
        table_rows = [r.table_row for r in batch.reqs]
        if batch.phase == "prefill":
            starts, acc = [], 0
            for n in batch.extend_lens:
                starts.append(acc)
                acc += n
            ints = self._to_device([batch.seq_lens, table_rows, batch.prefix_lens, batch.extend_lens, starts])
            batch.attn_metadata = TritonAttnMetadata(
                phase="prefill", rows_per_req=1, seq_lens=ints[0], table_rows=ints[1],
                prefix_lens=ints[2], extend_lens=ints[3], q_starts=ints[4],
                max_extend=max(batch.extend_lens, default=0),
            )
            return
        rows = self._rows_per_req(batch)
        assert all(n == rows for n in batch.extend_lens), (
            f"a {batch.phase} batch needs {rows} row(s) per request, got {batch.extend_lens}"
        )
        ints = self._to_device([batch.seq_lens, table_rows])
        splits = num_kv_splits(batch.size, self.layout.num_kv_heads, max(batch.seq_lens, default=1), self.num_sms)
        part_out = part_lse = counters = None
        if splits > 1:
            part_out, part_lse = alloc_partials(
                batch.size * rows, self.layout.num_heads, splits, self.layout.head_dim, self.device
            )
            counters = alloc_split_counters(batch.size, self.layout.num_kv_heads, self.device)  # once per step
        batch.attn_metadata = TritonAttnMetadata(
            phase=batch.phase, rows_per_req=rows, seq_lens=ints[0], table_rows=ints[1],
            num_splits=splits, part_out=part_out, part_lse=part_lse, split_counters=counters,
        )

    # --- forward ----------------------------------------------------------------------------
    def kv_store_target(self, layer_id: int, batch: Batch) -> KVStoreTarget | None:
        """Decode and verify batches: the layer's caches and `batch.out_loc`, exactly what `forward`'s
        store_kv writes (the q/k norm + rotary kernel then stores instead: one launch fewer per layer in
        the launch-bound small-batch steps). Prefill keeps store_kv."""
        md = batch.attn_metadata
        if not isinstance(md, TritonAttnMetadata) or md.phase == "prefill":
            return None
        k_cache, v_cache = self.kv_cache.layer(layer_id)
        return KVStoreTarget(k_cache, v_cache, batch.out_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch,
                kv_stored: bool = False) -> torch.Tensor:
        """kv_stored: k/v are already in the cache at `kv_store_target`'s slots (no store_kv launch)."""
        md: TritonAttnMetadata = batch.attn_metadata
        k_cache, v_cache = self.kv_cache.layer(layer_id)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, batch.out_loc)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if md.phase == "prefill":
            out = extend_attention(
                q, k_cache, v_cache, self.page_table, md.table_rows, md.prefix_lens, md.extend_lens,
                md.q_starts, md.max_extend, self.layout.scale,
            )
        else:
            out = decode_attention(
                q, k_cache, v_cache, self.page_table, md.table_rows, md.seq_lens, self.layout.scale,
                rows_per_req=md.rows_per_req, num_splits=md.num_splits,
                part_out=md.part_out, part_lse=md.part_lse, split_counters=md.split_counters,
            )
        return out.view(out.shape[0], -1)

    # --- CUDA graphs ------------------------------------------------------------------------
    def _graph_splits(self, bs: int, max_seq_len: int) -> int:
        return num_kv_splits(bs, self.layout.num_kv_heads, max_seq_len, self.num_sms)

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int], rows_per_req: int = 1) -> None:
        """Static buffers for decode (rows_per_req = 1) or verify graphs of every size in bs_list.
        A second call for the same rows_per_req keeps the buffers when they are big enough: graphs
        captured earlier read them, so they must not be replaced (several graph sets may share them;
        they replay one at a time on one stream)."""
        max_bs = max(bs_list)
        old = self._graphs.get(rows_per_req)
        if old is not None and old.max_bs >= max_bs and old.max_seq_len == max_seq_len:
            return
        max_splits = max(self._graph_splits(bs, max_seq_len) for bs in bs_list)
        part_out, part_lse = alloc_partials(
            max_bs * rows_per_req, self.layout.num_heads, max_splits, self.layout.head_dim, self.device
        )
        ints = torch.zeros(2, max_bs, dtype=torch.int32, device=self.device)
        ints[0].fill_(rows_per_req)
        ints[1].fill_(self.dummy_row)
        counters = alloc_split_counters(max_bs, self.layout.num_kv_heads, self.device)
        self._graphs[rows_per_req] = _GraphBuffers(max_bs, max_seq_len, ints, part_out, part_lse, counters, {})

    def _graph_state(self, batch: Batch) -> tuple[_GraphBuffers, int, int]:
        rows = self._rows_per_req(batch)
        if rows not in self._graphs:
            raise RuntimeError(f"init_capture_graph was not called for rows_per_req={rows}")
        gb = self._graphs[rows]
        bs = batch.padded_size or batch.size
        if bs > gb.max_bs:
            raise ValueError(f"graph batch size {bs} exceeds the captured maximum {gb.max_bs}")
        return gb, rows, bs

    def _fill_static(self, gb: _GraphBuffers, batch: Batch, rows: int, bs: int) -> None:
        n = batch.size
        seq = batch.seq_lens + [rows] * (bs - n)
        table_rows = [r.table_row for r in batch.reqs] + [self.dummy_row] * (bs - n)
        gb.ints[:, :bs].copy_(pinned([seq, table_rows], torch.int32), non_blocking=True)

    def prepare_for_capture(self, batch: Batch) -> None:
        gb, rows, bs = self._graph_state(batch)
        splits = self._graph_splits(bs, gb.max_seq_len)
        md = TritonAttnMetadata(
            phase=batch.phase, rows_per_req=rows, seq_lens=gb.ints[0, :bs], table_rows=gb.ints[1, :bs],
            num_splits=splits,
            part_out=gb.part_out[: bs * rows, :, :splits] if splits > 1 else None,
            part_lse=gb.part_lse[: bs * rows, :, :splits] if splits > 1 else None,
            split_counters=gb.split_counters[: bs * self.layout.num_kv_heads] if splits > 1 else None,
        )
        gb.metadata[bs] = md
        self._fill_static(gb, batch, rows, bs)
        batch.attn_metadata = md

    # --- prefill graphs (engine/prefill_graph.py) ----------------------------------------------
    def init_prefill_graph(self, max_reqs: int) -> None:
        """The extend kernel reads every length from the device, so a captured prefill step needs only
        static copies of its five per-request vectors: max_reqs requests + the padding request."""
        if self._prefill_ints is not None:
            if self._prefill_ints.shape[1] != max_reqs + 1:  # graphs captured earlier read this buffer
                raise RuntimeError(f"prefill graphs were set up for {self._prefill_ints.shape[1] - 1} requests")
            return
        self._prefill_ints = torch.zeros(5, max_reqs + 1, dtype=torch.int32, device=self.device)

    def prepare_prefill_graph(self, batch: Batch, num_rows: int) -> None:
        ints = self._prefill_ints
        if ints is None:
            raise RuntimeError("init_prefill_graph was not called")
        slots, n = ints.shape[1], batch.size
        real = sum(batch.extend_lens)
        if n >= slots or real > num_rows:
            raise ValueError(f"a captured prefill step holds at most {slots - 1} requests and {num_rows} rows; "
                             f"this batch has {n} and {real}")
        starts, acc = [], 0
        for e in batch.extend_lens:
            starts.append(acc)
            acc += e
        pad, rest = num_rows - real, slots - n - 1
        # padding request: rows [real, num_rows) at positions 0.. of the dummy row (its pages are the dummy
        # page, which only padding writes: finite values); slots past it have no rows (their programs exit)
        seq = batch.seq_lens + [pad] + [0] * rest
        table_rows = [r.table_row for r in batch.reqs] + [self.dummy_row] * (rest + 1)
        prefix = batch.prefix_lens + [0] * (rest + 1)
        ext = batch.extend_lens + [pad] + [0] * rest
        q_starts = starts + [real] + [0] * rest
        ints.copy_(pinned([seq, table_rows, prefix, ext, q_starts], torch.int32), non_blocking=True)
        batch.attn_metadata = TritonAttnMetadata(
            phase="prefill", rows_per_req=1, seq_lens=ints[0], table_rows=ints[1], prefix_lens=ints[2],
            extend_lens=ints[3], q_starts=ints[4], max_extend=num_rows,
        )

    def set_lengths_on_device(self, batch: Batch, seq_lens: torch.Tensor, table_rows: torch.Tensor) -> None:
        md: TritonAttnMetadata = batch.attn_metadata
        md.seq_lens.copy_(seq_lens)
        md.table_rows.copy_(table_rows)

    def prepare_for_replay(self, batch: Batch) -> None:
        gb, rows, bs = self._graph_state(batch)
        md = gb.metadata.get(bs)
        if md is None:
            raise RuntimeError(f"no graph was captured for batch size {bs} (rows_per_req={rows})")
        self._fill_static(gb, batch, rows, bs)
        batch.attn_metadata = md
