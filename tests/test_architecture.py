"""The package's shape: imports point down the layers (commands -> api/builder -> serve, tools -> decoding,
verifiers -> quant, kernels -> model -> spec, files), with no cycle hidden in a function-level import or a
registry table; the model never imports quant/ or kernels/ (they swap modules afterwards)."""

from __future__ import annotations

import ast
from pathlib import Path

import quasar

SRC = Path(quasar.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def dependencies(name: str) -> set[str]:
    """Every quasar module `name` imports, at the top or inside a function, or names in a string table
    ("quasar.verifiers.quantized:load_w8a8")."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("quasar."):
            found.add(node.value.partition(":")[0])
    return {d for d in found if d in MODULES and d != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {name: dependencies(name) for name in MODULES}
    assert cycles(graph) == []


# package -> the packages it must never import (imports point down: commands -> api/builder -> serve, tools ->
# decoding, verifiers -> quant, kernels -> model -> spec, files)
FORBIDDEN = {
    "quasar.model": ("quasar.quant", "quasar.kernels", "quasar.decoding", "quasar.verifiers", "quasar.tools",
                     "quasar.serve", "quasar.commands", "quasar.api", "quasar.builder"),
    "quasar.quant": ("quasar.decoding", "quasar.verifiers", "quasar.tools", "quasar.serve", "quasar.commands",
                     "quasar.api", "quasar.builder"),
    "quasar.kernels": ("quasar.decoding", "quasar.verifiers", "quasar.tools", "quasar.serve", "quasar.commands",
                       "quasar.api", "quasar.builder"),
    "quasar.verifiers": ("quasar.decoding", "quasar.tools", "quasar.serve", "quasar.commands", "quasar.api",
                         "quasar.builder"),
    "quasar.decoding": ("quasar.tools", "quasar.serve", "quasar.commands", "quasar.api",
                        "quasar.builder"),
    "quasar.serve": ("quasar.tools", "quasar.commands"),
    "quasar.tools": ("quasar.serve", "quasar.commands"),
}
LEAVES = ("quasar.files", "quasar.spec", "quasar.registry", "quasar.version")


def test_imports_point_down_the_layers():
    wrong = sorted(f"{name} -> {d}" for name in MODULES for package, banned in FORBIDDEN.items()
                   if name.startswith(package + ".") or name == package
                   for d in dependencies(name) if d.startswith(banned))
    assert wrong == []


def test_the_leaves_import_no_other_module():
    for name in LEAVES:
        assert dependencies(name) == set(), name


def test_one_registry_idiom():
    """Only registry.lookup imports a module by name (besides the package's lazy exports and the CLI's commands)."""
    by_name = {name for name, path in MODULES.items() if "import_module(" in path.read_text()}
    assert by_name == {"quasar.registry", "quasar", "quasar.cli"}


def test_the_model_never_imports_quant_or_the_kernels_switch():
    for name in ("quasar.model.llama", "quasar.kernels.layers", "quasar.model.config"):
        assert not {d for d in dependencies(name) if d.startswith(("quasar.quant", "quasar.kernels.plan", "quasar.kernels.native"))}


def test_files_is_a_leaf():
    assert dependencies("quasar.files") == set()
