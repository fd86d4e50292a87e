"""Engine.prepare_batch: a step's requests -> its Batch tensors, in one host-to-device copy.

Each request runs positions [cached_len, cached_len + extend_len); its pages must already cover them. A
position whose token is still being sampled on the device (overlap scheduling) gets a placeholder id 0;
`Engine.launch(..., inflight=...)` fills it in. A request is sampled when the step reaches its (virtual)
length; verify steps sample every row.
"""

from __future__ import annotations

import torch

from ..core import Batch, Phase, Req, to_device
from ..kvcache.manager import CacheManager


def build_batch(cache: CacheManager, device: torch.device, phase: Phase, reqs: list[Req], extend_lens: list[int],
                rows_per_req: int = 1) -> Batch:
    if phase == "decode":
        return _decode_batch(cache, device, reqs, rows_per_req)
    ids: list[int] = []
    pos: list[int] = []
    loc: list[int] = []
    sample_rows: list[int] = []
    sample_reqs: list[int] = []
    prefix_lens = []
    row = 0
    for i, (req, n) in enumerate(zip(reqs, extend_lens)):
        start = req.cached_len
        prefix_lens.append(start)
        ids.extend(req.token_slice(start, start + n))
        pos.extend(range(start, start + n))
        loc.extend(cache.slots(req, start, start + n))
        row += n
        if phase == "verify":
            sample_rows.extend(range(row - n, row))
            sample_reqs.extend([i] * n)
        elif start + n >= req.seq_len + req.inflight:
            sample_rows.append(row - 1)
            sample_reqs.append(i)
    return _pack(device, phase, reqs, list(extend_lens), prefix_lens, ids, pos, loc, sample_rows, sample_reqs,
                 rows_per_req)


def _decode_batch(cache: CacheManager, device: torch.device, reqs: list[Req], rows_per_req: int) -> Batch:
    """A decode step (one row per request, every request sampled): the per-step host work of the largest
    batches, without the general path's slices and per-row loops."""
    slot = cache.slot
    ids, pos, loc = [], [], []
    for req in reqs:
        p = req.cached_len
        n_in = len(req.input_ids)
        if p < n_in:
            tok = req.input_ids[p]
        else:  # the token is committed, or still being sampled on the device (0: gathered in launch)
            tok = req.output_ids[p - n_in] if p - n_in < len(req.output_ids) else 0
        ids.append(tok)
        pos.append(p)
        loc.append(slot(req, p))
    rows = list(range(len(reqs)))
    return _pack(device, "decode", reqs, [1] * len(reqs), pos, ids, pos, loc, rows, rows, rows_per_req)


def _pack(device: torch.device, phase: Phase, reqs: list[Req], extend_lens: list[int], prefix_lens: list[int],
          ids: list[int], pos: list[int], loc: list[int], sample_rows: list[int], sample_reqs: list[int],
          rows_per_req: int) -> Batch:
    # one host-to-device copy for the step's index data (the sampled rows too: views of one tensor)
    t = len(ids)
    packed = to_device(ids + pos + loc + sample_rows, torch.int64, device)
    return Batch(
        phase=phase, reqs=reqs, extend_lens=extend_lens, prefix_lens=list(prefix_lens),
        input_ids=packed[:t], positions=packed[t:2 * t], out_loc=packed[2 * t:3 * t], sample_rows=packed[3 * t:],
        sample_reqs=sample_reqs, rows_per_req=rows_per_req,
    )
