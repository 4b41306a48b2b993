"""The Sessions page's figures: task latency split per archetype and one session's timeline.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.figures.common import MODE_ORDER, OUTCOME_COLORS, empty_figure
from dashboard.palette import ALARM, NEUTRAL, TIME_COLORS

#: Gap kinds, in colours no reuse outcome uses (the session timeline shows both).
GAP_COLORS = {k: TIME_COLORS[k] for k in ("tool", "think", "pause", "none")}
TASK_PARTS = (
    ("llm_s", "LLM (sum of E2E)", TIME_COLORS["llm"]),
    ("tool_wait_s", "tool wait", GAP_COLORS["tool"]),
    ("think_s", "think", GAP_COLORS["think"]),
    ("pause_s", "pause", GAP_COLORS["pause"]),
    ("other_s", "other (client between turns)", TIME_COLORS["other"]),
)


def task_split(df: pd.DataFrame) -> go.Figure:
    """Mean task latency per session split into LLM time, tool wait, think, pause and the rest,
    one horizontal stacked bar per (mode, archetype), in seconds.

    `df`: ``store.queries.task_split`` (mode, archetype, sessions, task_latency_s, llm_s,
    tool_wait_s, think_s, pause_s; seconds). "other" = task latency minus the four parts.
    """
    if df.empty:
        return empty_figure("no finished sessions in the selection")
    d = df.copy()
    d["other_s"] = (d["task_latency_s"] - d[["llm_s", "tool_wait_s", "think_s", "pause_s"]].sum(axis=1)).clip(lower=0)
    order = {m: i for i, m in enumerate(MODE_ORDER)}
    d = d.sort_values(["mode", "archetype"], key=lambda c: c.map(order).fillna(99) if c.name == "mode" else c)
    d["group"] = d["mode"].astype(str) + " · " + d["archetype"].astype(str) + " (" + d["sessions"].astype(str) + ")"
    fig = go.Figure()
    for part, label, color in TASK_PARTS:
        fig.add_trace(
            go.Bar(
                y=d["group"],
                x=d[part],
                name=label,
                orientation="h",
                marker_color=color,
                hovertemplate=f"%{{y}}<br>{label}: %{{x:.2f}} s per session<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="stack",
        title="Task latency per session (mean), split",
        xaxis_title="seconds per session (mean)",
        yaxis_title="mode · archetype (sessions)",
        yaxis={"autorange": "reversed"},
        legend_title_text="part",
        margin={"t": 60},
        height=max(260, 60 + 40 * len(d)),
    )
    return fig




def session_timeline(df: pd.DataFrame) -> go.Figure:
    """One session's timeline (a Gantt): per turn, the gap before it (coloured by gap kind), the
    wait for the first token (coloured by reuse outcome) and the streaming after it.

    `df`: ``store.queries.session_turns`` (turn_index, kind, gap_kind, gap_before_s,
    start_s: seconds from the session's first request, ttft_s, e2e_s, status, reuse). A turn
    without a TTFT (failed) is drawn as one grey bar of its E2E, if any. x in seconds.
    """
    if df.empty:
        return empty_figure("no turns recorded for this session")
    d = df.sort_values("turn_index").reset_index(drop=True)
    d["row"] = "turn " + d["turn_index"].astype(str) + " · " + d["kind"].fillna("?").astype(str)
    fig = go.Figure()
    shown: set[str] = set()

    def bar(row: pd.Series, base: float, length: float, name: str, color: str, text: str) -> None:
        gap = name.startswith("gap")
        fig.add_trace(
            go.Bar(
                y=[row["row"]],
                x=[length],
                base=[base],
                orientation="h",
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                marker={"color": color, "pattern": {"shape": "/" if gap else ""}},
                hovertemplate=text + "<extra></extra>",
            )
        )
        shown.add(name)

    for _, row in d.iterrows():
        start = float(row["start_s"])
        gap = row["gap_before_s"]
        if pd.notna(gap) and gap > 0:
            kind = str(row["gap_kind"])
            bar(row, start - gap, gap, f"gap: {kind}", GAP_COLORS.get(kind, NEUTRAL),
                f"{row['row']}<br>{kind} gap {gap:.2f} s")  # fmt: skip
        ttft, e2e = row["ttft_s"], row["e2e_s"]
        if pd.notna(ttft):
            outcome = str(row["reuse"])
            bar(row, start, ttft, f"to first token: {outcome}", OUTCOME_COLORS.get(outcome, NEUTRAL),
                f"{row['row']}<br>TTFT {ttft * 1e3:.1f} ms ({outcome})")  # fmt: skip
            if pd.notna(e2e) and e2e > ttft:
                bar(row, start + ttft, e2e - ttft, "streaming", TIME_COLORS["decode"],
                    f"{row['row']}<br>streaming {(e2e - ttft) * 1e3:.1f} ms")  # fmt: skip
        else:
            length = float(e2e) if pd.notna(e2e) else 0.0
            bar(row, start, length, f"failed ({row['status']})", ALARM,
                f"{row['row']}<br>{row['status']}, no token")  # fmt: skip
    fig.update_layout(
        barmode="overlay",
        title="Session timeline",
        xaxis_title="time since the session's first request (s)",
        yaxis={"autorange": "reversed", "title": "turn"},
        legend={"title": {"text": "segment"}, "orientation": "h", "yanchor": "top", "y": -0.25, "x": 0},
        margin={"t": 60, "b": 40},
        height=max(340, 200 + 28 * len(d)),
    )
    return fig
