"""Batch-1 decode from the QKV row to o_proj in one launch (attention/triton/decode_oproj.py,
FREETOKEN_ATTN_OPROJ_FUSED): the kernel against the unfused references, its flags left zero for the next
launch, and the wiring through `Attention.attend` and `TritonBackend.fused_decode_oproj`.

On CPU the kernel runs under the Triton interpreter in fp32/fp16 (tiny shapes); the GPU tests (skipped
without CUDA) take bf16 at Qwen3-30B-A3B's attention shape, eagerly and replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from attn_cases import make_case

from freetoken_core.attention.triton.decode import alloc_partials, alloc_split_counters
from freetoken_core.attention.triton.decode_oproj import (
    alloc_oproj_scratch, decode_attention_oproj, decode_attention_oproj_reference,
)
from freetoken_core.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Problem:
    """One request of `seq_len` keys (the last one new), its QKV row, norms, rotary table and o_proj."""

    def __init__(self, seq_len: int, heads: int, kv_heads: int, head_dim: int, hidden: int, page_size: int,
                 dtype: torch.dtype, seed: int = 0, zero_centered: bool = False) -> None:
        self.case = make_case([seq_len - 1], [1], heads, kv_heads, head_dim, page_size, dtype, str(DEVICE), seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.heads, self.kv_heads, self.seq_len, self.dtype = heads, kv_heads, seq_len, dtype
        self.qkv = (2.0 * torch.randn(1, (heads + 2 * kv_heads) * head_dim, generator=g)).to(DEVICE, dtype)
        self.q_weight = (1.0 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype)
        self.k_weight = (1.0 + 0.3 * torch.randn(head_dim, generator=g)).to(DEVICE, dtype)
        self.o_weight = (torch.randn(hidden, heads * head_dim, generator=g) * (heads * head_dim) ** -0.5).to(
            DEVICE, dtype)
        params = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}
        self.rope = RotaryEmbedding(head_dim, 4096, params, dtype).to(DEVICE)
        self.positions = torch.tensor([seq_len - 1], dtype=torch.int64, device=DEVICE)
        self.scale = head_dim ** -0.5
        self.zero_centered = zero_centered

    def common(self) -> tuple:
        return (self.qkv, self.positions, self.heads, self.kv_heads, self.q_weight, self.k_weight, 1e-6, 1e-6,
                self.rope.cos_sin_cache, self.zero_centered)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.case
        k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
        y = decode_attention_oproj_reference(*self.common(), k_cache, v_cache, c.page_table, c.table_rows[0],
                                             self.seq_len, c.out_loc, self.scale, self.o_weight)
        return y, k_cache, v_cache

    def run(self, num_splits: int, scratch=None, min_split_tokens: int = 64,
            config: dict | None = None) -> torch.Tensor:
        c = self.case
        o_buf, flags = scratch or alloc_oproj_scratch(self.heads, c.k_cache.shape[-1], DEVICE)
        part_out = part_lse = counters = None
        if num_splits > 1:
            part_out, part_lse = alloc_partials(1, self.heads, num_splits, c.k_cache.shape[-1], DEVICE)
            counters = alloc_split_counters(1, self.kv_heads, DEVICE)
        y = decode_attention_oproj(
            *self.common(), c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows[:1]), c.ints([self.seq_len]),
            c.out_loc, self.scale, self.o_weight, o_buf, flags, num_splits=num_splits, part_out=part_out,
            part_lse=part_lse, split_counters=counters, min_split_tokens=min_split_tokens, config=config)
        assert flags.tolist() == [0], "the launch must leave its flag zero for the next one"
        if counters is not None:
            assert counters.count_nonzero().item() == 0
        return y


def _check(problem: Problem, y: torch.Tensor, tol: float) -> None:
    want, k_cache, v_cache = problem.reference()
    torch.testing.assert_close(y, want, atol=tol, rtol=tol)
    # the new key and value where store_kv puts them (the rest of the caches untouched)
    torch.testing.assert_close(problem.case.k_cache, k_cache, atol=tol, rtol=tol)
    torch.testing.assert_close(problem.case.v_cache, v_cache, atol=0, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("seq_len,num_splits,min_split", [
    (5, 1, 64),  # one split: the attention program writes its heads' output itself
    (37, 3, 8),  # three active splits merged by the last to finish
    (9, 4, 8),  # fewer active splits than launched (the rest exit at once)
])
def test_fused_decode_oproj_matches_the_unfused_references(page_size, dtype, tol, seq_len, num_splits, min_split):
    p = Problem(seq_len, 4, 2, 16, 24, page_size, dtype)
    _check(p, p.run(num_splits, min_split_tokens=min_split, config=dict(block_rows=4, block_k=16, pre_k=32,
                                                                           num_warps=4)), tol)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_group_of_eight_and_zero_centred_norm(zero_centered):
    p = Problem(21, 8, 1, 16, 20, 4, torch.float32, seed=5, zero_centered=zero_centered)
    _check(p, p.run(2, min_split_tokens=8, config=dict(block_rows=8, block_k=32, pre_k=64, num_warps=4)), 2e-5)


@pytest.mark.parametrize("spread", [1, 0])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("seq_len,num_splits", [(5, 1), (37, 3)])
def test_attention_programs_rows_spread_over_the_others(spread, dtype, tol, seq_len, num_splits):
    """128 rows of 4 a program = 32 programs: 2 x S attention programs hand their rows, one each, to the programs
    after them (spread), or load them after their attention (not spread); the same output either way."""
    p = Problem(seq_len, 4, 2, 16, 128, 4, dtype, seed=2)
    _check(p, p.run(num_splits, min_split_tokens=8, config=dict(block_rows=4, block_k=32, pre_k=32, num_warps=4,
                                                                   spread=spread)), tol)


def test_launches_in_a_row_share_one_scratch():
    """Layers one after another reuse o_buf and the flags: each launch must find them as the last left them."""
    scratch = alloc_oproj_scratch(4, 16, DEVICE)
    for seed, (seq_len, splits) in enumerate([(30, 3), (6, 1), (17, 2)]):
        p = Problem(seq_len, 4, 2, 16, 12, 2, torch.float32, seed=seed)
        _check(p, p.run(splits, scratch=scratch, min_split_tokens=8,
                        config=dict(block_rows=4, block_k=64, pre_k=64, num_warps=4)), 2e-5)


def test_bad_tiles_are_refused():
    p = Problem(5, 4, 2, 16, 8, 1, torch.float32)
    with pytest.raises(AssertionError, match="do not split"):
        p.run(1, config=dict(block_rows=4, block_k=48, pre_k=16, num_warps=4))


# ------------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seq_len,num_splits", [(17, 3), (272, 3), (1100, 32)])
def test_gpu_bf16_qwen3_moe_shape(page_size, seq_len, num_splits):
    p = Problem(seq_len, 32, 4, 128, 2048, page_size, torch.bfloat16)
    _check(p, p.run(num_splits), 2e-2)


@needs_cuda
def test_gpu_replayed_in_a_cuda_graph():
    """Captured once, replayed for growing lengths through static metadata, as the engine's graphs do."""
    p = Problem(300, 32, 4, 128, 2048, 16, torch.bfloat16)
    c = p.case
    o_buf, flags = alloc_oproj_scratch(32, 128, DEVICE)
    part_out, part_lse = alloc_partials(1, 32, 4, 128, DEVICE)
    counters = alloc_split_counters(1, 4, DEVICE)
    seq_lens, positions, out_loc = c.ints([2]), torch.tensor([1], device=DEVICE), c.out_loc.clone()
    table_rows = c.ints(c.table_rows[:1])  # static, as all of the graph's inputs: no host copy while capturing

    def step() -> torch.Tensor:
        return decode_attention_oproj(
            p.qkv, positions, 32, 4, p.q_weight, p.k_weight, 1e-6, 1e-6, p.rope.cos_sin_cache, False, c.k_cache,
            c.v_cache, c.page_table, table_rows, seq_lens, out_loc, p.scale, p.o_weight, o_buf, flags,
            num_splits=4, part_out=part_out, part_lse=part_lse, split_counters=counters)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    page_size = c.k_cache.shape[1]
    row = c.table_rows[0]
    for n in (40, 129, 300):
        seq_lens.fill_(n)
        positions.fill_(n - 1)
        out_loc.fill_(int(c.page_table[row, (n - 1) // page_size]) * page_size + (n - 1) % page_size)
        p.seq_len, p.positions, c.out_loc = n, positions.clone(), out_loc.clone()
        want, k_cache, _ = p.reference()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(c.k_cache, k_cache, atol=2e-2, rtol=2e-2)
        assert flags.tolist() == [0]


# ------------------------------------------------------------------------------ Attention.attend


def _attend_steps(monkeypatch, prompt_lens: tuple[int, ...], steps: int = 3, dtype=torch.float32,
                  heads: int = 4, kv_heads: int = 2, head_dim: int = 16, hidden: int = 64,
                  tol: float = 2e-5) -> list[int]:
    """Prefill, then decode steps through Attention.attend with FREETOKEN_ATTN_OPROJ_FUSED off and on
    (test_fused_kv_store's rig): outputs and caches equal within rounding. Returns the rows of each fused call."""
    from test_fused_kv_store import Rig, _attend_both_ways, _attention

    from freetoken_core.attention.triton import backend as triton_backend
    from freetoken_core.models.blocks import Attention

    monkeypatch.setattr(Attention, "_fuses_qk_norm_rotary", lambda self, q: True)  # the CPU keeps torch norms
    calls: list[int] = []
    real = triton_backend.decode_attention_oproj
    monkeypatch.setattr(triton_backend, "decode_attention_oproj",
                        lambda qkv, *a, **kw: (calls.append(qkv.shape[0]), real(qkv, *a, **kw))[1])
    attn = _attention(heads, kv_heads, head_dim, dtype, gated=False, hidden_size=hidden)
    rig = Rig(heads, kv_heads, head_dim, 4, dtype, num_layers=1)
    _attend_both_ways(monkeypatch, attn, rig, "FREETOKEN_ATTN_OPROJ_FUSED", steps, prompt_lens, tol=tol)
    return calls


def test_attend_takes_the_fused_launch_for_one_decode_row(monkeypatch):
    assert _attend_steps(monkeypatch, (70,)) == [1, 1, 1]  # decode rows only, never the prefill


def test_attend_keeps_the_separate_launches_for_two_requests(monkeypatch):
    assert _attend_steps(monkeypatch, (6, 3), steps=1) == []


def test_other_backends_and_gated_attention_take_no_fused_launch(monkeypatch):
    from test_fused_kv_store import _attention

    from freetoken_core import env
    from freetoken_core.attention.base import AttnBackend, QKNormRope
    from freetoken_core.models.blocks import Attention

    assert AttnBackend.fused_decode_oproj(None, 0, None, None, None, None, None) is None  # the default seam
    monkeypatch.setattr(Attention, "_fuses_qk_norm_rotary", lambda self, q: True)
    monkeypatch.setenv("FREETOKEN_ATTN_OPROJ_FUSED", "1")
    env.kernel_env.cache_clear()
    try:
        gated = _attention(4, 2, 16, torch.float32, gated=True)  # its q rows carry the gate
        row = torch.zeros(1, gated.qkv_proj.q_size + 2 * gated.qkv_proj.kv_size)
        assert gated._fused_decode_oproj(torch.zeros(1, dtype=torch.int64), row) is None
    finally:
        env.kernel_env.cache_clear()
    assert QKNormRope._fields == ("q_weight", "k_weight", "q_eps", "k_eps", "cos_sin_cache", "zero_centered")


def test_engine_greedy_through_the_fused_launch_matches_transformers(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE through the whole engine on the Triton backend (the interpreter), one request at a time so
    that every decode step takes the fused launch: greedy tokens equal transformers fp32."""
    from freetoken_core import LLM, SamplingParams, env
    from freetoken_core.attention.triton import backend as triton_backend
    from freetoken_core.models.blocks import Attention
    from tests.models.moe_checkpoints import PROMPTS, hf_greedy, make_tiny_moe

    path = make_tiny_moe(tmp_path, "per_expert", num_experts_per_tok=4, norm_topk_prob=True)
    expected = hf_greedy(path, PROMPTS[:2], 6)
    calls = []
    real = triton_backend.decode_attention_oproj
    monkeypatch.setattr(triton_backend, "decode_attention_oproj", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(Attention, "_fuses_qk_norm_rotary", lambda self, q: True)  # the CPU keeps torch norms
    monkeypatch.setenv("FREETOKEN_ATTN_OPROJ_FUSED", "1")
    env.kernel_env.cache_clear()
    try:
        llm = LLM(path, dtype="float32", attention_backend="triton", page_size=4, max_running_req=1, num_pages=64)
        got = [o.token_ids for o in llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))]
    finally:
        env.kernel_env.cache_clear()
    assert len(calls) == 2 * 5 * 3  # 2 prompts x 5 decode steps x 3 attention layers
    assert got == expected


@needs_cuda
def test_gpu_attend_bf16_qwen3_moe_shape(monkeypatch):
    assert _attend_steps(monkeypatch, (200,), dtype=torch.bfloat16, heads=32, kv_heads=4, head_dim=128,
                         hidden=2048, tol=2e-2) == [1, 1, 1]


def test_the_gpus_one_launch_form_passes_the_sm90_frontend(tmp_path):
    """The interpreter runs the kernel as two launches (PHASE 1, then 2); the GPU compiles PHASE 0, where one
    program does both parts, in bf16 with packed weights. tests/test_sm90_frontend.py checks the launches the
    tests above made; this puts their PHASE 0 bf16 form through Triton's sm_90 frontend too."""
    from tests import triton_launches
    from tests.test_sm90_frontend import _frontend

    records = [r for r in triton_launches.recorded() if r["name"] == "_decode_oproj_kernel"]
    if not records:
        pytest.skip("no interpreted launches of the kernel were recorded (a GPU machine compiles it in its tests)")
    half = [r for r in records if r["args"]["W"] == ["tensor", "int32"]]  # fp16 runs: packed weights
    assert half, "no packed (16-bit) launch was recorded"
    compiled = []
    for rec in half:
        args = {name: (["tensor", "bfloat16"] if desc == ["tensor", "float16"] else desc)
                for name, desc in rec["args"].items()}
        compiled.append({**rec, "args": {**args, "PHASE": ["const", 0]}})
    lines = _frontend(tmp_path, compiled)
    assert lines[-1]["checked"] == len(compiled) and not lines[:-1], lines[:3]


def test_backend_keeps_the_separate_launches_past_one_attention_program_an_sm():
    """The attention programs wait for each other, so all must be resident: at most one per SM (the CPU backend
    counts 4). More KV heads x splits than that: the backend answers None (the caller runs the separate launches)."""
    from test_fused_kv_store import Rig

    from freetoken_core.attention.triton.backend import TritonAttnMetadata
    from freetoken_core.core import Batch

    rig = Rig(4, 2, 16, 4, torch.float32, num_layers=1)
    backend = rig.fused
    assert backend.num_sms == 4
    ints = torch.ones(1, dtype=torch.int32)
    batch = Batch("decode", [], [1], [1], torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                  torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [])
    qkv = torch.zeros(1, (4 + 2 * 2) * 16)
    args = (0, batch, torch.zeros(1, dtype=torch.int64), qkv, None, torch.zeros(8, 64))
    for splits, fused in ((2, True), (3, False)):
        batch.attn_metadata = TritonAttnMetadata("decode", 1, ints, ints, num_splits=splits)
        if fused:  # 2 x 2 programs fit: the launch is taken (stopped at its first use of the norms here)
            with pytest.raises(TypeError):
                backend.fused_decode_oproj(*args)
        else:
            assert backend.fused_decode_oproj(*args) is None
