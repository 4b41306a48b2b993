"""Compaction (store/compact.py): a finished run's shards become one file per table, with every row.

The store is the dashboard fixture (written by store.writer's real writer), its shards split as a
run's writers leave them (a few rows per file). Truths, each by a second route: every table's rows
per run, as a multiset (a hash of each row's text), their count and the sums of every numeric column
before compaction; and every dashboard query's frame (tests/integration/test_rollups.py's list)
before compaction. A run still recording is left untouched and stays readable; a shard that lands
during the swap is kept; an interrupted compaction is resolved; a fresh rollup stays fresh.
A real recorded store is checked the same way in tests/integration/test_eval_vllm.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest

from planner.recorded_whatif import whatif_ttl_d_limit
from store import compact, db
from store.rollup import Rollups
from store.writer import Store, write_atomic
from tests import dashboard_store as fx
from tests.integration.test_rollups import add_run, calls

TABLES = ("turns", "sessions", "metric_samples", "runs_log")


def split_shards(root: Path, rows_per_file: int = 1) -> int:
    """Split every run's shard of every table into files of `rows_per_file` rows (a writer's
    one-second flushes); returns the number of files now."""
    n = 0
    for f in sorted((root / "runs").glob("*/*/*.parquet")):
        if f.parts[-3] == "_schema":
            continue
        t = pq.read_table(f)
        for i in range(0, max(t.num_rows, 1), rows_per_file):
            write_atomic(t.slice(i, rows_per_file), f.with_name(f"{f.stem}-s{i:06d}.parquet"))
            n += 1
        f.unlink()
    return n


def table_truths(root: Path) -> dict[str, list[tuple]]:
    """Per table and run: row count, the sum of each numeric column, and a hash of the multiset of
    its rows' text (order-free), by SQL over the views."""
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    try:
        out = {}
        for t in TABLES:
            nums = [c for (c,) in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = $t "
                "AND data_type IN ('DOUBLE', 'INTEGER', 'BIGINT')", {"t": t}).fetchall()]
            sums = "".join(f", sum({c})" for c in nums)
            out[t] = con.execute(f"SELECT run_id, count(*){sums}, list(md5(x::VARCHAR) ORDER BY md5(x::VARCHAR)) "
                                 f"FROM {t} x GROUP BY run_id ORDER BY run_id").fetchall()
        return out
    finally:
        con.close()


def assert_same(a: dict[str, list[tuple]], b: dict[str, list[tuple]]) -> None:
    assert a.keys() == b.keys()
    for t, rows in a.items():
        assert len(rows) == len(b[t]), t
        for ra, rb in zip(rows, b[t], strict=True):
            assert ra[:2] == rb[:2] and ra[-1] == rb[-1], (t, ra[0])  # run, count, the rows themselves
            for x, y in zip(ra[2:-1], rb[2:-1], strict=True):  # sums: floats added in another order
                assert (x is None and y is None) or math.isclose(x, y, rel_tol=1e-12), (t, ra[0], x, y)


def frames(root: Path) -> dict[str, pd.DataFrame]:
    run_ids = tuple(sorted(fx.RUNS))
    return {name: db.read(db.StoreLocation(root), q, *args) for name, q, args in calls(run_ids)}


def files(root: Path, run_id: str, table: str) -> list[str]:
    return sorted(p.name for p in (root / "runs" / run_id / table).glob("*.parquet"))


def test_compaction_keeps_every_row_and_every_figure(tmp_path):
    root = fx.build(tmp_path / "store")
    before_files = split_shards(root)
    add_run(root, "late-running", "running", 70)  # a run still recording: never touched
    split_shards(root)  # its shards too (and the fixture's, again: same rows)
    running_files = {t: files(root, "late-running", t) for t in TABLES}
    assert len(running_files["turns"]) == fx.TURNS
    truths, figures = table_truths(root), frames(root)

    store = Store(root)
    done = compact.compact_finished(store)
    assert {c.run_id for c in done} == set(fx.RUNS)
    for run_id in fx.RUNS:
        for t in TABLES:
            names = files(root, run_id, t)
            assert len(names) == 1 and names[0].startswith("compacted-"), (run_id, t, names)
    assert sum(c.files for c in done) == before_files  # every fixture shard went into a compacted file
    assert {t: files(root, "late-running", t) for t in TABLES} == running_files
    assert not list((root / "runs").glob("*/.*"))  # no staging directory left
    assert_same(table_truths(root), truths)
    for name, frame in frames(root).items():
        pd.testing.assert_frame_equal(frame, figures[name], check_exact=False, rtol=1e-12, obj=name)
    assert compact.compact_finished(store) == []  # one file per table: nothing more to do


