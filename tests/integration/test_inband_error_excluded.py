"""An in-band stream error (handed case sse/inband_error_after_tokens.json) is recorded as a failed
turn with its partial measurements, and left out of every latency figure: the store's views, the
dashboard's percentiles and the CLI's bottom line.

The truth is a second route to the same figures: the fixture store of tests/dashboard_store.py
without the extra turn. Every latency figure must be the same with and without it, while the turn
itself is on the row with its server message, HTTP 200, TTFT and 3 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from loadgen.session import TurnPlan
from loadgen.session_recorder import turn_row
from loadgen.stream_client import stream_turn
from store import db, queries
from store.writer import Store
from tests import dashboard_store
from tests.handed_cases import CASES
from tests.integration.http_stub import StubServer, events_script

pytestmark = pytest.mark.timing

CASE = json.loads((CASES / "sse" / "inband_error_after_tokens.json").read_text())
RUN, SESSION = "bidir-1", "bidir-1-s0"
EXTRA_TURN = dashboard_store.TURNS  # one past the fixture's last turn of that session


def _inband_error_row() -> dict:
    """The row the session player writes for the handed stream, through the real client."""
    with StubServer(events_script(CASE["events"])) as stub, httpx.Client() as client:
        result = stream_turn(client, stub.url + "/v1/chat/completions",
                             {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout_s=10)
    plan = TurnPlan(new_messages=[{"role": "user", "content": "go on"}],
                    reference_reply={"role": "assistant", "content": "ok"}, gap_before_s=2.0, gap_kind="tool")
    row = turn_row(run_id=RUN, session_id=SESSION, turn_index=EXTRA_TURN, plan=plan, result=result,
                   gap_before_s=2.0, prompt_ids=None, expected_reusable_tokens=None, divergence_position=None)
    row["sent_at"] = dashboard_store.sent_at(RUN, 0, EXTRA_TURN - 1)
    return row


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the fixture store, the same with the in-band error turn, that turn's row)."""
    plain = dashboard_store.build(tmp_path_factory.mktemp("plain"))
    with_error = dashboard_store.build(tmp_path_factory.mktemp("with_error"))
    row = _inband_error_row()
    w = Store(with_error).writer(RUN, "inband", flush_interval_s=60)
    try:
        w.append("turns", row)
    finally:
        w.close()
    return plain, with_error, row


def _sql(root: Path, sql: str) -> list[tuple]:
    con = Store(root).connect()
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_inband_error_row_keeps_its_partial_measurements(stores) -> None:
    _, with_error, row = stores
    exp = CASE["expect"]
    assert row["status"] == exp["status"] == "error" and row["http_status"] == exp["http_status"] == 200
    assert exp["error_contains"] in row["error"]
    assert row["completion_tokens"] == exp["completion_tokens"] == 3
    assert row["ttft_s"] == pytest.approx(exp["ttft_ms"] / 1000, abs=0.1)
    (stored,) = _sql(with_error, f"SELECT status, http_status, error, completion_tokens, ttft_s FROM turns "
                                 f"WHERE session_id = '{SESSION}' AND turn_index = {EXTRA_TURN}")
    assert stored[:4] == ("error", 200, row["error"], 3) and stored[4] == pytest.approx(row["ttft_s"])


def test_store_views_leave_the_inband_error_out(stores) -> None:
    plain, with_error, _ = stores
    cols = "ok_turns, ttft_p50_s, ttft_p90_s, ttft_mean_s"
    sql = f"SELECT run_id, {cols}, turns, failed_turns FROM run_summary ORDER BY run_id"
    a, b = _sql(plain, sql), _sql(with_error, sql)
    for ra, rb in zip(a, b, strict=True):
        assert ra[:5] == rb[:5]  # ok turns and every latency figure unchanged
        extra = 1 if ra[0] == RUN else 0
        assert (rb[5], rb[6]) == (ra[5] + extra, ra[6] + extra)  # counted as a failed turn
    ab = "SELECT * FROM mode_ab ORDER BY ALL"
    assert _sql(plain, ab) == _sql(with_error, ab)


def test_dashboard_percentiles_leave_the_inband_error_out(stores) -> None:
    plain, with_error, _ = stores
    f = queries.TurnFilter(run_ids=tuple(dashboard_store.RUNS))
    for query, args in ((queries.ttft_samples, (f, 0, 10_000)), (queries.ttft_stats, (f, 0)),
                        (queries.latency_by, (f, "turn_index"))):
        a = db.read(db.StoreLocation(plain), query, *args)
        b = db.read(db.StoreLocation(with_error), query, *args)
        assert a.equals(b), query.__name__


def test_cli_bottom_line_leaves_the_inband_error_out(stores, capsys, monkeypatch) -> None:
    from turnscope.commands.summaries import print_bottom_line

    plain, with_error, _ = stores
    monkeypatch.setenv("COLUMNS", "200")
    print_bottom_line(plain, list(dashboard_store.RUNS))
    a = capsys.readouterr().out
    print_bottom_line(with_error, list(dashboard_store.RUNS))
    b = capsys.readouterr().out
    assert "pd-bidir vs aggregated" in a and a == b
