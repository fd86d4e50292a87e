"""Speculative decoding in the scheduler: draft, verify k + 1 rows per request, commit, roll back.

A verify step gives every request `rows = k + 1` query rows: its last committed token and k draft
tokens (a request with fewer proposals pads with copies of its last token, which are never
accepted). Row j's logits are the target's prediction for the token after row j. Acceptance
(greedy: drafts equal to the argmax; sampling: rejection sampling, distribution-preserving) yields
the accepted drafts plus one target token. The scheduler's `_commit_tokens` takes them in order and stops
at the first that finishes the request; `Req.commit_pending` and `CacheManager.rollback_tail` keep
exactly the K/V of the committed positions and the pages of the committed tokens.

With overlap scheduling (CUDA), greedy requests run pipelined instead (`spec/pipeline.py`): drafting,
acceptance and the next step's inputs stay on the device, step N+1 is launched before step N's
tokens are read, and the host commits them one step behind. Each request then holds pages for two
steps ahead; they are rolled back to its committed tokens when the pipeline stops (a request joins
or leaves, a prefill runs, or a request needs the synchronous path).
"""

from __future__ import annotations

import time

import torch

from ..config import EngineConfig
from ..core import Req, to_device
from ..engine.engine import Engine
from ..engine.sampler import greedy_in_place_of, unsampleable_rows
from ..messages import DetokenizeMsg
from ..spec.ngram import NgramProposer
from ..spec.pipeline import DevicePipeline, PipelineStep
from ..spec.verify import verify
from .decode import plan_decode
from .spec_host import SpecHost


