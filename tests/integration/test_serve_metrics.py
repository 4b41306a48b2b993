"""`turnscope serve`'s scrapes (turnscope/conductor/serve_metrics.py) against real prometheus_client
servers, with runs written into the store by the store's real writer as Locust's run recorder writes
them: samples go under the run recorded through this proxy while it records, under the serve's own
id before and after, never under a run recorded through another proxy.

Truths: the times the test wrote each run row (a sample under a run was scraped between its
``running`` row and its final one plus the final settle), and the gauge values the test set."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from store.writer import Store
from turnscope.conductor import serve_metrics
from turnscope.conductor.serve_metrics import ServeMetrics, same_server

INTERVAL_S = 0.2


def _endpoint(name: str) -> tuple[object, Gauge, str]:
    reg = CollectorRegistry()
    gauge = Gauge(name, "test gauge", registry=reg)
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    return httpd, gauge, f"http://127.0.0.1:{httpd.server_port}"


def _samples(store: Store) -> list[tuple[str, dt.datetime, str, float]]:
    con = store.connect()
    try:
        return con.execute("SELECT run_id, scraped_at, name, value FROM metric_samples ORDER BY scraped_at").fetchall()
    finally:
        con.close()


def _wait(pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _run_row(run_id: str, host: str, status: str, now: dt.datetime) -> dict:
    """A ``runs_log`` row as loadgen/run_recorder.py writes it (config.host = Locust's --host)."""
    return {"run_id": run_id, "label": None, "mode": "pd-bidir", "workload": "w", "history_mode": "text",
            "config": {"host": host, "turnscope_mode": "pd-bidir"}, "started_at": now, "updated_at": now,
            "finished_at": None if status == "running" else now, "status": status,
            "heartbeat_s": 5.0 if status == "running" else None}


def test_same_server_names_one_address_however_spelt():
    assert same_server("http://localhost:8200", "http://127.0.0.1:8200/")
    assert same_server("http://0.0.0.0:8200/v1", "http://127.0.0.1:8200")
    assert not same_server("http://127.0.0.1:8201", "http://127.0.0.1:8200")
    assert not same_server("http://10.0.0.5:8200", "http://127.0.0.1:8200")
    assert not same_server("", "http://127.0.0.1:8200")


def test_scrapes_go_under_the_run_recorded_through_the_proxy(tmp_path: Path):
    store = Store(tmp_path / "store")
    store.init()
    d_http, kv, d_url = _endpoint("vllm:kv_cache_usage_perc")
    p_http, handles, p_url = _endpoint("turnscope_handle_bytes_live")
    kv.set(0.1)
    handles.set(0.0)
    own = "serve-test-own"
    sm = ServeMetrics(store, [(d_url, "decode"), (p_url, "proxy")], p_url, interval_s=INTERVAL_S, own_id=own)
    writer = store.writer("lc-1", "locust-run", flush_interval_s=0.1)
    other = store.writer("other-1", "locust-run", flush_interval_s=0.1)
    try:
        sm.start()
        _wait(lambda: sum(1 for r in _samples(store) if r[0] == own) >= 4)
        # the run Locust records through this proxy (Locust's --host spelt with localhost), and one
        # recorded through another proxy at the same time
        begun = dt.datetime.now(dt.UTC)
        writer.append("runs_log", _run_row("lc-1", p_url.replace("127.0.0.1", "localhost"), "running", begun))
        writer.flush()
        other.append("runs_log", _run_row("other-1", "http://127.0.0.1:1", "running", begun))
        other.flush()
        _wait(lambda: "lc-1" in sm.runs_seen)
        kv.set(0.5)
        handles.set(4096.0)
        _wait(lambda: sum(1 for r in _samples(store) if r[0] == "lc-1" and r[3] == 0.5) >= 3)
        ended = dt.datetime.now(dt.UTC)
        writer.append("runs_log", _run_row("lc-1", p_url, "complete", ended))
        writer.flush()
        _wait(lambda: any(r[0] == own and r[1] > ended for r in _samples(store)))
        kv.set(0.2)
        _wait(lambda: any(r[0] == own and r[3] == 0.2 for r in _samples(store)))
    finally:
        sm.stop()
        writer.close()
        other.close()
        d_http.shutdown()
        p_http.shutdown()
    rows = _samples(store)
    mine = [r for r in rows if r[0] == "lc-1"]
    assert sm.runs_seen == ["lc-1"]
    assert not [r for r in rows if r[0] == "other-1"], "a run through another proxy got this serve's scrapes"
    # the run's samples: both endpoints, scraped between its running row and its end (+ the final settle)
    assert {r[2] for r in mine} == {"vllm:kv_cache_usage_perc", "turnscope_handle_bytes_live"}
    assert min(r[1] for r in mine) >= begun
    assert max(r[1] for r in mine) <= ended + dt.timedelta(seconds=serve_metrics.FINAL_SETTLE_S + 2 * INTERVAL_S)
    assert 4096.0 in {r[3] for r in mine if r[2] == "turnscope_handle_bytes_live"}
    # the serve's own id before and after the run, never while it was scraped under the run
    first, last = min(r[1] for r in mine), max(r[1] for r in mine)
    ours = [r for r in rows if r[0] == own]
    assert any(r[1] < first for r in ours) and any(r[1] > last for r in ours)
    assert not [r for r in ours if first < r[1] < last]
    assert {r[3] for r in ours if r[2] == "vllm:kv_cache_usage_perc"} >= {0.1, 0.2}
