"""Plotly figures for the dashboard: pure functions, DataFrame in, `go.Figure` out.

Inputs use the store's units (seconds, tokens); latencies are drawn in milliseconds and every
axis title carries its unit. Colours are fixed per serving mode and per reuse outcome so the same
thing looks the same on every chart. An empty input gives an empty figure that says so.
"""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

#: Serving modes in display order (DESIGN §2); unknown modes sort after these.
MODE_ORDER = ["aggregated", "pd", "pd-bidir", "pd-nocache", "pd-bidir-nocache", "attach"]
MODE_COLORS = {
    "aggregated": "#4c4c4c",
    "pd": "#1f77b4",
    "pd-bidir": "#2ca02c",
    "pd-nocache": "#ff7f0e",
    "pd-bidir-nocache": "#9467bd",
    "attach": "#8c564b",
}
#: Reuse outcomes of the proxy (DESIGN §3), hit first.
OUTCOME_ORDER = [
    "hit",
    "miss_first_turn",
    "miss_no_session_id",
    "miss_expired",
    "miss_consumed",
    "miss_mismatch",
    "miss_below_threshold",
    "miss_transfer_failed",
    "miss_no_handle_returned",
    "not recorded",
]
OUTCOME_COLORS = {
    "hit": "#2ca02c",
    "miss_first_turn": "#aec7e8",
    "miss_no_session_id": "#c49c94",
    "miss_expired": "#ffbb78",
    "miss_consumed": "#f7b6d2",
    "miss_mismatch": "#d62728",
    "miss_below_threshold": "#dbdb8d",
    "miss_transfer_failed": "#8c564b",
    "miss_no_handle_returned": "#ff7f0e",
    "not recorded": "#c7c7c7",
}


def _ordered(values: pd.Series, order: list[str]) -> list[str]:
    present = [str(v) for v in pd.unique(values.dropna())]
    return [v for v in order if v in present] + sorted(v for v in present if v not in order)


def empty_figure(message: str) -> go.Figure:
    """A blank figure carrying `message` in its middle."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=260, margin={"l": 10, "r": 10, "t": 30, "b": 10})
    return fig


def _group_label(df: pd.DataFrame) -> pd.Series:
    workload = df["workload"].astype(object).where(df["workload"].notna(), "unnamed")
    history = df["history_mode"].astype(object).where(df["history_mode"].notna(), "?")
    return workload.astype(str) + " · history " + history.astype(str)


def ttft_by_turn(df: pd.DataFrame) -> go.Figure:
    """TTFT p50 (solid) and p90 (dashed) by turn index, one colour per mode.

    `df`: one row per (mode, turn_index[, workload, history_mode]) with ttft_p50_s and
    ttft_p90_s in seconds (``dashboard.queries.ttft_by_turn``). Drawn in ms. When the rows span
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
        long["group"] = _group_label(long)
        if long["group"].nunique() > 1:
            facet = "group"
    long = long.sort_values(["mode", "percentile", "turn_index"])
    fig = px.line(
        long,
        x="turn_index",
        y="ttft_ms",
        color="mode",
        line_dash="percentile",
        markers=True,
        facet_col=facet,
        category_orders={"mode": _ordered(long["mode"], MODE_ORDER), "percentile": ["p50", "p90"]},
        color_discrete_map=MODE_COLORS,
        hover_data={"turns": True} if "turns" in long.columns else None,
        labels={"turn_index": "turn index (0 = first turn)", "ttft_ms": "TTFT (ms)", "turns": "turns"},
        title="TTFT by turn index (p50 solid, p90 dashed)",
    )
    # One tick per turn while that stays readable.
    fig.update_xaxes(dtick=1 if long["turn_index"].max() <= 20 else None, rangemode="tozero")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(legend_title_text="mode, percentile", margin={"t": 60})
    return fig


def reuse_outcomes(df: pd.DataFrame) -> go.Figure:
    """Stacked bars: turns per mode split by the proxy's reuse outcome.

    `df`: columns mode, reuse, turns (count) (``dashboard.queries.reuse_outcomes``).
    """
    if df.empty:
        return empty_figure("no turns in the selected runs")
    fig = px.bar(
        df,
        x="mode",
        y="turns",
        color="reuse",
        category_orders={
            "mode": _ordered(df["mode"], MODE_ORDER),
            "reuse": _ordered(df["reuse"], OUTCOME_ORDER),
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
    (cumulative) (``dashboard.queries.external_kv_tokens``). Steps, since a counter only moves
    at scrapes.
    """
    if df.empty:
        return empty_figure("no prefill samples of prompt_tokens_by_source{external_kv_transfer}")
    d = df.copy()
    # Two runs may share a label; the run id keeps their lines apart.
    dup = d.groupby("run_label")["run_id"].transform("nunique") > 1
    d["run"] = d["run_label"].where(~dup, d["run_label"] + " (" + d["run_id"] + ")")
    d["run"] = d["run"] + " · " + d["mode"].astype(str)
    fig = px.line(
        d,
        x="elapsed_s",
        y="tokens",
        color="run",
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
