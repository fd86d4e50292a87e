"""Compile kernel launches (tests/triton_launches.py's records) all the way to an sm_90 cubin, without a GPU, and say
which matmul instruction each one got: `python -m tests.sm90_cubin LAUNCHES.json` prints one JSON line per launch
({"kernel", "ok", "wgmma"} or the error). Where tests/sm90_frontend.py stops at Triton IR, this runs the layout
passes, LLVM and ptxas: what decides whether a tl.dot becomes Hopper's wgmma (FP8 operands need it K-major).
Run in a process of its own (TRITON_INTERPRET=0), as sm90_frontend."""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports triton

import triton  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from tests.sm90_frontend import OPTION_NAMES, TARGET, signature_of  # noqa: E402


def compile_one(rec: dict) -> dict:
    where = f"{rec['module']}.{rec['name']}"
    try:
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        signature, constexprs = signature_of(fn, rec["args"])
        options = {k: v for k, v in rec["options"].items() if k in OPTION_NAMES}
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=TARGET, options=options)
        return {"kernel": where, "ok": True, "wgmma": "warp_group_dot" in kernel.asm["ttgir"]}
    except Exception as e:  # noqa: BLE001 - every failure is reported, with the launch that hit it
        return {"kernel": where, "ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}


def main() -> int:
    with open(sys.argv[1]) as f:
        results = [compile_one(rec) for rec in json.load(f)]
    for r in results:
        print(json.dumps(r))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
