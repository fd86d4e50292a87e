"""Device-resident n-gram speculative steps that chain without waiting for the host.

A synchronous verify step needs the host between steps: the drafts of step N+1 come from the tokens
step N committed. Here everything a step needs lives on the device instead: each request's token
history (`hist`, one row per page-table row), its committed length and its length limit. One step
drafts from the history, builds the k + 1 verify rows (last token and drafts, positions, cache
slots from the page table), runs the target, accepts greedily, appends the committed tokens to the
history and advances the lengths. On CUDA the whole step is one graph replay (drafting and
acceptance are one Triton kernel each, `ngram_triton`; `ngram_device` is their torch reference and
the CPU path), so step N+1 is queued before step N's results reach the host and the host's work
(stop checks, messages) hides behind the device, like overlapped plain decoding.

The host lags one step behind: `SpecDecoder` (scheduler/speculative.py) commits step N's tokens
while step N+1 runs, discards N+1's tokens of a request that finished at N, and gives each request
pages two steps ahead. Used for greedy requests only (sampling, logprobs and min_tokens verify
synchronously).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..core import Batch, Req, get_context, to_device
from ..engine.engine import Engine
from ..engine.graph import GraphRunner, default_bs_list
from ..kvcache.linear_state import LinearStateStep
from .ngram_device import append_committed, greedy_accept_rows, propose_device

if torch.cuda.is_available():
    from . import ngram_triton

log = logging.getLogger(__name__)


@dataclass
class PipelineStep:
    """A launched step: per member, [accepted drafts, drafts proposed, k + 1 target tokens]."""

    members: list[Req]
    out: torch.Tensor  # [n, k + 3] int64, on the host (pinned on CUDA) once `event` has fired
    event: torch.cuda.Event | None

    def rows(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return self.out.tolist()


class DevicePipeline:
    """The device state and the step of pipelined n-gram speculation for up to `max_bs` requests."""

    def __init__(self, engine: Engine, k: int, min_ngram: int, max_ngram: int) -> None:
        self.engine = engine
        self.k, self.rows_per_req = k, k + 1
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.device = engine.device
        cache = engine.cache
        self.max_bs = engine.resolved.max_running_req
        dev = self.device
        self.hist = torch.zeros((cache.page_table.shape[0], engine.max_seq_len), dtype=torch.int32, device=dev)
        # per slot (request of the current member list; padding slots are idle)
        self.table_rows = torch.full((self.max_bs,), cache.dummy_row, dtype=torch.int64, device=dev)
        self.lens = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.limits = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.active = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.out = torch.zeros((self.max_bs, k + 3), dtype=torch.int64, device=dev)
        # one step's scratch: drafts, their counts, the attention metadata, eager-path rows
        self.drafts = torch.zeros((self.max_bs, k), dtype=torch.int64, device=dev)
        self.num_drafts = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.rows_i32 = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.ids, self.pos, self.loc = (
            torch.zeros(self.max_bs * self.rows_per_req, dtype=torch.int64, device=dev) for _ in range(3)
        )
        # two Triton launches per step on the GPU; ~80 small torch ops otherwise (CPU, the reference)
        self.use_triton = dev.type == "cuda"
        # hybrid (GDN) models: each slot's linear-state slot and its kept-row count, on the device
        self.state_slots = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.all_rows = torch.full((self.max_bs,), self.rows_per_req, dtype=torch.int64, device=dev)
        self._linear_steps: dict[int, LinearStateStep] = {}
        self._hist_len: dict[int, tuple[int, int]] = {}  # uid -> (table row, tokens valid in hist)
        self.members: list[Req] = []
        self.runner: GraphRunner | None = None
        if engine.graph_runner is not None:
            self._capture()

    @staticmethod
    def available(engine: Engine) -> bool:
        """On CUDA only as a graph (an eager step syncs for its attention metadata, which is what the
        synchronous path does anyway); on CPU eagerly, which exercises the same logic (tests)."""
        if engine.device.type != "cuda":
            return True
        info = engine.attn_backend.info
        if engine.graph_runner is None:
            return False
        if not (info.uniform_extend_graph and info.lengths_on_device):
            log.warning("backend %s cannot take lengths from the device: speculation verifies synchronously", info.name)
            return False
        return True

    # --- one step's ops (shared by the graph and the eager path) --------------------------------
    def _prepare(self, bs: int, ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor) -> None:
        """Draft and build the verify rows of slots [0, bs) into ids/pos/loc [bs * (k + 1)]; the
        drafts, their counts and the attention lengths go to the pipeline's own buffers."""
        cache = self.engine.cache
        if self.use_triton:
            ngram_triton.prepare(
                self.hist, self.table_rows[:bs], self.lens[:bs], self.limits[:bs], self.active[:bs],
                cache.page_table, cache.page_size, self.k, self.min_ngram, self.max_ngram,
                ids, pos, loc, self.drafts[:bs], self.num_drafts[:bs], self.seq_lens[:bs], self.rows_i32[:bs],
            )
            return
        rows, lens = self.table_rows[:bs], self.lens[:bs]
        hist = self.hist.index_select(0, rows)
        drafts, num_drafts = propose_device(
            hist, lens, self.limits[:bs] - lens - 1, self.k, self.min_ngram, self.max_ngram
        )
        self.drafts[:bs].copy_(drafts)
        self.num_drafts[:bs].copy_(torch.where(self.active[:bs] != 0, num_drafts, torch.zeros_like(num_drafts)))
        last = hist.gather(1, (lens - 1)[:, None]).to(torch.int64)
        ids.copy_(torch.cat([last, drafts], dim=1).view(-1))
        p = (lens - 1)[:, None] + torch.arange(self.rows_per_req, device=self.device)[None, :]
        ps, table = cache.page_size, cache.page_table
        page_idx = (p // ps).clamp(max=table.shape[1] - 1)
        pos.copy_(p.view(-1))
        loc.copy_((table[rows[:, None], page_idx].to(torch.int64) * ps + p % ps).view(-1))
        self.seq_lens[:bs].copy_(lens + self.k)
        self.rows_i32[:bs].copy_(rows)

    def _linear_state(self, bs: int) -> LinearStateStep | None:
        """The verify step's GDN metadata, slots computed on the device from the page-table rows
        (row r -> slot r + 1, the dummy row -> slot 0), into buffers a graph captures once."""
        eng = self.engine
        if eng.linear_pool is None:
            return None
        rows = self.table_rows[:bs]
        self.state_slots[:bs].copy_(torch.where(rows == eng.cache.dummy_row, torch.zeros_like(rows), rows + 1))
        step = self._linear_steps.get(bs)
        if step is None:
            step = LinearStateStep(eng.linear_pool, self.state_slots[:bs], varlen=False, num_rows=self.all_rows[:bs],
                                   rows_per_req=self.rows_per_req, write_state=False)
            self._linear_steps[bs] = step
        return step

    def _replay_linear_state(self, bs: int, step: LinearStateStep | None, out: torch.Tensor) -> None:
        """After acceptance, on the device: advance every GDN state by its accepted rows (the last
        committed token + the accepted drafts), replaying the verify step's saved inputs."""
        if step is None:
            return
        kept = torch.where(self.active[:bs] != 0, out[:bs, 0] + 1, torch.zeros_like(out[:bs, 0]))
        self.engine.replay_linear_state(step, kept)

    def _accept(self, bs: int, logits: torch.Tensor) -> torch.Tensor:
        """Greedy acceptance of slots [0, bs) from the verify rows' logits; appends the committed
        tokens to the history, advances the lengths, returns the packed rows for the host."""
        target = logits.argmax(dim=-1)
        drafts, num_drafts, out = self.drafts[:bs], self.num_drafts[:bs], self.out[:bs]
        rows, lens, active = self.table_rows[:bs], self.lens[:bs], self.active[:bs]
        if self.use_triton:
            ngram_triton.accept(target, drafts, num_drafts, self.hist, rows, lens, active, out)
            return out
        target = target.view(bs, self.rows_per_req)
        accepted = greedy_accept_rows(target, drafts, num_drafts)
        on = active != 0
        count = torch.where(on, accepted + 1, torch.zeros_like(accepted))
        append_committed(self.hist, rows, lens, target, count)
        lens.copy_(torch.where(on, lens + count, torch.ones_like(lens)))
        out.copy_(torch.cat([accepted[:, None], num_drafts[:, None], target], dim=1))
        return out

    # --- CUDA graph ---------------------------------------------------------------------------
    def _graph_forward(self, batch: Batch) -> torch.Tensor:
        bs = batch.padded_size or batch.size
        self._prepare(bs, batch.input_ids, batch.positions, batch.out_loc)
        self.engine.attn_backend.set_lengths_on_device(batch, self.seq_lens[:bs], self.rows_i32[:bs])
        linear = self._linear_state(bs)
        get_context().linear_state = linear
        model = self.engine.model
        out = self._accept(bs, model.lm_head.logits(model.forward(batch.input_ids, batch.positions)))
        self._replay_linear_state(bs, linear, out)
        return out

    def _capture(self) -> None:
        eng = self.engine
        max_bs = eng.resolved.cuda_graph_max_bs
        self.runner = GraphRunner(
            eng.ctx, self._graph_forward, default_bs_list(max_bs), eng.cache.dummy_row, eng.max_seq_len,
            eng.device, rows_per_req=self.rows_per_req, out_dtype=torch.int64, phase="verify",
            pool=eng.graph_runner.pool,
        )
        self.runner.capture()
        self._reset_slots(0)

    # --- host side ----------------------------------------------------------------------------
    def can_run(self, reqs: list[Req]) -> bool:
        """Graph-captured for this many requests (CUDA), or any batch the engine admits (CPU, eager)."""
        if self.runner is not None:
            return len(reqs) <= self.runner.max_bs
        return len(reqs) <= self.max_bs

    def _reset_slots(self, start: int) -> None:
        self.table_rows[start:].fill_(self.engine.cache.dummy_row)
        self.lens[start:].fill_(1)
        self.limits[start:].fill_(1)
        self.active[start:].fill_(0)

    def start(self, members: list[Req]) -> None:
        """Load the members' committed state: lengths, limits, and the history tokens the device lacks."""
        assert members and len(members) <= self.max_bs
        max_req_len = self.engine.max_req_len
        cells_r, cells_c, cells_v = [], [], []
        for r in members:
            row, have = self._hist_len.get(r.uid, (r.table_row, 0))
            have = have if row == r.table_row else 0
            seq = r.seq_len
            if have < seq:
                cells_r.extend([r.table_row] * (seq - have))
                cells_c.extend(range(have, seq))
                cells_v.extend(r.token_slice(have, seq))
            self._hist_len[r.uid] = (r.table_row, seq)
        if cells_r:
            idx = to_device([cells_r, cells_c], torch.int64, self.device)
            self.hist[idx[0], idx[1]] = to_device(cells_v, torch.int32, self.device)
        n = len(members)
        state = to_device(
            [
                [r.table_row for r in members],
                [r.seq_len for r in members],
                [min(r.prompt_len + r.sampling.max_tokens, max_req_len) for r in members],
            ],
            torch.int64, self.device,
        )
        self.table_rows[:n].copy_(state[0])
        self.lens[:n].copy_(state[1])
        self.limits[:n].copy_(state[2])
        self.active[:n].fill_(1)
        self._reset_slots(n)
        self.members = list(members)

    def stop(self) -> None:
        """After the last step was resolved: the device history of every live member holds exactly
        its committed tokens."""
        for r in self.members:
            if not r.finished:  # a finished one was forgotten when it finished
                self._hist_len[r.uid] = (r.table_row, r.seq_len)
        self.members = []

    def forget(self, uid: int) -> None:
        self._hist_len.pop(uid, None)

    def launch(self) -> PipelineStep:
        """Queue one step for the current members; nothing here waits for the device on CUDA graphs."""
        n = len(self.members)
        self.engine.cache.flush()  # page-table entries of this step's pages, before the slots are read
        with torch.inference_mode():
            if self.runner is not None:
                out = self.runner.replay_as_captured(self.runner.padded_size(n))[:n]
            else:
                out = self._eager(n)
        if out.is_cuda:
            host = self.engine.sampler.pinned.get(out.shape, out.dtype)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return PipelineStep(list(self.members), host, event)
        return PipelineStep(list(self.members), out.clone(), None)

    def _eager(self, n: int) -> torch.Tensor:
        """The same step without a graph, on CPU (`available`): the attention metadata is built from
        host lengths, read back from the device."""
        rows = n * self.rows_per_req
        ids, pos, loc = self.ids[:rows], self.pos[:rows], self.loc[:rows]
        self._prepare(n, ids, pos, loc)
        prefix = (self.lens[:n] - 1).tolist()
        batch = Batch(
            phase="verify", reqs=self.members, extend_lens=[self.rows_per_req] * n, prefix_lens=prefix,
            input_ids=ids, positions=pos, out_loc=loc,
            sample_rows=torch.arange(n * self.rows_per_req, device=self.device),
            sample_reqs=[i for i in range(n) for _ in range(self.rows_per_req)],
            rows_per_req=self.rows_per_req,
        )
        eng = self.engine
        linear = self._linear_state(n)
        override = {"linear_state": linear} if linear is not None else {}
        out = self._accept(n, eng.forward_logits(batch, eng.forward_batch(batch, **override)))
        self._replay_linear_state(n, linear, out)
        return out
