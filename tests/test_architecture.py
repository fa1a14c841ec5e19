"""The package's shape: layers in subpackages, each importing only the layers README's layout table lists above
it, without an import cycle between them or among their modules, a few modules at the top, none too long to read, no
reaching into another module's private names or private modules.

Imports are read with `ast`, wherever they stand (inside functions, under `if TYPE_CHECKING:`): a lazy import that
dodges a cycle at run time is still a cycle, and an annotation that names a layer above is still a dependency on it.
`integrations/` is installed as `nugget_rag.integrations` (pyproject.toml's package-dir), so `integrations.x` and
`nugget_rag.integrations.x` name one module. Importing `a.b.c` runs `a/b/__init__.py` first; that implicit edge is not
counted, as in other import linters. Each rule is shown to fail on a module injected with a violation.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"nugget_rag": ROOT / "nugget_rag", "nugget_rag.integrations": ROOT / "integrations"}
ALIASES = {"integrations": "nugget_rag.integrations"}  # how tests and scripts import the integrations folder
MODEL_LINES = 350
MODULE_LINES = 400
TOP_LEVEL_MODULES = 6  # nugget_rag/*.py, __init__.py included
# integrations/'s subpackages that README's layout table must list in this order, the first lowest: the published index
# reads the local index, which reads the stores, never back
INTEGRATIONS_ORDER = ("integrations/stores", "integrations/local", "integrations/published")
INTEGRATIONS_TOP = {"nugget_rag.integrations.nugget_model", "nugget_rag.integrations.ray_ingest"}  # outside them
# public import paths that re-export: users import through them, the package from the modules they re-export
RE_EXPORTS = {"nugget_rag.resolution", "nugget_rag.integrations.ray_ingest"}


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


def imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[ast.stmt, str]]:
    """(statement, project module it imports) for each import anywhere in the module's source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
                yield node, name


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {module: {name for _, name in imports(module, path, modules)} for module, path in modules.items()}


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


def layer(module: str) -> str:
    """The layer a module belongs to: the module inside a subpackage that README's layout table gives a row of its
    own (`cli/options`, below the harness's layers that read it), else its subpackage of nugget_rag, or the
    top-level module itself."""
    parts = module.split(".")[1:] or [module]
    nested = ("/".join(parts[:n]) for n in range(len(parts), 1, -1))
    return next((name for name in nested if name in layout_rows()), parts[0])


def layer_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Layers as nodes, by every import between their modules; `python -m` entry points (`__main__`) sit above every
    layer and are left out."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph(modules).items():
        if not module.endswith(".__main__"):
            graph.setdefault(layer(module), set()).update(layer(m) for m in imported if layer(m) != layer(module))
    for node in list(graph.values()):
        for name in node:
            graph.setdefault(name, set())
    return graph


@functools.cache
def layout_rows() -> dict[str, int]:
    """Each layer's row in README's layout table, the first row 0: the folders and modules its first cell names."""
    table = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for row, line in enumerate(line for line in table.splitlines() if line.startswith("| `")):
        for path in re.findall(r"`([^`]+)`", line.split("|")[1]):
            name = path.removeprefix("nugget_rag/").removesuffix("/").removesuffix(".py")
            rows.setdefault("nugget_rag" if name == "__init__" else name, row)
    return rows


def upward_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of a layer from its own row of the layout table or a later one (entry points aside)."""
    rows = layout_rows()
    return sorted(f"{module} -> {name}" for module, path in modules.items() if not module.endswith(".__main__")
                  for _, name in imports(module, path, modules)
                  if layer(name) != layer(module) and rows[layer(name)] >= rows[layer(module)])


def misordered(rows: dict[str, int]) -> list[str]:
    """INTEGRATIONS_ORDER's subpackages, where README's layout table lists them otherwise (or leaves one out)."""
    found = [rows.get(name) for name in INTEGRATIONS_ORDER]
    return [] if None not in found and found == sorted(found) else list(INTEGRATIONS_ORDER)


def loose_integrations(modules: dict[str, Path]) -> list[str]:
    """integrations/'s modules in none of its subpackages (its __init__ and INTEGRATIONS_TOP aside)."""
    return sorted(module for module in modules if module.startswith("nugget_rag.integrations.")
                  and layer(module) == "integrations" and module not in INTEGRATIONS_TOP)


