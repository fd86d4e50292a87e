"""Mixture-of-experts layers: the top-k softmax router and the stacked experts.

Experts are stacked into two weights per layer, the layout of the fused kernels
(`kernels/fused_moe.py`) and of transformers 5's in-memory experts:
  gate_up_proj [E, 2I, H]  rows [gate | up] of each expert, gate first
  down_proj    [E, H, I]
Checkpoints store them either one expert at a time (`experts.{e}.gate_proj.weight`, ...) or already
stacked (`experts.gate_up_proj`, `experts.down_proj`); `weight_loader` fills both layouts, so a
model's weight rules only name the expert index and the shard.

On CUDA (half precision or fp32) the Triton kernels run the router's top-k and the experts inside
CUDA graphs; everywhere else (and with FREETOKEN_FUSED_MOE=0) the plain-torch reference, which
equals transformers' eager experts. Forward hooks on the experts observe the routing
(benchmarks/bench_decode.py `expert_usage`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..env import kernel_env
from ..parallel import all_reduce, tp_info
from ..kernels.fused_moe_ref import fused_moe_ref, topk_softmax_ref, topk_softmax_shared_ref
from .fp8 import Fp8BlockWeight, Fp8Held
from .linear import Linear
from .norm import ZeroCenteredRMSNorm
from .norm_linear import fuses_norm_gemv_normed, norm_linear_normed


def use_fused_moe(x: torch.Tensor) -> bool:
    return kernel_env().fused_moe and x.is_cuda


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (fp32 weights [T, k], int32 expert ids [T, k]): softmax in fp32, top-k,
    renormalised over the k only when the model says so (Qwen3-MoE's `norm_topk_prob`).
    shared_expert: [T, E + 1] logits ending with the shared expert's gate -> routes [T, k + 1] ending with
    expert E at weight sigmoid(gate) (`topk_softmax_shared_ref`)."""
    if use_fused_moe(router_logits):
        from ..kernels import moe_router  # first CUDA use: CPU users never load Triton

        return moe_router.topk_softmax(router_logits, top_k, renormalize, shared_expert)
    if shared_expert:
        return topk_softmax_shared_ref(router_logits, top_k, renormalize)
    return topk_softmax_ref(router_logits, top_k, renormalize)


def run_stacked_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, shared_last: bool = False,
                        fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None) -> torch.Tensor:
    """sum over k of weight * expert(x) for stacked weights on x's device (all experts, or a slot pool).
    shared_last: each token's last route is the shared expert stacked last in w13/w2 (a speed hint).
    fp8: (scale_inv of w13, of w2, block) when w13/w2 hold block-FP8 values (kernels/fp8_moe.py)."""
    if fp8 is not None:
        from ..kernels.fp8_moe import fp8_fused_moe  # Triton: on CPU only where FP8 is kept (interpreter)

        s13, s2, block = fp8
        return fp8_fused_moe(x, w13, s13, w2, s2, topk_weights, topk_ids, block=block, shared_last=shared_last)
    if use_fused_moe(x):
        from ..kernels import fused_moe  # first CUDA use: CPU users never load Triton

        return fused_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, shared_last=shared_last)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


