"""The run store: its schema, its writer and its read-only connection, in the one place that the
writers (loadgen, the scraper, the CLI) and the readers (the dashboard, the eval report) share
(docs/schema/overview.md; docs/design.md). Imports nothing of serving/, loadgen/
or dashboard/.

Layout under a store root::

    <root>/runs/<run_id>/<table>/<writer_id>-<token>-<seq>.parquet   shards (append-only)
    <root>/runs/<run_id>/<table>/compacted-<token>-000000.parquet     a finished run's shards merged (store.compact)
    <root>/runs/_schema/<table>/empty.parquet                         one empty typed shard per table
    <root>/turnscope.duckdb                                           views only (no table data)

Writers never open the DuckDB file: they write a shard to ``<name>.parquet.tmp`` and
``os.replace`` it to ``<name>.parquet`` (atomic on POSIX), so readers glob only complete files and
no writer ever holds a lock a reader needs, nor the reverse.

The column names and types come from ``data/schema.sql`` (the contract): the "tables" section is
executed in an in-memory DuckDB to learn each column's type, and each DuckDB type is mapped to one
Arrow type (``TIMESTAMPTZ`` -> ``timestamp[us, tz=UTC]``, ``JSON`` -> string holding JSON text).

Secrets never reach the store (docs/design.md): every value of ``runs_log`` (configurations, topologies,
workload specs) and the free-text columns ``turns.error`` and ``metric_samples.endpoint`` pass
through :func:`redact` when appended (credentials in URLs, bearer tokens, string values under
secret-looking keys such as ``api_key`` or ``HF_TOKEN``, values after ``--api-key``-like flags).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from core import resources
from core.redaction import redact

log = logging.getLogger(__name__)

#: The DuckDB file of views under a store root.
DB_FILE = "turnscope.duckdb"
#: The contract (``schema.sql`` of the shipped files, core.resources).
SCHEMA_PATH = resources.schema_path()

#: Bumped when the way views are generated changes (part of the schema version hash).
_VIEW_GENERATOR_VERSION = "1"
_VERSION_VIEW = "_turnscope_schema_version"
_SCHEMA_DIR = "_schema"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# DuckDB type (as information_schema.columns.data_type spells it) -> Arrow type.
_ARROW_TYPES: dict[str, pa.DataType] = {
    "VARCHAR": pa.string(),
    "JSON": pa.string(),
    "BOOLEAN": pa.bool_(),
    "INTEGER": pa.int32(),
    "BIGINT": pa.int64(),
    "DOUBLE": pa.float64(),
    "TIMESTAMP WITH TIME ZONE": pa.timestamp("us", tz="UTC"),
}
_INT_RANGES = {"INTEGER": (-(2**31), 2**31 - 1), "BIGINT": (-(2**63), 2**63 - 1)}


@dataclass(frozen=True)
class Column:
    """One column of a store table: its name, DuckDB type, Arrow type and nullability."""

    name: str
    sql_type: str
    arrow_type: pa.DataType
    nullable: bool


@dataclass(frozen=True)
class TableSchema:
    """A table of the "tables" section of schema.sql, in declaration order."""

    name: str
    columns: tuple[Column, ...]

    def arrow_schema(self) -> pa.Schema:
        """The Arrow schema every shard of this table is written with."""
        return pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns])

    def column(self, name: str) -> Column | None:
        """The column called ``name``, or None."""
        for c in self.columns:
            if c.name == name:
                return c
        return None


@dataclass(frozen=True)
class Schema:
    """schema.sql split into its sections: the shard tables and the derived-view SQL."""

    tables: dict[str, TableSchema]
    views_sql: str
    text: str
    path: Path


def _split_sections(text: str, path: Path) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = re.match(r"^--\s*section:\s*(\w+)\s*$", line.strip())
        if m:
            current = m.group(1)
            if current in sections:
                raise ValueError(f"{path}: section {current!r} appears twice")
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    for required in ("tables", "views"):
        if required not in sections:
            raise ValueError(f"{path}: missing '-- section: {required}' line")
    return {k: "\n".join(v) for k, v in sections.items()}


def load_schema(path: Path = SCHEMA_PATH) -> Schema:
    """Parse schema.sql into table definitions and the view SQL.

    The "tables" section is executed in a throw-away in-memory DuckDB, so DuckDB itself parses
    the SQL; each column's type is then mapped to an Arrow type.

    Raises:
        ValueError: a section is missing, the SQL does not parse (message names the file), or a
            column has a type with no Arrow mapping (message names file, table and column).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    sections = _split_sections(text, path)
    con = duckdb.connect(":memory:")
    try:
        try:
            con.execute(sections["tables"])
        except duckdb.Error as e:
            raise ValueError(f"{path}: section 'tables' does not execute: {e}") from e
        rows = con.execute(
            "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_schema = 'main' ORDER BY table_name, ordinal_position"
        ).fetchall()
        order = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_oid").fetchall()]
    finally:
        con.close()
    cols: dict[str, list[Column]] = {t: [] for t in order}
    for table, column, sql_type, is_nullable in rows:
        arrow_type = _ARROW_TYPES.get(sql_type)
        if arrow_type is None:
            raise ValueError(
                f"{path}: table {table}, column {column}: type {sql_type} has no Arrow mapping "
                f"(supported: {', '.join(sorted(_ARROW_TYPES))})"
            )
        cols[table].append(Column(column, sql_type, arrow_type, is_nullable == "YES"))
    tables = {t: TableSchema(t, tuple(c)) for t, c in cols.items()}
    return Schema(tables=tables, views_sql=sections["views"], text=text, path=path)


