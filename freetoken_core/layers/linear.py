"""Linear layers whose weights load from Hugging Face checkpoints, including fused ones.

q/k/v and gate/up are stored as one weight each, so a layer runs one matmul instead of three (or
two). The checkpoint still names them separately: `weight_loader(param, tensor, shard)` copies a
checkpoint tensor into its rows of the fused weight.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..env import kernel_env
from ..parallel import all_reduce, tp_info
from .fp8 import Fp8BlockWeight, Fp8Held, dense_weight
from .gemv_policy import GemvRouted


def cpu_packing_available() -> bool:
    """oneDNN weight prepacking (x86 CPU builds of torch)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and kernel_env().cpu_packed_linear
    )


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-prepacked copy of a [out, in] fp32/bf16 CPU weight, or None where that cannot be done.

    CPU decode reads every weight once per step, and the packed oneDNN kernel streams them about twice as
    fast as MKL's GEMV (CPU row of benchmarks/RESULTS.md)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not cpu_packing_available():
        return None
    if weight.dtype == torch.bfloat16 and not _mkldnn_bf16():  # oneDNN's bf16 path needs avx512 or avx_ne_convert
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=8)


@functools.cache
def _mkldnn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# oneDNN JIT-builds a primitive for each input row count and weight shape and keeps it in two caches of 1024
# entries (ideep's LRU_CACHE_CAPACITY, oneDNN's primitive cache), a few hundred KB apiece: prefills of every prompt
# length would fill them, hundreds of MB. Packing pays at decode-sized row counts (~2x MKL at 1-16 rows); from ~32
# rows on MKL is as fast and caches nothing per shape, so only these row counts reach oneDNN.
PACKED_MAX_ROWS = 32


def use_packed(x: torch.Tensor, packed: torch.Tensor | None) -> bool:
    return packed is not None and x.device.type == "cpu" and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def copy_checked(dst: torch.Tensor, loaded: torch.Tensor | Fp8BlockWeight) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, converting dtype and device in one copy (a block-FP8
    weight in the parameter's format: layers/fp8.py `dense_weight`)."""
    if dst.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(dense_weight(loaded, dst))


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    # torch.empty: every value is overwritten by the loader (which checks that nothing is missed).
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(Fp8Held, GemvRouted, nn.Module):
    """y = x W^T (+ b). W is [out, in] like the checkpoint; or, holding block FP8 (layers/fp8.py `Fp8Held`), W in
    float8_e4m3fn with `weight_scale_inv`, multiplied by kernels/fp8_gemm.py `fp8_linear` on any row count.

    Tensor parallelism (freetoken_core/parallel.py): `parallel="column"` keeps this rank's rows of
    W (its share of the outputs), `"row"` its columns (its share of the inputs) and sums the partial
    outputs over the ranks (the bias added once, after the sum). The checkpoint holds the whole
    weight; `weight_loader` takes this rank's slice. One rank: both are the plain layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None,
                 parallel: str | None = None):
        super().__init__()
        tp = tp_info()
        self.parallel = parallel if tp.world_size > 1 else None
        if self.parallel == "column":
            out_features = tp.shard(out_features, "output features")
        elif self.parallel == "row":
            in_features = tp.shard(in_features, "input features")
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None
        self.packed: torch.Tensor | None = None  # CPU: oneDNN-prepacked weight (pack_for_cpu)
        self.init_gemv_policy()

    fp8_names = ("weight",)
    takes_rows_gemm = True

    def fp8_refusal(self, block: tuple[int, int]) -> str | None:
        # the kernels read element (r, c) at scale_inv[r // 128, c // 128]: a fused segment that starts inside a
        # block would share that block's scale with its neighbour (tiny test shapes; every real Qwen3 one aligns)
        starts = [self.shard_rows(u)[0] for u in self.load_units(self.weight) if u is not None]
        if any(start % block[0] for start in starts):
            return f"a fused segment starts inside a {block[0]}-row scale block (rows {starts})"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row":
            y = all_reduce(self._matmul(x, None))
            return y if self.bias is None else y + self.bias
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_block is not None:
            from ..kernels.fp8_gemm import fp8_linear  # Triton: on CPU only where FP8 is kept (under the interpreter)

            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:  # the kernels read unit-stride rows (F.linear took any layout)
                rows = rows.contiguous()
            y = fp8_linear(rows, self.weight, self.weight_scale_inv, bias, self.fp8_block)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if use_packed(x, self.packed):
            return packed_linear(x, self.packed, bias)
        if x.is_cuda:
            from ..kernels import gemv as triton_gemv  # first CUDA use: CPU users never load Triton

            if triton_gemv.use_gemv(x, self.weight, self.gemv_min_elements):  # batch-1 decode: beats cuBLAS
                return triton_gemv.gemv(x, self.weight, bias)
            if self.rows_gemm and triton_gemv.use_rows_gemm(x, self.weight, self.gemv_min_elements):
                return triton_gemv.rows_gemm(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def pack_for_cpu(self) -> None:
        """Call after loading weights; the dense weight stays (for loading and inspection)."""
        self.packed = pack_cpu_weight(self.weight)

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        """(offset, size) of a checkpoint shard in the output rows; plain layers have one shard."""
        return 0, self.out_features

    def source_rows(self, shard: str | int | None) -> tuple[int, int]:
        """(offset, size) of this rank's rows in the checkpoint tensor of `shard`."""
        off, size = (0, self.out_features) if shard is None else self.shard_rows(shard)
        return (tp_info().rank * size, size) if self.parallel == "column" else (0, size)

    def load_units(self, param: nn.Parameter) -> list[str | int | None]:
        """The checkpoint shards that together fill `param` (models/weights.py checks each arrives)."""
        return [None]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None) -> None:
        off, size = (0, param.shape[0]) if shard is None else self.shard_rows(shard)
        if self.parallel == "row" and param is self.weight:
            loaded = loaded.narrow(1, tp_info().rank * self.in_features, self.in_features)
        elif self.parallel is not None and not (self.parallel == "row" and param is self.bias):
            src_off, size = self.source_rows(shard)
            if loaded.shape[0] != size * tp_info().world_size:
                raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} does not split into "
                                 f"{tp_info().world_size} shards of {size} rows")
            loaded = loaded.narrow(0, src_off, size)
        self.copy_rows(param, off, size, loaded)

    def copy_rows(self, param: nn.Parameter, off: int, size: int, loaded: torch.Tensor | Fp8BlockWeight) -> None:
        """Output rows [off, off + size) of `param` from a checkpoint tensor, in the format the layer holds."""
        if param is self.weight:
            self.copy_weight_rows("weight", None, off, size, loaded)
        else:
            copy_checked(param.data.narrow(0, off, size), loaded)


