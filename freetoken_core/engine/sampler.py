"""Token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The order, for every path that samples (plain steps here, speculative verification in spec/verify.py):
  1. penalties (presence / frequency / repetition, engine/penalties.py),
  2. masks: the min_tokens ban of stop tokens (and a grammar mask where one applies),
  3. temperature,
  4. top-k, then top-p, then min-p,
  5. the draw (or, in a verify step, speculative acceptance against these probabilities).
A mask sets logits to -inf, which every penalty keeps at -inf, so the ban is applied in place before the
penalties' out-of-place copy: logprobs are those of the model's logits with the masks, before penalties and
temperature (vLLM's raw logprobs).

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p.
A seeded request draws its noise from its own generator, one vocabulary-sized vector per token,
so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..core import to_device
from .penalties import PenaltyBatch

_GREEDY = SamplingParams()  # what a failed row samples with: its token is discarded


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float] | None = None  # log-probability of each sampled token (raw model distribution)
    top_logprobs: list[dict[int, float]] | None = None


def apply_filters(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    need_sort: bool = True, need_min_p: bool = True,
) -> torch.Tensor:
    """Mask logits [R, V] (already temperature-scaled) outside top-k / top-p / min-p with -inf.

    top_k <= 0 disables top-k; top_p == 1 disables top-p; min_p == 0 disables min-p. The flags
    (known on the host) skip work no row needs without a device sync.
    """
    vocab = logits.shape[-1]
    if need_sort:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        remove = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        cum_before = probs.cumsum(dim=-1) - probs
        remove |= (cum_before >= top_p[:, None]) & (ranks > 0)  # (a top_p that float32 rounds to 0 keeps one)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
    if need_min_p:
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


@dataclass
class SamplingSettings:
    """The per-row settings of sampled (non-greedy) rows as the step's tensors."""

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64
    top_p: torch.Tensor
    min_p: torch.Tensor
    need_sort: bool
    need_min_p: bool


def sampling_settings(params: list[SamplingParams], device: torch.device) -> SamplingSettings:
    return SamplingSettings(
        to_device([p.temperature for p in params], torch.float32, device),
        to_device([p.top_k for p in params], torch.int64, device),
        to_device([p.top_p for p in params], torch.float32, device),
        to_device([p.min_p for p in params], torch.float32, device),
        need_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        need_min_p=any(p.min_p > 0 for p in params),
    )