def test_a_fresh_rollup_stays_fresh(tmp_path):
    root = fx.build(tmp_path / "store")
    split_shards(root)
    rollups = Rollups(Store(root), whatif=whatif_ttl_d_limit)
    assert sorted(rollups.write_finished()) == sorted(fx.RUNS)
    compact.compact_finished(Store(root))
    assert sorted(rollups.freshness().fresh) == sorted(fx.RUNS)
    assert rollups.write_finished() == []


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_shard_landing_during_the_swap_is_kept(tmp_path, monkeypatch, exchange):
    """A late writer's shard renamed into the table's directory after the rows were read (just
    before the swap): it stays beside the compacted file, whichever way the directories swap."""
    root = fx.build(tmp_path / "store")
    split_shards(root)
    truths = table_truths(root)
    if not exchange:
        monkeypatch.setattr(compact, "_exchange", lambda a, b: False)
    real_swap = compact._swap
    late = root / "runs" / "bidir-1" / "turns" / "late-aaaa-000000.parquet"

    def swap_after_a_late_shard(staging, table_dir):
        if table_dir == late.parent:
            first = min(table_dir.glob("test-*.parquet"))
            write_atomic(pq.read_table(first).slice(0, 1), late)
        real_swap(staging, table_dir)

    monkeypatch.setattr(compact, "_swap", swap_after_a_late_shard)
    compact.compact_finished(Store(root))
    names = files(root, "bidir-1", "turns")
    assert len(names) == 2 and late.name in names
    after = table_truths(root)
    turns = {r[0]: r[1] for r in after["turns"]}
    assert turns["bidir-1"] == {r[0]: r[1] for r in truths["turns"]}["bidir-1"] + 1


def test_an_interrupted_compaction_is_resolved(tmp_path, monkeypatch):
    """Cut after the swap (the old shards in the staging directory, one of them written late) and
    cut before it (the new file staged): the next compaction leaves every row once."""
    root = fx.build(tmp_path / "store")
    split_shards(root)
    truths = table_truths(root)
    monkeypatch.setattr(compact.shutil, "rmtree", lambda *a, **k: None)
    compact.compact_table(Store(root), "bidir-1", "turns")  # swapped; staging (old shards) kept
    compact.compact_table(Store(root), "bidir-2", "turns")
    monkeypatch.undo()
    run_dir = root / "runs" / "bidir-1"
    (staging,) = [p for p in run_dir.iterdir() if p.name.startswith(".turns")]
    src = min(staging.glob("*.parquet"))
    write_atomic(pq.read_table(src).slice(0, 1), staging / "late-bbbb-000000.parquet")  # written late
    # bidir-2: as if cut before the swap: put its old shards back and the new file in staging
    run2 = root / "runs" / "bidir-2"
    (staging2,) = [p for p in run2.iterdir() if p.name.startswith(".turns")]
    compact._swap(staging2, run2 / "turns")
    compact.compact_finished(Store(root))
    assert not list((root / "runs").glob("*/.*"))
    counts = {r[0]: r[1] for r in table_truths(root)["turns"]}
    want = {r[0]: r[1] for r in truths["turns"]}
    assert counts == {**want, "bidir-1": want["bidir-1"] + 1}


def test_rollup_command_compacts(tmp_path):
    from typer.testing import CliRunner

    from turnscope.commands import app

    root = fx.build(tmp_path / "store")
    split_shards(root)
    truths = table_truths(root)
    out = CliRunner().invoke(app, ["rollup", "--store", str(root)])
    assert out.exit_code == 0, out.output
    assert f"of {len(fx.RUNS)} finished run(s)" in out.output
    assert_same(table_truths(root), truths)


def test_views_read_a_store_during_compaction_of_another_run(tmp_path):
    """A reader between two tables' compactions sees every row (each swap is whole)."""
    root = fx.build(tmp_path / "store")
    split_shards(root)
    truths = table_truths(root)
    seen = []
    real = compact.compact_table

    def and_read(store, run_id, table):
        out = real(store, run_id, table)
        seen.append(table_truths(root))
        return out

    for run_id in sorted(fx.RUNS):
        for t in TABLES:
            and_read(Store(root), run_id, t)
    assert len(seen) == len(fx.RUNS) * len(TABLES)
    for s in seen:
        assert_same(s, truths)


def test_shards_of_an_older_schema_are_unified(tmp_path):
    """A shard written before a column existed (it lacks ``error``): the compacted file holds that
    column NULL for its rows, as the views read it (union_by_name), and every other value."""
    root = fx.build(tmp_path / "store")
    split_shards(root)
    turns = root / "runs" / "bidir-1" / "turns"
    first = min(turns.glob("*.parquet"))
    old = pq.read_table(first)
    assert old["error"].null_count == old.num_rows  # the fixture's turn has no error: nothing is lost
    write_atomic(old.drop_columns(["error"]), first)
    truths = table_truths(root)
    compact.compact_finished(Store(root))
    assert len(files(root, "bidir-1", "turns")) == 1
    assert_same(table_truths(root), truths)
