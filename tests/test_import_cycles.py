"""No import cycles inside serving/, scheduler/ or layers/: modules import one way along the request path.

Walks each module's imports by AST (relative imports resolved; imports under `if TYPE_CHECKING:` excepted, as
they never run) and fails on any cycle among the modules of one subpackage tree.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "freetoken_core"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (its else branch runs, so it is walked)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package modules `path` imports at run time (a `from pkg import name` names the module pkg.name where
    that is one, else pkg)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def import_graph(subpackage: str) -> dict[str, set[str]]:
    files = sorted((PACKAGE_ROOT / subpackage).rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, known) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colours white/grey/black)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_sees_a_cycle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_type_checking_imports_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "freetoken_core" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n    from .c import C\n")
    (pkg / "b.py").write_text("from .a import thing\n")
    (pkg / "c.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", tmp_path / "freetoken_core")
    graph = import_graph("demo")
    assert graph["freetoken_core.demo.a"] == {"freetoken_core.demo.b"}
    assert find_cycle(graph) == ["freetoken_core.demo.a", "freetoken_core.demo.b", "freetoken_core.demo.a"]


@pytest.mark.parametrize("subpackage", [
    "serving",
    "scheduler",
    "layers",
])
def test_no_import_cycle(subpackage):
    cycle = find_cycle(import_graph(subpackage))
    assert cycle is None, f"import cycle in freetoken_core/{subpackage}: {' -> '.join(cycle)}"
