"""Where the host's CPU goes while a served benchmark runs (issue 13): CPU time per process group between two
snapshots of /proc, and how busy the whole host was.

    python benchmarks/cpu_usage.py snapshot A.json      # before a perf_analyzer run
    python benchmarks/cpu_usage.py snapshot B.json      # after it
    python benchmarks/cpu_usage.py diff A.json B.json   # one line: cores used per group, host busy %

Groups: `tritonserver` (the server's own threads: gRPC, ensemble, backends' C++ side), one per Python-backend
stub kind (`stub:freetoken`, `stub:detokenizer`, `stub:tokenizer`, summed over instances, with the count),
`engine` (the engine process: a multiprocessing spawn child), `perf_analyzer`, and `other`. Linux only.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

_STUB_MODEL = re.compile(r"/(tokenizer|detokenizer|freetoken)/1/model\.py")


def _group(cmdline: str, comm: str) -> str | None:
    if "multiprocessing.spawn" in cmdline:  # before the stub test: a stub's child may run its executable
        return "engine"
    if "triton_python_backend_stub" in cmdline:
        m = _STUB_MODEL.search(cmdline)
        return f"stub:{m.group(1) if m else '?'}"
    if comm == "tritonserver" or cmdline.split(" ", 1)[0].endswith("tritonserver"):
        return "tritonserver"
    if comm.startswith("perf_analyzer"):
        return "perf_analyzer"
    return None


def snapshot() -> dict:
    """{"t": wall seconds, "host": [busy, total] jiffies, "procs": {pid: [group, utime + stime ticks]}}."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle + iowait
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        group = _group(cmdline, comm)
        if group is None:
            group = "other"
        fields = stat[stat.rindex(")") + 2:].split()
        procs[pid] = [group, int(fields[11]) + int(fields[12])]  # utime, stime (fields 14, 15 of stat)
    return {"t": time.time(), "host": [sum(cpu) - idle, sum(cpu)], "procs": procs}


def diff(a: dict, b: dict) -> str:
    hz = os.sysconf("SC_CLK_TCK")
    dt = b["t"] - a["t"]
    cores: dict[str, float] = {}
    counts: dict[str, int] = {}
    for pid, (group, ticks) in b["procs"].items():
        before = a["procs"].get(pid, [group, 0])[1]  # a process started in between: all of its time
        cores[group] = cores.get(group, 0.0) + (ticks - before) / hz / dt
        counts[group] = counts.get(group, 0) + (ticks > before)
    busy = (b["host"][0] - a["host"][0]) / max(b["host"][1] - a["host"][1], 1)
    parts = [f"{g} {c:.2f}" + (f" ({counts[g]})" if g.startswith("stub:") else "")
             for g, c in sorted(cores.items(), key=lambda kv: -kv[1]) if c >= 0.01]
    return f"cpu over {dt:.1f} s: host {busy:.0%} of {os.cpu_count()} cpus busy; cores: " + ", ".join(parts)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "snapshot":
        with open(argv[1], "w") as f:
            json.dump(snapshot(), f)
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        with open(argv[1]) as f, open(argv[2]) as g:
            print(diff(json.load(f), json.load(g)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
