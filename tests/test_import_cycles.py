"""Imports point one way: no cycle among quasar's modules, counting imports inside functions and the
"module:function" names of registry tables (imported on first use)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import quasar

ROOT = Path(quasar.__file__).parent
REGISTRY_ENTRY = re.compile(r"quasar(\.\w+)+:\w+")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, package: str) -> list[str]:
    """The module names one AST node imports (or names in a registry table)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        return [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in `base`
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and REGISTRY_ENTRY.fullmatch(node.value):
        return [node.value.partition(":")[0]]
    return []


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}

    def owner(name: str) -> str | None:  # the longest quasar module that `name` is or lies in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {owner(t) for node in ast.walk(ast.parse(path.read_text())) for t in imported(node, package)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_the_graph_sees_function_level_and_registry_imports():
    graph = import_graph()
    assert "quasar.bench.peers" in graph["quasar.bench.methods"]  # only named in the METHODS table
    assert "quasar.speculative" in graph["quasar.api"]  # imported inside build_decoder


def test_no_import_cycles():
    graph = import_graph()
    cycles = [" -> ".join(c) for c in (cycle_through(graph, m) for m in sorted(graph)) if c]
    assert cycles == []
