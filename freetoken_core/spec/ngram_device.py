"""The n-gram prompt-lookup drafter and greedy acceptance as torch ops on a device-resident history.

The same rule as `NgramProposer` (longest n-gram first, latest earlier occurrence, a continuation
that runs into the suffix repeats its period), computed from a token history that lives on the
device, so a verify step can draft from the tokens the previous step committed without a trip
through the host (`spec/pipeline.py`). These are the reference for the pipeline's two Triton
kernels (`ngram_triton`), which the GPU runs inside the step's CUDA graph, and the CPU path.

The scan is O(batch * width * max_ngram) elementwise work per step.
"""

from __future__ import annotations

import torch


def propose_device(
    hist: torch.Tensor, lens: torch.Tensor, max_drafts: torch.Tensor, k: int, min_ngram: int, max_ngram: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [B, S]: each request's tokens (entries at or past lens[b] are ignored); lens [B] int64 >= 1;
    max_drafts [B] int64: at most this many drafts for request b (its length limit).

    Returns drafts [B, k] int64 (columns at or past num_drafts[b] are meaningless) and num_drafts [B]
    int64: min(k, max_drafts[b]) when a match exists, else 0.
    """
    batch, width = hist.shape
    device = hist.device
    idx = torch.arange(width, device=device)[None, :]  # candidate start s of an earlier occurrence
    last = lens[:, None] - 1
    cont = torch.full((batch,), -1, dtype=torch.int64, device=device)  # index of the continuation's first token
    for n in range(max_ngram, min_ngram - 1, -1):
        match = torch.ones((batch, width), dtype=torch.bool, device=device)
        for i in range(n):
            suffix_tok = hist.gather(1, (last - (n - 1) + i).clamp(min=0))  # [B, 1]
            # position s + i; wrap-around entries only reach s > width - 1 - n, which `valid` excludes
            match &= torch.roll(hist, -i, dims=1) == suffix_tok
        # an occurrence needs its continuation to exist: s + n <= lens - 1 (never the suffix itself)
        valid = idx + n <= last
        latest = torch.where(match & valid, idx, -1).amax(dim=1)
        cont = torch.where((cont < 0) & (latest >= 0), latest + n, cont)
    found = cont >= 0
    period = (lens - cont).clamp(min=1)  # >= 1 when found: the continuation starts before the end
    steps = torch.arange(k, device=device)[None, :]
    src = (cont.clamp(min=0)[:, None] + steps % period[:, None]).clamp(max=width - 1)
    drafts = hist.gather(1, src).to(torch.int64)
    num = torch.where(found, max_drafts.clamp(min=0, max=k), torch.zeros_like(max_drafts))
    return drafts, num


def greedy_accept_rows(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """target [B, k+1] (the target's argmax per verify row), drafts [B, k] -> accepted drafts [B]."""
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    ok = (drafts == target[:, :k]) & valid
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def append_committed(
    hist: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor
) -> None:
    """Write tokens[b, :count[b]] into hist[rows[b], lens[b]:] in place, dropping columns at or past
    the history's width."""
    width = hist.shape[1]
    cols = torch.arange(tokens.shape[1], device=hist.device)[None, :]
    at = lens[:, None] + cols
    keep = (cols < count[:, None]) & (at < width)
    r = rows[:, None].expand_as(at)
    hist[r[keep], at[keep]] = tokens.to(hist.dtype)[keep]