def re_export_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of RE_EXPORTS from inside the package."""
    return sorted(f"{module} -> {name}" for module, path in modules.items()
                  for _, name in imports(module, path, modules) if name in RE_EXPORTS)


def long_modules(modules: dict[str, Path]) -> dict[str, int]:
    return {module: n for module, path in modules.items()
            if (n := len(path.read_text().splitlines())) > MODULE_LINES}


def top_level(modules: dict[str, Path]) -> list[str]:
    """nugget_rag/*.py, __init__.py included."""
    return sorted(path.name for module, path in modules.items()
                  if module == "nugget_rag" or (module.count(".") == 1 and path.name != "__init__.py"
                                                and module.startswith("nugget_rag.")))


def model_lines(modules: dict[str, Path]) -> int:
    return len(modules["nugget_rag.model.nugget_model"].read_text().splitlines())


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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(modules: dict[str, Path]) -> list[str]:
    """Another module's private names used: `from x import _name`, `obj._name` where `_name` belongs to another of
    the project's modules (`index._add` from outside the index's module, say; a third-party library's own internals
    are not counted), and a private module (`pkg._kv`) imported from outside its package."""
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in modules.items()}
    owned = {module: private_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(names for other, names in owned.items() if other != module)) - owned[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                names = [a.name for a in node.names if private(a.name)]
                if names:
                    found.append(f"{module}: from {'.' * node.level}{node.module or ''} import {', '.join(names)}")
            elif isinstance(node, ast.Attribute) and node.attr in others and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        for node, name in imports(module, modules[module], modules):
            parts = name.split(".")
            hidden = next((i for i, part in enumerate(parts) if private(part)), None)
            if hidden is not None and not module.startswith(".".join(parts[:hidden]) + "."):
                found.append(f"{module}:{node.lineno}: imports the private module {name}")
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph(project_modules())
    assert "nugget_rag.model.nugget_model" in graph["nugget_rag"]  # relative, from a package's __init__
    assert "nugget_rag.integrations.local.index" in graph["nugget_rag.integrations"]  # package-dir mapping
    assert "nugget_rag.model.nugget_model" in graph["nugget_rag.eval.systems.base"]  # under TYPE_CHECKING
    assert "nugget_rag.integrations.ingest.ray" in graph["nugget_rag.cli.ingest"]  # inside a function


def test_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph(project_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_each_other_without_a_cycle():
    cycle = find_cycle(layer_graph(project_modules()))
    assert cycle is None, "layers in a cycle: " + " -> ".join(cycle)


def test_each_layer_imports_only_the_layers_listed_above_it():
    """README's layout table lists the layers from the bottom up: a layer imports only those of earlier rows."""
    modules = project_modules()
    unlisted = sorted({layer(module) for module in modules} - set(layout_rows()))
    assert not unlisted, f"layers missing from README's layout table: {unlisted}"
    upward = upward_imports(modules)
    assert not upward, "imports of a layer listed at or below the importer's row:\n" + "\n".join(upward)


def test_integrations_go_published_then_local_index_then_stores_never_back():
    """Each subpackage of integrations/ is a layer of README's layout table (so the rule above holds them to its
    order), the stores below the local index below the published index; its modules are in them, by job."""
    assert not misordered(layout_rows()), f"README's layout table must list {' < '.join(INTEGRATIONS_ORDER)}"
    assert not (loose := loose_integrations(project_modules())), \
        f"integrations/ modules outside its subpackages: {loose}; put each in the subpackage of its job"


def test_the_package_imports_what_a_public_path_re_exports_from_its_home():
    """One place to import the reading plan from (components/resolution.py), and Ray ingest (ingest/ray.py)."""
    assert not (found := re_export_imports(project_modules())), \
        "imports of a re-export, not of its home:\n" + "\n".join(found)


def test_the_top_level_holds_few_modules():
    top = top_level(project_modules())
    assert len(top) <= TOP_LEVEL_MODULES, f"nugget_rag/ has {len(top)} modules ({', '.join(top)}): at most " \
        f"{TOP_LEVEL_MODULES}; put a module in the subpackage of its layer"


def test_modules_read_in_one_sitting():
    long = long_modules(project_modules())
    assert not long, f"modules over {MODULE_LINES} lines: {long}; split them by job"


def test_no_module_uses_another_modules_private_names():
    found = private_uses(project_modules())
    assert not found, "another module's private names used:\n" + "\n".join(found)


def test_model_py_reads_in_one_sitting():
    lines = model_lines(project_modules())
    assert lines <= MODEL_LINES, f"nugget_rag/model/nugget_model.py has {lines} lines (at most {MODEL_LINES}): move a concern out"


INJECTED = {  # a module added to the package with one violation each, and what the rule reports
    "cycle": ("nugget_rag.model.injected", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from ..components.llm import NuggetLLM\n"),
    "upward": ("nugget_rag.state.injected", "def late():\n    from ..generation import decoding\n"),
    "long": ("nugget_rag.cli_injected", "x = 1\n" * (MODULE_LINES + 1)),
    "private module": ("nugget_rag.train.injected", "from ..eval.systems._kv import frozen_pass\n"),
    "private name": ("nugget_rag.serving.injected", "from ..integrations.local.index import _add\n"),
    "top level": ("nugget_rag.injected", "x = 1\n"),
    "options": ("nugget_rag.cli.options", "from .opening import open_index\n"),
    "model.py": ("nugget_rag.model.nugget_model", "x = 1\n" * (MODEL_LINES + 1)),
    "stores back": ("nugget_rag.integrations.stores.injected", "from ..local.index import NuggetIndex\n"),
    "local back": ("nugget_rag.integrations.local.injected", "def late():\n    from ..published import index\n"),
    "loose": ("nugget_rag.integrations.injected", "x = 1\n"),
    "re-export": ("nugget_rag.cli.injected", "from ..resolution import RESOLUTIONS\n"),
}


def test_the_integrations_order_fails_on_a_layout_table_listing_it_otherwise():
    rows = dict(layout_rows())
    assert not misordered(rows)
    rows["integrations/published"], rows["integrations/local"] = rows["integrations/local"], rows["integrations/published"]
    assert misordered(rows) == list(INTEGRATIONS_ORDER)
    assert misordered({name: row for name, row in layout_rows().items() if name != "integrations/stores"})


@pytest.mark.parametrize("rule", INJECTED)
def test_each_rule_fails_on_an_injected_violation(rule, tmp_path):
    module, source = INJECTED[rule]
    path = tmp_path / "injected.py"
    path.write_text(source)
    modules = project_modules() | {module: path}
    if rule == "cycle":
        assert find_cycle(layer_graph(modules)) is not None
        assert "nugget_rag.model.injected -> nugget_rag.components.llm" in upward_imports(modules)
    elif rule == "upward":
        assert upward_imports(modules) == ["nugget_rag.state.injected -> nugget_rag.generation.decoding"]
    elif rule == "long":
        assert long_modules(modules) == {module: MODULE_LINES + 1}
    elif rule == "private module":
        assert "nugget_rag.train.injected:1: imports the private module nugget_rag.eval.systems._kv" in \
            private_uses(modules)
    elif rule == "private name":
        assert private_uses(modules) == ["nugget_rag.serving.injected: from ..integrations.local.index import _add"]
    elif rule == "options":  # the options every command shares read no command: eval and train import them
        assert upward_imports(modules) == ["nugget_rag.cli.options -> nugget_rag.cli.opening"]
        assert find_cycle(layer_graph(modules)) is not None
    elif rule == "stores back":
        assert upward_imports(modules) == [
            "nugget_rag.integrations.stores.injected -> nugget_rag.integrations.local.index"]
        assert find_cycle(layer_graph(modules)) is not None  # the local index reads the stores
    elif rule == "local back":
        assert upward_imports(modules) == [
            "nugget_rag.integrations.local.injected -> nugget_rag.integrations.published.index"]
    elif rule == "re-export":
        assert re_export_imports(modules) == ["nugget_rag.cli.injected -> nugget_rag.resolution"]
    elif rule == "loose":
        assert loose_integrations(modules) == [module]
    elif rule == "top level":
        assert len(top_level(modules)) == len(top_level(project_modules())) + 1 > TOP_LEVEL_MODULES
    else:
        assert model_lines(modules) == MODEL_LINES + 1
