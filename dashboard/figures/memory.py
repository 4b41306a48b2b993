"""The Memory page's figures: KV usage and handle bytes next to the hit rate, the TTL what-if, and
expired and failed pulls.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from core.contract import MISS_EXPIRED, MISS_TRANSFER_FAILED, Role
from core.modes import PD_BIDIR
from dashboard.figures.common import empty_figure, legend_below, log_ticks, run_colors
from dashboard.palette import ALARM, NEUTRAL, NEUTRAL_DARK, OUTCOME_COLORS, mode_color
from store import hit_rate


def _run_names(df: pd.DataFrame) -> pd.Series:
    dup = df.groupby("run_label")["run_id"].transform("nunique") > 1
    name = df["run_label"].where(~dup, df["run_label"] + " (" + df["run_id"] + ")")
    return name + " · " + df["mode"].astype(str)


ROLE_DASHES = {Role.DECODE: "solid", Role.PREFILL: "dash", Role.AGGREGATED: "dot"}


def _hit_rate_title(hits: pd.DataFrame) -> str:
    """The hit-rate panel's title, with its window: the later turns sent in each time bucket."""
    widths = sorted({round(float(w), 1) for w in hits.get("bucket_s", pd.Series(dtype=float)).dropna()})
    if not widths:
        return "reuse hit rate of later turns"
    window = f"{widths[0]:g} s" if len(widths) == 1 else f"{widths[0]:g}-{widths[-1]:g} s"
    return f"reuse hit rate of the later turns sent in each {window} window"


