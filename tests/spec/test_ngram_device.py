"""The device n-gram drafter and greedy acceptance (fixed-shape torch ops) against the host drafter."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_core.spec import NgramProposer
from freetoken_core.spec.ngram_device import append_committed, greedy_accept_rows, propose_device


def pack(seqs: list[list[int]], width: int, fill: int = 9999) -> tuple[torch.Tensor, torch.Tensor]:
    # garbage past each length: the scan must never read it
    hist = torch.full((len(seqs), width), fill, dtype=torch.int32)
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    return hist, torch.tensor([len(s) for s in seqs], dtype=torch.int64)


@pytest.mark.parametrize("k,min_n,max_n", [(4, 1, 3), (1, 1, 1), (8, 2, 4), (3, 1, 2)])
def test_device_drafts_equal_the_host_drafter(k, min_n, max_n):
    rng = random.Random(k * 100 + min_n * 10 + max_n)
    seqs, limits = [], []
    for _ in range(64):
        n = rng.randint(1, 40)
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat n-grams often
        seqs.append([rng.randrange(vocab) for _ in range(n)])
        limits.append(rng.choice([k, k + 5, rng.randint(-1, k)]))
    width = 48
    hist, lens = pack(seqs, width)
    drafts, num = propose_device(hist, lens, torch.tensor(limits), k, min_n, max_n)
    for i, s in enumerate(seqs):
        want = NgramProposer(s, k, max_n, min_n).propose(limits[i])
        assert num[i].item() == len(want), (s, limits[i])
        assert drafts[i, : len(want)].tolist() == want, (s, limits[i])


def test_history_at_full_width_and_periodic_continuation():
    seq = [1, 2, 3] * 5 + [1, 2]  # 17 tokens, width exactly 17
    hist, lens = pack([seq], 17)
    drafts, num = propose_device(hist, lens, torch.tensor([6]), 6, 1, 3)
    assert num.tolist() == [6]
    assert drafts[0].tolist() == NgramProposer(seq, 6).propose() == [3, 1, 2, 3, 1, 2]


def test_greedy_accept_rows_counts_the_leading_matches():
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [4, 4, 4, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [4, 4, 4]])
    num = torch.tensor([3, 3, 3, 2])  # the last request proposed only 2: its third column never counts
    assert greedy_accept_rows(target, drafts, num).tolist() == [3, 1, 0, 2]


def test_append_committed_writes_only_the_committed_columns():
    hist = torch.arange(40, dtype=torch.int32).view(4, 10)
    before = hist.clone()
    rows = torch.tensor([2, 0])
    lens = torch.tensor([3, 8])
    tokens = torch.tensor([[100, 101, 102], [200, 201, 202]])
    append_committed(hist, rows, lens, tokens, torch.tensor([2, 3]))
    want = before.clone()
    want[2, 3:5] = torch.tensor([100, 101], dtype=torch.int32)
    want[0, 8:10] = torch.tensor([200, 201], dtype=torch.int32)  # the third is past the width: dropped
    assert torch.equal(hist, want)
