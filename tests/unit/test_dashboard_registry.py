"""dashboard/pages.py is the one list of the dashboard's pages: one entry per script of
dashboard/app_pages/, each with the title its script draws, and app.py names no page itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dashboard import pages

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "dashboard" / "app_pages"


def _drawn_title(script: Path) -> str:
    """The literal of the script's ``st.title(...)`` call, read from its source."""
    for node in ast.walk(ast.parse(script.read_text(), str(script))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "title" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "st":
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"{script} draws no st.title")


def test_one_entry_per_page_script_with_the_title_it_draws() -> None:
    scripts = sorted(p.stem for p in SCRIPTS.glob("*.py") if p.name != "__init__.py")
    assert sorted(p.slug for p in pages.PAGES) == scripts
    for p in pages.PAGES:
        assert (pages.APP.parent / p.script).resolve() == SCRIPTS / f"{p.slug}.py"
        assert _drawn_title(SCRIPTS / f"{p.slug}.py") == p.title, p.slug
    assert [p.slug for p in pages.PAGES if p.default] == ["overview"]
    assert [p.url_path for p in pages.PAGES][:2] == ["", "turns"]


def test_pages_without_runs_are_the_forecast_traffic_and_sql_pages() -> None:
    assert [p.title for p in pages.PAGES if not p.needs_runs] == ["Traffic", "Plan", "SQL"]
    assert [p.slug for p in pages.drawing("runs", "store")] == ["overview", "turns", "sessions", "memory",
                                                               "compare", "sql"]
    with pytest.raises(KeyError, match="overview"):
        pages.page("no-such-page")


def test_app_names_no_page_script_itself() -> None:
    app = pages.APP.read_text()
    literals = [n.value for n in ast.walk(ast.parse(app)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert not [s for s in literals if s.startswith("app_pages/")], "a page belongs in dashboard/pages.py"
