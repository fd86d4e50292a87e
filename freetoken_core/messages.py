"""Messages that leave the scheduler (one per request per step that committed tokens or finished)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DetokenizeMsg:
    uid: int
    next_tokens: list[int]  # every token committed for this request in this step (may be several)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None  # one per next_token, when requested
    top_logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including next_tokens
    error: str | None = None  # set with finish_reason "error"
    spec_accepted: int = 0  # speculative decoding: draft tokens accepted so far
    spec_proposed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @classmethod
    def failed(cls, uid: int, error: str) -> "DetokenizeMsg":
        """The one final message of a request that ends with an error and no tokens."""
        return cls(uid, [], finished=True, finish_reason="error", error=error)


@dataclass
class EngineStats:
    """A snapshot for metrics and tests (free pages must return to total after traffic)."""

    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    page_size: int
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    extra: dict = field(default_factory=dict)
    # prefix cache: prompt tokens looked up and served (totals), cached pages and snapshot slots (hybrids) in use
    prefix_query_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    prefix_cached_pages: int = 0
    prefix_cached_snapshots: int = 0
    # the hybrids' snapshot pool: its slots and those free or evictable (free == total once idle: none leaked)
    prefix_snapshot_slots_total: int = 0
    prefix_snapshot_slots_free: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_pages / max(self.num_total_pages, 1)
