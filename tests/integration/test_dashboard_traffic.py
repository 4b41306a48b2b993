"""The Traffic page, headless (Streamlit AppTest) over a store that holds only a traffic report of
the 24 shipped kv-cache-tester traces: the page renders without any run, and its headline numbers
are the plain-json walk's (tests/unit/test_agent_traces.py)."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from dashboard import charts, pages
from loadgen.traces.kv_cache_tester import DEFAULT_DIR
from loadgen.traffic import build_report
from store.writer import Store
from tests.unit.test_agent_traces import TRACES, truth, walk

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


def test_traffic_page_without_runs(monkeypatch, tmp_path):
    store = Store(tmp_path / "store")
    build_report(store, [DEFAULT_DIR], label="shipped")
    monkeypatch.setenv("TURNSCOPE_STORE", str(store.root))
    monkeypatch.setenv(charts.ENV_VAR, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    # No runs: only the pages that read forecasts and traffic reports are offered, and it says so.
    assert any("traffic reports" in c.value for c in at.sidebar.caption)
    at.switch_page(pages.page("traffic").script).run()
    assert not at.exception, [e.value for e in at.exception]
    sessions = requests = 0
    for p in TRACES:
        ss: list[list[dict]] = []
        walk(json.loads(p.read_text())["requests"], ss)
        sessions += len(ss)
        requests += sum(len(s) for s in ss)
    values = [m.value for m in at.metric]
    assert values[:2] == [f"{sessions:,}", f"{requests:,}"]
    assert len(at.get("plotly_chart")) == 5
    estimated = sum(truth(p)["estimated"] for p in TRACES)
    assert any(f"{estimated:,} gaps estimated" in c.value for c in at.caption)
