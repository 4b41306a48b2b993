"""The parts import one way (docs/design.md): serving and loadgen never import each other, and the
dashboard (its pages included) imports neither, not even through a shared module it imports."""

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
