"""The README and docs/**/*.md: every relative link resolves to a file of the repository (and to a
heading of it when it names an anchor), and the README stays short enough to read in five minutes.

Links and headings are read with markdown-it-py (CommonMark: links inside code are not links);
anchors follow GitHub's heading ids (github-slugger): the heading's text lower-cased, every
character that is not a letter, digit, underscore, hyphen or space dropped, spaces turned into
hyphens, and a repeated id suffixed -1, -2, ...
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 260
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _tokens(path: Path):
    return MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8"))


def _text(inline) -> str:
    """A heading's text as GitHub renders it: text and inline code, markup dropped."""
    return "".join(c.content for c in inline.children or [] if c.type in ("text", "code_inline"))


def slug(text: str) -> str:
    """GitHub's id for a heading of `text` (github-slugger, before de-duplication)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The ids of every heading of the Markdown file at `path`."""
    toks = _tokens(path)
    seen: Counter[str] = Counter()
    out = set()
    for i, t in enumerate(toks):
        if t.type == "heading_open":
            base = slug(_text(toks[i + 1]))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def links(path: Path) -> list[str]:
    """Every link and image target of the Markdown file at `path`."""
    out = []
    for t in _tokens(path):
        for c in t.children or []:
            if c.type == "link_open":
                out.append(c.attrs["href"])
            elif c.type == "image":
                out.append(c.attrs["src"])
    return out


def broken(path: Path) -> list[str]:
    """The relative links of `path` that name a missing file or a missing heading, with why."""
    bad = []
    for href in links(path):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:  # http(s), mailto: not checked here
            continue
        target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
        if not target.exists():
            bad.append(f"{href}: no file {target}")
        elif parts.fragment and target.suffix == ".md" and unquote(parts.fragment) not in anchors(target):
            bad.append(f"{href}: no heading #{parts.fragment} in {target.name}")
    return bad


def test_slug_follows_github():
    """Worked by hand from headings GitHub renders (ids read off rendered pages' anchors)."""
    assert slug("Measured ratios next to the vendor's") == "measured-ratios-next-to-the-vendors"
    assert slug("`make demo`") == "make-demo"
    assert slug("Rollups (what the dashboard reads for finished runs)") == (
        "rollups-what-the-dashboard-reads-for-finished-runs"
    )
    assert slug("Profiles: measured on a GPU (bench/layer_prefill.py, turnscope profile-from-timing)") == (
        "profiles-measured-on-a-gpu-benchlayer_prefillpy-turnscope-profile-from-timing"
    )


def test_checker_finds_broken_links(tmp_path):
    """The check has teeth: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#a-section) [ok](#doc) [file](missing.md) [anchor](other.md#no-such)\n\n"
        "```\n[in code](nowhere.md)\n```\n[web](https://example.com/x)\n"
    )
    assert [b.split(":")[0] for b in broken(doc)] == ["missing.md", "other.md#no-such"]


@pytest.mark.parametrize("path", DOCS, ids=[p.relative_to(REPO).as_posix() for p in DOCS])
def test_relative_links_resolve(path):
    assert broken(path) == []


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


def test_docs_cite_no_tracker_issues():
    """The docs say what a rule is and its source, not a tracker number ("issue 15", "#12");
    upstream references (vLLM issue 52234, vllm#55508, ROCm/ATOM issue 1562) are sources and allowed."""
    bad = []
    for path in DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"(?<![\w#])(?:[Ii]ssue \d+|#\d+\b)", line):
                if not re.search(r"(vLLM|vllm|\w[\w.-]*/[\w.-]+)\s*$", line[: m.start()]):
                    bad.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    assert bad == []
