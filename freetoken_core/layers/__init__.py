"""Model building blocks: plain torch, shared by every model in freetoken_core.models."""

from .activation import SiluAndMul, silu_and_mul
from .embedding import ParallelLMHead, VocabEmbedding
from .linear import Linear, MergedLinear, QKVLinear
from .norm import RMSNorm, ZeroCenteredRMSNorm, rms_norm
from .rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "Linear", "MergedLinear", "ParallelLMHead", "QKVLinear", "RMSNorm", "RotaryEmbedding", "SiluAndMul",
    "VocabEmbedding", "ZeroCenteredRMSNorm", "rms_norm", "rope_parameters", "silu_and_mul",
]
