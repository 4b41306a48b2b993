"""Store integration tests: real Parquet shards, real DuckDB views (docs/schema/overview.md)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from store.queries import turns as turn_queries
from store.writer import SCHEMA_PATH, Store
from tests.handed_cases import CASES as HANDED

CASES = HANDED / "store"
UTC = dt.UTC


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "store")
    s.init()
    return s


def _shards(store: Store, run_id: str, table: str) -> list[Path]:
    return sorted((store.root / "runs" / run_id / table).glob("*.parquet"))


@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Asia/Kolkata", "Pacific/Chatham"])
def test_store_same_instant_offsets(store: Store, tz: str) -> None:
    rows = [json.loads(line) for line in (CASES / "same_instant_offsets.jsonl").read_text().splitlines() if line]
    expect = json.loads((CASES / "same_instant_offsets.expect.json").read_text())["expect"]
    with store.writer("r1", "w") as w:
        for i, r in enumerate(rows):
            w.append("turns", {"session_id": "s", "turn_index": i, "request_id": r["request_id"],
                               "sent_at": dt.datetime.fromisoformat(r["sent_at"])})
    con = store.connect()
    con.execute(f"SET TimeZone = '{tz}'")
    a_eq_b, c_minus_a = con.execute(
        """SELECT a.sent_at = b.sent_at, epoch(c.sent_at) - epoch(a.sent_at)
           FROM turns a, turns b, turns c
           WHERE a.request_id = 'a' AND b.request_id = 'b' AND c.request_id = 'c'"""
    ).fetchone()
    assert a_eq_b is expect["a_equals_b"]
    assert c_minus_a == pytest.approx(expect["c_minus_a_s"], abs=1e-6)
    # The instant is stored in UTC: 12:38:00Z rendered in UTC, whatever the session zone.
    assert con.execute("SELECT strftime(timezone('UTC', sent_at), '%H:%M:%S.%g') FROM turns "
                       "WHERE request_id = 'c'").fetchone()[0] == "12:38:00.250"


def test_store_handle_across_decode_restart(store: Store) -> None:
    """The handed rows (decode scrapes of process_start_time_seconds and turns, interleaved) give
    one decode restart at the new process start (12:01:10Z), not at the scrape that first showed
    it (12:02:00Z); the turns whose handle was issued before it and used after it are found, the
    'hit' among them is stale, and a handle issued after the restart is valid."""
    rows = [json.loads(line) for line in (CASES / "handle_across_decode_restart.jsonl").read_text().splitlines()
            if line]
    expect = json.loads((CASES / "handle_across_decode_restart.expect.json").read_text())["expect"]
    with store.writer("r1", "w") as w:
        for r in rows:
            table = r.pop("table")
            for k in ("scraped_at", "sent_at"):
                if k in r:
                    r[k] = dt.datetime.fromisoformat(r[k])
            w.append(table, r)
    con = store.connect()
    lifetimes = con.execute("""SELECT strftime(timezone('UTC', started_at), '%Y-%m-%dT%H:%M:%SZ'), restarts_before
                               FROM engine_lifetimes WHERE role = 'decode' ORDER BY started_at""").fetchall()
    restarts = [at for at, before in lifetimes if before > 0]
    assert len(restarts) == expect["decode_restarts"] and restarts == [expect["decode_restart_at"]]

    def turns(where: str) -> list[str]:
        return [f"{sid}/{k}" for sid, k in con.execute(
            f"SELECT session_id, turn_index FROM turn_lifetimes WHERE {where} ORDER BY sent_at").fetchall()]

    assert sorted(turns("handle_spans_restart")) == sorted(expect["handles_spanning_restart"])
    assert turns("stale_hit") == expect["stale_handle_hits"]
    assert turns("handle_spans_restart AND reuse <> 'hit'") == expect["restart_attributed_misses"]
    assert sorted(turns("reuse = 'hit' AND NOT stale_hit")) == sorted(expect["valid_hits"])
    # bracketing by scrape time instead would have flagged s3/1 (issued 12:01:50, before the
    # 12:02:00 scrape that first showed the new lifetime): the view does not
    assert "s3/1" not in turns("handle_spans_restart")
    # the Turns page's server-side table counts the same turns (it asks turn_lifetimes only of runs
    # whose decode restarted)
    side = turn_queries.server_side(con, ["r1"])
    assert not side.empty and (side["restarts"] == expect["decode_restarts"]).all()
    assert (side["turns_on_pre_restart_handles"] == len(expect["handles_spanning_restart"])).all()
    assert (side["stale_hits"] == len(expect["stale_handle_hits"])).all()


def test_store_handle_issued_in_the_second_a_restart_reads_early_spans_it(store: Store) -> None:
    """A decode process start as prometheus_client reports it (boot time from /proc/stat in whole
    seconds) can read up to 1 s early. The real run this comes from (test_faults_vllm, D restarted
    between turns): new start read 12:00:40.42, the four turn-0 handles issued 0.30-0.37 s after
    that by the *old* D (its restart began once they were done), used 31 s later on the new D.
    All four span the restart; a handle the new D issued 5 s after its start does not."""
    t0 = dt.datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
    old_start, new_start = t0.timestamp(), t0.timestamp() + 40.42
    with store.writer("r1", "w") as w:
        for at, start in ((1.0, old_start), (40.1, old_start), (69.0, new_start), (99.0, new_start)):
            w.append("metric_samples", {"scraped_at": t0 + dt.timedelta(seconds=at), "endpoint": "http://127.0.0.1:8200",
                                        "role": "decode", "name": "process_start_time_seconds", "value": start})
        for sid, issued in (("a", 40.72), ("b", 40.79), ("c", 40.78), ("d", 40.78)):
            w.append("turns", {"session_id": sid, "turn_index": 0, "sent_at": t0 + dt.timedelta(seconds=40.2),
                               "status": "ok", "reuse": "miss_first_turn", "decode_engine": "127.0.0.1:8200"})
            used = 71.0
            w.append("turns", {"session_id": sid, "turn_index": 1, "sent_at": t0 + dt.timedelta(seconds=used),
                               "status": "ok", "reuse": "miss_decode_restarted", "decode_engine": "127.0.0.1:8200",
                               "handle_age_s": used - issued})
            # turn 2's handle came from the new D, issued 5 s after its start
            w.append("turns", {"session_id": sid, "turn_index": 2, "sent_at": t0 + dt.timedelta(seconds=80.42),
                               "status": "ok", "reuse": "hit", "decode_engine": "127.0.0.1:8200", "handle_age_s": 35.0})
    got = store.connect().execute("SELECT session_id, turn_index FROM turn_lifetimes WHERE handle_spans_restart "
                                  "ORDER BY 1, 2").fetchall()
    assert got == [(sid, 1) for sid in "abcd"]
    assert store.connect().execute("SELECT count(*) FROM turn_lifetimes WHERE stale_hit").fetchone()[0] == 0


def test_store_unknown_column_and_table(store: Store) -> None:
    w = store.writer("r1", "w")
    try:
        with pytest.raises(ValueError, match=r"turns: unknown column\(s\) 'ttft_ms'"):
            w.append("turns", {"session_id": "s", "turn_index": 0, "ttft_ms": 12})
        with pytest.raises(ValueError, match="unknown table 'turn'"):
            w.append("turn", {"session_id": "s"})
        with pytest.raises(ValueError, match="turns.sent_at: naive datetime"):
            w.append("turns", {"session_id": "s", "turn_index": 0, "sent_at": dt.datetime(2026, 1, 1)})
        with pytest.raises(ValueError, match="turns.session_id is NOT NULL"):
            w.append("turns", {"turn_index": 0})
        with pytest.raises(ValueError, match="turns.turn_index: expected int"):
            w.append("turns", {"session_id": "s", "turn_index": "0"})
    finally:
        w.close()
    assert _shards(store, "r1", "turns") == []  # nothing bad was buffered


def test_store_missing_columns_are_null_and_json_is_text(store: Store) -> None:
    now = dt.datetime(2026, 4, 29, 12, 0, tzinfo=UTC)
    with store.writer("r1", "w") as w:
        w.append("metric_samples", {"scraped_at": now, "endpoint": "http://x", "name": "m",
                                    "labels": {"pid": "2", "engine": "0"}, "value": 3})
    con = store.connect()
    role, labels, engine, value = con.execute(
        "SELECT role, labels, labels->>'engine', value FROM metric_samples").fetchone()
    assert role is None
    assert json.loads(labels) == {"engine": "0", "pid": "2"}
    assert engine == "0"
    assert value == 3.0


def test_store_empty_views(store: Store) -> None:
    con = store.connect()
    views = [r[0] for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal AND schema_name='main'").fetchall()]
    for v in ["runs_log", "sessions", "turns", "metric_samples", "runs", "turn_breakdown",
              "session_tasks", "metric_increases", "run_summary", "mode_ab"]:
        assert v in views
        assert con.execute(f"SELECT count(*) FROM {v}").fetchone()[0] == 0
    # Only views in the file: no table holds data.
    assert con.execute("SELECT count(*) FROM duckdb_tables()").fetchone()[0] == 0


def test_store_runs_view_latest_status(store: Store) -> None:
    t0 = dt.datetime(2026, 4, 29, 12, 0, tzinfo=UTC)
    # Two writers, rows arriving out of order: the latest updated_at wins, not the latest write.
    with store.writer("r1", "a") as w1, store.writer("r2", "b") as w2:
        w1.append("runs_log", {"status": "complete", "mode": "pd", "updated_at": t0 + dt.timedelta(seconds=60)})
        w1.flush()
        w1.append("runs_log", {"status": "running", "mode": "pd", "updated_at": t0})
        w2.append("runs_log", {"status": "running", "mode": "pd-bidir", "updated_at": t0})
        w2.append("runs_log", {"status": "failed", "mode": "pd-bidir",
                               "updated_at": t0 + dt.timedelta(seconds=5)})
        w2.append("turns", {"session_id": "s", "turn_index": 0, "status": "ok", "ttft_s": 0.5})
        w2.append("turns", {"session_id": "s", "turn_index": 1, "status": "error"})
    con = store.connect()
    assert con.execute("SELECT run_id, status FROM runs ORDER BY run_id").fetchall() == [
        ("r1", "complete"), ("r2", "failed")]
    assert con.execute("SELECT run_id, turns, ok_turns, failed_turns, ttft_p50_s FROM run_summary "
                       "ORDER BY run_id").fetchall() == [("r1", 0, 0, 0, None), ("r2", 2, 1, 1, 0.5)]


def test_store_reader_open_while_writer_flushes(store: Store) -> None:
    reader = store.connect(read_only=True)
    t0 = dt.datetime(2026, 4, 29, 12, 0, tzinfo=UTC)
    w = store.writer("r1", "w")
    try:
        for i in range(3):
            w.append("turns", {"session_id": "s", "turn_index": i, "sent_at": t0})
            w.flush()  # must not need any lock the open reader holds
            assert reader.execute("SELECT count(*) FROM turns").fetchone()[0] == i + 1
        store.init()  # same schema version: fine while a reader holds the file
    finally:
        w.close()
        reader.close()
    assert len(_shards(store, "r1", "turns")) == 3


def test_store_background_flush_within_interval(store: Store) -> None:
    w = store.writer("r1", "w", flush_interval_s=0.2)
    try:
        w.append("turns", {"session_id": "s", "turn_index": 0})
        deadline = time.monotonic() + 2.0
        while not _shards(store, "r1", "turns") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_shards(store, "r1", "turns")) == 1, "background flusher did not write within 2 s"
        assert store.connect().execute("SELECT count(*) FROM turns").fetchone()[0] == 1
    finally:
        w.close()
    assert not list((store.root / "runs").rglob("*.tmp"))


def test_store_concurrent_writers_same_id_do_not_collide(store: Store) -> None:
    ws = [store.writer("r1", "locust-1") for _ in range(2)]  # e.g. a restarted worker
    for k, w in enumerate(ws):
        for i in range(5):
            w.append("turns", {"session_id": f"s{k}", "turn_index": i})
        w.flush()
    for w in ws:
        w.close()
    assert len(_shards(store, "r1", "turns")) == 2
    assert store.connect().execute("SELECT count(*) FROM turns").fetchone()[0] == 10


def test_store_bad_run_id(store: Store) -> None:
    for bad in ["../x", "_schema", "a/b", ""]:
        with pytest.raises(ValueError, match="run_id"):
            store.writer(bad, "w")


def test_store_init_locked_with_outdated_views_is_clear(tmp_path: Path) -> None:
    root = tmp_path / "store"
    Store(root).init()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         ("import duckdb, sys, time; c = duckdb.connect(sys.argv[1], read_only=True); "
         "print('ok', flush=True); time.sleep(60)"), str(root / "turnscope.duckdb")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        Store(root).init()  # same version: tolerated
        changed = tmp_path / "schema.sql"
        changed.write_text(SCHEMA_PATH.read_text().replace(
            "CREATE VIEW mode_ab AS", "CREATE VIEW extra_view AS SELECT 1 AS x;\nCREATE VIEW mode_ab AS"))
        with pytest.raises(RuntimeError, match="close its readers"):
            Store(root, schema_path=changed).init()
    finally:
        holder.kill()
        holder.wait()
    s = Store(root, schema_path=changed)
    s.init()  # lock gone: views upgraded
    assert s.connect().execute("SELECT x FROM extra_view").fetchone() == (1,)


def test_store_view_types_follow_schema(store: Store) -> None:
    con = store.connect()
    types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                             "WHERE table_name = 'metric_samples'").fetchall())
    assert types == {"run_id": "VARCHAR", "scraped_at": "TIMESTAMP WITH TIME ZONE", "endpoint": "VARCHAR",
                     "role": "VARCHAR", "name": "VARCHAR", "labels": "JSON", "value": "DOUBLE"}
    with pytest.raises(duckdb.Error):
        con.execute("CREATE TABLE x (a INT)")  # read-only


def test_store_metric_increases_view_counter_reset_case(store: Store) -> None:
    case = json.loads((CASES.parent / "prometheus" / "counter_reset.json").read_text())
    t0 = dt.datetime(2026, 4, 29, 12, 0, tzinfo=UTC)
    with store.writer("r1", "scraper") as w:
        for i, s in enumerate(case["scrapes"]):
            at = t0 + dt.timedelta(seconds=i)
            base = {"scraped_at": at, "endpoint": "http://p", "role": "prefill", "labels": {"engine": "0"}}
            w.append("metric_samples", {**base, "name": "process_start_time_seconds", "labels": {},
                                        "value": s["process_start_time_seconds"]})
            w.append("metric_samples", {**base, "name": "vllm:prompt_tokens_total", "value": s["value"]})
    inc, resets = store.connect().execute(
        "SELECT sum(increase), count(*) FILTER (WHERE reset) FROM metric_increases "
        "WHERE name = 'vllm:prompt_tokens_total'").fetchone()
    assert (inc, resets) == (case["expect"]["increase"], case["expect"]["restarts"])


def test_store_metric_increases_view_restart_past_old_value(store: Store) -> None:
    # 4 -> 10 (+6); restart (start time 1 -> 2) and already at 12: +12, not +2. Then a drop
    # without a start-time series on another endpoint: 5 -> 3 is a reset, +3.
    t0 = dt.datetime(2026, 4, 29, 12, 0, tzinfo=UTC)
    rows = [("http://a", 0, 1.0, 4), ("http://a", 1, 1.0, 10), ("http://a", 2, 2.0, 12),
            ("http://b", 0, None, 5), ("http://b", 1, None, 3)]
    with store.writer("r1", "scraper") as w:
        for ep, i, start, v in rows:
            at = t0 + dt.timedelta(seconds=i)
            if start is not None:
                w.append("metric_samples", {"scraped_at": at, "endpoint": ep, "name": "process_start_time_seconds",
                                            "value": start})
            w.append("metric_samples", {"scraped_at": at, "endpoint": ep, "name": "c_total", "value": v})
    got = store.connect().execute(
        "SELECT endpoint, sum(increase), count(*) FILTER (WHERE reset) FROM metric_increases "
        "WHERE name = 'c_total' GROUP BY endpoint ORDER BY endpoint").fetchall()
    assert got == [("http://a", 18.0, 1), ("http://b", 3.0, 1)]


def test_store_first_flush_imports_nothing_under_gevent(store: Store) -> None:
    # In a Locust process (gevent-patched) the flusher is a greenlet: any import its first flush
    # does (pyarrow's lazy pandas shim took 125-200 ms) blocks every client greenlet meanwhile. The
    # writer pays for those imports when it is made; its first background flush imports nothing.
    code = f"""
import gevent.monkey
gevent.monkey.patch_all()
import datetime as dt, sys, time
from store.writer import Store
store = Store({str(store.root)!r})
w = store.writer("r1", "locust-users-x", flush_interval_s=0.2)
before = set(sys.modules)
w.append("turns", {{"session_id": "s", "turn_index": 0, "sent_at": dt.datetime.now(dt.UTC), "status": "ok"}})
deadline = time.monotonic() + 30
while not list((store.root / "runs" / "r1" / "turns").glob("*.parquet")) and time.monotonic() < deadline:
    time.sleep(0.05)
print(sorted(set(sys.modules) - before))
w.close()
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout[:400]
    assert len(_shards(store, "r1", "turns")) == 1
