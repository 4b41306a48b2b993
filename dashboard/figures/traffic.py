"""Figures of the Traffic page: pure functions, DataFrame in, ``go.Figure`` out (seconds, tokens).

Inputs are the frames of ``store.queries.traffic``. An empty input gives a figure that says so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from core.contract import HIT, MISS_EXPIRED, MISS_FIRST_TURN
from dashboard.figures import empty_figure
from dashboard.figures.common import log_ticks
from dashboard.palette import NEUTRAL, NEUTRAL_DARK, OUTCOME_COLORS, TIME_COLORS

#: Colours per gap kind / timeline segment (the same kind looks the same on every chart).
#: Gap kind -> colour (``dashboard.palette.TIME_COLORS``: time between turns, never a mode's colour).
KIND_COLORS = {"all": NEUTRAL_DARK, "tool": TIME_COLORS["tool"], "think": TIME_COLORS["think"],
               "pause": TIME_COLORS["pause"], "unknown": TIME_COLORS["unknown"], "request": TIME_COLORS["llm"]}


def _ttl_line(fig: go.Figure, ttl_s: float, text: str) -> None:
    """A dashed vertical line at `ttl_s` on the log x axis, labelled `text` at its top (an annotation's
    x on a log axis is log10 of the value; add_vline's own label would land off the plot)."""
    fig.add_vline(x=ttl_s, line_dash="dash", line_color=NEUTRAL_DARK)
    fig.add_annotation(x=float(np.log10(ttl_s)), y=1.0, xref="x", yref="paper", text=text, showarrow=False,
                       yanchor="bottom", xanchor="left", font={"size": 11})


def ttl_shares(ttl: pd.DataFrame) -> go.Figure:
    """Share of follow-ups within each TTL (x, log seconds) per gap kind; the configured TTL is a
    dashed vertical line."""
    if ttl.empty:
        return empty_figure("No follow-up requests in this report.")
    fig = go.Figure()
    for kind, g in ttl.groupby("gap_kind", sort=True):
        g = g.sort_values("ttl_s")
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=100 * g["share_within_ttl"], mode="lines+markers", name=str(kind),
                                 line={"color": KIND_COLORS.get(str(kind))},
                                 customdata=g[["within_ttl", "follow_ups"]],
                                 hovertemplate="TTL %{x:.0f} s: %{y:.1f}% (%{customdata[0]} of %{customdata[1]})"))
    conf = ttl.loc[ttl["configured"], "ttl_s"]
    if not conf.empty:
        _ttl_line(fig, float(conf.iloc[0]), f"configured TTL {float(conf.iloc[0]):g} s")
    vals, texts = log_ticks(ttl["ttl_s"])
    fig.update_xaxes(type="log", tickvals=vals, ticktext=texts, title="TTL (s, log scale)")
    fig.update_yaxes(title="follow-ups within the TTL (%)", range=[0, 102])
    fig.update_layout(height=380, margin={"t": 30}, legend_title="gap kind")
    return fig


def gap_histogram(gaps: pd.DataFrame, ttl_s: float) -> go.Figure:
    """Gap counts per kind on log-spaced bins (numpy.histogram), the TTL marked."""
    g = gaps[gaps["gap_s"] > 0]
    if g.empty:
        return empty_figure("No gaps to draw.")
    edges = np.logspace(np.log10(max(g["gap_s"].min(), 0.01)), np.log10(g["gap_s"].max() * 1.01), 40)
    mids = np.sqrt(edges[:-1] * edges[1:])
    fig = go.Figure()
    for kind, k in g.groupby("gap_kind", sort=True):
        counts, _ = np.histogram(k["gap_s"], bins=edges)
        fig.add_trace(go.Bar(x=mids, y=counts, width=np.diff(edges), name=str(kind),
                             marker_color=KIND_COLORS.get(str(kind))))
    _ttl_line(fig, ttl_s, f"configured TTL {ttl_s:g} s")
    vals, texts = log_ticks(g["gap_s"])
    fig.update_xaxes(type="log", tickvals=vals, ticktext=texts,
                     title="gap: end of a request to the session's next (s, log scale)")
    fig.update_yaxes(title="follow-ups")
    fig.update_layout(barmode="stack", height=360, margin={"t": 30}, legend_title="gap kind", bargap=0)
    return fig


