"""The GDN layers' per-step metadata (kvcache.linear_state.LinearStateStep) that the engine builds: one for
each eager batch, and the static ones that captured graphs read, refilled before every replay."""

from __future__ import annotations

import torch

from ..core import Batch, to_device
from ..kvcache.linear_state import LinearStatePool, LinearStateStep, slot_of_row


def _bounds(extend_lens: list[int]) -> list[int]:
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    return cu


class LinearStateSteps:
    def __init__(self, pool: LinearStatePool, dummy_row: int, device: torch.device) -> None:
        self.pool = pool
        self.dummy_row = dummy_row
        self.device = device
        self._graph_steps: dict[tuple[int, int], LinearStateStep] = {}  # (rows per request, batch size)
        # the prefill graphs' step and its packed int buffer (slot ids | cu_seqlens | fresh)
        self._prefill: tuple[LinearStateStep, torch.Tensor] | None = None

    def _slots(self, batch: Batch) -> list[int]:
        return [slot_of_row(r.table_row, self.dummy_row) for r in batch.reqs]

    def for_batch(self, batch: Batch) -> LinearStateStep:
        """Uniform rows (decode, verify) or varlen (prefill)."""
        slots = self._slots(batch)
        rows = batch.rows_per_req
        if batch.phase in ("decode", "verify") and all(n == rows for n in batch.extend_lens):
            dev = to_device([slots, [rows] * len(slots)], torch.int64, self.device)
            return LinearStateStep(self.pool, dev[0], varlen=False, num_rows=dev[1], rows_per_req=rows,
                                   write_state=batch.phase != "verify")
        dev = to_device([slots, _bounds(batch.extend_lens)[1:], [int(p == 0) for p in batch.prefix_lens]],
                        torch.int64, self.device)
        cu_seqlens = torch.cat([dev[1].new_zeros(1), dev[1]])
        return LinearStateStep(self.pool, dev[0], varlen=True, cu_seqlens=cu_seqlens, initial_zero=dev[2].bool())

    def for_graph(self, batch: Batch) -> LinearStateStep:
        """Decode / verify graphs (GraphRunner, capture and replay): the graph of each (rows, size) reads its
        slots and row counts from static buffers; padded rows use the dummy slot 0."""
        rows, bs = batch.rows_per_req, batch.padded_size or batch.size
        step = self._graph_steps.get((rows, bs))
        if step is None:
            step = LinearStateStep(self.pool, torch.zeros(bs, dtype=torch.int64, device=self.device), varlen=False,
                                   num_rows=torch.full((bs,), rows, dtype=torch.int64, device=self.device),
                                   rows_per_req=rows, write_state=batch.phase != "verify")
            self._graph_steps[(rows, bs)] = step
        slots = self._slots(batch) + [0] * (bs - batch.size)
        step.slot_ids.copy_(to_device(slots, torch.int64, self.device), non_blocking=True)
        return step

    def for_prefill_graph(self, batch: Batch, rows: int, slots: int) -> LinearStateStep:
        """Prefill graphs (PrefillGraphRunner, capture and replay): the varlen step in static buffers (one set;
        the graphs replay one at a time). Request slots past the batch's requests are the padding request
        (rows [real, rows)) and empty ones, all on the dummy state slot 0, fresh."""
        if self._prefill is None:
            ints = torch.zeros(3 * slots + 1, dtype=torch.int64, device=self.device)
            step = LinearStateStep(self.pool, ints[:slots], varlen=True, cu_seqlens=ints[slots:2 * slots + 1],
                                   initial_zero=torch.zeros(slots, dtype=torch.bool, device=self.device))
            self._prefill = (step, ints)
        step, ints = self._prefill
        pad = slots - batch.size
        cu = _bounds(batch.extend_lens) + [rows] * pad  # the padding request ends at `rows`; the empty slots too
        fresh = [int(p == 0) for p in batch.prefix_lens] + [1] * pad
        ints.copy_(to_device(self._slots(batch) + [0] * pad + cu + fresh, torch.int64, self.device), non_blocking=True)
        step.initial_zero.copy_(ints[2 * slots + 1:].bool())
        return step
