"""The state one step shares: requests, the batch being run, and the step Context.

A model reads the current batch and attention backend from the Context, never from the
scheduler: `get_context()` is the one piece of global state, set by the engine per step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Literal

import torch

from .config import SamplingParams

if TYPE_CHECKING:
    from .attention.base import AttnBackend
    from .kvcache.pool import KVCache


Phase = Literal["prefill", "decode", "verify"]


@dataclass(eq=False)  # identity semantics: requests live in queues and lists
class Req:
    """One generation request and its progress.

    Token layout: `input_ids + output_ids` is the sequence. `cached_len` tokens of it have their
    K/V in the paged cache. A decode step feeds the last token (position seq_len - 1).
    """

    uid: int
    input_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    table_row: int = -1  # page-table row, -1 while not admitted
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    inflight: int = 0  # tokens sampled on the device, not yet committed (overlap scheduling)
    # speculative decoding: provisional rows appended to the sequence for a verify step
    num_pending: int = 0
    pending_ids: list[int] = field(default_factory=list)  # the draft tokens of those rows
    spec_accepted: int = 0
    spec_proposed: int = 0
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served at its first admission

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def written_len(self) -> int:
        """Tokens whose K/V this request has written: every launched row (`cached_len`) up to the committed
        sequence. The last committed token has run only when a step launched before its commit (overlap
        scheduling) fed it; drafts never count (a verify step leaves cached_len at seq_len - 1)."""
        return min(self.cached_len, self.seq_len)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        # The prompt is fully in the cache once cached_len reaches prompt_len; the last prompt
        # chunk also samples the first output token.
        return self.cached_len >= self.prompt_len

    def token_at(self, pos: int) -> int:
        n = len(self.input_ids)
        return self.input_ids[pos] if pos < n else self.output_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end). Past the committed sequence come the pending draft
        tokens (speculative verify), then 0 placeholders for tokens still being sampled on the device
        (overlap scheduling)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            out = self.output_ids[start - n : end - n]
        else:
            out = self.input_ids[start:] + self.output_ids[: end - n]
        missing = end - start - len(out)
        if missing and self.num_pending:
            first = max(start, self.seq_len) - self.seq_len
            out = out + self.pending_ids[first : first + missing]
        return out + [0] * (end - start - len(out))

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def widen_pending(self, k: int, tokens: list[int] | None = None) -> None:
        """Widen the request by k provisional rows (draft tokens after the committed sequence) for a
        verify step: it then runs k + 1 rows, the last committed token and the k drafts."""
        assert k >= 0 and (tokens is None or len(tokens) == k)
        self.num_pending = k
        self.pending_ids = list(tokens) if tokens is not None else [0] * k

    def commit_pending(self, n: int) -> None:
        """After a verify step that committed n tokens (accepted drafts + one target token): the
        cache holds valid K/V for the rows of the last committed token and the n - 1 accepted drafts,
        i.e. every position before the new last token. The caller rolls the pages back to match."""
        assert 1 <= n <= self.num_pending + 1, f"commit of {n} tokens after {self.num_pending} pending rows"
        self.cached_len = self.seq_len - 1
        self.num_pending = 0
        self.pending_ids = []


class FeatureSink:
    """Collects the LM head's input rows of a step (hidden states) for a drafter that wants them."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def add(self, hidden_rows: torch.Tensor) -> None:
        self.rows.append(hidden_rows)


@dataclass
class Batch:
    """One engine step: several requests, each contributing `extend_lens[i]` query rows.

    prefill: rows are prompt tokens [cached_len, cached_len + extend_len).
    decode:  one row per request (`rows_per_req` = 1): the last token.
    verify:  `rows_per_req` rows per request: the last token plus draft tokens.
    """

    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]
    prefix_lens: list[int]  # tokens already in the cache for each request (before this step)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64: flat cache slot of each row's new K/V
    sample_rows: torch.Tensor  # [R] int64: rows whose logits are computed
    sample_reqs: list[int]  # index into reqs for each sampled row
    rows_per_req: int = 1
    attn_metadata: Any = None  # set by the attention backend's prepare_metadata
    features: FeatureSink | None = None  # set when a drafter asks for the LM head's input rows
    padded_size: int | None = None  # CUDA graph: number of request rows after padding

    def __post_init__(self) -> None:
        if self.phase == "verify":
            assert self.rows_per_req >= 1 and all(n == self.rows_per_req for n in self.extend_lens), (
                "a verify batch must set rows_per_req and give every request that many rows"
            )

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


@dataclass
class Context:
    """What a model's layers need during one forward: the batch, the KV cache, the backend."""

    kv_cache: "KVCache"
    attn_backend: "AttnBackend"
    batch: Batch | None = None
    # Under it, a layer with per-request state (GDN) must not touch the target's: it uses the
    # `linear_state` the override brings (a draft's own) and refuses to run without one.
    hide_target_state: bool = False
    linear_state: Any = None  # kvcache.linear_state.LinearStateStep of hybrid models, set per step

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator["Context"]:
        """Temporarily swap fields (a draft model runs on its own KV pool and backend)."""
        old = {k: getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host data -> device tensor without waiting for the device. A host-to-device copy from pageable
    memory synchronizes the stream (so step N+1's inputs would wait for step N to finish); from
    page-locked memory (PyTorch's caching host allocator) it is queued like a kernel."""
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pinned(data: Any, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor (plain on machines without CUDA) to copy_ into device buffers."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory() if torch.cuda.is_available() else t


_CTX: Context | None = None


def set_context(ctx: Context | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> Context:
    if _CTX is None:
        raise RuntimeError("no engine Context is set: models run only inside Engine.forward_batch")
    return _CTX
