"""CPU decode benchmark: freetoken_core LLM vs transformers `generate` on the same model and prompts.

    python benchmarks/bench_cpu.py [--model DIR] [--max-tokens 128] [--dtype float32]

Rows: batch 1 (one prompt) and 8 concurrent requests of different prompt lengths. transformers runs
the single prompt alone and the 8 prompts as one left-padded batch. Output tok/s counts generated
tokens over wall time including prefill; "decode tok/s" excludes the time to the first token.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from freetoken_core import LLM, SamplingParams

BASE = (
    "You are a helpful assistant. Summarise the following notes about the history of computing, "
    "from mechanical calculators to modern accelerators, in a few sentences. "
)


def prompts_of_lengths(tok, lengths: list[int]) -> list[list[int]]:
    ids = tok.encode(BASE * 40)
    return [ids[:n] for n in lengths]


def bench_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    for d in llm.stream(prompts, params):
        n += len(d.next_tokens)
        if first is None:
            first = time.perf_counter()
    t1 = time.perf_counter()
    return {"tokens": n, "seconds": t1 - t0, "tok_s": n / (t1 - t0),
            "decode_tok_s": (n - len(prompts)) / (t1 - first)}


def bench_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - width) * len(prompts)
    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "decode_tok_s": (n - len(prompts)) / (dt - t_first)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model dir (default: the SmolLM2 default model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.model is None:
        from freetoken_core.models.gguf import default_model_path

        args.model = default_model_path()
    torch.manual_seed(0)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_running_req=8, page_size=16)
    lengths8 = [16, 40, 64, 90, 128, 150, 200, 256]
    p1 = prompts_of_lengths(llm.tokenizer, [128])
    p8 = prompts_of_lengths(llm.tokenizer, lengths8)
    rows = []
    rows.append(("freetoken bs=1", bench_engine(llm, p1, args.max_tokens)))
    rows.append(("freetoken 8 concurrent", bench_engine(llm, p8, args.max_tokens)))
    del llm
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    rows.append(("transformers bs=1", bench_hf(hf, p1, args.max_tokens, pad)))
    rows.append(("transformers 8 padded", bench_hf(hf, p8, args.max_tokens, pad)))
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__},"
          f" {args.dtype}, {args.max_tokens} new tokens, prompts 128 (bs=1) and {lengths8}")
    print(f"| run | tokens | seconds | output tok/s | decode tok/s |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} |")
    d = dict(rows)
    print(f"\nratio bs=1 (output tok/s): {d['freetoken bs=1']['tok_s'] / d['transformers bs=1']['tok_s']:.2f}x")
    print(f"ratio 8 (output tok/s): {d['freetoken 8 concurrent']['tok_s'] / d['transformers 8 padded']['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
