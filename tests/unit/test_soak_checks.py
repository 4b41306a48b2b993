"""The soak's rows check (bench/soak_checks.py): three counts of the same turns agree when nothing is
lost, and a row that goes missing, appears twice, or a Locust event or proxy request without its row
makes it fail. Inputs are hand-built: the truth is what was put in."""

from __future__ import annotations

import json

import pytest

from bench.soak_checks import StoredTurn, flat, locust_posts, proxy_requests, rows_check, steady_from_s

# 5 turns sent: 3 `turn` (one cancelled in flight at the stop), 1 `fresh`, 1 `edit` that failed.
STORED = [StoredTurn("turn", "ok", "lg-1"), StoredTurn("turn", "ok", "lg-2"), StoredTurn("fresh", "ok", "lg-3"),
          StoredTurn("edit", "error", "lg-4"), StoredTurn("turn", "cancelled", "lg-5")]
LOCUST = {"turn": (3, 1), "fresh": (1, 0), "edit": (1, 1)}
PROXY = [("lg-1", "ok"), ("lg-2", "ok"), ("lg-3", "ok"), ("lg-4", "http_500"), ("lg-5", "incomplete")]


def test_the_three_counts_agree_when_nothing_is_lost():
    ok, detail = rows_check(STORED, LOCUST, PROXY)
    assert ok, detail
    assert "stored 5 turns rows (1 cancelled, 1 error, 3 ok)" in detail
    assert "the proxy served 5 requests after the warm-up, 5 of them stored" in detail
    # a request cut off before it reached the proxy: stored (cancelled) and fired, never served
    ok, detail = rows_check(STORED, LOCUST, PROXY[:-1])
    assert ok and "1 stored request(s) never reached the proxy" in detail


def test_a_missing_row_fails():
    ok, detail = rows_check(STORED[:-1], LOCUST, PROXY)  # the cancelled turn's row lost
    assert not ok
    assert "turn: stored 2 (0 not ok) vs Locust 3 (1 failed)" in detail
    assert "1 request(s) the proxy served have no stored row, e.g. lg-5" in detail


def test_a_row_stored_twice_fails():
    ok, detail = rows_check(STORED + [StoredTurn("fresh", "ok", "lg-3")], LOCUST | {"fresh": (2, 0)}, PROXY)
    assert not ok and "1 request id(s) stored more than once, e.g. lg-3" in detail
    ok, detail = rows_check(STORED + [StoredTurn("fresh", "ok", "lg-3")], LOCUST, PROXY)
    assert not ok and "fresh: stored 2 (0 not ok) vs Locust 1 (0 failed)" in detail


def test_an_ok_row_the_proxy_never_served_or_a_request_logged_twice_fails():
    ok, detail = rows_check(STORED, LOCUST, PROXY[1:])
    assert not ok and "1 ok row(s) the proxy never served, e.g. lg-1" in detail
    ok, detail = rows_check(STORED, LOCUST, PROXY + [("lg-2", "ok")])
    assert not ok and "logged twice by the proxy" in detail


def test_locust_json_and_proxy_log_readers(tmp_path):
    f = tmp_path / "locust.json"
    f.write_text(json.dumps([{"method": "POST", "name": "turn", "num_requests": 3, "num_failures": 1},
                             {"method": "TTFT", "name": "TTFT", "num_requests": 3, "num_failures": 0}]))
    assert locust_posts(f) == {"turn": (3, 1)}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json: not Locust's --json-file stats"):
        locust_posts(tmp_path / "bad.json")
    lines = ['INFO: started', json.dumps({"event": "request", "status": "ok", "request_id": "lg-1"}), "{not json",
             json.dumps({"event": "other"})]
    assert proxy_requests(lines) == [("lg-1", "ok")]


def test_rss_judged_once_the_table_is_full():
    assert steady_from_s(15.0, 450.0) == 450.0 and steady_from_s(600.0, 450.0) == 600.0
    # medians of the first and last quarter (2 samples each of 8)
    assert flat([100.0, 100, 100, 100, 104, 104, 105, 105], 0.05, 0.0)[0]       # +5 %: flat
    assert not flat([100.0, 100, 100, 100, 104, 104, 106, 106], 0.05, 0.0)[0]   # +6 %: not
