"""Per-run rollups beside the shards: what the dashboard reads instead of the plain per-run views
once a run has finished (docs/schema/overview.md).

A finished run's rows never change, yet the views ``run_summary``, ``run_kv_transfer`` and
``run_handle_memory`` recompute every run from all its turns and scrapes (windows over every
scrape series, percentiles over every turn: seconds at millions of turns). ``Rollups.write``
stores, per finished run, under ``<root>/rollups/<run_id>/``:

- ``run_summary.parquet``, ``run_kv_transfer.parquet``, ``run_handle_memory.parquet``: the run's
  row of each of those plain views, as the view gives it (each view is computed per run: a run's
  row depends on its own rows only);
- ``run_whatif_d_limit.parquet``: the Memory page's TTL what-if with D's KV space as the limit
  (``planner.recorded_whatif.whatif_ttl_d_limit``, handed to the writer as ``whatif``: a replay of
  every turn of the run, the page's slowest query at scale) at
  :data:`~store.queries.memory.WHATIF_TTLS_S` and the TTLs of the runs
  rolled up with it (a run's own TTL among them); the query reads these rows for a rolled-up run
  whenever every TTL it is asked for is in that grid, and replays the run otherwise;
- ``manifest.json`` (written last): the store version (``Store.version``), the what-if's TTL grid,
  the shard files of the run the rollup was made from (``turns``, ``sessions``,
  ``metric_samples``, ``runs_log``) and each relation's column types.

A rollup is *fresh* while its manifest's version is the store's, its what-if grid is this
turnscope's :data:`~store.queries.memory.WHATIF_TTLS_S`, and the run's shard files are
exactly those listed; any shard added later (a late writer, a new status row) makes it stale and
the run is read through the plain views again until the next ``write``. Only runs whose status
(view ``runs``) is no longer ``running`` are rolled up.

``Rollups.install(con)`` shadows, on one read-only connection, those three views with TEMP views
of the same name and columns: the fresh runs' rollup rows, then the plain view (through the store
file's own catalog) for the other runs. It also creates two TEMP views that exist only where
rollups do: ``run_whatif_d_limit`` (the fresh runs' what-if rows) and ``rolled_up_runs``
(``run_id``: the fresh runs, whose what-if rows are complete for the grid). DuckDB resolves an unqualified name to the TEMP view
first, so every query on that connection reads the rollups where fresh; the store file keeps
only the plain views (operators' SQL reads the shards). tests/integration/test_rollups.py checks
that every dashboard query gives the same figures both ways.

Rollup files are written as temporary files and renamed into place (atomic on POSIX), like
shards; no DuckDB file is opened for writing, so rollups never take a lock a reader needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from store.queries.memory import ROLLED_UP_RUNS, WHATIF_RELATION, WHATIF_TTLS_S, run_config
from store.writer import Store, connect_read_only, sql_ident, sql_str, write_atomic

#: The what-if a rollup holds: ``(con, run_ids, ttls_s, rollups=False) -> DataFrame`` on a
#: connection to the plain views (``planner.recorded_whatif.whatif_ttl_d_limit``: the replay is the
#: planner's, a layer above the store, so its writer hands it in).
WhatIf = Callable[..., pd.DataFrame]

#: The directory of rollups under a store root.
ROLLUP_DIR = "rollups"
MANIFEST = "manifest.json"
#: Per-run views materialised per run (one row per run).
SUMMARY_VIEWS: tuple[str, ...] = ("run_summary", "run_kv_transfer", "run_handle_memory")
#: Shard tables whose files a rollup records (a change in any makes it stale).
WATCHED_TABLES: tuple[str, ...] = ("turns", "sessions", "metric_samples", "runs_log")


@dataclass(frozen=True)
class Freshness:
    """Which runs of a store have a fresh rollup (`fresh`) and the column types of each rolled-up
    relation (`columns`: relation -> [(column, DuckDB type)], from a fresh manifest)."""

    fresh: tuple[str, ...]
    columns: dict[str, list[list[str]]]


class Rollups:
    """The rollups of the store `store` (see the module docstring).

    Args:
        store: the store (its schema gives the base views' casts, its version the manifests').
        whatif: the what-if the rollups hold (:data:`WhatIf`); needed to write, not to read.
    """

    def __init__(self, store: Store, whatif: WhatIf | None = None):
        self.store = store
        self.dir = store.root / ROLLUP_DIR
        self.whatif = whatif

    # -- listing ------------------------------------------------------------------------------

    def shard_listing(self, run_id: str) -> dict[str, list[str]]:
        """The shard file names of `run_id` per watched table (sorted; [] when none)."""
        out = {}
        for table in WATCHED_TABLES:
            d = self.store.root / "runs" / run_id / table
            try:
                out[table] = sorted(n for n in os.listdir(d) if n.endswith(".parquet"))
            except FileNotFoundError:
                out[table] = []
        return out

    def _manifest(self, run_id: str) -> dict | None:
        try:
            return json.loads((self.dir / run_id / MANIFEST).read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None

    def freshness(self) -> Freshness:
        """The runs whose rollup is fresh: manifest of this store version, same shard files."""
        fresh, columns = [], {}
        try:
            candidates = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return Freshness((), {})
        for run_id in candidates:
            m = self._manifest(run_id)
            if (m and m.get("version") == self.store.version and m.get("whatif_ttls_s") == list(WHATIF_TTLS_S)
                    and m.get("shards") == self.shard_listing(run_id)):
                fresh.append(run_id)
                columns = m["columns"]
        return Freshness(tuple(fresh), columns)

    def recorded_runs(self) -> list[str]:
        """The run ids with a ``runs_log`` shard directory (``runs/<run_id>/runs_log/``)."""
        runs_dir = self.store.root / "runs"
        try:
            names = sorted(e.name for e in os.scandir(runs_dir) if e.is_dir())
        except FileNotFoundError:
            return []
        return [n for n in names if (runs_dir / n / "runs_log").is_dir() and n != "_schema"]

    # -- writing ------------------------------------------------------------------------------

    def write(self, run_ids: list[str]) -> list[str]:
        """Roll up `run_ids` from their shards through the plain views (each view computed once
        for all of them) and the what-if (:meth:`_whatif`); returns those written. A run that is unknown or still ``running``, or
        whose shards changed while it was read, is left out (nothing written for it).

        Raises:
            duckdb.IOException: the store's DuckDB file is missing or held by a writer.
            OSError: a rollup file could not be written.
            ValueError: the rollups were made without a ``whatif`` to write.
        """
        if self.whatif is None:
            raise ValueError("Rollups(store) reads rollups; writing them needs its whatif "
                             "(planner.recorded_whatif.whatif_ttl_d_limit)")
        before = {r: self.shard_listing(r) for r in run_ids}
        tables: dict[str, pa.Table] = {}
        columns: dict[str, list[list[str]]] = {}
        con = connect_read_only(self.store.root)
        try:
            con.execute("SET enable_progress_bar = false")
            done = {r for (r,) in con.execute(
                "SELECT run_id FROM runs WHERE status <> 'running' AND list_contains($ids::VARCHAR[], run_id)",
                {"ids": list(run_ids)}).fetchall()}  # fmt: skip
            ids = ", ".join(sql_str(r) for r in sorted(done))
            for view in SUMMARY_VIEWS if done else ():
                rel = con.sql(f"SELECT * FROM {sql_ident(view)} WHERE run_id IN ({ids})")
                columns[view] = [[c, str(t)] for c, t in zip(rel.columns, rel.types, strict=True)]
                table = rel.arrow()
                tables[view] = table.read_all() if hasattr(table, "read_all") else table  # a reader in newer DuckDB
            if done:
                tables[WHATIF_RELATION], columns[WHATIF_RELATION] = self._whatif(con, sorted(done))
        finally:
            con.close()
        written = []
        for run_id in run_ids:
            if run_id not in done or self.shard_listing(run_id) != before[run_id]:
                continue
            out = self.dir / run_id
            out.mkdir(parents=True, exist_ok=True)
            for view, table in tables.items():
                write_atomic(table.filter(pc.equal(table["run_id"], run_id)), out / f"{view}.parquet")
            manifest = {"run_id": run_id, "version": self.store.version, "whatif_ttls_s": list(WHATIF_TTLS_S),
                        "shards": before[run_id], "columns": columns}
            tmp = out / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, out / MANIFEST)  # last: the rollup counts from here on
            written.append(run_id)
        return written

    def _whatif(self, con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> tuple[pa.Table, list[list[str]]]:
        """The what-if rows of `run_ids` on `con` (plain views: nothing installed) at the grid
        :data:`WHATIF_TTLS_S` plus the runs' own TTLs, as a table and its column types."""
        own = run_config(con, run_ids)["decoder_kv_blocks_ttl_s"].dropna()
        grid = sorted(set(WHATIF_TTLS_S) | {float(t) for t in own})
        frame = self.whatif(con, list(run_ids), grid, rollups=False)
        rel = con.from_df(frame.drop(columns=["run_label", "mode"]).astype(
            {"block_size": "Int64", "decode_workers": "Int64"}))
        table = rel.arrow()
        table = table.read_all() if hasattr(table, "read_all") else table
        return table, [[c, str(t)] for c, t in zip(rel.columns, rel.types, strict=True)]

    def relist(self, run_id: str) -> None:
        """Record `run_id`'s current shard files in its rollup's manifest, keeping the rollup fresh:
        only for a compaction (`store.compact`), which replaces a run's shards by files of the same
        rows, and only where the rollup was fresh before it."""
        m = self._manifest(run_id)
        if m is None:
            return
        m["shards"] = self.shard_listing(run_id)
        tmp = self.dir / run_id / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(m, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.dir / run_id / MANIFEST)

    def write_finished(self) -> list[str]:
        """Roll up every run that is no longer running and has no fresh rollup; returns the ids
        written."""
        con = connect_read_only(self.store.root)
        try:
            done = [r for (r,) in con.execute("SELECT run_id FROM runs WHERE status <> 'running' ORDER BY run_id").fetchall()]
        finally:
            con.close()
        fresh = set(self.freshness().fresh)
        return self.write([r for r in done if r not in fresh])

    # -- reading ------------------------------------------------------------------------------

    def state(self) -> tuple[Freshness, tuple[str, ...]]:
        """What :meth:`install` installs: the freshness and the recorded runs without a fresh
        rollup (read through the plain views). Equal states install the same TEMP views, so a
        connection that installed one need not install it again (`store.db.read`)."""
        state = self.freshness()
        fresh = set(state.fresh)
        return state, tuple(r for r in self.recorded_runs() if r not in fresh) if fresh else ()

    def install(self, con: duckdb.DuckDBPyConnection,
                state: tuple[Freshness, tuple[str, ...]] | None = None) -> tuple[str, ...]:
        """Shadow the rolled-up relations on `con` with TEMP views reading the fresh runs'
        rollups and the other runs' shards (see the module docstring), as of `state` (:meth:`state`,
        read now when None); returns the fresh run ids (none: nothing is installed and `con` reads
        the plain views)."""
        state, live = self.state() if state is None else state
        if not state.fresh:
            return ()
        catalog = con.execute("SELECT current_database()").fetchall()[0][0]
        for view in SUMMARY_VIEWS:
            cols = ", ".join(f"CAST({sql_ident(c)} AS {t}) AS {sql_ident(c)}" for c, t in state.columns[view])
            files = "[" + ", ".join(sql_str(str(self.dir / r / f"{view}.parquet")) for r in state.fresh) + "]"
            sql = f"SELECT {cols} FROM read_parquet({files})"
            if live:  # the plain view for the other runs (DuckDB pushes the run filter into its scans)
                ids = ", ".join(sql_str(r) for r in live)
                sql += f" UNION ALL SELECT * FROM {sql_ident(catalog)}.main.{sql_ident(view)} WHERE run_id IN ({ids})"
            con.execute(f"CREATE OR REPLACE TEMP VIEW {sql_ident(view)} AS {sql}")
        cols = ", ".join(f"CAST({sql_ident(c)} AS {t}) AS {sql_ident(c)}" for c, t in state.columns[WHATIF_RELATION])
        files = "[" + ", ".join(sql_str(str(self.dir / r / f"{WHATIF_RELATION}.parquet")) for r in state.fresh) + "]"
        con.execute(f"CREATE OR REPLACE TEMP VIEW {sql_ident(WHATIF_RELATION)} AS SELECT {cols} FROM read_parquet({files})")
        ids = ", ".join(f"({sql_str(r)})" for r in state.fresh)
        con.execute(f"CREATE OR REPLACE TEMP VIEW {sql_ident(ROLLED_UP_RUNS)} AS SELECT * FROM (VALUES {ids}) AS v(run_id)")
        return state.fresh

