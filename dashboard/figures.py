"""Plotly figures for the dashboard: pure functions, DataFrame in, `go.Figure` out.

Inputs use the store's units (seconds, tokens); latencies are drawn in milliseconds and every
axis title carries its unit. Colours are fixed per serving mode and per reuse outcome so the same
thing looks the same on every chart. An empty input gives an empty figure that says so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard import speedup

#: Serving modes in display order (README, "What each mode compares"); unknown modes sort after these.
MODE_ORDER = ["aggregated", "pd", "pd-bidir", "pd-nocache", "pd-bidir-nocache", "attach"]
#: The one mode -> colour map: every chart that tells modes apart uses it (sweep_figures too), and
#: uses another channel (marker symbol, facet) for anything else, such as the reuse outcome.
MODE_COLORS = {
    "aggregated": "#4c4c4c",
    "pd": "#1f77b4",
    "pd-bidir": "#2ca02c",
    "pd-nocache": "#ff7f0e",
    "pd-bidir-nocache": "#9467bd",
    "attach": "#8c564b",
}
#: Reuse outcomes of the proxy (docs/schema.md, ``turns.reuse``), hit first.
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


#: Marker per reuse outcome, where colour already means the mode: filled for a hit, open for the
#: misses an operator expects (first turn), crossed and other shapes for the rest.
OUTCOME_SYMBOLS = {
    "hit": "circle",
    "miss_first_turn": "circle-open",
    "miss_no_session_id": "square-open",
    "miss_expired": "hourglass",
    "miss_consumed": "diamond-open",
    "miss_mismatch": "x",
    "miss_below_threshold": "triangle-down",
    "miss_transfer_failed": "cross",
    "miss_no_handle_returned": "square",
    "not recorded": "diamond",
}


def legend_below(fig: go.Figure, height: int | None = None) -> go.Figure:
    """Put `fig`'s legend in a horizontal band under the plot, inside the figure's own area (a
    legend on the right is clipped in narrow columns); `height` in pixels, if given."""
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.22, "xanchor": "left", "x": 0},
                      margin={"b": 40})
    if height is not None:
        fig.update_layout(height=height)
    return fig


def turn_axis(fig: go.Figure, max_turn: float, min_turn: float = 0, **kwargs) -> None:
    """A turn-index x axis from `min_turn` to `max_turn` with half a turn of room on both sides,
    so markers at the first and the last turn are drawn whole; one tick per turn up to 20 turns."""
    fig.update_xaxes(range=[float(min_turn) - 0.5, float(max_turn) + 0.5], dtick=1 if max_turn <= 20 else None,
                     **kwargs)


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
        category_orders={"mode": _ordered(long["mode"], MODE_ORDER), "percentile": ["p50", "p90"]},
        color_discrete_map=MODE_COLORS,
        hover_data={"turns": True} if "turns" in long.columns else None,
        labels={"turn_index": "turn index (0 = first turn)", "ttft_ms": "TTFT (ms)", "turns": "turns"},
        title="TTFT by turn index (p50 solid, p90 dashed)",
        facet_col_spacing=0.06,
    )
    # Facet titles in words ("w · history text"), not plotly's "column=value".
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    turn_axis(fig, long["turn_index"].max())
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(legend_title_text="mode, percentile", margin={"t": 60})
    return legend_below(fig)


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


# --- Turns --------------------------------------------------------------------------------------

LATENCY_METRICS = (("ttft_p50_s", "TTFT p50"), ("itl_p50_s", "ITL p50"), ("e2e_p50_s", "E2E p50"))


def latency_panels(df: pd.DataFrame, by: str = "turn_index") -> go.Figure:
    """Median TTFT, ITL and E2E (three panels, ms) against turn index or prompt length.

    `df`: ``dashboard.queries.latency_by`` (mode, reuse, x, turns, ttft_p50_s, itl_p50_s,
    e2e_p50_s in seconds). `by`: ``turn_index`` or ``history`` (x is then the lower edge of a
    prompt-length bin, tokens). Colour is the mode (`MODE_COLORS`, as on every page), the marker
    the reuse outcome (`OUTCOME_SYMBOLS`); one legend entry per (mode, outcome).
    """
    if df.empty:
        return empty_figure("no ok turns in the selection")
    x_title = "turn index (0 = first turn)" if by == "turn_index" else "prompt length (tokens, history included)"
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in LATENCY_METRICS], horizontal_spacing=0.07)
    modes = _ordered(df["mode"], MODE_ORDER)
    outcomes = _ordered(df["reuse"], OUTCOME_ORDER)
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
                        line={"color": MODE_COLORS.get(mode, "#7f7f7f"), "width": 1.5},
                        marker={"symbol": OUTCOME_SYMBOLS.get(outcome, "circle"), "size": 9,
                                "color": MODE_COLORS.get(mode, "#7f7f7f"), "line": {"width": 1.5}},
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
    ("proxy_s", "proxy, queue, D's first token", "#9edae5"),
    ("prefill_s", "prefill leg (compute)", "#1f77b4"),
    ("kv_transfer_est_s", "KV transfer from D (estimate)", "#ff7f0e"),
    ("unsplit_ttft_s", "to first token (no proxy: not split)", "#7f7f7f"),
    ("decode_s", "decode (after first token)", "#2ca02c"),
)


def time_split(df: pd.DataFrame) -> go.Figure:
    """Where each turn's time went: stacked bars of mean ms per turn, by turn index, one panel
    per mode.

    `df`: ``dashboard.queries.time_split`` (mode, turn_index, turns and the parts in seconds:
    proxy_s, prefill_s, kv_transfer_est_s, unsplit_ttft_s, decode_s). A bar's height is the
    mean E2E of its turns.
    """
    if df.empty:
        return empty_figure("no ok turns with a TTFT and an E2E in the selection")
    modes = _ordered(df["mode"], MODE_ORDER)
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

    `df`: ``dashboard.queries.reuse_vs_expected`` (mode, turn_index, turns, expected_tokens,
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
    for mode in _ordered(df["mode"], MODE_ORDER):
        g = df[df["mode"] == mode].sort_values("turn_index")
        color = MODE_COLORS.get(mode, "#7f7f7f")
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


# --- Sessions -----------------------------------------------------------------------------------

#: Gap kinds, in colours no reuse outcome uses (the session timeline shows both).
GAP_COLORS = {"tool": "#bcbd22", "think": "#17becf", "pause": "#c5b0d5", "none": "#e0e0e0"}
TASK_PARTS = (
    ("llm_s", "LLM (sum of E2E)", "#1f77b4"),
    ("tool_wait_s", "tool wait", GAP_COLORS["tool"]),
    ("think_s", "think", GAP_COLORS["think"]),
    ("pause_s", "pause", GAP_COLORS["pause"]),
    ("other_s", "other (client between turns)", "#e0e0e0"),
)


def task_split(df: pd.DataFrame) -> go.Figure:
    """Mean task latency per session split into LLM time, tool wait, think, pause and the rest,
    one horizontal stacked bar per (mode, archetype), in seconds.

    `df`: ``dashboard.queries.task_split`` (mode, archetype, sessions, task_latency_s, llm_s,
    tool_wait_s, think_s, pause_s; seconds). "other" = task latency minus the four parts.
    """
    if df.empty:
        return empty_figure("no finished sessions in the selection")
    d = df.copy()
    d["other_s"] = (d["task_latency_s"] - d[["llm_s", "tool_wait_s", "think_s", "pause_s"]].sum(axis=1)).clip(lower=0)
    order = {m: i for i, m in enumerate(MODE_ORDER)}
    d = d.sort_values(["mode", "archetype"], key=lambda c: c.map(order).fillna(99) if c.name == "mode" else c)
    d["group"] = d["mode"].astype(str) + " · " + d["archetype"].astype(str) + " (" + d["sessions"].astype(str) + ")"
    fig = go.Figure()
    for part, label, color in TASK_PARTS:
        fig.add_trace(
            go.Bar(
                y=d["group"],
                x=d[part],
                name=label,
                orientation="h",
                marker_color=color,
                hovertemplate=f"%{{y}}<br>{label}: %{{x:.2f}} s per session<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="stack",
        title="Task latency per session (mean), split",
        xaxis_title="seconds per session (mean)",
        yaxis_title="mode · archetype (sessions)",
        yaxis={"autorange": "reversed"},
        legend_title_text="part",
        margin={"t": 60},
        height=max(260, 60 + 40 * len(d)),
    )
    return fig




def session_timeline(df: pd.DataFrame) -> go.Figure:
    """One session's timeline (a Gantt): per turn, the gap before it (coloured by gap kind), the
    wait for the first token (coloured by reuse outcome) and the streaming after it.

    `df`: ``dashboard.queries.session_turns`` (turn_index, kind, gap_kind, gap_before_s,
    start_s: seconds from the session's first request, ttft_s, e2e_s, status, reuse). A turn
    without a TTFT (failed) is drawn as one grey bar of its E2E, if any. x in seconds.
    """
    if df.empty:
        return empty_figure("no turns recorded for this session")
    d = df.sort_values("turn_index").reset_index(drop=True)
    d["row"] = "turn " + d["turn_index"].astype(str) + " · " + d["kind"].fillna("?").astype(str)
    fig = go.Figure()
    shown: set[str] = set()

    def bar(row: pd.Series, base: float, length: float, name: str, color: str, text: str) -> None:
        gap = name.startswith("gap")
        fig.add_trace(
            go.Bar(
                y=[row["row"]],
                x=[length],
                base=[base],
                orientation="h",
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                marker={"color": color, "pattern": {"shape": "/" if gap else ""}},
                hovertemplate=text + "<extra></extra>",
            )
        )
        shown.add(name)

    for _, row in d.iterrows():
        start = float(row["start_s"])
        gap = row["gap_before_s"]
        if pd.notna(gap) and gap > 0:
            kind = str(row["gap_kind"])
            bar(row, start - gap, gap, f"gap: {kind}", GAP_COLORS.get(kind, "#c7c7c7"),
                f"{row['row']}<br>{kind} gap {gap:.2f} s")  # fmt: skip
        ttft, e2e = row["ttft_s"], row["e2e_s"]
        if pd.notna(ttft):
            outcome = str(row["reuse"])
            bar(row, start, ttft, f"to first token: {outcome}", OUTCOME_COLORS.get(outcome, "#7f7f7f"),
                f"{row['row']}<br>TTFT {ttft * 1e3:.1f} ms ({outcome})")  # fmt: skip
            if pd.notna(e2e) and e2e > ttft:
                bar(row, start + ttft, e2e - ttft, "streaming", "#1f77b4",
                    f"{row['row']}<br>streaming {(e2e - ttft) * 1e3:.1f} ms")  # fmt: skip
        else:
            length = float(e2e) if pd.notna(e2e) else 0.0
            bar(row, start, length, f"failed ({row['status']})", "#d62728",
                f"{row['row']}<br>{row['status']}, no token")  # fmt: skip
    fig.update_layout(
        barmode="overlay",
        title="Session timeline",
        xaxis_title="time since the session's first request (s)",
        yaxis={"autorange": "reversed", "title": "turn"},
        legend={"title": {"text": "segment"}, "orientation": "h", "yanchor": "top", "y": -0.25, "x": 0},
        margin={"t": 60, "b": 40},
        height=max(340, 200 + 28 * len(d)),
    )
    return fig


# --- Memory -------------------------------------------------------------------------------------


def _run_names(df: pd.DataFrame) -> pd.Series:
    dup = df.groupby("run_label")["run_id"].transform("nunique") > 1
    name = df["run_label"].where(~dup, df["run_label"] + " (" + df["run_id"] + ")")
    return name + " · " + df["mode"].astype(str)


ROLE_DASHES = {"decode": "solid", "prefill": "dash", "aggregated": "dot"}


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
            "reuse hit rate of later turns",
        ],
    )
    names = pd.concat([mem[["run_id", "run_label", "mode"]], hits[["run_id", "run_label", "mode"]]]).drop_duplicates(
        "run_id"
    )
    names = names.assign(name=_run_names(names)).set_index("run_id")["name"]
    palette = px.colors.qualitative.D3
    colors = {r: palette[i % len(palette)] for i, r in enumerate(names.index)}
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


# --- Compare ------------------------------------------------------------------------------------


def compare_by_turn(df: pd.DataFrame, a_name: str, b_name: str) -> go.Figure:
    """The speed-up B / A of median TTFTs by turn index (``dashboard.speedup``: above 1, A is
    faster), with its bootstrap 95% CI as error bars, each point coloured by its verdict, and a
    line at 1 (no difference).

    `df`: ``dashboard.compare_stats.ratio_by_turn`` (turn_index, n_a, n_b, median_a_s, median_b_s,
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
            line={"color": "#7f7f7f"},
            marker={"color": [speedup.VERDICT_HEX[v] for v in verdicts], "size": 10},
            error_y={
                "type": "data",
                "symmetric": False,
                "array": (hi - up).to_numpy(),
                "arrayminus": (up - lo).to_numpy(),
                "color": "#7f7f7f",
            },
            customdata=np.column_stack(
                [d["median_a_s"] * 1e3, d["median_b_s"] * 1e3, d["n_a"], d["n_b"], lo, hi, [v.value for v in verdicts]]
            ),
            hovertemplate="turn %{x}: %{y:.2f}x (CI %{customdata[4]:.2f}-%{customdata[5]:.2f}x, "
            "%{customdata[6]})<br>median A %{customdata[0]:.1f} vs B %{customdata[1]:.1f} ms, "
            "n = %{customdata[2]} vs %{customdata[3]}<extra></extra>",
        )
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="#4c4c4c", annotation_text="no difference")
    fig.update_xaxes(title_text="turn index (0 = first turn)", dtick=1 if d["turn_index"].max() <= 20 else None)
    fig.update_yaxes(title_text=f"{speedup.LABEL}: TTFT {b_name} / {a_name} (medians)", rangemode="tozero")
    fig.update_layout(
        title=f"{speedup.LABEL.capitalize()} of A by turn index, 95% bootstrap CI (green: faster, red: slower, "
        "grey: undecided)",
        showlegend=False,
        margin={"t": 60},
    )
    return fig


CASE_COLORS = {"A": "#2ca02c", "B": "#4c4c4c"}


def compare_cases(df: pd.DataFrame, a_name: str, b_name: str) -> go.Figure:
    """Median TTFT (ms) of A and B side by side for each favourable and unfavourable case.

    `df`: ``dashboard.compare_stats.case_table`` (case, side ``A``|``B``, turns, ttft_p50_s), cases
    in display order.
    """
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
                marker_color=CASE_COLORS[side],
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
