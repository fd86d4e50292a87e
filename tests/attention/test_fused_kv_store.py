"""The decode K/V store inside the q/k norm + rotary kernel (FREETOKEN_ROTARY_STORE_KV): the backend seam
(`AttnBackend.kv_store_target`, `forward(..., kv_stored=True)`) and `Attention.attend`'s use of it.

Two TritonBackends with their own caches share one page table: one stores with store_kv inside forward,
the other lets the rotary kernel store; their outputs and caches must be equal bit for bit. On CPU the
kernels run under the Triton interpreter in fp32/fp16 (tiny shapes); the GPU tests (skipped without
CUDA) take bf16 at Qwen3-30B-A3B's and Qwen3.6's attention shapes, and the gated o_proj GEMV
(FREETOKEN_ATTN_GATE_GEMV) through `Attention.attend`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attn_cases import manager_batch

from freetoken_core import env
from freetoken_core.attention.base import AttnLayout, KVStoreTarget
from freetoken_core.attention.torch_native import TorchNativeBackend
from freetoken_core.attention.triton import backend as triton_backend
from freetoken_core.attention.triton.backend import TritonBackend
from freetoken_core.config import SamplingParams
from freetoken_core.core import Batch, Context, Req, set_context
from freetoken_core.kernels.qk_norm_rotary import qk_norm_rotary
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import KVCache, KVCacheShape
from freetoken_core.layers import RMSNorm, ZeroCenteredRMSNorm
from freetoken_core.layers.rotary import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NUM_PAGES = 128


class Rig:
    """Two Triton backends (store_kv in forward / the fused store), one CacheManager, a rotary table."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 rot_dim: int | None = None, num_layers: int = 2) -> None:
        self.h, self.hkv, self.d, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.num_layers = num_layers
        self.mgr = CacheManager(num_pages=NUM_PAGES, page_size=page_size, max_running_req=4, max_seq_len=128,
                                device=DEVICE)
        shape = KVCacheShape(num_layers, num_kv_heads, head_dim, page_size, dtype)
        layout = AttnLayout(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        self.unfused = TritonBackend(layout, KVCache(shape, NUM_PAGES, DEVICE), self.mgr.page_table)
        self.fused = TritonBackend(layout, KVCache(shape, NUM_PAGES, DEVICE), self.mgr.page_table)
        self.rot_dim = rot_dim or head_dim
        params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": self.rot_dim / head_dim}
        self.rope = RotaryEmbedding(head_dim, 512, params, dtype).to(DEVICE)
        self.gen = torch.Generator().manual_seed(0)
        self.wq, self.wk = (1.0 + 0.3 * self.randn(head_dim), 1.0 + 0.3 * self.randn(head_dim))

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(DEVICE, self.dtype)

    def req(self, uid: int, prompt_len: int) -> Req:
        r = Req(uid, list(range(prompt_len)), SamplingParams())
        self.mgr.assign_row(r)
        return r

    def batch(self, phase: str, reqs: list[Req], extend_lens: list[int], rows_per_req: int = 1) -> Batch:
        return manager_batch(self.mgr, phase, reqs, extend_lens, rows_per_req, DEVICE)

    def qkv(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the model has them: views of one fused projection row."""
        qd, kvd = self.h * self.d, self.hkv * self.d
        row = 2.0 * self.randn(t, qd + 2 * kvd)
        q, k, v = row.split([qd, kvd, kvd], dim=-1)
        return q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)

    def prefill(self, reqs: list[Req]) -> None:
        """The prompts' K/V written straight into both caches (no attention: the interpreter is slow),
        after checking that a prefill batch keeps the backend's own store."""
        ext = [r.prompt_len for r in reqs]
        batch = self.batch("prefill", reqs, ext)
        self.fused.prepare_metadata(batch)
        assert self.fused.kv_store_target(0, batch) is None
        for layer in range(self.num_layers):
            _, k, v = self.qkv(batch.num_tokens)
            for backend in (self.unfused, self.fused):
                backend.kv_cache.store(layer, batch.out_loc, k, v)
        self.commit(reqs, ext)

    def step(self, batch: Batch, tol: float = 0.0) -> None:
        """Both backends on the same decode/verify rows: outputs and (after each layer) caches equal."""
        self.unfused.prepare_metadata(batch)
        md_unfused = batch.attn_metadata
        self.fused.prepare_metadata(batch)
        md_fused = batch.attn_metadata
        for layer in range(self.num_layers):
            q, k, v = self.qkv(batch.num_tokens)
            args = (batch.positions, q, k, self.wq, self.wk, 1e-6, 1e-6, self.rope.cos_sin_cache, self.rot_dim)
            batch.attn_metadata = md_unfused
            qn, kn = qk_norm_rotary(*args)
            want = self.unfused.forward(qn, kn, v, layer, batch)
            batch.attn_metadata = md_fused
            target = self.fused.kv_store_target(layer, batch)
            assert isinstance(target, KVStoreTarget) and target.out_loc is batch.out_loc
            assert target.k_cache is self.fused.kv_cache.layer(layer)[0]
            qf, kf = qk_norm_rotary(*args, v=v, kv_out=target)
            got = self.fused.forward(qf, kf, v, layer, batch, kv_stored=True)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            for a, b in zip(self.fused.kv_cache.layer(layer), self.unfused.kv_cache.layer(layer)):
                torch.testing.assert_close(a, b, atol=0, rtol=0)

    def decode_then_verify(self, prompt_lens: list[int], verify_rows: int, decode_steps: int = 2) -> None:
        """Prefill the prompts, run decode steps, then one verify step of `verify_rows` rows per request,
        each step checked by `step` (the fused store against store_kv)."""
        reqs = [self.req(i, n) for i, n in enumerate(prompt_lens)]
        self.prefill(reqs)
        ones = [1] * len(reqs)
        for _ in range(decode_steps):
            self.step(self.batch("decode", reqs, ones))
            self.commit(reqs, ones)
        self.step(self.batch("verify", reqs, [verify_rows] * len(reqs), rows_per_req=verify_rows))

    @staticmethod
    def commit(reqs: list[Req], extend_lens: list[int]) -> None:
        for r, e in zip(reqs, extend_lens):
            r.cached_len += e


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_and_verify_with_the_fused_store_match_store_kv(page_size, dtype):
    Rig(4, 2, 16, page_size, dtype, rot_dim=8, num_layers=1).decode_then_verify([7, 3], verify_rows=2)


def test_forward_skips_store_kv_only_when_told(monkeypatch):
    rig = Rig(4, 2, 16, 4, torch.float32, num_layers=1)
    reqs = [rig.req(0, 5)]
    rig.prefill(reqs)
    calls = []
    real = triton_backend.store_kv
    monkeypatch.setattr(triton_backend, "store_kv", lambda *a: (calls.append(1), real(*a))[1])
    batch = rig.batch("decode", reqs, [1])
    rig.fused.prepare_metadata(batch)
    q, k, v = rig.qkv(1)
    rig.fused.forward(q, k, v, 0, batch)
    assert len(calls) == 1
    rig.fused.forward(q, k, v, 0, batch, kv_stored=True)
    assert len(calls) == 1


def test_other_backends_take_no_fused_store():
    mgr = CacheManager(num_pages=8, page_size=4, max_running_req=2, max_seq_len=16, device=DEVICE)
    cache = KVCache(KVCacheShape(1, 2, 16, 4, torch.float32), 8, DEVICE)
    backend = TorchNativeBackend(AttnLayout(4, 2, 16, 0.25), cache, mgr.page_table)
    r = Req(0, [1, 2], SamplingParams())
    mgr.assign_row(r)
    mgr.allocate(r, 3)
    mgr.flush()
    batch = Batch("decode", [r], [1], [2], torch.zeros(1, dtype=torch.int64), torch.tensor([2]),
                  torch.tensor(mgr.slots(r, 2, 3)), torch.zeros(0, dtype=torch.int64), [])
    backend.prepare_metadata(batch)
    assert backend.kv_store_target(0, batch) is None


# ------------------------------------------------------------------------------ Attention.attend


def _attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gated: bool,
               rot_dim: int | None = None, hidden_size: int = 64):
    from freetoken_core.models.blocks import Attention

    cfg = SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                          hidden_size=hidden_size, rms_norm_eps=1e-6)
    rot = rot_dim or head_dim
    params = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": rot / head_dim}
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, 4096, params, dtype)
        attn = Attention(cfg, 0, rope, dtype, qk_norm=True, q_outputs_per_head=2 if gated else 1,
                         norm_cls=ZeroCenteredRMSNorm if gated else RMSNorm)
    g = torch.Generator().manual_seed(3)
    for p in attn.parameters():
        p.data.copy_((torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else p.shape[-1] ** -0.5)).to(dtype))
    attn.o_proj.gemv_min_elements = 0  # as the engine sets it where PDL chains the decode kernels
    return attn


