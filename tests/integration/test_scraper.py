"""MetricsScraper against real prometheus_client HTTP servers, rows read back from the store."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import socket
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from loadgen.scraper import MetricsScraper
from store.writer import Store
from tests.integration.http_stub import Script, StubServer


def _serve(registry: CollectorRegistry, port: int = 0):
    httpd, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    return httpd, f"http://127.0.0.1:{httpd.server_port}"


def _registry(start: float) -> tuple[CollectorRegistry, Counter, Gauge]:
    reg = CollectorRegistry()
    events = Counter("turnscope_test_events", "Events.", ["kind"], registry=reg)
    usage = Gauge("turnscope_test_usage_perc", "Usage.", registry=reg)
    Histogram("turnscope_test_seconds", "Latency.", registry=reg, buckets=(0.1, 1.0)).observe(0.25)
    Gauge("process_start_time_seconds", "Start.", registry=reg).set(start)
    return reg, events, usage


def _wait_for(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _values(store: Store, name: str) -> list[float]:
    return [r[0] for r in store.connect().execute(
        "SELECT value FROM metric_samples WHERE name = ? ORDER BY scraped_at", [name]).fetchall()]


def test_scraper_records_counter_increments(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = Store(tmp_path / "store")
    store.init()
    reg, events, usage = _registry(start=1000.0)
    httpd, url = _serve(reg)
    port = httpd.server_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    garbage = StubServer(Script(headers={"Content-Type": "text/plain"}, fragments=[(0.0, b"not metrics at all\n")]))
    writer = store.writer("run1", "scraper", flush_interval_s=0.1)
    scraper = MetricsScraper([(url, "decode"), (dead, "prefill"), (garbage.url, "proxy")], writer, "run1",
                             interval_s=0.1, timeout_s=1.0)
    name = "turnscope_test_events_total"
    t_before = dt.datetime.now(dt.UTC)
    with garbage, caplog.at_level(logging.WARNING, logger="loadgen.scraper"):
        events.labels(kind="a").inc(3)
        usage.set(0.653)
        scraper.start()
        try:
            _wait_for(lambda: 3.0 in _values(store, name))
            events.labels(kind="a").inc(4)
            _wait_for(lambda: 7.0 in _values(store, name))
            # Engine restart: a fresh process on the same port, counter from 0, new start time.
            httpd.shutdown()
            httpd.server_close()
            reg2, events2, _ = _registry(start=2000.0)
            httpd, _ = _serve(reg2, port)
            # It counted past the old value before the next scrape: only the start time shows it.
            events2.labels(kind="a").inc(9)
            _wait_for(lambda: 9.0 in _values(store, name))
        finally:
            scraper.stop()
            writer.close()
            httpd.shutdown()
            httpd.server_close()
    t_after = dt.datetime.now(dt.UTC)

    vals = _values(store, name)
    # Exactly the values we set, in order: 3 (one or more scrapes), 7, then 9 after the restart.
    assert [v for i, v in enumerate(vals) if i == 0 or v != vals[i - 1]] == [3.0, 7.0, 9.0]
    con = store.connect()
    # The schema's metric_increases view: 4 before the restart, +9 after it (not 9 - 7 = 2).
    inc, resets = con.execute("SELECT sum(increase), count(*) FILTER (WHERE reset) FROM metric_increases "
                              "WHERE name = ?", [name]).fetchone()
    assert (inc, resets) == (13.0, 1)
    labels, role, endpoint = con.execute(
        "SELECT labels, role, endpoint FROM metric_samples WHERE name = ? LIMIT 1", [name]).fetchone()
    assert json.loads(labels) == {"kind": "a"} and role == "decode" and endpoint == url
    assert set(_values(store, "turnscope_test_usage_perc")) == {0.653, 0.0}
    assert set(_values(store, "process_start_time_seconds")) == {1000.0, 2000.0}
    names = {r[0] for r in con.execute("SELECT DISTINCT name FROM metric_samples").fetchall()}
    assert not [n for n in names if n.endswith(("_created", "_bucket"))], names
    assert {"turnscope_test_seconds_sum", "turnscope_test_seconds_count"} <= names
    lo, hi, endpoints = con.execute(
        "SELECT min(scraped_at), max(scraped_at), list(DISTINCT endpoint) FROM metric_samples").fetchone()
    assert t_before <= lo <= hi <= t_after
    assert endpoints == [url]  # the dead and the garbage endpoints produced no rows
    # They failed every round, were logged once per failure streak, and did not stop the thread.
    assert scraper.failed[dead] >= 3 and scraper.failed[garbage.url] >= 3 and scraper.ok[dead] == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert sum(dead in m for m in msgs) == 1
    assert sum(garbage.url in m and "not Prometheus text" in m for m in msgs) == 1


def test_scraper_interval_is_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.init()
    reg, _, _ = _registry(start=1.0)
    httpd, url = _serve(reg)
    writer = store.writer("run1", "scraper")
    scraper = MetricsScraper([(url, "aggregated")], writer, "run1", interval_s=0.25)
    try:
        scraper.start()
        time.sleep(1.1)  # scrapes at 0, 0.25, 0.5, 0.75, 1.0 s
    finally:
        scraper.stop()
        writer.close()
        httpd.shutdown()
        httpd.server_close()
    times = [r[0] for r in store.connect().execute(
        "SELECT DISTINCT epoch(scraped_at) FROM metric_samples ORDER BY 1").fetchall()]
    assert len(times) == 5
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(abs(g - 0.25) < 0.05 for g in gaps), gaps


def test_scraper_rejects_bad_config(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    store.init()
    with store.writer("run1", "w") as w:
        with pytest.raises(ValueError, match=r"endpoints\[0\].*role 'worker'"):
            MetricsScraper([("http://127.0.0.1:1", "worker")], w, "run1")
        with pytest.raises(ValueError, match="differs from the writer"):
            MetricsScraper([("http://127.0.0.1:1", "proxy")], w, "run2")


def test_scraper_final_scrape_holds_the_last_turn(tmp_path: Path) -> None:
    """A counter that rises after the last periodic scrape (the run's last turn) is in the store
    once stop() takes its final scrapes; without them the run would miss it."""
    import threading

    store = Store(tmp_path / "store")
    store.init()
    reg, events, _ = _registry(start=1000.0)
    httpd, url = _serve(reg)
    name = "turnscope_test_events_total"
    events.labels(kind="a")  # the series exists (at 0) before the first scrape
    try:
        for final_settle_s, run_id in ((0.0, "without"), (3.0, "with")):
            writer = store.writer(run_id, "scraper", flush_interval_s=0.1)
            scraper = MetricsScraper([(url, "prefill")], writer, run_id, interval_s=60.0)
            scraper.start()
            _wait_for(lambda s=scraper: s.ok[url] >= 1)
            events.labels(kind="a").inc(5)  # the last turn, counted after the last periodic scrape
            late = threading.Timer(0.1, lambda: events.labels(kind="a").inc(2))  # still being counted
            late.start()
            scraper.stop(final_settle_s=final_settle_s)
            late.join()
            writer.close()
        got = dict(store.connect().execute(
            "SELECT run_id, max(value) - min(value) FROM metric_samples WHERE name = ? GROUP BY run_id",
            [name]).fetchall())
        assert got == {"without": 0.0, "with": 7.0}
    finally:
        httpd.shutdown()
        httpd.server_close()
