"""SQL lives in one layer (docs/design.md): the store's modules (store/) and data/schema.sql. No
other module of the code writes a SQL statement or runs one (``.execute(``, ``.sql(``), and the
hit-rate condition is written once, in store/hit_rate.py. Read from the files with ``ast``;
docstrings may speak of SQL."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.unit.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[2]
#: The layer that holds SQL.
SQL_LAYER = "store"
#: A string that is a SQL statement: a query (SELECT ... FROM, or FROM-first is left to the store),
#: a CTE, or a statement that makes or changes something.
SQL_TEXT = re.compile(r"(?is)\bselect\b.+?\bfrom\b|^\s*with\s+\w+\s+as\s*\(|"
                      r"\b(create\s+(or\s+replace\s+)?(temp\s+|temporary\s+)?(view|table)|insert\s+into|"
                      r"delete\s+from|set\s+\w+\s*=\s*')")
#: Calls that run SQL on a DuckDB connection or relation.
SQL_CALLS = frozenset({"execute", "executemany", "sql"})
#: The hit-rate condition (the proxy's outcome ``hit``), as SQL writes it.
HIT_CONDITION = re.compile(r"(?i)\breuse\s*=\s*'hit'")
HIT_RATE_MODULE = "store/hit_rate.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal but docstrings; an f-string's literal parts joined."""
    skip = _docstrings(tree)
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append((node.lineno, "".join(v.value for v in node.values
                                             if isinstance(v, ast.Constant) and isinstance(v.value, str))))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and id(node) not in inner):
            out.append((node.lineno, node.value))
    return out


def sql_outside_the_store(path: str, source: str) -> list[str]:
    """The SQL of `source` (a module at `path`, relative to the repository) that should be in the
    store's layer: SQL text and SQL calls outside store/, and the hit-rate condition outside
    store/hit_rate.py."""
    tree = ast.parse(source, path)
    out = []
    in_store = path.split("/")[0] == SQL_LAYER
    for line, text in _strings(tree):
        if not in_store and SQL_TEXT.search(text):
            out.append(f"{path}:{line}: SQL text {text.strip()[:60]!r}")
        if path != HIT_RATE_MODULE and HIT_CONDITION.search(text):
            out.append(f"{path}:{line}: the hit-rate condition (store.hit_rate.hit_sql)")
    if not in_store:
        out += [f"{path}:{n.lineno}: .{n.func.attr}(" for n in ast.walk(tree)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in SQL_CALLS]
    return out


def code_files() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (REPO / top).rglob("*.py"))


def test_sql_is_only_in_the_store() -> None:
    found = []
    for p in code_files():
        found += sql_outside_the_store(p.relative_to(REPO).as_posix(), p.read_text())
    assert found == []


def test_the_check_catches_planted_sql() -> None:
    """A query, a CTE, a call that runs SQL and the hit-rate condition, planted outside the store
    or outside store/hit_rate.py; a docstring that speaks of SELECT is not SQL."""
    planted = '''"""Reads SELECT x FROM y in prose: a docstring."""
Q = """SELECT run_id FROM turns WHERE status = 'ok'"""
W = f"WITH t AS (SELECT 1) SELECT * FROM t WHERE {1}"
def f(con):
    """Docstring: con.execute(SELECT ... FROM ...)."""
    return con.execute(Q).df()
'''
    found = sql_outside_the_store("planner/planted.py", planted)
    assert [f.split(": ", 1)[1][:9] for f in found] == ["SQL text ", "SQL text ", ".execute("]
    assert sql_outside_the_store("store/queries/planted.py", planted) == []
    hit = "H = \"count(*) FILTER (WHERE t.reuse = 'hit')\"\n"
    assert sql_outside_the_store("store/queries/planted.py", hit) == [
        "store/queries/planted.py:1: the hit-rate condition (store.hit_rate.hit_sql)"]
    assert sql_outside_the_store(HIT_RATE_MODULE, hit) == []


def test_the_hit_rate_module_writes_the_condition() -> None:
    """The one place is where the test looks: store/hit_rate.py gives the condition the queries use."""
    from store import hit_rate

    assert HIT_CONDITION.search(hit_rate.hit_sql("t"))
    assert hit_rate.hit_sql("t") in hit_rate.counts_sql("t")
