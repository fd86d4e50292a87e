#!/usr/bin/env python3
"""Peer measurement: FreeToken 0.2.1's offline LLM on benchmarks/bench_prefix_chat.py's multi-turn chat workload,
radix prefix cache on vs off.

Run from the project root with the peer's files in .peer/ (../shared/peer copied; git-ignored, carry it to the GPU
host): run_freetoken.py's shapes, model-directory writer, --init core dummy redraw and torch-2.11 pinned-memory
workaround are imported from there, not copied.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ftsite .peer/whl/*.whl
    PYTHONPATH=/tmp/ftsite PYTHONUNBUFFERED=1 python3 benchmarks/dev/peer_prefix_chat.py --shape qwen3-30b-a3b
    PYTHONPATH=/tmp/ftsite PYTHONUNBUFFERED=1 python3 benchmarks/dev/peer_prefix_chat.py --shape qwen3.6-35b-a3b
    PYTHONPATH=/tmp/ftsite python3 benchmarks/dev/peer_prefix_chat.py --shape qwen3-30b-a3b --check-only   # no GPU

Workload (bench_prefix_chat.make_conversations, same seed, so the same ids): one shared system prompt, then per
conversation and turn `user-len` new ids; a turn's prompt is the previous prompt + its output + the next user ids;
greedy, ignore_eos, max_tokens per turn. An offline generate() takes a batch, so turns run LOCKSTEP: turn k of
every conversation is one generate() call (the engine runs up to --max-running-req of them at once). Ours runs a
closed loop per conversation instead, so compare throughput, not TTFT.

Prefix cache: SchedulerConfig.cache_type (freetoken/scheduler/config.py, default "radix"); "naive" is the
no-reuse NaivePrefixCache (kvcache/__init__.py). For GDN hybrids (Qwen3.6 / Qwen3-Next) the engine turns
"radix" into "hybrid_radix" (HybridRadixCache, GDN-state snapshots) in engine._adjust_config ->
_resolve_cache_type; "naive" stays naive. --cache both runs each setting in a child process, because
freetoken's Engine asserts `not torch.cuda.is_initialized()`: one process holds one LLM (also frees the GPU).

Cached prompt tokens: the scheduler reports them per request in PromptAdmittedMsg(uid, prompt_tokens,
cached_tokens) (message/tokenizer.py), which stock LLM.offline_send_result drops; ChatLLM below keeps them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_fp8  # noqa: E402 (this folder's, found once the line above ran)


def load_peer_template():
    """run_freetoken.py (the working decode peer) from this file's folder or ./.peer."""
    for d in (Path(__file__).resolve().parent, Path.cwd() / ".peer"):
        if (d / "run_freetoken.py").exists():
            spec = importlib.util.spec_from_file_location("run_freetoken", d / "run_freetoken.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    sys.exit("peer_prefix_chat.py: run_freetoken.py not found beside this file or in ./.peer")


def make_conversations(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """Verbatim bench_prefix_chat.make_conversations: the system prompt, then each conversation's user ids per turn.
    A copy, not an import: that module imports freetoken_core and torch, and the peer's process must stay free of both
    until FreeToken's Engine has checked that CUDA is not initialized."""
    rng = random.Random(args.seed)
    lo = min(100, vocab // 4)  # clear of the special ids at the low end
    system = [rng.randrange(lo, vocab) for _ in range(args.system_len)]
    user = [[[rng.randrange(lo, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
            for _ in range(args.conversations)]
    return system, user


def max_seq_len(args: argparse.Namespace) -> int:
    return args.system_len + args.turns * (args.user_len + args.max_tokens) + 16  # as bench_prefix_chat


def chat_llm_class():
    from freetoken.llm import LLM
    from freetoken.message import DetokenizeMsg, PromptAdmittedMsg

    class ChatLLM(LLM):
        """LLM that keeps each request's PromptAdmittedMsg (prompt and cached-prefix lengths) and every generated
        token: stock offline_send_result drops both, and drops a final token equal to EOS even under ignore_eos,
        which would shorten a turn and change the next prompt. Scheduler IO binds send_result to
        self.offline_send_result (scheduler/io.py) in offline mode, so this override is what runs."""

        admitted: dict[int, tuple[int, int]]

        def offline_send_result(self, reply) -> None:
            for msg in reply:
                if isinstance(msg, PromptAdmittedMsg):
                    self.admitted[msg.uid] = (msg.prompt_tokens, msg.cached_tokens)
                elif isinstance(msg, DetokenizeMsg):
                    self.status_map[msg.uid].output_ids.append(msg.next_token)
                else:  # ErrorReplyMsg (e.g. prompt longer than max_seq_len) and anything unforeseen
                    raise RuntimeError(f"FreeToken replied {type(msg).__name__}: {getattr(msg, 'error', msg)}")

        def generate_ids(self, prompts: list[list[int]], sampling_params) -> tuple[list[list[int]], int, int]:
            """(output ids per prompt, prompt tokens, cached prompt tokens) of one batch."""
            self.admitted = {}
            out = self.generate(prompts, sampling_params)
            return ([o["token_ids"] for o in out], sum(p for p, _ in self.admitted.values()),
                    sum(c for _, c in self.admitted.values()))

    return ChatLLM


def prepare(args: argparse.Namespace, rf) -> tuple[str, dict]:
    """Model directory + LLM keyword arguments, as run_freetoken.main builds them; patches installed."""
    path = os.environ.get("PATH", "").split(os.pathsep)  # tvm-ffi JIT-builds kernels with ninja + nvcc
    for d, exe in ((os.path.dirname(sys.executable), "ninja"), ("/usr/local/cuda/bin", "nvcc")):
        if shutil.which(exe) is None and os.path.exists(os.path.join(d, exe)):
            path.insert(0, d)
    os.environ["PATH"] = os.pathsep.join(path)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)
    if args.quant == "fp8":
        peer_fp8.fp8_shapes(rf)
        peer_fp8.realistic_scales(rf)
    model_dir = str(rf.write_shape(args.shape, Path(args.work_dir)))

    import torch

    torch_release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    try:
        if torch_release < (2, 14):
            rf.install_safe_pinned()
        if args.init == "core":
            rf.use_core_dummy_init()
    except ImportError as exc:  # the cp312 extensions cannot load elsewhere (e.g. a Python 3.11 CPU check)
        if not args.check_only:
            raise
        print(f"check-only: run_freetoken patches skipped, a compiled module does not load here: {exc}")
    kw = dict(use_dummy_weight=True, max_running_req=args.max_running_req, attention_backend=args.attention_backend,
              max_seq_len_override=max_seq_len(args), memory_ratio=args.memory_ratio, page_size=args.page_size,
              moe_strategy=args.moe_strategy)
    if args.moe_strategy == "offload":
        kw["moe_cache_auto"] = True  # as run_freetoken.py without --moe-cache-rate
    return model_dir, kw


def run_one(args: argparse.Namespace, rf, cache_on: bool) -> dict:
    import torch

    import freetoken
    from freetoken.core import SamplingParams

    model_dir, kw = prepare(args, rf)
    kw["cache_type"] = "radix" if cache_on else "naive"
    print(f"freetoken {freetoken.__version__} torch {torch.__version__} model {model_dir} {kw}", flush=True)
    t0 = time.perf_counter()
    llm = chat_llm_class()(model_dir, dtype=torch.bfloat16, **kw)
    ready_s = time.perf_counter() - t0
    cm = llm.cache_manager  # the resolved cache: cache_type is "hybrid_radix" for GDN models with "radix"
    info = dict(cache=("on" if cache_on else "off"), cache_type=cm.cache_type,
                prefix_cache=type(cm.prefix_cache).__name__, kv_pages=int(llm.engine.num_pages), ready_s=ready_s)
    print(f"engine ready in {ready_s:.1f} s: {info}", flush=True)

    vocab = rf.SHAPES[args.shape]["vocab_size"]
    system, user = make_conversations(args, vocab)
    lo = min(100, vocab // 4)
    # new SamplingParams per request: the scheduler clips max_tokens in place on the object it is given
    params = lambda n: [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens) for _ in range(n)]
    t = time.perf_counter()  # warm-up on ids below `lo`, which no workload prompt starts with (no cache hits)
    llm.generate_ids([[1 + (7 * i + c) % (lo - 1) for i in range(64)] for c in range(args.conversations)],
                     [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)] * args.conversations)
    torch.cuda.synchronize()
    info["warmup_s"] = time.perf_counter() - t

    prompts = [system + user[c][0] for c in range(args.conversations)]
    tokens: list[list[list[int]]] = [[] for _ in prompts]
    turn_s, prompt_tokens, output_tokens, cached, admitted_prompt = [], 0, 0, 0, 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        t = time.perf_counter()
        outs, n_prompt, n_cached = llm.generate_ids(prompts, params(len(prompts)))
        torch.cuda.synchronize()
        turn_s.append(time.perf_counter() - t)
        prompt_tokens += sum(map(len, prompts))
        output_tokens += sum(map(len, outs))
        admitted_prompt += n_prompt
        cached += n_cached
        print(f"  turn {turn + 1}: {turn_s[-1]:.2f} s, prompt {len(prompts[0])} tokens x {len(prompts)}, "
              f"cached {n_cached} of {n_prompt}", flush=True)
        for c, out in enumerate(outs):
            tokens[c].append(out)
            if turn + 1 < args.turns:
                prompts[c] = prompts[c] + out + user[c][turn + 1]
    wall = time.perf_counter() - t0
    short = sum(len(t) != args.max_tokens for conv in tokens for t in conv)
    result = dict(**info, wall_s=wall, total_tok_s=(prompt_tokens + output_tokens) / wall,
                  output_tok_s=output_tokens / wall, turn1_s=turn_s[0],
                  turns2plus_mean_s=(sum(turn_s[1:]) / len(turn_s[1:])) if len(turn_s) > 1 else float("nan"),
                  turn_s=turn_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                  admitted_prompt_tokens=admitted_prompt, cached_prompt_tokens=cached,
                  turns_not_max_tokens=short, tokens=tokens)
    try:
        llm.shutdown()
    except Exception as exc:  # noqa: BLE001 -- the numbers are in already
        print(f"shutdown: {type(exc).__name__}: {exc}")
    return result


def check_only(args: argparse.Namespace, rf) -> None:
    """No GPU: write the model directory, resolve the engine config for both cache settings as the engine does,
    and check every FreeToken name this script uses."""
    import inspect

    import torch

    import freetoken
    import freetoken.scheduler.io as sched_io
    from freetoken.core import SamplingParams
    from freetoken.distributed import DistributedInfo, set_tp_info
    from freetoken.engine.engine import _adjust_config
    from freetoken.message import PromptAdmittedMsg
    from freetoken.scheduler import SchedulerConfig
    from freetoken.scheduler.cache import CacheManager

    model_dir, kw = prepare(args, rf)
    set_tp_info(rank=0, size=1)
    for cache_type in ("radix", "naive"):
        cfg = SchedulerConfig(model_path=model_dir, tp_info=DistributedInfo(0, 1), dtype=torch.bfloat16,
                              offline_mode=True, cache_type=cache_type, **kw)
        _adjust_config(cfg)
        print(f"check-only: cache_type {cache_type!r} resolves to {cfg.cache_type!r} (moe {cfg.moe_strategy}, "
              f"attention {cfg.attention_backend}, max_seq_len {cfg.max_seq_len}, page_size {cfg.page_size})")
    ChatLLM = chat_llm_class()
    assert "self.send_result = self.offline_send_result" in inspect.getsource(sched_io), "offline IO binding moved"
    assert {"prompt_tokens", "cached_tokens", "uid"} <= set(PromptAdmittedMsg.__dataclass_fields__)
    assert {"temperature", "ignore_eos", "max_tokens"} <= set(SamplingParams.__dataclass_fields__)
    src = inspect.getsource(CacheManager)
    assert "self.cache_type =" in src and "self.prefix_cache =" in src, "CacheManager fields moved"
    assert '"token_ids"' in inspect.getsource(ChatLLM.generate)
    system, user = make_conversations(args, rf.SHAPES[args.shape]["vocab_size"])
    last = len(system) + args.turns * args.user_len + (args.turns - 1) * args.max_tokens
    print(f"check-only: freetoken {freetoken.__version__}, {ChatLLM.__name__}({ChatLLM.__mro__[1].__name__}) ready; "
          f"system {len(system)} ids (first {system[:3]}), {len(user)} conversations x {len(user[0])} turns, "
          f"last prompt {last} tokens; stops before LLM(...) construction (needs CUDA)")


def summary_line(name: str, r: dict) -> str:
    return (f"RESULT freetoken-0.2.1 chat {name} cache={r['cache']} ({r['cache_type']}): wall {r['wall_s']:.1f} s, "
            f"total {r['total_tok_s']:.0f} tok/s, output {r['output_tok_s']:.0f} tok/s, turn 1 {r['turn1_s']:.2f} s, "
            f"turns 2+ {r['turns2plus_mean_s']:.2f} s/turn, cached {r['cached_prompt_tokens']} of "
            f"{r['prompt_tokens']} prompt tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="one of .peer/run_freetoken.py's shapes")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=2000)
    ap.add_argument("--user-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", choices=["on", "off", "both"], default="both",
                    help="radix prefix cache (hybrid_radix on GDN models) or naive; both = on, then off, one process each")
    ap.add_argument("--max-running-req", type=int, default=64)
    ap.add_argument("--moe-strategy", default="fused", choices=["fused", "offload", "auto"],
                    help="fused keeps the experts resident on the GPU (FreeToken's auto picks offload for MoE)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--memory-ratio", type=float, default=0.9)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--init", choices=["core", "freetoken"], default="core", help="dummy weights, as run_freetoken.py")
    ap.add_argument("--quant", choices=["none", "fp8"], default="none",
                    help="fp8: the FP8 releases' quantization_config (peer_fp8.py)")
    ap.add_argument("--work-dir", default="/tmp/ft-peer-models")
    ap.add_argument("--check-only", action="store_true", help="no GPU: config resolution + API names")
    ap.add_argument("--json", help="write the results here too (with the output tokens)")
    args = ap.parse_args()
    rf = load_peer_template()  # after --help, which needs no peer files
    if args.shape not in rf.SHAPES:
        ap.error(f"--shape must be one of {sorted(rf.SHAPES)}, got {args.shape!r}")
    if args.check_only:
        check_only(args, rf)
        return 0

    if args.cache != "both":
        results = {args.cache: run_one(args, rf, args.cache == "on")}
    else:  # one child process per setting: FreeToken's Engine needs a process whose CUDA is not yet initialized
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("on", "off"):
                out = Path(tmp) / f"{mode}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--cache", mode, "--json", str(out)]
                rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                if rc != 0 or not out.exists():
                    sys.exit(f"cache={mode} run failed (exit {rc})")
                results[mode] = json.loads(out.read_text())[mode]
    tokens = {mode: r.pop("tokens") for mode, r in results.items()}
    if "on" in tokens and "off" in tokens:
        results["same_tokens_on_off"] = tokens["on"] == tokens["off"]
    print(json.dumps(results, indent=1))
    for mode in ("on", "off"):
        if mode in results:
            print(summary_line(args.shape, results[mode]))
    if "same_tokens_on_off" in results:
        on, off = results["on"], results["off"]
        print(f"cache on vs off: {on['total_tok_s'] / off['total_tok_s']:.2f}x total tok/s; "
              f"same tokens: {results['same_tokens_on_off']}")
    if args.json:
        for mode, toks in tokens.items():
            results[mode]["tokens"] = toks
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
