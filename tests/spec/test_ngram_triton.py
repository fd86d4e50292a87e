"""The pipelined speculative step's Triton kernels (spec/ngram_triton.py) against the torch reference
(spec/ngram_device.py). CPU: under the Triton interpreter; GPU: compiled."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_core.spec import ngram_triton
from freetoken_core.spec.ngram_device import append_committed, greedy_accept_rows, propose_device

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_state(seed: int, batch: int, width: int, rows: int, k: int):
    rng = random.Random(seed)
    hist = torch.randint(0, 7, (rows, width), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    table_rows = torch.tensor(rng.sample(range(rows), batch), dtype=torch.int64)
    lens, limits = [], []
    for _ in range(batch):
        n = rng.choice([1, 2, 3, rng.randint(1, width - k), width - k])
        lens.append(n)
        limits.append(rng.choice([n, n + 1, n + 2, n + k + 1, width]))
    vocab_small = hist % 3  # many repeats: matches of every length
    hist = torch.where(torch.rand(hist.shape, generator=torch.Generator().manual_seed(seed + 1)) < 0.7, vocab_small, hist)
    active = torch.tensor([1] * (batch - 1) + [0], dtype=torch.int32)  # the last slot is idle (padding)
    return hist.to(DEV), table_rows.to(DEV), torch.tensor(lens).to(DEV), torch.tensor(limits).to(DEV), active.to(DEV)


@pytest.mark.parametrize("k,min_n,max_n,page_size", [(4, 1, 3, 1), (8, 2, 4, 4), (3, 1, 1, 16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_and_accept_match_the_torch_reference(k, min_n, max_n, page_size, seed):
    batch, width, rows = 6, 300, 9  # width > the kernel's scan block: several blocks
    hist, table_rows, lens, limits, active = make_state(seed, batch, width, rows, k)
    pages_per_row = (width + page_size - 1) // page_size
    page_table = torch.randperm(rows * pages_per_row, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    page_table = page_table.view(rows, pages_per_row).to(DEV)
    r = k + 1
    ids, pos, loc = (torch.full((batch * r,), -7, dtype=torch.int64, device=DEV) for _ in range(3))
    drafts = torch.zeros(batch, k, dtype=torch.int64, device=DEV)
    num = torch.zeros(batch, dtype=torch.int64, device=DEV)
    seq_lens = torch.zeros(batch, dtype=torch.int32, device=DEV)
    rows_i32 = torch.zeros(batch, dtype=torch.int32, device=DEV)
    ngram_triton.prepare(hist, table_rows, lens, limits, active, page_table, page_size, k, min_n, max_n,
                         ids, pos, loc, drafts, num, seq_lens, rows_i32)

    mine = hist.index_select(0, table_rows)
    want_drafts, want_num = propose_device(mine, lens, limits - lens - 1, k, min_n, max_n)
    want_num = torch.where(active != 0, want_num, torch.zeros_like(want_num))
    assert num.tolist() == want_num.tolist()
    assert torch.equal(drafts, want_drafts)  # every column, also past num (the padded rows' inputs)
    last = mine.gather(1, (lens - 1)[:, None]).to(torch.int64)
    assert torch.equal(ids.view(batch, r), torch.cat([last, want_drafts], dim=1))
    want_pos = (lens - 1)[:, None] + torch.arange(r, device=DEV)[None, :]
    assert torch.equal(pos.view(batch, r), want_pos)
    want_loc = page_table[table_rows[:, None], want_pos // page_size].to(torch.int64) * page_size + want_pos % page_size
    assert torch.equal(loc.view(batch, r), want_loc)
    assert seq_lens.tolist() == (lens + k).tolist() and rows_i32.tolist() == table_rows.tolist()

    # a target that agrees with a prefix of each request's drafts
    g = torch.Generator().manual_seed(seed + 5)
    target = torch.randint(0, 7, (batch, r), generator=g).to(DEV)
    agree = torch.randint(0, k + 1, (batch,), generator=g).to(DEV)
    cols = torch.arange(k, device=DEV)[None, :]
    target[:, :k] = torch.where(cols < agree[:, None], drafts, target[:, :k])
    hist_ref, lens_ref = hist.clone(), lens.clone()
    out = torch.zeros(batch, k + 3, dtype=torch.int64, device=DEV)
    ngram_triton.accept(target.view(-1), drafts, num, hist, table_rows, lens, active, out)

    accepted = greedy_accept_rows(target, drafts, num)
    on = active != 0
    count = torch.where(on, accepted + 1, torch.zeros_like(accepted))
    append_committed(hist_ref, table_rows, lens_ref, target, count)
    lens_ref = torch.where(on, lens_ref + count, torch.ones_like(lens_ref))
    assert out[:, 0].tolist() == accepted.tolist() and out[:, 1].tolist() == num.tolist()
    assert torch.equal(out[:, 2:], target)
    assert lens.tolist() == lens_ref.tolist()
    assert torch.equal(hist, hist_ref)
