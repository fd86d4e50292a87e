"""Scripts under benchmarks/ are not a package: tests load one by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py (e.g. "soak", "dev/pa_export") as a module, registered in sys.modules (dataclasses
    look their module up by name)."""
    spec = importlib.util.spec_from_file_location(f"freetoken_bench_{name.replace('/', '_')}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
