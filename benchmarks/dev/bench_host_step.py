"""Host time of a decode step outside the model's forward: what the scheduler and engine spend in Python.

    python benchmarks/dev/bench_host_step.py [--bs 16,64] [--steps 300]

On the GPU a small model's decode step replays a CUDA graph in well under the host's own per-step work at
large batches (py-spy of the served engine at 64 streams: 68% of its time in Scheduler.step, 9% waiting
for the device), so this host time sets the step rate there. It runs here on the CPU with a one-layer
model of hidden size 32 (its forward is timed and taken out), so it is measurable on any machine. Prints
the median ms per step: whole step, the forward, and the rest (the median of each step's difference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.conftest's tiny model

from freetoken_core.config import EngineConfig, SamplingParams  # noqa: E402
from freetoken_core.scheduler.scheduler import Scheduler  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402


def host_ms(path: Path, bs: int, steps: int) -> tuple[float, float, float]:
    sched = Scheduler(EngineConfig(model_path=str(path), dtype="float32", max_running_req=bs, page_size=16,
                                   num_pages=4000, attention_backend="torch"))
    params = SamplingParams(max_tokens=steps + 20, ignore_eos=True)
    for i in range(bs):
        sched.add_request([1 + i % 50] * 128, params)
    for _ in range(5):
        sched.step()
    engine = sched.engine
    forward = engine.forward_batch
    fwd: list[float] = []

    def timed(batch, **kw):
        t = time.perf_counter()
        out = forward(batch, **kw)
        fwd.append(time.perf_counter() - t)
        return out

    engine.forward_batch = timed
    total = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step()
        total.append(time.perf_counter() - t0)
    assert len(fwd) == len(total), "one forward per decode step"
    host = [t - f for t, f in zip(total, fwd)]  # per step: robust to the forward's own noise
    return 1e3 * statistics.median(total), 1e3 * statistics.median(fwd), 1e3 * statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", default="16,64")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp), arch="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                               max_position_embeddings=1024)
        print("| batch | step ms | forward ms | host outside the forward ms |\n|---|---|---|---|")
        for bs in (int(b) for b in args.bs.split(",")):
            step, f, host = host_ms(path, bs, args.steps)
            print(f"| {bs} | {step:.3f} | {f:.3f} | {host:.3f} |", flush=True)


if __name__ == "__main__":
    main()
