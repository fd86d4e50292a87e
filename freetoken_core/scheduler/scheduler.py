"""The continuous-batching scheduler: admission, prefill/decode steps, committing tokens, aborts.

Step policy: prefill work (new prompts, unfinished chunks) runs under the `max_extend_tokens`
budget, but never twice in a row while requests wait to decode, so a stream of new prompts
cannot starve running decodes (they get at least every other step). With `mixed_prefill` the
decoders run their next row inside the prefill step instead (one row each, out of the budget).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..config import EngineConfig, SamplingParams
from ..core import Batch, Req
from ..engine.engine import Engine, InflightStep
from ..messages import DetokenizeMsg, EngineStats
from .decode import allocate_decode, plan_decode
from .prefill import plan_prefill
from .speculative import SpecDecoder
from .stops import StopChecker

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    batch: Batch
    step: InflightStep
    rows_by_uid: dict[int, int]  # sampled row of each request in this step


class Scheduler:
    def __init__(self, config: EngineConfig, engine: Engine | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self.engine = engine or Engine(config)
        from ..tokenizer.tokenize import config_eos_ids, has_tokenizer_files, load_tokenizer

        if tokenizer is None and has_tokenizer_files(config.model_path):
            tokenizer = load_tokenizer(config.model_path)
        self.tokenizer = tokenizer  # None for token-in/token-out models without tokenizer files
        self.eos_token_ids: set[int] = (
            set(tokenizer.eos_token_ids()) if tokenizer is not None else config_eos_ids(self.engine.model.config)
        )
        self.cache = self.engine.cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted, in admission order (prefilling or decoding)
        self._by_uid: dict[int, Req] = {}
        self._stop_checkers: dict[int, StopChecker] = {}
        self._outbox: list[DetokenizeMsg] = []
        self._uids = itertools.count()
        self._last_was_prefill = False
        self._pending: _Pending | None = None  # the launched step whose tokens are not yet committed
        # fault isolation (fail_step): the requests of the batches this step() launched, and the
        # messages it produced so far (a step that raises must not lose them)
        self._step_reqs: list[Req] = []
        self._step_msgs: list[DetokenizeMsg] = []
        # overlap pays off on an asynchronous device; on CPU it only exercises the logic (tests)
        self.overlap = (
            self.engine.device.type == "cuda" if config.overlap_schedule is None else config.overlap_schedule
        )
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            self.spec = SpecDecoder(self, config, self.engine, self.overlap)

    # --- requests in and out ----------------------------------------------------------------
    @property
    def max_req_len(self) -> int:
        return self.engine.max_req_len

    def add_request(self, input_ids: list[int], params: SamplingParams | None = None, uid: int | None = None) -> int:
        """Validate and queue a request; raises ValueError naming the limit it breaks."""
        params = params or SamplingParams()
        input_ids = [int(t) for t in input_ids]
        if not input_ids:
            raise ValueError("the prompt is empty: at least one token is required")
        vocab = self.engine.vocab_size
        bad = [t for t in input_ids if t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        # a request can never outgrow the whole pool, so it cannot wait forever for pages
        limit = min(self.max_req_len, self.cache.num_total_pages * self.cache.page_size)
        if len(input_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the limit is {limit - 1} "
                f"(max_seq_len {limit} including at least one generated token)"
            )
        params.validate(max_new_tokens_limit=limit - len(input_ids), vocab_size=vocab)
        if uid is None:
            uid = next(self._uids)
        if uid in self._by_uid:
            raise ValueError(f"request id {uid} is already in use")
        req = Req(uid=uid, input_ids=input_ids, sampling=params)
        if params.seed is not None:
            req.generator = self.engine.sampler.make_generator(params.seed)
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)")
            self._stop_checkers[uid] = StopChecker(self.tokenizer, input_ids, params)
        self._by_uid[uid] = req
        if self.spec is not None:
            self.spec.add(req)
        self.waiting.append(req)
        self.prompt_tokens_total += len(input_ids)
        return uid

    def abort(self, uid: int) -> bool:
        """Stop a waiting or running request now; its final message comes out of the next step()."""
        req = self._by_uid.get(uid)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self._outbox.append(self.message(req, [], None))
        return True

    def close(self) -> None:
        """Release the engine (its tensor-parallel workers, graphs and pools) and the drafter's graphs;
        no step runs after it."""
        self._pending = None
        self.spec = None
        self.engine.close()

    def has_request(self, uid: int) -> bool:
        """Whether `uid` is waiting or running (not finished, not aborted)."""
        return uid in self._by_uid

    @property
    def has_queued_messages(self) -> bool:
        """Messages (aborts) queued for the next step() to return."""
        return bool(self._outbox)

    @property
    def in_flight(self) -> bool:
        """A launched step (plain or pipelined speculative) whose tokens are not committed yet."""
        return self._pending is not None or (self.spec is not None and self.spec.busy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._outbox or self.in_flight)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_pages=self.cache.num_free_pages,
            num_total_pages=self.cache.num_total_pages,
            page_size=self.cache.page_size,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            # offloaded MoE experts: slot hit rate, bytes copied per token, misses per layer
            extra={"moe": self.engine.moe_stats()} if getattr(self.engine, "moe_executors", None) else {},
            **self.cache.prefix_stats(),
        )

    def fail_step(self, error: str) -> list[DetokenizeMsg]:
        """After step() raised: finish the requests of the step(s) in flight with `error` (their pages
        and slots freed) and drop the in-flight state; everyone else keeps its state and runs on.

        In flight: the batches this step() launched, the launched step whose tokens were not yet
        committed (overlap scheduling) and a pipelined speculative step: up to two steps. Returns
        the messages the failed step had already produced, then one error message per failed request."""
        hit = list(self._step_reqs)
        if self._pending is not None:
            hit += self._pending.batch.reqs
        self._pending = None
        if self.spec is not None:
            hit += self.spec.abandon()
        msgs, self._step_msgs, self._step_reqs = self._step_msgs, [], []
        msgs += self._outbox  # aborts queued meanwhile
        self._outbox = []
        seen: set[int] = set()
        for req in hit:
            if req.finished or req.uid in seen:
                continue
            seen.add(req.uid)
            if req in self.waiting:  # retracted inside the failed step
                self.waiting.remove(req)
            req.inflight = 0
            msgs.append(self.fail(req, error))
        self.cache.drop_unreferenced()  # an abort during the failed step may have cached pages it wrote
        return msgs

    def fail(self, req: Req, error: str) -> DetokenizeMsg:
        """Finish one request with an error (its pages and slots freed); its final message."""
        self._finish(req, "error")
        msg = self.message(req, [], None)
        msg.error = error
        return msg

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[DetokenizeMsg]:
        """Run one engine step. With overlap scheduling (CUDA), step N+1 is launched before step N's
        tokens are read back, so host work hides behind the device. That holds for prefill and mixed
        steps too: planning counts a request's token in flight as part of its length (`_virtual_len`)
        and a rider's input is gathered on the device like a decode row's. Retraction and speculation
        wait for the previous step (they need the committed tokens).

        Prefill steps do not wait either: served prompts arrive one at a time, and a waiting step left the
        device idle while the host planned it (the served 64-stream row of benchmarks/RESULTS.md)."""
        msgs, self._outbox = self._outbox, []
        self._step_reqs, self._step_msgs = [], msgs
        decoders = self.decoders()
        prefill_pending = (bool(self.waiting) and self._row_free()) or self._prefilling(decoders)
        if prefill_pending and not (decoders and self._last_was_prefill):
            if self.spec is not None:
                self.drain(msgs)  # drafts and verify rows need the committed tokens
            ran, mixed = self._run_prefill(msgs)
            # a mixed step decoded too: the next may prefill again (decoders are not starved)
            self._last_was_prefill = ran and not mixed
            if ran:
                return msgs
            decoders = self.decoders()
        self._last_was_prefill = False
        if decoders:
            self._run_decode(decoders, msgs)
        else:
            self.drain(msgs)
        return msgs

    def _prefilling(self, decoders: list[Req]) -> bool:
        """Whether a running request still has prompt rows to prefill (a chunked prompt). The others that
        are not decoders have their last token in flight: they need no step, only their token committed."""
        if len(decoders) == len(self.running):
            return False
        return any(len(r.input_ids) + len(r.output_ids) - r.cached_len > 1 for r in self.running)

    def _row_free(self) -> bool:
        """Whether a waiting request could be admitted at all. When every row is taken, planning a
        prefill is pointless (a row frees when the step in flight commits a request's last token)."""
        return self.cache.num_free_rows > 0  # one row per admitted request, max_running_req rows

    # --- what a drafter uses (scheduler/spec_host.py) -------------------------------------------
    @property
    def plain_step_in_flight(self) -> bool:
        """A launched plain (non-speculative) step whose tokens are not committed yet."""
        return self._pending is not None

    def mark_in_flight(self, reqs: list[Req]) -> None:
        """Fault isolation: these requests are in a step this step() launched (fail_step fails them)."""
        self._step_reqs.extend(reqs)

    def decoders(self) -> list[Req]:
        """The running requests whose next row is a decode row: the requests of a decode step."""
        # seq_len + inflight - cached_len == 1 (its next row is a decode row) and it wants more (a request
        # whose in-flight token is its last by length needs no further step); spelled out without Req's
        # properties: this runs every step over every request
        return [r for r in self.running
                if len(r.input_ids) + len(r.output_ids) + r.inflight - r.cached_len == 1
                and len(r.output_ids) + r.inflight < r.sampling.max_tokens]

    def _run_prefill(self, msgs: list[DetokenizeMsg]) -> tuple[bool, bool]:
        """A prefill step; with `mixed_prefill` the decoders ride along (one row each, in front).
        Returns (whether a step ran, whether it decoded too)."""
        riders = self._riders()
        prefilling = [r for r in self.running if r.seq_len - r.cached_len > 1]
        plan, admitted = plan_prefill(
            prefilling, self.waiting, self.running, self.cache, self.config.max_extend_tokens - len(riders),
            self.engine.resolved.max_running_req, self.engine.resolved.decode_rows_per_req,
        )
        self.running.extend(admitted)
        if not plan.reqs:
            return False, False  # the riders decode in the usual step (their pages are allocated)
        reqs, lens = riders + plan.reqs, [1] * len(riders) + plan.extend_lens
        self._launch(self.engine.prepare_batch("prefill", reqs, lens), msgs)
        return True, bool(riders)

    def _riders(self) -> list[Req]:
        """`mixed_prefill`: the decoders that run their next row inside this prefill step (SGLang's mixed
        chunk; every vLLM V1 step is one): a prompt's arrival then costs the running requests no step of
        their own. None when a decoder would need retraction (the decode step does that), with
        speculation (its verify steps), or when their rows would take the whole prefill budget."""
        if not self.config.mixed_prefill or self.spec is not None:
            return []
        decoders = self.decoders()
        if not decoders or len(decoders) >= self.config.max_extend_tokens:
            return []
        batch_reqs, retracted = plan_decode(decoders, self.running, self.cache, self._virtual_len)
        if retracted:
            return []
        allocate_decode(batch_reqs, self.cache, self._virtual_len)
        return batch_reqs

    def _run_decode(self, decoders: list[Req], msgs: list[DetokenizeMsg]) -> None:
        if self.spec is not None:
            if self.spec.run_pipelined(decoders, msgs):
                return
            self.drain(msgs)  # drafts need the committed tokens; verify steps run synchronously
            decoders = self.decoders()
            drafts = self.spec.propose(decoders)
            if any(drafts.values()):
                self.spec.run_verify(decoders, drafts, msgs)
                return
        batch_reqs, retracted = plan_decode(decoders, self.running, self.cache, self._virtual_len)
        if retracted and self._pending is not None:
            self.drain(msgs)  # retraction needs settled lengths: plan again
            decoders = self.decoders()
            batch_reqs, retracted = plan_decode(decoders, self.running, self.cache, self._virtual_len)
        for req in retracted:
            self.retract(req)
        allocate_decode(batch_reqs, self.cache, self._virtual_len)
        if batch_reqs:
            self._launch(self.engine.prepare_batch("decode", batch_reqs, [1] * len(batch_reqs)), msgs)
        else:
            self.drain(msgs)

    @staticmethod
    def _virtual_len(req: Req) -> int:
        return req.seq_len + req.inflight

    def _launch(self, batch: Batch, msgs: list[DetokenizeMsg]) -> None:
        banned = {}
        for row, i in enumerate(batch.sample_reqs):
            req = batch.reqs[i]
            if req.num_output + req.inflight < req.sampling.min_tokens:
                banned[row] = sorted(self.eos_token_ids | set(req.sampling.stop_token_ids))
        gather = None
        prev = self._pending
        if prev is not None:
            prev_rows = prev.rows_by_uid
            src, dst = [], []
            row = 0
            for req, n in zip(batch.reqs, batch.extend_lens):
                if req.inflight and req.uid in prev_rows:
                    src.append(prev_rows[req.uid])
                    dst.append(row + n - 1)  # a decode row's input is the token still in flight
                row += n
            if src:
                gather = (prev.step.tokens, src, dst)
        self.mark_in_flight(batch.reqs)
        step = self.engine.launch(batch, banned, gather)
        for req, n in zip(batch.reqs, batch.extend_lens):
            req.cached_len += n
            if batch.phase == "prefill":
                self.cache.after_chunk(req)
        for i in batch.sample_reqs:
            batch.reqs[i].inflight += 1
        self._pending = _Pending(batch, step, {batch.reqs[i].uid: row for row, i in enumerate(batch.sample_reqs)})
        for row, error in step.failed.items():  # its token is discarded when the step resolves
            msgs.append(self.fail(batch.reqs[batch.sample_reqs[row]],
                                   f"this request's sampling settings cannot run: {error}"))
        if prev is not None:
            self._resolve(prev, msgs)
        if not self.overlap:
            self.drain(msgs)

    def drain(self, msgs: list[DetokenizeMsg]) -> None:
        """Commit every step in flight (plain and pipelined speculative) into `msgs`: lengths settle."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._resolve(pending, msgs)
        if self.spec is not None:
            self.spec.drain(msgs)

    def _resolve(self, pending: "_Pending", msgs: list[DetokenizeMsg]) -> None:
        out = pending.step.result()
        batch = pending.batch
        now = time.perf_counter()
        for row, i in enumerate(batch.sample_reqs):
            req = batch.reqs[i]
            req.inflight -= 1
            if req.finished:  # finished or aborted while the step ran: its token is discarded
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            token = out.tokens[row]
            taken = self._commit_tokens(req, [token])
            if self.spec is not None and not req.finished:
                self.spec.on_commit(req, [token])
            if out.logprobs is not None and req.sampling.logprobs is not None:
                req.output_logprobs.extend([out.logprobs[row]][:taken])
                if out.top_logprobs is not None:
                    req.output_top_logprobs.extend([out.top_logprobs[row]][:taken])
            msgs.append(self.message(req, [token][:taken], len(req.output_logprobs) - taken))

    # --- committing -------------------------------------------------------------------------
    def _commit_tokens(self, req: Req, tokens: list[int]) -> int:
        """Append tokens in order; stop at the first that finishes the request. Returns the count taken."""
        p = req.sampling
        checker = self._stop_checkers.get(req.uid)
        out = req.output_ids
        n_prompt = len(req.input_ids)
        max_req_len = self.max_req_len
        for i, tok in enumerate(tokens):  # locals, not Req's properties: this runs for every token of every step
            out.append(tok)
            self.generated_tokens_total += 1
            n_out = len(out)
            reason: str | None = None
            stop_reason: int | str | None = None
            if n_out >= p.min_tokens:
                if tok in p.stop_token_ids:
                    reason, stop_reason = "stop", tok
                elif not p.ignore_eos and tok in self.eos_token_ids:
                    reason, stop_reason = "stop", tok
            if reason is None and checker is not None:
                matched = checker.add(tok)
                if matched is not None and n_out >= p.min_tokens:
                    reason, stop_reason = "stop", matched
            if reason is None and (n_out >= p.max_tokens or n_prompt + n_out >= max_req_len):
                reason = "length"
            if reason is not None:
                req.stop_reason = stop_reason
                self._finish(req, reason)
                return i + 1
        return len(tokens)

    def _finish(self, req: Req, reason: str) -> None:
        req.finished = True
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if reason == "error":  # its K/V is suspect: not cached
            self.cache.free(req)
        else:
            self._release(req)
        self.engine.penalties.release(req.uid)
        self._by_uid.pop(req.uid, None)
        self._stop_checkers.pop(req.uid, None)
        if self.spec is not None:
            self.spec.remove(req.uid)

    def retract(self, req: Req) -> None:
        """Out of pages: give a running request's cache back and queue it first for recompute."""
        log.info("retracting request %d (%d tokens) to free KV pages", req.uid, req.seq_len)
        self.running.remove(req)
        self._release(req)  # cached: its re-admission takes it back
        self.engine.penalties.release(req.uid)  # refilled from the committed tokens when it samples again
        req.cached_len = 0
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        """Pages and row back, what it wrote cached; its linear states (hybrids) are at cached_len unless a
        pipelined speculative step may hold accepted rows not seen yet."""
        unknown = req.cached_len > req.seq_len or (self.spec is not None and self.spec.busy)
        self.cache.free(req, req.written_len, -1 if unknown else req.cached_len)

    def message(self, req: Req, tokens: list[int], lp_start: int | None) -> DetokenizeMsg:
        """The message out for `req` after a commit of `tokens`; its logprobs from entry `lp_start` on."""
        want_lp = req.sampling.logprobs is not None and lp_start is not None
        # positional, in DetokenizeMsg's field order (a message per request per step)
        return DetokenizeMsg(
            req.uid, tokens, req.finished, req.finish_reason, req.stop_reason,
            req.output_logprobs[lp_start:] if want_lp else None,
            req.output_top_logprobs[lp_start:] if want_lp and req.sampling.logprobs else None,
            len(req.input_ids), len(req.output_ids), None, req.spec_accepted, req.spec_proposed,
            req.num_cached_tokens or 0,
        )
