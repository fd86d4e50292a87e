"""Decode batches: one row per request, pages for the new token, retraction when the pool is dry."""

from __future__ import annotations

from typing import Callable

from ..core import Req
from ..kvcache.manager import CacheManager

LengthFn = Callable[[Req], int]


def _seq_len(r: Req) -> int:
    return r.seq_len


def plan_decode(
    decoders: list[Req], running: list[Req], cache: CacheManager, length: LengthFn = _seq_len
) -> tuple[list[Req], list[Req]]:
    """Allocate each decoder's page for the token it writes this step. When the pool cannot cover
    them all, retract the most recently admitted requests (they lose the least work) until it can.
    Returns (requests to decode, requests to retract); the caller frees the retracted ones."""
    batch = list(decoders)
    victims: list[Req] = []
    candidates = [r for r in reversed(running)]  # newest first

    def shortfall() -> int:
        need = cache.pages_needed_total(batch, [length(r) for r in batch])
        freed = sum(cache.pages_released_by(v) for v in victims)
        return need - (cache.num_free_pages + freed)

    while batch and shortfall() > 0 and len(victims) < len(running) - 1:
        victim = candidates.pop(0)
        victims.append(victim)
        if victim in batch:
            batch.remove(victim)
    return batch, victims


def allocate_decode(batch: list[Req], cache: CacheManager, length: LengthFn = _seq_len) -> None:
    """Pages for every position the step writes (length(r) tokens: the last is this step's row).
    Only a request whose row crosses into a new page allocates (one in page_size steps)."""
    lengths = [length(r) for r in batch]
    if cache.pages_needed_total(batch, lengths) == 0:
        return
    for r, n in zip(batch, lengths):
        cache.allocate(r, n)
