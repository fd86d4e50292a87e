"""GPU decode/prefill benchmark against the HBM floor (random weights of real model shapes).

    python benchmarks/bench_decode.py [--shapes llama-3.2-1b,llama-3-8b,qwen3-8b] [--bs 1,8,32,64,128]
                                      [--prompts 128,1024] [--out-tokens 256] [--model DIR] [--hf] [--quant fp8]

Per row: tok/s, ms per decode step, and the fraction of the floor, where the floor of one step is
(weight bytes read + KV bytes read) / device copy bandwidth measured in this run. On MoE shapes the
weights read are the dense ones (attention, router, dense MLPs, LM head) plus the *distinct* experts
the step's router chose in each layer, counted from its ids in a few extra eager steps of the same
batch (`expert_usage`); prefill FLOPs count the active parameters (top-k experts per token). Prefill: one
8192-token prompt against the bf16 matmul rate measured in this run. `--hf` adds transformers
`generate` at batch 1 on the same shape. `--model DIR` runs a real checkpoint instead of a shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.scheduler.scheduler import Scheduler

SHAPES = {
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6),
    # text-only form of Qwen3.6-35B-A3B: 30 GDN + 10 gated-attention layers, 256 experts top-8 + a shared expert
    "qwen3.6-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4,
                            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, vocab_size=248320, tie_word_embeddings=False,
                            max_position_embeddings=262144, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
}


def write_shape(name: str, root: Path) -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**SHAPES[name], "torch_dtype": "bfloat16"}))
    return d


def copy_bandwidth(device: torch.device) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of 2 GiB."""
    a = torch.empty(1 << 30, dtype=torch.int16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    del a, b
    return 2 * (1 << 31) / dt


def matmul_rate(device: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (time.perf_counter() - t0)


def moe_blocks(model: torch.nn.Module) -> list:
    try:
        from freetoken_core.layers.moe import SparseMoeBlock
    except ImportError:  # an older tree under A/B (ab_decode.py) has no MoE layer
        return []

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def weight_bytes_per_step(model: torch.nn.Module, distinct_experts: float | None = None) -> tuple[int, int]:
    """(bytes read per decode step, active matmul params per token).

    Dense weights: all but the input embedding table (only a few rows of it are read), unless it is
    tied to the LM head. Experts: `distinct_experts` per MoE layer (the mean number the step's
    router touched; None counts every expert) for the bytes, top-k per token for the params."""
    dense, embed, params = 0, 0, 0
    # FP8-held layers (--quant fp8): e4m3 values plus their block scales (fp32 buffers), read every step too
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("_scale_inv"))]
    for name, p in tensors:
        if ".experts." in name:
            continue
        b = p.numel() * p.element_size()
        dense += b
        if "embed_tokens" in name:
            embed += b
        elif not name.endswith("_scale_inv"):
            params += p.numel()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    read = dense if tied else dense - embed
    for block in moe_blocks(model):
        ex = block.experts
        stacks = [ex.gate_up_proj, ex.down_proj] + [s for _, s in ex.fp8_tensors()]
        per_expert_bytes = sum(t[0].numel() * t.element_size() for t in stacks)
        n = ex.num_experts if distinct_experts is None else distinct_experts
        read += int(n * per_expert_bytes)
        params += block.top_k * (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel())
    return read, params