class StackedExperts(Fp8Held, nn.Module):
    """E SwiGLU experts `down(silu(gate x) * up x)` held as [E, ...] weights: the compute dtype, or block FP8
    (layers/fp8.py `Fp8Held`: `gate_up_proj_scale_inv`, `down_proj_scale_inv`; resident or offloaded to device slots)
    run by kernels/fp8_moe.py `fp8_fused_moe`.

    `device` places the weights (the host, for offloaded strategies; default: where the model is
    built). With an `executor` attached (freetoken_core/moe: device slot pools, the CPU executor) the
    experts run there; without one, on the stacked weights themselves (`resident`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        # tensor parallelism: each rank keeps its share of every expert's intermediate dimension
        # (column-parallel gate/up, row-parallel down) and the layer sums the ranks' outputs
        self.full_intermediate_size = intermediate_size
        intermediate_size = tp_info().shard(intermediate_size, "moe_intermediate_size")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.executor: object | None = None
        # (w13, w2) with one more expert stacked after the E routed ones (the parameters are views of
        # them): a shared expert fused into the routed ones (SharedExpertMoeBlock.fuse_shared_expert)
        self.stack_with_shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scales_with_shared: tuple[torch.Tensor, torch.Tensor] | None = None  # their block scales (FP8 held)

    fp8_names = ("gate_up_proj", "down_proj")

    def fp8_refusal(self, block: tuple[int, int]) -> str | None:
        if self.intermediate_size % block[0]:  # the up rows would start inside a scale block of [gate | up]
            return f"moe_intermediate_size {self.intermediate_size} is not a multiple of {block[0]}"
        return None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routes [T, k] -> sum over k of weight * expert(x), [T, H] in x's dtype."""
        if self.executor is not None:
            return self.executor.forward(x, topk_weights, topk_ids)
        fp8 = None
        if self.stack_with_shared is not None:  # the routes end with the shared expert, stacked last
            w13, w2 = self.stack_with_shared
            if self.fp8_block is not None:
                fp8 = (*self.scales_with_shared, self.fp8_block)
            # the decode GEMV starts the shared route before the ids are final, on the premise that x was
            # written at least two launches back; FREETOKEN_ROUTER_TOPK_FUSED writes x and the ids in one
            shared_last = not kernel_env().router_topk_fused
            return all_reduce(run_stacked_experts(x, w13, w2, topk_weights, topk_ids, shared_last, fp8))
        return all_reduce(run_stacked_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                              fp8=self.fp8_bank()))

    def fp8_bank(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
        """(scale_inv of gate_up_proj, of down_proj, block) when the experts hold block FP8, else None."""
        if self.fp8_block is None:
            return None
        return self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.fp8_block

    @property
    def bytes_per_expert(self) -> int:
        """One expert's real bytes (values, and scales where FP8): a host -> device copy of it."""
        tensors = [self.gate_up_proj, self.down_proj]
        if self.fp8_block is not None:
            tensors += [self.gate_up_proj_scale_inv, self.down_proj_scale_inv]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    # --- loading (models/weights.py) ----------------------------------------------------------
    def load_units(self, param: nn.Parameter) -> list[tuple[int, int | None]]:
        if param is self.gate_up_proj:
            return [(e, s) for e in range(self.num_experts) for s in (0, 1)]
        return [(e, None) for e in range(self.num_experts)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None,
                      expert: int | None = None) -> list[tuple[int, int | None]]:
        """One expert's gate (shard 0), up (shard 1) or down weight, or (expert None) the whole stack."""
        loaded = self._rank_slice(param, loaded, shard, stacked=expert is None)
        name = "gate_up_proj" if param is self.gate_up_proj else "down_proj"
        if expert is None:
            self.copy_weight_rows(name, None, 0, param.shape[-2], loaded)
            return self.load_units(param)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} is out of range: the model has {self.num_experts} experts")
        start, length = 0, param.shape[-2]
        if param is self.gate_up_proj:
            if shard not in (0, 1):
                raise ValueError(f"gate_up_proj takes shard 0 (gate) or 1 (up), got {shard!r}")
            start, length = shard * self.intermediate_size, self.intermediate_size
        self.copy_weight_rows(name, expert, start, length, loaded)
        return [(expert, shard if param is self.gate_up_proj else None)]


    def _rank_slice(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None, stacked: bool) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (all of it with one rank)."""
        tp = tp_info()
        if tp.world_size == 1:
            return loaded
        i, full = self.intermediate_size, self.full_intermediate_size
        lo = tp.rank * i
        if param is self.down_proj:  # [.., H, I]: the intermediate columns
            return loaded.narrow(loaded.dim() - 1, lo, i)
        if not stacked:  # one expert's gate or up [I, H]
            return loaded.narrow(0, lo, i)
        rows = 1  # the stack [E, 2I, H]: this rank's gate rows, then its up rows
        cat = Fp8BlockWeight.cat if isinstance(loaded, Fp8BlockWeight) else torch.cat
        return cat([loaded.narrow(rows, lo, i), loaded.narrow(rows, full + lo, i)], dim=rows)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, a [E, H] linear layer) -> top-k -> stacked experts. Called like a dense MLP, or
    (`fuses_input_norm`) with the decoder layer's post-attention norm, which then runs inside the
    router's launch at batch-1 decode (layers/norm_linear.py `norm_linear_normed`)."""

    fuses_input_norm = True

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype | None, expert_device: torch.device | str | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, dtype, expert_device)
        # FREETOKEN_ROUTER_TOPK_FUSED: the router launch's int32 arrival counter (_router_topk)
        self._route_counter: torch.Tensor | None = None

    # the router's last row is a stacked shared expert's gate: k + 1 routes (models/qwen3_next.py)
    routes_shared_expert = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_router_logits(x, self.gate(x))

    def forward_with_norm(self, norm: nn.Module, x: torch.Tensor,
                          residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (self(norm(x + residual)), x + residual)."""
        if kernel_env().router_topk_fused and use_fused_moe(x) and fuses_norm_gemv_normed(norm, self.gate, x, residual):
            from ..kernels import norm_gemv as triton_norm_gemv  # CUDA only

            weights, ids, h, residual = triton_norm_gemv.norm_gemv_routed(
                x, residual, norm.weight, norm.eps, self.gate.weight, self._router_topk(x.device),
                zero_centered=type(norm) is ZeroCenteredRMSNorm)
            return self.from_routes(h, weights, ids), residual
        logits, h, residual = norm_linear_normed(norm, self.gate, x, residual)
        return self.from_router_logits(h, logits), residual

    def from_router_logits(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(logits, self.top_k, self.renormalize, self.routes_shared_expert)
        return self.from_routes(x, weights, ids)

    def from_routes(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, weights, ids)

    def _router_topk(self, device: torch.device):
        """The top-k spec of the router's one-launch path, with this layer's arrival counter (allocated on
        first use; zero between launches, so a CUDA graph may capture its first fill)."""
        from ..kernels.norm_gemv import RouterTopK

        counter = self._route_counter
        if counter is None or counter.device != device:
            counter = self._route_counter = torch.zeros(1, dtype=torch.int32, device=device)
        return RouterTopK(self.top_k, self.renormalize, self.routes_shared_expert, counter)
