"""Presence, frequency and repetition penalties with vLLM's semantics, from per-request token counts on the device.

For each penalized row, over the vocabulary:
- repetition_penalty r (1: off) on every token seen in the prompt or in the output so far: a positive logit is
  divided by r, a negative one multiplied by r;
- frequency_penalty f: logit -= f * (times the token occurs in the output so far);
- presence_penalty p: logit -= p * (1 if the token occurs in the output so far, else 0).

Each penalized request owns a slot of two device tables: its output-token counts and a mask of its prompt's tokens.
A slot is filled from the host's tokens when the request first samples (after admission or a retraction) and then
gains each sampled token on the device, in stream order right after the sampling, so a step launched before the
host has read the previous one (overlap scheduling) still sees every token sampled before it. The tables are
allocated at the first penalized request: requests without penalties cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core import to_device

if TYPE_CHECKING:
    from ..core import Req

_FIRST_CAPACITY = 8


def apply_penalties_reference(
    logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
    presence: list[float], frequency: list[float], repetition: list[float],
) -> torch.Tensor:
    """Plain-torch reference, one row and one token at a time (vLLM's apply_penalties, spelled out)."""
    out = logits.clone()
    for row in range(out.shape[0]):
        seen = set(prompts[row]) | set(outputs[row])
        for tok in seen:
            v = out[row, tok]
            out[row, tok] = v / repetition[row] if v > 0 else v * repetition[row]
        for tok in set(outputs[row]):
            out[row, tok] -= frequency[row] * outputs[row].count(tok) + presence[row]
    return out


class PenaltyState:
    """The device tables of the penalized requests' token counts, one slot per request (by uid)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(_FIRST_CAPACITY, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        prompt[:old] = self.in_prompt
        self.output_counts, self.in_prompt = counts, prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def _acquire(self, req: "Req") -> int:
        """A slot filled from the request's committed tokens (all of them: it is not mid-flight when it first
        samples after admission)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.output_counts[slot].zero_()
        self.in_prompt[slot].zero_()
        self.in_prompt[slot, to_device(req.input_ids, torch.int64, self.device)] = True
        if req.output_ids:
            ids = to_device(req.output_ids, torch.int64, self.device)
            self.output_counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.slot_of[req.uid] = slot
        return slot

    def release(self, uid: int) -> None:
        """The request finished or was retracted (a retracted one refills its slot when it samples again)."""
        slot = self.slot_of.pop(uid, None)
        if slot is not None:
            self._free.append(slot)

    @torch.inference_mode()  # the tables are inference tensors, whichever path touches them first
    def prepare(self, reqs: list["Req"], rows: list[int] | None = None) -> "PenaltyBatch | None":
        """The penalties of one sampling call whose logits row rows[i] (default i) belongs to reqs[i]; None when
        no request is penalized (then nothing runs on the device)."""
        picked = [i for i, r in enumerate(reqs) if r.sampling.has_penalties]
        if not picked:
            return None
        rows = rows if rows is not None else list(range(len(reqs)))
        slots = [self.slot_of[reqs[i].uid] if reqs[i].uid in self.slot_of else self._acquire(reqs[i]) for i in picked]
        params = [reqs[i].sampling for i in picked]
        dev = self.device
        return PenaltyBatch(
            self,
            rows=to_device([rows[i] for i in picked], torch.int64, dev),
            slots=to_device(slots, torch.int64, dev),
            presence=to_device([p.presence_penalty for p in params], torch.float32, dev),
            frequency=to_device([p.frequency_penalty for p in params], torch.float32, dev),
            repetition=to_device([p.repetition_penalty for p in params], torch.float32, dev),
            picked=picked,
            host_slots=slots,
        )


@dataclass
class PenaltyBatch:
    """One sampling call's penalized rows (`rows` of the logits) and their slots; tensors on the device."""

    state: PenaltyState
    rows: torch.Tensor  # [P] int64
    slots: torch.Tensor  # [P] int64
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor
    repetition: torch.Tensor
    picked: list[int]  # which of the requests given to prepare() these rows belong to
    host_slots: list[int]

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] -> penalized copy (the input, kept for raw logprobs, is not changed)."""
        counts = self.state.output_counts[self.slots]  # [P, V]
        in_output = counts > 0
        seen = in_output | self.state.in_prompt[self.slots]
        rows = logits[self.rows]
        rep = torch.where(seen, self.repetition[:, None], torch.ones_like(rows))
        rows = torch.where(rows > 0, rows / rep, rows * rep)
        rows = rows - self.frequency[:, None] * counts - self.presence[:, None] * in_output
        return logits.index_put((self.rows,), rows)

    @torch.inference_mode()
    def record(self, tokens: torch.Tensor) -> None:
        """tokens [R] on the device: the token each logits row sampled; the penalized rows' count one more."""
        sampled = tokens[self.rows]
        self.state.output_counts.index_put_((self.slots, sampled), torch.ones_like(sampled, dtype=torch.int32),
                                            accumulate=True)

    @torch.inference_mode()
    def record_committed(self, committed: list[list[int]]) -> None:
        """committed[i]: the tokens the i-th request given to prepare() committed (a verify step's)."""
        slots = [slot for slot, i in zip(self.host_slots, self.picked) for _ in committed[i]]
        ids = [t for i in self.picked for t in committed[i]]
        if ids:
            idx = to_device([slots, ids], torch.int64, self.state.device)
            self.state.output_counts.index_put_((idx[0], idx[1]), torch.ones_like(idx[0], dtype=torch.int32),
                                                accumulate=True)
