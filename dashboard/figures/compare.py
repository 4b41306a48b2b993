"""The Compare page's figures: the speed-up by turn index and the favourable/unfavourable cases.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis import speedup
from dashboard.figures.common import empty_figure
from dashboard.palette import AB_COLORS, NEUTRAL, NEUTRAL_DARK, side_colors


def compare_by_turn(df: pd.DataFrame, a_name: str, b_name: str) -> go.Figure:
    """The speed-up B / A of median TTFTs by turn index (``analysis.speedup``: above 1, A is
    faster), with its bootstrap 95% CI as error bars, each point coloured by its verdict, and a
    line at 1 (no difference).

    `df`: ``analysis.compare.ratio_by_turn`` (turn_index, n_a, n_b, median_a_s, median_b_s,
    ratio A / B, ci_low, ci_high; CI NaN when a side has fewer than 2 turns).
    """
    if df.empty:
        return empty_figure("no turn index has ok turns on both sides")
    d = df.sort_values("turn_index")
    up = 1 / d["ratio"]
    lo, hi = 1 / d["ci_high"], 1 / d["ci_low"]
    verdicts = [speedup.verdict_of(a, b) for a, b in zip(lo, hi, strict=True)]
    fig = go.Figure(
        go.Scatter(
            x=d["turn_index"],
            y=up,
            mode="lines+markers",
            name=f"{speedup.LABEL} {b_name} / {a_name}",
            line={"color": NEUTRAL},
            marker={"color": [speedup.VERDICT_HEX[v] for v in verdicts], "size": 10},
            error_y={
                "type": "data",
                "symmetric": False,
                "array": (hi - up).to_numpy(),
                "arrayminus": (up - lo).to_numpy(),
                "color": NEUTRAL,
            },
            customdata=np.column_stack(
                [d["median_a_s"] * 1e3, d["median_b_s"] * 1e3, d["n_a"], d["n_b"], lo, hi, [v.value for v in verdicts]]
            ),
            hovertemplate="turn %{x}: %{y:.2f}x (CI %{customdata[4]:.2f}-%{customdata[5]:.2f}x, "
            "%{customdata[6]})<br>median A %{customdata[0]:.1f} vs B %{customdata[1]:.1f} ms, "
            "n = %{customdata[2]} vs %{customdata[3]}<extra></extra>",
        )
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color=NEUTRAL_DARK, annotation_text="no difference")
    fig.update_xaxes(title_text="turn index (0 = first turn)", dtick=1 if d["turn_index"].max() <= 20 else None)
    fig.update_yaxes(title_text=f"{speedup.LABEL}: TTFT {b_name} / {a_name} (medians)", rangemode="tozero")
    fig.update_layout(
        title=f"{speedup.LABEL.capitalize()} of A by turn index, 95% bootstrap CI (green: faster, red: slower, "
        "grey: undecided)",
        showlegend=False,
        margin={"t": 60},
    )
    return fig


#: Neutral side colours (``dashboard.palette.AB_COLORS``), used unless each side is one mode of its own.
CASE_COLORS = AB_COLORS


def compare_cases(df: pd.DataFrame, a_name: str, b_name: str, a_mode: str | None = None,
                  b_mode: str | None = None) -> go.Figure:
    """Median TTFT (ms) of A and B side by side for each favourable and unfavourable case.

    `df`: ``analysis.compare.case_table`` (case, side ``A``|``B``, turns, ttft_p50_s), cases
    in display order. Each side in its mode's colour when `a_mode` and `b_mode` are two different
    modes, else in the neutral A/B colours (``dashboard.palette.side_colors``).
    """
    colors = side_colors(a_mode, b_mode)
    if df.empty:
        return empty_figure("no later turns on either side")
    fig = go.Figure()
    for side, name in (("A", a_name), ("B", b_name)):
        g = df[df["side"] == side]
        fig.add_trace(
            go.Bar(
                x=g["case"],
                y=g["ttft_p50_s"] * 1e3,
                name=f"{side}: {name}",
                marker_color=colors[side],
                customdata=g[["turns"]].to_numpy(),
                hovertemplate=f"{name}<br>%{{x}}: %{{y:.1f}} ms (median of %{{customdata[0]}} turns)<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        title="Favourable vs unfavourable turns (turn index >= 1)",
        xaxis_title="case",
        yaxis_title="TTFT p50 (ms)",
        margin={"t": 60},
    )
    return fig
