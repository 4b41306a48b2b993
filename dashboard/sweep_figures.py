"""Plotly figures of the Sweep page: pure functions, DataFrame in, `go.Figure` out.

Inputs are `analysis.sweep_stats`'s frames (seconds, tokens); latencies are drawn in milliseconds.
Modes keep their colours from `dashboard.figures`; a speed-up pair takes its baseline's colour.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from analysis import speedup
from dashboard.figures import MODE_COLORS, MODE_ORDER, empty_figure, ordered_present
from dashboard.palette import NEUTRAL

IDEAL_NAME = "ideal: prefill of the new tokens + KV pull"
LIMIT_NAME = "limit: pd-nocache / ideal"


def ttft_vs_prefix(stats: pd.DataFrame, ideal: pd.DataFrame | None = None,
                   x_title: str = "prefix tokens per conversation") -> go.Figure:
    """Mean (left) and p90 (right) TTFT against the swept prefix length, one line per mode, and
    the ideal (dashed black) where known.

    `stats`: ``analysis.sweep_stats.point_stats`` (prefix_tokens, mode, turns, ttft_mean_s,
    ttft_p90_s); `ideal`: ``analysis.sweep_stats.ideal_stats`` (prefix_tokens, ideal_mean_s,
    ideal_p90_s). Drawn in ms.
    """
    if stats.empty:
        return empty_figure("no ok turns in this sweep")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean TTFT", "p90 TTFT"), horizontal_spacing=0.08)
    for mode in ordered_present(stats["mode"], MODE_ORDER):
        g = stats[stats["mode"] == mode].sort_values("prefix_tokens")
        for col, stat in ((1, "mean"), (2, "p90")):
            fig.add_trace(go.Scatter(
                x=g["prefix_tokens"], y=g[f"ttft_{stat}_s"] * 1e3, mode="lines+markers", name=mode,
                legendgroup=mode, showlegend=col == 1, line={"color": MODE_COLORS.get(mode)},
                customdata=g[["turns"]].to_numpy(),
                hovertemplate=f"{mode}<br>%{{x:,}} tokens<br>{stat} %{{y:.0f}} ms<br>%{{customdata[0]}} turns"
                              "<extra></extra>"), row=1, col=col)
    if ideal is not None and not ideal.empty:
        g = ideal.sort_values("prefix_tokens")
        for col, stat in ((1, "mean"), (2, "p90")):
            fig.add_trace(go.Scatter(
                x=g["prefix_tokens"], y=g[f"ideal_{stat}_s"] * 1e3, mode="lines+markers", name=IDEAL_NAME,
                legendgroup="ideal", showlegend=col == 1, line={"color": "black", "dash": "dash"},
                marker={"symbol": "x"},
                hovertemplate=f"ideal<br>%{{x:,}} tokens<br>{stat} %{{y:.0f}} ms<extra></extra>"), row=1, col=col)
    fig.update_xaxes(title_text=x_title, rangemode="tozero")
    fig.update_yaxes(title_text="TTFT (ms)", rangemode="tozero")
    fig.update_layout(title="TTFT against prefix length, per mode (ideal dashed)", legend_title_text="mode",
                      margin={"t": 80})
    return fig


def speedup_vs_prefix(speedups: pd.DataFrame, limit: pd.DataFrame | None = None, stat: str = "mean",
                      x_title: str = "prefix tokens per conversation") -> go.Figure:
    """The speed-up ``TTFT(baseline) / TTFT(bidirectional)`` of each pair against prefix length,
    with its 95% CI as error bars, a line at 1 (no gain) and the ideal's limit (dashed).

    `speedups`: ``analysis.sweep_stats.speedups`` (pair, baseline, prefix_tokens, speedup, ci_low,
    ci_high; dimensionless); `limit`: ``analysis.sweep_stats.ideal_speedup`` (prefix_tokens, speedup).
    """
    if speedups.empty:
        return empty_figure("no point has both modes of a pair (pd-bidir-nocache/pd-nocache, pd-bidir/pd, "
                            "pd-bidir/aggregated)")
    fig = go.Figure()
    for pair, g in speedups.groupby("pair", sort=False):
        g = g.sort_values("prefix_tokens")
        hi = (g["ci_high"] - g["speedup"]).to_numpy(dtype=float)
        lo = (g["speedup"] - g["ci_low"]).to_numpy(dtype=float)
        fig.add_trace(go.Scatter(
            x=g["prefix_tokens"], y=g["speedup"], mode="lines+markers", name=str(pair),
            line={"color": MODE_COLORS.get(str(g["baseline"].iloc[0]))},
            marker={"size": 10, "color": [speedup.VERDICT_HEX[speedup.verdict_of(a, b)]
                                          for a, b in zip(g["ci_low"], g["ci_high"], strict=True)],
                    "line": {"color": MODE_COLORS.get(str(g["baseline"].iloc[0])), "width": 2}},
            error_y={"type": "data", "symmetric": False, "array": np.nan_to_num(hi),
                     "arrayminus": np.nan_to_num(lo), "visible": True},
            customdata=g[["ci_low", "ci_high"]].to_numpy(),
            hovertemplate=f"{pair}<br>%{{x:,}} tokens<br>%{{y:.2f}}x (95% CI %{{customdata[0]:.2f}}-"
                          "%{customdata[1]:.2f}x)<extra></extra>"))
    if limit is not None and not limit.empty:
        g = limit.sort_values("prefix_tokens")
        fig.add_trace(go.Scatter(x=g["prefix_tokens"], y=g["speedup"], mode="lines+markers", name=LIMIT_NAME,
                                 line={"color": "black", "dash": "dash"}, marker={"symbol": "x"},
                                 hovertemplate="limit<br>%{x:,} tokens<br>%{y:.2f}x<extra></extra>"))
    fig.add_hline(y=1.0, line={"color": NEUTRAL, "dash": "dot"}, annotation_text="no gain",
                  annotation_position="bottom left")
    fig.update_xaxes(title_text=x_title, rangemode="tozero")
    fig.update_yaxes(title_text=f"speed-up of {stat} TTFT (x)", rangemode="tozero")
    fig.update_layout(title=f"Speed-up of {stat} TTFT: baseline / bidirectional, 95% CI (above 1: faster; "
                            "marker green: CI above 1, red: below, grey: includes 1)",
                      legend_title_text="bidirectional vs baseline", margin={"t": 60})
    return fig
