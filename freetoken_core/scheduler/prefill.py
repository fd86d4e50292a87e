"""Admission and chunked prefill under a token budget.

A request is admitted only when a page-table row is free and the pool can hold its uncached
tokens plus `decode_rows_per_req` tokens of in-flight headroom, on top of what the running
requests need for their own next step. Prefill work (new prompts, unfinished chunks, retracted
requests) is cut into chunks so one step never runs more than `max_extend_tokens` rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..core import Req
from ..kvcache.manager import CacheManager


@dataclass
class PrefillPlan:
    reqs: list[Req]
    extend_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


def _chunk(req: Req, budget: int, cache: CacheManager) -> int:
    """This step's rows of a prompt: under the budget, and ending where the cache wants a state snapshot."""
    n = min(req.seq_len - req.cached_len, budget)
    limit = cache.chunk_limit(req)
    return n if limit is None else min(n, limit - req.cached_len)


def plan_prefill(
    prefilling: list[Req],
    waiting: deque[Req],
    running: list[Req],
    cache: CacheManager,
    budget: int,
    max_running_req: int,
    headroom: int,
) -> tuple[PrefillPlan, list[Req]]:
    """Choose this step's prefill rows. Returns the plan and the requests newly admitted
    (removed from `waiting`, given a row and pages)."""
    reqs: list[Req] = []
    lens: list[int] = []
    for req in prefilling:
        if budget <= 0:
            break
        n = _chunk(req, budget, cache)
        if cache.pages_needed(req, req.cached_len + n) > cache.num_free_pages:
            continue  # decoders took the pages; they free them by finishing or being retracted
        cache.allocate(req, req.cached_len + n)
        reqs.append(req)
        lens.append(n)
        budget -= n
    # what admitted requests still need (rest of their prompt, a token in flight (overlap scheduling), next
    # step) stays reserved
    reserved = sum(cache.pages_needed(r, r.seq_len + r.inflight + headroom) for r in running)
    admitted: list[Req] = []
    num_admitted = len(running)
    while waiting and budget > 0 and num_admitted < max_running_req and cache.num_free_rows > 0:
        req = waiting[0]
        cache.assign_row(req)
        # the longest cached prefix (whole pages), leaving at least one token to run for the logits
        matched = cache.attach_prefix(req, req.seq_len - 1)
        # the whole uncached sequence plus headroom must fit, not just this chunk: a request that
        # cannot finish its prefill would hold pages that decoders need
        need = cache.pages_needed(req, req.seq_len + headroom)
        if need > cache.num_free_pages - reserved:
            cache.free(req)  # the row back, the prefix unlocked
            break
        waiting.popleft()
        req.cached_len = matched
        if req.num_cached_tokens is None:
            req.num_cached_tokens = min(matched, req.prompt_len)
            cache.count_lookup(req.prompt_len, req.num_cached_tokens)
        n = _chunk(req, budget, cache)
        cache.allocate(req, req.cached_len + n)
        reserved += cache.pages_needed(req, req.seq_len + headroom)
        reqs.append(req)
        lens.append(n)
        admitted.append(req)
        budget -= n
        num_admitted += 1
    return PrefillPlan(reqs, lens), admitted
