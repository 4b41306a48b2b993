"""The docs are a reference, not a notebook: no page under docs/ (recursively) is longer than 400 lines
(measured history goes to the dated log, docs/results.md and docs/log/), and code names a docs page,
never a heading of one (`docs/planner.md, "Speed probe"`, `docs/x.md ("Heading")`, `docs/x.md#anchor`):
a heading moves and the reference silently goes stale; a page that holds the topic stays.

The link checks (every docs link resolves, anchors included) are tests/unit/test_readme_links.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 400
PAGES = sorted((REPO / "docs").rglob("*.md"))
CODE_DIRS = (*PACKAGES, "bench", "tests", "scripts")

#: A docs page followed by a heading: `docs/x.md#anchor`, or the page, a comma or a space (a line break
#: and a comment marker allowed), then a quote, optionally in brackets or escaped in a string.
HEADING_REF = re.compile(r'docs/[\w./-]+\.md(?:#[\w-]|(?:,\s*|\s+)(?:#:?\s*)?\(?\\?")')


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py")
                  if p.resolve() != Path(__file__).resolve() and ".venv" not in p.parts)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO / "docs").as_posix() for p in PAGES])
def test_docs_page_is_at_most_400_lines(page):
    n = page.read_text(encoding="utf-8").count("\n")
    assert n <= MAX_LINES, (
        f"docs/{page.relative_to(REPO / 'docs').as_posix()} has {n} lines (at most {MAX_LINES}): split it by "
        "topic, and move dated measurements to the log (docs/results.md, docs/log/)"
    )


def heading_refs(text: str) -> list[str]:
    """The references of `text` that name a docs heading, not just its page."""
    return [m.group(0) for m in HEADING_REF.finditer(text)]


def test_heading_ref_pattern():
    """The pattern has teeth, and lets a page reference through."""
    bad = ['(docs/planner.md, "Speed probe")', 'docs/design.md ("Serving modes")', "docs/schema.md#rollups",
           'see docs/results.md "Schedule"', '(docs/planner.md,\n    "Calibration over a range")',
           '"(docs/configuration.md, \\"Routing\\")"', '"... (docs/results.md, "\n "Schedule") ..."']
    good = ["(docs/planner/calibration.md)", 'DOC = REPO / "docs" / "workloads.md"', '"docs/workloads.md"',
            "docs/schema/overview.md's rollups", "f\"docs/workloads.md '{title}'\"", "docs/design.md; the rest"]
    assert [t for t in bad if not heading_refs(t)] == []
    assert [t for t in good if heading_refs(t)] == []


def test_code_names_docs_pages_not_headings():
    bad = []
    for path in code_files():
        text = path.read_text(encoding="utf-8")
        for m in HEADING_REF.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)!r}")
    assert bad == [], "name the docs page that holds the topic, not a heading of it:\n" + "\n".join(bad)


def test_code_names_docs_pages_that_exist():
    """Every page of ours a code file names (`docs/<page>.md`, `docs/planner/<page>.md`, ...) exists: a
    page that moved leaves no stale name behind. (vLLM's own docs, `docs/features/...`, are not ours.)"""
    ours = "|".join(sorted(p.name for p in (REPO / "docs").iterdir() if p.is_dir()))
    missing = set()
    for path in code_files():
        for m in re.finditer(rf"(?<![\w/])docs/((?:(?:{ours})/)?[\w.-]+\.md)\b", path.read_text(encoding="utf-8")):
            if not (REPO / "docs" / m.group(1)).exists():
                missing.add(f"{path.relative_to(REPO)}: docs/{m.group(1)}")
    assert sorted(missing) == []
