"""Every Triton kernel launch the CPU tests make, recorded, so that the same specializations can be put
through the GPU compiler's frontend (tests/test_sm90_frontend.py, tests/sm90_frontend.py).

Why: on CPU the kernels run under Triton's interpreter, which executes their Python and never compiles
them. A kernel that is correct there can still fail to compile on the GPU (Triton 3.6 rejected a str
default of a jit helper that every MoE model calls; no CPU test noticed). Triton compiles for an sm_90
target without a GPU, so the recorded launches can be compiled to Triton IR on any machine.

A launch is recorded as (module, kernel name, each argument described, launch options), with the
values of non-constexpr scalars dropped (the compiler sees only their type): one record per
specialization, however often the tests launch it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

# launch keywords that are compile options, not kernel arguments
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "enable_fp_fusion")
_INT32 = range(-(2 ** 31), 2 ** 31)

_records: dict[str, dict] = {}
_unrecordable: dict[str, str] = {}  # kernel -> why


def describe(value: Any, constexpr: bool) -> list | None:
    """A JSON-able description of one argument (None: a kind this recorder does not know)."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch.")]
    if value is None:
        return ["none"]
    if isinstance(value, tl.dtype):
        return ["tl_dtype", value.name]
    if constexpr:
        if isinstance(value, (bool, int, float, str)):
            return ["const", value]
        return None
    if isinstance(value, bool):
        return ["i1"]
    if isinstance(value, int):
        return ["i32" if value in _INT32 else "i64"]
    if isinstance(value, float):
        return ["fp32"]
    return None


def _is_constexpr(param: inspect.Parameter) -> bool:
    # annotations are strings under `from __future__ import annotations`
    return "constexpr" in str(param.annotation)


@functools.cache
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def record(fn, args: tuple, kwargs: dict) -> None:
    """Called for every interpreted launch of `fn` (the kernel's Python function)."""
    if not fn.__module__.startswith("freetoken_core."):
        return
    name = f"{fn.__module__}.{fn.__qualname__}"
    signature = _signature(fn)
    params = signature.parameters
    kernel_kwargs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    try:
        bound = signature.bind(*args, **kernel_kwargs)
    except TypeError as e:
        _unrecordable[name] = str(e)
        return
    described = {}
    for arg_name, value in bound.arguments.items():
        d = describe(value, _is_constexpr(params[arg_name]))
        if d is None:
            _unrecordable[name] = f"{arg_name}: {type(value).__name__}"
            return
        described[arg_name] = d
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS and isinstance(v, (bool, int))}
    rec = {"module": fn.__module__, "name": fn.__qualname__, "args": described, "options": options}
    key = repr(sorted((k, repr(v)) for k, v in rec.items()))
    _records.setdefault(key, rec)


def install() -> bool:
    """Record every interpreted launch from now on; False where kernels are compiled (a GPU machine)."""
    from freetoken_core.env import triton_interpreted

    if not triton_interpreted():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_records_launches", False):
        return True
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        record(self.fn, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._records_launches = True
    InterpretedFunction.run = run
    return True


def recorded() -> list[dict]:
    return list(_records.values())


def unrecordable() -> dict[str, str]:
    return dict(_unrecordable)
