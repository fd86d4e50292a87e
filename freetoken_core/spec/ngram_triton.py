"""Triton kernels of the pipelined speculative step (spec/pipeline.py): one launch drafts and builds
the verify rows, one launch accepts and appends. The torch ops of `ngram_device` compute the same
thing as ~80 tiny kernels (~0.45 ms per step in a graph on the H200, as much as SmolLM2's forward);
these are two. `ngram_device` stays the reference (tests/spec/test_ngram_triton.py) and the CPU path.

Both kernels run one program per request slot.

- `prepare`: scans the slot's token history once for the latest earlier occurrence of the suffix
  n-grams (longest n first), proposes up to k drafts (a continuation that reaches the end repeats its
  period, as `NgramProposer` does), and writes the k + 1 verify rows' token ids, positions, cache
  slots (from the page table), the attention key length and the table row.
- `accept`: greedy acceptance against the target's argmax rows, then the committed tokens go into
  the history, the length advances, and one packed row per slot is written for the host.
"""

from __future__ import annotations

import torch

from ..env import configure_triton

configure_triton()  # before `import triton`: interpreted without a GPU (CPU tests)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SCAN_BLOCK = 256


@triton.jit
def _prepare_kernel(
    hist_ptr, hist_width, table_rows_ptr, lens_ptr, limits_ptr, active_ptr,
    page_table_ptr, pages_per_row, page_size,
    ids_ptr, pos_ptr, loc_ptr, drafts_ptr, num_drafts_ptr, seq_lens_ptr, rows_i32_ptr,
    K: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(table_rows_ptr + b).to(tl.int64)
    length = tl.load(lens_ptr + b).to(tl.int64)
    limit = tl.load(limits_ptr + b).to(tl.int64)
    active = tl.load(active_ptr + b)
    hist = hist_ptr + row * hist_width

    # best[n]: the latest end e of an earlier occurrence of the last n tokens (continuation e + 1
    # must exist, so e <= length - 2). run[e]: how many tokens match backwards from e and from the end.
    n_idx = tl.arange(0, NP)
    best = tl.full([NP], -1, tl.int64)
    offs = tl.arange(0, BLOCK)
    for start in range(0, length - 1, BLOCK):
        e = start + offs
        in_range = e <= length - 2
        alive = in_range
        run = tl.zeros([BLOCK], tl.int64)
        for j in tl.static_range(MAX_N):
            ok = alive & (e - j >= 0)  # e <= length - 2, so then also length - 1 - j > 0
            tok = tl.load(hist + e - j, mask=ok, other=-1)
            suf = tl.load(hist + tl.maximum(length - 1 - j, 0))  # used only where ok
            alive = ok & (tok == suf)
            run += alive.to(tl.int64)
        for n in tl.static_range(MIN_N, MAX_N + 1):
            cand = tl.max(tl.where(in_range & (run >= n), e, -1), axis=0)
            best = tl.where(n_idx == n, tl.maximum(best, cand), best)
    cont = -1
    for n in tl.static_range(MIN_N, MAX_N + 1):  # ascending: the longest n with a match wins
        e_n = tl.sum(tl.where(n_idx == n, best, 0), axis=0)
        cont = tl.where(e_n >= 0, e_n + 1, cont)

    i = tl.arange(0, KP)
    period = tl.maximum(length - cont, 1)
    src = tl.minimum(tl.maximum(cont, 0) + i % period, hist_width - 1)
    drafts = tl.load(hist + src, mask=i < K, other=0).to(tl.int64)
    num = tl.where(cont >= 0, tl.minimum(tl.maximum(limit - length - 1, 0), K), 0)
    num = tl.where(active != 0, num, 0)
    tl.store(drafts_ptr + b * K + i, drafts, mask=i < K)
    tl.store(num_drafts_ptr + b, num)

    rows_per_req = K + 1
    last = tl.load(hist + length - 1).to(tl.int64)
    tl.store(ids_ptr + b * rows_per_req, last)
    tl.store(ids_ptr + b * rows_per_req + 1 + i, drafts, mask=i < K)
    j = tl.arange(0, RP)
    pos = length - 1 + j
    page_idx = tl.minimum(pos // page_size, pages_per_row - 1)
    page = tl.load(page_table_ptr + row * pages_per_row + page_idx, mask=j < rows_per_req, other=0).to(tl.int64)
    tl.store(pos_ptr + b * rows_per_req + j, pos, mask=j < rows_per_req)
    tl.store(loc_ptr + b * rows_per_req + j, page * page_size + pos % page_size, mask=j < rows_per_req)
    tl.store(seq_lens_ptr + b, (length + K).to(tl.int32))
    tl.store(rows_i32_ptr + b, row.to(tl.int32))


@triton.jit
def _accept_kernel(
    target_ptr, drafts_ptr, num_drafts_ptr, hist_ptr, hist_width, table_rows_ptr, lens_ptr, active_ptr, out_ptr,
    K: tl.constexpr, KP: tl.constexpr, RP: tl.constexpr,
):
    b = tl.program_id(0)
    rows_per_req = K + 1
    row = tl.load(table_rows_ptr + b).to(tl.int64)
    length = tl.load(lens_ptr + b).to(tl.int64)
    active = tl.load(active_ptr + b)
    num = tl.load(num_drafts_ptr + b).to(tl.int64)
    i = tl.arange(0, KP)
    drafts = tl.load(drafts_ptr + b * K + i, mask=i < K, other=-1)
    target_i = tl.load(target_ptr + b * rows_per_req + i, mask=i < K, other=-2)
    ok = (drafts == target_i) & (i < num)
    accepted = tl.min(tl.where(ok | (i >= K), K, i), axis=0).to(tl.int64)  # the leading run of matches
    count = tl.where(active != 0, accepted + 1, 0)
    j = tl.arange(0, RP)
    target = tl.load(target_ptr + b * rows_per_req + j, mask=j < rows_per_req, other=0).to(tl.int64)
    col = length + j
    tl.store(hist_ptr + row * hist_width + col, target.to(tl.int32), mask=(j < count) & (col < hist_width))
    tl.store(lens_ptr + b, tl.where(active != 0, length + count, 1))
    out = out_ptr + b * (K + 3)
    tl.store(out, accepted)
    tl.store(out + 1, num)
    tl.store(out + 2 + j, target, mask=j < rows_per_req)


def prepare(
    hist: torch.Tensor, table_rows: torch.Tensor, lens: torch.Tensor, limits: torch.Tensor, active: torch.Tensor,
    page_table: torch.Tensor, page_size: int, k: int, min_ngram: int, max_ngram: int,
    ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
    seq_lens: torch.Tensor, rows_i32: torch.Tensor,
) -> None:
    """For slots [0, bs) with bs = lens.numel(): writes ids/pos/loc [bs * (k + 1)], drafts [bs, k],
    num_drafts [bs], seq_lens/rows_i32 [bs] (int32, the attention metadata)."""
    bs = lens.numel()
    _prepare_kernel[(bs,)](
        hist, hist.shape[1], table_rows, lens, limits, active, page_table, page_table.shape[1], page_size,
        ids, pos, loc, drafts, num_drafts, seq_lens, rows_i32,
        K=k, KP=triton.next_power_of_2(k), RP=triton.next_power_of_2(k + 1),
        MIN_N=min_ngram, MAX_N=max_ngram, NP=triton.next_power_of_2(max_ngram + 1), BLOCK=SCAN_BLOCK,
    )


def accept(
    target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, hist: torch.Tensor,
    table_rows: torch.Tensor, lens: torch.Tensor, active: torch.Tensor, out: torch.Tensor,
) -> None:
    """target [bs * (k + 1)] argmax ids. Updates hist and lens in place; out [bs, k + 3] int64."""
    bs, k = drafts.shape
    _accept_kernel[(bs,)](
        target, drafts, num_drafts, hist, hist.shape[1], table_rows, lens, active, out,
        K=k, KP=triton.next_power_of_2(k), RP=triton.next_power_of_2(k + 1),
    )
