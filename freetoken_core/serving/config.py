"""ServingConfig: every serving knob of the `freetoken` model, declared once (default, type, range, why).

`serving_config()` is the one place it is built: the model's config.pbtxt `parameters` (a blank value keeps the
default) with `FREETOKEN_<NAME>` environment variables over them. Every part of the serving layer receives the
frozen result. The engine's own knobs are EngineConfig's fields (serving/params.py turns the same parameters into
one); docs/configuration.md lists both.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from freetoken_core.config import EngineConfig

ENV_PREFIX = "FREETOKEN_"
MAX_WHOLE = 1 << 20  # the ceiling of the counts below that have no natural one
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def knob(default: Any, why: str, lo: float | None = None, hi: float | None = None, rule: str = "") -> Any:
    """A ServingConfig field: its default, the one line a deployer reads, its range and how a bad value is named."""
    return field(default=default, metadata={"why": why, "lo": lo, "hi": hi, "rule": rule})


@dataclass(frozen=True)
class ServingConfig:
    # --- requests: what a client may ask for
    max_tokens_limit: int = knob(
        0, "ceiling on any request's max_tokens (0 = only the context length limits it)",
        0, 2**31 - 1, "a whole number >= 0")
    max_nonstream_tokens: int = knob(
        4096, "ceiling on max_tokens of a non-streaming request (0 = none): Triton does not tell a model that an "
        "HTTP /generate client went away, so such a request always runs to its end", 0, 2**31 - 1,
        "a whole number >= 0")
    # --- streaming: how tokens become responses
    stream_interval: int = knob(
        1, "tokens per streamed response (the first goes out at once); more = fewer responses, each costing the "
        "ensemble a detokenizer execution", 1, MAX_WHOLE, "a whole number >= 1")
    detok_send_order: bool = knob(
        True, "the detokenizer instances keep each stream's responses in order (stream/send_order.py), so a stream "
        "may have several in flight; needs the decoupled detokenizer (off, logged, with a plain one)")
    detok_inflight_budget: int = knob(
        128, "responses all streams may have unacked together (with detok_send_order), shared among the streams in "
        "flight: few streams get a wider window, many no longer queue more than this (0 = a fixed window)",
        0, MAX_WHOLE, f"a whole number from 0 (off) to {MAX_WHOLE}")
    detok_max_inflight: int = knob(
        0, "a stream's responses sent but not yet acked by the detokenizer; 0 = auto (1 with the budget, 4 with "
        "send order alone or one detokenizer instance, else 1)", 0, MAX_WHOLE, "a whole number >= 0")
    sender_threads: int = knob(
        0, "threads that send responses of one instance (each send is a round trip with the GIL released); 0 = auto "
        "(2 with the engine process on hosts of 16+ CPUs, else 1)", 0, 64,
        "a whole number from 1 to 64, or 0 (auto)")
    # --- cancellation and metrics
    cancel_check_interval_ms: float = knob(
        200.0, "how often the engine thread asks Triton whether clients cancelled (each ask is an IPC round trip)",
        0, 3_600_000, "from 0 to 3600000 (ms)")
    nonstream_cancel_probe_ms: float = knob(
        0.0, "> 0: non-streaming ensemble requests probe for a gRPC cancel this often (needs a decoupled "
        "detokenizer: every streamed response then costs one more IPC round trip); 0 = the cancel is seen at the end",
        0, 3_600_000, "from 0 (off) to 3600000 (ms)")
    metrics_interval_ms: float = knob(
        500.0, "how often gauges and counters are pushed to Triton's metrics (an IPC round trip each time)",
        0, 3_600_000, "from 0 to 3600000 (ms)")
    # --- the engine process
    engine_process: bool = knob(
        True, "the engine runs in a child process with a GIL of its own; off: in the model's process beside the "
        "sender (one GIL for both: slower at many streams, one instance only)")
    engine_cpus: str = knob(
        "auto", "CPUs of the engine process's own: 'off', a list ('15', '14-15') or 'auto' (the last physical core "
        "per rank on hosts of 8+ CPUs); `serve` runs the rest of the server on the other CPUs")
    engine_msg_ring_kib: int = knob(
        0, "KiB of a shared-memory ring per instance for the engine's step messages instead of the pipe (0 = the "
        "pipe): more throughput at many streams, tokens in lumps at few; x86-64 only", 0, MAX_WHOLE,
        f"a whole number from 0 (no ring) to {MAX_WHOLE}")
    engine_msg_ring_poll_us: float = knob(
        500.0, "how often (us) an instance with requests in flight looks into its ring: shorter = smoother streams "
        "for more CPU", 10, 2000, "from 10 to 2000")
    gc_freeze: bool = knob(
        True, "each served process moves its start-up heap out of the cyclic garbage collector's way (gc.freeze); "
        "off only to debug the collector")
    # --- tests only
    fault_injection: str = knob(
        "", "TEST ONLY: faults to inject (engine_proc/faults.py); empty in production")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_range(f, getattr(self, f.name))

    @property
    def ring_bytes(self) -> int:
        return self.engine_msg_ring_kib * 1024

    @property
    def ring_poll_s(self) -> float:
        return self.engine_msg_ring_poll_us / 1e6


FIELDS = {f.name: f for f in dataclasses.fields(ServingConfig)}
FIELD_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def field_type(f: dataclasses.Field) -> type:
    return FIELD_TYPES[f.type] if isinstance(f.type, str) else f.type


def _check_range(f: dataclasses.Field, value: Any) -> None:
    lo, hi, rule = f.metadata["lo"], f.metadata["hi"], f.metadata["rule"]
    kind = field_type(f)
    bad = not isinstance(value, kind) and not (kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not bad and kind in (int, float):
        bad = (lo is not None and value < lo) or (hi is not None and value > hi)
    if bad:
        raise ValueError(f"serving parameter {f.name} must be {rule or kind.__name__}, got {value!r}")


def parse_value(name: str, raw: str) -> Any:
    """One parameter's text as its field's type; a clear error names the parameter and the rule."""
    f = FIELDS[name]
    kind, text = field_type(f), raw.strip()
    rule = f.metadata["rule"] or ("1 or 0" if kind is bool else kind.__name__)
    try:
        if kind is bool:
            if text.lower() in TRUE_WORDS:
                return True
            if text.lower() in FALSE_WORDS:
                return False
            number = float(text)  # "1.0" / "0.0": the switches were numbers once
            if number not in (0.0, 1.0):
                raise ValueError(text)
            return bool(number)
        if kind is int:
            number = float(text)
            if number != int(number):
                raise ValueError(text)
            return int(number)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(f"serving parameter {name} must be {rule}, got {raw!r}") from None
    return text


def is_backend_key(name: str) -> bool:
    """The Python backend's own parameters (EXECUTION_ENV_PATH, ...) are upper case: they pass through."""
    return name.isupper()


