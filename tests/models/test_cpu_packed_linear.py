"""oneDNN-prepacked CPU linears: only decode-sized row counts reach oneDNN, whose caches keep a JIT primitive per
row count and weight shape (~0.3 MB each, up to 1024 per cache): prompts of many lengths must not add one apiece.
Both paths give F.linear's result."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

import freetoken_core.layers.embedding as embedding_mod
import freetoken_core.layers.linear as linear_mod
from freetoken_core import LLM, SamplingParams
from freetoken_core.layers.embedding import ParallelLMHead
from freetoken_core.layers.linear import PACKED_MAX_ROWS, Linear, cpu_packing_available

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="torch build without oneDNN weight packing")


def _record_packed_calls(monkeypatch) -> collections.Counter:
    """Counts (rows, weight shape) of every call that reaches oneDNN; the real call still runs."""
    seen: collections.Counter = collections.Counter()
    real = linear_mod.packed_linear

    def recording(x, packed, bias):
        seen[(x.numel() // x.shape[-1], tuple(packed.shape))] += 1
        return real(x, packed, bias)

    monkeypatch.setattr(linear_mod, "packed_linear", recording)
    monkeypatch.setattr(embedding_mod, "packed_linear", recording)
    return seen


def test_prompts_of_many_lengths_reach_onednn_only_at_decode_row_counts(tiny_model_factory, monkeypatch):
    llm = LLM(tiny_model_factory(arch="llama"), dtype="float32", device="cpu", page_size=4, num_pages=400,
              max_running_req=4)
    seen = _record_packed_calls(monkeypatch)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate(range(33, 73, 5))]  # 8 lengths > 32
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    rows = {r for r, _ in seen}
    weights = {w for _, w in seen}
    assert rows and rows <= set(range(1, PACKED_MAX_ROWS + 1)), sorted(rows)  # decode steps still packed
    # the bound on what oneDNN can cache, however many prompt lengths come
    assert len(seen) <= PACKED_MAX_ROWS * len(weights)


@pytest.mark.parametrize("rows", [1, 5, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 97])
def test_packed_and_plain_rows_give_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(48, 40, bias=True, dtype=torch.float32)
    head = ParallelLMHead(300, 48, dtype=torch.float32)
    for p in (lin.weight, lin.bias, head.weight):
        p.data.copy_(torch.randn(p.shape, generator=g))
    lin.pack_for_cpu()
    head.pack_for_cpu()
    assert lin.packed is not None and head.packed is not None
    x = torch.randn(rows, 48, generator=g)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(x), F.linear(x, head.weight), atol=1e-5, rtol=1e-5)
