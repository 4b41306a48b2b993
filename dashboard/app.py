"""turnscope dashboard: `streamlit run dashboard/app.py`.

Read-only over the store named by ``$TURNSCOPE_STORE`` (default ``store.db.DEFAULT_STORE``).
This script owns what every page shares: the store, its empty states, and the sidebar's filters
(run, mode, archetype, turn kind, gap kind); the pages (``dashboard/pages.py``, their scripts in
``dashboard/app_pages/``) read the resulting `dashboard.context.Selection`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `streamlit run` puts dashboard/ on sys.path, not the folder holding the dashboard package (a
# checkout's root, or site-packages installed): this script's code, not another copy's, runs.
_CODE_ROOT = Path(__file__).resolve().parents[1]
if str(_CODE_ROOT) not in sys.path:
    sys.path.insert(0, str(_CODE_ROOT))

import pandas as pd
import streamlit as st

from dashboard import charts, context, live, loader, pages
from dashboard.figures import MODE_ORDER
from store import db, queries
from store.queries import sidebar

st.set_page_config(page_title="turnscope", page_icon=":material/query_stats:", layout="wide")

PAGES = [st.Page(p.script, title=p.title, icon=p.icon, default=p.default) for p in pages.PAGES]
#: Pages that need no recorded run (a store may hold only forecasts or traffic reports).
WITHOUT_RUNS = [sp for sp, p in zip(PAGES, pages.PAGES, strict=True) if not p.needs_runs]

store = db.store_from_env()
st.sidebar.caption(f"Store: `{store.root}`")
if st.sidebar.button("Refresh", icon=":material/refresh:", help="Re-read the store now"):
    loader.clear()
charts.toggle()


def _load_runs() -> pd.DataFrame:
    """All runs (possibly none), or an empty state drawn on the page followed by `st.stop()`."""
    try:
        return loader.fetch(str(store.root), queries.runs)
    except (db.StoreMissing, db.StoreBusy, db.StoreInvalid) as exc:
        st.navigation(PAGES)  # the menu stays while the page says why there is nothing to show
        _say_unreadable(exc)
    raise AssertionError("unreachable")  # st.stop() raises


def _say_unreadable(exc: Exception) -> None:
    """Say why the store cannot be read (StoreMissing, StoreBusy, StoreInvalid), then `st.stop()`."""
    if isinstance(exc, db.StoreMissing):
        st.info(
            f"No store yet at `{store.root}`: run `turnscope demo` to make one, or point "
            f"`{db.ENV_VAR}` at an existing store directory."
        )
    elif isinstance(exc, db.StoreBusy):
        st.warning(f"The store at `{store.root}` is being set up by a writer; refresh in a moment.")
    else:
        st.error(f"`{store.db}` is not a turnscope store (see data/schema.sql): {exc}")
    st.stop()


def _has_rows(table: str) -> bool:
    """Whether the store's `table` (plan_log, traffic_log) has a row."""
    return not db.read(store, sidebar.any_row, table).empty


runs = _load_runs()
if runs.empty:
    if not (_has_rows("plan_log") or _has_rows("traffic_log")):
        st.navigation(PAGES)
        st.info(f"No runs yet in `{store.root}`: run `turnscope demo`.")
        st.stop()
    # Only forecasts or traffic reports: show the pages that read them, not the run filters.
    nav = st.navigation(WITHOUT_RUNS)
    st.sidebar.caption("No recorded runs in this store: showing its forecasts and traffic reports.")
    context.publish(context.Selection(store=store, runs=runs, run_ids=(), modes=()))
    nav.run()
    st.stop()
nav = st.navigation(PAGES)

present = [str(m) for m in runs["mode"].dropna().unique()]
mode_options = [m for m in MODE_ORDER if m in present] + sorted(m for m in present if m not in MODE_ORDER)
modes = st.sidebar.multiselect("Modes", mode_options, placeholder="all modes", key="ts_modes")


def _run_name(run_id: str) -> str:
    row = runs.loc[runs["run_id"] == run_id].iloc[0]
    label = row["label"] if pd.notna(row["label"]) and row["label"] else run_id
    return f"{label} · {row['mode']} · {row['status']}"


chosen = st.sidebar.multiselect(
    "Runs", runs["run_id"].tolist(), format_func=_run_name, placeholder="all runs", key="ts_runs"
)
# An empty filter means "all", so runs that appear while the app is open are included.
keep = runs
if modes:
    keep = keep[keep["mode"].isin(modes)]
if chosen:
    keep = keep[keep["run_id"].isin(chosen)]

# Turn filters: the values present in the runs kept so far. Empty means all.
options = loader.load(str(store.root), queries.filter_options, tuple(keep["run_id"].astype(str)))


def _values(field: str) -> list[str]:
    return options.loc[options["field"] == field, "value"].astype(str).tolist()


def _turn_filter(label: str, field: str, key: str, help_: str) -> tuple[str, ...]:
    values = _values(field)
    # A value picked earlier that the current runs lack stays listed, so the widget keeps it.
    picked = [v for v in st.session_state.get(key, []) if v not in values]
    return tuple(st.sidebar.multiselect(label, values + picked, placeholder="all", key=key, help=help_))


archetypes = _turn_filter(
    "Archetype", "archetype", "ts_archetypes",
    "Session archetype (from the session's row, written when it ends: a running session has none yet).",
)  # fmt: skip
kinds = _turn_filter("Turn kind", "kind", "ts_kinds", "turn, retry, edit, fresh or resume (docs/workloads.md).")
gap_kinds = _turn_filter("Gap kind", "gap_kind", "ts_gap_kinds", "What the session waited on before the turn.")
running = len(live.recording(keep))
st.sidebar.caption(
    f"{len(keep)} of {len(runs)} runs selected"
    + (f"; {running} still recording (the run pages refresh themselves)" if running else "")
)
# a page drawing recorded runs follows a recording one (dashboard/live.py)
if pages.by_title(nav.title).draws == "runs":
    live.follow(str(store.root), keep)

context.publish(
    context.Selection(
        store=store,
        runs=runs,
        run_ids=tuple(keep["run_id"].astype(str)),
        modes=tuple(modes or mode_options),
        archetypes=archetypes,
        kinds=kinds,
        gap_kinds=gap_kinds,
    )
)
live.timed(nav.run)  # the page, timed: a recording run's reruns are spaced by it
