"""The host's CPU idle states, and a way to keep CPUs out of the deep ones while a benchmark runs (issue 13).

Why: one stream's served request crosses ~10 thread and process hand-offs (benchmarks/wake_latency.py), and on the
H200 host a woken thread took 50-110 us at the median, more than a warm core needs. A core in a deep idle state
(C6 and the like) takes tens of microseconds to come back. Linux's PM QoS interface, /dev/cpu_dma_latency, keeps
every CPU out of the states whose exit latency exceeds the value written, for as long as the writer keeps the file
open (what tuned's latency-performance profile does). It is host tuning that a deployer chooses, not something
`serve` does: this script only tells whether a benchmark host has those states and, asked, holds the limit for a
run, so that a served run can be compared with and without it. The H200 hosts lent to this project (twenty-seventh
session) have no cpuidle driver (the guest halts to its hypervisor) and holding the limit at 0 moved no hand-off
beyond the noise (benchmarks/RESULTS.md): their wake-ups are the hypervisor's, not C-state exits.

  python3 benchmarks/host_idle.py info            # one line: the idle driver, governor, states, whether it can hold
  python3 benchmarks/host_idle.py hold US         # hold the limit at US microseconds until killed (SIGTERM)
"""

from __future__ import annotations

import argparse
import os
import signal
import struct
import sys
from pathlib import Path

CPUIDLE = Path("/sys/devices/system/cpu")
PM_QOS = Path("/dev/cpu_dma_latency")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def idle_states(cpu_dir: Path = CPUIDLE / "cpu0" / "cpuidle") -> list[tuple[str, str, str]]:
    """(name, exit latency in us, disabled flag) of each idle state of one CPU, in the kernel's order."""
    states = sorted(cpu_dir.glob("state*"), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else 0)
    return [(_read(s / "name"), _read(s / "latency"), _read(s / "disable")) for s in states]


def info(root: Path = CPUIDLE, qos: Path = PM_QOS) -> str:
    states = idle_states(root / "cpu0" / "cpuidle")
    text = ", ".join(f"{name} {lat} us{' (off)' if off == '1' else ''}" for name, lat, off in states) or "none listed"
    can_hold = "writable" if os.access(qos, os.W_OK) else "not writable"
    governor = _read(root / "cpuidle" / "current_governor_ro")
    if governor == "?":  # kernels with a governor that can be switched name it here
        governor = _read(root / "cpuidle" / "current_governor")
    return (f"cpu idle: driver {_read(root / 'cpuidle' / 'current_driver')}, governor {governor}; "
            f"states: {text}; {qos}: {can_hold}")


def hold(latency_us: int, qos: Path = PM_QOS) -> int:
    """Write the limit and keep the file open until SIGTERM/SIGINT (the kernel drops the limit when it closes)."""
    try:
        fd = os.open(qos, os.O_WRONLY)
        os.write(fd, struct.pack("i", latency_us))
    except OSError as e:
        print(f"host_idle: cannot hold {qos} at {latency_us} us: {e}", flush=True)
        return 1
    print(f"host_idle: holding {qos} at {latency_us} us (pid {os.getpid()})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        os.close(fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info")
    h = sub.add_parser("hold")
    h.add_argument("latency_us", type=int)
    h.add_argument("--path", type=Path, default=PM_QOS, help=argparse.SUPPRESS)  # tests: a plain file
    args = ap.parse_args(argv)
    if args.cmd == "info":
        print(info())
        return 0
    if args.latency_us < 0:
        ap.error(f"latency_us must be >= 0, got {args.latency_us}")
    return hold(args.latency_us, args.path)


if __name__ == "__main__":
    sys.exit(main())
