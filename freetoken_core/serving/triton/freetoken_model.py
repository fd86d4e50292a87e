"""The `freetoken` Triton model's body: engine setup, request intake, Triton transport.

model_repository/freetoken/1/model.py only forwards to this class; `pb_utils` is passed in
because it exists only inside the Python-backend stub.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from freetoken_core.serving.engine_proc.cpu_affinity import engine_cpus_of_model
from freetoken_core.serving.triton.ensemble_secret import is_ensemble_key, route_tag
from freetoken_core.serving.config import ServingConfig, inflight_budget, sender_threads, serving_config
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop
from freetoken_core.serving.engine_proc.loop_options import LoopOptions
from freetoken_core.serving.engine_proc.faults import InjectedFault, install_fault_hook, parse_fault_specs
from freetoken_core.serving.engine_proc.gc_freeze import freeze_startup_heap
from freetoken_core.lifetime import kill_children, watch_parent
from freetoken_core.serving.triton.metrics import TritonMetrics
from freetoken_core.serving.params import engine_config_from_params, parse_model_config_params
from freetoken_core.serving.report import configure_logging
from freetoken_core.serving.triton.request import _scalar, _text, parse_request
from freetoken_core.serving.triton.triton_io import input_arrays
from freetoken_core.tokenizer.tokenize import config_vocab_size

log = logging.getLogger("freetoken_core.serving")

INPUT_NAMES = (
    "input_ids", "max_tokens", "stream", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "random_seed",
    "min_tokens", "min_length", "ignore_eos", "beam_width", "stop_words", "stop_token_ids", "bad_words",
    "exclude_input_in_output", "return_logprobs", "num_top_logprobs", "return_num_input_tokens",
    "return_num_output_tokens", "return_num_cached_tokens",
    "return_finish_reason", "sampling_parameters", "text_input", "ensemble_key", "detok_acks",
)


_DECOUPLED = re.compile(r"decoupled\s*:\s*true")  # in a config.pbtxt's model_transaction_policy


def _detokenizer_config(model_dir: str) -> tuple[Path, str | None]:
    """The ensemble's detokenizer config next to this model: its path and its text without comments (None: no
    such file)."""
    cfg = Path(model_dir).parent / "detokenizer" / "config.pbtxt"
    if not model_dir or not cfg.is_file():
        return cfg, None
    return cfg, re.sub(r"#[^\n]*", "", cfg.read_text())


def detokenizer_decoupled(model_dir: str) -> bool | None:
    """Whether the ensemble's detokenizer next to this model is decoupled (None: no config there)."""
    _, text = _detokenizer_config(model_dir)
    return None if text is None else bool(_DECOUPLED.search(text))


def check_detokenizer_decoupled(model_dir: str) -> None:
    """Probes (nonstream_cancel_probe_ms > 0) are invisible only to a decoupled detokenizer, which can
    complete one with the FINAL flag alone; a plain one would answer each probe, and every client
    would get extra responses. Refuse to start instead."""
    cfg, text = _detokenizer_config(model_dir)
    if text is None:
        log.warning("nonstream_cancel_probe_ms is set but %s is missing: make sure the ensemble's "
                    "detokenizer is decoupled", cfg)
    elif not _DECOUPLED.search(text):
        raise ValueError(
            f"nonstream_cancel_probe_ms > 0 needs a decoupled detokenizer, but {cfg} is not: add "
            "`model_transaction_policy { decoupled: true }` there (`freetoken-core serve` does) or set "
            "nonstream_cancel_probe_ms to 0")


def send_order_enabled(option: bool, model_dir: str) -> bool:
    """detok_send_order as set, except with a plain (not decoupled) detokenizer: that one marks a response
    sent before execute() returns it, so a later response of the stream could overtake it on another
    instance; there a stream keeps one response in flight instead (logged, not refused: the option is on
    by default)."""
    if not option:
        return False
    if detokenizer_decoupled(model_dir) is False:
        log.warning("detok_send_order is on but the ensemble's detokenizer is not decoupled: each stream keeps one "
                    "response in flight instead (add `model_transaction_policy { decoupled: true }` to its "
                    "config.pbtxt, as `freetoken-core serve` does, or set detok_send_order to 0)")
        return False
    return True


def ordered_inflight_budget(budget: int, send_order: bool) -> int:
    """This instance's part of detok_inflight_budget as it applies: 0 without detok_send_order, where a larger
    window could let a stream's responses overtake each other across detokenizer instances (logged; not a warning:
    the budget is on by default, and turning send order off is a choice of its own)."""
    if budget and not send_order:
        log.info("detok_inflight_budget applies only with detok_send_order (and a decoupled detokenizer): off")
        return 0
    return budget