def reuse_split(reuse: pd.DataFrame) -> go.Figure:
    """Per format: input tokens reusable within the TTL, reusable after it (or below the
    recompute threshold), and new, as shares of all input tokens."""
    if reuse.empty:
        return empty_figure("No requests in this report.")
    r = reuse.copy()
    if r["format"].notna().sum() == 1:  # one format: its row is the "all" row, drawn once
        r = r[r["format"].notna()]
    r["what"] = r["format"].astype(object).where(r["format"].notna(), "all")
    total = r["input_tokens"].astype(float)
    parts = {"reusable within the TTL": r["reusable_in_ttl_tokens"].astype(float),
             "reusable, but late or under the threshold": (r["reusable_tokens"] - r["reusable_in_ttl_tokens"]).astype(float),
             "new": r["new_tokens"].astype(float)}
    # as the reuse outcomes they would be: a hit, a miss that costs (expired), nothing to reuse (quiet)
    colors = [OUTCOME_COLORS[HIT], OUTCOME_COLORS[MISS_EXPIRED], OUTCOME_COLORS[MISS_FIRST_TURN]]
    fig = go.Figure()
    for (name, v), c in zip(parts.items(), colors, strict=True):
        fig.add_trace(go.Bar(y=r["what"], x=100 * v / total, name=name, orientation="h", marker_color=c,
                             hovertemplate="%{x:.1f}%"))
    fig.update_xaxes(title="share of input tokens (%)", range=[0, 100])
    fig.update_layout(barmode="stack", height=160 + 40 * len(r), margin={"t": 40},  # legend above: clear of the ticks
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0})
    return fig


def context_growth(growth: pd.DataFrame) -> go.Figure:
    """Prompt tokens by request index, one line per session."""
    if growth.empty:
        return empty_figure("No sessions to draw.")
    fig = go.Figure()
    for sid, g in growth.groupby("session_id", sort=False):
        fig.add_trace(go.Scatter(x=g["request_index"], y=g["input_tokens"], mode="lines", name=str(sid),
                                 line={"width": 1}, hovertemplate=f"{sid}<br>request %{{x}}: %{{y:,}} tokens"))
    fig.update_xaxes(title="request index in the session")
    fig.update_yaxes(title="prompt tokens")
    fig.update_layout(height=380, margin={"t": 30}, showlegend=False)
    return fig


def session_timeline(tl: pd.DataFrame) -> go.Figure:
    """One session and its sub-agents: a row per session, segments (requests, tool/think waits,
    pauses over the TTL) as horizontal bars on the source's clock (seconds)."""
    if tl.empty:
        return empty_figure("Pick a session.")
    fig = go.Figure()
    rows = list(dict.fromkeys(tl["session_id"]))
    for seg, g in tl.groupby("segment", sort=True):
        fig.add_trace(go.Bar(y=g["session_id"], x=g["end_s"] - g["start_s"], base=g["start_s"], orientation="h",
                             name=str(seg), marker_color=KIND_COLORS.get(str(seg)),
                             customdata=g[["request_index", "input_tokens", "shared_prefix_tokens"]],
                             hovertemplate=(f"{seg}" + " before/of request %{customdata[0]}: %{x:.1f} s<br>"
                                            "prompt %{customdata[1]:,} tokens, %{customdata[2]:,} shared")))
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1], title=None)
    fig.update_xaxes(title="seconds since the trace's first request")
    fig.update_layout(barmode="overlay", height=160 + 50 * len(rows), margin={"t": 30}, legend_title="segment")
    return fig


def trace_vs_engine(turns: pd.DataFrame) -> go.Figure:
    """Per replayed turn: the trace's reusable tokens (x, scaled) against what the engine reused
    (y), coloured by the proxy's reuse outcome; the diagonal is "as the trace says"."""
    if turns.empty:
        return empty_figure("No replayed trace turns in the selection.")
    fig = go.Figure()
    for outcome, g in turns.groupby(turns["reuse"].fillna("not recorded"), sort=True):
        fig.add_trace(go.Scatter(x=g["trace_reusable_tokens"], y=g["measured_reused_tokens"], mode="markers",
                                 name=str(outcome), customdata=g[["session_id", "turn_index", "mode"]],
                                 hovertemplate="%{customdata[0]} turn %{customdata[1]} (%{customdata[2]})<br>"
                                               "trace %{x:,} tokens, engine %{y:,}"))
    top = float(max(turns["trace_reusable_tokens"].max(), turns["measured_reused_tokens"].fillna(0).max(), 1))
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="as the trace says",
                             line={"dash": "dot", "color": NEUTRAL}))
    fig.update_xaxes(title="the trace's reusable tokens (scaled)")
    fig.update_yaxes(title="tokens the engine reused")
    fig.update_layout(height=380, margin={"t": 30}, legend_title="reuse")
    return fig
