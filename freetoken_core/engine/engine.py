"""Engine: owns the model, the paged KV cache, the attention backend and the sampler; runs one Batch."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from ..attention import AttnBackend, create_backend
from ..config import PREFILL_GRAPH_MAX_TOKENS_DEFAULT, EngineConfig
from ..env import kernel_env
from ..core import Batch, Context, Phase, Req, set_context, to_device
from ..kvcache.linear_state import STATE_DTYPES, LinearStatePool, LinearStateStep
from ..kvcache.factory import cache_kind, make_cache_manager, plan_snapshots
from ..kvcache.manager import pages_for
from ..kvcache.pool import KVCache, KVCacheShape
from ..layers.gemv_policy import use_gemv_for_all_sizes
from ..kernels.pdl import device_uses_pdl
from .batch_builder import build_batch
from .graph import GraphRunner, default_bs_list
from .linear_steps import LinearStateSteps
from .prefill_graph import PrefillGraphRunner, prefill_graph_buckets
from .penalties import PenaltyState
from .resolved import ResolvedEngineConfig, resolve_device, resolve_dtype
from .sampler import DeviceSample, PinnedPool, SampleOutput, Sampler

log = logging.getLogger(__name__)

MAX_DEFAULT_SEQ_LEN = 32768


class Engine:
    """`config` is the caller's and stays as given; what the engine decided is `self.resolved`."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tp = None
        cuda_graph = config.cuda_graph and self.device.type == "cuda"
        if config.tensor_parallel_size > 1:  # before the model: its layers are built as this rank's shard
            from ..distributed.group import TensorParallelGroup

            if cuda_graph:
                log.warning("tensor_parallel_size %d: CUDA graphs with the collectives inside are not built yet; "
                            "decoding eagerly", config.tensor_parallel_size)
                cuda_graph = False
            self.tp = TensorParallelGroup(config, self.device)
        try:
            self._build(config, cuda_graph)
        except BaseException:
            if self.tp is not None:  # the workers wait for this rank's sizes: stop them, do not leave them hanging
                self.tp.close()
            raise

    def _build(self, config: EngineConfig, cuda_graph: bool) -> None:
        from ..models.loader import load_model

        rows = config.decode_rows()
        self.moe_strategy, self.config = self._moe_strategy(cuda_graph)
        self.model = load_model(config.model_path, self.dtype, self.device, load_format=config.load_format,
                                expert_device="cpu" if self.moe_strategy not in ("resident", "none") else None,
                                quantization=config.quantization, fp8_host_experts=self.moe_strategy == "offload")
        self.moe_executors, max_running_req, cuda_graph = self._place_experts(cuda_graph)
        self._fuse_shared_experts()
        if device_uses_pdl(self.device):  # see its docstring: why only in the PDL chain
            use_gemv_for_all_sizes(self.model, rows=config.speculative is not None)
        model_max = int(getattr(self.model.config, "max_position_embeddings", MAX_DEFAULT_SEQ_LEN) or MAX_DEFAULT_SEQ_LEN)
        self.max_seq_len = config.max_seq_len or min(model_max, MAX_DEFAULT_SEQ_LEN)
        if hasattr(self.model, "ensure_positions"):  # a max_seq_len past the model's own limit
            self.model.ensure_positions(self.max_seq_len)
        # the longest request leaves room for a widened (speculative) step inside its page-table row
        self.max_req_len = self.max_seq_len - (rows - 1)
        layout = self.model.attn_layout()  # from the model's per-layer cache specs
        shape = KVCacheShape(self.model.num_kv_layers, layout.num_kv_heads, layout.head_dim, config.page_size, self.dtype)
        # hybrid models: the GDN layers' per-request states first (a slot per page-table row, +1 dummy),
        # then the K/V pages take what is left of the budget
        self.linear_pool = self._linear_state_pool(max_running_req)
        # found once: the verify replay runs every speculative step
        self.gdn_layers = [m for m in self.model.modules() if hasattr(m, "replay_accepted")]
        self.last_verify_state: LinearStateStep | None = None
        budget_bytes, max_pages = self._kv_budget(shape, max_running_req)
        kind = cache_kind(config, self.linear_pool, self.tp is not None)
        if kind == "hybrid":  # K/V pages reserved for the prefix cache's linear-state snapshots
            snapshots, num_pages = plan_snapshots(config, self.linear_pool, budget_bytes, shape.bytes_per_page())
        else:
            snapshots, num_pages = 0, min(budget_bytes // shape.bytes_per_page(), max_pages)
        self.kv_cache = KVCache(shape, num_pages, self.device)
        self.cache = make_cache_manager(kind, config, num_pages, max_running_req, self.max_seq_len, self.device,
                                        self.kv_cache, self.linear_pool, snapshots)
        self.linear_steps = (LinearStateSteps(self.linear_pool, self.cache.dummy_row, self.device)
                             if self.linear_pool is not None else None)
        self.attn_backend: AttnBackend = create_backend(config.attention_backend, layout, self.kv_cache, self.cache.page_table)
        self.ctx = Context(kv_cache=self.kv_cache, attn_backend=self.attn_backend)
        if self.tp is not None:  # the workers size their shards of the K/V cache like this rank's
            import torch.distributed as dist

            self.tp.broadcast(dict(dtype=self.dtype, num_pages=num_pages, max_seq_len=self.max_seq_len,
                                   max_running_req=max_running_req,
                                   attention_backend=self.attn_backend.info.name))
            dist.barrier()
        self.sampler = Sampler(self.device, config.seed)
        self.vocab_size = int(self.model.config.vocab_size)
        self.penalties = PenaltyState(self.vocab_size, self.device)
        self.graph_runner: GraphRunner | None = None
        self.verify_graph_runner: GraphRunner | None = None
        self.prefill_graph_runner: PrefillGraphRunner | None = None
        info = self.attn_backend.info
        if cuda_graph and not info.supports_cuda_graph:
            log.warning("attention backend %s cannot capture CUDA graphs; decoding eagerly", info.name)
            cuda_graph = False
        if cuda_graph and rows > 1 and not info.uniform_extend_graph:
            log.warning("backend %s cannot capture %d-row verify graphs; verifying eagerly", info.name, rows)
        self.resolved = ResolvedEngineConfig(
            device=str(self.device), dtype=str(self.dtype), max_seq_len=self.max_seq_len, max_req_len=self.max_req_len,
            decode_rows_per_req=rows, max_running_req=max_running_req, num_pages=num_pages - 1,
            page_size=config.page_size, attention_backend=info.name, moe_strategy=self.moe_strategy,
            cuda_graph=cuda_graph,
            cuda_graph_max_bs=min(config.cuda_graph_max_bs or max_running_req, max_running_req) if cuda_graph else 0,
            verify_cuda_graph=cuda_graph and rows > 1 and info.uniform_extend_graph,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        if cuda_graph:
            from ..moe.device_cache import preserved_counters

            with preserved_counters(self.moe_executors):  # capture's dummy rows are not served tokens
                self._capture_graphs()
        log.info("engine ready: %s; %s", config.model_path, self.resolved.describe())

    # --- MoE expert placement (freetoken_core/moe) ----------------------------------------------
    def _moe_strategy(self, cuda_graph: bool) -> tuple[str, EngineConfig]:
        """-> (the strategy, the config to place experts with). `auto`: resident when the experts fit the device
        beside the dense weights, the CUDA-graph pool, the prefill workspace and a K/V reserve (moe/residency.py),
        else offload, with the expert cache's budget set when none was given; "none" for dense models."""
        from ..models.loader import load_config
        from ..moe.placement import moe_layout
        from ..moe.residency import auto_strategy
        from .memory_plan import residency_plan

        cfg = self.config
        hf_config = load_config(cfg.model_path)
        if moe_layout(hf_config, self.dtype) is None:
            return "none", cfg
        if cfg.moe_strategy != "auto":
            return cfg.moe_strategy, cfg
        if self.device.type != "cuda":
            return "resident", cfg
        free, _ = torch.cuda.mem_get_info(self.device)
        plan = residency_plan(cfg, hf_config, self.dtype, free, cuda_graph=cuda_graph)
        log.info(plan.describe())
        strategy, cache_gb = auto_strategy(plan, budget_given=cfg.moe_cache_budgets_given() > 0)
        if cache_gb is None:
            return strategy, cfg
        # the expert cache takes what the device holds beside the rest
        log.info("moe_strategy auto -> offload with moe_cache_gb=%.2f", cache_gb)
        return strategy, dataclasses.replace(cfg, moe_cache_gb=cache_gb)

    def _place_experts(self, cuda_graph: bool) -> tuple[list, int, bool]:
        """-> (the expert executors, max_running_req after the pool's batch clamp, whether decode may
        still be captured)."""
        from ..moe.placement import graph_safe, place_experts

        self.moe_place_s = 0.0
        max_running_req = self.config.max_running_req
        if self.moe_strategy in ("resident", "none"):
            return [], max_running_req, cuda_graph
        t0 = time.perf_counter()
        executors, max_bs = place_experts(self.model, self.moe_strategy, self.config, self.device)
        self.moe_place_s = time.perf_counter() - t0  # pinning the host banks + the device cache's self-check
        if max_bs < max_running_req:
            log.warning("expert pools of %s slots hold one step of at most %d requests (x %d rows x top-k): "
                        "max_running_req %d -> %d", executors[0].num_slots if hasattr(executors[0], "num_slots") else "?",
                        max_bs, self.config.decode_rows(), max_running_req, max_bs)
            max_running_req = max_bs
        if cuda_graph and not graph_safe(executors):
            log.warning("moe_strategy %s reads each layer's routing on the host: decoding without CUDA graphs",
                        self.moe_strategy)
            cuda_graph = False
        return executors, max_running_req, cuda_graph

    def _fuse_shared_experts(self) -> None:
        """FREETOKEN_FUSED_SHARED_EXPERT: stack each shared expert into its layer's routed experts
        (models/qwen3_next.py SharedExpertMoeBlock), where the fused-MoE kernels run them (CUDA, resident)."""
        env = kernel_env()
        if not (env.fused_shared_expert and env.fused_moe and self.device.type == "cuda"
                and self.moe_strategy == "resident"):
            return
        blocks = [m for m in self.model.modules() if hasattr(m, "fuse_shared_expert")]
        fused = sum(1 for b in blocks if b.fuse_shared_expert())
        if fused:
            # each layer's old stacks were freed in blocks a little smaller than the new ones, which the
            # caching allocator cannot reuse: give them back before the K/V pages are sized
            torch.cuda.empty_cache()
        if blocks:
            log.info("shared expert stacked into the routed experts in %d of %d MoE layers", fused, len(blocks))

    def moe_stats(self) -> dict:
        """Slot hit rate, bytes copied per token and misses per layer of the expert executors."""
        from ..moe.stats import MoeStats, layer_stats

        return MoeStats(layer_stats(self.moe_executors)).summary()

    def _linear_state_pool(self, max_running_req: int) -> LinearStatePool | None:
        specs = self.model.linear_state_specs() if hasattr(self.model, "linear_state_specs") else []
        if not specs:
            return None
        state_dtype = STATE_DTYPES[self.config.linear_state_dtype]
        slots = max_running_req + 1
        pool = LinearStatePool(specs, slots, self.dtype, state_dtype, self.device)
        log.info("linear-state pool: %d GDN layers x %d slots (%d requests + 1 dummy), %.1f MiB per request, "
                 "%.2f GiB in all (%s recurrent state); the K/V pages get the rest of the budget",
                 len(specs), slots, slots - 1, LinearStatePool.bytes_per_slot(specs, self.dtype, state_dtype) / 2**20,
                 pool.nbytes / 2**30, self.config.linear_state_dtype)
        return pool

    def linear_state_step(self, batch: Batch) -> LinearStateStep | None:
        """The GDN layers' metadata for this batch (engine/linear_steps.py); None for models without them."""
        return None if self.linear_steps is None else self.linear_steps.for_batch(batch)

    def _graph_linear_state(self, batch: Batch) -> None:
        """GraphRunner hook (capture and replay): the decode / verify graphs' static state step."""
        if self.linear_steps is None:
            return
        step = self.linear_steps.for_graph(batch)
        self.ctx.linear_state = step
        if batch.phase == "verify":
            self.last_verify_state = step

    def _prefill_graph_linear_state(self, batch: Batch, rows: int, slots: int) -> None:
        """PrefillGraphRunner hook: the prefill graphs' static state step."""
        self.ctx.linear_state = self.linear_steps.for_prefill_graph(batch, rows, slots)

    @torch.inference_mode()
    def commit_verify(self, kept_rows: list[int]) -> None:
        """After a verify step: advance every GDN state by each request's kept rows (the tokens now
        cached), replaying the verify step's saved inputs (kvcache/linear_state.py)."""
        st = self.last_verify_state
        if st is None or self.linear_pool is None:
            return
        n = st.slot_ids.shape[0]
        kept = to_device(list(kept_rows) + [0] * (n - len(kept_rows)), torch.int64, self.device)
        self.replay_linear_state(st, kept)
        self.last_verify_state = None

    def replay_linear_state(self, step: LinearStateStep, kept: torch.Tensor) -> None:
        """Advance every GDN layer's states by `kept` [B] rows of a verify step (host- or device-made counts)."""
        for layer in self.gdn_layers:
            layer.replay_accepted(step, kept)

    def _kv_budget(self, shape: KVCacheShape, max_running_req: int) -> tuple[int, int]:
        """(bytes for the K/V pages, the most pages worth having: every row at full length, +1 dummy page). An
        explicit `num_pages` (usable pages, as the metrics count them) gives its pages' bytes."""
        cfg = self.config
        bytes_per_page = shape.bytes_per_page()
        max_pages = max_running_req * pages_for(self.max_seq_len, cfg.page_size) + 1
        if cfg.num_pages is not None:
            return min(cfg.num_pages + 1, max_pages) * bytes_per_page, max_pages
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.memory_fraction
        else:
            budget = cfg.kv_cache_gb * (1 << 30)
        if budget // bytes_per_page < 2:
            raise MemoryError(f"KV cache budget {budget / 2**30:.2f} GiB holds no page of {bytes_per_page} bytes")
        return int(budget), max_pages

    def _capture_graphs(self) -> None:
        max_bs = self.resolved.cuda_graph_max_bs
        self.graph_runner = GraphRunner(
            self.ctx, self._logits_of_all_rows, default_bs_list(max_bs), self.cache.dummy_row,
            self.max_seq_len, self.device, rows_per_req=1, batch_hook=self._graph_linear_state,
            replay_hook=self._graph_linear_state,
        )
        self.graph_runner.capture()
        rows = self.resolved.decode_rows_per_req
        if rows > 1 and not self.resolved.verify_cuda_graph:
            return  # verify steps run eagerly (logged when resolved), and so do prefill steps
        if rows > 1:
            # verify steps (speculative decoding): k + 1 rows per request, same graph memory pool
            self.verify_graph_runner = GraphRunner(
                self.ctx, self._logits_of_all_rows, default_bs_list(max_bs), self.cache.dummy_row,
                self.max_seq_len, self.device, rows_per_req=rows, pool=self.graph_runner.pool,
                batch_hook=self._graph_linear_state, replay_hook=self._graph_linear_state,
            )
            self.verify_graph_runner.capture()
        runner = self.build_prefill_graphs()
        if runner is not None:
            try:
                runner.capture()
            except Exception:  # an opt-in speed-up: a capture that fails leaves prefill eager, said loudly
                log.exception("capturing prefill graphs failed: prefilling eagerly")
                self.prefill_graph_runner = None
                torch.cuda.synchronize(self.device)

    def build_prefill_graphs(self) -> PrefillGraphRunner | None:
        """The small-prefill graph runner (engine/prefill_graph.py) when `prefill_graph_max_tokens` asks
        for one and this engine can run it, else None (prefill stays eager; the log says why).
        Not captured here: `_capture_graphs` captures it; on CPU, tests run its static steps eagerly."""
        cfg, max_running_req = self.config, self.resolved.max_running_req
        max_tokens = min(cfg.prefill_graph_max_tokens, cfg.max_extend_tokens, self.max_seq_len)
        if max_tokens < 1:
            return None
        why = None
        if not self.attn_backend.info.prefill_graph:
            why = f"attention backend {self.attn_backend.info.name} cannot capture prefill steps"
        elif self.moe_strategy not in ("resident", "none"):
            why = f"moe_strategy {self.moe_strategy} places the experts a prefill step needs on the host"
        elif self.tp is not None:
            why = "tensor-parallel steps run eagerly"
        if why is not None:  # loud only when asked for; the default just says it once
            say = log.info if cfg.prefill_graph_max_tokens == PREFILL_GRAPH_MAX_TOKENS_DEFAULT else log.warning
            say("prefill_graph_max_tokens %d: %s; prefilling eagerly", cfg.prefill_graph_max_tokens, why)
            return None
        pool = self.graph_runner.pool if self.graph_runner is not None else None
        self.prefill_graph_runner = PrefillGraphRunner(
            self.ctx, self._logits_of_sample_rows, prefill_graph_buckets(max_tokens),
            # a mixed step (mixed_prefill) carries a row of every running request besides the new prompts
            max_running_req if cfg.mixed_prefill else min(cfg.prefill_graph_max_reqs, max_running_req),
            self.cache.dummy_row, self.device, pool=pool,
            state_hook=self._prefill_graph_linear_state if self.linear_pool is not None else None,
        )
        return self.prefill_graph_runner

    def _logits_of_sample_rows(self, batch: Batch) -> torch.Tensor:
        return self.model.lm_head.logits(self.model.forward(batch.input_ids, batch.positions)[batch.sample_rows])

    def _logits_of_all_rows(self, batch: Batch) -> torch.Tensor:
        return self.model.lm_head.logits(self.model.forward(batch.input_ids, batch.positions))

    # --- batch construction (engine/batch_builder.py) ------------------------------------------
    def prepare_batch(self, phase: Phase, reqs: list[Req], extend_lens: list[int], rows_per_req: int = 1) -> Batch:
        """The step's tensors (`batch_builder.build_batch`): each request runs positions [cached_len,
        cached_len + extend_len), its pages already allocated."""
        return build_batch(self.cache, self.device, phase, reqs, extend_lens, rows_per_req)

    # --- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_batch(self, batch: Batch, **override: Any) -> torch.Tensor:
        """Run the model over the batch's rows; returns the final hidden states [T, hidden].

        `override` swaps Context fields for this call (a draft model on its own KV pool/backend)."""
        self.cache.flush()
        if self.linear_pool is not None and "linear_state" not in override:
            override["linear_state"] = self.linear_state_step(batch)
            if batch.phase == "verify":
                self.last_verify_state = override["linear_state"]
        if self.tp is not None:  # every rank runs this step over its shard
            from ..distributed.plan import StepPlan

            self.tp.send_plan(StepPlan.of(batch, [self.cache.pages_of(r) for r in batch.reqs]))
        with self.ctx.override(batch=batch, **override) as ctx:
            set_context(ctx)
            try:
                ctx.attn_backend.prepare_metadata(batch)
                return self.model.forward(batch.input_ids, batch.positions)
            finally:
                set_context(None)

    @torch.inference_mode()
    def forward_logits(self, batch: Batch, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, vocab] of the rows the batch samples."""
        if batch.sample_rows.numel() == 0:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        rows = hidden if batch.sample_rows.numel() == hidden.shape[0] else hidden[batch.sample_rows]
        if batch.features is not None:
            batch.features.add(rows)
        return self.model.lm_head.logits(rows)

    @torch.inference_mode()
    def launch(
        self,
        batch: Batch,
        banned: dict[int, list[int]] | None = None,
        inflight: tuple[torch.Tensor, list[int], list[int]] | None = None,
    ) -> InflightStep:
        """Queue forward + sampling on the device without waiting for it.

        `banned` maps a sampled row to token ids it may not produce (min_tokens). `inflight` is
        (previous step's device tokens, their rows, this batch's rows): input ids still being
        sampled are gathered on the device, so consecutive steps never wait for the host."""
        if inflight is not None:
            prev_tokens, src, dst = inflight
            idx = to_device([dst, src], torch.int64, self.device)
            batch.input_ids[idx[0]] = prev_tokens[idx[1]]
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            self.cache.flush()
            logits = self.graph_runner.replay(batch)
        elif self.prefill_graph_runner is not None and self.prefill_graph_runner.can_run(batch):
            self.cache.flush()
            runner = self.prefill_graph_runner
            logits = runner.replay(batch) if runner.graphs else runner.run_static(batch)
        else:
            hidden = self.forward_batch(batch)
            logits = self.forward_logits(batch, hidden)
        reqs = [batch.reqs[i] for i in batch.sample_reqs]
        if logits.shape[0] == 0:
            return InflightStep(self.sampler.empty(), self.sampler.pinned)
        sample = self.sampler.sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                                     self.penalties.prepare(reqs), banned)
        return InflightStep(sample, self.sampler.pinned)

    @torch.inference_mode()
    def forward_verify(self, batch: Batch) -> torch.Tensor:
        """fp32 logits of every row of a verify batch [size * rows_per_req, vocab]."""
        runner = self.verify_graph_runner
        if runner is not None and runner.can_run(batch):
            self.cache.flush()
            return runner.replay(batch)
        return self.forward_logits(batch, self.forward_batch(batch))

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave their process group, then drop the graphs, the
        K/V and GDN state pools and the model, so the memory returns and another Engine can start in
        this process. Idempotent; the engine runs no step after it."""
        if self.tp is not None:
            self.tp.close()
        if getattr(self, "closed", False):
            return
        self.closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight reads what is freed below
        self.graph_runner = self.verify_graph_runner = self.prefill_graph_runner = None
        self.ctx = self.attn_backend = self.kv_cache = self.linear_pool = self.linear_steps = None
        self.model, self.moe_executors, self.last_verify_state, self.gdn_layers = None, [], None, []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self, batch: Batch, banned: dict[int, list[int]] | None = None) -> SampleOutput:
        """Forward + sample, waiting for the result."""
        return self.launch(batch, banned).result()


class InflightStep:
    """A launched step whose sampled tokens are on their way to the host."""

    def __init__(self, sample: DeviceSample, pinned: PinnedPool | None = None) -> None:
        self.sample = sample
        self.tokens = sample.tokens  # device tensor: the next step gathers its inputs from it
        self.failed = sample.failed  # {row: error} of rows whose sampling settings could not run (sampler.py)
        self._host = sample.to_host_async(pinned)

    def result(self) -> SampleOutput:
        return self._host.wait()