def memory_timeline(mem: pd.DataFrame, hits: pd.DataFrame) -> go.Figure:
    """KV usage of P and D (%), the proxy's live handle bytes (MiB) and the reuse hit rate (%)
    over time since each run started, one colour per run, in three stacked panels.

    `mem`: ``store.queries.memory_timeline`` (run_id, run_label, mode, role, name,
    elapsed_s, value: usage 0..1 or bytes). `hits`: ``store.queries.hit_rate_timeline``
    (run_id, run_label, mode, elapsed_s, later_turns, hits, hit_rate 0..1).
    """
    if mem.empty and hits.empty:
        return empty_figure("no KV-usage or handle scrapes and no proxy outcomes in the selection")
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=[
            "KV cache usage (vllm:kv_cache_usage_perc), D solid, P dashed",
            "KV held for live handles (turnscope_handle_bytes_live)",
            _hit_rate_title(hits),
        ],
    )
    names = pd.concat([mem[["run_id", "run_label", "mode"]], hits[["run_id", "run_label", "mode"]]]).drop_duplicates(
        "run_id"
    )
    colors = run_colors(names.set_index("run_id")["mode"])
    names = names.assign(name=_run_names(names)).set_index("run_id")["name"]
    legend_done: set[str] = set()

    def add(x, y, run_id, row, dash="solid", suffix="", hover=""):
        name = names[run_id]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                name=name,
                legendgroup=run_id,
                showlegend=run_id not in legend_done,
                mode="lines",
                line={"color": colors[run_id], "dash": dash, "shape": "hv"},
                hovertemplate=f"{name}{suffix}<br>%{{x:.0f}} s: %{{y:.1f}}{hover}<extra></extra>",
            ),
            row=row,
            col=1,
        )
        legend_done.add(run_id)

    usage = mem[mem["name"] != "turnscope_handle_bytes_live"] if not mem.empty else mem
    for (run_id, role), g in usage.groupby(["run_id", "role"], sort=True) if not usage.empty else []:
        g = g.sort_values("elapsed_s")
        add(g["elapsed_s"], g["value"] * 100, run_id, 1, ROLE_DASHES.get(role, "dashdot"), f" · {role}", " %")
    handles = mem[mem["name"] == "turnscope_handle_bytes_live"] if not mem.empty else mem
    for run_id, g in handles.groupby("run_id", sort=True) if not handles.empty else []:
        g = g.sort_values("elapsed_s")
        add(g["elapsed_s"], g["value"] / 2**20, run_id, 2, suffix=" · handles", hover=" MiB")
    for run_id, g in hits.groupby("run_id", sort=True) if not hits.empty else []:
        g = g.sort_values("elapsed_s")
        add(g["elapsed_s"], g["hit_rate"] * 100, run_id, 3, suffix=" · hit rate", hover=" %")
    for row, rows, what in ((1, usage, "vllm:kv_cache_usage_perc"), (2, handles, "turnscope_handle_bytes_live"),
                            (3, hits, "later turns with a proxy outcome")):
        if rows.empty:  # said in the panel itself, not left as an empty frame
            fig.add_annotation(text=f"no {what} in the selected runs", xref="x domain", yref="y domain", x=0.5,
                               y=0.5, showarrow=False, font={"color": NEUTRAL}, row=row, col=1)
    fig.update_yaxes(title_text="KV usage (%)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="handle KV (MiB)", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="hit rate (%)", range=[0, 105], row=3, col=1)
    fig.update_xaxes(title_text="time since run start (s)", row=3, col=1)
    fig.update_layout(title="Memory next to reuse", legend_title_text="run · mode", height=720, margin={"t": 80})
    return fig


MiB = 2**20


def whatif_totals(df: pd.DataFrame) -> pd.DataFrame:
    """``planner.recorded_whatif.whatif_ttl_d_limit`` rows (one per run and TTL) summed per mode and TTL
    (modes are never pooled, ``store.hit_rate``): mode, ttl_s, later_turns, hits, lost_hits,
    held_gib_s (sums over the mode's runs), runs, runs_over (runs whose held KV would exceed their D's
    space at that TTL: demand_peak_bytes > capacity_bytes). Rows without a mode count as ``pd-bidir``."""
    d = df if "mode" in df else df.assign(mode=PD_BIDIR)
    over = (d["demand_peak_bytes"] > d["capacity_bytes"]).astype(int)
    return (d.assign(runs_over=over, runs=1)
            .groupby(["mode", "ttl_s"], as_index=False)[["later_turns", "hits", "lost_hits", "held_gib_s", "runs",
                                                          "runs_over"]]
            .sum().sort_values(["mode", "ttl_s"]))


def whatif_ttl(df: pd.DataFrame, current_ttls_s: list[float] | None = None) -> go.Figure:
    """What each ``decoder_kv_blocks_ttl`` would have given with D's KV space as the limit, in three
    full-width panels over the TTL (log axis), the runs' configured TTLs marked: per mode, the hit
    rate of later turns (%, solid; dotted: the share lost because D was full) and the KV held (GiB x s,
    summed over the mode's runs), each in its mode's colour; and per run the peak KV held pinned (MiB:
    solid within D's space, dotted what the TTL would ask with no limit) with D's KV space as a dashed
    line, red crosses where the demand exceeds it.

    `df`: ``planner.recorded_whatif.whatif_ttl_d_limit`` (run_id, run_label, mode, ttl_s, later_turns, hits,
    lost_hits, held_gib_s, peak_held_bytes, demand_peak_bytes, capacity_bytes).
    """
    if df.empty or not (df["later_turns"] > 0).any():
        return empty_figure("no later turns to replay in the selection")
    tot = whatif_totals(df)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[
        f"{hit_rate.LABEL} per mode (dotted: lost because D was full)", "KV held pinned on D (GiB x s) per mode",
        "peak KV held pinned on D, per run (dotted: with no limit), D's KV space dashed"])
    for mode, g in tot.groupby("mode", sort=False):
        color = mode_color(mode)
        rate = hit_rate.rate(g["hits"], g["later_turns"]) * 100
        lost = hit_rate.rate(g["lost_hits"], g["later_turns"]) * 100
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=rate, name=f"{mode} · hit rate", mode="lines+markers",
                                 line={"color": color}, legendgroup=f"mode-{mode}",
                                 hovertemplate=f"{mode}<br>TTL %{{x:.0f}} s: %{{y:.1f}} % of later turns hit"
                                               "<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=lost, name=f"{mode} · lost: D full", mode="lines+markers",
                                 line={"color": color, "dash": "dot"}, marker={"symbol": "x"},
                                 legendgroup=f"mode-{mode}",
                                 hovertemplate=f"{mode}<br>TTL %{{x:.0f}} s: %{{y:.1f}} % of later turns found "
                                               "their handle lost (D full)<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=g["held_gib_s"], name=f"{mode} · KV held (GiB x s)",
                                 mode="lines+markers", line={"color": color}, legendgroup=f"mode-{mode}",
                                 showlegend=False,
                                 hovertemplate=f"{mode}<br>TTL %{{x:.0f}} s: %{{y:.4g}} GiB x s<extra></extra>"),
                      row=2, col=1)
    runs = df.drop_duplicates("run_id").assign(run_label=lambda d: d["run_label"].fillna(d["run_id"]))
    if "mode" not in runs:
        runs = runs.assign(mode=PD_BIDIR)
    colors = run_colors(runs.set_index("run_id")["mode"])
    names = runs.assign(name=_run_names(runs)).set_index("run_id")["name"]
    for run_id, g in df.groupby("run_id", sort=True):
        g = g.sort_values("ttl_s")
        name, color = names[run_id], colors[run_id]
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=g["peak_held_bytes"] / MiB, name=name, legendgroup=run_id,
                                 mode="lines+markers", line={"color": color},
                                 hovertemplate=f"{name}<br>TTL %{{x:.0f}} s: peak %{{y:.1f}} MiB<extra></extra>"),
                      row=3, col=1)
        fig.add_trace(go.Scatter(x=g["ttl_s"], y=g["demand_peak_bytes"] / MiB, name=f"{name}: no limit",
                                 legendgroup=run_id, showlegend=False, mode="lines", line={"color": color, "dash": "dot"},
                                 hovertemplate=f"{name}<br>TTL %{{x:.0f}} s: %{{y:.1f}} MiB asked with no limit"
                                               "<extra></extra>"), row=3, col=1)
        cap = g["capacity_bytes"].dropna()
        if not cap.empty:
            fig.add_trace(go.Scatter(x=g["ttl_s"], y=np.full(len(g), float(cap.iloc[0]) / MiB),
                                     name=f"{name}: D's KV space", legendgroup=run_id, showlegend=False,
                                     mode="lines", line={"color": color, "dash": "dash", "width": 1},
                                     hovertemplate=f"{name}<br>D's KV space %{{y:.1f}} MiB<extra></extra>"),
                          row=3, col=1)
            over = g[g["demand_peak_bytes"] > g["capacity_bytes"]]
            if not over.empty:
                fig.add_trace(go.Scatter(x=over["ttl_s"], y=over["demand_peak_bytes"] / MiB,
                                         name="exceeds D's KV space", legendgroup="over", mode="markers",
                                         marker={"symbol": "x", "size": 11, "color": ALARM},
                                         hovertemplate=f"{name}<br>TTL %{{x:.0f}} s: %{{y:.1f}} MiB would exceed "
                                                       "D's KV space<extra></extra>"), row=3, col=1)
    for ttl in sorted(set(current_ttls_s or [])):
        fig.add_vline(x=ttl, line_dash="dot", line_color=NEUTRAL_DARK)
        # On a log axis an annotation's x is log10 of the value (add_vline's own label would not be).
        fig.add_annotation(x=float(np.log10(ttl)), y=1.035, xref="x", yref="paper", text=f"configured {ttl:g} s",
                           showarrow=False, yanchor="bottom", font={"size": 11})
    ticks = sorted(set(tot["ttl_s"].tolist()))
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    fig.update_xaxes(title_text="decoder_kv_blocks_ttl (s, log scale)", row=3, col=1)
    fig.update_yaxes(title_text="% of later turns", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="GiB x s", rangemode="tozero", row=2, col=1)
    # log scale: D's space (GiB) and the peaks (often MiB) on one axis, runs of any size side by side
    mib = pd.concat([df["peak_held_bytes"], df["demand_peak_bytes"], df["capacity_bytes"]]) / MiB
    vals, texts = log_ticks(mib)
    fig.update_yaxes(title_text="MiB (log scale)", type="log", tickvals=vals, ticktext=texts, row=3, col=1)
    fig.update_layout(title="What if the TTL were different? (recorded turns replayed, D's KV space the limit)",
                      height=820, margin={"t": 90}, legend={"orientation": "h", "y": -0.08})
    return fig


