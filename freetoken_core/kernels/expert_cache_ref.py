"""The device-side expert cache's tables and the plain-torch reference of its two kernels
(`expert_cache.py`): one LRU step (`assign_ref`) and the copy of the missed experts (`copy_ref`).

Tables of one MoE layer (all on the device, all authoritative; the host never keeps a mirror):
  slot_of    [E] int32  the slot holding expert e, -1 when e is not resident
  expert_of  [S] int32  the expert in slot s, -1 when s is free
  last_used  [S] int64  the layer's step clock when slot s was last needed
  last_need  [E] int64  scratch: the clock of the last step that routed to e (kernel A's "needed" marks)
  clock      [1] int64  the layer's step clock, advanced by every assign
  counters   [5] int64  hits, misses, bytes copied, tokens, overflow (see COUNTERS)
  miss_expert, miss_slot [S] int32, miss_count [1] int32: the last assign's misses, for the copy

One step (`assign_ref`): the clock advances; the experts the routes name are "needed"; a needed expert
already resident is a hit (its slot's last_used becomes the clock); each needed-but-absent expert, in
increasing expert id, takes a victim slot: a free one first (lowest slot first), else the least recently
used slot whose expert this step does not need (ties: lowest slot). Hits and misses count distinct
experts per step. A step needing more distinct experts than there are slots leaves the rest unmapped
(counted as overflow; their routes read slot 0): callers never let that happen (moe/budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

COUNTERS = ("hits", "misses", "bytes_copied", "tokens", "overflow")


@dataclass
class CacheTables:
    slot_of: torch.Tensor
    expert_of: torch.Tensor
    last_used: torch.Tensor
    last_need: torch.Tensor
    clock: torch.Tensor
    counters: torch.Tensor
    miss_expert: torch.Tensor
    miss_slot: torch.Tensor
    miss_count: torch.Tensor

    @classmethod
    def create(cls, num_experts: int, num_slots: int, device: torch.device | str,
               counters: torch.Tensor | None = None) -> "CacheTables":
        """Every slot free. `counters` may be a [5] int64 view of a tensor shared by all layers (one read)."""
        if counters is None:
            counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        return cls(
            slot_of=torch.full((num_experts,), -1, **i32), expert_of=torch.full((num_slots,), -1, **i32),
            last_used=torch.zeros(num_slots, **i64), last_need=torch.zeros(num_experts, **i64),
            clock=torch.zeros(1, **i64), counters=counters, miss_expert=torch.zeros(num_slots, **i32),
            miss_slot=torch.zeros(num_slots, **i32), miss_count=torch.zeros(1, **i32),
        )

    @property
    def num_experts(self) -> int:
        return self.slot_of.shape[0]

    @property
    def num_slots(self) -> int:
        return self.expert_of.shape[0]

    def clone(self) -> "CacheTables":
        return CacheTables(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def copy_(self, other: "CacheTables") -> None:
        """Restore from a snapshot (`clone`), in place: graphs captured over these tensors stay valid."""
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))

    def check(self) -> None:
        """slot_of and expert_of are inverse maps of the resident experts (tests; reads the device)."""
        slot_of, expert_of = self.slot_of.cpu().tolist(), self.expert_of.cpu().tolist()
        for s, e in enumerate(expert_of):
            assert e == -1 or slot_of[e] == s, f"slot {s} holds expert {e}, whose slot_of is {slot_of[e]}"
        for e, s in enumerate(slot_of):
            assert s == -1 or expert_of[s] == e, f"expert {e} maps to slot {s}, which holds {expert_of[s]}"


def assign_ref(topk_ids: torch.Tensor, t: CacheTables, bytes_per_expert: int, tokens: int) -> torch.Tensor:
    """One LRU step over the tables (in place) -> topk_slot int32, the shape of topk_ids."""
    clock = int(t.clock[0]) + 1
    t.clock[0] = clock
    ids = topk_ids.reshape(-1).to(torch.int64).cpu()
    needed = sorted(set(ids.tolist()))
    slot_of, expert_of, last_used = t.slot_of.tolist(), t.expert_of.tolist(), t.last_used.tolist()
    for e in needed:
        t.last_need[e] = clock
    hits = [e for e in needed if slot_of[e] >= 0]
    for e in hits:
        last_used[slot_of[e]] = clock
    keep = {slot_of[e] for e in hits}
    order = sorted((s for s in range(len(expert_of)) if s not in keep),
                   key=lambda s: (-1 if expert_of[s] < 0 else last_used[s], s))
    misses = [e for e in needed if slot_of[e] < 0]
    done = 0
    for e, s in zip(misses, order):
        old = expert_of[s]
        if old >= 0:
            slot_of[old] = -1
        slot_of[e], expert_of[s], last_used[s] = s, e, clock
        t.miss_expert[done], t.miss_slot[done] = e, s
        done += 1
    t.miss_count[0] = done
    t.slot_of.copy_(torch.tensor(slot_of, dtype=torch.int32))
    t.expert_of.copy_(torch.tensor(expert_of, dtype=torch.int32))
    t.last_used.copy_(torch.tensor(last_used, dtype=torch.int64))
    t.counters += torch.tensor([len(hits), done, done * bytes_per_expert, tokens, len(misses) - done],
                               dtype=torch.int64, device=t.counters.device)
    slots = t.slot_of.to(torch.int64)[ids.to(t.slot_of.device)].clamp(min=0)
    return slots.to(torch.int32).view(topk_ids.shape)


def copy_ref(t: CacheTables, host_w13: torch.Tensor, host_w2: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor) -> None:
    """Copy the last assign's missed experts from the host banks into their slots."""
    for j in range(int(t.miss_count[0])):
        e, s = int(t.miss_expert[j]), int(t.miss_slot[j])
        w13[s].copy_(host_w13[e])
        w2[s].copy_(host_w2[e])
