"""Where a decode step's time goes on the GPU: step time and a kernel table.

    python benchmarks/dev/profile_decode.py [--shape llama-3-8b] [--bs 1] [--prompt 128]

Prints the step time with CUDA graphs and the kernels of the captured steps grouped by name with
their summed device time (torch.profiler), so "step time - kernel time" is what launch gaps and
tails cost; then the same eagerly. benchmarks/dev/bench_gemv.py measures the linear layers alone.
"""

from __future__ import annotations

import sys
import argparse
import collections
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared bench_decode / bench_spec helpers
from bench_decode import SHAPES, copy_bandwidth, write_shape  # noqa: E402
from freetoken_core.config import EngineConfig, SamplingParams  # noqa: E402
from freetoken_core.scheduler.scheduler import Scheduler  # noqa: E402


def make_sched(model_dir: Path, graphs: bool, bs: int, page_size: int = 16, max_seq_len: int = 2048,
               memory_fraction: float = 0.5) -> Scheduler:
    return Scheduler(EngineConfig(model_path=str(model_dir), dtype="bfloat16", device="cuda",
                                  attention_backend="triton", max_running_req=max(bs, 1), page_size=page_size,
                                  max_seq_len=max_seq_len, load_format="dummy", memory_fraction=memory_fraction,
                                  cuda_graph=graphs))


def start(sched: Scheduler, bs: int, prompt: int, out: int) -> None:
    for i in range(bs):
        ids = torch.randint(10, 1000, (prompt,), generator=torch.Generator().manual_seed(i)).tolist()
        sched.add_request(ids, SamplingParams(max_tokens=out, ignore_eos=True))
    while any(r.cached_len < r.prompt_len for r in sched.running) or sched.waiting:
        sched.step()


def step_ms(sched: Scheduler, bs: int, prompt: int, steps: int = 200) -> float:
    start(sched, bs, prompt, steps + 8)
    for _ in range(4):
        sched.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    while sched.has_work():
        sched.step()
    return ms


def kernel_table(sched: Scheduler, bs: int, prompt: int, steps: int = 10) -> None:
    start(sched, bs, prompt, steps + 20)
    for _ in range(4):
        sched.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
    while sched.has_work():
        sched.step()
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            per[name][0] += 1
            per[name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    total = sum(v[1] for v in per.values()) / steps
    print(f"kernels per step {sum(v[0] for v in per.values()) / steps:.0f}, kernel time per step {total / 1e3:.3f} ms")
    print("| kernel | per step | us per step | share |")
    print("|---|---|---|---|")
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {name} | {n / steps:.0f} | {us / steps:.1f} | {100 * us / steps / total:.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# {args.shape} bs {args.bs} prompt {args.prompt}; copy bw {bw / 1e12:.2f} TB/s")
    with tempfile.TemporaryDirectory() as tmp:
        d = write_shape(args.shape, Path(tmp))
        sched = make_sched(d, True, args.bs)
        print(f"graph step: {step_ms(sched, args.bs, args.prompt):.3f} ms")
        kernel_table(sched, args.bs, args.prompt)
        del sched
        torch.cuda.empty_cache()
        sched = make_sched(d, False, args.bs)
        print(f"eager step: {step_ms(sched, args.bs, args.prompt, 50):.3f} ms")
        print("eager kernels:")
        kernel_table(sched, args.bs, args.prompt)
        del sched
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
