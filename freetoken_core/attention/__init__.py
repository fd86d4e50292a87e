"""Attention backends: select one by name (`create_backend`)."""

from __future__ import annotations

import torch

from ..kvcache.pool import KVCache
from .base import AttnBackend, AttnLayout, BackendInfo

BACKEND_NAMES = ("torch", "triton", "flashinfer", "fa")


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        if device.type == "cuda":
            try:
                from .triton import backend as _  # noqa: F401

                return "triton"
            except ImportError:
                return "torch"
        return "torch"
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKEND_NAMES)}")
    return name


def create_backend(name: str, layout: AttnLayout, kv_cache: KVCache, page_table: torch.Tensor) -> AttnBackend:
    name = resolve_backend_name(name, kv_cache.device)
    if name == "torch":
        from .torch_native import TorchNativeBackend

        return TorchNativeBackend(layout, kv_cache, page_table)
    if name == "triton":
        from .triton.backend import TritonBackend

        return TritonBackend(layout, kv_cache, page_table)
    if name == "flashinfer":
        from .flashinfer import FlashInferBackend

        return FlashInferBackend(layout, kv_cache, page_table)
    from .fa import FlashAttnBackend

    return FlashAttnBackend(layout, kv_cache, page_table)


__all__ = ["AttnBackend", "AttnLayout", "BackendInfo", "create_backend", "resolve_backend_name"]
