"""PrefillGraphRunner: CUDA graphs of small prefill steps (EngineConfig.prefill_graph_max_tokens).

Why: an eager prefill of a short prompt is launch-bound (hundreds of launches cost far more host time than
its device work, benchmarks/RESULTS.md), and no request decodes while it runs. Served load makes that the common case: a client keeps C streams busy
and every finished request brings one new prompt, so prompts arrive one at a time and each is a prefill
step of its own, where an offline run prefills its prompts 16 at a time (issue 13: the 16-stream gap).

What is captured: one graph per token bucket (`prefill_graph_buckets`), each for up to `max_reqs`
requests whose rows add up to at most the bucket. The inputs live in static buffers (token ids,
positions, K/V slots, each request's last row); the attention backend keeps static copies of the
per-request vectors (`AttnBackend.prepare_prefill_graph`). A batch runs in the smallest bucket that holds
its rows. The rows after its real rows belong to one padding request on the dummy page-table row: its K/V
go to the dummy page, and every row computes finite values (a padding row reaches a MoE router like any
other row, and a NaN there would pick no valid expert).

Output: fp32 logits of each request's last row, [max_reqs, vocab]; `replay` returns the rows of the
requests the batch samples (those whose prompt ends in this step), in order.

Hybrid models' GDN layers get the same shape of static state step (`state_hook`): the padding request and
the request slots without rows run on the dummy state slot 0, fresh (initial_zero), so no real request's
conv or recurrent state is read or written by them.

Not covered (eager as before): batches that feed a drafter's features; backends without
`BackendInfo.prefill_graph`.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from ..core import Batch, Context, set_context, to_device
from ..kvcache.pool import DUMMY_PAGE

log = logging.getLogger(__name__)

LogitsFn = Callable[[Batch], torch.Tensor]  # fp32 logits of batch.sample_rows
# before each static step (capture and replay): the model's own static per-request state, from the static
# batch of `rows` rows with `slots` request slots (hybrid models: Engine._prefill_graph_linear_state, engine/linear_steps.py)
StateHook = Callable[[Batch, int, int], None]


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """Row counts to capture, up to max_tokens: 16, 32, 64, then 1.5x and 2x of each power of two
    (96, 128, 192, 256, ...). A batch pads to the next one: at most a third of its rows are padding
    past 64, and a graph costs capture time and a little memory of its own."""
    if max_tokens < 1:
        return []
    sizes = {16, 32, 64}
    p = 64
    while p < max_tokens:
        sizes |= {p + p // 2, 2 * p}
        p *= 2
    return sorted(s for s in sizes if s < max_tokens) + [max_tokens]


class PrefillGraphRunner:
    def __init__(
        self,
        ctx: Context,
        logits_of_sample_rows: LogitsFn,
        buckets: list[int],
        max_reqs: int,
        dummy_row: int,
        device: torch.device,
        pool: object = None,
        state_hook: StateHook | None = None,
    ) -> None:
        if not buckets or max_reqs < 1:
            raise ValueError(f"prefill graphs need token buckets and max_reqs >= 1, got {buckets}, {max_reqs}")
        self.ctx = ctx
        self.forward = logits_of_sample_rows
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        self.max_reqs = max_reqs
        self.dummy_row = dummy_row
        self.device = device
        self.pool = pool
        self.state_hook = state_hook
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.full((n,), DUMMY_PAGE, dtype=torch.int64, device=device)
        self.last_rows = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.backend = ctx.attn_backend
        self.backend.init_prefill_graph(max_reqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._out_buf: torch.Tensor | None = None

    def bucket(self, num_rows: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_rows)]

    def can_run(self, batch: Batch) -> bool:
        return (batch.phase == "prefill" and 0 < batch.size <= self.max_reqs
                and batch.num_tokens <= self.max_tokens and batch.features is None)

    # --- static steps -------------------------------------------------------------------------
    def _static_batch(self, batch: Batch | None, rows: int) -> Batch:
        """The batch a graph of `rows` rows runs: the real batch's requests over the static buffers
        (a capture has none: every row is padding)."""
        reqs = [] if batch is None else batch.reqs
        return Batch(
            phase="prefill", reqs=reqs,
            extend_lens=[] if batch is None else list(batch.extend_lens),
            prefix_lens=[] if batch is None else list(batch.prefix_lens),
            input_ids=self.input_ids[:rows], positions=self.positions[:rows], out_loc=self.out_loc[:rows],
            sample_rows=self.last_rows, sample_reqs=list(range(len(reqs))), padded_size=rows,
        )

    def _fill(self, batch: Batch, rows: int) -> Batch:
        """Copy a real batch into the static buffers of a `rows`-row graph; returns the static batch."""
        real = batch.num_tokens
        self.input_ids[:real].copy_(batch.input_ids, non_blocking=True)
        self.positions[:real].copy_(batch.positions, non_blocking=True)
        self.out_loc[:real].copy_(batch.out_loc, non_blocking=True)
        if rows > real:  # ids and positions left over from an earlier step are valid inputs; slots are not
            self.out_loc[real:rows].fill_(DUMMY_PAGE)
        last, acc = [], 0
        for n in batch.extend_lens:
            acc += n
            last.append(acc - 1)
        last += [0] * (self.max_reqs - len(last))
        self.last_rows.copy_(to_device(last, torch.int64, self.device), non_blocking=True)
        static = self._static_batch(batch, rows)
        self._prepare(static, rows)
        return static

    def _prepare(self, static: Batch, rows: int) -> None:
        self.backend.prepare_prefill_graph(static, rows)
        if self.state_hook is not None:
            self.state_hook(static, rows, self.max_reqs + 1)

    def run_static(self, batch: Batch) -> torch.Tensor:
        """The captured step without the graph: the same static buffers and padding, run eagerly.
        For checking the padding on machines without CUDA; returns what `replay` returns."""
        rows = self.bucket(batch.num_tokens)
        static = self._fill(batch, rows)
        with self.ctx.override(batch=static) as ctx:
            set_context(ctx)
            try:
                out = self.forward(static)
            finally:
                set_context(None)
        return self._sampled(out[: batch.size], batch)

    def _sampled(self, per_req: torch.Tensor, batch: Batch) -> torch.Tensor:
        if len(batch.sample_reqs) == batch.size:  # every prompt ends in this step (the usual case)
            return per_req
        return per_req[to_device(batch.sample_reqs, torch.int64, self.device)]

    # --- capture and replay -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for rows in reversed(self.buckets):  # largest first: its output buffer and pool blocks serve the rest
            batch = self._static_batch(None, rows)
            self.out_loc.fill_(DUMMY_PAGE)
            with torch.cuda.stream(stream), self.ctx.override(batch=batch) as ctx:
                set_context(ctx)
                try:
                    self._prepare(batch, rows)
                    for _ in range(2):  # warm up (Triton compile/autotune) outside the graph
                        self._run(batch, rows)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._run(batch, rows)
                finally:
                    set_context(None)
            self.graphs[rows] = graph
            if self.pool is None:
                self.pool = graph.pool()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d prefill CUDA graphs (up to %d requests, rows %s)", len(self.graphs),
                 self.max_reqs, self.buckets)

    def _run(self, batch: Batch, rows: int) -> None:
        out = self.forward(batch)
        if self._out_buf is None:
            self._out_buf = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        self._out_buf.copy_(out)
        self.outputs[rows] = self._out_buf

    def replay(self, batch: Batch) -> torch.Tensor:
        """fp32 logits of the batch's sampled rows (batch.sample_reqs order), from the captured graph."""
        rows = self.bucket(batch.num_tokens)
        self._fill(batch, rows)
        self.graphs[rows].replay()
        return self._sampled(self.outputs[rows][: batch.size], batch)
