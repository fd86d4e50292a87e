"""gc_freeze (serving/engine_proc/gc_freeze.py): each served process moves its start-up heap out of the cyclic garbage
collector's way once start-up ends, so a full collection on the served path no longer walks it."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest

from freetoken_core.serving.config import serving_config
from freetoken_core.serving.engine_proc.gc_freeze import freeze_startup_heap, freeze_text_model
from freetoken_core.serving.launch.repository import get_parameter, render_repository


@pytest.fixture
def unfrozen():
    """Whatever a test froze goes back to the collector (the rest of the session runs as before)."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freeze_moves_what_is_alive_out_of_the_collector_and_collects_start_up_garbage_first(unfrozen):
    class Node:
        pass

    kept = [[i] for i in range(20_000)]  # lists: always tracked by the collector
    cycle = Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle  # start-up garbage in a reference cycle: collected before the freeze, not frozen for good
    moved = freeze_startup_heap("test")
    assert gone() is None
    assert moved >= len(kept) and gc.get_freeze_count() == moved
    tracked = gc.get_objects()  # what a full collection walks now: only what came after the freeze
    assert len(tracked) < len(kept) and not any(o is kept[0] for o in tracked)
    made_after = [[j] for j in range(100)]
    assert any(o is made_after[0] for o in gc.get_objects())


def test_text_models_freeze_unless_their_config_says_0(unfrozen):
    def args(value: str | None) -> dict:
        params = {} if value is None else {"gc_freeze": {"string_value": value}}
        return {"model_config": json.dumps({"parameters": params})}

    freeze_text_model(args("0"), "detokenizer")
    assert gc.get_freeze_count() == 0
    freeze_text_model(args(None), "detokenizer")  # an older config without the parameter: the default
    assert gc.get_freeze_count() > 0


def test_gc_freeze_parameter_values():
    def gc_freeze_wanted(value: str | None) -> bool:
        return serving_config({} if value is None else {"gc_freeze": value}).gc_freeze

    assert [gc_freeze_wanted(v) for v in (None, "", "1", "1.0", "on", "0", "0.0", "off")] == [True] * 5 + [False] * 3
    with pytest.raises(ValueError, match="gc_freeze"):
        gc_freeze_wanted("2")


def test_serve_copies_gc_freeze_to_the_text_models(tmp_path: Path):
    for environ, want in (({}, "1"), ({"FREETOKEN_GC_FREEZE": "0"}, "0")):
        repo = render_repository(tmp_path / want, {"model_path": "/m"}, environ)
        for model in ("freetoken", "tokenizer", "detokenizer"):
            assert get_parameter((repo / model / "config.pbtxt").read_text(), "gc_freeze") == want, model


@pytest.mark.serving
def test_every_served_process_froze_its_start_up_heap(triton_server):
    """The session server (engine process, one `freetoken` instance, tokenizer and detokenizer) logged one freeze
    each, after its start-up."""
    log = triton_server.log_path.read_text(errors="replace")
    for where in ("engine process", "freetoken instance", "tokenizer", "detokenizer"):
        lines = [x for x in log.splitlines() if f"{where}: " in x and "objects kept out of garbage collection" in x]
        assert lines, f"no gc.freeze line from the {where}"
        assert int(lines[0].split(f"{where}: ", 1)[1].split()[0]) > 10_000, lines[0]
