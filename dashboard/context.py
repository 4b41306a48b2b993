"""The selection the sidebar makes in ``dashboard/app.py``, handed to the pages.

Stored in `st.session_state`, so it is per browser session, never shared between users.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import streamlit as st

from store.db import StoreLocation
from store.queries import TurnFilter

_KEY = "_turnscope_selection"


@dataclass(frozen=True)
class Selection:
    """What the pages show.

    `runs`: every run of the store (``store.queries.runs``); `run_ids`: the runs the
    sidebar's filters keep (a tuple, possibly empty); `modes`: the modes the filter keeps;
    `archetypes`, `kinds`, `gap_kinds`: the turn filters (empty tuple: all).
    """

    store: StoreLocation
    runs: pd.DataFrame
    run_ids: tuple[str, ...]
    modes: tuple[str, ...]
    archetypes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    gap_kinds: tuple[str, ...] = ()

    @property
    def filter(self) -> TurnFilter:
        """The selection as the queries' `TurnFilter` (hashable: a cache key)."""
        return TurnFilter(self.run_ids, self.archetypes, self.kinds, self.gap_kinds)

    def describe(self) -> str:
        """The selection in one line of words, for captions and exports."""
        parts = [f"{len(self.run_ids)} run(s)"]
        if self.archetypes:
            parts.append("archetype " + ", ".join(self.archetypes))
        if self.kinds:
            parts.append("turn kind " + ", ".join(self.kinds))
        if self.gap_kinds:
            parts.append("gap kind " + ", ".join(self.gap_kinds))
        return " · ".join(parts)

    @property
    def root(self) -> str:
        """The store directory as a string: the cache key of `dashboard.loader.load`."""
        return str(self.store.root)

    @property
    def selected_runs(self) -> pd.DataFrame:
        return self.runs[self.runs["run_id"].isin(self.run_ids)]


def publish(selection: Selection) -> None:
    st.session_state[_KEY] = selection


def current() -> Selection:
    """The selection of this script run; stops the page when the app did not make one."""
    sel = st.session_state.get(_KEY)
    if sel is None:
        st.error("Open the dashboard through dashboard/app.py (`streamlit run dashboard/app.py`).")
        st.stop()
    return sel
