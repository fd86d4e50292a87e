"""No import cycle inside the subpackages whose layering the design fixes: a cycle there means two
modules that cannot be read (or changed) apart. Imports under `if TYPE_CHECKING:` are type-only and
do not count; imports inside functions do (they run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import freetoken_core

PACKAGE = Path(freetoken_core.__file__).parent
CHECKED = ("scheduler", "layers")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package modules `module` imports when it runs (TYPE_CHECKING blocks skipped)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if target in known:
                out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {m: runtime_imports(p.read_text(), m, p.name == "__init__.py", known) for m, p in paths.items()}


def cycles_within(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Strongly connected components (more than one module) of the imports among `prefix`'s modules."""
    nodes = [m for m in graph if m == prefix or m.startswith(prefix + ".")]
    edges = {m: {t for t in graph[m] if t in nodes} for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strongconnect(v)
    return found


def test_the_walker_sees_relative_imports_and_skips_type_only_ones() -> None:
    known = {"freetoken_core.a.x", "freetoken_core.a.y", "freetoken_core.a.z", "freetoken_core.core"}
    src = ("from typing import TYPE_CHECKING\nfrom .y import f\nfrom ..core import Req\n"
           "if TYPE_CHECKING:\n    from .z import g\n"
           "def h():\n    from . import z\n")
    assert runtime_imports(src, "freetoken_core.a.x", False, known) == {
        "freetoken_core.a.y", "freetoken_core.core", "freetoken_core.a.z"}
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert cycles_within(graph, "p") == [["p.a", "p.b"]]


@pytest.mark.parametrize("sub", CHECKED)
def test_no_import_cycle_inside(sub: str) -> None:
    cycles = cycles_within(import_graph(), f"freetoken_core.{sub}")
    assert not cycles, f"import cycles inside freetoken_core/{sub}: {cycles}"
