"""The Overview page's figures: TTFT by turn index, reuse outcomes per mode, P's external KV tokens.
"""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dashboard.figures.common import (
    MODE_COLORS,
    MODE_ORDER,
    OUTCOME_COLORS,
    OUTCOME_ORDER,
    empty_figure,
    legend_below,
    ordered_present,
    run_colors,
    turn_axis,
    zero_based,
)


def _group_label(df: pd.DataFrame) -> pd.Series:
    workload = df["workload"].astype(object).where(df["workload"].notna(), "unnamed")
    history = df["history_mode"].astype(object).where(df["history_mode"].notna(), "?")
    return workload.astype(str) + " · history " + history.astype(str)


def ttft_by_turn(df: pd.DataFrame) -> go.Figure:
    """TTFT p50 (solid) and p90 (dashed) by turn index, one colour per mode.

    `df`: one row per (mode, turn_index[, workload, history_mode]) with ttft_p50_s and
    ttft_p90_s in seconds (``store.queries.ttft_by_turn``). Drawn in ms. When the rows span
    more than one (workload, history_mode), each gets its own panel.
    """
    if df.empty:
        return empty_figure("no ok turns with a TTFT in the selected runs")
    long = df.melt(
        id_vars=[c for c in df.columns if c not in ("ttft_p50_s", "ttft_p90_s")],
        value_vars=["ttft_p50_s", "ttft_p90_s"],
        var_name="percentile",
        value_name="ttft_s",
    )
    long["percentile"] = long["percentile"].map({"ttft_p50_s": "p50", "ttft_p90_s": "p90"})
    long["ttft_ms"] = long["ttft_s"] * 1e3
    facet = None
    if {"workload", "history_mode"} <= set(long.columns):
        long["workload · history"] = _group_label(long)
        if long["workload · history"].nunique() > 1:
            facet = "workload · history"
    long = long.sort_values(["mode", "percentile", "turn_index"])
    fig = px.line(
        long,
        x="turn_index",
        y="ttft_ms",
        color="mode",
        line_dash="percentile",
        markers=True,
        facet_col=facet,
        category_orders={"mode": ordered_present(long["mode"], MODE_ORDER), "percentile": ["p50", "p90"]},
        color_discrete_map=MODE_COLORS,
        hover_data={"turns": True} if "turns" in long.columns else None,
        labels={"turn_index": "turn index (0 = first turn)", "ttft_ms": "TTFT (ms)", "turns": "turns"},
        title="TTFT by turn index (p50 solid, p90 dashed)",
        facet_col_spacing=0.06,
    )
    # Facet titles in words ("w · history text"), not plotly's "column=value".
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    turn_axis(fig, long["turn_index"].max())
    fig.update_yaxes(range=zero_based(long["ttft_ms"]))
    fig.update_layout(legend_title_text="mode, percentile", margin={"t": 60})
    return legend_below(fig)


def reuse_outcomes(df: pd.DataFrame) -> go.Figure:
    """Stacked bars: turns per mode split by the proxy's reuse outcome.

    `df`: columns mode, reuse, turns (count) (``store.queries.reuse_outcomes``).
    """
    if df.empty:
        return empty_figure("no turns in the selected runs")
    fig = px.bar(
        df,
        x="mode",
        y="turns",
        color="reuse",
        category_orders={
            "mode": ordered_present(df["mode"], MODE_ORDER),
            "reuse": ordered_present(df["reuse"], OUTCOME_ORDER),
        },
        color_discrete_map=OUTCOME_COLORS,
        labels={"mode": "serving mode", "turns": "turns (count)", "reuse": "reuse outcome"},
        title="Reuse outcome per mode",
    )
    fig.update_layout(barmode="stack", margin={"t": 60})
    return fig


def external_kv_tokens(df: pd.DataFrame) -> go.Figure:
    """Cumulative prompt tokens the prefill workers pulled over KV transfer, one line per run.

    `df`: columns run_id, run_label, mode, elapsed_s (seconds since run start), tokens
    (cumulative) (``store.queries.external_kv_tokens``). Steps, since a counter only moves
    at scrapes. Each run in its mode's colour (`run_colors`).
    """
    if df.empty:
        return empty_figure("no prefill samples of prompt_tokens_by_source{external_kv_transfer}")
    d = df.copy()
    # Two runs may share a label; the run id keeps their lines apart.
    dup = d.groupby("run_label")["run_id"].transform("nunique") > 1
    d["run"] = d["run_label"].where(~dup, d["run_label"] + " (" + d["run_id"] + ")")
    d["run"] = d["run"] + " · " + d["mode"].astype(str)
    by_run = run_colors(d.drop_duplicates("run_id").set_index("run_id")["mode"])
    fig = px.line(
        d,
        x="elapsed_s",
        y="tokens",
        color="run",
        color_discrete_map={r: by_run[str(i)] for r, i in zip(d["run"], d["run_id"], strict=True)},
        line_shape="hv",
        markers=True,
        hover_data={"run_id": True, "mode": True},
        labels={
            "elapsed_s": "time since run start (s)",
            "tokens": "prompt tokens pulled from D (cumulative)",
            "run": "run · mode",
        },
        title='Prefill: vllm:prompt_tokens_by_source{source="external_kv_transfer"}',
    )
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(margin={"t": 60})
    return fig