def probs_of(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """The distribution rows sample from: temperature, then top-k / top-p / min-p, then softmax."""
    scaled = apply_filters(logits / s.temperature[:, None], s.top_k, s.top_p, s.min_p, s.need_sort, s.need_min_p)
    return scaled.softmax(dim=-1)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] fp32, one SamplingParams per row (none greedy) -> the distribution each row samples from."""
    return probs_of(logits, sampling_settings(params, logits.device))


@dataclass
class _StepPlan:
    """What one step's sampling needs from its requests' SamplingParams, built on the host before any device work."""

    greedy_rows: list[int]
    random_rows: list[int]
    settings: SamplingSettings | None  # of the random rows
    top_n: list[int] | None  # per row: top logprobs asked for (None: no row wants logprobs)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> "_StepPlan":
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        settings = sampling_settings([params[i] for i in random_rows], device) if random_rows else None
        top_n = None
        if any(p.logprobs is not None for p in params):
            top_n = [p.logprobs or 0 for p in params]
            if not all(isinstance(n, int) and 0 <= n <= vocab for n in top_n):
                raise ValueError(f"logprobs must be integers in [0, {vocab}], got {top_n}")
        return cls(greedy_rows, random_rows, settings, top_n)


def row_error(p: SamplingParams, vocab: int, device: torch.device) -> str | None:
    """Why one request's settings cannot be sampled (SamplingParams.validate's words where it objects), or None."""
    try:
        p.copy().validate(vocab_size=vocab)
    except (ValueError, TypeError) as e:
        return str(e)
    try:
        _StepPlan.build([p], vocab, device)
    except Exception as e:  # noqa: BLE001  anything a single row's values raise
        return f"{type(e).__name__}: {e}"
    return None


def unsampleable_rows(params: list[SamplingParams], vocab: int, device: torch.device) -> dict[int, str]:
    """{row: why} of the rows whose settings cannot be sampled: requests that bypassed SamplingParams.validate.
    For after a step's sampling build failed: one request's row, not the step, is at fault."""
    return {i: err for i, p in enumerate(params) if (err := row_error(p, vocab, device)) is not None}


def greedy_in_place_of(params: list[SamplingParams], failed: dict[int, str]) -> list[SamplingParams]:
    """The rows of failed requests sample greedily (their tokens are discarded): the rest keep theirs."""
    return [_GREEDY if i in failed else p for i, p in enumerate(params)]


def ban_masks(logits: torch.Tensor, banned: dict[int, list[int]]) -> None:
    """In place: row r of logits [R, V] may not produce the ids banned[r] (ids past the vocabulary ignored)."""
    vocab = logits.shape[-1]
    rows = [r for r, ids in banned.items() for t in ids if t < vocab]
    cols = [t for ids in banned.values() for t in ids if t < vocab]
    if rows:
        idx = to_device([rows, cols], torch.int64, logits.device)
        logits[idx[0], idx[1]] = float("-inf")


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.pinned = PinnedPool() if device.type == "cuda" else None

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def _plan(self, params: list[SamplingParams], vocab: int) -> tuple[_StepPlan, dict[int, str]]:
        """The step's plan, and {row: error} of rows whose settings cannot be sampled (unsampleable_rows): those
        rows are sampled greedily and their requests failed by the scheduler, so one bad request never fails its
        step-mates. The per-row search runs only when the batch build fails."""
        try:
            return _StepPlan.build(params, vocab, self.device), {}
        except Exception:  # noqa: BLE001  find the rows at fault
            failed = unsampleable_rows(params, vocab, self.device)
            if not failed:
                raise
            return _StepPlan.build(greedy_in_place_of(params, failed), vocab, self.device), failed

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        penalties: PenaltyBatch | None = None,
        banned: dict[int, list[int]] | None = None,
    ) -> DeviceSample:
        """logits [R, V] float32, one row per sampled request row, in the order of the module's docstring.
        `banned` maps a row to token ids it may not produce (min_tokens); `penalties` (engine/penalties.py) are
        its penalized rows, whose counts gain the sampled tokens. Nothing here waits for the device."""
        num_rows, vocab = logits.shape
        plan, failed = self._plan(params, vocab)
        if banned:
            ban_masks(logits, banned)
        raw = logits
        if penalties is not None:
            logits = penalties.apply(logits)
        greedy_rows, random_rows = plan.greedy_rows, plan.random_rows
        tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if greedy_rows:
            if len(greedy_rows) == num_rows:
                tokens = logits.argmax(dim=-1)
            else:
                idx = to_device(greedy_rows, torch.int64, logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
        if random_rows:
            idx = to_device(random_rows, torch.int64, logits.device)
            probs = probs_of(logits[idx], plan.settings)
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=generators[i] or self.generator)
            # exponential_ can return exactly 0: 0/0 would make a zero-probability token win
            tokens[idx] = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        if penalties is not None:
            penalties.record(tokens)
        out = DeviceSample(tokens=tokens, failed=failed)
        if plan.top_n is not None:
            logprobs = raw.log_softmax(dim=-1)
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            out.top_n = plan.top_n
            max_n = max(out.top_n)
            if max_n > 0:
                out.top_values, out.top_ids = logprobs.topk(max_n, dim=-1)
        return out

    def empty(self) -> DeviceSample:
        return DeviceSample(tokens=torch.empty(0, dtype=torch.int64, device=self.device))


@dataclass
class DeviceSample:
    """Sampling results still on the device."""

    tokens: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R]
    top_values: torch.Tensor | None = None  # [R, n]
    top_ids: torch.Tensor | None = None
    top_n: list[int] | None = None  # per row: how many top logprobs it asked for
    # {row: error} of rows whose settings could not be sampled (Sampler._plan): known on the host at once
    failed: dict[int, str] = field(default_factory=dict)

    def to_host_async(self, pinned: "PinnedPool | None" = None) -> "HostCopy":
        return HostCopy(self, pinned)


class PinnedPool:
    """Reused page-locked host buffers: allocating pinned memory costs far more than a decode step.
    A ring of `depth` buffers per shape is enough for the steps that can be in flight at once."""

    def __init__(self, depth: int = 4) -> None:
        self.depth = depth
        self._rings: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._rings:
            self._rings[key] = ([torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(self.depth)], [0])
        bufs, pos = self._rings[key]
        pos[0] = (pos[0] + 1) % self.depth
        return bufs[pos[0]]


class HostCopy:
    """Non-blocking device-to-host copy of a DeviceSample; `wait()` syncs on its event only."""

    def __init__(self, s: DeviceSample, pinned: PinnedPool | None = None) -> None:
        self.top_n = s.top_n
        tensors = [t for t in (s.tokens, s.logprobs, s.top_values, s.top_ids) if t is not None]
        self.event = None
        if s.tokens.is_cuda:
            pool = pinned or PinnedPool(1)
            self.host = [pool.get(t.shape, t.dtype) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensors
        self.has_lp = s.logprobs is not None
        self.has_top = s.top_values is not None

    def wait(self) -> SampleOutput:
        if self.event is not None:
            self.event.synchronize()
        it = iter(self.host)
        out = SampleOutput(tokens=next(it).tolist())
        if self.has_lp:
            out.logprobs = next(it).tolist()
        if self.has_top:
            values, ids = next(it).tolist(), next(it).tolist()
            n = self.top_n or []
            out.top_logprobs = [dict(zip(ids[r][: n[r]], values[r][: n[r]])) for r in range(len(values))]
        return out
