"""The runtime model repository of `freetoken-core serve`: model_repository/ copied with the `freetoken`
parameters filled from FREETOKEN_<NAME> environment variables and command-line overrides, the instance counts
chosen for this host."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Mapping

from freetoken_core.serving.engine_proc.cpu_affinity import engine_cpus_of_model, format_cpu_list, resolve_engine_cpus
from freetoken_core.serving.params import all_param_names, env_overrides

log = logging.getLogger(__name__)

MODEL_NAMES = ("tokenizer", "freetoken", "detokenizer", "ensemble")
# Instance counts, overridable like the engine parameters: the stateless Python models', and the engine
# model's (its instances share one engine process: serving/engine_proc/engine_share.py).
INSTANCE_ENV = {"tokenizer": "FREETOKEN_TOKENIZER_INSTANCES", "detokenizer": "FREETOKEN_DETOKENIZER_INSTANCES",
                "freetoken": "FREETOKEN_FREETOKEN_INSTANCES"}


def source_repository() -> Path:
    """model_repository/ next to the package (a source checkout or the Docker image's /opt copy)."""
    env = os.environ.get("FREETOKEN_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "model_repository"


_PARAM_RE = r'(parameters\s*\{\s*key:\s*"{key}"\s*value:\s*\{\s*string_value:\s*)"((?:[^"\\]|\\.)*)"'


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace one `parameters { key: "K" value: { string_value: "..." } }`, or append it."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    pattern = re.compile(_PARAM_RE.replace("{key}", re.escape(key)))
    if pattern.search(config_text):
        return pattern.sub(lambda m: f'{m.group(1)}"{escaped}"', config_text, count=1)
    return config_text.rstrip("\n") + f'\nparameters {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}\n'


def get_parameter(config_text: str, key: str) -> str | None:
    m = re.search(_PARAM_RE.replace("{key}", re.escape(key)), config_text)
    return None if m is None else m.group(2).replace('\\"', '"').replace("\\\\", "\\")


def set_instance_count(config_text: str, count: int) -> str:
    return re.sub(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", rf"\g<1>{count}", config_text, count=1)


def set_decoupled(config_text: str) -> str:
    """Make a model config decoupled (after its max_batch_size line), unless it already is."""
    if re.search(r"^\s*model_transaction_policy", config_text, re.M):
        return config_text
    return re.sub(r"^(max_batch_size:.*)$", r"\1\nmodel_transaction_policy { decoupled: true }", config_text,
                  count=1, flags=re.M)


def render_repository(dest: Path, overrides: Mapping[str, str], environ: Mapping[str, str] | None = None,
                      source: Path | None = None) -> Path:
    """Copy the model repository to dest with the freetoken parameters filled in.

    Precedence: config.pbtxt defaults < FREETOKEN_<NAME> environment < explicit overrides."""
    environ = os.environ if environ is None else environ
    source = source or source_repository()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg_path = dest / "freetoken" / "config.pbtxt"
    text = cfg_path.read_text()
    values = {**env_overrides(environ), **{k: v for k, v in overrides.items() if v is not None}}
    unknown = sorted(set(values) - set(all_param_names()))
    if unknown:
        raise ValueError(f"unknown engine parameter(s) {unknown}; known: {all_param_names()}")
    for key, value in values.items():
        text = set_parameter(text, key, str(value))
    cfg_path.write_text(text)
    # tokenizer and detokenizer load the same tokenizer files as the engine, and freeze their start-up heap as it does
    model_path = get_parameter(text, "model_path") or ""
    gc_freeze = get_parameter(text, "gc_freeze") or "1"
    for model in ("tokenizer", "detokenizer"):
        p = dest / model / "config.pbtxt"
        p.write_text(set_parameter(set_parameter(p.read_text(), "model_path", model_path), "gc_freeze", gc_freeze))
    engine_process = float(get_parameter(text, "engine_process") or 1) != 0
    engine_cpus = get_parameter(text, "engine_cpus") or ""
    if engine_cpus.strip():  # "auto" becomes the list it means here, where the whole host is in view
        ranks = int(get_parameter(text, "tensor_parallel_size") or 1)
        # with an engine process: auto resolved, a list checked against this host's CPUs; without one: auto is off
        # and a list is refused
        cpus = (resolve_engine_cpus(engine_cpus, ranks) if engine_process
                else engine_cpus_of_model(engine_cpus, ranks, engine_process=False))
        text = set_parameter(text, "engine_cpus", format_cpu_list(cpus))
        cfg_path.write_text(text)
    if float(get_parameter(text, "nonstream_cancel_probe_ms") or 0) > 0:
        # probes must end inside the detokenizer without a response: only a decoupled model can do that
        p = dest / "detokenizer" / "config.pbtxt"
        p.write_text(set_decoupled(p.read_text()))
    counts = {"detokenizer": default_detokenizer_instances(),
              "freetoken": default_freetoken_instances(engine_process=engine_process)}
    for model, var in INSTANCE_ENV.items():
        if environ.get(var):
            counts[model] = int(environ[var])
    for model, count in counts.items():
        p = dest / model / "config.pbtxt"
        p.write_text(set_instance_count(p.read_text(), count))
    log.info("model instances: %s", ", ".join(f"{m} {c}" for m, c in counts.items()))
    return dest


def default_detokenizer_instances(cpus: int | None = None) -> int:
    """Detokenizer instances for this host. Each is a light stub process (no torch: its imports take ~35 MB)
    that waits most of a response on IPC round trips (the execute it is handed, its `send()`), not on a CPU: at
    16 and 64 streams the 8 stubs of the H200 host kept ~2.3-2.7 cores busy (benchmarks/RESULTS.md, twenty-first
    session), so instances, not cores, set how many responses a second the ensemble answers. 1 on small boxes (2 cores
    here), 1 per 4 CPUs up to 4 below 16 CPUs (not measured there), 16 on 16 or more: on the H200 host
    (16 cores) 16 instances answered 10.7k responses/s at 16 streams (1.29 tokens a response) and 11.3k at
    64, against 8.8-9.6k (1.28-1.43) and 8.3-9.2k with 8 in the same call (twenty-sixth session); 8 against
    2 and 4: seventeenth session."""
    cpus = cpus or os.cpu_count() or 1
    return 16 if cpus >= 16 else max(1, min(4, cpus // 4))


def default_freetoken_instances(cpus: int | None = None, engine_process: bool = True) -> int:
    """`freetoken` instances for this host. Each is a stub process whose sends are serialized (one
    `send()` is an IPC round trip to a server thread, ~2.8k responses/s a stub), and they share one engine
    process: on the H200 host (16 cores) six instances with 8 detokenizers answered 10.5-10.8k responses/s at
    64 streams, four 7.3k (8.8k with 6 detokenizers), two 5.9k, at the same or higher tok/s (seventeenth
    session). Eight since the twenty-eighth session: with 16 detokenizers and 2 send threads each
    (`sender_threads` auto) they answered 11.2-11.5k responses/s at 64 streams where six of one thread answered
    7.1k, at equal or higher tok/s (benchmarks/RESULTS.md). One on smaller hosts (not measured there), and one
    when the engine runs in the model's process (engine_process=0 cannot share)."""
    cpus = cpus or os.cpu_count() or 1
    return 8 if engine_process and cpus >= 16 else 1
