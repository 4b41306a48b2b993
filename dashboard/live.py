"""Rows as they land: while a shown run is recording, the page re-reads the store by itself.

A run is recording while its latest ``runs`` row reads ``running`` (no end yet; the ``runs`` view
turns a row whose heartbeats stopped into ``aborted``: docs/schema/views.md). While the sidebar's
selection keeps such a run and the page draws runs (``dashboard/pages.py``: Overview, Turns,
Sessions, Memory, Compare), `follow` draws a caption saying so and a Streamlit fragment that runs
every `interval_s` seconds. Each time it takes the store's fingerprint without the ``runs_log``
folders (`dashboard.loader.store_version`: a few hundred ``stat`` calls), and reruns the whole app
when a shard of turns, sessions or scrapes landed since the page was drawn: the page's queries then
miss the cache (their key holds the store's fingerprint) and read the new rows. A run's heartbeat
(its ``runs_log`` row rewritten every few seconds) reruns nothing: the fragment reads the runs
(``store.queries.runs``, cached until the store changes) and reruns the app only when one it follows
no longer reads ``running``. That rerun finds nothing recording and draws no fragment: the
refreshing stops.

A writer killed outright writes nothing more, so the store stops changing while the cached ``runs``
still read ``running``; after `STALE_S` seconds without any write the fragment forgets the cached
results once and reruns, and the view then reads the run ``aborted``.

The interval: each rerun after new rows re-reads the page's queries (a fraction of a second to a few
seconds of the server's CPU on a demo store, more with more scrapes: docs/dashboard.md); 5 s keeps a
watched page at most that far behind without taking a core from the workers it watches.
``TURNSCOPE_DASHBOARD_LIVE_S`` sets it.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pandas as pd
import streamlit as st

from dashboard import loader
from store import db, queries

#: Environment variable: seconds between the store checks of a page showing a recording run.
ENV_VAR = "TURNSCOPE_DASHBOARD_LIVE_S"
#: Seconds between the store checks, when `ENV_VAR` is not set.
DEFAULT_INTERVAL_S = 5.0
#: Seconds without any write to the store after which the cached results are forgotten once.
STALE_S = 60.0
#: Store folders whose writes alone rerun nothing: a recording run's heartbeats.
HEARTBEATS = ("runs_log",)
#: Session-state keys: the fingerprints the page was drawn from (its data; the whole store), and
#: when the whole store last changed (monotonic s).
_SEEN = "_ts_live_seen"
_SEEN_ALL = "_ts_live_seen_all"
_CHANGED_AT = "_ts_live_changed_at"
_DRAWN = "_ts_live_drawn"  # (monotonic s when the last full run started, its seconds)
#: A page reruns for new rows at most once per this many of its own last full runs' durations:
#: a watched page that takes 1 s of the server to draw re-reads at most every 4 s, so watching
#: takes at most about a quarter of a core from the workers being watched.
COST_FACTOR = 4.0


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


def timed(run) -> None:
    """Call `run` (the app's page), noting when it started and how long it took (also when it
    stops early): the fragment spaces its reruns by it (`COST_FACTOR`)."""
    t0 = time.monotonic()
    try:
        run()
    finally:
        st.session_state[_DRAWN] = (t0, time.monotonic() - t0)


def follow(store_root: str, runs: pd.DataFrame) -> None:
    """On a page showing `runs` (the selection's): when any of them is recording, say so and keep
    the page current (the module's docstring); else draw nothing."""
    live = recording(runs)
    if live.empty:
        st.session_state.pop(_SEEN, None)
        return
    st.session_state[_SEEN] = loader.store_version(store_root, HEARTBEATS)
    everything = loader.store_version(store_root)
    if st.session_state.get(_SEEN_ALL) != everything:
        st.session_state[_CHANGED_AT] = time.monotonic()
    st.session_state[_SEEN_ALL] = everything
    ids = tuple(live["run_id"].astype(str))
    _watch(store_root, ids, interval_s())


def _watch(store_root: str, ids: tuple[str, ...], every_s: float) -> None:
    names = ", ".join(f"`{r}`" for r in ids)
    n = len(ids)

    @st.fragment(run_every=every_s)
    def watch() -> None:
        now = dt.datetime.now(dt.UTC)
        st.caption(
            f":material/autorenew: {'Run' if n == 1 else 'Runs'} {names} {'is' if n == 1 else 'are'} recording: "
            f"this page re-reads the store every {every_s:g} s and shows new rows as they land, until "
            f"{'it ends' if n == 1 else 'they end'} (last look {now:%H:%M:%S} UTC)."
        )
        if loader.store_version(store_root, HEARTBEATS) != st.session_state.get(_SEEN):
            started, took = st.session_state.get(_DRAWN, (0.0, 0.0))
            if time.monotonic() - started >= COST_FACTOR * took:
                st.rerun(scope="app")  # new turns, sessions or scrapes; else at a later look
        everything = loader.store_version(store_root)
        if everything != st.session_state.get(_SEEN_ALL):
            st.session_state[_SEEN_ALL] = everything
            st.session_state[_CHANGED_AT] = time.monotonic()
            try:
                runs = loader.fetch(store_root, queries.runs)
            except (db.StoreBusy, db.StoreMissing, db.StoreInvalid):
                return  # a writer setting the store up: look again next time
            if set(recording(runs[runs["run_id"].isin(ids)])["run_id"].astype(str)) != set(ids):
                st.rerun(scope="app")  # a run it follows ended
        elif time.monotonic() - st.session_state.get(_CHANGED_AT, time.monotonic()) > STALE_S:
            # nothing written for a while: a writer may be gone; let the runs view say so
            st.session_state[_CHANGED_AT] = time.monotonic()
            loader.clear()
            st.rerun(scope="app")

    watch()
