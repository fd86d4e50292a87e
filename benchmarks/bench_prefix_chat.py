"""Multi-turn chat benchmark of the prefix cache, offline (the engine's Scheduler, no server): cache on vs off.

    python benchmarks/bench_prefix_chat.py [--model DIR] [--load-format dummy] [--conversations 64] [--turns 6]
        [--system-len 2000] [--user-len 100] [--max-tokens 128] [--device auto] [--dtype auto]
    python benchmarks/bench_prefix_chat.py --shape llama-3.2-1b --load-format dummy   (GPU, random weights)
    python benchmarks/bench_prefix_chat.py --conversations 4 --turns 3 --system-len 64 --user-len 8 --max-tokens 8
        (CPU, the default SmolLM2)

Token-id conversations (random ids, so hits are exact, also with random weights): every conversation opens
with one shared system prompt; a turn's prompt is the previous prompt + its output + `user-len` new tokens;
closed loop with zero think time (a conversation sends its next turn the moment the previous one finishes).
Reports TTFT p50 / p90 of turns 2+ (arrival to first token), total and output throughput, prompt tokens
served from the cache; the two runs must produce the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from freetoken_core import LLM, SamplingParams


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(llm: LLM, args: argparse.Namespace) -> dict:
    sched = llm.scheduler
    vocab = sched.engine.vocab_size
    rng = random.Random(args.seed)
    lo = min(100, vocab // 4)  # clear of the special ids at the low end
    system = [rng.randrange(lo, vocab) for _ in range(args.system_len)]
    user = [[[rng.randrange(lo, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
            for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = {c: system + user[c][0] for c in range(args.conversations)}
    turn_of = {c: 0 for c in prompts}
    uid_conv: dict[int, int] = {}
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    outs: dict[int, list[int]] = {}
    ttft_later: list[float] = []
    cached = prompt_tokens = output_tokens = 0
    tokens_by_turn: dict[tuple[int, int], list[int]] = {}

    def send(c: int) -> None:
        uid = sched.add_request(prompts[c], params)
        uid_conv[uid], sent[uid], outs[uid] = c, time.perf_counter(), []

    t0 = time.perf_counter()
    for c in prompts:
        send(c)
    while sched.has_work():
        for m in sched.step():
            now = time.perf_counter()
            if m.next_tokens and m.uid not in first:
                first[m.uid] = now
                if turn_of[uid_conv[m.uid]] > 0:
                    ttft_later.append(now - sent[m.uid])
            outs[m.uid].extend(m.next_tokens)
            if not m.finished:
                continue
            c = uid_conv[m.uid]
            prompt_tokens += m.num_prompt_tokens
            output_tokens += len(outs[m.uid])
            cached += m.num_cached_tokens
            tokens_by_turn[(c, turn_of[c])] = outs[m.uid]
            turn_of[c] += 1
            if turn_of[c] < args.turns:
                prompts[c] = prompts[c] + outs[m.uid] + user[c][turn_of[c]]
                send(c)
    wall = time.perf_counter() - t0
    return {
        "ttft_p50_ms_turns_2plus": 1e3 * percentile(ttft_later, 0.5),
        "ttft_p90_ms_turns_2plus": 1e3 * percentile(ttft_later, 0.9),
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "output_tok_s": output_tokens / wall,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "tokens": tokens_by_turn,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model dir (default: the SmolLM2 default model)")
    ap.add_argument("--shape", default=None, help="a bench_decode.py shape (config only; use --load-format dummy)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights from config.json")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--user-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-running-req", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="CPU K/V budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.shape is not None:
        import tempfile
        from pathlib import Path

        from bench_decode import write_shape  # benchmarks/ is this script's directory

        args.model = str(write_shape(args.shape, Path(tempfile.mkdtemp())))
    if args.model is None:
        from freetoken_core.models.gguf import default_model_path

        args.model = default_model_path()
    max_len = args.system_len + args.turns * (args.user_len + args.max_tokens) + 16
    results = {}
    for on in (True, False):
        llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                  max_running_req=args.max_running_req, page_size=args.page_size, kv_cache_gb=args.kv_cache_gb,
                  max_seq_len=max_len, enable_prefix_caching=on)
        results["on" if on else "off"] = run(llm, args)
        llm.scheduler.close()
        del llm
    same = results["on"].pop("tokens") == results["off"].pop("tokens")
    on, off = results["on"], results["off"]
    print(json.dumps(results, indent=1))
    print(f"TTFT p50 turns 2+: {on['ttft_p50_ms_turns_2plus']:.1f} ms with the cache, "
          f"{off['ttft_p50_ms_turns_2plus']:.1f} ms without ({on['ttft_p50_ms_turns_2plus'] / off['ttft_p50_ms_turns_2plus']:.0%}); "
          f"p90 {on['ttft_p90_ms_turns_2plus']:.1f} vs {off['ttft_p90_ms_turns_2plus']:.1f} ms")
    print(f"throughput: {on['total_tok_s']:.0f} vs {off['total_tok_s']:.0f} tok/s total "
          f"({on['total_tok_s'] / off['total_tok_s']:.2f}x); cached {on['cached_prompt_tokens']} of "
          f"{on['prompt_tokens']} prompt tokens; same tokens: {same}")


if __name__ == "__main__":
    main()