class SpecDecoder:
    def __init__(self, host: SpecHost, cfg: EngineConfig, engine: Engine, overlap: bool) -> None:
        self.sched = host
        self.engine, self.cache = engine, engine.cache
        self.k = cfg.num_speculative_tokens
        self.rows = self.k + 1
        self.max_ngram, self.min_ngram = cfg.ngram_max, cfg.ngram_min
        self._proposers: dict[int, NgramProposer] = {}
        self.pipeline: DevicePipeline | None = None
        self._inflight: PipelineStep | None = None
        if overlap and DevicePipeline.available(engine):
            self.pipeline = DevicePipeline(engine, self.k, self.min_ngram, self.max_ngram)

    # --- per-request drafter state ------------------------------------------------------------
    def add(self, req: Req) -> None:
        self._proposers[req.uid] = NgramProposer(req.input_ids, self.k, self.max_ngram, self.min_ngram)

    def remove(self, uid: int) -> None:
        self._proposers.pop(uid, None)
        if self.pipeline is not None:
            self.pipeline.forget(uid)

    def on_commit(self, req: Req, tokens: list[int]) -> None:
        prop = self._proposers.get(req.uid)
        if prop is not None and tokens:
            prop.extend(tokens)

    def propose(self, decoders: list[Req]) -> dict[int, list[int]]:
        """Drafts per request uid (empty when the n-gram lookup finds nothing)."""
        out = {}
        for r in decoders:
            left = min(r.sampling.max_tokens - r.num_output, self.engine.max_req_len - r.seq_len) - 1
            prop = self._proposers.get(r.uid)
            out[r.uid] = prop.propose(max(0, min(left, self.k))) if prop is not None else []
        return out

    # --- pipelined steps (greedy, device-resident) ---------------------------------------------
    @property
    def busy(self) -> bool:
        return self._inflight is not None

    @staticmethod
    def pipelinable(req: Req) -> bool:
        p = req.sampling
        return p.greedy and p.logprobs is None and req.num_output >= p.min_tokens

    def run_pipelined(self, decoders: list[Req], msgs: list[DetokenizeMsg]) -> bool:
        """Launch the next pipelined step for these decoders and commit the previous one. False
        (with the pipeline drained) when they must verify synchronously."""
        pl, sched = self.pipeline, self.sched
        if pl is None or not decoders:
            return False
        if pl.members and pl.members != decoders:
            self.drain(msgs)  # a request joined or left: settle every length, then start over
            decoders = sched.decoders()
        if sched.plain_step_in_flight:
            sched.drain(msgs)  # a plain step is in flight: its token is an input of ours
            decoders = sched.decoders()
        if not decoders or not pl.can_run(decoders) or not all(self.pipelinable(r) for r in decoders):
            self.drain(msgs)
            return False
        if not self._allocate(decoders):
            self.drain(msgs)
            return False
        if not pl.members:
            pl.start(decoders)
        sched.mark_in_flight(pl.members)  # fault isolation: these are in flight now
        step = pl.launch()
        prev, self._inflight = self._inflight, step
        if prev is not None:
            self._commit_step(prev, msgs)
        return True

    def _allocate(self, decoders: list[Req]) -> bool:
        """Pages for what the next step may write: the step in flight commits up to k + 1 tokens
        the host has not seen, and the new step writes k + 1 rows after them."""
        cache = self.cache
        ahead = 2 * self.k + 1 if self._inflight is not None else self.k
        need = {r.uid: min(r.seq_len + ahead, cache.max_seq_len) for r in decoders}
        if sum(cache.pages_needed(r, need[r.uid]) for r in decoders) > cache.num_free_pages:
            return False  # the synchronous path retracts requests when the pool runs dry
        for r in decoders:
            cache.allocate(r, need[r.uid])
        return True

    def _commit_step(self, step: PipelineStep, msgs: list[DetokenizeMsg]) -> None:
        sched = self.sched
        now = None
        for req, row in zip(step.members, step.rows()):
            if req.finished:  # finished or aborted while the step ran: its tokens are discarded
                continue
            accepted, proposed = row[0], row[1]
            tokens = row[2 : 3 + accepted]
            req.spec_proposed += proposed
            req.spec_accepted += accepted
            if req.first_token_time is None:
                req.first_token_time = now = now or time.perf_counter()
            taken = sched._commit_tokens(req, tokens)
            if not req.finished:
                req.cached_len = req.seq_len - 1
                self.on_commit(req, tokens[:taken])
            msgs.append(sched.message(req, tokens[:taken], None))

    def drain(self, msgs: list[DetokenizeMsg]) -> None:
        """Commit the step in flight and stop the pipeline: every member's pages go back to its
        committed tokens, so the synchronous path and the prefill planner see settled state."""
        pl = self.pipeline
        if pl is None:
            return
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._commit_step(step, msgs)
        for req in pl.members:
            if not req.finished:
                self.cache.rollback_tail(req, req.seq_len)
        pl.stop()

    def abandon(self) -> list[Req]:
        """After a failed step (Scheduler.fail_step): drop the pipelined step in flight, whose tokens
        are lost, and stop the pipeline. Returns the requests it held; the caller fails them."""
        members = list(self._inflight.members) if self._inflight is not None else []
        self._inflight = None
        if self.pipeline is not None:
            members += self.pipeline.members
            self.pipeline.members = []
        return members

    # --- the verify step ----------------------------------------------------------------------
    def run_verify(self, decoders: list[Req], drafts: dict[int, list[int]], msgs: list[DetokenizeMsg]) -> None:
        sched, cache, engine = self.sched, self.cache, self.engine
        k, rows = self.k, self.rows
        widened = lambda r: r.seq_len + k  # noqa: E731  positions L-1 .. L+k-1 are written
        batch_reqs, retracted = plan_decode(decoders, sched.running, cache, widened)
        for req in retracted:
            sched.retract(req)
        if not batch_reqs:
            return
        for r in batch_reqs:
            cache.allocate(r, widened(r))
            d = drafts.get(r.uid, [])
            r.widen_pending(k, d + [r.output_ids[-1] if r.output_ids else r.input_ids[-1]] * (k - len(d)))
        num_drafts = [len(drafts.get(r.uid, [])) for r in batch_reqs]
        batch = engine.prepare_batch("verify", batch_reqs, [rows] * len(batch_reqs), rows_per_req=rows)
        sched.mark_in_flight(batch_reqs)  # fault isolation: these are in flight now
        logits = engine.forward_verify(batch).view(len(batch_reqs), rows, -1)
        self._ban_early_stops(logits, batch_reqs)
        committed = self._accept(logits, batch_reqs, num_drafts, msgs)
        lp = self._logprobs(logits, batch_reqs, committed)
        kept: list[int] = []  # rows whose tokens stay cached: linear (GDN) states advance by as many
        for i, (req, tokens) in enumerate(zip(batch_reqs, committed)):
            if req.finished:  # failed in _accept: its sampling settings could not run
                kept.append(0)
                continue
            req.spec_proposed += num_drafts[i]
            req.spec_accepted += len(tokens) - 1
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            taken = sched._commit_tokens(req, tokens)
            if req.finished:
                kept.append(0)
                msgs.append(sched.message(req, tokens[:taken], self._extend_lp(req, lp[i], taken)))
                continue
            req.commit_pending(taken)
            kept.append(taken)
            cache.rollback_tail(req, req.seq_len)
            self.on_commit(req, tokens[:taken])
            msgs.append(sched.message(req, tokens[:taken], self._extend_lp(req, lp[i], taken)))
        engine.commit_verify(kept)

    def _ban_early_stops(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """min_tokens: row j of a request produces its output token number num_output + j."""
        rows, cols = [], []
        ban = sorted(self.sched.eos_token_ids)
        for i, r in enumerate(reqs):
            for j in range(self.rows):
                if r.num_output + j < r.sampling.min_tokens:
                    ids = [t for t in ban + r.sampling.stop_token_ids if t < logits.shape[-1]]
                    rows += [i * self.rows + j] * len(ids)
                    cols += ids
        if rows:
            idx = to_device([rows, cols], torch.int64, logits.device)
            logits.view(-1, logits.shape[-1])[idx[0], idx[1]] = float("-inf")

    def _accept(self, logits: torch.Tensor, reqs: list[Req], num_drafts: list[int],
                msgs: list[DetokenizeMsg]) -> list[list[int]]:
        """The tokens each request commits. A request whose sampling settings cannot run (it bypassed
        SamplingParams.validate) is failed alone, its row verified greedily and discarded (as Sampler does)."""
        draft_ids = to_device([r.pending_ids for r in reqs], torch.int64, logits.device)
        params = [r.sampling for r in reqs]
        generators = [r.generator for r in reqs]
        try:
            return verify(logits, draft_ids, num_drafts, params, generators, self.engine.sampler.generator)
        except Exception:  # noqa: BLE001  find the requests at fault
            failed = unsampleable_rows(params, logits.shape[-1], logits.device)
            if not failed:
                raise
        for i, error in failed.items():
            msgs.append(self.sched.fail(reqs[i], f"this request's sampling settings cannot run: {error}"))
        return verify(logits, draft_ids, num_drafts, greedy_in_place_of(params, failed), generators,
                      self.engine.sampler.generator)

    def _logprobs(self, logits: torch.Tensor, reqs: list[Req], committed: list[list[int]]) -> list[list[tuple]]:
        """Per request: (logprob, top dict) of each committed token, from its verify row."""
        out: list[list[tuple]] = [[] for _ in reqs]
        for i, r in enumerate(reqs):
            if r.finished or r.sampling.logprobs is None:  # (finished: failed in _accept)
                continue
            n = len(committed[i])
            lp = logits[i, :n].log_softmax(dim=-1)
            chosen = lp.gather(1, torch.tensor(committed[i], device=lp.device)[:, None]).squeeze(1).tolist()
            tops: list[dict[int, float]] = [{} for _ in range(n)]
            if r.sampling.logprobs:
                v, ids = lp.topk(r.sampling.logprobs, dim=-1)
                tops = [dict(zip(a, b)) for a, b in zip(ids.tolist(), v.tolist())]
            out[i] = list(zip(chosen, tops))
        return out

    @staticmethod
    def _extend_lp(req: Req, lp: list[tuple], taken: int) -> int | None:
        """Record the committed tokens' logprobs; returns where this step's entries start."""
        if req.sampling.logprobs is None:
            return None
        start = len(req.output_logprobs)
        for value, top in lp[:taken]:
            req.output_logprobs.append(value)
            req.output_top_logprobs.append(top)
        return start
