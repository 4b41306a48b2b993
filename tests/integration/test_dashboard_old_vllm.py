"""A run attached to an old vLLM that exposes only the deprecated metric names (handed case
``renamed_metrics_old_names``: ``vllm:gpu_cache_usage_perc``, ``vllm:time_per_output_token_seconds``)
shows KV usage and ITL on every dashboard page, run headless by Streamlit's AppTest over a store
filled by the real scraper from a live /metrics endpoint.

Truths: the handed case's expect values (KV usage 0.37, 400 ITL observations of mean 0.025 s per
event) and the client ITL written into the turns rows here (25 ms).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path

import numpy as np
import plotly.io as pio
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import charts, pages
from loadgen.scraper import MetricsScraper
from store.writer import Store
from tests.handed_cases import CASES
from tests.integration.metrics_endpoint import MetricsEndpoint, histograms_zeroed

APP = pages.APP
#: The pages an evaluation's store fills (dashboard/pages.py).
PAGES = tuple(p.slug for p in pages.drawing("runs", "store"))
CASE = "renamed_metrics_old_names"
RUN = "attach-old-vllm"
CLIENT_ITL_S = 0.025


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("old-vllm")
    store = Store(root)
    store.init()
    text = (CASES / "prometheus" / f"{CASE}.prom").read_text()
    server = MetricsEndpoint([histograms_zeroed(text), text], version="0.9.1")
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    try:
        with store.writer(RUN, "test", flush_interval_s=60) as w:
            w.append("runs_log", {"mode": "attach", "status": "complete", "started_at": t0,
                                  "finished_at": t0 + dt.timedelta(seconds=30), "updated_at": t0})
            for k in range(3):
                w.append("turns", {"session_id": "s0", "turn_index": k, "request_id": f"r{k}", "kind": "turn",
                                   "sent_at": t0 + dt.timedelta(seconds=5 * k), "ttft_s": 0.2, "e2e_s": 1.0,
                                   "itl_p50_s": CLIENT_ITL_S, "prompt_tokens": 100 * (k + 1),
                                   "completion_tokens": 32, "status": "ok"})
            w.append("sessions", {"session_id": "s0", "archetype": "a", "turns": 3, "status": "ok"})
            scraper = MetricsScraper([(server.url, "aggregated")], w, RUN, timeout_s=5)
            scraper.scrape_once()
            scraper.scrape_once()
    finally:
        server.close()
    return root


def open_page(monkeypatch: pytest.MonkeyPatch, root: Path, page: str) -> AppTest:
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    monkeypatch.setenv(charts.ENV_VAR, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    if not pages.page(page).default:
        at.switch_page(pages.page(page).script).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def values(v) -> list:
    """A Plotly trace array as a list; plotly >= 6 serialises numeric arrays as base64 ``bdata``."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def figures(at: AppTest) -> list:
    return [pio.from_json(c.proto.spec) for c in at.get("plotly_chart")]


def test_every_page_renders_an_old_vllm_run(monkeypatch, store_root: Path) -> None:
    for page in PAGES:
        open_page(monkeypatch, store_root, page)


def test_memory_page_shows_kv_usage_read_under_the_old_name(monkeypatch, store_root: Path) -> None:
    exp = json.loads((CASES / "prometheus" / f"{CASE}.expect.json").read_text())["expect"]
    at = open_page(monkeypatch, store_root, "memory")
    assert not any("No `vllm:kv_cache_usage_perc`" in i.value for i in at.info)
    fig = next(f for f in figures(at) if f.layout.title.text == "Memory next to reuse")
    assert "KV cache usage" in fig.layout.annotations[0].text
    usage = [values(tr.y) for tr in fig.data if tr.yaxis == "y"]  # the first panel: KV usage, percent
    assert usage and all(v == pytest.approx(100 * exp["kv_cache_usage_perc"]) for ys in usage for v in ys)


def test_turns_page_shows_client_and_server_itl(monkeypatch, store_root: Path) -> None:
    exp = json.loads((CASES / "prometheus" / f"{CASE}.expect.json").read_text())["expect"]
    at = open_page(monkeypatch, store_root, "turns")
    server = next(d.value for d in at.dataframe if "itl_source" in d.value.columns)
    row = server.iloc[0]
    assert row["itl_source"] == exp["itl_source"]
    assert row["itl_events"] == exp["itl_count"]
    assert row["itl_mean_s_per_event"] == pytest.approx(exp["itl_mean_s"])
    assert row["vllm_version"] == "0.9.1"
    latency = next(fig for fig in figures(at) if any("ITL" in (a.text or "") for a in fig.layout.annotations))
    assert latency.data, "no latency traces on the Turns page"
