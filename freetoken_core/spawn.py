"""Child processes started with "spawn" (CUDA cannot be forked), from a Python or from Triton's stub."""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any


def spawn_context() -> Any:
    """torch.multiprocessing's spawn context with a real Python as the child's executable: inside
    Triton's Python-backend stub `sys.executable` is the stub binary, which cannot run a child."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    exe = sys.executable
    if not os.path.basename(exe or "").startswith("python"):
        exe = shutil.which("python3") or exe
    ctx.set_executable(exe)
    return ctx
