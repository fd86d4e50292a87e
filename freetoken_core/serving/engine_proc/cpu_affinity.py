"""CPUs of its own for the engine process (serving parameter `engine_cpus`; "auto" by default).

Why: at many streams the served path (Triton's threads, the `freetoken` and detokenizer stubs, the client when it
shares the host) keeps most of a host's CPUs busy, and the engine process's main thread, which schedules and
launches every step, then waits for a CPU like any other thread; for a small model its step rate is its CPU time.
With `engine_cpus` set, `freetoken-core serve` starts tritonserver (and so every stub) on the host's other CPUs
and the engine process moves itself onto these, so nothing else of the server runs there.

Values: "" (off), a CPU list in taskset's syntax ("15", "14-15", "3,7"), or "auto" (the default): the last physical
core of the CPUs the launcher may use (with its hyperthread siblings), one per tensor-parallel rank, on a host with
at least AUTO_MIN_CPUS of them and only while that sets apart at most 1/AUTO_MAX_SHARE of them (else off: auto never
fails a load). `serve` resolves "auto" into the list it writes into config.pbtxt, so the engine and the server's
mask agree; a repository served by a plain `tritonserver` only pins the engine process; without an engine process
(engine_process=0) auto is off.

Measured on the H200 host (16 CPUs; SmolLM2 shape, ensemble, perf_analyzer gRPC streaming, two A/B pairs,
benchmarks/RESULTS.md twenty-first session): 64 streams +15% and +17% tok/s, 16 streams +3% and +0%, one stream
the same within 1.4%.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTO_MIN_CPUS = 8  # fewer: a CPU set apart costs the rest of the server too much
AUTO_MAX_SHARE = 4  # auto sets apart at most a quarter of the CPUs (tensor parallelism on a small host: off)
OFF_VALUES = ("", "off", "none")
_SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpu_list(text: str) -> frozenset[int]:
    """taskset's list syntax: "3", "0-2,5" -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"engine_cpus: {text!r} is not a CPU list (e.g. 15, 14-15 or 3,7)") from None
        if first < 0 or last < first:
            raise ValueError(f"engine_cpus: {part!r} in {text!r} is not a CPU range (first-last, first <= last)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def thread_siblings(cpu: int) -> frozenset[int]:
    """The CPUs of `cpu`'s physical core (itself alone where the kernel does not say)."""
    try:
        return parse_cpu_list((_SYS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
    except (OSError, ValueError):
        return frozenset({cpu})


def resolve_engine_cpus(spec: str, ranks: int = 1, allowed: frozenset[int] | None = None,
                        siblings=thread_siblings) -> frozenset[int]:
    """The engine's CPUs for a value of `engine_cpus` (empty = off), checked against `allowed` (default: the
    CPUs this process may run on, which the rest of the server keeps)."""
    spec = spec.strip().lower()
    if spec in OFF_VALUES:
        return frozenset()
    allowed = frozenset(os.sched_getaffinity(0)) if allowed is None else allowed
    if spec == "auto":
        if len(allowed) < AUTO_MIN_CPUS:
            return frozenset()
        chosen: set[int] = set()
        cores = 0
        for cpu in sorted(allowed, reverse=True):
            if cores == ranks:
                break
            if cpu not in chosen:
                chosen |= siblings(cpu) & allowed
                cores += 1
        if len(chosen) * AUTO_MAX_SHARE > len(allowed):
            return frozenset()
        cpus = frozenset(chosen)
    else:
        cpus = parse_cpu_list(spec)
        if not cpus <= allowed:
            raise ValueError(f"engine_cpus={spec}: CPU(s) {format_cpu_list(cpus - allowed)} are not among the CPUs "
                             f"this server may use ({format_cpu_list(allowed)})")
    if not allowed - cpus:
        raise ValueError(f"engine_cpus={spec} leaves no CPU for the rest of the server (it may use "
                         f"{format_cpu_list(allowed)})")
    return cpus


def engine_cpus_of_model(spec: str, ranks: int = 1, engine_process: bool = True) -> frozenset[int]:
    """In the `freetoken` model: the list `serve` wrote (it checked it, and runs the server on the other CPUs), or,
    under a plain tritonserver, "auto" resolved here (off without an engine process: there is nothing of the engine's
    own to move). A list naming CPUs the host lacks fails in the engine process (`pin_this_process`), which fails
    the model's load with that message; a list without an engine process fails here."""
    spec = spec.strip().lower()
    if spec == "auto":
        return resolve_engine_cpus(spec, ranks) if engine_process else frozenset()
    cpus = frozenset() if spec in OFF_VALUES else parse_cpu_list(spec)
    if cpus and not engine_process:
        raise ValueError(f"engine_cpus={spec} pins the engine process: it needs engine_process=1 (or engine_cpus=off)")
    return cpus


def pin_this_process(cpus: frozenset[int]) -> None:
    """Move the calling process (its threads to come too) onto `cpus`: the engine process, first thing."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise ValueError(f"engine_cpus={format_cpu_list(cpus)}: this host cannot run the engine there ({e})") from None


def keep_off(cpus: frozenset[int]):
    """A Popen preexec step: the child (tritonserver, and so every stub) runs on the CPUs other than `cpus`."""
    rest = frozenset(os.sched_getaffinity(0)) - cpus

    def preexec() -> None:
        os.sched_setaffinity(0, rest)

    return preexec
