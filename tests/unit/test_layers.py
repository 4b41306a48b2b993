"""The parts import one way (docs/design.md): serving and loadgen never import each other, the
dashboard (its pages included) imports neither, not even through a shared module it imports; no
module imports up a layer (the ground imports nothing above it) and no modules import each other in
a circle, and every import of the repository's own modules resolves in this checkout."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ("serving", "loadgen", "dashboard")


def _imported_modules(part: str) -> set[str]:
    """Every module that a file of `part` imports (read from the source, so Streamlit pages and
    the Locust file, which run on import, need not be executed)."""
    names: set[str] = set()
    for path in (REPO / part).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return {n for n in names if n.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("part, forbidden", [("serving", {"loadgen", "dashboard"}),
                                             ("loadgen", {"serving", "dashboard"}),
                                             ("dashboard", {"serving", "loadgen"})])
def test_part_imports_no_other_part(part: str, forbidden: set[str]) -> None:
    mods = sorted(m for m in _imported_modules(part) if not m.endswith("locustfile"))
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(forbidden)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{part} pulls in {out.stdout.strip()}"


# -- the layers (docs/design.md) ------------------------------------------------------------

#: The layers by folder, bottom (0) up (docs/design.md): a module may import modules of its
#: own folder and of lower layers only. Every module of the repository's code lies in exactly one of
#: these folders (:func:`test_every_module_lies_in_a_layer_folder`): a new module takes its layer
#: from where it is put, not from a list of modules. The top-level folders are layers themselves
#: (:func:`test_the_top_level_folders_are_layers`): turnscope/ holds the top three.
LAYER_FOLDERS = (("core", 0), ("store", 1), ("serving", 2), ("loadgen", 2), ("analysis", 2),
                 ("planner", 3), ("dashboard", 4), ("turnscope/conductor", 5),
                 ("turnscope/commands", 6), ("turnscope", 7))  # turnscope/ itself: the package and its entry
#: The top-level packages of the code (pyproject.toml lists them and their subpackages).
PACKAGES = tuple(sorted({f.split("/")[0] for f, _ in LAYER_FOLDERS}))


def layer_of(module: str) -> tuple[int, str]:
    """(layer, folder) of a module of this repository: its deepest folder of :data:`LAYER_FOLDERS`."""
    path = module.replace(".", "/")
    for folder, layer in sorted(LAYER_FOLDERS, key=lambda f: -len(f[0])):
        if path == folder or path.startswith(folder + "/"):
            return layer, folder
    raise AssertionError(f"{module} lies in no layer folder of {[f for f, _ in LAYER_FOLDERS]}")


#: A module named in a string as ``"package.module:function"``: the references that
#: ``importlib.import_module`` resolves at run time (``loadgen/traces/formats.py``'s registry).
DYNAMIC_REF = re.compile(r"^([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*$")
#: Every module that calls ``importlib.import_module`` (or ``__import__``) and what it may import
#: that way: references of :data:`DYNAMIC_REF` in its own strings (which the graph then follows), or
#: names outside the repository's packages. A new call site must be added here
#: (:func:`test_every_dynamic_import_is_listed`).
DYNAMIC_IMPORTERS = {
    "loadgen.traces.formats": "the registry's 'module:function' strings",
    "dashboard.serve": "third-party libraries only (PRELOAD)",
}


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names in `module` (a relative one resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports anywhere in its file (top level or in a
    function; relative imports resolved), read with ``ast``, and the modules its strings name as
    ``"module:function"`` (:data:`DYNAMIC_REF`) for ``importlib.import_module``."""
    paths = {}
    for part in PACKAGES:
        for path in (REPO / part).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node, path.name == "__init__.py")
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DYNAMIC_REF.match(node.value):
                targets = [node.value.partition(":")[0]]
            else:
                continue
            graph[module].update(t for t in targets if t in paths and t != module)
    return graph


def layering_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer or sideways between two folders of one layer."""
    out = []
    for module, targets in graph.items():
        layer, package = layer_of(module)
        for t in targets:
            t_layer, t_package = layer_of(t)
            if t_layer > layer or (t_layer == layer and t_package != package):
                out.append(f"{module} -> {t}")
    return sorted(out)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_module_lies_in_a_layer_folder() -> None:
    """turnscope/ itself holds only the package and its entry (``python -m turnscope``); every other
    module sits in a layer's folder."""
    graph = import_graph()
    assert all(layer_of(m) for m in graph)
    assert sorted(m for m in graph if layer_of(m)[1] == "turnscope") == ["turnscope", "turnscope.__main__"]


def test_no_module_imports_up_a_layer_or_across_one() -> None:
    assert layering_breaches(import_graph()) == []