class StoreNotWritable(OSError):
    """The store root is not a directory this process can write; the message names it."""


# -- secrets (core.redaction) -------------------------------------------------------------

#: Columns whose values pass through :func:`redact` when appended (None: every column).
_REDACTED_COLUMNS: dict[str, tuple[str, ...] | None] = {"runs_log": None, "turns": ("error",),
                                                        "metric_samples": ("endpoint",),
                                                        "metric_sources": ("endpoint",), "engine_info": ("endpoint",)}


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _SAFE_NAME.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a safe path component "
            "(letters, digits, '.', '_', '-', not starting with a punctuation mark, at most 128 chars)"
        )


def sql_str(s: str) -> str:
    """``s`` as a SQL string literal (single quotes doubled)."""
    return "'" + s.replace("'", "''") + "'"


def sql_ident(s: str) -> str:
    """``s`` as a quoted SQL identifier (double quotes doubled)."""
    return '"' + s.replace('"', '""') + '"'


class Store:
    """A store root: Parquet shards under ``runs/`` and ``turnscope.duckdb`` holding only views.

    Args:
        root: the store directory (created by :meth:`init` if missing), e.g. ``data/``.
        schema_path: the contract; defaults to the shipped ``schema.sql`` (:data:`SCHEMA_PATH`).
    """

    def __init__(self, root: Path, schema_path: Path = SCHEMA_PATH):
        self.root = Path(root).resolve()
        self.schema = load_schema(schema_path)
        self.db_path = self.root / DB_FILE

    @property
    def version(self) -> str:
        """sha256 of schema.sql, the absolute store root and the view generator version.

        The root is part of it because the base views embed the absolute shard glob.
        """
        h = hashlib.sha256()
        for part in (self.schema.text, str(self.root), _VIEW_GENERATOR_VERSION):
            h.update(part.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()

    def table_glob(self, table: str) -> str:
        """The absolute glob matching every complete shard of ``table`` (all runs)."""
        return str(self.root / "runs" / "*" / table / "*.parquet")

    def schema_shard(self, table: str) -> Path:
        """The empty typed shard of ``table`` (``runs/_schema/<table>/empty.parquet``)."""
        return self.root / "runs" / _SCHEMA_DIR / table / "empty.parquet"

    def base_select(self, table: str, paths: list[str]) -> str:
        """SQL of ``table``'s base view over the Parquet files or globs `paths` (absolute): every
        column cast to its schema type, in schema order (``read_parquet(..., union_by_name = true)``).
        The base views use ``[table_glob(table)]``; `store.rollup` the shards of some runs only."""
        t = self.schema.tables[table]
        cols = ", ".join(f"CAST({sql_ident(c.name)} AS {c.sql_type}) AS {sql_ident(c.name)}" for c in t.columns)
        files = sql_str(paths[0]) if len(paths) == 1 else "[" + ", ".join(sql_str(p) for p in paths) + "]"
        return f"SELECT {cols} FROM read_parquet({files}, union_by_name = true)"

    def init(self) -> None:
        """Create the empty typed shards and the views; idempotent.

        Writes ``runs/_schema/<table>/empty.parquet`` (0 rows, the schema's Arrow types) for each
        table, so every view binds before the first run. Then, unless ``turnscope.duckdb`` already
        carries this schema version (a view ``_turnscope_schema_version``), drops all its views and
        creates: one base view per table (``read_parquet(<glob>, union_by_name=true)`` with every
        column cast to its schema type, so the view types are the contract's whatever the shards
        hold), then the derived views of the "views" section.

        Raises:
            RuntimeError: the DuckDB file is locked by another process (e.g. an open dashboard) and
                does not already hold views of this version; the message says what to do.
            ValueError: the views section does not execute (message names schema.sql).
        """
        self.check_writable()
        for t in self.schema.tables.values():
            target = self.schema_shard(t.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists() or pq.read_schema(target) != t.arrow_schema():
                write_atomic(pa.Table.from_pylist([], schema=t.arrow_schema()), target)
        if self._current_version() == self.version:
            return
        try:
            # Written in an older storage format so the `duckdb` CLI (PyPI duckdb-cli, 1.5) opens it too.
            con = duckdb.connect(str(self.db_path), config={"storage_compatibility_version": "v1.4.0"})
        except (duckdb.IOException, duckdb.ConnectionException) as e:
            raise RuntimeError(
                f"{self.db_path} is locked or open elsewhere ({e}) and does not hold the views of "
                f"this schema version; close its readers (dashboard, duckdb shell) and run init again"
            ) from e
        try:
            self.create_views(con)
        finally:
            con.close()

    def check_writable(self) -> None:
        """Create the root if missing and check that files can be written in it.

        Raises:
            StoreNotWritable: the root (or a parent) is not a directory, or not writable; the
                message names the directory and what was expected.
        """
        probe = self.root / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreNotWritable(
                f"store directory {self.root}: expected a directory this process can write "
                f"(Parquet shards and turnscope.duckdb go there): {e.strerror or e}") from e

    def _current_version(self) -> str | None:
        if not self.db_path.exists():
            return None
        try:
            con = duckdb.connect(str(self.db_path), read_only=True)
        except (duckdb.IOException, duckdb.ConnectionException):
            # Held read-write by someone else, or already open in this process with another
            # configuration: fall through to the read-write attempt, which reports clearly.
            return None
        try:
            return con.execute(f"SELECT version FROM {_VERSION_VIEW}").fetchone()[0]
        except duckdb.Error:
            return None
        finally:
            con.close()

    def create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        """Drop every view of `con`'s database and create this schema's (the base views over the
        shards, the derived views, the version view), in one transaction: `init` on the store's
        file, `store.db.ViewsDb` on an in-memory database. Raises ValueError as `init`."""
        con.execute("BEGIN TRANSACTION")
        try:
            existing = con.execute(
                "SELECT view_name FROM duckdb_views() WHERE NOT internal AND schema_name = 'main'"
            ).fetchall()
            for (name,) in existing:
                con.execute(f"DROP VIEW IF EXISTS {sql_ident(name)} CASCADE")
            for t in self.schema.tables.values():
                con.execute(f"CREATE VIEW {sql_ident(t.name)} AS {self.base_select(t.name, [self.table_glob(t.name)])}")
            try:
                con.execute(self.schema.views_sql)
            except duckdb.Error as e:
                raise ValueError(f"{self.schema.path}: section 'views' does not execute: {e}") from e
            con.execute(f"CREATE VIEW {_VERSION_VIEW} AS SELECT {sql_str(self.version)} AS version")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def connect(self, read_only: bool = True) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection to the views (read-only by default; readers never block writers)."""
        if read_only:
            return connect_read_only(self.root)
        return duckdb.connect(str(self.db_path), read_only=False)

    def writer(self, run_id: str, writer_id: str, flush_interval_s: float = 1.0) -> ShardWriter:
        """A new :class:`ShardWriter` for ``run_id``, with its background flusher started.

        Raises:
            ValueError: run_id or writer_id is not a safe path component, or run_id is reserved.
        """
        return ShardWriter(self, run_id, writer_id, flush_interval_s)


def connect_read_only(root: str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """A read-only DuckDB connection to the views of the store at ``root`` (no writer is blocked
    for longer than it stays open: close it soon). Raises ``duckdb.IOException`` when the file is
    missing or held read-write by a writer creating the views."""
    return duckdb.connect(str(Path(root) / DB_FILE), read_only=True)


def write_atomic(table: pa.Table, target: Path) -> None:
    """Write ``table`` as Parquet to ``target`` through a ``.tmp`` file renamed into place (atomic on POSIX)."""
    tmp = target.with_name(target.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, target)


class ShardWriter:
    """Buffers rows per table and writes them as Parquet shards of one run.

    Each flush writes, per table with buffered rows, one file
    ``runs/<run_id>/<table>/<writer_id>-<token>-<seq>.parquet`` (``token``: random per writer, so
    two writers given the same writer_id, or a restarted process, never overwrite each other).
    A background thread flushes every ``flush_interval_s`` seconds, so a crash loses at most about
    that much. Thread-safe; works with gevent-patched threading too.

    Args:
        store: the store (its schema gives the tables and types).
        run_id, writer_id: path components, ``[A-Za-z0-9][A-Za-z0-9._-]*``.
        flush_interval_s: seconds between background flushes (> 0).
    """

    def __init__(self, store: Store, run_id: str, writer_id: str, flush_interval_s: float = 1.0):
        _check_name("run_id", run_id)
        _check_name("writer_id", writer_id)
        if not (isinstance(flush_interval_s, (int, float)) and flush_interval_s > 0):
            raise ValueError(f"flush_interval_s must be > 0 seconds, got {flush_interval_s!r}")
        self._store = store
        self._tables = store.schema.tables
        self.run_id = run_id
        self.writer_id = writer_id
        self._token = uuid.uuid4().hex[:8]
        self._seq = 0
        self._buffers: dict[str, list[dict[str, Any]]] = {t: [] for t in self._tables}
        self._buf_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._interval = float(flush_interval_s)
        self._ka_lock = threading.Lock()
        self._keepalive: list[Any] | None = None  # [table, row, interval_s, next beat (monotonic)]
        self._warm_up()
        self._thread = threading.Thread(target=self._loop, name=f"shard-writer-{writer_id}", daemon=True)
        self._thread.start()

    def _warm_up(self) -> None:
        """Convert and write each table once, empty and into memory, before any row arrives. The
        first ``pa.Table.from_pylist`` imports pandas (pyarrow's pandas shim) and the first Parquet
        write more of pyarrow: about 0.2-0.3 s at once. Under gevent (a Locust process) the
        background flusher is a greenlet, so paid in the first flush that import blocked every
        other greenlet: a turn whose first token arrived meanwhile was read, with every token after
        it, only once the flush was done (docs/known-behaviour.md)."""
        for table in self._tables.values():
            pq.write_table(pa.Table.from_pylist([], schema=table.arrow_schema()), pa.BufferOutputStream())

    # -- rows -------------------------------------------------------------------------------------

    def append(self, table: str, row: dict[str, Any]) -> None:
        """Buffer one row of ``table``; ``run_id`` is filled in when absent.

        Values are checked and converted now, so a bad row fails here, not in the flusher:
        VARCHAR <- str; INTEGER/BIGINT <- int (not bool); DOUBLE <- int or float; BOOLEAN <- bool;
        TIMESTAMPTZ <- tz-aware ``datetime`` (stored as UTC, microseconds); JSON <- dict, list,
        number, bool (``json.dumps``'ed with sorted keys) or a str that already holds JSON.
        Missing columns are NULL.

        Raises:
            ValueError: unknown table or column, NULL in a NOT NULL column, a naive datetime, a
                value of the wrong type, or a row for another run; the message names the table
                and column.
            RuntimeError: the writer is closed.
        """
        if self._closed:
            raise RuntimeError(f"ShardWriter {self.writer_id} of run {self.run_id} is closed")
        out = self._check_row(table, row)
        with self._buf_lock:
            self._buffers[table].append(out)

    def _check_row(self, table: str, row: dict[str, Any]) -> dict[str, Any]:
        """The row converted to its stored values (see :meth:`append`); raises as it does."""
        schema = self._tables.get(table)
        if schema is None:
            raise ValueError(f"unknown table {table!r}; the schema has {', '.join(self._tables)}")
        if not isinstance(row, dict):
            raise TypeError(f"{table}: a row must be a dict, got {type(row).__name__}")
        unknown = [k for k in row if schema.column(k) is None]
        if unknown:
            raise ValueError(f"{table}: unknown column(s) {', '.join(map(repr, unknown))}")
        if "run_id" in row and row["run_id"] != self.run_id and schema.column("run_id") is not None:
            raise ValueError(f"{table}.run_id: row says {row['run_id']!r} but this writer is for {self.run_id!r}")
        out: dict[str, Any] = {}
        redacted = _REDACTED_COLUMNS.get(table, ())
        for c in schema.columns:
            v = row.get(c.name)
            if v is None and c.name == "run_id":
                v = self.run_id
            if v is not None and (redacted is None or c.name in redacted):
                v = _redact_column(c, v)
            out[c.name] = _convert(table, c, v)
        return out

    # -- flushing ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write every table's buffered rows as one shard per table (atomic rename).

        Raises:
            OSError: the shard could not be written; the rows stay buffered for the next flush.
        """
        with self._flush_lock:
            with self._buf_lock:
                pending = {t: rows for t, rows in self._buffers.items() if rows}
                for t in pending:
                    self._buffers[t] = []
                seq = self._seq
                self._seq += 1
            failed: dict[str, list[dict[str, Any]]] = {}
            error: BaseException | None = None
            for t, rows in pending.items():
                if error is not None:
                    failed[t] = rows
                    continue
                d = self._store.root / "runs" / self.run_id / t
                target = d / f"{self.writer_id}-{self._token}-{seq:06d}.parquet"
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    write_atomic(pa.Table.from_pylist(rows, schema=self._tables[t].arrow_schema()), target)
                except Exception as e:  # noqa: BLE001 - keep the rows, re-raised below
                    failed[t] = rows
                    error = e
            if failed:
                with self._buf_lock:
                    for t, rows in failed.items():
                        self._buffers[t] = rows + self._buffers[t]
            if error is not None:
                raise error

    def keep_alive(self, table: str, row: dict[str, Any], interval_s: float) -> None:
        """Append ``row`` with ``updated_at`` = now to ``table`` every ``interval_s`` seconds (and
        flush it), from the background flusher, until :meth:`stop_keep_alive` or :meth:`close`:
        the heartbeat of a running run's ``runs_log`` row (the ``runs`` view reads a ``running``
        run whose row is older than three heartbeats as ``aborted``). The first beat comes
        ``interval_s`` after this call. Raises ValueError for a row ``append`` refuses or a
        non-positive interval."""
        if not (isinstance(interval_s, (int, float)) and interval_s > 0):
            raise ValueError(f"keep_alive interval must be > 0 seconds, got {interval_s!r}")
        probe = dict(row, updated_at=dt.datetime.now(dt.UTC))
        self._check_row(table, probe)
        with self._ka_lock:
            self._keepalive = [table, dict(row), float(interval_s), time.monotonic() + interval_s]

    def stop_keep_alive(self) -> None:
        """Stop the heartbeat. When this returns no beat is being or will be appended, so a row
        appended afterwards (the run's final status) is the newest."""
        with self._ka_lock:
            self._keepalive = None

    def _beat(self) -> None:
        with self._ka_lock:
            ka = self._keepalive
            if ka is None or time.monotonic() < ka[3]:
                return
            table, row, interval, _ = ka
            ka[3] = time.monotonic() + interval
            self.append(table, dict(row, updated_at=dt.datetime.now(dt.UTC)))

    def _next_wait(self) -> float:
        ka = self._keepalive
        if ka is None:
            return self._interval
        return max(0.0, min(self._interval, ka[3] - time.monotonic()))

    def _loop(self) -> None:
        while not self._stop.wait(self._next_wait()):
            try:
                self._beat()
                self.flush()
            except Exception:
                log.exception("background flush of run %s writer %s failed; retrying", self.run_id, self.writer_id)

    def close(self) -> None:
        """Stop the background flusher and write what is buffered; idempotent.

        Raises:
            OSError: the final flush failed.
        """
        if self._closed:
            return
        self.stop_keep_alive()
        self._closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _redact_column(c: Column, v: Any) -> Any:
    """``v`` without secrets (:func:`redact`); JSON text is parsed, redacted and written back."""
    if c.sql_type == "JSON" and isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            return v  # _convert reports it
        clean = redact(parsed)
        return v if clean == parsed else json.dumps(clean, sort_keys=True)
    if isinstance(v, (str, dict, list, tuple)):
        return redact(v)
    return v


def _convert(table: str, c: Column, v: Any) -> Any:
    where = f"{table}.{c.name}"
    if v is None:
        if not c.nullable:
            raise ValueError(f"{where} is NOT NULL in the schema but the row has no value")
        return None
    t = c.sql_type
    if t == "TIMESTAMP WITH TIME ZONE":
        if not isinstance(v, dt.datetime):
            raise ValueError(f"{where}: expected a tz-aware datetime, got {type(v).__name__} {v!r}")
        if v.tzinfo is None or v.utcoffset() is None:
            raise ValueError(f"{where}: naive datetime {v.isoformat()}; pass a tz-aware datetime")
        return v.astimezone(dt.UTC)
    if t == "JSON":
        if isinstance(v, str):
            try:
                json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: str given for a JSON column is not valid JSON: {e}") from e
            return v
        try:
            return json.dumps(v, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: value is not JSON-serialisable: {e}") from e
    if t == "VARCHAR":
        if not isinstance(v, str):
            raise ValueError(f"{where}: expected str, got {type(v).__name__} {v!r}")
        return v
    if t in _INT_RANGES:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{where}: expected int, got {type(v).__name__} {v!r}")
        lo, hi = _INT_RANGES[t]
        if not lo <= v <= hi:
            raise ValueError(f"{where}: {v} is out of range for {t}")
        return v
    if t == "DOUBLE":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{where}: expected float, got {type(v).__name__} {v!r}")
        return float(v) if not (isinstance(v, float) and math.isnan(v)) else v
    if t == "BOOLEAN":
        if not isinstance(v, bool):
            raise ValueError(f"{where}: expected bool, got {type(v).__name__} {v!r}")
        return v
    raise ValueError(f"{where}: unsupported type {t}")  # unreachable: load_schema checked
