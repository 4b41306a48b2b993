"""The Turns page's figures: latency panels, where each turn's time went, expected vs measured reuse.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.figures.common import (
    MODE_ORDER,
    OUTCOME_ORDER,
    OUTCOME_SYMBOLS,
    empty_figure,
    legend_below,
    ordered_present,
    turn_axis,
)
from dashboard.palette import TIME_COLORS, mode_color

LATENCY_METRICS = (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50"), ("e2e_p50_s", "E2E p50"))


def latency_panels(df: pd.DataFrame, by: str = "turn_index") -> go.Figure:
    """Median TTFT, ITL and E2E (three panels, ms) against turn index or prompt length.

    `df`: ``store.queries.latency_by`` (mode, reuse, x, turns, ttft_p50_s, itl_p50_s,
    e2e_p50_s in seconds). `by`: ``turn_index`` or ``history`` (x is then the lower edge of a
    prompt-length bin, tokens). Colour is the mode (`MODE_COLORS`, as on every page), the marker
    the reuse outcome (`OUTCOME_SYMBOLS`); one legend entry per (mode, outcome).
    """
    if df.empty:
        return empty_figure("no ok turns in the selection")
    x_title = "turn index (0 = first turn)" if by == "turn_index" else "prompt length (tokens, history included)"
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in LATENCY_METRICS], horizontal_spacing=0.07)
    modes = ordered_present(df["mode"], MODE_ORDER)
    outcomes = ordered_present(df["reuse"], OUTCOME_ORDER)
    for mode in modes:
        for outcome in outcomes:
            g = df[(df["reuse"] == outcome) & (df["mode"] == mode)].sort_values("x")
            if g.empty:
                continue
            name = f"{mode} · {outcome}"
            for col, (metric, _) in enumerate(LATENCY_METRICS, start=1):
                fig.add_trace(
                    go.Scatter(
                        x=g["x"],
                        y=g[metric] * 1e3,
                        name=name,
                        legendgroup=name,
                        showlegend=col == 1,
                        mode="lines+markers",
                        line={"color": mode_color(mode), "width": 1.5},
                        marker={"symbol": OUTCOME_SYMBOLS.get(outcome, "circle"), "size": 9,
                                "color": mode_color(mode), "line": {"width": 1.5}},
                        customdata=g[["turns"]].to_numpy(),
                        hovertemplate=f"{name}<br>x=%{{x}}<br>%{{y:.1f}} ms<br>%{{customdata[0]}} turns<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
    if by == "turn_index":
        turn_axis(fig, df["x"].max(), title_text=x_title)
    else:
        fig.update_xaxes(title_text=x_title, rangemode="tozero")
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(title_text="median (ms)", col=1)
    fig.update_layout(
        title="Latency by " + ("turn index" if by == "turn_index" else "history length")
        + " (colour: mode; marker: reuse outcome)",
        legend_title_text="mode · reuse outcome",
        margin={"t": 80},
    )
    return legend_below(fig, height=460 + 22 * ((len(modes) * len(outcomes)) // 4))


#: Parts of a turn's time, in stacking order, with their colours.
TIME_PARTS = (
    ("proxy_s", "proxy, queue, D's first token", TIME_COLORS["proxy"]),
    ("prefill_s", "prefill leg (compute)", TIME_COLORS["prefill"]),
    ("kv_transfer_est_s", "KV transfer from D (estimate)", TIME_COLORS["transfer"]),
    ("unsplit_ttft_s", "to first token (no proxy: not split)", TIME_COLORS["unsplit"]),
    ("decode_s", "decode (after first token)", TIME_COLORS["decode"]),
)


def time_split(df: pd.DataFrame) -> go.Figure:
    """Where each turn's time went: stacked bars of mean ms per turn, by turn index, one panel
    per mode.

    `df`: ``store.queries.time_split`` (mode, turn_index, turns and the parts in seconds:
    proxy_s, prefill_s, kv_transfer_est_s, unsplit_ttft_s, decode_s). A bar's height is the
    mean E2E of its turns.
    """
    if df.empty:
        return empty_figure("no ok turns with a TTFT and an E2E in the selection")
    modes = ordered_present(df["mode"], MODE_ORDER)
    fig = make_subplots(rows=1, cols=len(modes), subplot_titles=modes, shared_yaxes=True, horizontal_spacing=0.03)
    for col, mode in enumerate(modes, start=1):
        g = df[df["mode"] == mode].sort_values("turn_index")
        for part, label, color in TIME_PARTS:
            if part not in g or not (g[part].fillna(0) > 0).any():
                continue
            fig.add_trace(
                go.Bar(
                    x=g["turn_index"],
                    y=g[part] * 1e3,
                    name=label,
                    legendgroup=label,
                    showlegend=not any(t.name == label for t in fig.data),
                    marker_color=color,
                    customdata=g[["turns"]].to_numpy(),
                    hovertemplate=f"{mode} · {label}<br>turn %{{x}}: %{{y:.1f}} ms (mean of %{{customdata[0]}} turns)"
                    "<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="turn index", row=1, col=col, dtick=1 if g["turn_index"].max() <= 20 else None)
    fig.update_yaxes(title_text="mean time per turn (ms)", col=1)
    fig.update_layout(
        barmode="stack",
        title="Where each turn's time went (mean per turn; KV transfer is an estimate)",
        legend_title_text="part",
        margin={"t": 80},
        height=420,
    )
    return fig


#: Relative difference beyond which a mode's expected reuse gets its own line.
EXPECTED_APART = 0.05


def reuse_vs_expected(df: pd.DataFrame) -> go.Figure:
    """Measured reused tokens per later turn by turn index, one colour per mode (solid), against
    what was expected (black, dashed).

    `df`: ``store.queries.reuse_vs_expected`` (mode, turn_index, turns, expected_tokens,
    measured_tokens: mean tokens per turn). The modes replay the same sessions, so their
    expectations nearly coincide: one expected line (the turn-weighted mean over modes) is drawn,
    and one per mode only where a mode's expectation differs from it by more than
    `EXPECTED_APART` (then without the shared line when no mode is left on it).
    """
    if df.empty:
        return empty_figure("no later turns with expected and measured reuse in the selection")
    fig = go.Figure()
    w = df.assign(_w=df["expected_tokens"] * df["turns"])
    pooled = w.groupby("turn_index", sort=True).agg(_w=("_w", "sum"), turns=("turns", "sum")).reset_index()
    pooled["expected_tokens"] = pooled["_w"] / pooled["turns"]
    ref = pooled.set_index("turn_index")["expected_tokens"]
    apart = [
        m for m, g in df.groupby("mode")
        if not np.allclose(g["expected_tokens"], ref.loc[g["turn_index"]].to_numpy(), rtol=EXPECTED_APART)
    ]  # fmt: skip
    shared = len(apart) < df["mode"].nunique()
    if shared:
        fig.add_trace(go.Scatter(
            x=pooled["turn_index"], y=pooled["expected_tokens"], name="expected" + (" (other modes)" if apart else ""),
            mode="lines+markers", line={"color": "black", "dash": "dash"}, marker={"symbol": "line-ew-open", "size": 12},
            customdata=pooled[["turns"]].to_numpy(),
            hovertemplate="expected<br>turn %{x}: %{y:.0f} tokens (mean of %{customdata[0]})<extra></extra>",
        ))  # fmt: skip
    for mode in ordered_present(df["mode"], MODE_ORDER):
        g = df[df["mode"] == mode].sort_values("turn_index")
        color = mode_color(mode)
        parts = [("measured_tokens", "measured", "solid")] + ([("expected_tokens", "expected", "dash")]
                                                              if mode in apart else [])
        for col, label, dash in parts:
            fig.add_trace(
                go.Scatter(
                    x=g["turn_index"],
                    y=g[col],
                    name=f"{mode}, {label}",
                    mode="lines+markers",
                    line={"color": color, "dash": dash},
                    customdata=g[["turns"]].to_numpy(),
                    hovertemplate=f"{mode} {label}<br>turn %{{x}}: %{{y:.0f}} tokens (mean of %{{customdata[0]}})"
                    "<extra></extra>",
                )
            )
    turn_axis(fig, df["turn_index"].max(), df["turn_index"].min(), title_text="turn index")
    fig.update_yaxes(title_text="reused prompt tokens per turn (mean)", rangemode="tozero")
    fig.update_layout(title="Expected vs measured reuse", legend_title_text="mode, reuse", margin={"t": 60})
    return legend_below(fig)