class QKVLinear(Linear):
    """q, k and v projections fused: output rows are [q (H*D) | k (Hkv*D) | v (Hkv*D)].

    With tensor parallelism each rank keeps H/n query heads and Hkv/n KV heads, or, when there are
    fewer KV heads than ranks, a copy of the one KV head its query heads use."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, dtype: torch.dtype | None = None):
        tp = tp_info()
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
            self.kv_start = tp.rank * self.num_kv_heads
        else:  # replicated: rank r's query heads share KV head r * Hkv // n
            if tp.world_size % num_kv_heads:
                raise ValueError(f"num_key_value_heads={num_kv_heads} neither splits over nor divides "
                                 f"tensor_parallel_size={tp.world_size}")
            self.num_kv_heads, self.kv_start = 1, tp.rank * num_kv_heads // tp.world_size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype)
        self.parallel = "column" if tp.world_size > 1 else None

    def load_units(self, param: nn.Parameter) -> list[str | int | None]:
        return ["q", "k", "v"]

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard]

    def source_rows(self, shard: str | int | None) -> tuple[int, int]:
        if self.parallel is None:
            return super().source_rows(shard)
        if shard == "q":
            return tp_info().rank * self.q_size, self.q_size
        return self.kv_start * self.head_dim, self.kv_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None) -> None:
        if self.parallel is None:
            return super().weight_loader(param, loaded, shard)
        off, size = self.shard_rows(shard)
        src_off, _ = self.source_rows(shard)
        self.copy_rows(param, off, size, loaded.narrow(0, src_off, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (no copies) of the fused output."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output rows (gate/up: shards 0, 1);
    with `parallel="column"` each rank keeps its share of every segment."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None,
                 parallel: str | None = None):
        tp = tp_info()
        if parallel == "column" and tp.world_size > 1:
            out_sizes = [tp.shard(n, "a fused projection's segment") for n in out_sizes]
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.parallel = parallel if tp.world_size > 1 else None

    def load_units(self, param: nn.Parameter) -> list[str | int | None]:
        return list(range(len(self.out_sizes)))

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        i = int(shard)
        return sum(self.out_sizes[:i]), self.out_sizes[i]
