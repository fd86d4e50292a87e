"""GraphRunner: CUDA-graph capture and replay of decode (and verify) steps.

One graph per batch size in `bs_list`, all sharing one memory pool, captured largest first so the
smaller graphs reuse its pool blocks. Inputs (token ids, positions, cache slots) live in static
buffers; the attention backend keeps its own static metadata (`init_capture_graph`,
`prepare_for_capture`, `prepare_for_replay`). A batch is padded to the next captured size with
rows that read the dummy page-table row and write their K/V to the dummy page.

The captured callable is `forward(batch) -> Tensor` (default: the target model's fp32 logits of
every row), so a draft model can capture its own graphs on its own backend in the same pool.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable

import torch

from ..core import Batch, Context, Phase, Req, set_context
from ..config import SamplingParams
from ..kvcache.pool import DUMMY_PAGE

log = logging.getLogger(__name__)

ForwardFn = Callable[[Batch], torch.Tensor]


def default_bs_list(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, max_bs + 1, 16))
    out = sorted({b for b in sizes if b <= max_bs} | {max_bs})
    return out


class GraphRunner:
    def __init__(
        self,
        ctx: Context,
        forward: ForwardFn,
        bs_list: list[int],
        dummy_row: int,
        max_seq_len: int,
        device: torch.device,
        rows_per_req: int = 1,
        out_dtype: torch.dtype = torch.float32,
        phase: Phase = "decode",
        ctx_override: dict[str, Any] | None = None,
        batch_hook: Callable[[Batch], None] | None = None,
        pool: Any = None,
        replay_hook: Callable[[Batch], None] | None = None,
    ) -> None:
        if rows_per_req != 1 and phase == "decode":
            phase = "verify"
        self.ctx = ctx
        self.forward = forward
        self.bs_list = sorted(bs_list)
        self.max_bs = self.bs_list[-1]
        self.rows_per_req = rows_per_req
        self.phase: Phase = phase
        self.dummy_row = dummy_row
        self.out_dtype = out_dtype
        self.ctx_override = ctx_override or {}
        self.batch_hook = batch_hook  # at capture, with the static batch
        self.replay_hook = replay_hook  # before each replay, with the real (padded) batch
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        n = self.max_bs * rows_per_req
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.sample_rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._out_buf: torch.Tensor | None = None
        backend = self.ctx_override.get("attn_backend", ctx.attn_backend)
        backend.init_capture_graph(max_seq_len, self.bs_list, rows_per_req)
        self.backend = backend

    # --- capture ----------------------------------------------------------------------------
    def _static_batch(self, reqs: list[Req], bs: int, prefix_lens: list[int]) -> Batch:
        rows = bs * self.rows_per_req
        batch = Batch(
            phase=self.phase, reqs=reqs, extend_lens=[self.rows_per_req] * len(reqs), prefix_lens=prefix_lens,
            input_ids=self.input_ids[:rows], positions=self.positions[:rows], out_loc=self.out_loc[:rows],
            sample_rows=self.sample_rows[:rows],
            sample_reqs=[i for i in range(len(reqs)) for _ in range(self.rows_per_req)],
            rows_per_req=self.rows_per_req, padded_size=bs,
        )
        return batch

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.bs_list):  # largest first: its output buffer and pool blocks serve the rest
            dummies = [Req(uid=-1 - i, input_ids=[0], sampling=SamplingParams()) for i in range(bs)]
            for r in dummies:
                r.table_row = self.dummy_row
            batch = self._static_batch(dummies, bs, [0] * bs)
            self.input_ids.zero_()
            self.positions.zero_()
            self.out_loc.fill_(DUMMY_PAGE)
            with torch.cuda.stream(stream), self.ctx.override(batch=batch, **self.ctx_override) as ctx:
                set_context(ctx)
                try:
                    self.backend.prepare_for_capture(batch)
                    if self.batch_hook:
                        self.batch_hook(batch)
                    for _ in range(2):  # warm up (Triton autotune/compile) outside the graph
                        self._run(batch, bs)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._run(batch, bs)
                finally:
                    set_context(None)
            self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs (batch sizes %s, %d rows per request)", len(self.graphs), self.bs_list, self.rows_per_req)

    def _run(self, batch: Batch, bs: int) -> None:
        out = self.forward(batch)
        n = out.shape[0]  # a row per query row (logits), or whatever the forward returns per batch
        if self._out_buf is None:  # sized by the first (largest) capture, whatever forward returns
            self._out_buf = torch.empty((n, *out.shape[1:]), dtype=self.out_dtype, device=out.device)
        self._out_buf[:n].copy_(out)
        self.outputs[bs] = self._out_buf[:n]

    # --- replay -----------------------------------------------------------------------------
    def can_run(self, batch: Batch) -> bool:
        return (
            batch.phase == self.phase
            and batch.rows_per_req == self.rows_per_req
            and batch.size <= self.max_bs
            and bool(self.graphs)
        )

    def padded_size(self, bs: int) -> int:
        return self.bs_list[bisect.bisect_left(self.bs_list, bs)]

    def replay_as_captured(self, bs: int) -> torch.Tensor:
        """Replay the graph of (captured) size bs on whatever its static buffers hold: for a forward
        that computes its own inputs from device state (`spec/pipeline.py`)."""
        self.graphs[bs].replay()
        return self.outputs[bs]

    def replay(self, batch: Batch) -> torch.Tensor:
        """Run the captured graph for this batch; returns the forward's output for its real rows."""
        bs = self.padded_size(batch.size)
        rows, real = bs * self.rows_per_req, batch.num_tokens
        self.input_ids[:real].copy_(batch.input_ids, non_blocking=True)
        self.positions[:real].copy_(batch.positions, non_blocking=True)
        self.out_loc[:real].copy_(batch.out_loc, non_blocking=True)
        if rows > real:
            self.input_ids[real:rows].zero_()
            self.positions[real:rows].zero_()
            self.out_loc[real:rows].fill_(DUMMY_PAGE)
        batch.padded_size = bs
        self.backend.prepare_for_replay(batch)
        if self.replay_hook:
            self.replay_hook(batch)
        self.graphs[bs].replay()
        return self.outputs[bs][:real]
