"""The Memory page's figures: KV usage and handle bytes next to the hit rate, and the TTL what-if.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.figures.common import empty_figure, run_colors


def _run_names(df: pd.DataFrame) -> pd.Series:
    dup = df.groupby("run_label")["run_id"].transform("nunique") > 1
    name = df["run_label"].where(~dup, df["run_label"] + " (" + df["run_id"] + ")")
    return name + " · " + df["mode"].astype(str)


ROLE_DASHES = {"decode": "solid", "prefill": "dash", "aggregated": "dot"}


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

    `mem`: ``dashboard.queries.memory_timeline`` (run_id, run_label, mode, role, name,
    elapsed_s, value: usage 0..1 or bytes). `hits`: ``dashboard.queries.hit_rate_timeline``
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
    fig.update_yaxes(title_text="KV usage (%)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="handle KV (MiB)", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="hit rate (%)", range=[0, 105], row=3, col=1)
    fig.update_xaxes(title_text="time since run start (s)", row=3, col=1)
    fig.update_layout(title="Memory next to reuse", legend_title_text="run · mode", height=720, margin={"t": 80})
    return fig


def whatif_ttl(df: pd.DataFrame, current_ttls_s: list[float] | None = None) -> go.Figure:
    """Hit rate (%) and KV held (GiB x s, or token x s without kv_bytes_per_token) that each
    ``decoder_kv_blocks_ttl`` would have given, with the runs' configured TTLs marked.

    `df`: ``dashboard.queries.whatif_ttl`` (ttl_s, later_turns, hits, held_token_s, held_gib_s).
    """
    if df.empty or not (df["later_turns"] > 0).any():
        return empty_figure("no later turns to replay in the selection")
    d = df.sort_values("ttl_s")
    rate = np.where(d["later_turns"] > 0, d["hits"] / d["later_turns"].where(d["later_turns"] > 0), np.nan)
    use_bytes = d["held_gib_s"].notna().all()
    held = d["held_gib_s"] if use_bytes else d["held_token_s"]
    held_title = "KV held (GiB x s)" if use_bytes else "KV held (tokens x s; kv_bytes_per_token unknown)"
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(x=d["ttl_s"], y=rate * 100, name="hit rate", mode="lines+markers", line={"color": "#2ca02c"},
                   hovertemplate="TTL %{x:.0f} s: %{y:.1f} % of later turns hit<extra></extra>"),
        secondary_y=False,
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(x=d["ttl_s"], y=held, name=held_title, mode="lines+markers", line={"color": "#9467bd", "dash": "dash"},
                   hovertemplate="TTL %{x:.0f} s: %{y:.3g}<extra></extra>"),
        secondary_y=True,
    )  # fmt: skip
    for ttl in sorted(set(current_ttls_s or [])):
        fig.add_vline(x=ttl, line_dash="dot", line_color="#4c4c4c")
        # On a log axis an annotation's x is log10 of the value (add_vline's own label would not be).
        fig.add_annotation(
            x=float(np.log10(ttl)), y=1.0, xref="x", yref="paper", text=f"configured {ttl:g} s",
            showarrow=False, yanchor="bottom", font={"size": 11},
        )  # fmt: skip
    ticks = sorted(set(d["ttl_s"].tolist()))
    fig.update_xaxes(
        title_text="decoder_kv_blocks_ttl (s, log scale)",
        type="log",
        tickvals=ticks,
        ticktext=[f"{t:g}" for t in ticks],
    )
    fig.update_yaxes(title_text="hit rate of later turns (%)", range=[0, 105], secondary_y=False)
    fig.update_yaxes(title_text=held_title, rangemode="tozero", secondary_y=True)
    fig.update_layout(title="What if the TTL were different? (replayed from the recorded gaps)", margin={"t": 60})
    return fig
