"""The package's shape: no import cycle among its modules, and a model.py that reads in one sitting.

Imports are read with `ast`, wherever they stand (inside functions, under `if TYPE_CHECKING:`): a lazy import that
dodges a cycle at run time is still a cycle. `integrations/` is installed as `nugget_rag.integrations`
(pyproject.toml's package-dir), so `integrations.x` and `nugget_rag.integrations.x` name one module. Importing
`a.b.c` runs `a/b/__init__.py` first; that implicit edge is not counted, as in other import linters.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"nugget_rag": ROOT / "nugget_rag", "nugget_rag.integrations": ROOT / "integrations"}
ALIASES = {"integrations": "nugget_rag.integrations"}  # how tests and scripts import the integrations folder
MODEL_LINES = 350


def project_modules() -> dict[str, Path]:
    """Every module of the package by its installed name."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def canonical(name: str) -> str:
    for alias, target in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return target + name[len(alias):]
    return name


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [canonical(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = canonical(node.module)
            # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `import pkg.mod.attr` style: the longest known prefix
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@cache
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {module: imported(module, path, modules) for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "nugget_rag.model" in graph["nugget_rag"]  # relative, from a package's __init__
    assert "nugget_rag.integrations.index" in graph["nugget_rag.integrations"]  # package-dir mapping
    assert "nugget_rag.model" in graph["nugget_rag.eval.systems.base"]  # under TYPE_CHECKING, three levels up
    assert "nugget_rag.integrations" in graph["nugget_rag.cli"]  # inside a function


def test_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_model_py_reads_in_one_sitting():
    lines = len((ROOT / "nugget_rag" / "model.py").read_text().splitlines())
    assert lines <= MODEL_LINES, f"nugget_rag/model.py has {lines} lines (at most {MODEL_LINES}): move a concern out"
