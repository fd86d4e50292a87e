"""The scheduler's private members stay inside scheduler.py: the package reaches it through its public
API (speculative decoding through scheduler/spec_host.py), and `_commit_tokens` is the one exception
(the single commit path a drafter calls)."""

from __future__ import annotations

import ast
from pathlib import Path

import freetoken_core

PACKAGE = Path(freetoken_core.__file__).parent
SCHEDULER = PACKAGE / "scheduler" / "scheduler.py"
ALLOWED = {"_commit_tokens"}


def scheduler_private_members() -> set[str]:
    """Every `_name` that class Scheduler defines: methods and `self._name` attributes."""
    tree = ast.parse(SCHEDULER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def foreign_private_uses(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each `x._name` with `_name` a Scheduler private member and `x` not `self`/`cls`
    (a class's own members of the same name are its own)."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_the_checker_sees_the_members_it_guards() -> None:
    private = scheduler_private_members()
    assert {"_pending", "_by_uid", "_outbox", "_step_reqs", "_commit_tokens"} <= private
    src = "def f(self, sched):\n    return sched._pending, self.sched._outbox, sched._commit_tokens, self._pending\n"
    assert foreign_private_uses(src, private - ALLOWED) == [(2, "_pending"), (2, "_outbox")]


def test_no_scheduler_private_member_is_used_outside_scheduler_py() -> None:
    private = scheduler_private_members() - ALLOWED
    hits = [f"{path.relative_to(PACKAGE.parent)}:{line}: .{name}"
            for path in sorted(PACKAGE.rglob("*.py")) if path != SCHEDULER
            for line, name in foreign_private_uses(path.read_text(), private)]
    assert not hits, "Scheduler private members used outside scheduler.py:\n" + "\n".join(hits)
