"""Every kernel specialization the CPU tests launched under the interpreter also passes Triton's GPU
frontend for sm_90 (tests/triton_launches.py says why). Ordered after every other test (tests/conftest.py),
so that it sees their launches; alone, it has nothing to check and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import triton_launches

ROOT = Path(__file__).resolve().parents[1]


def _frontend(tmp_path: Path, launches: list[dict], import_root: Path | None = None) -> list[dict]:
    """Run tests/sm90_frontend.py on `launches` in a process of its own (TRITON_INTERPRET=0): its output lines,
    one per failed launch, then the counts; the exit status says whether any failed."""
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    roots = [str(p) for p in (import_root, ROOT) if p is not None]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "tests.sm90_frontend", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines and out.returncode == int(lines[-1]["failed"] > 0), out.stdout[-3000:] + out.stderr[-3000:]
    return lines


@pytest.mark.runs_last
def test_recorded_launches_pass_the_sm90_frontend(tmp_path):
    launches = triton_launches.recorded()
    if not launches:
        pytest.skip("no interpreted kernel launches were recorded: run it with the kernel tests (a GPU machine "
                    "compiles them in its own tests)")
    lines = _frontend(tmp_path, launches)
    assert lines[-1].get("checked") == len(launches), lines[-1]
    assert lines[-1].get("pdl_variants", 0) > 0, lines[-1]  # the decode kernels' PDL branches were compiled too
    failures = lines[:-1]
    assert not failures, "\n".join(f"{f['kernel']}: {f['error']}" for f in failures[:10])
    # the launches the recorder could not describe (an argument kind it does not know) were not checked
    assert not triton_launches.unrecordable(), triton_launches.unrecordable()


def _check_probe(tmp_path, kernels: dict[str, str]) -> list[dict]:
    """Write a module of jit kernels (name -> body), check a launch of each, return the output lines."""
    pkg = tmp_path / "freetoken_core_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = ["import triton", "import triton.language as tl", "",
           "@triton.jit", "def helper(x_ptr, CACHE: tl.constexpr = ''):", "    return tl.load(x_ptr, cache_modifier=CACHE)"]
    for name, body in kernels.items():
        src += ["", "@triton.jit", f"def {name}(x_ptr, y_ptr):", f"    {body}"]
    (pkg / "kernels.py").write_text("\n".join(src) + "\n")
    launches = [{"module": "freetoken_core_probe.kernels", "name": name,
                 "args": {"x_ptr": ["tensor", "float32"], "y_ptr": ["tensor", "float32"]}, "options": {}}
                for name in kernels]
    return _frontend(tmp_path, launches, import_root=tmp_path)


def test_the_frontend_check_reports_what_fails_to_compile(tmp_path):
    """A range that is not a power of two fails the frontend on every Triton; a well-formed kernel passes.
    On Triton 3.6 (the GPU image's) also the bug this check exists for: a jit helper's `tl.constexpr = ""`
    default, which the interpreter runs and the GPU compiler rejects."""
    import triton

    kernels = {"bad_range": "tl.store(y_ptr + tl.arange(0, 3), tl.load(x_ptr + tl.arange(0, 3)))",
               "good": "tl.store(y_ptr, helper(x_ptr, ''))"}
    if triton.__version__.startswith("3.6."):
        kernels["bad_default"] = "tl.store(y_ptr, helper(x_ptr))"
    lines = _check_probe(tmp_path, kernels)
    failed = sorted(f["kernel"].rsplit(".", 1)[1] for f in lines[:-1])
    assert failed == sorted(k for k in kernels if k.startswith("bad")), lines
    assert lines[-1] == {"checked": len(kernels), "failed": len(failed)}