def load_identity(args: dict[str, Any]) -> str:
    """What the instances of one load of this model agree on: name, version and the config file's
    mtime, so that a reload with an edited config (Triton loads the new instances before it unloads the
    old ones) starts an engine of its own instead of joining the old one. A reload of unchanged files
    while loaded would join the old engine: unload, then load (serving/engine_proc/engine_share.py)."""
    repo = args.get("model_repository")
    try:
        stamp = f"-{(Path(repo) / 'config.pbtxt').stat().st_mtime_ns}" if repo else ""
    except OSError:
        stamp = ""
    return f"{args.get('model_name', 'freetoken')}-{args.get('model_version', '1')}{stamp}"


def model_instance_count(model_config: dict[str, Any]) -> int:
    """How many instances Triton starts of this model (the instance groups' counts added up)."""
    groups = model_config.get("instance_group") or [{}]
    return sum(int(g.get("count", 1) or 1) for g in groups)


def detokenizer_instances(model_dir: str) -> int:
    """The instance count in the ensemble's detokenizer config next to this model (0 = unknown)."""
    _, text = _detokenizer_config(model_dir)
    if text is None:
        return 0
    m = re.search(r"instance_group\s*\[\s*\{[^}]*?count\s*:\s*(\d+)", text)
    return int(m.group(1)) if m else 1


def max_inflight(option: int, model_dir: str, send_order: bool = False, budget: int = 0) -> int:
    """detok_max_inflight: as set, or (0 = auto) 1 with detok_send_order and an inflight budget (the budget shared
    by the streams in flight sets the window, at least one a stream: many streams then no longer queue more
    responses than the budget in front of the detokenizers), 4 for a single detokenizer instance or with
    detok_send_order alone (the instances keep each stream in order), else 1."""
    if option != int(option) or option < 0:
        raise ValueError(f"serving parameter detok_max_inflight must be a whole number >= 0, got {option}")
    if option:
        return int(option)
    if send_order and budget > 0:
        return 1
    return 4 if send_order or detokenizer_instances(model_dir) == 1 else 1


def loop_options(config: ServingConfig, model_dir: str, instances: int) -> LoopOptions:
    """The engine loop's settings for this instance: the ServingConfig resolved against the ensemble next to it (is
    its detokenizer decoupled, how many instances) and this host (sender_threads auto)."""
    send_order = send_order_enabled(config.detok_send_order, model_dir)
    budget = ordered_inflight_budget(inflight_budget(config, instances), send_order)
    return LoopOptions(
        cancel_check_interval_s=config.cancel_check_interval_ms / 1000.0,
        metrics_interval_s=config.metrics_interval_ms / 1000.0,
        stream_interval=config.stream_interval,
        nonstream_probe_interval_s=config.nonstream_cancel_probe_ms / 1000.0,
        max_inflight=max_inflight(config.detok_max_inflight, model_dir, send_order, budget),
        inflight_budget=budget,
        sender_threads=sender_threads(config),
        send_order=send_order,
        route_tag=route_tag(),
        max_queued_requests=config.max_queued_requests,
    )


def from_ensemble(tensors: dict[str, np.ndarray]) -> bool:
    """Whether the ensemble's tokenizer step sent this request: its `ensemble_key` is the server's secret. A
    client that sends one is refused, whatever it holds (serving/triton/ensemble_secret.py)."""
    key = tensors.get("ensemble_key")
    if key is None:
        return False
    if not is_ensemble_key(_text(_scalar(key))):
        raise ValueError("ensemble_key is internal to the ensemble: leave it out")
    return True


class TritonTransport:
    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    def send(self, handle: Any, outputs: dict[str, np.ndarray] | None, error: str | None, final: bool) -> None:
        pb = self.pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            handle.send(pb.InferenceResponse(error=pb.TritonError(error)), flags=flags)
        elif outputs is None:
            handle.send(flags=flags)
        else:
            tensors = [pb.Tensor(name, arr) for name, arr in outputs.items()]
            handle.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def is_cancelled(self, handle: Any) -> bool:
        return handle.is_cancelled()


