"""Quality of the FP8 path on a GPU: greedy tokens of block-FP8 weights run by the FP8 kernels against the same
weights dequantized to bf16.

    python3 benchmarks/fp8_quality.py [--shape smollm2-135m | --model DIR] [--prompts 16] [--tokens 256]

--shape writes a checkpoint of that bench_decode.py shape with transformers' random initialization (bf16
safetensors); --model takes a bf16 or fp32 checkpoint directory (the converted SmolLM2, say). Both runs load it with
quantization="fp8", block-quantized at load as `--param quantization=fp8` serves it: once with the FP8 weights kept
(FREETOKEN_FP8_KEEP=auto: the kernels/fp8_*.py path), once dequantized to bf16 at load (FREETOKEN_FP8_KEEP=0), each
in a child process (the knob is read once a process). The prompts are seeded random token ids, all submitted
together; greedy, ignore_eos.

Reported: the prompts whose tokens agree to the end; for each other one the first position where the runs part,
and there the dequantized run's logprob of its own token minus its logprob of the FP8 run's token. A small gap is a
near tie that FP8's rounding of the weights tipped; a gap of several nats would be a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

TOP_LOGPROBS = 8  # the dequantized run's candidates per position: where the FP8 run's token usually is


def write_random_checkpoint(shape: str, root: Path) -> Path:
    """A bench_decode.py shape with transformers' random initialization, saved as bf16 safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench_decode import write_shape  # benchmarks/ is this script's directory

    model_dir = write_shape(shape, root)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    return model_dir


def child(args: argparse.Namespace) -> None:
    from freetoken_core import LLM, SamplingParams

    rng = random.Random(args.seed)
    vocab = json.loads((Path(args.model) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    llm = LLM(args.model, dtype="bfloat16", device="cuda", quantization="fp8", max_running_req=args.prompts,
              max_seq_len=args.prompt_len + args.tokens + 8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=TOP_LOGPROBS))
    Path(args.out).write_text(json.dumps([{"tokens": o.token_ids, "top": [{str(t): lp for t, lp in top.items()}
                                                                          for top in o.top_logprobs or []]}
                                          for o in outs]))


def run_child(args: argparse.Namespace, keep: str, out: Path) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--out", str(out), "--prompts",
           str(args.prompts), "--tokens", str(args.tokens), "--prompt-len", str(args.prompt_len), "--seed",
           str(args.seed)]
    subprocess.run(cmd, check=True, env={**os.environ, "FREETOKEN_FP8_KEEP": keep})
    return json.loads(out.read_text())


def compare(kept: list[dict], dequantized: list[dict]) -> list[dict]:
    """Per prompt: the first position where the runs part (None: never) and the dequantized run's logprob gap
    there between its token and the FP8 run's (None when the FP8 token is not among its top candidates)."""
    rows = []
    for k, d in zip(kept, dequantized):
        at = next((i for i, (a, b) in enumerate(zip(k["tokens"], d["tokens"])) if a != b), None)
        gap = None
        if at is not None and at < len(d["top"]):
            top = d["top"][at]
            own, theirs = top.get(str(d["tokens"][at])), top.get(str(k["tokens"][at]))
            gap = None if own is None or theirs is None else own - theirs
        rows.append({"first_divergence": at, "logprob_gap": gap})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", help="a bench_decode.py shape (random weights)")
    p.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the per-prompt rows here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    import torch

    if not torch.cuda.is_available():
        p.error("the FP8 kernels run on CUDA; this host has no GPU")
    work = Path(tempfile.mkdtemp(prefix="freetoken-fp8-quality-"))
    args.model = args.model or str(write_random_checkpoint(args.shape, work))
    kept = run_child(args, "auto", work / "kept.json")
    dequantized = run_child(args, "0", work / "dequantized.json")
    rows = compare(kept, dequantized)
    agree = sum(r["first_divergence"] is None for r in rows)
    print(f"{args.model}: {agree} of {len(rows)} prompts agree for all {args.tokens} greedy tokens")
    for i, r in enumerate(rows):
        if r["first_divergence"] is not None:
            gap = "not in the top candidates" if r["logprob_gap"] is None else f"{r['logprob_gap']:.4f} nats"
            print(f"  prompt {i}: first divergence at token {r['first_divergence']}, dequantized logprob gap {gap}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
