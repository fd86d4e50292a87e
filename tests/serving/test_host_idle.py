"""benchmarks/host_idle.py: what a benchmark host says about its CPU idle states, and the PM QoS hold (written as the
kernel reads it: one native int, kept open until the holder is told to stop)."""

from __future__ import annotations

import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmark_scripts import BENCHMARKS, load_benchmark


def _state(cpuidle: Path, index: int, name: str, latency: int, disabled: bool = False) -> None:
    d = cpuidle / f"state{index}"
    d.mkdir(parents=True)
    (d / "name").write_text(f"{name}\n")
    (d / "latency").write_text(f"{latency}\n")
    (d / "disable").write_text("1\n" if disabled else "0\n")


def test_info_lists_states_in_kernel_order_and_whether_the_limit_can_be_held(tmp_path):
    mod = load_benchmark("host_idle")
    root = tmp_path / "cpu"
    cpuidle = root / "cpu0" / "cpuidle"
    for i, (name, lat) in enumerate([("POLL", 0), ("C1", 2), ("C1E", 10), ("C6", 133)]):
        _state(cpuidle, i, name, lat, disabled=name == "C1E")
    _state(cpuidle, 10, "C10", 300)  # state10 sorts after state4, not after state1
    (root / "cpuidle").mkdir()
    (root / "cpuidle" / "current_driver").write_text("intel_idle\n")
    (root / "cpuidle" / "current_governor").write_text("menu\n")
    qos = tmp_path / "qos"
    line = mod.info(root, qos)
    assert line == ("cpu idle: driver intel_idle, governor menu; states: POLL 0 us, C1 2 us, C1E 10 us (off), "
                    f"C6 133 us, C10 300 us; {qos}: not writable")
    qos.write_bytes(b"")
    assert mod.info(root, qos).endswith(f"{qos}: writable")
    assert "states: none listed" in mod.info(tmp_path / "nothing", qos)


def test_hold_writes_the_limit_and_stops_on_sigterm(tmp_path):
    qos = tmp_path / "qos"
    qos.write_bytes(b"")
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "host_idle.py"), "hold", "7", "--path", str(qos)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith(f"host_idle: holding {qos} at 7 us")
        assert struct.unpack("i", qos.read_bytes()) == (7,)
        time.sleep(0.1)
        assert proc.poll() is None  # still holding
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_hold_says_why_when_the_host_does_not_allow_it(tmp_path):
    out = subprocess.run([sys.executable, str(BENCHMARKS / "host_idle.py"), "hold", "0", "--path",
                          str(tmp_path / "missing" / "qos")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "cannot hold" in out.stdout
