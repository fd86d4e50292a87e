"""Decode speed of one shape under named variants of the kernels, each in a fresh process, alternating.

    python benchmarks/decode_variants.py --shape qwen3-30b-a3b --bs 1 --prompt 16 --page-size 1 \
        --variants base,splits_all,down_after_wait,no_attention,no_experts --rounds 2

A variant is a small patch applied in the child process before the engine is built: a launch tile from
another table entry, a kernel option turned back to its previous behaviour (an A/B of one change in one
tree), or an *ablation* that skips a part of the layer (its output then is wrong; the step time without it
says what that part costs inside the CUDA graph, where PDL overlaps neighbouring kernels and eager kernel
times add up to more than the step). Prints each run, then the median ms/step and tok/s per variant.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------- variants

def _attn_kw(doc: str, **kw) -> Callable[[], None]:
    """Keyword arguments added to every decode_attention call of the triton backend (patches compose)."""
    def patch() -> None:
        from freetoken_core.attention.triton import backend

        backend.decode_attention = functools.partial(backend.decode_attention, **kw)
    patch.__doc__ = doc
    return patch


def _down_after_wait() -> None:
    """The MoE down GEMV waits for the gate/up GEMV before loading anything (as before the early tile)."""
    from freetoken_core.kernels import moe_gemv

    down = moe_gemv.moe_gemv_down
    moe_gemv.moe_gemv_down = lambda *a, after_gate_up=False, **k: down(*a, after_gate_up=False, **k)


def _no_attention() -> None:
    """Ablation: decode attention (K/V store and the attention kernels) skipped; o_proj reads q."""
    from freetoken_core.attention.triton.backend import TritonBackend

    forward = TritonBackend.forward

    def skip(self, q, k, v, layer_id, batch, kv_stored=False):
        if batch.attn_metadata.phase == "prefill":
            return forward(self, q, k, v, layer_id, batch, kv_stored)
        return q.reshape(q.shape[0], -1)

    TritonBackend.forward = skip


def _no_gdn_core() -> None:
    """Ablation: the GDN conv, recurrence and output norm skipped (in_proj and out_proj still run, on z)."""
    from freetoken_core.layers.gdn import GatedDeltaNet

    GatedDeltaNet.attend = lambda self, positions, proj: self.out_proj(
        proj[:, self.conv_dim: self.conv_dim + self.value_dim])


def _no_experts() -> None:
    """Ablation: the routed experts skipped (the router and its top-k still run)."""
    from freetoken_core.layers.moe import StackedExperts

    StackedExperts.forward = lambda self, x, weights, ids: x


def _no_moe() -> None:
    """Ablation: the whole MoE block skipped (router, top-k, experts); the post-attention norm still runs."""
    from freetoken_core.layers.moe import SparseMoeBlock

    def norm_only(self, norm, x, residual):
        return norm(x, residual)

    SparseMoeBlock.forward_with_norm = norm_only


def _tile(table_module: str, table: str, key: tuple, **tile) -> Callable[[], None]:
    def patch() -> None:
        import importlib

        getattr(importlib.import_module(table_module), table)[key] = tile
    patch.__doc__ = f"{table}[{key}] = {tile}"
    return patch


def _decode_tile(key: tuple, part: str, **tile) -> Callable[[], None]:
    def patch() -> None:
        from freetoken_core.kernels import fused_moe_configs as cfg

        cfg.DECODE_CONFIGS[key] = {**cfg.DECODE_CONFIGS[key], part: tile}
    patch.__doc__ = f"DECODE_CONFIGS[{key}][{part!r}] = {tile}"
    return patch


def _gdn_small_batch_tile(bv: int, warps: int, stages: int) -> Callable[[], None]:
    def patch() -> None:
        from freetoken_core.kernels import gdn

        gdn.GDN_UPDATE_CONFIGS = ((255, bv, warps, stages),) + gdn.GDN_UPDATE_CONFIGS[1:]
    patch.__doc__ = f"The GDN decode recurrence up to batch 7 with BV {bv}, {warps} warp(s), {stages} stages."
    return patch


def _lm_cublas() -> None:
    """The LM head's one-row logits on cuBLAS (F.linear), as before the LM head took the Triton GEMV."""
    from freetoken_core.layers import embedding

    embedding._one_row_gemv = lambda x, weight, min_elements: False


_NG, _G = "freetoken_core.kernels.norm_gemv", "freetoken_core.kernels.gemv"
_TILE_TABLES = {"gemv": (_G, "GEMV_CONFIGS"), "norm": (_NG, "NORM_GEMV_CONFIGS")}


