"""Whether the pages draw their Plotly charts, and drawing one: a choice in the sidebar, on by default.

The charts are what the dashboard is for, so every page draws them. A browser tab's first Plotly
chart makes it load and evaluate plotly.js (Streamlit's 4.7 MB ``PlotlyChart`` chunk): about 1.7 s
of wall time and 1.8 CPU-seconds of Chromium on the project's 2-core machine, once per tab, since
moving between pages from the sidebar keeps the document (docs/dashboard.md). For a slow machine
the sidebar's "Hide charts" leaves them out for the session (every page, until "Draw charts");
``TURNSCOPE_DASHBOARD_CHARTS=0`` starts a session with them hidden.

A figure is built only when it is drawn (`show` takes a function), so a page without charts spends
no server time on them either. The HTML export (``dashboard/html_reports.py``) always holds its figures.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import plotly.graph_objects as go
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

#: Session-state keys: whether charts are drawn, and the sidebar's button that flips it.
KEY = "ts_charts"
BUTTON_KEY = "ts_charts_button"
#: Environment variable: "0" (or false, no) starts a session with charts hidden.
ENV_VAR = "TURNSCOPE_DASHBOARD_CHARTS"
LABEL = "Draw charts"
HIDE_LABEL = "Hide charts"
HELP = ("Draw or hide each page's Plotly charts (for the session). The first chart of a browser tab loads "
        "plotly.js: about 2 s on a small machine, then each page's charts draw in a fraction of that.")  # fmt: skip
#: plotly.js options of every chart: no Plotly logo in the mode bar.
CONFIG = {"displaylogo": False}


def default() -> bool:
    """Whether a new session draws charts: yes unless `ENV_VAR` is 0, false or no."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("0", "false", "no")


def _flip() -> None:
    st.session_state[KEY] = not on()


def toggle() -> None:
    """The sidebar's "Hide charts" / "Draw charts" button (the app's frame draws it on every page).

    A button, not ``st.toggle``: the frame already draws one (Refresh), and each other kind of
    widget makes the browser load its own code on every page (Streamlit's Checkbox chunk: 0.6-1.3 s
    of an empty page's cold visit here)."""
    st.session_state.setdefault(KEY, default())
    st.sidebar.button(HIDE_LABEL if on() else LABEL, icon=":material/bar_chart:", key=BUTTON_KEY, on_click=_flip,
                      help=HELP)  # fmt: skip


def on() -> bool:
    """Whether this session draws charts."""
    return bool(st.session_state.get(KEY, default()))


def show(make: Callable[[], go.Figure], key: str, where: DeltaGenerator | None = None) -> go.Figure | None:
    """Draw the figure `make()` builds in `where` (the page by default) under `key`, when charts
    are on; else build nothing and return None."""
    if not on():
        return None
    fig = make()
    (where if where is not None else st).plotly_chart(fig, key=key, config=CONFIG)
    return fig


def note(what: str = "this page's charts") -> None:
    """Where charts are off, a caption saying how to draw `what`."""
    if not on():
        st.caption(f":material/bar_chart: {what[0].upper() + what[1:]} are not drawn: press **{LABEL}** in "
                   "the sidebar (it holds for every page).")  # fmt: skip
