"""The package's shape: layers in subpackages without an import cycle between them or among their modules, a few
modules at the top, none too long to read, no reaching into another module's private names.

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
MODULE_LINES = 400
TOP_LEVEL_MODULES = 8  # nugget_rag/*.py, __init__.py included
LONG_ALLOWED = ("nugget_rag.cli", "nugget_rag.train")  # the CLI's one parser, and the trainer's own package


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


def annotation_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:`."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def imported(module: str, path: Path, modules: dict[str, Path], annotations: bool = True) -> set[str]:
    """The project modules `module` imports, anywhere in its source (`annotations` False: not under
    TYPE_CHECKING)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if annotations else annotation_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
    assert "nugget_rag.model.nugget_model" in graph["nugget_rag"]  # relative, from a package's __init__
    assert "nugget_rag.integrations.index" in graph["nugget_rag.integrations"]  # package-dir mapping
    assert "nugget_rag.model.nugget_model" in graph["nugget_rag.eval.systems.base"]  # under TYPE_CHECKING
    assert "nugget_rag.integrations" in graph["nugget_rag.cli"]  # inside a function


def test_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer(module: str) -> str:
    """The layer a module belongs to: its subpackage of nugget_rag, or the top-level module itself."""
    return module.split(".")[1] if "." in module else module


def test_layers_import_each_other_without_a_cycle():
    """Subpackages and top-level modules as nodes (entry points aside), by what runs: a type annotation may name a layer above (the
    reading plan's compressor, say) without making it a dependency."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        if module.endswith(".__main__"):  # `python -m` entry points sit above every layer
            continue
        imports = imported(module, path, modules, annotations=False)
        graph.setdefault(layer(module), set()).update(layer(m) for m in imports if layer(m) != layer(module))
    for node in list(graph.values()):
        for name in node:
            graph.setdefault(name, set())
    cycle = find_cycle(graph)
    assert cycle is None, "layers in a cycle: " + " -> ".join(cycle)


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in PACKAGES["nugget_rag"].glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, f"nugget_rag/ has {len(top)} modules ({', '.join(top)}): at most " \
        f"{TOP_LEVEL_MODULES}; put a module in the subpackage of its layer"


def test_modules_read_in_one_sitting():
    long = {module: n for module, path in project_modules().items()
            if not module.startswith(LONG_ALLOWED) and (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}; split them by job"


def private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, attributes it assigns (`self._x = ...`), constants."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_names():
    """Neither `from x import _name` nor `obj._name` where `_name` belongs to another of the project's modules
    (`index._add` from outside the index's module, say); a third-party library's own internals are not counted."""
    modules = project_modules()
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in modules.items()}
    owned = {module: private_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(names for other, names in owned.items() if other != module)) - owned[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{module}: from {'.' * node.level}{node.module or ''} import {', '.join(private)}")
            elif isinstance(node, ast.Attribute) and node.attr in others and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "another module's private names used:\n" + "\n".join(found)


def test_model_py_reads_in_one_sitting():
    lines = len((ROOT / "nugget_rag" / "model" / "nugget_model.py").read_text().splitlines())
    assert lines <= MODEL_LINES, f"nugget_rag/model/nugget_model.py has {lines} lines (at most {MODEL_LINES}): move a concern out"