def test_no_import_cycle() -> None:
    assert import_cycles(import_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle() -> None:
    graph = import_graph()
    graph["core.resources"] = graph["core.resources"] | {"dashboard.loader"}  # the ground -> the dashboard
    assert "core.resources -> dashboard.loader" in layering_breaches(graph)
    assert any({"core.resources", "dashboard.loader"} <= set(c) for c in import_cycles(graph))
    graph = import_graph()
    graph["store.queries.memory"] = graph["store.queries.memory"] | {"planner.ttl_whatif"}  # the store -> the planner
    assert layering_breaches(graph) == ["store.queries.memory -> planner.ttl_whatif"]
    graph = import_graph()
    graph["serving.routing"] = graph["serving.routing"] | {"loadgen.workload"}  # across one layer
    assert layering_breaches(graph) == ["serving.routing -> loadgen.workload"]


def dynamic_importers() -> list[str]:
    """The modules of the code that call ``import_module`` or ``__import__``."""
    out = []
    for module, path in _module_paths().items():
        text = path.read_text()
        if "import_module(" in text or "__import__(" in text:
            out.append(module)
    return sorted(out)


def _module_paths() -> dict[str, Path]:
    out = {}
    for part in PACKAGES:
        for path in (REPO / part).rglob("*.py"):
            out[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def test_every_dynamic_import_is_listed() -> None:
    """A module that imports by name at run time is listed, with what it imports that way: the
    graph above follows its ``"module:function"`` strings, and nothing else of ours is imported so."""
    assert dynamic_importers() == sorted(DYNAMIC_IMPORTERS)


def test_the_graph_follows_dynamic_references() -> None:
    """The trace registry's ``"module:function"`` strings are edges of the graph."""
    assert "loadgen.traces.kv_cache_tester" in import_graph()["loadgen.traces.formats"]


def test_the_graph_follows_relative_imports() -> None:
    """A relative import (which ruff bans, pyproject.toml ``TID252``) would still be an edge."""
    tree = ast.parse("from ..queries import memory\nfrom . import db\n")
    found = [_absolute("store.queries.overview", n, False) for n in tree.body]
    assert found == ["store.queries", "store.queries"]
    found = [_absolute("store", n, True) for n in tree.body]
    assert found == ["queries", "store"]


# -- shared names are public ------------------------------------------------------------------------

def private_imports(module: str, source: str, modules: set[str]) -> list[str]:
    """The ``_private`` names of another of `modules` that `source` (module `module`) imports
    (``from m import _x``) or reads off an imported module (``m._x``)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname: a.name for a in node.names if a.asname and a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__") and node.module != module:
                    out.append(f"{module}:{node.lineno}: {node.module}.{a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != module):
            out.append(f"{module}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return sorted(out)


def test_no_module_imports_another_modules_private_name() -> None:
    """docs/design.md: a name two modules share is public."""
    paths = _module_paths()
    found = [f for m, p in paths.items() for f in private_imports(m, p.read_text(), set(paths))]
    assert found == []


def test_the_private_import_check_catches_both_forms() -> None:
    modules = set(_module_paths())
    planted = "from planner.fit import on_run_kv_space, _kv_space\nfrom planner import fit\nx = fit._kv_space\n"
    assert private_imports("turnscope.conductor.planted", planted, modules) == [
        "turnscope.conductor.planted:1: planner.fit._kv_space", "turnscope.conductor.planted:3: planner.fit._kv_space"]
    assert private_imports("planner.fit", "from planner.fit import _kv_space\n", modules) == []


# -- the house drawn from the top-level folders -------------------------------------------------------

def top_level_rank(package: str) -> int:
    """A top-level folder's layer: its lowest folder's (turnscope/ holds the conductor, the
    commands and the entry, all above every other folder)."""
    return min(layer for folder, layer in LAYER_FOLDERS if folder.split("/")[0] == package)


def top_level_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level folder -> the other top-level folders its modules import."""
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, targets in graph.items():
        out[module.split(".")[0]].update(t.split(".")[0] for t in targets if t.split(".")[0] != module.split(".")[0])
    return out


def arrows_up(top: dict[str, set[str]]) -> list[str]:
    """Arrows of the top-level house that run up or sideways (to a folder of the same or a higher
    layer)."""
    return sorted(f"{a} -> {b}" for a, targets in top.items() for b in targets
                  if top_level_rank(b) >= top_level_rank(a))


def test_the_top_level_folders_are_layers() -> None:
    """The house drawn from the top-level folders: every arrow runs down, and no circle."""
    top = top_level_graph(import_graph())
    assert arrows_up(top) == []
    assert import_cycles(top) == []


def test_the_dashboard_is_a_leaf() -> None:
    """dashboard/ holds pages, figures and tables: no other package imports it (the CLI starts it
    as a process); what it reads is the store's (store/queries/)."""
    assert sorted(a for a, targets in top_level_graph(import_graph()).items() if "dashboard" in targets) == []


def test_the_house_check_catches_an_arrow_up() -> None:
    graph = import_graph()
    graph["planner.fit"] = graph["planner.fit"] | {"turnscope.conductor.settings"}
    top = top_level_graph(graph)
    assert arrows_up(top) == ["planner -> turnscope"]
    assert any({"planner", "turnscope"} <= set(c) for c in import_cycles(top))


def test_every_top_level_package_is_a_layer() -> None:
    """Every top-level folder holding Python code (bar tests/, bench/, scripts/, data/) is one of
    :data:`PACKAGES`, so a new top-level package must take a layer here."""
    code = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert code == set(PACKAGES)


# -- every import resolves in this repository ---------------------------------------------------------

def _module_file(module: str) -> Path | None:
    """The file of `module` in this checkout (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level: definitions, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def unresolved_imports() -> list[str]:
    """Imports of this repository's packages (in its code, tests and benches) that name a module or a
    name this checkout does not have: a module moved or renamed, its importers not updated. Read
    from the files, so an installed copy of an older tree cannot answer for a missing module."""
    ours = (*PACKAGES, "tests", "bench")
    out = []
    for part in ours:
        for path in (REPO / part).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    out += [f"{path.relative_to(REPO)}:{node.lineno}: {a.name}" for a in node.names
                            if a.name.split(".")[0] in ours and _module_file(a.name) is None]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in ours:
                    target = _module_file(node.module)
                    if target is None:
                        out.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.module}")
                        continue
                    names = _top_level_names(target)
                    out += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                            if a.name != "*" and a.name not in names
                            and _module_file(f"{node.module}.{a.name}") is None]
    return sorted(out)


def test_every_import_of_the_repository_resolves_in_it() -> None:
    assert unresolved_imports() == []
