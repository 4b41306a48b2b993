"""The Plan page's figures (plotly), each titled as a FORECAST with its profile."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dashboard.figures.common import MODE_COLORS, legend_below
from turnscope.analysis.plan_check import frontier_highlights
from turnscope.modes import BIDIRECTIONAL_MODES, PLAN_TABLE_ORDER

#: Column order of the Plan page's tables: baselines first, then what reuse adds.
PLAN_TABLE_MODES = PLAN_TABLE_ORDER

GiB = 2**30


def outcome_table(outcomes: pd.DataFrame) -> pd.DataFrame:
    """``dashboard.queries.plan.outcomes`` (mode, outcome, requests) as outcome rows x mode columns, requests
    (0 where a mode has none of an outcome); modes in the order of ``PLAN_TABLE_MODES``."""
    wide = outcomes.pivot_table(index="outcome", columns="mode", values="requests", aggfunc="sum", fill_value=0)
    cols = [m for m in PLAN_TABLE_MODES if m in wide.columns] + sorted(c for c in wide.columns if c not in PLAN_TABLE_MODES)
    return wide[cols].astype(int).rename_axis(columns=None)


def ttft_parts_table(parts: pd.DataFrame) -> pd.DataFrame:
    """``dashboard.queries.plan.ttft_parts`` for display: modes in ``PLAN_TABLE_MODES``, seconds as
    milliseconds (rounded to 0.1 ms), the queue share as a percentage (rounded to 0.1%)."""
    order = {m: i for i, m in enumerate(PLAN_TABLE_MODES)}
    df = parts.sort_values("mode", key=lambda s: s.map(lambda m: order.get(m, len(order)))).reset_index(drop=True)
    ms = (df[["ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "queue_wait_mean_s", "queue_wait_p95_s"]] * 1000).round(1)
    return pd.DataFrame({"mode": df["mode"], "requests": df["requests"].astype(int),
                         "TTFT mean (ms)": ms["ttft_mean_s"], "TTFT p50 (ms)": ms["ttft_p50_s"],
                         "TTFT p95 (ms)": ms["ttft_p95_s"], "queue wait mean (ms)": ms["queue_wait_mean_s"],
                         "queue wait p95 (ms)": ms["queue_wait_p95_s"],
                         "queue share of TTFT (%)": (df["queue_share"] * 100).round(1)})


def secondary_table(sp: pd.DataFrame) -> pd.DataFrame:
    """``plan_speedups`` rows' secondary figures for display: mean TTFT (ms, every request), the
    mean-TTFT ratio (every request, later requests) and the queue's share of mean TTFT (%)."""
    return pd.DataFrame({"pair": sp["treatment"] + " vs " + sp["baseline"],
                         "treatment mean TTFT (ms)": (sp["treatment_ttft_mean_s"] * 1000).round(1),
                         "baseline mean TTFT (ms)": (sp["baseline_ttft_mean_s"] * 1000).round(1),
                         "mean-TTFT ratio, all requests": sp["mean_speedup"].round(2),
                         "mean-TTFT ratio, later requests": sp["later_mean_speedup"].round(2),
                         "treatment queueing (% of mean TTFT)": (sp["treatment_queue_share"] * 100).round(1),
                         "baseline queueing (% of mean TTFT)": (sp["baseline_queue_share"] * 100).round(1)})


def frontier_highlights_table(fr: pd.DataFrame) -> pd.DataFrame:
    """The frontier's rows that matter (``turnscope.analysis.plan_check.frontier_highlights``) for display:
    TTL (s), D space (GiB or unbounded), hit rate (%) with its 80% interval (blank: none), GiB-s
    pinned, peak GiB, handles lost to D full, and why the row is shown."""
    hl = frontier_highlights(fr)
    return pd.DataFrame({"mode": hl["mode"], "TTL (s)": hl["decoder_kv_blocks_ttl_s"],
                         "D KV space": hl["decode_kv_space_bytes"].map(
                             lambda b: "unbounded" if pd.isna(b) else f"{b / GiB:,.3g} GiB"),
                         "hit rate (%)": (hl["hit_rate"] * 100).round(1),
                         "80% interval (%)": [None if pd.isna(lo) else f"{lo:.1%}-{hi:.1%}" for lo, hi in
                                              zip(hl["hit_rate_interval_low"], hl["hit_rate_interval_high"],
                                                  strict=True)],
                         "pinned (GiB-s)": hl["held_gib_s"].round(1),
                         "peak pinned (GiB)": (hl["peak_held_bytes"] / GiB).round(3),
                         "lost to D full": hl["d_full_events"], "why shown": hl["why"]})


