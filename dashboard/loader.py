"""Cached reads for the Streamlit pages: a query function of ``dashboard.queries`` run through
``dashboard.db``.

Pages call ``load(sel.root, queries.ttft_stats, f, ...)``: the query function itself, so a search
for a query's callers finds its pages. Results are cached with `st.cache_data` for
`dashboard.db.CACHE_TTL_S` seconds, keyed by the store directory, the query's qualified name and
its arguments, so reruns are cheap and a run that is still writing shows new rows on the next
refresh after the TTL (or at once after "Refresh").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import db

Query = Callable[..., pd.DataFrame]


@st.cache_data(ttl=db.CACHE_TTL_S, show_spinner=False)
def _fetch(store_root: str, name: str, _query: Query, *args: object) -> pd.DataFrame:
    """`_query(con, *args)` on `store_root`; `name` (the query's qualified name) is the cache key
    in its place (a leading underscore keeps Streamlit from hashing the function)."""
    return db.read(db.StoreLocation(Path(store_root)), _query, *args)


def fetch(store_root: str, query: Query, *args: object) -> pd.DataFrame:
    """``query(con, *args)`` on `store_root`, as a DataFrame (cached). `query` is a function of
    ``dashboard.queries`` (or another module's query function, e.g. ``dashboard.queries.traffic``).

    `args` must be hashable values (run ids as a tuple of str, ints). Raises the exceptions of
    `dashboard.db` (StoreMissing, StoreBusy, StoreInvalid); those are not cached.
    """
    return _fetch(store_root, f"{query.__module__}.{query.__qualname__}", query, *args)


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
