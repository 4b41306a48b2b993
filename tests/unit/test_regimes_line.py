"""The demo's three-regime line quotes the recorded eviction ladder exactly as the README's headline
table does (one measurement, two places: they must agree)."""

from __future__ import annotations

import re
from pathlib import Path

from turnscope.commands.summaries import EVICTION_LADDER

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_quotes_the_readme_row():
    row = next(line for line in (REPO / "README.md").read_text().splitlines()
               if "capacity ladder with P's own cache evicting" in line)
    speedup, ci = re.search(r"\*\*([\d.]+x)\*\* \(95% CI ([\d.]+-[\d.]+x)\)", row).groups()
    assert f"{speedup} (95% CI {ci})" in EVICTION_LADDER
    hit = re.search(r"P hit rate (\d+)%", row).group(1)
    assert f"P's hit rate {hit}%" in EVICTION_LADDER
    recorded = re.search(r"\[(\d{4}-\d{2}-\d{2}), ", row).group(1)   # the row's dated link
    assert f"recorded {recorded}" in EVICTION_LADDER
