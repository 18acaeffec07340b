"""The package's import graph: no cycles, and no import that runs up the layers.

Layers, lowest first (README.md, "Layout of the repository"): kernels -> the ring (ringflash's
own modules, the transport among them) -> train -> launch. A module may import its own layer or a
lower one. The graph is read from the source's import statements (module-level and inside
functions), not by importing. Package `__init__` files are nodes like any module: a module that
takes a name from its own package's `__init__`, which imports that module in turn, is a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.dist_utils import REPO

# Installed name -> source folder (pyproject.toml's package-dir).
PACKAGES = {"ringflash.kernels": REPO / "kernels", "ringflash.train": REPO / "train", "ringflash": REPO / "ringflash"}

# Cycles kept on purpose: (importer, imported) -> why.
KNOWN_CYCLES = {
    ("ringflash.kernels.varlen", "ringflash.kernels"): "varlen wraps the package's own attn_fwd/attn_bwd, "
    "which the __init__ defines before importing varlen last to re-export it",
}


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
    """The project modules `module` imports (absolute and relative), resolved to known names.

    `from pkg import sub` with `sub` a module is an edge to `sub` only when `pkg` is one of the
    importer's own packages (Python has run that `__init__` before the importer anyway); a name
    defined in `pkg/__init__.py` is an edge to `pkg`."""

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = (
                ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module
            )
            subs = [f"{root}.{a.name}" for a in node.names]
            names = [s if s in known else root for s in subs]
            if root not in parents:
                names.append(root)
        for name in names:
            name = resolve(name)
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_runs_up_the_layers():
    graph = _graph()
    up = [(m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)]
    assert up == [], "imports from a lower layer into a higher one (kernels -> ring -> train -> launch): " + str(up)


def test_no_import_cycles():
    graph = {m: {d for d in deps if (m, d) not in KNOWN_CYCLES} for m, deps in _graph().items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_known_cycles_are_still_there():
    # An exception that no longer applies is removed, not kept.
    graph = _graph()
    assert [e for e in KNOWN_CYCLES if e[1] not in graph.get(e[0], ())] == []


def test_the_graph_is_read():
    # The walk finds the layers' real edges (a walk that found nothing would pass the tests above).
    graph = _graph()
    assert "ringflash.kernels.spec" in graph["ringflash.layout"]
    assert "ringflash.ring" in graph["ringflash.ops"]
    assert "ringflash.transport" in graph["ringflash.ops"]
    assert any(d.startswith("ringflash.train") for d in graph["launch.train"])
    # __init__ files are read: the kernels package re-exports its backends; a name taken from
    # a package's __init__ is an edge to it, a submodule taken from one's own package is not.
    assert "ringflash.kernels.backends" in graph["ringflash.kernels"]
    assert "ringflash.kernels" in graph["ringflash.kernels.varlen"]
    assert "ringflash" not in graph["ringflash.kernels.varlen"]


def test_a_cycle_through_an_init_is_found():
    # The back-edge the old walk missed: a module below a package's __init__ taking a name from it.
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}}
    assert _cycle(graph) == ["p", "p.a", "p.b", "p"]


def test_launch_scripts_import_no_sibling():
    # launch/ is a folder of scripts: one importing another by its bare name works only because
    # Python puts a script's own folder on sys.path, and hides the edge from the graph above.
    # What scripts share lives in the library (ringflash.bench).
    scripts = {p.stem for p in (REPO / "launch").glob("*.py")}
    bad = []
    for path in sorted((REPO / "launch").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bad += [(path.name, n) for n in names if n.split(".")[0] in scripts]
    assert bad == [], "launch scripts importing each other: " + str(bad)