def expert_usage(sched: Scheduler, bs: int, prompt_len: int, steps: int = 6) -> float | None:
    """Mean distinct experts per MoE layer per decode step for this batch size, counted from the
    router's ids in `steps` eager decode steps (graph replays run no Python hooks)."""
    blocks = moe_blocks(sched.engine.model)
    if not blocks:
        return None
    counts: list[int] = []

    def count(module, args):  # StackedExperts(x, weights, ids); a stacked shared expert (id E) is a dense weight
        ids = args[2]
        counts.append(int(torch.unique(ids[ids < module.num_experts]).numel()))

    g = torch.Generator().manual_seed(bs * 31 + prompt_len)
    for _ in range(bs):
        ids = torch.randint(10, sched.engine.vocab_size - 10, (prompt_len,), generator=g).tolist()
        sched.add_request(ids, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    while any(r.cached_len < r.prompt_len for r in sched.running) or sched.waiting:
        sched.step()
    runner, sched.engine.graph_runner = sched.engine.graph_runner, None
    hooks = [b.experts.register_forward_pre_hook(count) for b in blocks]
    try:
        while sched.has_work():
            sched.step()
    finally:
        for h in hooks:
            h.remove()
        sched.engine.graph_runner = runner
    decode = counts[-len(blocks) * steps:]  # the last steps are pure decode of the whole batch
    return sum(decode) / max(len(decode), 1)


def run_decode(sched: Scheduler, bs: int, prompt_len: int, out_tokens: int,
               after_prefill: Callable[[], None] | None = None) -> tuple[float, int, int]:
    """Prefill `bs` prompts, then time the decode steps; returns (seconds, steps, tokens). Steps
    while the last prompts are still prefilling are not timed; `after_prefill` runs just before the
    timed steps (e.g. to read counters)."""
    vocab = sched.engine.vocab_size
    g = torch.Generator().manual_seed(bs * 7919 + prompt_len)
    for _ in range(bs):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        sched.add_request(ids, SamplingParams(max_tokens=out_tokens, ignore_eos=True))
    while any(r.cached_len < r.prompt_len for r in sched.running) or sched.waiting:
        sched.step()
    torch.cuda.synchronize()
    if after_prefill is not None:
        after_prefill()
    t0 = time.perf_counter()
    steps = tokens = 0
    while sched.has_work():
        tokens += sum(len(m.next_tokens) for m in sched.step())
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - t0, steps, tokens


def run_prefill(sched: Scheduler, n: int) -> float:
    ids = torch.randint(10, sched.engine.vocab_size - 10, (n,)).tolist()
    sched.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    sched.step()  # warm-up compile for this shape class happens in the first call
    while sched.has_work():
        sched.step()
    torch.cuda.synchronize()
    # new tokens: the warm-up's would be served from the prefix cache
    ids = torch.randint(10, sched.engine.vocab_size - 10, (n,)).tolist()
    sched.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while sched.has_work():
        sched.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_batch1(model_dir: Path, dummy: bool, prompt_len: int, new_tokens: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    model.eval()
    ids = torch.randint(10, 1000, (1, prompt_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
    tok_s = new_tokens / (time.perf_counter() - t0)
    del model
    return tok_s


def bench_model(label: str, model_dir: Path, dummy: bool, args, bw: float, mm: float) -> None:
    max_bs = max(args.bs)
    cfg = EngineConfig(
        model_path=str(model_dir), dtype="bfloat16", device="cuda", attention_backend=args.backend,
        max_running_req=max_bs, page_size=args.page_size, max_seq_len=max(max(args.prompts) + args.out_tokens + 16, args.prefill + 16),
        max_extend_tokens=max(args.prefill, 8192), load_format="dummy" if dummy else "auto",
        memory_fraction=0.8, cuda_graph=not args.no_graph, tensor_parallel_size=args.tp,
        linear_state_dtype=args.linear_state_dtype, quantization=args.quant,
        enable_prefix_caching=not args.no_prefix_cache,
    )
    t0 = time.perf_counter()
    sched = Scheduler(cfg)  # shape dirs hold only config.json: token ids in, token ids out
    print(f"\n## {label}: engine ready in {time.perf_counter() - t0:.1f} s "
          f"(graphs: {sched.engine.graph_runner is not None}, backend {sched.engine.attn_backend.info.name})", flush=True)
    wbytes, params = weight_bytes_per_step(sched.engine.model)
    shape = sched.engine.kv_cache.shape
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    pool = getattr(sched.engine, "linear_pool", None)
    state_bytes = 0  # hybrid models: each request's GDN states are read and written once per step
    if pool is not None:
        state_bytes = 2 * pool.nbytes // pool.num_slots
        print(f"linear state {state_bytes / 2 / 2**20:.1f} MiB per request (read + written every step)")
    print(f"weights {wbytes / 1e9:.2f} GB (all experts); KV {kv_per_token / 1024:.0f} KiB/token; "
          f"copy bw {bw / 1e12:.2f} TB/s; matmul {mm / 1e12:.0f} TFLOP/s")
    print("| model | bs | prompt | out | tok/s | ms/step | distinct experts/layer | floor ms/step | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    run_decode(sched, 1, 16, 8)  # warm-up
    run_decode(sched, max(args.bs), 16, 4)
    for p in args.prompts:
        for bs in args.bs:
            dt, steps, tokens = run_decode(sched, bs, p, args.out_tokens)
            distinct = expert_usage(sched, bs, p)
            step_bytes, _ = weight_bytes_per_step(sched.engine.model, distinct)
            ms = dt / steps * 1e3
            avg_ctx = p + args.out_tokens / 2
            avg_bs = tokens / steps  # requests decoding per timed step
            floor = (step_bytes + avg_bs * (avg_ctx * kv_per_token + state_bytes)) / bw * 1e3
            print(f"| {label} | {bs} | {p} | {args.out_tokens} | {tokens / dt:.0f} | {ms:.2f} | "
                  f"{'-' if distinct is None else f'{distinct:.1f}'} | {floor:.2f} | {100 * floor / ms:.0f}% |", flush=True)
    if args.prefill:
        dt = run_prefill(sched, args.prefill)
        shape_cfg = sched.engine.model.config
        hd = sched.engine.model.attn_layout().head_dim
        n_attn = getattr(sched.engine.model, "num_kv_layers", shape_cfg.num_hidden_layers)  # full-attention layers only
        attn_flops = 2 * n_attn * shape_cfg.num_attention_heads * hd * args.prefill**2  # causal
        # params: active ones (top-k experts per token on MoE shapes)
        flops = 2 * params * args.prefill + attn_flops
        print(f"prefill {args.prefill} tokens: {dt * 1e3:.0f} ms, {args.prefill / dt:.0f} tok/s, "
              f"{flops / dt / 1e12:.0f} TFLOP/s = {100 * flops / dt / mm:.0f}% of the measured matmul rate", flush=True)
    sched.engine.close()  # tensor-parallel workers
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        tok_s = hf_batch1(model_dir, dummy, 128, args.hf_tokens)
        print(f"transformers generate bs=1 ({label}, bf16, eager): {tok_s:.1f} tok/s", flush=True)
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b,qwen3-8b")
    ap.add_argument("--model", default=None, help="a real HF model dir instead of random shapes")
    ap.add_argument("--bs", default="1,8,32,64,128")
    ap.add_argument("--prompts", default="128,1024")
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (ranks on GPUs 0..tp-1)")
    ap.add_argument("--quant", default=None, choices=["fp8"],
                    help="block-FP8 weights (128 x 128 blocks): random FP8 values and scales of a quantized N(0, 0.02) "
                         "weight on the shapes, a real --model quantized at load; kept FP8 on the GPU")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--linear-state-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="hybrid (GDN) shapes: the recurrent state's dtype (issue 15 reports both)")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="engine without the prefix cache (the A/B of requests that never hit it)")
    args = ap.parse_args()
    args.bs = [int(x) for x in args.bs.split(",")]
    args.prompts = [int(x) for x in args.prompts.split(",")]
    dev = torch.device("cuda")
    bw, mm = copy_bandwidth(dev), matmul_rate(dev)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    suffix = (f" ({args.quant})" if args.quant else "") + (" (no prefix cache)" if args.no_prefix_cache else "")
    if args.model:
        bench_model(Path(args.model).name + suffix, Path(args.model), False, args, bw, mm)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            bench_model(name + suffix, write_shape(name, Path(tmp)), True, args, bw, mm)


if __name__ == "__main__":
    main()
