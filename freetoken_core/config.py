"""Engine and sampling configuration: plain dataclasses, validated where users fill them in."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Any


# EngineConfig.prefill_graph_max_tokens: the largest prefill step captured by default (CUDA, with decode graphs)
PREFILL_GRAPH_MAX_TOKENS_DEFAULT = 512

# SamplingParams limits: what the sampler's int64 / float32 tensors hold
SAMPLING_EPS = 1e-5  # temperatures below it sample greedily (vLLM's _SAMPLING_EPS)
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGPROBS = 20
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (vLLM's and OpenAI's range)


def _is_integer(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _integer(name: str, v: Any) -> int:
    if not _is_integer(v):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def _real(name: str, v: Any) -> float:
    """A finite number (an integer counts); a bool, a string or NaN/inf does not."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:  # an integer past float's range
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return f


def _in_range(name: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


@dataclass
class SamplingParams:
    """Per-request generation settings (names follow vLLM's SamplingParams)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = -1  # -1 or 0: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; n: plus top-n
    skip_special_tokens: bool = True
    # vLLM's penalties: presence / frequency over the output so far, repetition over prompt and output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # a temperature this small divides the logits into inf/NaN in float32: it means greedy (vLLM's rule)
        return self.temperature < SAMPLING_EPS

    def validate(self, max_new_tokens_limit: int | None = None, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and its limit for anything a user can get wrong: exact types (a
        bool is a bool, an integer an integer) and every value within what the engine's tensors hold.
        vocab_size (when known) bounds top_k and stop_token_ids."""
        if _integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        max_tokens_cap = INT64_MAX if max_new_tokens_limit is None else max_new_tokens_limit
        if self.max_tokens > max_tokens_cap:
            raise ValueError(f"max_tokens={self.max_tokens} exceeds the limit of {max_tokens_cap} new tokens")
        _in_range("min_tokens", _integer("min_tokens", self.min_tokens), 0, INT64_MAX)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is larger than max_tokens={self.max_tokens}")
        if not 0.0 <= _real("temperature", self.temperature) <= FLOAT32_MAX:
            raise ValueError(f"temperature must be in [0, {FLOAT32_MAX:.4g}] (0, or below {SAMPLING_EPS}: greedy), "
                             f"got {self.temperature}")
        if not 0.0 < _real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= _real("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            lim = MAX_PRESENCE_FREQUENCY_PENALTY
            if not -lim <= _real(name, getattr(self, name)) <= lim:
                raise ValueError(f"{name} must be in [{-lim}, {lim}], got {getattr(self, name)}")
        if not 0.0 < _real("repetition_penalty", self.repetition_penalty) <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be in (0, {FLOAT32_MAX:.4g}] (1: off), "
                             f"got {self.repetition_penalty}")
        top_k_cap = INT64_MAX if vocab_size is None else vocab_size
        if not -1 <= _integer("top_k", self.top_k) <= top_k_cap:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or in [1, {top_k_cap}]"
                             f"{' (the vocabulary size)' if vocab_size is not None else ''}, got {self.top_k}")
        if self.seed is not None:
            _in_range("seed", _integer("seed", self.seed), 0, INT64_MAX)
        if self.logprobs is not None:
            _in_range("logprobs", _integer("logprobs", self.logprobs), 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        id_cap = INT64_MAX if vocab_size is None else vocab_size - 1
        for t in self.stop_token_ids:
            if not _is_integer(t) or not 0 <= t <= id_cap:
                raise ValueError(f"stop_token_ids must be integers in [0, {id_cap}]"
                                 f"{' (the vocabulary)' if vocab_size is not None else ''}, got {t!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict (vLLM-backend `sampling_parameters`); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def copy(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Defaults suit a small model on CPU."""

    model_path: str
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer | fa
    max_running_req: int = 32
    page_size: int = 16
    max_seq_len: int | None = None  # default: the model's max_position_embeddings (capped at 32768)
    max_extend_tokens: int = 2048  # token budget of one prefill step (chunked prefill)
    kv_cache_gb: float = 1.0  # CPU: memory budget of the KV cache
    memory_fraction: float = 0.85  # CUDA: fraction of free memory for the KV cache after weights
    num_pages: int | None = None  # explicit count of usable K/V pages (overrides both budgets; tests use it)
    decode_rows_per_req: int = 1  # query rows one request may run per decode step (speculation: k+1)
    cuda_graph: bool = True  # capture decode with CUDA graphs (CUDA only)
    cuda_graph_max_bs: int | None = None
    # > 0: where decode runs in CUDA graphs, also capture prefill steps of up to this many rows (and
    # prefill_graph_max_reqs requests) (engine/prefill_graph.py): a short prompt's eager prefill is launch-bound
    # (benchmarks/RESULTS.md, prefill-graph row); 0 = eager prefill
    prefill_graph_max_tokens: int = PREFILL_GRAPH_MAX_TOKENS_DEFAULT
    prefill_graph_max_reqs: int = 4
    # prefill steps also carry one row of every decoding request (SGLang's --enable-mixed-chunk), so an
    # arriving prompt does not cost the running requests a step; their rows count in max_extend_tokens
    mixed_prefill: bool = False
    overlap_schedule: bool | None = None  # None: on for CUDA; True forces it (CPU too: tests the logic)
    seed: int = 0
    load_format: str = "auto"  # auto: safetensors; dummy: random weights from config.json (benchmarks)
    # None: as the checkpoint's config.json quantization_config says (block FP8 or none); "fp8": quantize an
    # unquantized checkpoint's projections block-wise at load (128 x 128 blocks, like the FP8 releases)
    quantization: str | None = None
    speculative: str | None = None  # None | "ngram" (prompt-lookup drafter, verified by the target)
    num_speculative_tokens: int = 4  # k: draft tokens per verify step (k + 1 rows per request)
    ngram_max: int = 3
    ngram_min: int = 1
    linear_state_dtype: str = "float32"  # hybrid (GDN) models: recurrent state dtype, float32 | bfloat16
    # MoE models: where the routed experts live (freetoken_core/moe): auto | resident | offload | cpu | hybrid,
    # and the device-slot budget of offload / hybrid (one of the three)
    moe_strategy: str = "auto"
    moe_cache_slots: int | None = None  # slots per MoE layer
    moe_cache_gb: float | None = None  # GiB of slots over all MoE layers
    moe_cache_rate: float | None = None  # a share of all experts (FreeToken's option)
    # offload: the device-side cache (slot tables + copy kernels, decodes in CUDA graphs): auto (on CUDA,
    # after a startup self-check; else the host-driven slot pool without graphs) | on (CPU too) | off
    moe_device_cache: str = "auto"
    moe_cpu_threads: int | None = None  # threads of the CPU expert executor (default: half the cores)
    tensor_parallel_size: int = 1  # ranks (one process each, rank 0 this one) sharding the model (distributed/)
    # torch.distributed backend of the ranks: auto (NCCL on CUDA, one GPU per rank; gloo on CPU) | nccl |
    # gloo (on CUDA too: ranks share the GPUs there are, collectives staged through host memory; for
    # checking the sharded CUDA path on a one-GPU machine, not for speed)
    tensor_parallel_backend: str = "auto"
    # reuse the K/V pages (and, on hybrid models, linear-state snapshots) of earlier requests' common prefixes
    # (kvcache/prefix_cache.py): a chat's next turn or a shared system prompt is not prefilled again
    enable_prefix_caching: bool = True
    # hybrid (GDN) models: GiB of linear-state snapshot slots (None: half of the KV budget), and
    # the spacing in tokens of the periodic snapshots taken from chunked prefill of long contexts
    prefix_cache_state_gb: float | None = None
    prefix_cache_state_interval: int = 512

    def decode_rows(self) -> int:
        """Query rows one request runs per decode step: `decode_rows_per_req`, at least k + 1 under
        speculation (a verify step runs them); every per-request allowance follows this."""
        return max(self.decode_rows_per_req, self.num_speculative_tokens + 1 if self.speculative else 1)

    def moe_cache_budgets_given(self) -> int:
        """How many of moe_cache_slots / moe_cache_gb / moe_cache_rate are set (at most one may be)."""
        return sum(v is not None for v in (self.moe_cache_slots, self.moe_cache_gb, self.moe_cache_rate))

    def validate(self) -> None:
        """Raise a ValueError naming the field and its limit; never changes a field."""
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"unknown speculative method {self.speculative!r}; known: ngram")
        if self.speculative is not None:
            if not 1 <= self.num_speculative_tokens <= 16:
                raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
            if not 1 <= self.ngram_min <= self.ngram_max:
                raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unknown quantization {self.quantization!r}; use None (from the checkpoint) or 'fp8'")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req must be >= 1, got {self.max_running_req}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {self.max_extend_tokens}")
        if self.prefill_graph_max_tokens < 0 or self.prefill_graph_max_reqs < 1:
            raise ValueError(f"need prefill_graph_max_tokens >= 0 and prefill_graph_max_reqs >= 1, got "
                             f"{self.prefill_graph_max_tokens}, {self.prefill_graph_max_reqs}")
        if self.decode_rows_per_req < 1:
            raise ValueError(f"decode_rows_per_req must be >= 1, got {self.decode_rows_per_req}")
        if self.dtype not in ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"):
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        from .moe import MOE_STRATEGIES

        if self.moe_strategy not in MOE_STRATEGIES:
            raise ValueError(f"unknown moe_strategy {self.moe_strategy!r}; known: {', '.join(MOE_STRATEGIES)}")
        if self.moe_device_cache not in ("auto", "on", "off"):
            raise ValueError(f"moe_device_cache must be auto, on or off, got {self.moe_device_cache!r}")
        if self.moe_cache_budgets_given() > 1:
            raise ValueError("set only one of moe_cache_slots, moe_cache_gb, moe_cache_rate")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"tensor_parallel_backend must be auto, nccl or gloo, got {self.tensor_parallel_backend!r}")
        if self.tensor_parallel_size > 1 and self.moe_strategy not in ("auto", "resident"):
            raise ValueError(f"moe_strategy {self.moe_strategy!r} does not run with tensor_parallel_size > 1; "
                             "use resident (experts sharded over the ranks)")
        if self.linear_state_dtype not in ("float32", "fp32", "bfloat16", "bf16"):
            raise ValueError(f"linear_state_dtype must be float32 or bfloat16, got {self.linear_state_dtype!r}")
        if self.prefix_cache_state_gb is not None and not self.prefix_cache_state_gb >= 0:
            raise ValueError(f"prefix_cache_state_gb must be >= 0, got {self.prefix_cache_state_gb}")
        if self.prefix_cache_state_interval < 1:
            raise ValueError(f"prefix_cache_state_interval must be >= 1, got {self.prefix_cache_state_interval}")
        if not (0.0 < self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
