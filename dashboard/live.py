"""Rows as they land: while a shown run is recording, the page re-reads the store by itself.

A run is recording while its latest ``runs`` row reads ``running`` (no end yet; the ``runs`` view
turns a row whose heartbeats stopped into ``aborted``: docs/schema/views.md). While the sidebar's
selection keeps such a run and the page draws runs (``dashboard/pages.py``: Overview, Turns,
Sessions, Memory, Compare), `follow` draws a caption saying so and a Streamlit fragment that runs
every `INTERVAL_S` seconds: it takes the store's fingerprint (`dashboard.loader.store_version`, a
few hundred ``stat`` calls) and, when a shard or a run row landed since the page was drawn, reruns
the whole app, whose queries then miss the cache (their key holds the fingerprint) and read the
new rows. When the run ends (its final row is a write too), that rerun finds nothing recording and
draws no fragment: the refreshing stops.

A writer killed outright writes nothing more, so the fingerprint stops changing while the cached
``runs`` still read ``running``; after `STALE_S` seconds without a change the fragment forgets the
cached results once and reruns, and the view then reads the run ``aborted``.

The interval: a recording run's heartbeat (``--turnscope-heartbeat-s``) writes a row every few
seconds anyway, and each rerun after a write re-reads the page's queries (a fraction of a second
of the server's CPU on a demo-sized store); 5 s keeps a watched page at most that far behind
without taking a core from the workers it watches. ``TURNSCOPE_DASHBOARD_LIVE_S`` overrides it.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pandas as pd
import streamlit as st

from dashboard import loader

#: Environment variable: seconds between the store checks of a page showing a recording run.
ENV_VAR = "TURNSCOPE_DASHBOARD_LIVE_S"
#: Seconds between the store checks, when `ENV_VAR` is not set.
DEFAULT_INTERVAL_S = 5.0
#: Seconds without any write to the store after which the cached results are forgotten once.
STALE_S = 60.0
#: Session-state keys: the fingerprint the page was drawn from, and when it last changed (monotonic s).
_SEEN = "_ts_live_seen"
_CHANGED_AT = "_ts_live_changed_at"


def interval_s() -> float:
    """Seconds between store checks: `ENV_VAR` when it is a positive number, else `DEFAULT_INTERVAL_S`.

    Raises ValueError naming the variable when it is set to something else."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected a positive number of seconds")
    return value


def recording(runs: pd.DataFrame) -> pd.DataFrame:
    """The rows of `runs` (``store.queries.runs``'s columns) whose status is ``running``."""
    return runs[runs["status"] == "running"]


def follow(store_root: str, runs: pd.DataFrame) -> None:
    """On a page showing `runs` (the selection's): when any of them is recording, say so and keep
    the page current (the module's docstring); else draw nothing."""
    live = recording(runs)
    if live.empty:
        st.session_state.pop(_SEEN, None)
        return
    seen = loader.store_version(store_root)
    if st.session_state.get(_SEEN) != seen:
        st.session_state[_CHANGED_AT] = time.monotonic()
    st.session_state[_SEEN] = seen
    names = ", ".join(f"`{r}`" for r in live["run_id"].astype(str))
    _watch(store_root, names, len(live), interval_s())


def _watch(store_root: str, names: str, n: int, every_s: float) -> None:
    @st.fragment(run_every=every_s)
    def watch() -> None:
        now = dt.datetime.now(dt.UTC)
        st.caption(
            f":material/autorenew: {'Run' if n == 1 else 'Runs'} {names} {'is' if n == 1 else 'are'} recording: "
            f"this page re-reads the store every {every_s:g} s and shows new rows as they land, until "
            f"{'it ends' if n == 1 else 'they end'} (last look {now:%H:%M:%S} UTC)."
        )
        version = loader.store_version(store_root)
        if version != st.session_state.get(_SEEN):
            st.rerun(scope="app")
        if time.monotonic() - st.session_state.get(_CHANGED_AT, time.monotonic()) > STALE_S:
            # nothing written for a while: a writer may be gone; let the runs view say so
            st.session_state[_CHANGED_AT] = time.monotonic()
            loader.clear()
            st.rerun(scope="app")

    watch()
