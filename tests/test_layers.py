"""The package's import graph: no cycles, and no import that runs up the layers.

Layers, lowest first (DESIGN.md): kernels -> the ring (ringflash's own modules, the transport
among them) -> train -> launch. A module may import its own layer or a lower one. The graph is
read from the source's import statements (module-level and inside functions), not by importing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.dist_utils import REPO

# Installed name -> source folder (pyproject.toml's package-dir).
PACKAGES = {"ringflash.kernels": REPO / "kernels", "ringflash.train": REPO / "train", "ringflash": REPO / "ringflash"}
LAYERS = ["ringflash.kernels", "ringflash", "ringflash.train", "launch"]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    for path in (REPO / "launch").glob("*.py"):
        mods[f"launch.{path.stem}"] = path
    return mods


def _layer(module: str) -> int:
    if module.startswith("launch."):
        return 3
    for i, prefix in ((0, "ringflash.kernels"), (2, "ringflash.train")):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return 1


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `module` imports (absolute and relative), resolved to known names."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names = [root] + [f"{root}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_import_runs_up_the_layers():
    graph = _graph()
    up = [(m, d) for m, deps in graph.items() for d in deps
          if _layer(d) > _layer(m) and not (d == "ringflash" and _layer(m) == 0)]
    assert up == [], "imports from a lower layer into a higher one (kernels -> ring -> train -> launch): " + str(up)


def test_no_import_cycles():
    # Package __init__ files re-export their modules and are imported by them for those names;
    # cycles are checked among the modules proper.
    full = _graph()
    inits = {m for m, p in _modules().items() if p.name == "__init__.py"}
    graph = {m: {d for d in deps if d not in inits} for m, deps in full.items() if m not in inits}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_graph_is_read():
    # The walk finds the layers' real edges (a walk that found nothing would pass the tests above).
    graph = _graph()
    assert "ringflash.kernels.spec" in graph["ringflash.layout"]
    assert "ringflash.ring" in graph["ringflash.ops"]
    assert "ringflash.transport" in graph["ringflash.ops"]
    assert any(d.startswith("ringflash.train") for d in graph["launch.train"])
