"""GPU benchmark of MoE expert offload: resident vs offload (the device-side expert cache) at several
cache rates, random weights of a real MoE shape (load_format=dummy).

    python benchmarks/bench_offload.py [--shape qwen3-30b-a3b] [--rates 1.0,0.5,0.25] [--bs 1,8]
                                       [--out-tokens 128] [--prompt 16] [--zipf S] [--layers N]

Per row: decode tok/s and ms per step, TTFT of a `--prompt`-token prompt, the slot hit rate and the
bytes copied host -> device per generated token over the timed decode (device counters read before
and after it), the distinct experts per layer per step (bench_decode.py `expert_usage`), and the
floor of one step: the HBM part as bench_decode.py computes it (dense weights + the distinct
experts + KV, over the device copy bandwidth) plus the step's missed bytes over the host -> device
bandwidth of a pinned copy measured in this run. A batch the slot budget's clamp lowers shows as
"8->4". Per engine: build time, how long its pinned host banks took to build (drawn once per run, on
the GPU, and reused by every offload engine: identical weights for every row), whether decode ran
in CUDA graphs, and which executor placed the experts.

`--zipf S` adds a fixed Zipf popularity per MoE layer to the router: logits + S * -log(rank of the
expert) under a random per-layer ranking (a forward hook on the router module, installed before graph
capture; benchmark only). S = 0 or no flag: the random weights' own routing, which changes little from
step to step (high hit rates). The `routing` column says which one a row used.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import (  # noqa: E402
    SHAPES, copy_bandwidth, expert_usage, moe_blocks, run_decode, weight_bytes_per_step, write_shape,
)

from freetoken_core.config import EngineConfig, SamplingParams  # noqa: E402
from freetoken_core.models import loader  # noqa: E402
from freetoken_core.moe.stats import layer_stats  # noqa: E402
from freetoken_core.scheduler.scheduler import Scheduler  # noqa: E402


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a pinned host -> device copy of 1 GiB."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 5
    for _ in range(n):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    del src, dst
    return nbytes / dt


class DummyWeights:
    """Replaces loader.init_dummy_weights_ for this run: every parameter drawn on the GPU by one
    generator in parameter order (the resident and the offloaded engines get the same weights); host
    parameters (offloaded experts) become pinned host banks, built once and reused by later engines
    (a CPU normal_ of 58 GB would take minutes). Installs the --zipf router hooks before capture."""

    def __init__(self, zipf: float | None) -> None:
        self.zipf = zipf
        self.banks: dict[str, torch.Tensor] = {}
        self.bank_s = 0.0  # seconds the last engine spent building (or reusing) host banks
        self.reused = False

    def __call__(self, model: torch.nn.Module, seed: int = 0) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.bank_s, self.reused = 0.0, bool(self.banks)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                elif p.device.type == "cuda":
                    p.normal_(0.0, 0.02, generator=g)
                else:
                    t0 = time.perf_counter()
                    drawn = torch.empty(p.shape, dtype=p.dtype, device="cuda").normal_(0.0, 0.02, generator=g)
                    bank = self.banks.get(name)
                    if bank is None:
                        bank = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                        bank.copy_(drawn)
                        self.banks[name] = bank
                    p.data = bank
                    del drawn
                    torch.cuda.synchronize()
                    self.bank_s += time.perf_counter() - t0
        if self.zipf:
            add_zipf_bias(model, self.zipf)


def add_zipf_bias(model: torch.nn.Module, s: float, seed: int = 1234) -> None:
    g = torch.Generator().manual_seed(seed)
    for block in moe_blocks(model):
        n = block.experts.num_experts
        rank = torch.randperm(n, generator=g).to(torch.float32) + 1.0  # expert e's popularity rank
        w = block.gate.weight if hasattr(block.gate, "weight") else next(block.gate.parameters())
        bias = (-s * torch.log(rank)).to(device=w.device, dtype=w.dtype)
        block.gate.register_forward_hook(lambda _m, _args, out, bias=bias: out + bias)


def moe_counters(engine) -> tuple[int, int, int]:
    """(hits, misses, bytes copied) summed over the layers (one device read)."""
    if not engine.moe_executors:
        return 0, 0, 0
    layers = layer_stats(engine.moe_executors)
    return sum(s.hits for s in layers), sum(s.misses for s in layers), sum(s.bytes_copied for s in layers)


def random_prompts(sched: Scheduler, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = sched.engine.vocab_size
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def timed_decode(sched: Scheduler, bs: int, prompt: int, out_tokens: int) -> dict:
    """Prefill bs prompts untimed, then time the decode steps; counters are read around the decode."""
    before: list = []
    dt, steps, tokens = run_decode(sched, bs, prompt, out_tokens,
                                   after_prefill=lambda: before.extend(moe_counters(sched.engine)))
    hits, misses, copied = (a - b for a, b in zip(moe_counters(sched.engine), before))
    return dict(dt=dt, steps=steps, tokens=tokens, hits=hits, misses=misses, copied=copied)


def ttft(sched: Scheduler, length: int) -> float:
    """Seconds from submitting one prompt to its first token (warm: the shape ran before)."""
    ids = random_prompts(sched, 1, length, 17)[0]
    sched.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = None
    while sched.has_work():
        msgs = sched.step()
        if first is None and any(m.next_tokens for m in msgs):
            first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def bench_engine(model_dir: Path, strategy: str, rate: float | None, args, bw: float, h2d: float,
                 init: DummyWeights) -> list[str]:
    max_bs = max(args.bs)
    cfg = EngineConfig(
        model_path=str(model_dir), dtype="bfloat16", device="cuda", attention_backend=args.backend,
        max_running_req=max_bs, page_size=16, max_seq_len=args.prompt + args.out_tokens + 64,
        load_format="dummy", memory_fraction=0.5, moe_strategy=strategy,
        moe_cache_rate=rate if strategy == "offload" else None,
    )
    t0 = time.perf_counter()
    sched = Scheduler(cfg)
    build = time.perf_counter() - t0
    eng = sched.engine
    graphs = eng.graph_runner is not None
    executor = type(eng.moe_executors[0]).__name__ if eng.moe_executors else "-"
    slots = getattr(eng.moe_executors[0], "num_slots", "-") if eng.moe_executors else "all"
    banks = "-" if strategy == "resident" else (f"reused ({init.bank_s:.1f} s)" if init.reused else f"{init.bank_s:.1f} s")
    print(f"## {strategy}{'' if rate is None else f' rate {rate}'}: engine ready in {build:.1f} s, pinned host banks "
          f"{banks}, expert placement {eng.moe_place_s:.1f} s, graphs {graphs}, executor {executor}, "
          f"slots/layer {slots}, max_running_req {eng.resolved.max_running_req}", flush=True)
    shape = eng.kv_cache.shape
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    clamp = eng.resolved.max_running_req
    timed_decode(sched, 1, args.prompt, 8)  # warm-up (compile, the graphs' first replays)
    timed_decode(sched, min(max_bs, clamp), args.prompt, 4)
    ttft(sched, args.prompt)
    first = ttft(sched, args.prompt)
    routing = f"zipf S={args.zipf:g}" if args.zipf else "random weights"
    rows = []
    for bs in args.bs:
        run = min(bs, clamp)
        r = timed_decode(sched, run, args.prompt, args.out_tokens)
        distinct = expert_usage(sched, run, args.prompt)
        step_bytes, _ = weight_bytes_per_step(eng.model, distinct)
        avg_bs = r["tokens"] / r["steps"]
        avg_ctx = args.prompt + args.out_tokens / 2
        hbm = (step_bytes + avg_bs * avg_ctx * kv_per_token) / bw
        floor = (hbm + r["copied"] / r["steps"] / h2d) * 1e3
        ms = r["dt"] / r["steps"] * 1e3
        routed = r["hits"] + r["misses"]
        hit = f"{r['hits'] / routed:.3f}" if routed else "-"
        rows.append(
            f"| {strategy} | {'-' if rate is None else rate} | {slots} | {bs if run == bs else f'{bs}->{run}'} | "
            f"{'yes' if graphs else 'no'} | {r['tokens'] / r['dt']:.1f} | {ms:.2f} | {first * 1e3:.1f} | {hit} | "
            f"{r['copied'] / max(r['tokens'], 1) / 2**20:.2f} | {'-' if distinct is None else f'{distinct:.1f}'} | "
            f"{hbm * 1e3:.2f} + {floor - hbm * 1e3:.2f} | {100 * floor / ms:.0f}% | {routing} |")
        print(rows[-1], flush=True)
    eng.close()
    del sched, eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", help=f"a MoE shape of bench_decode.py: {', '.join(SHAPES)}")
    ap.add_argument("--rates", default="1.0,0.5,0.25", help="moe_cache_rate of each offload engine")
    ap.add_argument("--bs", default="1,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--zipf", type=float, default=None, help="Zipf exponent S of a fixed per-layer router bias")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quicker run)")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--no-resident", action="store_true")
    args = ap.parse_args()
    args.bs = [int(x) for x in args.bs.split(",")]
    rates = [float(x) for x in args.rates.split(",") if x]
    dev = torch.device("cuda")
    bw, h2d = copy_bandwidth(dev), h2d_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {args.shape}"
          f"{'' if args.layers is None else f' ({args.layers} layers)'}, device copy {bw / 1e12:.2f} TB/s, "
          f"pinned host->device {h2d / 1e9:.1f} GB/s", flush=True)
    init = DummyWeights(args.zipf)
    loader.init_dummy_weights_ = init  # benchmark only: see DummyWeights
    header = ("| strategy | cache rate | slots/layer | bs | graphs | tok/s | ms/step | TTFT ms | hit rate | "
              "MiB copied/token | distinct experts/layer | floor ms/step (HBM + H2D) | % of floor | routing |")
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers is not None:
            SHAPES[args.shape] = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
            if "layer_types" in SHAPES[args.shape]:
                SHAPES[args.shape]["layer_types"] = SHAPES[args.shape]["layer_types"][:args.layers]
        model_dir = write_shape(args.shape, Path(tmp))
        runs = ([] if args.no_resident else [("resident", None)]) + [("offload", r) for r in sorted(rates, reverse=True)]
        for strategy, rate in runs:
            rows += bench_engine(model_dir, strategy, rate, args, bw, h2d, init)
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
