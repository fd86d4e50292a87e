"""Engine settings of the `freetoken` Triton model: config.pbtxt `parameters` <-> EngineConfig.

Every EngineConfig field is a string parameter of the same name; an empty string means "the
EngineConfig default". The serve command overrides any of them with FREETOKEN_<NAME> environment
variables (FREETOKEN_MODEL_PATH, FREETOKEN_DTYPE, FREETOKEN_MAX_RUNNING_REQ, ...) and writes the
result into the runtime copy of the repository, so the running config.pbtxt is the whole truth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from typing import Any, Mapping

from freetoken_core.config import EngineConfig

ENV_PREFIX = "FREETOKEN_"
# Serving-only knobs of the freetoken model (not EngineConfig fields).
SERVING_DEFAULTS: dict[str, str] = {
    # How often the engine thread asks Triton whether clients cancelled: each ask is an IPC round trip.
    "cancel_check_interval_ms": "200",
    # How often gauges/counters are pushed to Triton's metrics (also IPC); histograms go after each step's
    # responses (serving/triton/metrics.py).
    "metrics_interval_ms": "500",
    # Ceiling on max_tokens per request (0 = only the context length limits it).
    "max_tokens_limit": "0",
    # Streaming: tokens per response (the first token always goes out at once). 1 = every engine
    # step; e.g. 4 cuts the ensemble's per-response work (detokenizer execution, gRPC message) by ~4x.
    "stream_interval": "1",
    # Ceiling on max_tokens of a NON-streaming request (0 = none). Triton 2.51 tells no model that an
    # HTTP /generate client disconnected (benchmarks/repro_cancel_signals.py), so such a request
    # runs to its end for nobody: this bounds that waste. Streaming requests are not limited by it.
    "max_nonstream_tokens": "4096",
    # > 0: every this many ms, a non-streaming ensemble request sends an internal probe through the
    # detokenizer, which sees a gRPC cancel there and stops the engine (Triton marks only the steps it
    # schedules after a cancel). Needs a decoupled detokenizer (`serve` renders it so), which costs
    # every streamed response one more IPC round trip; 0 = off: the cancel is noticed at the end.
    "nonstream_cancel_probe_ms": "0",
    # Flow control of streamed ensemble responses (serving/engine_proc/engine_loop.py): how many a request may have
    # in the detokenizer's queue (sent, not yet acked). 0 = auto: with detok_send_order (the default) and
    # detok_inflight_budget (the default) 1, the least a stream gets of the budget (which then sets the window); with
    # send order alone or one detokenizer instance (one queue: in order anyway) 4; else 1 (what keeps a stream in
    # order across several instances). While a stream is at the limit its tokens wait and merge into its next
    # response.
    "detok_max_inflight": "0",
    # > 0 (with detok_send_order): responses the server's streams may have in the detokenizers' queues together,
    # shared by the streams in flight, so that few streams get more each: a stream's window is then
    # max(detok_max_inflight, this / the streams in flight). Each `freetoken` instance shares out its part (this /
    # the instance count) among its own streams. E.g. 128 (with auto detok_max_inflight, 1): 8 a stream at 16
    # streams, 2 at 64, 1 at 128, so few streams can use the detokenizers' spare capacity while many no longer queue
    # more than 128 responses in front of them (at capacity a longer queue only adds waiting, and a request's first
    # and last responses wait in it too: each stream's turnaround). 0 = off (the fixed window). On by default: on the
    # H200 at 16 streams, Llama-3.2-1B shape, 1.09 tokens a response at 11.7k responses/s against 1.22 at 10.5k off,
    # the same tok/s and latency, one stream the same; SmolLM2 shape 1.26 where the last run without it read 1.55
    # (benchmarks/RESULTS.md, thirty-third session).
    "detok_inflight_budget": "128",
    # 1: the detokenizer instances keep each stream's responses in order themselves (serving/stream/send_order.py:
    # an order table in shared memory), so auto detok_max_inflight is 4 whatever the instance count and a
    # stream's last response never waits for an ack. Only with the decoupled detokenizer (the default): with a
    # plain one it is off (logged). On by default since the twenty-fifth session: on the H200, with the engine
    # process, one token a response at one stream (up to 1.35 off), SmolLM2 shape at 16 streams 1.32-1.47 tokens
    # a response (1.51 off), 16 streams 2-4% less, 64 streams 5-11% more tok/s (benchmarks/RESULTS.md); 0: one
    # response of a stream in flight.
    "detok_send_order": "1",
    # 1: the engine (scheduler, model, sampling) runs in a child process with a GIL of its own, and this
    # model's process only takes requests and sends responses (serving/engine_proc/engine_process.py); 0: the engine
    # thread runs in this process beside the sender (one GIL for both: slower at many streams).
    "engine_process": "1",
    # KiB of a shared-memory ring through which the engine process hands each step's messages to a `freetoken`
    # instance (serving/engine_proc/msg_ring.py: a memory copy on the engine's thread instead of a pipe write that wakes the
    # instance); 0 = the pipe (the default). Opt-in: on the H200 it raised throughput at 16 and 64 streams
    # (Llama-3.2-1B shape 64 streams +28%) but the instance then polls, so a stream's tokens arrive in lumps
    # (one stream: ~2.3 tokens a response instead of ~1.4) and one stream is no faster (RESULTS.md, nineteenth
    # session). x86-64 only (elsewhere: the pipe).
    "engine_msg_ring_kib": "0",
    # how often (us) an instance with requests in flight looks into its ring (serving/engine_proc/msg_ring.py RING_POLL_S)
    "engine_msg_ring_poll_us": "500",
    # Threads that call the response sender's send() (serving/stream/sender.py SendWorkers): each send is a
    # round trip to a server thread with the GIL released, so N threads keep N responses in flight; a
    # request stays on one thread (its order holds). 1 = the sender thread sends itself. 0 = auto: 2 with the
    # engine process on hosts of 16+ CPUs (where `serve` also runs 8 instances), else 1. On the H200 host 8
    # instances of 2 send threads answered 11.2-11.5k responses/s at 64 streams against 7.1k (and a run with no
    # result) for 6 of 1, at 1.38-1.40 tokens a response at 16 streams (RESULTS.md, twenty-eighth session).
    "sender_threads": "0",
    # 1: each served process (engine process, `freetoken`, tokenizer and detokenizer stubs) moves what is alive
    # when its start-up ends out of the cyclic garbage collector's way (gc.freeze, serving/engine_proc/gc_freeze.py): a full
    # collection walked ~300k start-up objects, 143-153 ms with the SmolLM2 engine on the CPU box, ~0 ms after; 0:
    # Python's collector as it is. `serve` copies it to the text models' configs.
    "gc_freeze": "1",
}


# Serving-only knobs whose values are text, not numbers.
SERVING_TEXT_DEFAULTS: dict[str, str] = {
    # CPUs of the engine process's own, apart from the rest of the server (serving/engine_proc/cpu_affinity.py): "" / "off", a
    # CPU list ("15", "14-15") or "auto" (the last physical core per rank, on hosts of 8+ CPUs where that is at most
    # a quarter of them; else off). H200 host, 64 streams: +15-17% tok/s (benchmarks/RESULTS.md, twenty-first session).
    "engine_cpus": "auto",
}

# String parameters for tests only (serving/engine_proc/faults.py); empty in production.
TEST_PARAMS: dict[str, str] = {"fault_injection": ""}


def engine_param_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


def all_param_names() -> list[str]:
    return engine_param_names() + list(SERVING_DEFAULTS) + list(SERVING_TEXT_DEFAULTS) + list(TEST_PARAMS)


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """FREETOKEN_<NAME> variables for known parameter names (unknown ones are ignored)."""
    out = {}
    for name in all_param_names():
        key = ENV_PREFIX + name.upper()
        if key in environ:
            out[name] = environ[key]
    return out


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _convert(name: str, raw: str, annotation: Any) -> Any:
    text = raw.strip()
    args = typing.get_args(annotation) if _is_union(annotation) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ValueError(f"engine parameter {name}={raw!r} is not a valid {getattr(base, '__name__', base)}") from None
    return text


def engine_config_from_params(params: Mapping[str, str]) -> EngineConfig:
    """Build an EngineConfig from string parameters; blank values keep the dataclass default."""
    hints = typing.get_type_hints(EngineConfig)
    kwargs: dict[str, Any] = {}
    for name in engine_param_names():
        raw = params.get(name)
        if raw is None or (raw.strip() == "" and name != "model_path"):
            continue
        kwargs[name] = _convert(name, raw, hints[name])
    kwargs["model_path"] = resolve_model_path(kwargs.get("model_path") or "")
    cfg = EngineConfig(**kwargs)
    cfg.validate()
    return cfg


def resolve_model_path(path: str) -> str:
    """"" means the default model (SmolLM2-135M-Instruct, fetched and converted on first use)."""
    if path.strip():
        return path.strip()
    from freetoken_core.models.gguf import default_model_path

    return default_model_path()


def serving_options(params: Mapping[str, str]) -> dict[str, float]:
    out = {}
    for name, default in SERVING_DEFAULTS.items():
        raw = (params.get(name) or "").strip() or default
        try:
            out[name] = float(raw)
        except ValueError:
            raise ValueError(f"serving parameter {name}={raw!r} is not a number") from None
    return out


def sender_threads(options: Mapping[str, float], cpus: int | None = None) -> int:
    """Send threads of one `freetoken` instance; 0 (auto) resolves for this host (`cpus`: os.cpu_count())."""
    value = options["sender_threads"]
    if value != int(value) or not 0 <= value <= 64:
        raise ValueError(f"serving parameter sender_threads must be a whole number from 1 to 64, or 0 (auto), "
                         f"got {value:g}")
    if value == 0:
        return 2 if options["engine_process"] and (cpus or os.cpu_count() or 1) >= 16 else 1
    return int(value)


def msg_ring(options: Mapping[str, float]) -> tuple[int, float]:
    """(bytes of each instance's message ring, 0 = the pipe; seconds between an instance's looks into it)."""
    kib, poll_us = options["engine_msg_ring_kib"], options["engine_msg_ring_poll_us"]
    if kib != int(kib) or not 0 <= kib <= 1 << 20:
        raise ValueError(f"serving parameter engine_msg_ring_kib must be a whole number from 0 (no ring) to "
                         f"{1 << 20}, got {kib:g}")
    if not 10 <= poll_us <= 2000:
        raise ValueError(f"serving parameter engine_msg_ring_poll_us must be from 10 to 2000, got {poll_us:g}")
    return int(kib) * 1024, poll_us / 1e6


def inflight_budget(options: Mapping[str, float], instances: int) -> int:
    """detok_inflight_budget: this `freetoken` instance's part of it, rounded up (0 = off)."""
    value = options["detok_inflight_budget"]
    if value != int(value) or not 0 <= value <= 1 << 20:
        raise ValueError(f"serving parameter detok_inflight_budget must be a whole number from 0 (off) to {1 << 20}, "
                         f"got {value:g}")
    return -(-int(value) // max(instances, 1)) if value else 0


def stream_interval(options: Mapping[str, float]) -> int:
    value = options["stream_interval"]
    if value != int(value) or value < 1:
        raise ValueError(f"serving parameter stream_interval must be a whole number >= 1, got {value:g}")
    return int(value)


def parse_model_config_params(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """Triton hands initialize() the config as JSON: parameters = {key: {"string_value": v}}."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
