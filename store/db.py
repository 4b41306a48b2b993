"""Locating and opening the turnscope store, read-only (docs/schema/overview.md).

The store is a directory: ``runs/<run_id>/<table>/*.parquet`` shards written by loadgen, and
``turnscope.duckdb``, which holds only views over those shards (data/schema.sql). The dashboard
never writes it.

The file is never held. A DuckDB read-only connection holds a shared lock on ``turnscope.duckdb``
for as long as it is open, and that lock makes a writer that (re)creates the views
(``Store(root).init()`` at the start of a run) fail. So `read` runs queries on `ViewsDb`, an
in-memory copy of the store's views made once (the file is opened read-only for a moment to read
its version) and again when the file changes; where the file's views are of another version,
each query opens the file read-only, reads, and closes it. `st.cache_data` (``dashboard.loader``)
keeps repeated reruns and visits cheap, keyed by the store's version so that rows of a run that is
still writing show up on the next rerun.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from core import resources
from store.rollup import Rollups
from store.writer import Store

ENV_VAR = "TURNSCOPE_STORE"
DB_FILE = "turnscope.duckdb"
#: turnscope's home: the checkout's ``data/``, or ``./turnscope-data`` installed (core.resources).
DEFAULT_STORE = resources.home()
#: How long a cached result may live (s). Query results are keyed by the store's version
#: (``dashboard.loader.store_version``) and derived results (bootstraps) by their input rows, so the
#: TTL only bounds how long an unused entry holds memory, not how fresh a result is.
CACHE_TTL_S = 3600


class StoreMissing(Exception):
    """The store directory or its ``turnscope.duckdb`` does not exist yet."""


class StoreBusy(Exception):
    """``turnscope.duckdb`` is held read-write by a writer (views being created); retry soon."""


class StoreInvalid(Exception):
    """``turnscope.duckdb`` opened but does not hold the views data/schema.sql defines."""


@dataclass(frozen=True)
class StoreLocation:
    """Where a store is, as the dashboard reads it: the directory `root` and `db`, its DuckDB file
    of views (the store itself, its schema and writer, is `store.writer.Store`)."""

    root: Path

    @property
    def db(self) -> Path:
        return self.root / DB_FILE

    def exists(self) -> bool:
        return self.db.is_file()


def store_from_env() -> StoreLocation:
    """The store named by ``$TURNSCOPE_STORE``, else :data:`DEFAULT_STORE`."""
    raw = os.environ.get(ENV_VAR, "").strip()
    return StoreLocation(Path(raw).expanduser().resolve() if raw else DEFAULT_STORE)


def _is_lock_error(exc: Exception) -> bool:
    return "lock" in str(exc).lower()


@contextmanager
def connect(
    store: StoreLocation, *, attempts: int = 5, backoff_s: float = 0.1
) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open `store` read-only for the duration of the ``with`` block, then close it.

    A writer holding the file read-write (creating the views) makes the open fail with a lock
    error; that is retried `attempts` times with a doubling `backoff_s` (seconds) before raising
    `StoreBusy`. Raises `StoreMissing` when there is no ``turnscope.duckdb``.
    """
    if not store.exists():
        raise StoreMissing(f"no store at {store.db}")
    delay = backoff_s
    for attempt in range(attempts):
        try:
            con = duckdb.connect(str(store.db), read_only=True)
            break
        except duckdb.IOException as exc:  # includes "Could not set lock on file"
            if not _is_lock_error(exc):
                raise
            if attempt == attempts - 1:
                raise StoreBusy(f"{store.db} is locked by a writer: {exc}") from exc
            time.sleep(delay)
            delay *= 2
    try:
        yield con
    finally:
        con.close()


@functools.lru_cache(maxsize=8)
def rollups_of(root: Path) -> Rollups:
    """The rollups of the store at `root` (`store.rollup`; its schema is parsed once)."""
    return Rollups(Store(root))


#: Whether `read` reads finished runs from their rollups (`store.rollup`) where fresh; the
#: figures are the same either way (tests/integration/test_rollups.py), only faster.
use_rollups = True


def _invalid_reason(store: StoreLocation, con: duckdb.DuckDBPyConnection, exc: duckdb.Error) -> str:
    """Why a query found no view or column it needs: views written by another turnscope version
    (their ``_turnscope_schema_version`` is not this schema's), or not a turnscope store at all."""
    try:
        (held,) = con.execute("SELECT version FROM _turnscope_schema_version").fetchone()
    except duckdb.Error:
        held = None
    if held is not None and held != Store(store.root).version:
        return (f"{store.db} holds the views of another turnscope version (data/schema.sql changed "
                f"since they were written): run `turnscope rollup --store {store.root}` (it recreates "
                f"them; the shards are not touched), then refresh. ({exc})")
    return f"{store.db}: {exc}"


#: Whether `read` runs its queries on this process's in-memory copy of the store's views
#: (`ViewsDb`) where the store's views are of this turnscope's schema, rather than opening
#: ``turnscope.duckdb`` for each query; the rows are the same (both read the shards).
use_views_db = True


