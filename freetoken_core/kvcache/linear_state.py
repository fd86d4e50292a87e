"""The linear-state pool of hybrid (gated-delta-net) models, and the per-step metadata its layers read.

A GDN layer keeps no K/V pages: each request owns one fixed-size state per GDN layer, a conv state
[conv_dim, K-1] (the last K-1 inputs of the causal conv) and a recurrent state [Hv, dk, dv]
(fp32 by default). Slots are tied to page-table rows: the request in row r owns slot r + 1, and
slot 0 is the dummy that CUDA-graph padding rows (the dummy row) read and write. So a slot is taken
at admission with the row, returned with it at finish, abort or retraction, and can never be held
twice (the rows are checked like pages are). A slot's old contents are never cleared: a request's
first prefill chunk tells the kernels to start from zeros (`initial_zero`).

Speculative verify steps (k + 1 rows per request) run every GDN layer without writing its state,
keeping the rows' conv inputs, q/k/v and raw gate inputs a/b; once the accepted counts are known, `commit_verify`
replays the accepted rows into the states (no per-row state copies: a Qwen3.6 state is ~61 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .spec import LinearStateSpec

STATE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def slot_of_row(row: int, dummy_row: int) -> int:
    return 0 if row == dummy_row else row + 1


class LinearStatePool:
    """conv[i] [slots, conv_dim, K-1] and recurrent[i] [slots, Hv, dk, dv] for GDN layer i."""

    def __init__(self, specs: list[LinearStateSpec], num_slots: int, conv_dtype: torch.dtype,
                 state_dtype: torch.dtype, device: torch.device) -> None:
        self.specs, self.num_slots, self.device = specs, num_slots, device
        self.conv = [torch.zeros(num_slots, s.conv_dim, s.conv_kernel - 1, dtype=conv_dtype, device=device) for s in specs]
        self.recurrent = [torch.zeros(num_slots, s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=state_dtype,
                                      device=device) for s in specs]

    @staticmethod
    def bytes_per_slot(specs: list[LinearStateSpec], conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        ce, se = torch.empty((), dtype=conv_dtype).element_size(), torch.empty((), dtype=state_dtype).element_size()
        return sum(s.conv_dim * (s.conv_kernel - 1) * ce + s.num_v_heads * s.head_k_dim * s.head_v_dim * se
                   for s in specs)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)


@dataclass
class VerifyInputs:
    """What one GDN layer saw in a verify step, for the replay of its accepted rows."""

    conv_in: torch.Tensor  # [B*R, conv_dim], before the conv
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor  # [B*R, Hv], in_proj_ba's raw gate inputs (the kernels compute g and beta from them)
    b: torch.Tensor


@dataclass
class LinearStateStep:
    """Per-step metadata of the GDN layers (set by the engine before the forward).

    varlen (prefill, or any step with uneven rows): `cu_seqlens` [B+1], `initial_zero` [B].
    uniform (decode, verify): `num_rows` [B] and `rows_per_req`; `write_state` False in verify."""

    pool: LinearStatePool
    slot_ids: torch.Tensor
    varlen: bool
    cu_seqlens: torch.Tensor | None = None
    initial_zero: torch.Tensor | None = None
    num_rows: torch.Tensor | None = None
    rows_per_req: int = 1
    write_state: bool = True
    is_target: bool = True  # False for a draft model's own states (Context.hide_target_state)
    saved: dict[int, VerifyInputs] = field(default_factory=dict)  # state_index -> a verify step's inputs
