"""What a speculative drafter (scheduler/speculative.py) needs of the scheduler that runs it.

A protocol, so the drafter does not import the scheduler (the scheduler imports the drafter):
the requests of a step, retraction, fault isolation, draining, and the one commit path
`_commit_tokens` with the messages out. Widening and rollback are `Req.widen_pending`,
`Req.commit_pending` and `CacheManager.rollback_tail`.
"""

from __future__ import annotations

from typing import Protocol

from ..core import Req
from ..messages import DetokenizeMsg


class SpecHost(Protocol):
    running: list[Req]  # admitted requests, in admission order
    eos_token_ids: set[int]  # read at each step (callers may replace the set)

    @property
    def plain_step_in_flight(self) -> bool: ...

    def decoders(self) -> list[Req]: ...

    def drain(self, msgs: list[DetokenizeMsg]) -> None: ...

    def retract(self, req: Req) -> None: ...

    def mark_in_flight(self, reqs: list[Req]) -> None: ...

    def fail(self, req: Req, error: str) -> DetokenizeMsg: ...

    def message(self, req: Req, tokens: list[int], lp_start: int | None) -> DetokenizeMsg: ...

    def _commit_tokens(self, req: Req, tokens: list[int]) -> int: ...