def tile_variant(spec: str) -> Callable[[], None] | None:
    """`tile:gemv:NxK:bn/bk/warps/stages` or `tile:norm:...`: any launch tile of the one-row GEMV tables
    (a sweep's best, say) without a named entry here. None when spec is not of that form."""
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] != "tile" or parts[1] not in _TILE_TABLES:
        return None
    try:
        n, k = (int(v) for v in parts[2].split("x"))
        nums = [int(v) for v in parts[3].split("/")]
    except ValueError:
        return None
    if len(nums) != 4:
        return None
    return _tile(*_TILE_TABLES[parts[1]], (n, k), **dict(zip(("block_n", "block_k", "num_warps", "num_stages"), nums)))


VARIANTS: dict[str, Callable[[], None]] = {
    "base": lambda: None,
    "splits_all": _attn_kw("Every split of the decode launch runs (no per-request split count).", min_split_tokens=1),
    "split128": _attn_kw("At most one decode split per 128 keys.", min_split_tokens=128),
    "fused_merge": _attn_kw("The split-KV merge inside the decode kernel (the last split merges).", fused_merge=True),
    "attn_bn32": _attn_kw("Decode attention blocks of 32 keys.", block_n=32),
    "attn_bn64": _attn_kw("Decode attention blocks of 64 keys.", block_n=64),
    "down_after_wait": _down_after_wait,
    "lm_cublas": _lm_cublas,
    "gdn_bv8": _gdn_small_batch_tile(8, 1, 3),
    "gdn_bv32": _gdn_small_batch_tile(32, 1, 1),
    "gdn_bv16s1": _gdn_small_batch_tile(16, 1, 1),
    "no_gdn_core": _no_gdn_core,
    "no_attention": _no_attention,
    "no_experts": _no_experts,
    "no_moe": _no_moe,
    # whole-K tiles: a program's entire weight slice loads before the PDL wait (as the routers' tile does)
    "qkv30_n2k2048": _tile(_NG, "NORM_GEMV_CONFIGS", (5120, 2048), block_n=2, block_k=2048, num_warps=8, num_stages=1),
    "qkv30_n4k2048": _tile(_NG, "NORM_GEMV_CONFIGS", (5120, 2048), block_n=4, block_k=2048, num_warps=8, num_stages=1),
    "o30_n2k4096": _tile(_G, "GEMV_CONFIGS", (2048, 4096), block_n=2, block_k=4096, num_warps=8, num_stages=1),
    "o30_n1k4096": _tile(_G, "GEMV_CONFIGS", (2048, 4096), block_n=1, block_k=4096, num_warps=8, num_stages=1),
    "gu30_n2k2048": _decode_tile((128, 2048, 768, "default"), "gate_up", BLOCK_N=2, BLOCK_K=2048, num_warps=8,
                                 num_stages=1),
    "dn30_n2k256": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=2, BLOCK_K=256, num_warps=4,
                                num_stages=3),
    "dn30_n4k256": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=4, BLOCK_K=256, num_warps=4,
                                num_stages=3),
    "gu36_n4k256w4s2": _decode_tile((256, 2048, 512, "default"), "gate_up", BLOCK_N=4, BLOCK_K=256, num_warps=4,
                                    num_stages=2),
    "gu36_n8k256w4s2": _decode_tile((256, 2048, 512, "default"), "gate_up", BLOCK_N=8, BLOCK_K=256, num_warps=4,
                                    num_stages=2),
    "gu36_n4k512w4s2": _decode_tile((256, 2048, 512, "default"), "gate_up", BLOCK_N=4, BLOCK_K=512, num_warps=4,
                                    num_stages=2),
    "gu36_n4k128w4s3": _decode_tile((256, 2048, 512, "default"), "gate_up", BLOCK_N=4, BLOCK_K=128, num_warps=4,
                                    num_stages=3),
    "dn36_n4k256w4s3": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=4, BLOCK_K=256, num_warps=4,
                                    num_stages=3),
    "dn36_n8k256w4s2": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=8, BLOCK_K=256, num_warps=4,
                                    num_stages=2),
    "dn36_n8k256w4s3": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=8, BLOCK_K=256, num_warps=4,
                                    num_stages=3),
    "dn36_n4k512w4s3": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=4, BLOCK_K=512, num_warps=4,
                                    num_stages=3),
    "dn36_n8k512w4s3": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=8, BLOCK_K=512, num_warps=4,
                                    num_stages=3),
    "dn36_n2k512w2s4": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=2, BLOCK_K=512, num_warps=2,
                                    num_stages=4),
    "dn30_n4k256w4s3": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=4, BLOCK_K=256, num_warps=4,
                                    num_stages=3),
    "dn30_n8k256w4s3": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=8, BLOCK_K=256, num_warps=4,
                                    num_stages=3),
    "dn30_n4k1024w4s2": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=4, BLOCK_K=1024, num_warps=4,
                                     num_stages=2),
    # the Qwen3.6 down tile (route loop 4/512/4/3) with its first 1, 2, 4 (the table's) or 8 routes loaded before
    # the PDL wait
    **{f"dn36_early{n}": _decode_tile((256, 2048, 512, "default"), "down", BLOCK_N=4, BLOCK_K=512, num_warps=4,
                                      num_stages=3, routes="loop", early=n) for n in (1, 2, 4, 8)},
    # the 30B's down as a route loop (K 768 in one 1024 chunk) with its first 1, 4 or 8 routes loaded before the wait
    **{f"dn30_loop_early{n}": _decode_tile((128, 2048, 768, "default"), "down", BLOCK_N=4, BLOCK_K=1024,
                                           num_warps=4, num_stages=3, routes="loop", early=n) for n in (1, 4, 8)},
    "qkv36_n2k2048": _tile(_NG, "NORM_GEMV_CONFIGS", (9216, 2048), block_n=2, block_k=2048, num_warps=8, num_stages=1),
}


