"""bench/soak.py's rows check on a short real run against the stub workers: three counts of the
same turns agree when nothing is lost (the turns cut off at the stop included), and the same
run's data with one row taken away, or one row twice, fails the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.soak_checks import StoredTurn, locust_posts, proxy_requests, rows_check
from store.writer import Store

REPO = Path(__file__).resolve().parents[2]


def test_a_short_stub_soak_passes_its_rows_check_and_fails_without_a_row(tmp_path):
    out, store_root = tmp_path / "out", tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--stub", "--minutes", "0.25", "--users", "6",
         "--sessions", "30", "--time-scale", "0.02", "--warmup-min", "0.05", "--sample-s", "3",
         "--canary-every-s", "5",
         "--store", str(store_root), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["checks"]["rows: stored = Locust = proxy"]
    assert rows["pass"], rows["detail"] + "\n" + proc.stdout[-3000:]
    assert summary["turns_stored"] == summary["locust_posts"] > 0
    # the soak reports its canaries: one before the load, every 5 s of its 15 under it, one after;
    # their requests went through the proxy and are no rows of the load (the rows check passed)
    canaries = summary["checks"]["known-answer canaries: no wrong tokens"]
    assert canaries["pass"], canaries["detail"]
    assert summary["canaries"].get("match", 0) >= 3 and set(summary["canaries"]) == {"match"}

    con = Store(store_root).connect()
    try:
        stored = [StoredTurn(*r) for r in con.execute(
            "SELECT kind, status, request_id FROM turns WHERE run_id = ?", [summary["run_id"]]).fetchall()]
        phases = dict(con.execute("SELECT phase, count(DISTINCT canary_id) FROM run_canaries WHERE run_id = ? "
                                  "GROUP BY phase", [summary["run_id"]]).fetchall())
    finally:
        con.close()
    assert phases["start"] == 1 and phases["end"] == 1 and phases["during"] >= 1
    locust = locust_posts(out / "locust.json")
    served = proxy_requests((out / "proxy.log").read_text().splitlines())
    served = [r for r in served if r[0].startswith("lg-")]  # the warm-up's requests carry the proxy's own ids
    assert rows_check(stored, locust, served)[0]
    ok_row = next(t for t in stored if t.status == "ok")
    assert not rows_check([t for t in stored if t is not ok_row], locust, served)[0]   # a row lost
    assert not rows_check(stored + [ok_row], locust, served)[0]                        # a row twice
