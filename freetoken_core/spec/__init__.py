"""Speculative decoding: drafters and the acceptance of their drafts in a verify step."""

from .ngram import NgramProposer
from .verify import (
    VerifyResult,
    greedy_accept,
    greedy_accept_device,
    rejection_accept,
    rejection_accept_device,
    sampling_probs,
    verify,
    verify_device,
)

__all__ = [
    "NgramProposer",
    "VerifyResult",
    "greedy_accept",
    "greedy_accept_device",
    "rejection_accept",
    "rejection_accept_device",
    "sampling_probs",
    "verify",
    "verify_device",
]
