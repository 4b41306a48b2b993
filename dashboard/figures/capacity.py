"""The capacity ramp's figure (Memory page): load on x, goodput, TTFT and D's KV usage on y, one
line per mode. A pure function, DataFrame in, ``go.Figure`` out; modes keep their colours from
``dashboard.figures``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.modes import PD, PD_BIDIR
from dashboard.figures import empty_figure
from dashboard.palette import NEUTRAL_DARK, mode_color

TREATMENT = PD_BIDIR


def capacity_curve(steps: pd.DataFrame, crossing_users: int | None = None) -> go.Figure:
    """Three full-width rows against concurrent sessions (``users``): goodput (turns/s meeting the
    SLO), TTFT p50 (dotted) and p90 (solid) in ms, and D's peak KV usage (%); one colour per mode,
    a vertical dashed line at ``crossing_users`` when given.

    ``steps``: ``store.queries.capacity.capacity_steps`` rows of one ramp (``mode``, ``users``,
    ``goodput_per_s``, ``ttft_p50_s``, ``ttft_p90_s``, ``decode_kv_usage_max``, ``slo_turns``,
    ``turns``)."""
    if steps.empty:
        return empty_figure("no capacity steps in the selection")
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("goodput: turns meeting the SLO per second",
                                        "TTFT p90 (solid) and p50 (dotted)", "D's KV usage, peak during the step"))
    for mode in sorted(steps["mode"].unique(), key=lambda m: (m != PD, m)):
        g = steps[steps["mode"] == mode].sort_values("users")
        color = mode_color(mode)
        cd = g[["slo_turns", "turns"]].to_numpy()
        fig.add_trace(go.Scatter(x=g["users"], y=g["goodput_per_s"], mode="lines+markers", name=mode, legendgroup=mode,
                                 line={"color": color}, customdata=cd,
                                 hovertemplate=f"{mode}<br>%{{x}} sessions<br>goodput %{{y:.2f}} turns/s"
                                               "<br>%{customdata[0]} of %{customdata[1]} turns met the SLO<extra></extra>"),
                      row=1, col=1)
        for stat, dash in (("p90", "solid"), ("p50", "dot")):
            fig.add_trace(go.Scatter(x=g["users"], y=g[f"ttft_{stat}_s"] * 1e3, mode="lines+markers",
                                     name=f"{mode} {stat}", legendgroup=mode, showlegend=False,
                                     line={"color": color, "dash": dash},
                                     hovertemplate=f"{mode}<br>%{{x}} sessions<br>TTFT {stat} %{{y:,.0f}} ms<extra></extra>"),
                          row=2, col=1)
        fig.add_trace(go.Scatter(x=g["users"], y=g["decode_kv_usage_max"] * 100, mode="lines+markers",
                                 name=f"{mode} D KV", legendgroup=mode, showlegend=False, line={"color": color},
                                 hovertemplate=f"{mode}<br>%{{x}} sessions<br>D KV peak %{{y:.0f}}%<extra></extra>"),
                      row=3, col=1)
    if crossing_users is not None:
        for row in (1, 2, 3):
            fig.add_vline(x=crossing_users, line={"dash": "dash", "color": NEUTRAL_DARK}, row=row, col=1)
    fig.update_xaxes(title_text="concurrent sessions (load step)", row=3, col=1, dtick=1)
    fig.update_yaxes(title_text="turns/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="TTFT (ms)", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="% of D's KV", range=[0, 105], row=3, col=1)
    fig.update_layout(height=720, legend={"orientation": "h", "y": 1.08, "x": 0}, legend_title_text="mode",
                      margin={"t": 90})
    return fig


def eviction_window(speedups: pd.DataFrame, window_steps: tuple[int, ...] = (),
                    crossing_users: int | None = None) -> go.Figure:
    """P's eviction ladder (Memory page): three full-width rows against concurrent sessions
    (``users``): P's own prefix-cache hit rate (%) of ``pd`` and of ``pd-bidir``, the speed-up
    ``pd`` / ``pd-bidir`` (median TTFT of later turns) with its 95% interval as error bars and a
    dotted line at 1, and ``pd-bidir``'s D peak KV usage (%). The window's steps (``window_steps``)
    are shaded, the crossing (``crossing_users``: D runs out) a dashed vertical line.

    ``speedups``: ``analysis.eviction_window.step_speedups`` rows."""
    if speedups.empty:
        return empty_figure("no step measured in both pd and pd-bidir")
    g = speedups.sort_values("users")
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        subplot_titles=("P's own prefix-cache hit rate", "speed-up pd / pd-bidir (95% CI)",
                                        "pd-bidir's D KV usage, peak during the step"))
    for col, mode in (("p_hit_rate_baseline", PD), ("p_hit_rate_treatment", TREATMENT)):
        fig.add_trace(go.Scatter(x=g["users"], y=g[col] * 100, mode="lines+markers", name=f"{mode} P hit rate",
                                 line={"color": mode_color(mode)},
                                 hovertemplate=f"{mode}<br>%{{x}} sessions<br>P hit rate %{{y:.1f}}%<extra></extra>"),
                      row=1, col=1)
    fig.add_trace(go.Scatter(
        x=g["users"], y=g["speedup"], mode="lines+markers", name="speed-up", line={"color": NEUTRAL_DARK},
        error_y={"type": "data", "symmetric": False, "array": (g["ci_high"] - g["speedup"]).fillna(0),
                 "arrayminus": (g["speedup"] - g["ci_low"]).fillna(0)},
        customdata=g[["ci_low", "ci_high", "verdict"]].to_numpy(),
        hovertemplate="%{x} sessions<br>speed-up %{y:.2f}x (%{customdata[0]:.2f}-%{customdata[1]:.2f}x)"
                      "<br>%{customdata[2]}<extra></extra>"), row=2, col=1)
    fig.add_hline(y=1, line={"dash": "dot", "color": NEUTRAL_DARK}, row=2, col=1)
    fig.add_trace(go.Scatter(x=g["users"], y=g["decode_kv_usage_max"] * 100, mode="lines+markers",
                             name=f"{TREATMENT} D KV", line={"color": mode_color(TREATMENT)},
                             hovertemplate="%{x} sessions<br>D KV peak %{y:.0f}%<extra></extra>"), row=3, col=1)
    if window_steps:
        for row in (1, 2, 3):
            fig.add_vrect(x0=window_steps[0] - 0.3, x1=window_steps[-1] + 0.3, fillcolor="#2ca02c", opacity=0.12,
                          line_width=0, row=row, col=1)
    if crossing_users is not None:
        for row in (1, 2, 3):
            fig.add_vline(x=crossing_users, line={"dash": "dash", "color": NEUTRAL_DARK}, row=row, col=1)
    top = max(1.1, float(g["ci_high"].max(skipna=True)) if g["ci_high"].notna().any() else 1.1,
              float(g["speedup"].max()))
    fig.update_xaxes(title_text="concurrent sessions (load step)", row=3, col=1, dtick=1)
    fig.update_yaxes(title_text="% of prompt tokens", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="x (above 1: pd-bidir faster)", range=[0, top * 1.08], row=2, col=1)
    fig.update_yaxes(title_text="% of D's KV", range=[0, 105], row=3, col=1)
    fig.update_layout(height=720, legend={"orientation": "h", "y": 1.08, "x": 0}, margin={"t": 90})
    return fig
