"""The serialisable step plan rank 0 broadcasts: everything a worker needs to run the same forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..core import Batch, Req


@dataclass
class StepPlan:
    phase: str
    input_ids: list[int]
    positions: list[int]
    out_loc: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    rows_per_req: int
    table_rows: list[int]
    pages: list[list[int]]  # each request's pages, in order (its page-table row up to now)
    sample_rows: list[int]  # rows whose logits the LM head gathers (none: no LM head this step)

    @classmethod
    def of(cls, batch: Batch, pages: list[list[int]]) -> "StepPlan":
        return cls(batch.phase, batch.input_ids.tolist(), batch.positions.tolist(), batch.out_loc.tolist(),
                   list(batch.prefix_lens), list(batch.extend_lens), batch.rows_per_req,
                   [r.table_row for r in batch.reqs], pages, batch.sample_rows.tolist())

    def batch(self, device: torch.device) -> Batch:
        reqs = []
        for i, row in enumerate(self.table_rows):
            r = Req(uid=i, input_ids=[0], sampling=SamplingParams())
            r.table_row = row
            reqs.append(r)
        ints = dict(dtype=torch.int64, device=device)
        return Batch(
            phase=self.phase, reqs=reqs, extend_lens=self.extend_lens, prefix_lens=self.prefix_lens,
            input_ids=torch.tensor(self.input_ids, **ints), positions=torch.tensor(self.positions, **ints),
            out_loc=torch.tensor(self.out_loc, **ints), sample_rows=torch.tensor(self.sample_rows, **ints),
            sample_reqs=[], rows_per_req=self.rows_per_req,
        )
