"""Acceptance of drafted tokens in one speculative verify step, for a whole batch.

The target model scores k+1 rows per request: row 0 after the last committed token, row j after
draft j-1. Acceptance decides how many drafts to keep and which token to commit after them.

- Greedy: keep drafts while they equal the target's argmax; then commit the target's token at the
  first mismatch (or the bonus row after the last draft). The committed tokens are exactly what
  non-speculative greedy decoding would produce.
- Sampled: speculative sampling (Leviathan et al. 2023, Chen et al. 2023) with a deterministic
  drafter, whose draft distribution q is one-hot at the draft d. Accept d with probability
  min(1, p(d)/q(d)) = p(d); on the first rejection sample from normalize(max(p - q, 0)), which is p
  with d removed and renormalised; after all drafts are accepted sample the bonus from the next
  row. Each committed token is then distributed exactly as the target's sampling distribution.

Everything runs as torch ops on the probabilities' device; results stay there (`VerifyResult`)
until `to_lists()`, the one host transfer. Random draws come from each request's own generator
when it has one, so a seeded request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..core import to_device
from ..engine.sampler import sampling_probs as engine_sampling_probs


@dataclass
class VerifyResult:
    """Acceptance results still on the device.

    num_accepted[b] drafts were accepted; the request commits tokens[b, : num_accepted[b] + 1]
    (the accepted drafts, then the corrected or bonus token). Columns after that are meaningless.
    """

    num_accepted: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [B, k+1] int64

    def packed(self) -> torch.Tensor:
        """[B, k+2] int64: column 0 is num_accepted, the rest `tokens`: copy it to the host with one
        (possibly non-blocking, pinned) transfer and read it with `unpack`."""
        return torch.cat([self.num_accepted[:, None], self.tokens], dim=1)

    @staticmethod
    def unpack(rows: list[list[int]]) -> list[list[int]]:
        return [row[1 : row[0] + 2] for row in rows]

    def to_lists(self) -> list[list[int]]:
        """The committed tokens of each request (1..k+1 of them). The only host sync."""
        return self.unpack(self.packed().tolist())


def _num_drafts_tensor(num_drafts: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(num_drafts, torch.Tensor):
        return num_drafts.to(device=device, dtype=torch.int64)
    return to_device(list(num_drafts), torch.int64, device)


def _count_accepted(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, k] bool -> [B] int64: length of the leading run of True."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accept_device(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: list[int] | torch.Tensor
) -> VerifyResult:
    """target_ids [B, k+1] (target argmax per verify row), draft_ids [B, k], num_drafts [B]."""
    batch, k = draft_ids.shape
    assert target_ids.shape == (batch, k + 1), f"target_ids {tuple(target_ids.shape)} vs draft_ids {tuple(draft_ids.shape)}"
    nd = _num_drafts_tensor(num_drafts, target_ids.device)
    valid = torch.arange(k, device=target_ids.device)[None, :] < nd[:, None]  # padded drafts never match
    accept = (draft_ids.to(target_ids.dtype) == target_ids[:, :k]) & valid
    # accepted drafts equal the target's tokens, so the target row itself is the committed sequence
    return VerifyResult(num_accepted=_count_accepted(accept), tokens=target_ids.to(torch.int64))


def greedy_accept(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: list[int] | torch.Tensor
) -> list[list[int]]:
    return greedy_accept_device(target_ids, draft_ids, num_drafts).to_lists()


def rejection_accept_device(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int] | torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> VerifyResult:
    """probs [B, k+1, V]: the target's final sampling distribution per verify row (after temperature,
    top-k, top-p, min-p; rows need not be normalised). draft_ids [B, k], num_drafts [B].

    Random draws per request: num_drafts[b] uniforms (k when num_drafts is a device tensor, so pass
    a host list to keep seeded results independent of the batch's padding), then one Exp(1) vector
    of vocabulary size. Only one residual-or-bonus sample is ever taken per request, and which row
    it comes from depends on the uniforms alone, so one noise vector serves every row.
    """
    batch, k = draft_ids.shape
    vocab = probs.shape[-1]
    assert probs.shape[:2] == (batch, k + 1), f"probs {tuple(probs.shape)} vs draft_ids {tuple(draft_ids.shape)}"
    assert len(generators) == batch, f"{len(generators)} generators for {batch} requests"
    dev = probs.device
    probs = probs.float()
    nd = _num_drafts_tensor(num_drafts, dev)
    host_nd = None if isinstance(num_drafts, torch.Tensor) else [int(n) for n in num_drafts]

    uniforms = torch.ones(batch, k, device=dev)  # 1.0 is never < p: unused slots reject
    noise = torch.empty(batch, vocab, device=dev)
    if all(g is None for g in generators):  # no per-request seeds: one draw for the whole batch
        uniforms.uniform_(generator=default_generator)
        noise.exponential_(generator=default_generator)
    else:
        for b, g in enumerate(generators):
            gen = g if g is not None else default_generator
            n = k if host_nd is None else host_nd[b]
            if n > 0:
                uniforms[b, :n].uniform_(generator=gen)
            noise[b].exponential_(generator=gen)
    # exponential_ may return 0 (from a uniform of exactly 0): 0/0 would be NaN, which argmax picks
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    drafts = draft_ids.to(device=dev, dtype=torch.int64)
    safe_drafts = drafts.clamp(0, vocab - 1)  # padding may be any id; padded rows are masked below
    p_draft = probs[:, :k, :].gather(2, safe_drafts[:, :, None]).squeeze(2)  # [B, k]
    valid = torch.arange(k, device=dev)[None, :] < nd[:, None]
    accept = (uniforms < p_draft) & valid
    num_accepted = _count_accepted(accept)

    # the row the final token comes from: the first rejected draft's row, or the bonus row
    rows = probs[torch.arange(batch, device=dev), num_accepted]  # [B, V]
    rejected = num_accepted < nd
    residual = rows
    if k > 0:
        d = safe_drafts.gather(1, num_accepted.clamp(max=k - 1)[:, None])  # [B, 1]
        keep = rows.gather(1, d) * (~rejected)[:, None].to(rows.dtype)
        residual = rows.scatter(1, d, keep)
        # p(d) == 1 up to rounding leaves nothing to sample from: the rejection had probability ~0
        residual = torch.where((residual.sum(dim=1) > 0)[:, None], residual, rows)
    final = (residual / noise).argmax(dim=1)

    tokens = torch.cat([drafts, final[:, None]], dim=1)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def rejection_accept(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int] | torch.Tensor,
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[list[int]]:
    return rejection_accept_device(probs, draft_ids, num_drafts, generators, default_generator).to_lists()


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, R, V] -> the target's final sampling distribution [B, R, V] (float32): each
    request's temperature / top-k / top-p / min-p on all its R rows, exactly as the sampler does.
    Every request must have temperature > 0."""
    batch, num_rows, vocab = logits.shape
    assert len(params) == batch and all(not p.greedy for p in params), "sampling_probs is for sampled requests"
    per_row = [p for p in params for _ in range(num_rows)]
    return engine_sampling_probs(logits.reshape(batch * num_rows, vocab).float(), per_row).reshape(batch, num_rows, vocab)


def verify_device(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int] | torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> VerifyResult:
    """One verify step for a mixed batch: logits [B, k+1, V] from the target, greedy requests
    accepted greedily, sampled ones by rejection sampling. Results stay on the device."""
    batch, k = draft_ids.shape
    result = greedy_accept_device(logits.argmax(dim=-1), draft_ids, num_drafts)
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if not sampled:
        return result
    idx = to_device(sampled, torch.int64, logits.device)
    if isinstance(num_drafts, torch.Tensor):
        sub_nd: list[int] | torch.Tensor = num_drafts.to(logits.device)[idx]
    else:
        sub_nd = [num_drafts[b] for b in sampled]
    sub = rejection_accept_device(
        sampling_probs(logits[idx], [params[b] for b in sampled]),
        draft_ids.to(logits.device)[idx],
        sub_nd,
        [generators[b] for b in sampled],
        default_generator,
    )
    if len(sampled) == batch:
        return sub
    result.num_accepted[idx] = sub.num_accepted
    result.tokens[idx] = sub.tokens
    return result


def verify(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int] | torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[list[int]]:
    return verify_device(logits, draft_ids, num_drafts, params, generators, default_generator).to_lists()
