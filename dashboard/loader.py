"""Cached reads for the Streamlit pages: `dashboard.queries` run through `dashboard.db`.

Results are cached with `st.cache_data` for `dashboard.db.CACHE_TTL_S` seconds, keyed by the
store directory, the query's name and its arguments, so reruns are cheap and a run that is still
writing shows new rows on the next refresh after the TTL (or at once after "Refresh").
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import db, queries


@st.cache_data(ttl=db.CACHE_TTL_S, show_spinner=False)
def fetch(store_root: str, query: str, *args: object) -> pd.DataFrame:
    """``dashboard.queries.<query>(con, *args)`` on `store_root`, as a DataFrame (cached).

    `args` must be hashable values (run ids as a tuple of str, ints). Raises the exceptions of
    `dashboard.db` (StoreMissing, StoreBusy, StoreInvalid); those are not cached.
    """
    fn = getattr(queries, query)
    return db.read(db.Store(Path(store_root)), fn, *args)


def load(store_root: str, query: str, *args: object) -> pd.DataFrame:
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
    fetch.clear()
