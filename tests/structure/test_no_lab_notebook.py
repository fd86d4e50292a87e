"""The package says why, not how it was found: no session history in its code, comments or docstrings (the
figures live in benchmarks/RESULTS.md). `start_new_session` is subprocess's keyword, not narrative."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "freetoken_core"
NARRATIVE = re.compile(r"[a-z]+(st|nd|rd|th) session|\bsessions?\b", re.IGNORECASE)


def narrative_lines(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NARRATIVE.search(line.replace("start_new_session", "")):
                hits.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return hits


def test_the_scan_sees_narrative(tmp_path):
    (tmp_path / "a.py").write_text("x = 1  # measured in the twelfth session\nsubprocess.Popen(start_new_session=True)\n")
    assert narrative_lines(tmp_path) == [f"{tmp_path.name}/a.py:1: x = 1  # measured in the twelfth session"]


def test_no_session_narrative_in_the_package():
    assert narrative_lines(PACKAGE) == []
