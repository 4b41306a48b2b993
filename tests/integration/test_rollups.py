"""Per-run rollups (store/rollup.py) give the dashboard the same figures as the plain views.

Second route: every query of ``store.queries`` is run over a real store (the dashboard
fixture, written by store.writer's writer) once on the plain views (``db.use_rollups = False``)
and once through the rollups, and the frames must be equal; each rolled-up row must equal its
plain view's row. Then more rows arrive (a shard appended to a rolled-up run, a new finished run
and a running one) and the two routes must still agree, before and after rolling up again.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from planner.recorded_whatif import whatif_ttl_d_limit
from store import db, queries
from store.queries.memory import WHATIF_TTLS_S
from store.rollup import MANIFEST, ROLLUP_DIR, SUMMARY_VIEWS, Rollups
from store.writer import Store
from tests import dashboard_store as fx

TTLS = (60.0, 120.0, 480.0, 900.0)


def calls(run_ids: tuple[str, ...]) -> list[tuple[str, object, tuple]]:
    """Every dashboard query with the arguments its page gives it, over `run_ids` and narrowed."""
    every = queries.TurnFilter(run_ids)
    narrow = queries.TurnFilter(run_ids, archetypes=("coding",), kinds=("turn",), gap_kinds=("tool", "think"))
    out: list[tuple[str, object, tuple]] = [("runs", queries.runs, ()), ("filter_options", queries.filter_options, (run_ids,))]
    for tag, f in (("all", every), ("narrow", narrow)):
        out += [
            (f"reuse_outcomes {tag}", queries.reuse_outcomes, (f, 1)),
            (f"ttft_stats {tag}", queries.ttft_stats, (f, 1)),
            (f"ttft_samples {tag}", queries.ttft_samples, (f, 1, None)),
            (f"ttft_samples sampled {tag}", queries.ttft_samples, (f, 1, 5)),
            (f"ttft_by_turn {tag}", queries.ttft_by_turn, (f,)),
            (f"latency_by {tag}", queries.latency_by, (f, "turn_index")),
            (f"latency_by history {tag}", queries.latency_by, (f, "history")),
            (f"time_split {tag}", queries.time_split, (f,)),
            (f"reuse_vs_expected {tag}", queries.reuse_vs_expected, (f, 128)),
            (f"reuse_shortfalls {tag}", queries.reuse_shortfalls, (f, 128, 200)),
            (f"task_split {tag}", queries.task_split, (f,)),
            (f"session_list {tag}", queries.session_list, (f, 500)),
            (f"memory_timeline {tag}", queries.memory_timeline, (f,)),
            (f"hit_rate_timeline {tag}", queries.hit_rate_timeline, (f,)),
            (f"reuse_cost {tag}", queries.reuse_cost, (f,)),
            (f"whatif_ttl {tag}", queries.whatif_ttl, (f, TTLS)),
        ]
    out += [
        ("external_kv_tokens", queries.external_kv_tokens, (run_ids,)),
        ("run_summary", queries.run_summary, (run_ids,)),
        ("kv_transfer", queries.kv_transfer, (run_ids,)),
        ("run_config", queries.run_config, (run_ids,)),
        ("compare_stats", queries.compare_stats, (run_ids[:2], run_ids[2:], None, 1)),
        ("compare_samples", queries.compare_samples, (run_ids[:2], run_ids[2:], None, None)),
        ("whatif_ttl_d_limit grid", whatif_ttl_d_limit, (run_ids, WHATIF_TTLS_S)),
        ("whatif_ttl_d_limit off grid", whatif_ttl_d_limit, (run_ids, (75.0, 480.0))),
    ]
    return out


def both_routes(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each query's frame on the plain views equals its frame through the rollups."""
    store = db.StoreLocation(root)
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    try:
        run_ids = tuple(r for (r,) in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall())
    finally:
        con.close()
    for name, query, args in calls(run_ids):
        monkeypatch.setattr(db, "use_rollups", False)
        plain = db.read(store, query, *args)
        monkeypatch.setattr(db, "use_rollups", True)
        rolled = db.read(store, query, *args)
        pd.testing.assert_frame_equal(rolled, plain, check_exact=False, rtol=1e-12, obj=name)


def summary_rows_equal_views(root: Path) -> list[str]:
    """Check each fresh run's rolled-up rows against its plain view's rows; returns the fresh ids."""
    rollups = Rollups(Store(root), whatif=whatif_ttl_d_limit)
    fresh = rollups.freshness().fresh
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    try:
        for run_id in fresh:
            for view in SUMMARY_VIEWS:
                plain = con.execute(f"SELECT * FROM {view} WHERE run_id = $r", {"r": run_id}).df()
                rolled = pd.read_parquet(root / ROLLUP_DIR / run_id / f"{view}.parquet")
                assert len(plain) == 1, (view, run_id)
                for col in plain.columns:
                    a, b = plain[col].iloc[0], rolled[col].iloc[0]
                    # floats to 1e-12: DuckDB's parallel sums add in no fixed order
                    same = (pd.isna(a) and pd.isna(b)) or a == b or (
                        isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-12))
                    assert same, (view, run_id, col, a, b)
    finally:
        con.close()
    return list(fresh)


