"""The docs keep what they promise: the README's headline table holds one figure a cell (its
"result" column), a docs page's lines stay readable in a terminal (prose at most
:data:`PROSE_CAP` characters; a table row cannot wrap, so each cell at most :data:`CELL_CAP`), and
every path or module the docs name in code spans exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_layers import PACKAGES, _module_file, _top_level_names

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
IDS = [p.relative_to(REPO).as_posix() for p in PAGES]
#: Characters a prose line (outside code blocks and tables) may have.
PROSE_CAP = 120
#: Characters a table cell may have.
CELL_CAP = 500
#: Made files the docs name that a checkout does not hold until turnscope has run (git-ignored).
MADE = ("data/turnscope.duckdb", "data/runs", "data/rollups", "data/models")
#: A file name a code span may hold that is no module path (``turnscope.duckdb``, ``design.md``).
FILE_SUFFIX = re.compile(r"\.(duckdb|md|py|ya?ml|json|jsonl|sql|toml|parquet|csv|txt|sh|html|png)$")


def _lines(text: str):
    """(line number, line, in a code block) of a Markdown text."""
    fence = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            yield i, line, True
            continue
        yield i, line, fence


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row (``|`` inside code spans kept)."""
    parts, depth, cur = [], False, ""
    for ch in row.strip().strip("|"):
        if ch == "`":
            depth = not depth
        if ch == "|" and not depth:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


# -- one figure a cell ------------------------------------------------------------------------------

#: An interval in brackets after the figure: ``(95% CI 2.45-5.28x)`` or ``(0.71-1.74x)``.
INTERVAL = re.compile(r"\s*\((?:95% CI )?[\d.,]+-[\d.,]+\s*[x%]?\)")
#: One figure: a number with its unit, ``N of M``, or a fleet (``2P1D``) after a code span.
FIGURE = re.compile(r"^(?:[\d.,]+\s*(?:x|%|s|GiB-s)?|[\d,]+ of [\d,]+|\d+P\d+D)$")


def figures_in(cell: str) -> bool:
    """Whether a headline cell is one figure: in bold or not, an interval in brackets after it and
    words after a colon or comma allowed (``1.15x (0.71-1.74x): no clear difference``)."""
    c = cell.replace("**", "")
    c = INTERVAL.sub("", c)
    c = re.sub(r"[:,]\s*[^\d]*$", "", c)
    c = re.sub(r"`[^`]*`\s*", "", c).strip()
    return bool(FIGURE.match(c))


def headline_results(text: str) -> list[str]:
    """The "result" cells of the table under the README's "Headline results"."""
    section = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = _cells(rows[0])
    col = header.index("result")
    return [_cells(r)[col] for r in rows[2:]]


def test_the_readme_headline_is_one_figure_a_cell() -> None:
    cells = headline_results((REPO / "README.md").read_text())
    assert len(cells) >= 10
    assert [c for c in cells if not figures_in(c)] == []


def test_the_figure_check_catches_two_figures() -> None:
    ok = ["**3.57x** (95% CI 2.45-5.28x)", "1.15x (0.71-1.74x): no clear difference", "**39 of 40**", "96.2%",
          "`pd+host` 2P1D", "5.0 GiB-s, as forecast", "0.7 s"]
    assert all(figures_in(c) for c in ok)
    two = ["3.09 s (6.54 s with its charts drawn)", "19.4 -> 5.0 GiB-s", "`pd+host` 2P1D (24 GPUs)", "1.2x and 1.3x"]
    assert not any(figures_in(c) for c in two)


# -- a line-length cap --------------------------------------------------------------------------------

#: A link's target, which a line cannot break (not counted).
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")


def long_lines(text: str) -> list[str]:
    """Prose lines over :data:`PROSE_CAP` characters (a link's target not counted) and table
    cells over :data:`CELL_CAP`."""
    out = []
    for i, line, code in _lines(text):
        if code:
            continue
        if line.lstrip().startswith("|"):
            out += [f"{i}: a cell of {len(c):,} characters" for c in _cells(line) if len(c) > CELL_CAP]
        elif len(LINK_TARGET.sub("]()", line)) > PROSE_CAP:
            out.append(f"{i}: {len(line):,} characters")
    return out


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_docs_lines_are_capped(page: Path) -> None:
    assert long_lines(page.read_text()) == []


def test_the_cap_catches_a_long_line_and_a_long_cell() -> None:
    text = ("x" * (PROSE_CAP + 1) + "\n```\n" + "y" * 500 + "\n```\n| a | " + "z" * (CELL_CAP + 1) + " |\n"
            + "[a page](" + "p" * PROSE_CAP + ".md#a-heading)\n")
    assert long_lines(text) == [f"1: {PROSE_CAP + 1} characters", f"5: a cell of {CELL_CAP + 1} characters"]


# -- paths named in docs exist ------------------------------------------------------------------------

CODE_SPAN = re.compile(r"`([^`\n]+)`")


def missing_paths(text: str) -> list[str]:
    """Code spans naming a path of the repository (its first folder a top-level one) that does not
    exist, and dotted names of the code's packages (``store.queries.memory.run_config``) whose
    module or top-level name does not."""
    tops = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    out = []
    for i, line, code in _lines(text):
        if code:
            continue
        for span in CODE_SPAN.findall(line):
            token = re.split(r"[:\s(,]", span.strip().split("::")[0])[0]
            if "/" in token:
                if (any(c in token for c in "*<{$~") or "..." in token or token.startswith(("/", "http"))
                        or token.split("/")[0] not in tops or token.rstrip("/").startswith(MADE)):
                    continue
                if not (REPO / token.rstrip("/")).exists():
                    out.append(f"{i}: {token}")
            elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?", span) and span.split(".")[0] in PACKAGES \
                    and not FILE_SUFFIX.search(span):
                parts = span.removesuffix("()").split(".")
                k = len(parts)
                while k and _module_file(".".join(parts[:k])) is None:
                    k -= 1
                if not k or (k < len(parts) and parts[k] not in _top_level_names(_module_file(".".join(parts[:k])))):
                    out.append(f"{i}: {span}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_paths_named_in_docs_exist(page: Path) -> None:
    assert missing_paths(page.read_text()) == []


def test_the_path_check_catches_a_moved_module() -> None:
    gone_path, gone_module = "dashboard" + "/hit_rate.py", "dashboard" + ".queries.memory"  # where they were
    text = (f"`{gone_path}`, `store/hit_rate.py`, `{gone_module}`, `store.queries.memory`,\n"
            "`store.queries.memory.run_config`, `store.queries.memory.no_such_query`, `data/turnscope.duckdb`,\n"
            "`turnscope.duckdb`, `queries/traffic.py`\n")
    assert missing_paths(text) == [f"1: {gone_path}", f"1: {gone_module}", "2: store.queries.memory.no_such_query"]
