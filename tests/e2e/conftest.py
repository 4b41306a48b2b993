"""Stores the browser test modules share, built once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def planned_store(tmp_path_factory) -> Path:
    """The root of a store holding the planner's recorded runs (tests/planner_store.py), a traffic
    report of the 24 shipped kv-cache-tester traces, a forecast of them with the vendor-h200 profile,
    then (newest, shown first) the runs planned from their own fitted profile. Built once (about 45 s
    on 2 cores, once per module before) for the Plan page tests of test_dashboard_browser.py and
    test_dashboard_charts.py; the dashboard opens it read-only, so they share it."""
    from typer.testing import CliRunner

    from loadgen.traces.kv_cache_tester import DEFAULT_DIR
    from loadgen.traffic import build_report
    from store.writer import Store
    from tests import planner_store
    from turnscope.commands import app

    root = planner_store.build(tmp_path_factory.mktemp("planned") / "store")
    build_report(Store(root), [DEFAULT_DIR], label="kv-cache-tester")
    for args in ([str(DEFAULT_DIR), "--profile", str(REPO / "data/profiles/vendor-h200.yaml"), "--label",
                  "kv-cache-tester", "--sessions-per-hour", "100", "--sessions", "48"],
                 [str(root), "--fit-runs", ",".join(planner_store.RUNS.values()), "--label", "check"]):
        r = CliRunner().invoke(app, ["plan", *args, "--store", str(root)], env={"COLUMNS": "4000"})
        assert r.exit_code == 0, r.output
    return root
