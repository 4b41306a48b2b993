"""CLI tables piped to a file read whole: no number, mode or header cut to fit 80 columns.

`turnscope capacity`'s summary (turnscope.conductor.capacity.print_capacity_summary, the table it prints after a
ramp) over the hand-built ramp of tests/capacity_store.py, printed by a separate Python process whose
stdout is a pipe (Rich then assumes 80 columns, as in a log or CI), checked against the ramp's
hand-computed truths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import capacity_store

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path
from rich.console import Console
from tests import capacity_store
from turnscope.conductor.capacity import print_capacity_summary
root = Path(sys.argv[1])
ids = [capacity_store.run_id(m, u) for m in capacity_store.MODES for u in capacity_store.USERS]
print_capacity_summary(root, ids, Console())
"""


def test_capacity_summary_piped_keeps_every_number_whole(tmp_path):
    root = capacity_store.build(tmp_path / "store")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    for (mode, users), p50 in capacity_store.EXPECTED_TTFT_P50.items():
        p90 = capacity_store.EXPECTED_TTFT_P90[(mode, users)]
        # each step's TTFT p50/p90 in ms and its goodput, as hand-computed in capacity_store
        assert f"{p50 * 1e3:.0f}/{p90 * 1e3:.0f}" in out, (mode, users, out)
    assert "pd-bidir" in out and "TTFT p50/p90 ms" in out and "goodput/s" in out
    assert f"{capacity_store.EXPECTED_GOODPUT[('pd-bidir', 4)]:.2f}" in out
