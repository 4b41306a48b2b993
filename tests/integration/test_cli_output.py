"""The CLI's result text at 80 columns and in a log file: nothing cut, lists broken between items.

The store is tests/dashboard_store.py's (written through store.writer's writer); the names that
must appear whole are the fixture's run ids and reuse outcomes, read straight from its Parquet
shards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dashboard_store
from turnscope.conductor import console_text

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dashboard_store.build(tmp_path_factory.mktemp("store"))


def summary_to_file(store: Path, out: Path, env: dict[str, str]) -> list[str]:
    """`turnscope.commands.summaries.print_summary` in a fresh interpreter whose stdout is a file, as in `turnscope
    eval > log`."""
    code = (
        "import sys; from pathlib import Path; from turnscope.commands.summaries import print_summary; "
        f"print_summary(Path({str(store)!r}), {list(dashboard_store.RUNS)!r})"
    )
    with out.open("w") as f:
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=f, check=True, timeout=120)
    return out.read_text().splitlines()


def check_lines(lines: list[str], width: int) -> None:
    text = "\n".join(lines)
    assert text.strip(), "no output"
    assert max(len(line) for line in lines) <= width, [line for line in lines if len(line) > width]
    assert "…" not in text  # nothing ellipsised
    for run_id, (mode, _, _) in dashboard_store.RUNS.items():
        # each run's table is headed by its whole id, mode and history mode
        assert f"{run_id}: {mode}, history {dashboard_store.HISTORY}" in lines, run_id
    # Each "reuse:" list: every item is `outcome=count`, whole, on the list's own lines.
    for i, line in enumerate(lines):
        if line.startswith("  reuse: "):
            items = line[len("  reuse: "):]
            j = i + 1
            while j < len(lines) and lines[j].startswith(" " * len("  reuse: ")) and "=" in lines[j]:
                items += " " + lines[j].strip()
                j += 1
            for item in items.split(", "):
                assert re.fullmatch(r"[a-z_/]+=\d+", item), (item, lines[i:j])


def test_summary_in_a_log_file_fits_80_columns(store_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    lines = summary_to_file(store_root, tmp_path / "eval.log", env)
    check_lines(lines, 80)
    assert any(line.startswith("pd-bidir vs aggregated") for line in lines)  # the bottom line is there


def test_summary_in_a_narrow_terminal(store_root, tmp_path):
    lines = summary_to_file(store_root, tmp_path / "eval.log", os.environ | {"COLUMNS": "44"})
    check_lines(lines, 44)


def test_wrap_items_breaks_between_items_with_a_hanging_indent():
    items = [f"outcome_{i}={i}" for i in range(12)]  # 11-12 characters each
    lines = console_text.wrap_items("  reuse: ", items, 40)
    assert lines == [
        "  reuse: outcome_0=0, outcome_1=1,",
        "         outcome_2=2, outcome_3=3,",
        "         outcome_4=4, outcome_5=5,",
        "         outcome_6=6, outcome_7=7,",
        "         outcome_8=8, outcome_9=9,",
        "         outcome_10=10, outcome_11=11",
    ]
    # An item longer than the line stays whole on a line of its own.
    assert console_text.wrap_items("x: ", ["a" * 50, "b"], 20) == ["x: " + "a" * 50 + ",", "   b"]


def test_sweep_summary_in_a_log_file_fits_80_columns(tmp_path):
    """`turnscope sweep`'s table: one row per (prefix, mode), so five modes fit 80 columns whole."""
    from tests import sweep_store

    root = sweep_store.build(tmp_path / "store")
    code = (
        "import duckdb; from pathlib import Path; from turnscope.commands.summaries import print_sweep_summary; "
        f"root = Path({str(root)!r}); "
        "ids = [r[0] for r in duckdb.connect(str(root / 'turnscope.duckdb'), read_only=True)"
        ".execute('select run_id from runs').fetchall()]; print_sweep_summary(root, ids)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = tmp_path / "sweep.log"
    with out.open("w") as f:
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=f, check=True, timeout=120)
    lines = out.read_text(encoding="utf-8").splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in "\n".join(lines)
    cells = {c.strip() for line in lines for c in line.split("│")}
    assert set(sweep_store.MODES) <= cells, cells