def check_known(params: Mapping[str, str], engine_names: list[str]) -> None:
    """An unknown parameter is a start-up error naming it (a typo would otherwise silently keep a default)."""
    unknown = sorted(k for k in params if k not in FIELDS and k not in engine_names and not is_backend_key(k))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} in the freetoken model's config.pbtxt; known: serving "
                         f"{sorted(FIELDS)}, engine {sorted(engine_names)} (docs/configuration.md)")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def serving_config(params: Mapping[str, str], environ: Mapping[str, str] | None = None) -> ServingConfig:
    """THE builder: config.pbtxt parameters (blank = the default), FREETOKEN_<NAME> environment variables over
    them. Unknown parameters are refused (the engine's EngineConfig fields and the backend's own keys pass)."""
    check_known(params, [f.name for f in dataclasses.fields(EngineConfig)])
    environ = environ or {}
    values: dict[str, Any] = {}
    for name in FIELDS:
        raw = environ.get(env_name(name), params.get(name))
        if raw is None or (raw.strip() == "" and field_type(FIELDS[name]) is not str):
            continue
        values[name] = parse_value(name, raw)
    return ServingConfig(**values)


def sender_threads(config: ServingConfig, cpus: int | None = None) -> int:
    """Send threads of one `freetoken` instance; 0 (auto) resolves for this host (`cpus`: os.cpu_count())."""
    if config.sender_threads == 0:
        return 2 if config.engine_process and (cpus or os.cpu_count() or 1) >= 16 else 1
    return config.sender_threads


def inflight_budget(config: ServingConfig, instances: int) -> int:
    """detok_inflight_budget: this `freetoken` instance's part of it, rounded up (0 = off)."""
    value = config.detok_inflight_budget
    return -(-value // max(instances, 1)) if value else 0
