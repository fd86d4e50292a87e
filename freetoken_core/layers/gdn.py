"""Gated-delta-net (GDN) linear attention, the token mixer of Qwen3-Next and Qwen3.5/3.6 layers.

h -> in_proj: [q | k | v] through a causal depthwise conv (kernel K, SiLU), z (the output gate),
and b, a -> beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); q, k L2-normed; the
delta-rule recurrence over the request's state (fp32); per-head gated RMSNorm
`w * rmsnorm(o) * silu(z)`; out_proj. The gates, the L2 norms and the output norm run inside the
recurrence kernel, and the decoder layer runs its input norm fused with in_proj (`fuses_input_norm`):
a batch-1 decode is norm+in_proj, conv, recurrence, out_proj. Two kernel switches (env.py) fold two of
those launches into their neighbours: the conv into the recurrence (`gdn_fused_conv`, plain decode) and,
at one row, the output norm into out_proj's GEMV (`gdn_out_norm_gemv`, kernels/gdn_out_gemv.py).

The one projection is held flat, [q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv)],
so [q | k | v], z, b and a are views of one output. Qwen3.5 checkpoints store it in pieces
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); Qwen3-Next stores `in_proj_qkvz` and
`in_proj_ba`, each grouped per key head ([dk, dk, r*dv, r*dv] and [r, r] per key head, r = Hv / Hk):
`weight_loader` takes both (shard ("grouped", segments) de-interleaves).

The layer reads its step's state metadata from `get_context().linear_state` (kvcache/linear_state.py):
prefill chunks go through the varlen kernels (state carried across chunks exactly), decode and
verify rows through the update kernels (verify writes nothing; `commit_verify` replays the
accepted rows). CUDA: the Triton kernels of kernels/gdn.py, and for prefill fla-core's chunked kernel
where it is installed and passed its self-check (kernels/gdn_fla.py); CPU: their torch references.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core import get_context
from ..env import kernel_env
from ..kernels import causal_conv1d_ref, gdn_ref
from ..kvcache.linear_state import LinearStateStep, VerifyInputs
from ..kvcache.spec import LinearStateSpec
from .fp8 import dense_weight
from .linear import Linear, MergedLinear, copy_checked


def _ops(x: torch.Tensor):
    if x.is_cuda:
        from ..kernels import causal_conv1d, gdn, gdn_fla  # first CUDA use: CPU users never load Triton

        # prefill: fla-core's chunked kernel where installed and self-checked, else our token loop
        return causal_conv1d.causal_conv1d_varlen, causal_conv1d.conv1d_update, gdn_fla.gdn_prefill, \
            gdn.gdn_recurrent_update
    return (causal_conv1d_ref.causal_conv1d_varlen_ref, causal_conv1d_ref.conv1d_update_ref, gdn_ref.gdn_varlen_ref,
            gdn_ref.gdn_recurrent_update_ref)


class GroupedMergedLinear(MergedLinear):
    """A MergedLinear whose segments a checkpoint may store interleaved per key head ("grouped"):
    rows [g0: seg0 part, seg1 part, ...][g1: ...], part sizes = segment size / groups.

    Holding block FP8 (Qwen3.5/3.6 checkpoints store q/k/v and z in FP8, b and a in full precision): the first
    `fp8_segments` segments (the body) are FP8 and the rest a dense `weight_tail` in the compute dtype, which the
    one-row decode computes in the FP8 launch (kernels/fp8_gemv.py `fp8_norm_gemv` tail). A grouped (Qwen3-Next)
    checkpoint interleaves its segments per key head, cutting scale blocks: that projection dequantizes."""

    fp8_segments = 4  # q, k, v, z

    def __init__(self, in_features: int, out_sizes: list[int], groups: int, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_sizes, bias=False, dtype=dtype)
        if any(s % groups for s in out_sizes):
            raise ValueError(f"segments {out_sizes} do not split into {groups} key-head groups")
        self.groups = groups
        self.body_rows = sum(out_sizes[: self.fp8_segments])

    def fp8_refusal(self, block: tuple[int, int]) -> str | None:
        bounds = [sum(self.out_sizes[:i]) for i in range(1, self.fp8_segments + 1)]
        if any(b % block[0] for b in bounds):
            return f"a GDN in_proj segment ends inside a {block[0]}-row scale block (rows {bounds})"
        return None

    def hold_fp8(self, block: tuple[int, int]) -> bool:
        if self.fp8_refusal(block) is not None:
            return False
        self.register_buffer("weight_tail", self.weight.data[self.body_rows:].clone())
        self.weight.data = self.weight.data[: self.body_rows]
        return super().hold_fp8(block)

    def drop_fp8(self) -> None:
        if self.fp8_block is None:
            return
        super().drop_fp8()
        self.weight.data = torch.cat([self.weight.data, self.weight_tail])
        delattr(self, "weight_tail")

    def fp8_dense_tensors(self) -> list[torch.Tensor]:
        return [self.weight_tail] if self.fp8_block is not None else []

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = super()._matmul(x, bias)
        if self.fp8_block is None:
            return y
        return torch.cat([y, torch.nn.functional.linear(x, self.weight_tail)], dim=-1)

    def copy_rows(self, param: nn.Parameter, off: int, size: int, loaded: Any) -> None:
        if self.fp8_block is not None and param is self.weight and off >= self.body_rows:  # b / a: the dense tail
            copy_checked(self.weight_tail.narrow(0, off - self.body_rows, size), loaded)
            return
        super().copy_rows(param, off, size, loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> list[Any]:
        if isinstance(shard, tuple) and shard and shard[0] == "grouped":  # ("grouped", consecutive segments)
            segs = list(shard[1])
            self.drop_fp8()  # per-group slices cut scale blocks: de-interleave the real weight
            loaded = dense_weight(loaded, param)
            parts = [self.out_sizes[i] // self.groups for i in segs]
            per_group = loaded.view(self.groups, sum(parts), -1).split(parts, dim=1)  # each [G, part, H]
            off = sum(self.out_sizes[: segs[0]])
            copy_checked(param.data.narrow(0, off, sum(self.out_sizes[i] for i in segs)),
                         torch.cat([p.reshape(-1, loaded.shape[-1]) for p in per_group], 0))
            return segs
        if isinstance(shard, tuple):  # consecutive segments stored as one tensor
            off = sum(self.out_sizes[: shard[0]])
            size = sum(self.out_sizes[i] for i in shard)
            self.copy_rows(param, off, size, loaded)
            return list(shard)
        super().weight_loader(param, loaded, shard)
        return [shard]


class GatedRMSNorm(nn.Module):
    """Per-head `w * rmsnorm(o) * silu(z)` (Llama rounding of the norm, the gate in fp32). The layer
    hands its weight to the recurrence (`out_norm`), which applies it in the same launch; calling the
    module runs it alone (one launch on CUDA)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, H, dim] or [N, dim] (strided views are fine)."""
        if x.is_cuda:
            from ..kernels import gdn

            return gdn.gated_rmsnorm(x, gate, self.weight, self.eps)
        return gdn_ref.gated_rmsnorm_ref(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, state_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        from ..parallel import tp_info

        if tp_info().world_size > 1:
            raise ValueError("gated-delta-net (hybrid) models do not run with tensor_parallel_size > 1 yet")
        self.state_index = state_index
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj = GroupedMergedLinear(
            hidden, [self.key_dim, self.key_dim, self.value_dim, self.value_dim, self.num_v_heads, self.num_v_heads],
            self.num_k_heads, dtype)
        self.conv1d = nn.Module()  # checkpoint name conv1d.weight [C, 1, K] (a depthwise nn.Conv1d)
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.conv_kernel, dtype=dtype),
                                          requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden, bias=False, dtype=dtype)
        # the fused decode conv's [slots, Hk] counters (kernels/gdn.py conv_arrival_counters): allocated at
        # the first fused step (the graph runner's eager warm-up, before any capture), zero between launches
        self._conv_arrivals: torch.Tensor | None = None

    def cache_spec(self) -> LinearStateSpec:
        return LinearStateSpec(self.state_index, self.conv_dim, self.conv_kernel, self.num_v_heads,
                               self.head_k_dim, self.head_v_dim)

    fuses_input_norm = True  # the decoder layer runs its input norm fused with in_proj (layers/norm_linear.py)

    def attend(self, positions: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        """proj: in_proj of the normed input rows, [T, conv_dim + value_dim + 2 Hv]. Every tensor
        between the projections is a view of its outputs (no copies); the gates and the output norm
        run inside the recurrence (kernels/gdn.py `gating=` / `out_norm=`), and behind their switches
        the conv does too (plain decode) or the norm runs in out_proj's GEMV instead (one row)."""
        ctx = get_context()
        st: LinearStateStep | None = ctx.linear_state
        if ctx.hide_target_state and (st is None or st.is_target):
            raise RuntimeError("a gated-delta-net layer ran under hide_target_state without a linear state of its "
                               "own: pass linear_state=<the draft's LinearStateStep> with the override")
        if st is None:
            raise RuntimeError("a gated-delta-net layer ran without the engine's linear-state metadata")
        t = proj.shape[0]
        conv_in = proj[:, : self.conv_dim]
        z_end = self.conv_dim + self.value_dim
        z = proj[:, self.conv_dim: z_end].view(t, self.num_v_heads, self.head_v_dim)
        b = proj[:, z_end: z_end + self.num_v_heads]
        a = proj[:, z_end + self.num_v_heads:]
        conv_varlen, conv_update, gdn_varlen, gdn_update = _ops(proj)
        i = self.state_index
        conv_pool, state_pool = st.pool.conv[i], st.pool.recurrent[i]
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        gating = (self.A_log, self.dt_bias)  # the kernels compute g and beta from the raw a, b
        norm_in_out_proj = self._norm_in_out_proj(proj, st)
        out_norm = None if norm_in_out_proj else (self.norm.weight, z, self.norm.eps)
        if self._conv_in_recurrence(proj, st):  # plain decode: conv + recurrence in one launch
            from ..kernels import gdn

            o = gdn.gdn_decode_with_conv(conv_in, weight, None, conv_pool, a, b, state_pool, st.slot_ids, st.num_rows,
                                         self.num_k_heads, self._arrivals(conv_pool), gating=gating,
                                         out_norm=out_norm)
            return self._out(o, z, t, norm_in_out_proj)
        if st.varlen:
            y = conv_varlen(conv_in, weight, None, st.cu_seqlens, conv_pool, st.slot_ids, st.initial_zero)
        else:
            y = conv_update(conv_in, weight, None, conv_pool, st.slot_ids, st.num_rows, st.rows_per_req,
                            write_state=st.write_state)
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        if st.varlen:
            o = gdn_varlen(q, k, v, a, b, st.cu_seqlens, state_pool, st.slot_ids, st.initial_zero,
                           gating=gating, out_norm=out_norm)
        else:
            o = gdn_update(q, k, v, a, b, state_pool, st.slot_ids, st.num_rows, st.rows_per_req,
                           write_state=st.write_state, gating=gating, out_norm=out_norm)
            if not st.write_state:
                # a verify step: keep what the replay of the accepted rows needs. Views, not copies:
                # they keep this step's projection and conv outputs alive, and nothing writes those.
                st.saved[i] = VerifyInputs(conv_in, q, k, v, a, b)
        return self._out(o, z, t, norm_in_out_proj)

    def _out(self, o: torch.Tensor, z: torch.Tensor, t: int, norm_in_out_proj: bool) -> torch.Tensor:
        if norm_in_out_proj:  # o is the recurrence's un-normed output: the norm runs in out_proj's GEMV
            from ..kernels.gdn_out_gemv import gdn_out_norm_gemv

            proj = self.out_proj
            if proj.fp8_block is not None:
                from ..kernels.fp8_gdn_out_gemv import fp8_gdn_out_norm_gemv

                return fp8_gdn_out_norm_gemv(o, z, self.norm.weight, self.norm.eps, proj.weight, proj.weight_scale_inv,
                                             proj.bias, proj.fp8_block)
            return gdn_out_norm_gemv(o, z, self.norm.weight, self.norm.eps, self.out_proj.weight, self.out_proj.bias)
        return self.out_proj(o.reshape(t, self.value_dim))  # contiguous: a view

    # Batch-1 decode launches folded into their neighbours (freetoken_core/env.py, off by default; CUDA only:
    # on CPU the layer runs the torch references, which have no launches to save).
    def _conv_in_recurrence(self, proj: torch.Tensor, st: LinearStateStep) -> bool:
        """FREETOKEN_GDN_FUSED_CONV: plain decode (one row per request, states written). Verify keeps the
        separate conv (its replay needs the conv outputs, VerifyInputs), and so does prefill."""
        return (proj.is_cuda and kernel_env().gdn_fused_conv and not st.varlen and st.rows_per_req == 1
                and st.write_state)

    def _norm_in_out_proj(self, proj: torch.Tensor, st: LinearStateStep) -> bool:
        """FREETOKEN_GDN_OUT_NORM_GEMV: one decode row whose recurrence tile is too small to norm a whole
        head in its epilogue (kernels/gdn.py fuses_out_norm): the norm moves into out_proj's GEMV."""
        if not (proj.is_cuda and kernel_env().gdn_out_norm_gemv and proj.shape[0] == 1 and not st.varlen):
            return False
        from ..kernels import gdn, gdn_out_gemv

        if gdn.fuses_out_norm(st.slot_ids.shape[0], self.num_v_heads, self.head_v_dim):
            return False
        if self.out_proj.fp8_block is not None:  # kernels/fp8_gdn_out_gemv.py takes the row the bf16 kernel would
            return proj.dtype in (torch.bfloat16, torch.float16)
        return gdn_out_gemv.use_gdn_out_norm_gemv(proj, self.out_proj.weight)

    def _arrivals(self, conv_pool: torch.Tensor) -> torch.Tensor:
        buf = self._conv_arrivals
        if buf is None or buf.device != conv_pool.device or buf.shape[0] < conv_pool.shape[0]:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the fused GDN conv's counters must be allocated before CUDA-graph capture: "
                                   "run the step once eagerly first (GraphRunner's warm-up does)")
            from ..kernels import gdn

            buf = self._conv_arrivals = gdn.conv_arrival_counters(conv_pool, self.num_k_heads)
        return buf

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.in_proj(h))

    def replay_accepted(self, st: LinearStateStep, accepted: torch.Tensor) -> None:
        """After a verify step: advance this layer's states by each request's `accepted` rows."""
        saved = st.saved[self.state_index]
        _, conv_update, _, gdn_update = _ops(saved.conv_in)
        i = self.state_index
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        conv_update(saved.conv_in, weight, None, st.pool.conv[i], st.slot_ids, accepted, st.rows_per_req,
                    write_state=True)
        gdn_update(saved.q, saved.k, saved.v, saved.a, saved.b, st.pool.recurrent[i], st.slot_ids, accepted,
                   st.rows_per_req, write_state=True, gating=(self.A_log, self.dt_bias))
