"""Run a model the way the engine does, without the engine: a real KVCache, CacheManager and
TorchNativeBackend, a Batch built by hand, and the step Context set around model.forward."""

from __future__ import annotations

import torch

from freetoken_core.attention.torch_native import TorchNativeBackend
from freetoken_core.config import SamplingParams
from freetoken_core.core import Batch, Context, Req, set_context
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import KVCache, KVCacheShape


class ModelHarness:
    def __init__(self, model: torch.nn.Module, num_pages: int = 64, page_size: int = 4,
                 max_running_req: int = 4, max_seq_len: int = 128) -> None:
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        layout = model.attn_layout()
        shape = KVCacheShape(model.num_kv_layers, layout.num_kv_heads, layout.head_dim, page_size, self.dtype)
        self.kv_cache = KVCache(shape, num_pages, self.device)
        self.cache = CacheManager(num_pages, page_size, max_running_req, max_seq_len, self.device)
        self.backend = TorchNativeBackend(layout, self.kv_cache, self.cache.page_table)
        self._next_uid = 0

    def add_request(self, prompt: list[int]) -> Req:
        req = Req(uid=self._next_uid, input_ids=list(prompt), sampling=SamplingParams())
        self._next_uid += 1
        self.cache.assign_row(req)
        return req

    @torch.inference_mode()
    def step(self, reqs: list[Req], new_tokens: list[list[int]]) -> torch.Tensor:
        """Feed `new_tokens[i]` after each request's cached tokens (prefill chunks or decode rows),
        all requests in one batch. Returns the final hidden rows [T, hidden] in batch order."""
        prefix = [r.cached_len for r in reqs]
        extend = [len(t) for t in new_tokens]
        ids, pos, loc, last = [], [], [], []
        for r, toks, p0 in zip(reqs, new_tokens, prefix):
            self.cache.allocate(r, p0 + len(toks))
            ids += toks
            pos += range(p0, p0 + len(toks))
            loc += self.cache.slots(r, p0, p0 + len(toks))
            last.append(len(ids) - 1)
        self.cache.flush()
        i64 = dict(dtype=torch.int64, device=self.device)
        phase = "prefill" if any(n > 1 for n in extend) or any(p == 0 for p in prefix) else "decode"
        batch = Batch(
            phase=phase, reqs=reqs, extend_lens=extend, prefix_lens=prefix,
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(pos, **i64),
            out_loc=torch.tensor(loc, **i64), sample_rows=torch.tensor(last, **i64),
            sample_reqs=list(range(len(reqs))),
        )
        set_context(Context(self.kv_cache, self.backend, batch))
        try:
            self.backend.prepare_metadata(batch)
            hidden = self.model.forward(batch.input_ids, batch.positions)
        finally:
            set_context(None)
        for r, n in zip(reqs, extend):
            r.cached_len += n
        return hidden

    def logits(self, reqs: list[Req], new_tokens: list[list[int]]) -> torch.Tensor:
        """step() then the LM head on every row: fp32 [T, vocab]."""
        hidden = self.step(reqs, new_tokens)
        with torch.inference_mode():
            return self.model.lm_head.logits(hidden)