def _attend_both_ways(monkeypatch, attn, rig: Rig, switch: str, steps: int = 2, prompt_lens: tuple = (6, 2),
                      qkv_scale: float = 1.0, tol: float = 0.0) -> None:
    """Prefill, then decode steps through Attention.attend with `switch` off (rig.unfused) and on
    (rig.fused): equal outputs and caches (within `tol`; default bit for bit)."""
    reqs = [rig.req(i, n) for i, n in enumerate(prompt_lens)]
    width = attn.qkv_proj.q_size + 2 * attn.qkv_proj.kv_size
    gen = torch.Generator().manual_seed(11)
    phases = [("prefill", [r.prompt_len for r in reqs])] + [("decode", [1] * len(reqs))] * steps
    try:
        for phase, ext in phases:
            batch = rig.batch(phase, reqs, ext)
            qkv = (torch.randn(sum(ext), width, generator=gen) * qkv_scale).to(DEVICE, rig.dtype)
            outs = []
            for flag, backend in (("0", rig.unfused), ("1", rig.fused)):
                monkeypatch.setenv(switch, flag)
                env.kernel_env.cache_clear()
                backend.prepare_metadata(batch)
                set_context(Context(backend.kv_cache, backend, batch))
                with torch.no_grad():
                    outs.append(attn.attend(batch.positions, qkv))
                set_context(None)
            torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
            for a, b in zip(rig.fused.kv_cache.layer(0), rig.unfused.kv_cache.layer(0)):
                torch.testing.assert_close(a, b, atol=tol, rtol=tol)
            rig.commit(reqs, ext)
    finally:
        set_context(None)
        env.kernel_env.cache_clear()


