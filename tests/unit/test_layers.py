"""The parts import one way (docs/design.md): serving and loadgen never import each other, the
dashboard (its pages included) imports neither, not even through a shared module it imports; no
module imports up a layer (the ground imports nothing above it) and no modules import each other in
a circle, and every import of the repository's own modules resolves in this checkout."""

from __future__ import annotations

import ast
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
    return {n for n in names if n.split(".")[0] in (*PARTS, "turnscope")}


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
#: from where it is put, not from a list of modules.
LAYER_FOLDERS = (("turnscope/core", 0), ("serving", 1), ("loadgen", 1), ("turnscope/analysis", 1),
                 ("turnscope/planner", 2), ("dashboard", 3), ("turnscope/conductor", 4),
                 ("turnscope/commands", 5), ("turnscope", 6))  # turnscope/ itself: the package and its entry


def layer_of(module: str) -> tuple[int, str]:
    """(layer, folder) of a module of this repository: its deepest folder of :data:`LAYER_FOLDERS`."""
    path = module.replace(".", "/")
    for folder, layer in sorted(LAYER_FOLDERS, key=lambda f: -len(f[0])):
        if path == folder or path.startswith(folder + "/"):
            return layer, folder
    raise AssertionError(f"{module} lies in no layer folder of {[f for f, _ in LAYER_FOLDERS]}")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this repository it imports anywhere in its file (top level or in a
    function), read with ``ast``."""
    paths = {}
    for part in (*PARTS, "turnscope"):
        for path in (REPO / part).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                           for a in node.names]
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
    graph["turnscope.core.store"] = graph["turnscope.core.store"] | {"dashboard.db"}  # ground -> dashboard
    assert "turnscope.core.store -> dashboard.db" in layering_breaches(graph)
    assert any({"turnscope.core.store", "dashboard.db"} <= set(c) for c in import_cycles(graph))
    graph = import_graph()
    graph["serving.routing"] = graph["serving.routing"] | {"loadgen.workload"}  # across one layer
    assert layering_breaches(graph) == ["serving.routing -> loadgen.workload"]


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
    ours = (*PARTS, "turnscope", "tests", "bench")
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