#: The bars of :func:`nixl_failures`: (column of ``store.queries.nixl_failures``, legend name,
#: colour); the proxy's outcomes in their outcome colours, vLLM's counters in shades of them.
NIXL_FAILURE_BARS = (
    ("expired_turns", "proxy: miss_expired (handle held back by its margin)", OUTCOME_COLORS[MISS_EXPIRED]),
    ("p_kv_expired_reqs", "P, vLLM: KV expired (read declined past D's deadline)", "#fdae6b"),
    ("transfer_failed_turns", "proxy: miss_transfer_failed (offered, not pulled)", OUTCOME_COLORS[MISS_TRANSFER_FAILED]),
    ("p_failed_transfers", "P, vLLM: failed transfers", "#cb181d"),
    ("d_kv_expired_reqs", "D, vLLM: KV expired (handles no P pulled within its TTL)", NEUTRAL),
)


def nixl_failures(df: pd.DataFrame) -> go.Figure:
    """Expired and failed pulls per run, horizontal bars in requests: the proxy's ``miss_expired``
    and ``miss_transfer_failed`` turns beside vLLM's NIXL counters on P (KV expired: reads P
    declined as past D's deadline; failed transfers) and D's expired handles. A run's bar is absent
    where the counter was not scraped (NaN), 0 where it stayed flat.

    `df`: ``store.queries.nixl_failures``.
    """
    if df.empty:
        return empty_figure("no runs with a proxy outcome or a NIXL counter in the selection")
    names = _run_names(df)
    fig = go.Figure()
    for col, label, color in NIXL_FAILURE_BARS:
        fig.add_bar(y=names, x=df[col].astype(float), name=label, orientation="h", marker_color=color,
                    hovertemplate="%{y}: %{x:,.0f} " + label + "<extra></extra>")
    # the unit in the title, not as the x axis's title: the legend band below the plot covers that
    fig.update_layout(title="Expired and failed pulls per run (requests)", barmode="group",
                      height=max(300, 100 + 28 * len(df) * len(NIXL_FAILURE_BARS)),
                      margin={"l": 10, "r": 10, "t": 60, "b": 10})
    fig.update_xaxes(rangemode="tozero")
    fig.update_yaxes(autorange="reversed")
    return legend_below(fig)
