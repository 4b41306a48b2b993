"""Compaction: a finished run's shards merged into one Parquet file per table (docs/schema/overview.md).

A run's writers append many small shards (``runs/<run_id>/<table>/<writer>-<token>-<seq>.parquet``:
one per table per flush, every second while the run goes on): a `make demo` store holds over 800
files of a few hundred rows each, and every view query opens all of them (the base views glob
``runs/*/<table>/*.parquet``), so the dashboard's queries spent most of their time opening files,
not reading rows. A finished run's rows never change, so `compact_finished` rewrites each table of
each finished run that has more than one shard as a single file,
``runs/<run_id>/<table>/compacted-<token>-000000.parquet``, holding exactly the rows of the shards
it replaces (the row count is checked before anything is replaced; the source file names are kept
in the file's Parquet metadata under :data:`SOURCES_KEY`). The views read it as any other shard:
the contract (data/schema.sql) does not change, only how many files hold the rows.

Readers are never shown a half-done state. The new file is written into a staging directory
``runs/<run_id>/.<table>.compact-<token>/`` (a dot name no view's glob matches), which is then
exchanged with the table's directory in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a
glob sees either every old shard or the one new file. Where the exchange is not available (another
OS or file system), two renames are used instead, and a reader globbing in between them (a few
microseconds) finds that run's table empty once; the dashboard's next rerun reads it again
(its cache is keyed by the store's directories, which the renames change).

A writer that still writes to a finished run (a late shard) loses nothing: a shard it renames into
the table's directory before the exchange ends up in the staging directory and is moved back into
the table's directory before the staging directory is removed; one renamed after the exchange
lands in the new directory; one whose temporary file was written before the exchange and renamed
after fails its rename and stays buffered for its next flush (store.writer.ShardWriter.flush).
A compaction cut short (a crash) leaves only a staging directory, which the next compaction
resolves (:func:`_recover`). A run still ``running`` (view ``runs``) is never touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from store.writer import Store, connect_read_only, write_atomic

log = logging.getLogger(__name__)

#: File name prefix of a compacted shard (``<prefix>-<token>-000000.parquet``: a shard's name form).
COMPACTED_PREFIX = "compacted"
#: Parquet key-value metadata of a compacted file: a JSON list of the shard names it replaced.
SOURCES_KEY = b"turnscope.compacted_from"
_STAGING_MARK = ".compact-"
#: Rows per row group of a compacted file (DuckDB's own row group size).
ROW_GROUP_ROWS = 122_880

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@dataclass(frozen=True)
class Compacted:
    """One table of one run compacted: `files` shards became one file of `rows` rows."""

    run_id: str
    table: str
    files: int
    rows: int


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories `a` and `b` atomically (``renameat2(RENAME_EXCHANGE)``); False where the
    C library or the file system does not offer it."""
    libc_name = ctypes.util.find_library("c")
    try:
        renameat2 = ctypes.CDLL(libc_name, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def _swap(staging: Path, table_dir: Path) -> None:
    """Put `staging`'s contents at `table_dir` and the old contents at `staging`."""
    if _exchange(staging, table_dir):
        return
    held = staging.with_name(staging.name + ".old")
    os.rename(table_dir, held)
    os.rename(staging, table_dir)
    os.rename(held, staging)


def _shards(d: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(d) if n.endswith(".parquet"))
    except FileNotFoundError:
        return []


def _sources(compacted: Path) -> set[str]:
    """The shard names the compacted file `compacted` replaced (its Parquet metadata)."""
    meta = pq.read_schema(compacted).metadata or {}
    return set(json.loads(meta.get(SOURCES_KEY, b"[]")))


def _restore_late(staging: Path, table_dir: Path, sources: set[str]) -> int:
    """Move every shard in `staging` that is not among `sources` back to `table_dir`; the count."""
    moved = 0
    for name in _shards(staging):
        if name not in sources:
            os.replace(staging / name, table_dir / name)
            moved += 1
    return moved


def _recover(run_dir: Path) -> None:
    """Resolve the staging directories an interrupted compaction left in `run_dir`. Before its
    swap, a staging directory holds the new file only: removed. After it, the table's directory
    holds the new file (named by the staging directory's token) and the staging directory the
    old shards: those the new file does not list are moved back, then it is removed. Cut between
    the fallback's renames, the table's directory is missing and ``<staging>.old`` holds its
    shards: renamed back first."""
    staged = sorted((e.name for e in os.scandir(run_dir) if e.is_dir() and e.name.startswith(".")
                     and _STAGING_MARK in e.name), key=lambda n: not n.endswith(".old"))
    for name in staged:
        d = run_dir / name
        table, rest = name[1:].split(_STAGING_MARK, 1)
        table_dir = run_dir / table
        if not table_dir.exists():
            if name.endswith(".old"):
                os.rename(d, table_dir)
            continue
        new = table_dir / f"{COMPACTED_PREFIX}-{rest.removesuffix('.old')}-000000.parquet"
        if new.exists():
            _restore_late(d, table_dir, _sources(new))
        shutil.rmtree(d)


def _stream(table_dir: Path, names: list[str], schema: pa.Schema, target: Path) -> int:
    """Write the shards `names` of `table_dir`, all of `schema`, to `target` one after another in
    row groups of about :data:`ROW_GROUP_ROWS` (a temporary name renamed into place); the rows written."""
    tmp = target.with_name(target.name + ".tmp")
    rows, pending, held = 0, [], 0
    with pq.ParquetWriter(tmp, schema) as out:
        for name in names:
            part = pq.read_table(table_dir / name).replace_schema_metadata(schema.metadata)
            pending.append(part)
            held += part.num_rows
            if held >= ROW_GROUP_ROWS:
                out.write_table(pa.concat_tables(pending))
                rows, pending, held = rows + held, [], 0
        if pending:
            out.write_table(pa.concat_tables(pending))
            rows += held
    os.replace(tmp, target)
    return rows


def compact_table(store: Store, run_id: str, table: str) -> Compacted | None:
    """Merge the shards of `table` of `run_id` into one file (see the module docstring); None when
    it has fewer than two. The caller makes sure the run is finished.

    Raises:
        OSError: a file could not be read, written or renamed (the table is left as it was).
        ValueError: the merged rows are not as many as the shards hold (nothing replaced).
    """
    table_dir = store.root / "runs" / run_id / table
    names = _shards(table_dir)
    if len(names) < 2:
        return None
    schemas = [pq.read_schema(table_dir / n).remove_metadata() for n in names]
    expected = sum(pq.ParquetFile(table_dir / n).metadata.num_rows for n in names)
    token = uuid.uuid4().hex[:8]
    staging = table_dir.parent / f".{table}{_STAGING_MARK}{token}"
    staging.mkdir()
    target = staging / f"{COMPACTED_PREFIX}-{token}-000000.parquet"
    sources = {SOURCES_KEY: json.dumps(names).encode()}
    try:
        if all(s.equals(schemas[0]) for s in schemas):  # one writer schema: streamed, memory bounded
            rows = _stream(table_dir, names, schemas[0].with_metadata(sources), target)
        else:  # shards of older schemas: columns unified as the views' union_by_name reads them
            merged = pa.concat_tables([pq.read_table(table_dir / n) for n in names], promote_options="permissive")
            rows = merged.num_rows
            write_atomic(merged.replace_schema_metadata(sources), target)
        if rows != expected:
            raise ValueError(f"{table_dir}: merged {rows} rows, the shards hold {expected}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap(staging, table_dir)
    late = _restore_late(staging, table_dir, set(names))
    shutil.rmtree(staging)
    if late:
        log.info("compaction of %s kept %d shard(s) written meanwhile beside the compacted file", table_dir, late)
    return Compacted(run_id, table, len(names), rows)


def finished_runs(store: Store) -> list[str]:
    """The runs whose status (view ``runs``) is no longer ``running``."""
    con = connect_read_only(store.root)
    try:
        return [r for (r,) in con.execute("SELECT run_id FROM runs WHERE status <> 'running' ORDER BY run_id").fetchall()]
    finally:
        con.close()


def compact_run(store: Store, run_id: str) -> list[Compacted]:
    """Compact every table of the finished run `run_id` (raises as :func:`compact_table`)."""
    run_dir = store.root / "runs" / run_id
    if not run_dir.is_dir():
        return []
    _recover(run_dir)
    done = []
    for e in sorted(os.scandir(run_dir), key=lambda e: e.name):
        if e.is_dir() and not e.name.startswith((".", "_")):
            c = compact_table(store, run_id, e.name)
            if c is not None:
                done.append(c)
    return done


def compact_finished(store: Store) -> list[Compacted]:
    """Compact every finished run of `store` (runs with one file per table are left as they are);
    a fresh rollup of a compacted run stays fresh (`store.rollup.Rollups.relist`: the rows are the
    same). Returns what was compacted.

    Raises:
        duckdb.IOException: the store's DuckDB file is missing or held by a writer.
        OSError, ValueError: as :func:`compact_table`.
    """
    from store.rollup import Rollups  # the rollups read the compacted shards; one import cycle less

    rollups = Rollups(store)
    fresh = set(rollups.freshness().fresh)
    out: list[Compacted] = []
    for run_id in finished_runs(store):
        done = compact_run(store, run_id)
        if done and run_id in fresh:
            rollups.relist(run_id)
        out += done
    return out