def add_run(root: Path, run_id: str, status: str, minutes: int) -> None:
    """A run of one pd-bidir session (the fixture's rows for session 0 of bidir-1)."""
    w = Store(root).writer(run_id, "late", flush_interval_s=60)
    try:
        start = fx.T0 + dt.timedelta(minutes=minutes)
        w.append("runs_log", {"label": run_id, "mode": "pd-bidir", "workload": fx.WORKLOAD, "history_mode": fx.HISTORY,
                              "config": fx.config("bidir-1"), "status": status, "started_at": start,
                              "updated_at": start})  # fmt: skip
        w.append("sessions", {**fx.session_row("bidir-1", 0), "run_id": run_id})
        for t in range(fx.TURNS):
            w.append("turns", {**fx.turn_row("bidir-1", 0, t, start + dt.timedelta(seconds=30 * t)), "run_id": run_id})
    finally:
        w.close()


def test_rollups_give_the_plain_views_figures(monkeypatch, tmp_path):
    root = fx.build(tmp_path / "store")
    rollups = Rollups(Store(root), whatif=whatif_ttl_d_limit)
    assert rollups.freshness().fresh == ()
    both_routes(root, monkeypatch)  # nothing rolled up: both routes are the plain views

    written = rollups.write_finished()
    assert sorted(written) == sorted(fx.RUNS)  # every fixture run is complete
    assert sorted(summary_rows_equal_views(root)) == sorted(fx.RUNS)
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    try:  # the rollups are what the dashboard's connection reads
        assert sorted(rollups.install(con)) == sorted(fx.RUNS)
        temp = {r for (r,) in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary").fetchall()}
        assert set(SUMMARY_VIEWS) <= temp
    finally:
        con.close()
    both_routes(root, monkeypatch)
    assert rollups.write_finished() == []  # all fresh: nothing to do

    # A late shard of a rolled-up run: its rollup is stale and the run is read from its shards.
    w = Store(root).writer("bidir-1", "late", flush_interval_s=60)
    try:
        late = "bidir-1-late"  # a copy of session 1 under another id
        w.append("sessions", {**fx.session_row("bidir-1", 1), "session_id": late})
        for t in range(fx.TURNS):
            w.append("turns", {**fx.turn_row("bidir-1", 1, t, fx.sent_at("bidir-1", 1, t)), "session_id": late})
    finally:
        w.close()
    assert "bidir-1" not in rollups.freshness().fresh
    # More runs: a finished one and a running one, neither rolled up.
    add_run(root, "late-done", "complete", 60)
    add_run(root, "late-running", "running", 70)
    both_routes(root, monkeypatch)

    assert sorted(rollups.write_finished()) == ["bidir-1", "late-done"]  # never a running run
    assert "late-running" not in rollups.freshness().fresh
    summary_rows_equal_views(root)
    both_routes(root, monkeypatch)
    manifest = json.loads((root / ROLLUP_DIR / "bidir-1" / MANIFEST).read_text())
    assert len(manifest["shards"]["turns"]) == 2  # made from the fixture's shard and the late one


def test_rollup_cli(tmp_path):
    from typer.testing import CliRunner

    from turnscope.commands import app

    root = fx.build(tmp_path / "store")
    out = CliRunner().invoke(app, ["rollup", "--store", str(root)])
    assert out.exit_code == 0, out.output
    assert f"rolled up {len(fx.RUNS)} run(s)" in out.output
    again = CliRunner().invoke(app, ["rollup", "--store", str(root)])
    assert "rolled up 0 run(s)" in again.output
    missing = CliRunner().invoke(app, ["rollup", "--store", str(tmp_path / "none")])
    assert missing.exit_code != 0 and "no store at" in missing.output


def test_views_of_an_older_schema_are_named_and_recreated_by_rollup(tmp_path):
    """A store whose views were written by an older turnscope (its run_config lacked the routing
    columns): the dashboard says so and how to fix it; `turnscope rollup` recreates the views."""
    from typer.testing import CliRunner

    from store.writer import SCHEMA_PATH
    from turnscope.commands import app

    root = fx.build(tmp_path / "store")
    old_sql = SCHEMA_PATH.read_text().replace(
        ",\n       json_extract_string(config, '$.topology.proxy.prefill_routing') AS prefill_routing,\n"
        "       json_extract_string(config, '$.topology.proxy.decode_routing') AS decode_routing\n",
        "\n")
    assert old_sql != SCHEMA_PATH.read_text()  # the older view really lacks the columns
    (tmp_path / "old.sql").write_text(old_sql)
    (root / "turnscope.duckdb").unlink()
    Store(root, tmp_path / "old.sql").init()
    loc = db.StoreLocation(root)
    with pytest.raises(db.StoreInvalid, match=r"another turnscope version.*turnscope rollup --store"):
        db.read(loc, queries.runs)
    out = CliRunner().invoke(app, ["rollup", "--store", str(root)])
    assert out.exit_code == 0, out.output
    assert set(db.read(loc, queries.runs)["run_id"]) == set(fx.RUNS)
