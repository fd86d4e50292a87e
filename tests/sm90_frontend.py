"""Put recorded kernel launches (tests/triton_launches.py) through Triton's GPU frontend for an sm_90 target,
without a GPU: `python -m tests.sm90_frontend LAUNCHES.json` prints one JSON line per launch that failed
and exits 1 if any did.

Run in a process of its own with TRITON_INTERPRET=0, so that `triton.jit` gives compilable JITFunctions
(the tests' process has the interpreter's). Only the frontend (Python AST -> Triton IR) runs: it is where
a kernel's Python meets the compiler's rules, and it takes milliseconds a kernel; the later stages
(layouts, LLVM, PTX) run on the GPU machine's tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports triton

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # the H200
POINTER = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
           "float8_e4m3fn": "fp8e4nv"}


def _value(desc: list):
    kind = desc[0]
    if kind == "const":
        return desc[1]
    if kind == "none":
        return None
    if kind == "tl_dtype":
        return tl.dtype(desc[1])
    raise ValueError(f"not a constexpr description: {desc}")


def signature_of(fn, args: dict[str, list]) -> tuple[dict[str, str], dict[str, object]]:
    signature, constexprs = {}, {}
    for param in fn.params:
        desc = args.get(param.name)
        if desc is None:  # left to its default
            if param.is_constexpr or param.default is None:
                signature[param.name] = "constexpr"
                constexprs[param.name] = param.default
                continue
            raise ValueError(f"argument {param.name} was not recorded")
        kind = desc[0]
        if param.is_constexpr or kind in ("none", "tl_dtype", "const"):
            signature[param.name] = "constexpr"
            constexprs[param.name] = _value(desc)
        elif kind == "tensor":
            signature[param.name] = "*" + POINTER[desc[1]]
        else:
            signature[param.name] = kind
    return signature, constexprs


BACKEND = make_backend(TARGET)
OPTION_NAMES = {f.name for f in dataclasses.fields(BACKEND.parse_options({}))}


def to_ttir(fn, signature: dict[str, str], constexprs: dict[str, object], options: dict) -> None:
    """The first stage of `triton.compile` for TARGET (compiler.py: parse options, load dialects, make_ir)."""
    backend = BACKEND
    src = ASTSource(fn, signature, constexprs)
    opts = backend.parse_options({k: v for k, v in {**options, **src.parse_options()}.items() if k in OPTION_NAMES})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src.make_ir(TARGET, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)


def with_pdl(launches: list[dict]) -> list[dict]:
    """Each launch that ran without PDL (USE_PDL false: the interpreter never chains kernels) once more as
    the GPU launches it, with PDL: the branches that load weights or expert ids before the PDL wait exist
    only there."""
    extra = []
    for rec in launches:
        if rec["args"].get("USE_PDL") == ["const", False]:
            extra.append({**rec, "args": {**rec["args"], "USE_PDL": ["const", True]}})
    return launches + extra


def check(launches: list[dict]) -> list[dict]:
    failures = []
    for rec in launches:
        where = f"{rec['module']}.{rec['name']}"
        try:
            fn = getattr(importlib.import_module(rec["module"]), rec["name"])
            if not isinstance(fn, triton.runtime.JITFunction):
                raise TypeError(f"{where} is {type(fn).__name__}, not a JITFunction")
            signature, constexprs = signature_of(fn, rec["args"])
            to_ttir(fn, signature, constexprs, rec["options"])
        except Exception as e:  # noqa: BLE001 - every failure is reported, with the launch that hit it
            failures.append({"kernel": where, "args": rec["args"], "error": f"{type(e).__name__}: {e}"[:2000]})
    return failures


def main() -> int:
    with open(sys.argv[1]) as f:
        launches = json.load(f)
    compiled = with_pdl(launches)
    failures = check(compiled)
    for failure in failures:
        print(json.dumps(failure))
    pdl_variants = len(compiled) - len(launches)
    print(json.dumps({"checked": len(launches), "failed": len(failures),
                      **({"pdl_variants": pdl_variants} if pdl_variants else {})}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
