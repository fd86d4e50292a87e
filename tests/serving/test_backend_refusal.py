"""An engine started with an optional attention backend whose package is missing (or is the wrong
build) refuses at start, and the message says how to install what it needs (issue 14)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from freetoken_core.attention import AttnLayout, create_backend
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import KVCache, KVCacheShape


def _backend(name: str):
    mgr = CacheManager(16, 4, 2, 32, torch.device("cpu"))
    kv = KVCache(KVCacheShape(1, 2, 16, 4, torch.float32), 16, torch.device("cpu"))
    return create_backend(name, AttnLayout(4, 2, 16, 0.25), kv, mgr.page_table)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_fa_without_flash_attn_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"`flash_attn` package, which is not installed: install flash-attn 2\.x"):
        _backend("fa")


def _fake_flash_attn_4(monkeypatch, cute: types.ModuleType | None) -> None:
    fake = types.ModuleType("flash_attn")  # what flash-attn-4 installs: flash_attn.cute, no 2.x API
    fake.__version__ = "4.0.0b36"
    fake.__path__ = []  # a package
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)  # None: importing it fails


def test_fa_with_a_broken_flash_attn_4_is_refused_with_the_cause(monkeypatch):
    _fake_flash_attn_4(monkeypatch, None)  # e.g. its CuTe DSL (nvidia-cutlass-dsl) is missing
    with pytest.raises(ImportError, match=r"\(4\.0\.0b36\) has neither \((ModuleNotFoundError|ImportError): .*flash_attn\.cute") as e:
        _backend("fa")
    assert "pip install flash-attn --no-build-isolation" in str(e.value)
    assert "pip install flash-attn-4" in str(e.value)


def test_fa_takes_flash_attn_4_when_2_is_absent(monkeypatch):
    from freetoken_core.attention.fa import import_flash_attn

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = lambda *a, **k: None
    _fake_flash_attn_4(monkeypatch, cute)
    api = import_flash_attn()
    assert api.version == 4 and api.varlen is cute.flash_attn_varlen_func and api.with_kvcache is None
    with pytest.raises(ValueError, match="runs on CUDA only"):  # this box: the API is found, the device is not
        _backend("fa")


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_flashinfer_without_flashinfer_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"`flashinfer` package, which is not installed: `pip install flashinfer-python`"):
        _backend("flashinfer")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_engine_start_refuses_fa_before_serving(smollm2_path):
    from freetoken_core import LLM

    with pytest.raises(ImportError, match="attention backend 'fa' needs"):
        LLM(smollm2_path, dtype="float32", attention_backend="fa")
