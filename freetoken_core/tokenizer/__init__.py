"""Tokenizer (encode, chat template, EOS, stop words) and incremental, UTF-8-safe detokenizer."""

from .detokenize import DetokStep, DetokWindow, IncrementalDetokenizer, decode_step, window_anchors
from .tokenize import Tokenizer, load_tokenizer, validate_chat_messages

__all__ = [
    "DetokStep",
    "DetokWindow",
    "IncrementalDetokenizer",
    "Tokenizer",
    "decode_step",
    "load_tokenizer",
    "validate_chat_messages",
    "window_anchors",
]