def held_out_table(held_out: dict) -> pd.DataFrame:
    """A profile's ``held_out`` (JSON: ``ttft_ratio`` and ``hit_rate_error`` per mode, each [p10,
    p90]) as one row per mode: measured / forecast TTFT p10 and p90 (rounded to 0.001), recorded
    minus forecast hit rate p10 and p90 (percentage points, 0.1; blank without handles)."""
    ratio, hit = held_out.get("ttft_ratio", {}), held_out.get("hit_rate_error", {})
    modes = [m for m in PLAN_TABLE_MODES if m in ratio] + sorted(set(ratio) - set(PLAN_TABLE_MODES))
    return pd.DataFrame({"mode": modes,
                         "measured / forecast TTFT, p10": [round(ratio[m][0], 3) for m in modes],
                         "measured / forecast TTFT, p90": [round(ratio[m][1], 3) for m in modes],
                         "hit rate error (pp), p10": [round(hit[m][0] * 100, 1) if m in hit else None for m in modes],
                         "hit rate error (pp), p90": [round(hit[m][1] * 100, 1) if m in hit else None for m in modes]})


def frontier_figure(fr: pd.DataFrame, tag: str) -> go.Figure:
    """Hit rate against GiB-seconds held per TTL x D-space point (``plan_frontier`` rows), one panel
    per mode, colour = TTL; the operator's current point ringed (a diamond)."""
    modes = [m for m in PLAN_TABLE_MODES if m in BIDIRECTIONAL_MODES and m in set(fr["mode"])]
    df = fr.assign(space=fr["decode_kv_space_bytes"].map(lambda b: "unbounded" if pd.isna(b) else f"{b / GiB:,.1f} GiB"),
                   ttl=fr["decoder_kv_blocks_ttl_s"].map(lambda t: f"{t:,.0f} s"))
    ttls = [f"{t:,.0f} s" for t in sorted(fr["decoder_kv_blocks_ttl_s"].unique())]
    fig = px.scatter(df, x="held_gib_s", y="hit_rate", color="ttl", facet_col="mode",
                     category_orders={"mode": modes, "ttl": ttls},
                     hover_data={"space": True, "ttft_saved_s": ":,.1f", "peak_held_bytes": ":,.0f",
                                 "d_full_events": True},
                     labels={"held_gib_s": "D pinned KV (GiB-s)", "hit_rate": "hit rate (later requests)",
                             "ttl": "decoder_kv_blocks_ttl", "space": "D KV space", "ttft_saved_s": "TTFT saved (s)",
                             "peak_held_bytes": "peak pinned (bytes)", "d_full_events": "handles lost to D full"},
                     title=f"{tag}: TTL x D memory frontier")
    fig.update_traces(marker={"size": 9})
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    for i, mode in enumerate(modes, start=1):
        cur = df[(df["mode"] == mode) & df["current"]]
        fig.add_trace(go.Scatter(x=cur["held_gib_s"], y=cur["hit_rate"], mode="markers", name="current setting",
                                 showlegend=i == 1, legendgroup="current",
                                 marker={"symbol": "diamond-open", "size": 18, "color": "black", "line": {"width": 2}},
                                 hovertext=[f"current: TTL {t}, D {sp}" for t, sp in zip(cur["ttl"], cur["space"], strict=True)]),
                      row=1, col=i)
    fig.update_yaxes(tickformat=".0%")
    return legend_below(fig, height=520)


def check_figure(ch: pd.DataFrame) -> go.Figure:
    """Predicted against measured TTFT of every ok turn of the checked runs, per mode, on log axes
    (TTFTs span two decades), with the line of equality and the check's +-25% band."""
    ok = ch[(ch["status"] == "ok") & ch["measured_ttft_s"].notna() & (ch["predicted_ttft_s"] > 0)]
    fig = px.scatter(ok, x="measured_ttft_s", y="predicted_ttft_s", color="mode", log_x=True, log_y=True,
                     color_discrete_map=MODE_COLORS, hover_data=["checked_run_id", "session_id", "turn_index"],
                     labels={"measured_ttft_s": "measured TTFT (s)", "predicted_ttft_s": "forecast TTFT (s)"},
                     title="Forecast against measured TTFT, recorded runs planned from their own records")
    if len(ok):
        lo = float(min(ok["measured_ttft_s"].min(), ok["predicted_ttft_s"].min())) * 0.8
        hi = float(max(ok["measured_ttft_s"].max(), ok["predicted_ttft_s"].max())) * 1.25
        for k, name, dash in ((1.0, "equal", "dot"), (1.25, "+25%", "dash"), (0.75, "-25%", "dash")):
            fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * k, hi * k], mode="lines", name=name,
                                     line={"dash": dash, "color": "grey", "width": 1}))
    fig.update_xaxes(dtick="D2")  # log axes: labels at 1, 2 and 5 of each decade, not every digit
    fig.update_yaxes(dtick="D2")
    return legend_below(fig, height=520)
