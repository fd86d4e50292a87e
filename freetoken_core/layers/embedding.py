"""Token embedding and LM head (one device; the names leave room for tensor parallelism)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import pack_cpu_weight, packed_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(nn.Module):
    """Hidden rows -> vocabulary logits. With `tied` the embedding's weight is shared, not copied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tied = tied is not None
        self.packed: torch.Tensor | None = None  # CPU: oneDNN-prepacked weight (pack_for_cpu)
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] -> fp32 [R, vocab]. The matmul runs in the model dtype (as transformers
        does); only the result is widened, so samplers and logprobs work in fp32."""
        if self.packed is not None and x.device.type == "cpu":
            return packed_linear(x, self.packed, None).float()
        return F.linear(x, self.weight).float()

    def pack_for_cpu(self) -> None:
        self.packed = pack_cpu_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)