class FreetokenModel:
    def __init__(self, pb_utils: Any, args: dict[str, Any]) -> None:
        configure_logging()
        self.pb = pb_utils
        self.model_name = args.get("model_name", "freetoken")
        self.sched: Any = None
        # a stub outlives a killed tritonserver otherwise, and its engine process with it (serving/lifetime.py)
        watch_parent(f"{self.model_name} stub", on_orphaned=self._end_engine_process)
        model_config = json.loads(args["model_config"])
        params = parse_model_config_params(model_config)
        self.config = serving = serving_config(params, os.environ)  # checked (unknown names too) before the engine
        faults = parse_fault_specs(serving.fault_injection)
        if faults:
            log.warning("TEST ONLY: fault injection is on: %s", faults)
        config = engine_config_from_params(params)
        log.info("starting engine: %s", config)
        log.info("serving: %s", serving)
        instances = model_instance_count(model_config)
        if instances > 1 and not serving.engine_process:
            raise ValueError(f"{self.model_name} has {instances} instances (instance_group count), which share one "
                             "engine process: set engine_process=1, or use one instance")
        engine_cpus = engine_cpus_of_model(serving.engine_cpus, config.tensor_parallel_size,
                                           engine_process=serving.engine_process)
        if serving.engine_process:
            from freetoken_core.serving.engine_proc.engine_process import EngineClient
            from freetoken_core.serving.engine_proc.engine_share import MAX_INSTANCES, EngineRendezvous

            if instances > MAX_INSTANCES:
                raise ValueError(f"{self.model_name} has {instances} instances; one engine serves at most "
                                 f"{MAX_INSTANCES}")
            # several instances (stubs: each sends its own requests' responses) share one engine on the GPU
            share = EngineRendezvous(load_identity(args)) if instances > 1 else None
            # the fault hook goes into the child with the scheduler it wraps
            self.sched = EngineClient(config, [f for f in faults if f.kind != "init"], share=share,
                                      ring_bytes=serving.ring_bytes, ring_poll_s=serving.ring_poll_s,
                                      engine_cpus=engine_cpus, gc_freeze=serving.gc_freeze)
        else:
            from freetoken_core.scheduler.scheduler import Scheduler

            self.sched = Scheduler(config)
            if faults:
                install_fault_hook(self.sched, faults)
        self.max_tokens_limit = serving.max_tokens_limit or None
        self.vocab_size = config_vocab_size(config.model_path) or None  # bounds input_ids, top_k and stop_token_ids
        self.max_nonstream_tokens = serving.max_nonstream_tokens or None
        model_dir = args.get("model_repository", "")
        if serving.nonstream_cancel_probe_ms > 0:
            check_detokenizer_decoupled(model_dir)
        labels = {"model": self.model_name, "version": str(args.get("model_version", "1"))}
        self.loop = EngineLoop(
            self.sched,
            TritonTransport(pb_utils),
            loop_options(serving, model_dir, instances),
            TritonMetrics(pb_utils, labels),
            on_device_fatal=self._unload_self,
        )
        self.loop.start()
        try:
            if any(f.kind == "init" for f in faults):
                raise InjectedFault("injected fault in initialize()")
            stats = self.sched.stats()
        except BaseException:
            # Triton then marks the model not ready (UNAVAILABLE) and logs the traceback; the engine
            # threads must not outlive the failed load
            self.loop.stop(timeout=5.0)
            raise
        log.info("engine ready: %d KV pages of %d tokens", stats.num_total_pages, stats.page_size)
        if serving.gc_freeze:
            freeze_startup_heap(f"{self.model_name} instance")

    def _end_engine_process(self) -> None:
        proc = getattr(self.sched, "_proc", None)
        if proc is not None and proc.pid is not None:
            kill_children([proc.pid])

    def _unload_self(self, reason: str) -> None:
        """The device is unusable: unload this model (and the ensemble that needs it), so its ready
        endpoint says so. Needs explicit model control, which `freetoken-core serve` uses; from a thread
        of its own, because the unload calls finalize(), which joins the engine thread."""
        def unload() -> None:
            try:
                self.pb.unload_model(model_name=self.model_name, unload_dependents=True)
                log.error("unloaded model %s: %s", self.model_name, reason)
            except Exception as e:  # noqa: BLE001 (not in explicit model control mode)
                log.error("could not unload model %s (%s): every request now fails with: %s; restart the "
                          "server (tritonserver --model-control-mode=explicit lets it unload itself)",
                          self.model_name, e, reason)

        threading.Thread(target=unload, name="freetoken-unload", daemon=True).start()

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = input_arrays(pb, request, INPUT_NAMES)
                parsed = parse_request(tensors, self.max_tokens_limit, vocab_size=self.vocab_size,
                                       max_nonstream_tokens=self.max_nonstream_tokens,
                                       parameters=request.parameters(), from_ensemble=from_ensemble(tensors))
            except ValueError as e:
                self.loop.reject(sender, str(e))
                continue
            except Exception as e:  # a malformed tensor must fail only its own request
                log.exception("bad request")
                self.loop.reject(sender, f"invalid request: {type(e).__name__}: {e}")
                continue
            self.loop.submit(sender, parsed)

    def finalize(self) -> None:
        self.loop.stop()
