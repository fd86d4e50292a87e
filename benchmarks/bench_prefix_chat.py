"""Multi-turn chat benchmark of the prefix cache, offline (the engine's Scheduler) or served: cache on vs off.

    python benchmarks/bench_prefix_chat.py [--model DIR] [--load-format dummy] [--conversations 64] [--turns 6]
        [--system-len 2000] [--user-len 100] [--max-tokens 128] [--device auto] [--dtype auto] [--quantization fp8]
    python benchmarks/bench_prefix_chat.py --shape llama-3.2-1b --load-format dummy   (GPU, random weights)
    python benchmarks/bench_prefix_chat.py --conversations 4 --turns 3 --system-len 64 --user-len 8 --max-tokens 8
        (CPU, the default SmolLM2)
    ... --lockstep: turn k of every conversation as one LLM.generate call, the form FreeToken 0.2.1's offline LLM
        runs the same workload in (`benchmarks/dev/peer_prefix_chat.py`)

Served (gRPC to the `freetoken` model, streaming `input_ids`; one stream per conversation):
    python benchmarks/bench_prefix_chat.py --served localhost:8001 [--model DIR | --shape NAME] ...
        a running server (--model / --shape only give the vocabulary size the ids are drawn from)
    python benchmarks/bench_prefix_chat.py --served --compare [--shape NAME --load-format dummy] ...
        starts `freetoken-core serve`'s server twice (launch/server.py), with enable_prefix_caching true, then false

Token-id conversations (random ids, so hits are exact, also with random weights): every conversation opens
with one shared system prompt; a turn's prompt is the previous prompt + its output + `user-len` new tokens;
closed loop with zero think time (a conversation sends its next turn the moment the previous one finishes).
Reports TTFT p50 / p90 of turns 2+ (arrival to first token), total and output throughput, prompt tokens
served from the cache; the two runs must produce the same tokens (greedy).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import tempfile
import threading
import time
from pathlib import Path

from freetoken_core import LLM, SamplingParams


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def make_conversations(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's new user tokens per turn (random ids, seeded)."""
    rng = random.Random(args.seed)
    lo = min(100, vocab // 4)  # clear of the special ids at the low end
    system = [rng.randrange(lo, vocab) for _ in range(args.system_len)]
    user = [[[rng.randrange(lo, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
            for _ in range(args.conversations)]
    return system, user


def summary(ttft_later: list[float], wall: float, prompt_tokens: int, output_tokens: int, cached: int,
            tokens_by_turn: dict[tuple[int, int], list[int]]) -> dict:
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


def run(llm: LLM, args: argparse.Namespace) -> dict:
    sched = llm.scheduler
    system, user = make_conversations(args, sched.engine.vocab_size)
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
    return summary(ttft_later, wall, prompt_tokens, output_tokens, cached, tokens_by_turn)


def run_lockstep(llm: LLM, args: argparse.Namespace) -> dict:
    """Turn k of every conversation as one `generate` call (the form a peer's offline batch API can run too).
    TTFT is not seen through `generate`; the summary's TTFT fields hold each later turn's whole call time."""
    system, user = make_conversations(args, llm.scheduler.engine.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [system + user[c][0] for c in range(args.conversations)]
    turn_seconds: list[float] = []
    cached = prompt_tokens = output_tokens = 0
    tokens_by_turn: dict[tuple[int, int], list[int]] = {}
    t0 = time.perf_counter()
    for turn in range(args.turns):
        t_turn = time.perf_counter()
        outs = llm.generate(prompts, params)
        if turn > 0:
            turn_seconds.append(time.perf_counter() - t_turn)
        for c, out in enumerate(outs):
            prompt_tokens += out.num_prompt_tokens
            output_tokens += out.num_output_tokens
            cached += out.num_cached_tokens
            tokens_by_turn[(c, turn)] = out.token_ids
            if turn + 1 < args.turns:
                prompts[c] = prompts[c] + out.token_ids + user[c][turn + 1]
    wall = time.perf_counter() - t0
    return summary(turn_seconds, wall, prompt_tokens, output_tokens, cached, tokens_by_turn)


# --- served: gRPC streams to the `freetoken` model ---------------------------------------------------
def _tensor(grpcclient, name: str, values: list, dtype: str):
    import numpy as np

    arr = np.asarray(values, dtype={"INT32": np.int32, "BOOL": bool}[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


class TurnClient:
    """One gRPC stream to the `freetoken` model; `generate` sends token ids and waits for the final response."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))

    def generate(self, ids: list[int], max_tokens: int, timeout: float = 600.0) -> tuple[list[int], int, float]:
        """(output ids, num_cached_tokens, seconds from sending to the first token) of one greedy turn."""
        g = self._grpc
        self._client.async_stream_infer("freetoken", [
            _tensor(g, "input_ids", ids, "INT32"), _tensor(g, "max_tokens", [max_tokens], "INT32"),
            _tensor(g, "ignore_eos", [True], "BOOL"), _tensor(g, "stream", [True], "BOOL"),
            _tensor(g, "return_num_cached_tokens", [True], "BOOL")])
        t0 = time.perf_counter()
        tokens: list[int] = []
        ttft = float("nan")
        while True:
            result, error = self._responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"turn of {len(ids)} prompt tokens failed: {error}")
            new = result.as_numpy("next_tokens").tolist()
            if new and not tokens:
                ttft = time.perf_counter() - t0
            tokens += new
            if bool(result.as_numpy("finished")[0]):
                return tokens, int(result.as_numpy("num_cached_tokens")[0]), ttft

    def close(self) -> None:
        self._client.stop_stream()
        self._client.close()


def run_served(url: str, args: argparse.Namespace, vocab: int) -> dict:
    """The same closed loop through a server: a thread per conversation sends its next turn the moment the
    previous one ends."""
    system, user = make_conversations(args, vocab)
    lock = threading.Lock()
    ttft_later: list[float] = []
    totals = {"prompt": 0, "output": 0, "cached": 0}
    tokens_by_turn: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def converse(c: int) -> None:
        client = TurnClient(url)
        try:
            prompt = system + user[c][0]
            for turn in range(args.turns):
                out, cached, ttft = client.generate(prompt, args.max_tokens)
                with lock:
                    if turn > 0:
                        ttft_later.append(ttft)
                    totals["prompt"] += len(prompt)
                    totals["output"] += len(out)
                    totals["cached"] += cached
                    tokens_by_turn[(c, turn)] = out
                if turn + 1 < args.turns:
                    prompt = prompt + out + user[c][turn + 1]
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=converse, args=(c,), daemon=True) for c in range(args.conversations)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return summary(ttft_later, wall, totals["prompt"], totals["output"], totals["cached"], tokens_by_turn)


def served_results(args: argparse.Namespace, vocab: int) -> dict:
    if not args.compare:
        return {"served": run_served(args.served, args, vocab)}
    from freetoken_core.serving.launch.server import start_server

    results = {}
    for on in (True, False):
        overrides = {"model_path": args.model, "load_format": args.load_format, "device": args.device,
                     "dtype": args.dtype, "max_running_req": str(args.max_running_req),
                     **({"quantization": args.quantization} if args.quantization else {}),
                     **({"prefix_cache_state_gb": str(args.prefix_cache_state_gb)}
                        if args.prefix_cache_state_gb is not None else {}),
                     "page_size": str(args.page_size), "kv_cache_gb": str(args.kv_cache_gb),
                     "max_seq_len": str(max_seq_len(args)), "enable_prefix_caching": str(on).lower()}
        log_path = Path(tempfile.gettempdir()) / f"bench-prefix-chat-server-{'on' if on else 'off'}.log"
        handle = start_server(overrides, log_path=log_path)
        try:
            results["on" if on else "off"] = run_served(handle.grpc_url, args, vocab)
        finally:
            handle.stop()
        results["on" if on else "off"]["server"] = server_plan(log_path)
    return results


# the engine's start-up lines that say how the memory was split (pages, snapshot slots) and its retractions: what
# explains a served run's numbers
PLAN_MARKS = ("engine ready:", "linear-state pool:", "prefix cache:")
RETRACT_MARK = "retracting request"


def server_plan(log_path: Path) -> dict:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    plan = [line[line.index(mark):] for line in lines for mark in PLAN_MARKS if mark in line]
    return {"plan": plan, "retractions": sum(RETRACT_MARK in line for line in lines)}


def add_tokenizer_files(model_dir: Path) -> None:
    """The default model's tokenizer files beside a shape's config.json (the ids sent are the shape's own)."""
    import shutil

    from freetoken_core.models.gguf import default_model_path

    for f in Path(default_model_path()).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, model_dir / f.name)


def max_seq_len(args: argparse.Namespace) -> int:
    return args.system_len + args.turns * (args.user_len + args.max_tokens) + 16


def offline_results(args: argparse.Namespace) -> dict:
    results = {}
    for on in (True, False):
        llm = LLM(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                  quantization=args.quantization, prefix_cache_state_gb=args.prefix_cache_state_gb,
                  max_running_req=args.max_running_req, page_size=args.page_size, kv_cache_gb=args.kv_cache_gb,
                  max_seq_len=max_seq_len(args), enable_prefix_caching=on)
        results["on" if on else "off"] = (run_lockstep if args.lockstep else run)(llm, args)
        llm.scheduler.close()
        del llm
    return results


def report(results: dict, first_metric: str = "TTFT") -> None:
    if "served" in results:
        r = results["served"]
        r.pop("tokens")
        print(json.dumps(r, indent=1))
        return
    same = results["on"].pop("tokens") == results["off"].pop("tokens")
    on, off = results["on"], results["off"]
    print(json.dumps(results, indent=1))
    print(f"{first_metric} p50 turns 2+: {on['ttft_p50_ms_turns_2plus']:.1f} ms with the cache, "
          f"{off['ttft_p50_ms_turns_2plus']:.1f} ms without ({on['ttft_p50_ms_turns_2plus'] / off['ttft_p50_ms_turns_2plus']:.0%}); "
          f"p90 {on['ttft_p90_ms_turns_2plus']:.1f} vs {off['ttft_p90_ms_turns_2plus']:.1f} ms")
    print(f"throughput: {on['total_tok_s']:.0f} vs {off['total_tok_s']:.0f} tok/s total "
          f"({on['total_tok_s'] / off['total_tok_s']:.2f}x); cached {on['cached_prompt_tokens']} of "
          f"{on['prompt_tokens']} prompt tokens; same tokens: {same}")
    for side in ("on", "off"):
        server = results[side].get("server")
        if server:
            print(f"server, cache {side}: {server['retractions']} retractions; " + "; ".join(server["plan"]))


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
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="fp8: weights quantized block-wise at load (both sides; what an 80 GB card serves a 35B in)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="CPU K/V budget")
    ap.add_argument("--prefix-cache-state-gb", type=float, default=None,
                    help="hybrids: K/V pages reserved for snapshots, GiB (default: the engine's, half the budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--served", nargs="?", const="", default=None, metavar="HOST:PORT",
                    help="through a server's gRPC endpoint (with --compare: servers this script starts)")
    ap.add_argument("--compare", action="store_true", help="served: start a server with the cache, then without")
    ap.add_argument("--lockstep", action="store_true",
                    help="offline: each turn of all conversations as one generate() call (a peer's batch API's form)")
    args = ap.parse_args()
    if args.served == "" and not args.compare:
        ap.error("--served needs HOST:PORT, or --compare to start the servers itself")
    if args.shape is not None:
        from bench_decode import write_shape  # benchmarks/ is this script's directory

        args.model = str(write_shape(args.shape, Path(tempfile.mkdtemp())))
        if args.served is not None:  # the server's tokenizer and detokenizer steps load SmolLM2's tokenizer files
            add_tokenizer_files(Path(args.model))
    if args.model is None:
        from freetoken_core.models.gguf import default_model_path

        args.model = default_model_path()
    if args.served is None:
        report(offline_results(args), "turn time (lockstep)" if args.lockstep else "TTFT")
    else:
        report(served_results(args, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]))


if __name__ == "__main__":
    main()