@pytest.mark.parametrize("gated", [False, True])
def test_attend_stores_through_the_rotary_kernel(monkeypatch, gated):
    """On CPU attend keeps the torch norms; here the fused kernel is forced (interpreter, fp32) so that the
    wiring is what is tested: the target asked of the backend, kv_stored passed, store_kv skipped."""
    from freetoken_core.models.blocks import Attention

    monkeypatch.setattr(Attention, "_fuses_qk_norm_rotary", lambda self, q: True)
    calls = []
    real = triton_backend.store_kv
    monkeypatch.setattr(triton_backend, "store_kv", lambda *a: (calls.append(a[0].shape[0]), real(*a))[1])
    attn = _attention(4, 2, 16, torch.float32, gated, rot_dim=8 if gated else None)
    rig = Rig(4, 2, 16, 4, torch.float32, num_layers=1)
    _attend_both_ways(monkeypatch, attn, rig, "FREETOKEN_ROTARY_STORE_KV")
    assert calls == [8, 8, 2, 2]  # prefill: both backends store; decode: only the unfused one


# ------------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [
    (32, 4, 128, 128),  # Qwen3-30B-A3B
    (16, 2, 256, 64),  # Qwen3.6 gated attention (partial rotary 0.25)
])
def test_gpu_bf16_decode_with_the_fused_store(heads, kv_heads, head_dim, rot_dim, page_size):
    Rig(heads, kv_heads, head_dim, page_size, torch.bfloat16, rot_dim=rot_dim).decode_then_verify([40, 9], verify_rows=4)


@needs_cuda
@pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim,gated", [
    (32, 4, 128, 128, False),  # Qwen3-30B-A3B
    (16, 2, 256, 64, True),  # Qwen3.6
])
def test_gpu_attend_with_the_fused_store(monkeypatch, heads, kv_heads, head_dim, rot_dim, gated):
    attn = _attention(heads, kv_heads, head_dim, torch.bfloat16, gated, rot_dim, hidden_size=2048)
    rig = Rig(heads, kv_heads, head_dim, 16, torch.bfloat16, rot_dim=rot_dim, num_layers=1)
    _attend_both_ways(monkeypatch, attn, rig, "FREETOKEN_ROTARY_STORE_KV")


@needs_cuda
def test_gpu_attend_gated_o_proj_in_the_gemv(monkeypatch):
    """Qwen3.6's gated attention at batch 1 (one row per decode step): o_proj(o * sigmoid(gate)) in the
    GEMV's launch equals torch's sigmoid and multiply before the same GEMV, bit for bit; a two-request
    decode step (two rows) keeps the torch ops."""
    from freetoken_core.kernels import gemv as triton_gemv

    attn = _attention(16, 2, 256, torch.bfloat16, True, 64, hidden_size=2048)  # o_proj 2048 x 4096
    seen = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: (seen.append("gate" in kw), real(*a, **kw))[1])
    rig = Rig(16, 2, 256, 16, torch.bfloat16, rot_dim=64, num_layers=1)
    _attend_both_ways(monkeypatch, attn, rig, "FREETOKEN_ATTN_GATE_GEMV", prompt_lens=(5,), qkv_scale=2.0)
    assert seen == [False, True, False, True]  # decode rows: the plain GEMV with the switch off, gated with it on
