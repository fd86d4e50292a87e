"""The benchmark scripts start: each tool under benchmarks/ and benchmarks/dev/ answers --help (argparse), so a
moved file whose imports no longer resolve fails here, and the README's list of tools names only files that exist.

The scripts run in this process (runpy, as `python SCRIPT --help` would, with the script's folder first on
sys.path): a subprocess each would import torch twenty times over."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS

REPO = BENCHMARKS.parent
# modules other scripts import, not tools
HELPERS = {"soak_requests.py", "openai_pa.py"}
# perf_analyzer's helpers read sys.argv themselves (sub-commands and file lists): their usage is their docstring
NO_ARGPARSE = {"pa_clients.py", "pa_export.py", "pa_summary.py"}
SCRIPTS = sorted(p for p in [*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "dev").glob("*.py")]
                 if p.name not in HELPERS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_each_tool_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    if script.name in NO_ARGPARSE:
        runpy.run_path(str(script), run_name="freetoken_bench_help")  # imports resolve; no main() run
        return
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_the_perf_analyzer_script_answers_help():
    out = subprocess.run(["bash", str(BENCHMARKS / "gpu_perf_analyzer.sh"), "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "perf_analyzer" in out.stdout and "MODEL_DIR|SHAPE" in out.stdout


def test_docs_tests_and_scripts_name_only_benchmarks_that_exist():
    """Every `benchmarks/...` script named by the README, docs/, the benchmarks themselves, the tests, the client
    examples or the Makefile is a file of the repository (a moved or deleted script leaves no stale pointer)."""
    texts = [REPO / "README.md", REPO / "Makefile", *(REPO / "docs").glob("*.md")]
    for folder, patterns in ((BENCHMARKS, ("*.md", "*.py", "*.sh")), (REPO / "tests", ("*.py",)),
                             (REPO / "client_examples", ("*.py", "*.sh"))):
        texts += [p for pattern in patterns for p in folder.rglob(pattern)]
    named = {(m, text.relative_to(REPO)) for text in texts
             for m in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh)\b", text.read_text())}
    assert any(str(where) == "README.md" for _, where in named), "the README names no benchmark script"
    missing = sorted((n, str(where)) for n, where in named if not (REPO / n).is_file())
    assert not missing, missing
