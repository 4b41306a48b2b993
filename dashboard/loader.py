"""Cached reads for the Streamlit pages: a query function of ``store.queries`` run through
``store.db``.

Pages call ``load(sel.root, queries.ttft_stats, f, ...)``: the query function itself, so a search
for a query's callers finds its pages. Results are cached with `st.cache_data`, keyed by the store
directory, the store's version (`store_version`: it changes whenever a shard, a rollup or the views
file is written), the query's qualified name and its arguments. So a page a person comes back to
is served from the cache for as long as the store is unchanged (for at most
`store.db.CACHE_TTL_S` seconds), and a run that is still writing shows its new rows on the
next rerun after they land (or at once after "Refresh").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import streamlit as st

from store import db

Query = Callable[..., pd.DataFrame]


#: Directory levels under the store's root whose modification times make its version: the root,
#: ``runs/`` and ``rollups/``, each run's directory, and each table's shard directory.
VERSION_DEPTH = 3


def store_version(store_root: str, skip: tuple[str, ...] = ()) -> int:
    """A fingerprint of the store at `store_root` that changes when it is written: a hash of the
    names and modification times (ns) of ``turnscope.duckdb`` and of every directory down to
    `VERSION_DEPTH` levels. Shards and rollups are written under a temporary name and renamed into
    their directory (store.writer, store.rollup), and a rename or a new directory changes
    its parent's modification time. A few hundred ``stat`` calls for a store of a hundred runs.
    A missing store gives the fingerprint of nothing (the query then raises StoreMissing).
    Directories named in `skip` (e.g. ``runs_log``: a recording run's heartbeats) are left out."""
    seen: list[tuple[str, int]] = []
    level = [Path(store_root)]
    for _ in range(VERSION_DEPTH):
        below: list[Path] = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    if e.name in skip:
                        continue
                    seen.append((e.path, e.stat(follow_symlinks=False).st_mtime_ns))
                    below.append(Path(e.path))
                elif e.name == db.DB_FILE:
                    seen.append((e.path, e.stat().st_mtime_ns))
        level = below
        if not level:
            break
    return hash(tuple(sorted(seen)))


@st.cache_data(ttl=db.CACHE_TTL_S, max_entries=512, show_spinner=False)
def _fetch(store_root: str, version: int, name: str, _query: Query, *args: object) -> pd.DataFrame:
    """`_query(con, *args)` on `store_root` at `version` (`store_version`); `name` (the query's
    qualified name) is the cache key in its place (a leading underscore keeps Streamlit from hashing
    the function)."""
    return db.read(db.StoreLocation(Path(store_root)), _query, *args)


def fetch(store_root: str, query: Query, *args: object) -> pd.DataFrame:
    """``query(con, *args)`` on `store_root`, as a DataFrame (cached). `query` is a function of
    ``store.queries`` (or another module's query function, e.g. ``store.queries.traffic``).

    `args` must be hashable values (run ids as a tuple of str, ints). Raises the exceptions of
    `store.db` (StoreMissing, StoreBusy, StoreInvalid); those are not cached.
    """
    return _fetch(
        store_root, store_version(store_root), f"{query.__module__}.{query.__qualname__}", query, *args
    )


def load(store_root: str, query: Query, *args: object) -> pd.DataFrame:
    """`fetch` for a page: a store that goes away or is locked mid-render is said on the page,
    which then stops, instead of a traceback."""
    try:
        return fetch(store_root, query, *args)
    except db.StoreBusy:
        st.warning(f"The store at `{store_root}` is being set up by a writer; refresh in a moment.")
    except (db.StoreMissing, db.StoreInvalid) as exc:
        st.error(f"The store at `{store_root}` cannot be read: {exc}")
    st.stop()
    raise AssertionError("unreachable")  # st.stop() raises


def clear() -> None:
    """Forget every cached result (the sidebar's Refresh button)."""
    _fetch.clear()