# ---------------------------------------------------------------------------------------------- child

def child(args) -> None:
    import torch

    from bench_decode import run_decode, write_shape
    from freetoken_core.config import EngineConfig
    from freetoken_core.scheduler.scheduler import Scheduler

    for name in args.variant.split("+"):
        if not name.startswith(("env:", "tree:")):
            (VARIANTS.get(name) or tile_variant(name))()
    with tempfile.TemporaryDirectory() as tmp:
        d = write_shape(args.shape, Path(tmp))
        sched = Scheduler(EngineConfig(
            model_path=str(d), dtype="bfloat16", device="cuda", attention_backend="triton", max_running_req=args.bs,
            page_size=args.page_size, max_seq_len=args.max_seq_len or args.prompt + args.out_tokens + 16,
            load_format="dummy", memory_fraction=0.8, cuda_graph=True, prefill_graph_max_tokens=0))
        run_decode(sched, args.bs, args.prompt, 8)  # warm-up: compiles the kernels of this variant
        dt, steps, tokens = run_decode(sched, args.bs, args.prompt, args.out_tokens)
        torch.cuda.synchronize()
    print("RESULT " + json.dumps({"variant": args.variant, "ms": dt / steps * 1e3, "tok_s": tokens / dt}), flush=True)


def _env_of(variant: str) -> dict[str, str]:
    """env:NAME=VALUE parts of a variant: environment variables of its child (kernel switches, env.py)."""
    return dict(p[len("env:"):].split("=", 1) for p in variant.split("+") if p.startswith("env:"))


def _tree_of(variant: str) -> str:
    """tree:DIR part of a variant: run it on the freetoken_core package in DIR (an older tree, for an A/B of
    code that has no switch) instead of this checkout's."""
    trees = [p[len("tree:"):] for p in variant.split("+") if p.startswith("tree:")]
    return str(Path(trees[-1]).resolve()) if trees else str(HERE.parent)


def run_child(variant: str, args) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_tree_of(variant), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", **_env_of(variant)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--variant", variant, "--shape", args.shape,
           "--bs", str(args.bs), "--prompt", str(args.prompt), "--out-tokens", str(args.out_tokens),
           "--page-size", str(args.page_size), "--max-seq-len", str(args.max_seq_len)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"variant {variant} failed:\n{out.stdout[-2500:]}", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--variants", default="base",
                    help="comma-separated; a+b applies both; env:FREETOKEN_X=1 sets a kernel switch for that run; "
                         "tree:DIR runs the freetoken_core package in DIR; tile:gemv|norm:NxK:bn/bk/warps/stages "
                         "sets a one-row GEMV tile")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=0, help="0: prompt + out tokens + 16 (bench_decode's rule)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--variant", default="base")
    ap.add_argument("--list", action="store_true", help="print the variants and what each patches")
    args = ap.parse_args()
    if args.list:
        for name, patch in VARIANTS.items():
            print(f"{name}: {(patch.__doc__ or '').strip().splitlines()[0] if patch.__doc__ else '-'}")
        return
    if args.child:
        child(args)
        return
    names = args.variants.split(",")
    for n in names:
        unknown = [p for p in n.split("+")
                   if p not in VARIANTS and not (p.startswith("env:") and "=" in p) and not p.startswith("tree:")
                   and tile_variant(p) is None]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; --list shows them")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            res = run_child(n, args)
            if res:
                runs[n].append(res)
                print(f"round {r} {n}: {res['ms']:.3f} ms/step, {res['tok_s']:.1f} tok/s", flush=True)
    print(f"\n{args.shape} bs {args.bs} prompt {args.prompt} page {args.page_size} out {args.out_tokens}")
    print("| variant | ms/step (median) | tok/s (median) | runs |\n|---|---|---|---|")
    for n in names:
        if runs[n]:
            print(f"| {n} | {statistics.median(r['ms'] for r in runs[n]):.3f} | "
                  f"{statistics.median(r['tok_s'] for r in runs[n]):.1f} | {len(runs[n])} |")


if __name__ == "__main__":
    main()