class ViewsDb:
    """The views of a store (data/schema.sql, over its shards) in an in-memory DuckDB of this
    process, for `read`: opening ``turnscope.duckdb`` loads its catalog of some fifty views,
    30-80 ms a query on a 2-core machine and as much as the query itself once the shards are
    compacted (store/compact.py), and a page runs ten or more. The views read the shards at query time
    (their globs), so new rows are seen at once; the copy is made again when ``turnscope.duckdb``
    changes (its views recreated by a writer: `Store.init`). It never holds the store's file, so
    no writer is blocked. Each thread queries through its own cursor, which keeps the rollups'
    TEMP views (`store.rollup.Rollups.install`) while the rollups' state is unchanged.

    Made by `views_db` only where the file's views are of this turnscope's schema version; a store
    whose views are of another version is read from its file, as before, so its queries fail
    with `StoreInvalid`'s message naming the fix."""

    def __init__(self, key: tuple[int, int], con: duckdb.DuckDBPyConnection):
        self.key = key
        self.con = con
        self.local = threading.local()
        self._lock = threading.Lock()  # cursors are made one at a time

    def cursor(self, rollups: Rollups | None) -> duckdb.DuckDBPyConnection:
        """This thread's cursor, with `rollups`'s TEMP views installed as of now (none: the plain
        views)."""
        state = rollups.state() if rollups is not None else None
        key = repr(state)
        loc = self.local
        if getattr(loc, "key", None) != key:
            old = getattr(loc, "cur", None)
            if old is not None:
                old.close()  # its TEMP views go with it
            loc.cur, loc.key = None, None
            with self._lock:
                cur = self.con.cursor()
            if state is not None:
                rollups.install(cur, state)
            loc.cur, loc.key = cur, key
        return loc.cur


_views_dbs: dict[Path, ViewsDb] = {}
_views_lock = threading.Lock()


def views_db(store: StoreLocation) -> ViewsDb | None:
    """This process's `ViewsDb` of `store`, made now if ``turnscope.duckdb`` changed since (size
    and modification time); None where its views are of another turnscope version or missing.
    Raises `StoreMissing`, `StoreBusy` as `connect`."""
    try:
        st = store.db.stat()
    except FileNotFoundError as exc:
        raise StoreMissing(f"no store at {store.db}") from exc
    key = (st.st_mtime_ns, st.st_size)
    with _views_lock:
        held = _views_dbs.get(store.root)
        if held is not None and held.key == key:
            return held
        _views_dbs.pop(store.root, None)
        with connect(store) as con:
            try:
                (version,) = con.execute("SELECT version FROM _turnscope_schema_version").fetchone()
            except duckdb.Error:
                version = None
        schema = rollups_of(store.root).store
        if version != schema.version:
            return None
        mem = duckdb.connect(":memory:")
        mem.execute("SET enable_progress_bar = false")
        schema.create_views(mem)
        _views_dbs[store.root] = made = ViewsDb(key, mem)
        return made


def read(store: StoreLocation, query: Callable[..., pd.DataFrame], *args: Any) -> pd.DataFrame:
    """Call ``query(con, *args)`` on a read-only connection to `store`'s views; return its DataFrame.

    Where `use_views_db` and the store's views are of this schema, the connection is this thread's
    cursor of `ViewsDb`; otherwise a fresh read-only connection to ``turnscope.duckdb``, closed after.
    Where `use_rollups`, the connection reads the finished runs with fresh rollups from them
    (`store.rollup.Rollups.install`: TEMP views shadowing the base and per-run views).

    A missing view or column (the file is not a turnscope store, or its views are of another
    schema version: the message says how to recreate them) raises `StoreInvalid`. One retry covers a shard renamed or removed between DuckDB's glob and its
    read (writers rename temp files into place).
    """
    rollups = rollups_of(store.root) if use_rollups else None
    for attempt in range(2):
        vdb = views_db(store) if use_views_db else None
        if vdb is not None:
            con = vdb.cursor(rollups)
            try:
                return query(con, *args)
            except (duckdb.CatalogException, duckdb.BinderException) as exc:
                raise StoreInvalid(f"{store.db}: {exc}") from exc
            except duckdb.IOException:
                if attempt == 1:
                    raise
            continue
        with connect(store) as con:
            try:
                if rollups is not None:
                    rollups.install(con)
                return query(con, *args)
            except (duckdb.CatalogException, duckdb.BinderException) as exc:
                raise StoreInvalid(_invalid_reason(store, con, exc)) from exc
            except duckdb.IOException:
                if attempt == 1:
                    raise
    raise AssertionError("unreachable")


def bound_memory(con: duckdb.DuckDBPyConnection, limit: str, spill_dir: Path) -> None:
    """Cap DuckDB's working memory on `con` at `limit` (e.g. ``"1GB"``; its default is 80% of RAM),
    spilling to `spill_dir` past it, so a query's memory does not grow with the data."""
    con.execute(f"SET memory_limit = '{limit}'")
    con.execute(f"SET temp_directory = '{spill_dir}'")
