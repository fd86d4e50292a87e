"""Token embedding and LM head, vocab-parallel under tensor parallelism: each rank holds V / n rows;
the embedding sums the ranks' rows (each rank contributes the ids in its range), the LM head gathers
the ranks' logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import all_gather_last_dim, all_reduce, tp_info
from .gemv_policy import GemvRouted
from .linear import copy_checked, pack_cpu_weight, packed_linear, use_packed


def _vocab_shard(vocab_size: int) -> tuple[int, int]:
    tp = tp_info()
    local = tp.shard(vocab_size, "vocab_size")
    return tp.rank * local, local


def _load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int) -> None:
    start, local = _vocab_shard(vocab_size)
    if tp_info().world_size > 1:
        loaded = loaded.narrow(0, start, local)
    copy_checked(param.data, loaded)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, local = _vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_info().world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        return all_reduce(out * mine[:, None].to(out.dtype))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size)


def _one_row_gemv(x: torch.Tensor, weight: torch.Tensor, min_elements: int) -> bool:
    from ..kernels import gemv as triton_gemv  # first CUDA use: CPU users never load Triton

    return triton_gemv.use_gemv(x, weight, min_elements)


class ParallelLMHead(GemvRouted, nn.Module):
    """Hidden rows -> vocabulary logits. With `tied` the embedding's weight is shared, not copied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tied = tied is not None
        self.packed: torch.Tensor | None = None  # CPU: oneDNN-prepacked weight (pack_for_cpu)
        # one-row CUDA logits go to the Triton GEMV, as `Linear`'s do (and the engine lowers this bar the
        # same way, use_gemv_for_all_sizes): cuBLAS would break the decode step's PDL chain right before
        # the step's largest weight (Qwen3.6's 248k x 2048 head is 1 GB of a batch-1 step's ~3.6 GB)
        self.init_gemv_policy()
        if tied is not None:
            self.weight = tied.weight
        else:
            _, local = _vocab_shard(vocab_size)
            self.weight = nn.Parameter(torch.empty(local, hidden_size, dtype=dtype), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] -> fp32 [R, vocab]. The matmul runs in the model dtype (as transformers
        does); only the result is widened, so samplers and logprobs work in fp32."""
        if use_packed(x, self.packed):
            logits = packed_linear(x, self.packed, None)
        elif x.is_cuda and _one_row_gemv(x, self.weight, self.gemv_min_elements):
            from ..kernels.gemv import gemv

            logits = gemv(x, self.weight)
        else:
            logits = F.linear(x, self.weight)
        return all_gather_last_dim(logits).float()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        _load_vocab_rows(param, loaded, self.vocab_size)

    def pack_for_cpu(self) -> None:
        self.packed = pack_cpu_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)
