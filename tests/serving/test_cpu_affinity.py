"""engine_cpus (serving/engine_proc/cpu_affinity.py): the engine process on CPUs of its own, the rest of the server on the
others. The engine process's side is tested with a real child in test_engine_process.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from freetoken_core.serving.engine_proc.cpu_affinity import (
    engine_cpus_of_model, format_cpu_list, keep_off, parse_cpu_list, pin_this_process, resolve_engine_cpus,
)
from freetoken_core.serving.launch.server import chain_preexec
from freetoken_core.serving.launch.repository import get_parameter, render_repository

HOST16 = frozenset(range(16))


def pairs(cpu: int) -> frozenset[int]:
    """A 16-CPU host of 8 cores, hyperthreads numbered as Linux does on most Intel parts: i and i + 8."""
    return frozenset({cpu % 8, cpu % 8 + 8})


def test_cpu_lists_parse_as_taskset_writes_them():
    assert parse_cpu_list("15") == {15}
    assert parse_cpu_list(" 0-2, 5 ") == {0, 1, 2, 5}
    assert format_cpu_list(parse_cpu_list("7,3-4")) == "3,4,7"
    for bad in ("a", "3-1", "-1", "1,,2", ""):
        with pytest.raises(ValueError, match="engine_cpus"):
            parse_cpu_list(bad)


def test_auto_takes_the_last_whole_core_per_rank_on_a_big_enough_host():
    assert resolve_engine_cpus("auto", 1, HOST16, pairs) == {7, 15}
    assert resolve_engine_cpus("AUTO", 2, HOST16, pairs) == {6, 7, 14, 15}
    assert resolve_engine_cpus("auto", 1, HOST16, lambda c: frozenset({c})) == {15}  # no hyperthreads
    assert resolve_engine_cpus("auto", 1, frozenset(range(7)), pairs) == frozenset()  # too few CPUs: off
    for off in ("", "off", " none "):
        assert resolve_engine_cpus(off, 1, HOST16, pairs) == frozenset()


def test_auto_sets_apart_at_most_a_quarter_of_the_cpus_and_never_fails():
    """auto is the default: it must never fail a load, so where its cores would take more than a quarter of the
    CPUs (tensor parallelism on a small host) it is off, where a list would be refused."""
    assert resolve_engine_cpus("auto", 2, HOST16, pairs) == {6, 7, 14, 15}  # 4 of 16
    assert resolve_engine_cpus("auto", 3, HOST16, pairs) == frozenset()  # 6 of 16
    assert resolve_engine_cpus("auto", 8, HOST16, pairs) == frozenset()  # every CPU: a list would raise
    assert resolve_engine_cpus("auto", 3, frozenset(range(24)), lambda c: frozenset({c})) == {21, 22, 23}
    quads = lambda c: frozenset({c % 4, c % 4 + 4})  # noqa: E731  (an 8-CPU host of 4 cores)
    assert resolve_engine_cpus("auto", 1, frozenset(range(8)), quads) == {3, 7}  # 2 of 8: a quarter exactly
    assert resolve_engine_cpus("auto", 2, frozenset(range(8)), quads) == frozenset()


def test_a_cpu_list_must_leave_the_server_a_cpu_and_name_only_usable_ones():
    assert resolve_engine_cpus("14-15", 1, HOST16) == {14, 15}
    with pytest.raises(ValueError, match="CPU.s. 16,17 are not among the CPUs this server may use"):
        resolve_engine_cpus("15-17", 1, HOST16)
    with pytest.raises(ValueError, match="leaves no CPU for the rest of the server"):
        resolve_engine_cpus("0-15", 1, HOST16)


def test_the_model_takes_the_written_list_as_is_and_resolves_auto_itself():
    assert engine_cpus_of_model("3,5") == {3, 5}  # serve checked it; the server itself runs off these CPUs
    assert engine_cpus_of_model("") == frozenset()
    mine = frozenset(os.sched_getaffinity(0))
    assert engine_cpus_of_model("auto") == resolve_engine_cpus("auto", 1, mine)


def test_without_an_engine_process_auto_is_off_and_a_list_is_refused():
    assert engine_cpus_of_model("auto", 1, engine_process=False) == frozenset()
    assert engine_cpus_of_model("off", 1, engine_process=False) == frozenset()
    with pytest.raises(ValueError, match="engine_cpus=3 pins the engine process: it needs engine_process=1"):
        engine_cpus_of_model("3", 1, engine_process=False)


def test_auto_is_the_default():
    from freetoken_core.serving.launch.repository import source_repository
    from freetoken_core.serving.config import ServingConfig

    assert ServingConfig().engine_cpus == "auto"
    assert get_parameter((source_repository() / "freetoken" / "config.pbtxt").read_text(), "engine_cpus") == "auto"


def test_a_cpu_the_host_lacks_fails_with_its_name():
    with pytest.raises(ValueError, match="engine_cpus=4096: this host cannot run the engine there"):
        pin_this_process(frozenset({4096}))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_server_process_starts_off_the_engines_cpus():
    engine = frozenset({max(os.sched_getaffinity(0))})
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         preexec_fn=chain_preexec(keep_off(engine)),
                         capture_output=True, text=True, check=True).stdout
    assert eval(out) == sorted(frozenset(os.sched_getaffinity(0)) - engine)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_serve_writes_the_engines_cpus_into_the_repository(tmp_path):
    last = max(os.sched_getaffinity(0))
    cfg = tmp_path / "repo" / "freetoken" / "config.pbtxt"
    render_repository(tmp_path / "repo", {"model_path": "/models/m", "engine_cpus": f"{last}"}, environ={})
    assert get_parameter(cfg.read_text(), "engine_cpus") == str(last)
    # auto on a host under AUTO_MIN_CPUS: off, written as such
    render_repository(tmp_path / "repo", {"model_path": "/models/m"}, environ={"FREETOKEN_ENGINE_CPUS": "auto"})
    expected = format_cpu_list(resolve_engine_cpus("auto", 1))
    assert get_parameter(cfg.read_text(), "engine_cpus") == expected
    with pytest.raises(ValueError, match="not among the CPUs this server may use"):
        render_repository(tmp_path / "repo", {"model_path": "/models/m", "engine_cpus": "4096"}, environ={})
    # the default (auto) without an engine process: off, written as such; a list there is refused at once
    render_repository(tmp_path / "repo", {"model_path": "/models/m", "engine_process": "0"}, environ={})
    assert get_parameter(cfg.read_text(), "engine_cpus") == ""
    with pytest.raises(ValueError, match="needs engine_process=1"):
        render_repository(tmp_path / "repo", {"model_path": "/models/m", "engine_process": "0",
                                              "engine_cpus": f"{last}"}, environ={})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_start_server_keeps_the_server_off_the_engines_cpus(tmp_path, monkeypatch):
    """start_server hands spawn_tritonserver the CPUs serve wrote for the engine (its Popen runs keep_off)."""
    from freetoken_core.serving.launch import server as launcher

    seen = {}

    class Stop(Exception):
        pass

    def fake_spawn(repo_dir, *args, cpus_off=frozenset(), **kw):
        seen["cpus_off"] = cpus_off
        raise Stop

    monkeypatch.setattr(launcher, "spawn_tritonserver", fake_spawn)
    last = max(os.sched_getaffinity(0))
    with pytest.raises(Stop):
        launcher.start_server({"model_path": "/models/m", "engine_cpus": str(last)}, repo_dir=tmp_path / "repo")
    assert seen["cpus_off"] == {last}
    with pytest.raises(Stop):
        launcher.start_server({"model_path": "/models/m"}, repo_dir=tmp_path / "repo")
    assert seen["cpus_off"] == frozenset()
