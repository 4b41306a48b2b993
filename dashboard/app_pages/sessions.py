"""Sessions: task latency split into LLM, tool, think and pause, and one session's timeline
(task latency: docs/schema/views.md, ``session_tasks``)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, context, figures, tables
from dashboard.loader import load
from store import queries

sel = context.current()
st.title("Sessions")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()
f = sel.filter
st.caption(
    f"Selection: {sel.describe()}. Sessions are whole: the turn-kind and gap-kind filters do not apply here. "
    "A session appears once it has finished (its row is written at the end)."
)

split = load(sel.root, queries.task_split, f)
if split.empty:
    st.info("No finished sessions in the selection yet.")
charts.note("the task latency split")
charts.show(lambda: figures.task_split(split), "task_split")
st.caption(
    "Task latency: first request sent to last response finished. LLM = the sum of the turns' E2E; tool, "
    "think and pause = the gaps before turns by kind; other = what is left (the client's own time between turns)."
)

# --- one session ------------------------------------------------------------------------------
st.subheader("One session")
listed = load(sel.root, queries.session_list, f, 500)
if listed.empty:
    st.info("No sessions to pick.")
    st.stop()
total = int(listed["total"].iloc[0])
keys = (listed["run_id"].astype(str) + "/" + listed["session_id"].astype(str)).tolist()
names = {
    k: f"{row.session_id} · {row.run_label} · {row.mode} · {row.history_mode} · {row.task_latency_s:.1f} s"
    if row.task_latency_s == row.task_latency_s
    else f"{row.session_id} · {row.run_label} · {row.mode} · {row.history_mode}"
    for k, row in zip(keys, listed.itertuples(), strict=True)
}


@st.fragment
def _one_session(root: str, listed: pd.DataFrame, keys: list[str], names: dict[str, str], total: int) -> None:
    """The session picker and the picked session's timeline: a fragment, so picking one reruns this
    part alone, not the page's queries and figures above."""
    pick = st.selectbox(
        "Session (slowest first)" + (f"; the {len(keys)} slowest of {total}" if total > len(keys) else ""),
        keys,
        index=None,
        format_func=names.get,
        placeholder="pick a session to see its timeline",
        key="session_pick",
    )
    if pick is None:
        st.caption("Pick a session above to draw its timeline: each turn's gap, wait for the first token and stream.")
    else:
        run_id, session_id = pick.split("/", 1)
        turns = load(root, queries.session_turns, run_id, session_id)
        # asked for by picking a session: drawn whether or not the page's charts are on
        st.plotly_chart(figures.session_timeline(turns), key="session_timeline", config=charts.CONFIG)
        row = listed.iloc[keys.index(pick)]
        st.caption(
            f"{row['session_id']} ({row['archetype']}, {row['status']}): {int(row['turns'])} turns, task "
            f"{row['task_latency_s']:.2f} s = LLM {row['llm_s']:.2f} + tool {row['tool_wait_s']:.2f} + think "
            f"{row['think_s']:.2f} + pause {row['pause_s']:.2f} s + other."
        )


_one_session(sel.root, listed, keys, names, total)

st.dataframe(
    tables.session_table(listed),
    hide_index=True,
    key="session_table",
    column_config={
        c: st.column_config.NumberColumn(format="%.2f")
        for c in ("task (s)", "LLM (s)", "tool (s)", "think (s)", "pause (s)")
    }
    | {"run_id": st.column_config.TextColumn(width="large")},
)
