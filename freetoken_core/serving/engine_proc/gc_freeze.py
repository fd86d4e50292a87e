"""Keep Python's full garbage collections off the served path (what vLLM's `freeze_gc_heap` and SGLang's
`freeze_gc` do).

Every served process (the engine process, the `freetoken`, tokenizer and detokenizer stubs) ends its start-up with
~300k objects the cyclic collector tracks (torch, transformers, the model's modules); a full (generation 2)
collection walks all of them while the process's threads wait: 143-153 ms in a process holding the SmolLM2 engine
(313k objects) on the 2-core CPU box (benchmarks/RESULTS.md, thirty-first session). What is alive when start-up
ends lives as long as the process, so it moves to the permanent generation (`gc.freeze`) then, after one
collection that clears start-up's garbage; later full collections walk only what the process made since (~0 ms
there). Reference counting frees everything as before: freezing only stops the collector walking those objects.

`gc_freeze` (a serving parameter of the `freetoken` model, `FREETOKEN_GC_FREEZE`; `serve` copies it to the text
models): 1 (the default) freezes, 0 leaves the collector as Python sets it.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Mapping

from freetoken_core.serving.config import serving_config
from freetoken_core.serving.params import parse_model_config_params
from freetoken_core.serving.report import configure_logging

log = logging.getLogger(__name__)


def freeze_startup_heap(where: str) -> int:
    """Collect once, then move every tracked object to the permanent generation; returns how many were moved."""
    t0 = time.perf_counter()
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    log.info("%s: %d objects kept out of garbage collection from now on (gc.freeze, %.0f ms)", where, frozen,
             1e3 * (time.perf_counter() - t0))
    return frozen


def freeze_text_model(args: Mapping[str, Any], where: str) -> None:
    """A text model's initialize(), once its tokenizer is loaded: freeze unless its config says gc_freeze=0 (and
    log it as the freetoken model logs, so that the server's log shows every process's line)."""
    configure_logging()
    if serving_config(parse_model_config_params(args["model_config"]), os.environ).gc_freeze:
        freeze_startup_heap(where)
