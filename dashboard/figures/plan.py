"""The Plan page's figures (plotly), each titled as a FORECAST with its profile."""

from __future__ import annotations

import math

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from analysis.plan_check import frontier_highlights
from core.contract import Role
from core.modes import BIDIRECTIONAL_MODES, PLAN_TABLE_ORDER, one_way
from dashboard.figures.common import MODE_COLORS, legend_below, log_ticks
from dashboard.palette import ALARM, NEUTRAL, NEUTRAL_DARK, mode_color
from planner.plan_store import LOAD_UNITS, load_words
from planner.strategies import HOST_STRATEGIES, STRATEGIES, STRATEGY_SYMBOLS

#: Column order of the Plan page's tables: baselines first, then what reuse adds.
PLAN_TABLE_MODES = PLAN_TABLE_ORDER

GiB = 2**30


def outcome_table(outcomes: pd.DataFrame) -> pd.DataFrame:
    """``store.queries.plan.outcomes`` (mode, outcome, requests) as outcome rows x mode columns, requests
    (0 where a mode has none of an outcome); modes in the order of ``PLAN_TABLE_MODES``."""
    wide = outcomes.pivot_table(index="outcome", columns="mode", values="requests", aggfunc="sum", fill_value=0)
    cols = [m for m in PLAN_TABLE_MODES if m in wide.columns] + sorted(c for c in wide.columns if c not in PLAN_TABLE_MODES)
    return wide[cols].astype(int).rename_axis(columns=None)


def ttft_parts_table(parts: pd.DataFrame) -> pd.DataFrame:
    """``store.queries.plan.ttft_parts`` for display: modes in ``PLAN_TABLE_MODES``, seconds as
    milliseconds (rounded to 0.1 ms), the queue share (the prefill worker's and D's waits) as a
    percentage (rounded to 0.1%)."""
    order = {m: i for i, m in enumerate(PLAN_TABLE_MODES)}
    df = parts.sort_values("mode", key=lambda s: s.map(lambda m: order.get(m, len(order)))).reset_index(drop=True)
    ms = (df[["ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "queue_wait_mean_s", "queue_wait_p95_s",
              "decode_wait_mean_s"]] * 1000).round(1)
    return pd.DataFrame({"mode": df["mode"], "requests": df["requests"].astype(int),
                         "TTFT mean (ms)": ms["ttft_mean_s"], "TTFT p50 (ms)": ms["ttft_p50_s"],
                         "TTFT p95 (ms)": ms["ttft_p95_s"], "queue wait mean (ms)": ms["queue_wait_mean_s"],
                         "queue wait p95 (ms)": ms["queue_wait_p95_s"],
                         "D wait mean (ms)": ms["decode_wait_mean_s"],
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
    """The frontier's rows that matter (``analysis.plan_check.frontier_highlights``) for display:
    TTL (s), D space (GiB or unbounded), hit rate (%) with its 80% interval (blank: none), GiB-s
    pinned, peak GiB, handles lost to D full, and why the row is shown."""
    hl = frontier_highlights(fr)
    return pd.DataFrame({"mode": hl["mode"], "TTL (s)": hl["decoder_kv_blocks_ttl_s"],
                         "D KV space": hl["decode_kv_space_bytes"].map(
                             lambda b: "unbounded" if pd.isna(b) else f"{b / GiB:,.3g} GiB"),
                         "hit rate (%)": (hl["hit_rate"] * 100).round(1),
                         "80% interval (%)": ["" if pd.isna(lo) else f"{lo:.1%}-{hi:.1%}" for lo, hi in
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
    """Predicted against measured TTFT (ms) of every ok turn of the checked runs, per mode, on log
    axes (TTFTs span two decades) ticked at 1, 2, 5 x 10^k ms, with the line of equality and the
    check's +-25% band."""
    ok = ch[(ch["status"] == "ok") & ch["measured_ttft_s"].notna() & (ch["predicted_ttft_s"] > 0)]
    ok = ok.assign(measured_ms=ok["measured_ttft_s"] * 1000, predicted_ms=ok["predicted_ttft_s"] * 1000)
    fig = px.scatter(ok, x="measured_ms", y="predicted_ms", color="mode", log_x=True, log_y=True,
                     color_discrete_map=MODE_COLORS, hover_data=["checked_run_id", "session_id", "turn_index"],
                     labels={"measured_ms": "measured TTFT (ms)", "predicted_ms": "forecast TTFT (ms)"},
                     title="Forecast against measured TTFT, recorded runs planned from their own records")
    if len(ok):
        lo = float(min(ok["measured_ms"].min(), ok["predicted_ms"].min())) * 0.8
        hi = float(max(ok["measured_ms"].max(), ok["predicted_ms"].max())) * 1.25
        for k, name, dash in ((1.0, "equal", "dot"), (1.25, "+25%", "dash"), (0.75, "-25%", "dash")):
            fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * k, hi * k], mode="lines", name=name,
                                     line={"dash": dash, "color": "grey", "width": 1}))
        vals, text = log_ticks(pd.Series([lo, hi]))
        fig.update_xaxes(tickvals=vals, ticktext=text)
        fig.update_yaxes(tickvals=vals, ticktext=text)
    return legend_below(fig, height=520)


def _err(value: pd.Series, low: pd.Series, high: pd.Series) -> dict | None:
    """Plotly's asymmetric error bar from interval ends (None where no row has one)."""
    if low.isna().all():
        return None
    return {"type": "data", "symmetric": False, "array": (high - value).fillna(0).clip(lower=0).tolist(),
            "arrayminus": (value - low).fillna(0).clip(lower=0).tolist(), "thickness": 1.5}


def ledger_figure(led: pd.DataFrame, tag: str) -> go.Figure:
    """The ledger (``plan_ledger`` rows) as one point per strategy: KV held over time, every tier
    (GiB-s: P's cache + D pinned + host), against the TTFT p50 of later requests saved against
    recompute (ms); 80% interval bars where the profile has held-out errors (x: D pinned's, y: TTFT
    saved's). Colour: the mode the strategy is costed as; open marker: with a host tier."""
    fig = go.Figure()
    for r in led.itertuples():
        one = led[led["strategy"] == r.strategy]
        held = one["p_cache_gib_s"] + one["d_pinned_gib_s"] + one["host_gib_s"]
        rest = held - one["d_pinned_gib_s"]
        saved = one["ttft_saved_s"] * 1000
        fig.add_trace(go.Scatter(
            x=held, y=saved, mode="markers+text", name=r.strategy, text=[r.strategy], textposition="top center",
            marker={"color": mode_color(r.mode), "symbol": STRATEGY_SYMBOLS.get(r.strategy, "circle"), "size": 14,
                    "line": {"width": 2, "color": mode_color(r.mode)}},
            error_x=_err(held, rest + one["d_pinned_interval_low_gib_s"], rest + one["d_pinned_interval_high_gib_s"]),
            error_y=_err(saved, one["ttft_saved_interval_low_s"] * 1000, one["ttft_saved_interval_high_s"] * 1000),
            hovertemplate=(f"{r.strategy} (costed as {r.mode})<br>held %{{x:,.1f}} GiB-s (P cache {r.p_cache_gib_s:,.1f}, "
                           f"D pinned {r.d_pinned_gib_s:,.1f}, host {r.host_gib_s:,.1f})<br>TTFT p50 saved %{{y:,.1f}} ms"
                           f"<br>hit rate {r.hit_rate:.1%}<extra></extra>")))
    missing = [r.strategy for r in led.itertuples() if pd.isna(r.ttft_saved_s)]
    note = (f" (not drawn: {', '.join(missing)}: overloaded, or against an overloaded recompute: no TTFT)"
            if missing else "")
    fig.update_layout(title=f"{tag}: KV held against TTFT saved, per retention strategy{note}",
                      xaxis_title="KV held, every tier (GiB-s)", yaxis_title="TTFT p50 saved vs recompute, turn 2 on (ms)")
    return legend_below(fig, height=460)


def _iv(value: float, low: float, high: float, fmt) -> str:
    """``"lo-hi"`` (``" to "`` when an end is negative), or ``""`` where there is no interval (a
    blank cell: Streamlit prints a missing value as "None")."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return ""
    return f"{fmt(low)}{' to ' if min(low, high) < 0 else '-'}{fmt(high)}"


def ledger_table(led: pd.DataFrame) -> pd.DataFrame:
    """``plan_ledger`` rows for display: whether the strategy keeps up at the load (else its overload:
    its TTFT and speed-up are then blank), hit rate (%), TTFT p50 of later requests (ms), speed-up and
    TTFT saved against recompute, each with its 80% interval (blank: none), GiB-s per tier,
    prefill GPU-s saved, memory $ per million saved tokens (blank: no price)."""
    pct, ms = (lambda x: f"{x * 100:.1f}"), (lambda x: f"{x * 1000:,.1f}")
    over = led["overload"] if "overload" in led else pd.Series([None] * len(led), index=led.index)
    return pd.DataFrame({
        "strategy": led["strategy"], "mode costed": led["mode"],
        "at this load": [o if isinstance(o, str) and o else "keeps up" for o in over],
        "hit rate (%)": (led["hit_rate"] * 100).round(1),
        "hit rate 80% interval (%)": [_iv(v, lo, hi, pct) for v, lo, hi in
                                      zip(led["hit_rate"], led["hit_rate_interval_low"], led["hit_rate_interval_high"], strict=True)],
        "TTFT p50, turn 2 on (ms)": (led["ttft_p50_later_s"] * 1000).round(1),
        "TTFT 80% interval (ms)": [_iv(v, lo, hi, ms) for v, lo, hi in
                                   zip(led["ttft_p50_later_s"], led["ttft_p50_later_interval_low_s"],
                                       led["ttft_p50_later_interval_high_s"], strict=True)],
        "speed-up vs recompute": led["speedup_vs_recompute"].round(2),
        "speed-up 80% interval": [_iv(v, lo, hi, lambda x: f"{x:.2f}") for v, lo, hi in
                                  zip(led["speedup_vs_recompute"], led["speedup_interval_low"],
                                      led["speedup_interval_high"], strict=True)],
        "P cache (GiB-s)": led["p_cache_gib_s"].round(1), "D pinned (GiB-s)": led["d_pinned_gib_s"].round(1),
        "D pinned 80% interval (GiB-s)": [_iv(v, lo, hi, lambda x: f"{x:,.1f}") for v, lo, hi in
                                          zip(led["d_pinned_gib_s"], led["d_pinned_interval_low_gib_s"],
                                              led["d_pinned_interval_high_gib_s"], strict=True)],
        "host (GiB-s)": led["host_gib_s"].round(1), "prefill GPU-s saved": led["prefill_gpu_s_saved"].round(1),
        "memory $ / M saved tokens": led["memory_usd_per_m_saved_tokens"].round(4),
        "net $ / M saved tokens": led["net_usd_per_m_saved_tokens"].round(4)})


def headline(rec: pd.Series | None, sp: pd.DataFrame) -> tuple[list[tuple[str, str, str | None]], str]:
    """The page's answer: up to four (label, value, help) figures and one sentence, from a
    recommendation row (``plan_recommendations``) when the plan has one, else from the speed-ups
    (``plan_speedups``: ``pd-bidir`` vs ``pd`` first)."""
    ms = lambda x: f"{x * 1000:,.1f}"
    if rec is not None:
        iv = _iv(rec["speedup"], rec["speedup_interval_low"], rec["speedup_interval_high"], lambda x: f"{x:.2f}")
        t_iv = _iv(rec["recommended_ttft_mean_s"], rec["recommended_ttft_mean_interval_low_s"],
                   rec["recommended_ttft_mean_interval_high_s"], ms)
        figures = [("recommended", rec["recommended_label"].split(",")[0], rec["recommended_label"]),
                   ("mean TTFT (ms)", ms(rec["recommended_ttft_mean_s"]), f"80% interval {t_iv} ms" if t_iv else
                    "no held-out interval"),
                   ("speed-up vs current", f"{rec['speedup']:.2f}x", f"80% interval {iv}x" if iv else "no held-out interval"),
                   ("D pinned (GiB-s)", f"{rec['recommended_d_pinned_gib_s']:,.0f}",
                    f"now {rec['current_d_pinned_gib_s']:,.0f} GiB-s")]
        verdict = ("enable bidirectional transfer" if rec["enables_bidir"] else "do not enable bidirectional transfer")
        sentence = (f"Recommended: {rec['recommended_label']} ({verdict}): mean TTFT {ms(rec['recommended_ttft_mean_s'])} ms"
                    f"{f' (80% interval {t_iv} ms)' if t_iv else ' (no held-out interval)'} against "
                    f"{ms(rec['current_ttft_mean_s'])} ms now ({rec['current_label']}).")
        return figures, sentence
    if sp.empty:
        return [], "This plan has no speed-ups to show."
    order = {(t, one_way(t)): i for i, t in enumerate(BIDIRECTIONAL_MODES)}  # each against its one-way P/D
    sp = sp.assign(_o=[order.get((t, b), 9) for t, b in zip(sp["treatment"], sp["baseline"], strict=True)]).sort_values("_o")
    figures = []
    for r in sp.head(4).itertuples():
        iv = _iv(r.speedup, r.speedup_interval_low, r.speedup_interval_high, lambda x: f"{x:.2f}")
        figures.append((f"{r.treatment} vs {r.baseline}", f"{r.speedup:.2f}x",
                        f"80% interval {iv}x" if iv else "no held-out interval"))
    top = sp.iloc[0]
    faster = "faster" if top["speedup"] >= 1 else "slower"
    sentence = (f"{top['treatment']} is forecast {top['speedup']:.2f}x {faster} than {top['baseline']} in median TTFT "
                f"from the second turn on ({int(top['treatment_hits']):,} hits of {int(top['later_requests']):,} later requests).")
    return figures, sentence


# -- fleet sizing (plan_fleets, plan_load_curve) -----------------------------------------------------

#: The fleet table's mark of the recommended row.
RECOMMENDED_MARK = "★ recommended"


def fleet_name(prefill_workers: int, decode_workers: int) -> str:
    """A fleet in a few characters: ``2P 3D``."""
    return f"{int(prefill_workers)}P {int(decode_workers)}D"


def overload_text(role: str, factor: float | None, words: str | None = None) -> str:
    """The overload as the planner wrote it (``words``: the row's ``overload`` column, the one
    verdict of planner.overload), else, for a plan stored before that column,
    ``overloaded: P at 3.4x its capacity`` (``factor``: offered work over the capacity of the
    role's busiest worker, 3 significant digits so 1.05x never reads as 1.0x); without a factor (an
    overload found by a queue that never drains) ``overloaded: P's queue never drains``."""
    if isinstance(words, str) and words:
        return words
    who = "P" if role == Role.PREFILL else "D" if role == Role.DECODE else str(role)
    if factor is None or pd.isna(factor):
        return f"overloaded: {who}'s queue never drains"
    return f"overloaded: {who} at {factor:.3g}x its capacity"


def _words(df: pd.DataFrame) -> list:
    """Each row's stored overload in words (None where the plan predates the column)."""
    return list(df["overload"]) if "overload" in df else [None] * len(df)


def _ms(x: float) -> str:
    return f"{x * 1000:,.0f}"


def fleet_table(fl: pd.DataFrame, profile_decode_kv_bytes: float | None,
                knees: pd.DataFrame | None = None) -> pd.DataFrame:
    """``plan_fleets`` rows for display, one per strategy, the answer's columns first: the
    recommended row marked (`RECOMMENDED_MARK`), the fleet (``2P 3D``), GPUs, p90 and p50 TTFT (ms,
    or the overload in words in their place), whether it meets the SLO, USD per million tokens
    (only where the plan is priced); then what an operator asks next (:func:`fleet_next_answers`:
    p90 / SLO, close, the lowest SLO reached, the knee; ``knees``: the plan's
    ``store.queries.plan.fleet_knees``, None: not read); then hit rate (%), D KV per worker (GiB; the
    profile's where the row has none, ``profile_decode_kv_bytes`` bytes), KV held (GiB-s per tier),
    prefill GPU-s saved, fleets searched."""
    def kv(b: float) -> str:
        if pd.notna(b):
            return f"{b / GiB:,.1f}"
        return "profile's" if profile_decode_kv_bytes is None else f"{profile_decode_kv_bytes / GiB:,.1f} (profile's)"

    over = fl["overloaded"].fillna(False).astype(bool)
    p90 = [overload_text(r, f, w) if o else _ms(t) for o, r, f, w, t in
           zip(over, fl["overload_role"], fl["overload_factor"], _words(fl), fl["ttft_p90_s"], strict=True)]
    p50 = ["—" if o else _ms(t) for o, t in zip(over, fl["ttft_p50_s"], strict=True)]
    out = pd.DataFrame({
        "": [RECOMMENDED_MARK if r else "" for r in fl["recommended"].fillna(False).astype(bool)],
        "strategy": fl["strategy"], "fleet": [fleet_name(p, d) for p, d in
                                             zip(fl["prefill_workers"], fl["decode_workers"], strict=True)],
        "GPUs": fl["gpus"].map(lambda g: f"{g:,g}"),
        "TTFT p90 (ms)": p90, "TTFT p50 (ms)": p50,
        "meets SLO": ["yes" if m else "no" for m in fl["meets_slo"].fillna(False).astype(bool)]})
    if fl["usd_per_m_tokens"].notna().any():
        out["$ / M tokens"] = fl["usd_per_m_tokens"].round(2)
    out = out.assign(**fleet_next_answers(fl, knees))
    out = out.assign(**{
        "hit rate (%)": (fl["hit_rate"] * 100).round(1),
        "D KV per worker (GiB)": fl["decode_kv_bytes_per_worker"].map(kv),
        "P cache (GiB-s)": fl["p_cache_gib_s"].round(1), "D pinned (GiB-s)": fl["d_pinned_gib_s"].round(1),
        "host (GiB-s)": fl["host_gib_s"].round(1), "prefill GPU-s saved": fl["prefill_gpu_s_saved"].round(1),
        "fleets searched": fl["fleets_searched"].astype("Int64")})
    return out


#: The next answers' columns (:func:`fleet_next_answers`), in the fleet table's order.
FLEET_NEXT_COLUMNS = ("p90 / SLO", "close to SLO", "lowest SLO reached (ms)", "knee")


def fleet_next_answers(fl: pd.DataFrame, knees: pd.DataFrame | None) -> dict[str, list[str]]:
    """The fleet table's answers to an operator's next questions, one text per ``plan_fleets`` row,
    as the planner stored them (docs/planner/fleet.md): ``p90 / SLO`` (``ttft_p90_over_slo``, two
    decimals; "—" when overloaded or without an SLO); ``close to SLO`` ("close" where
    ``close_to_slo``: within the planner's known error of the SLO); ``lowest SLO reached (ms)``
    where no fleet meets the SLO: the p90 of the strategy's largest fleet in the limits
    (``lowest_ttft_p90_s``, that row's fleet), "none within the limits" when that fleet is
    overloaded, "—" where a fleet meets it; ``knee``: the highest load of the load curve the fleet
    serves at the SLO (``knees``' ``knee_load_value``, in the load's unit), "none on the curve" when
    it serves not even the lowest load, "—" when the fleet is not on the curve. A column the store
    predates reads "—"."""
    n = len(fl)
    dash = ["—"] * n

    def col(name: str) -> list:
        return list(fl[name]) if name in fl else [None] * n

    margin = ["—" if m is None or pd.isna(m) else f"{m:.2f}" for m in col("ttft_p90_over_slo")]
    close = ["close" if c is not None and not pd.isna(c) and bool(c) else "" for c in col("close_to_slo")]
    if "close_to_slo" not in fl:
        close = dash
    lowest = []
    for meets, over, low, p, d in zip(fl["meets_slo"].fillna(False).astype(bool), fl["overloaded"].fillna(False),
                                      col("lowest_ttft_p90_s"), fl["prefill_workers"], fl["decode_workers"],
                                      strict=True):
        if meets or "lowest_ttft_p90_s" not in fl:
            lowest.append("—")
        elif low is not None and not pd.isna(low):
            lowest.append(f"{_ms(low)} on {fleet_name(p, d)}")
        else:
            lowest.append(f"none within the limits ({fleet_name(p, d)} overloaded)" if bool(over) else "—")
    knee = dash
    if knees is not None and not knees.empty:
        unit = LOAD_UNITS.get(str(fl["load_kind"].iloc[0]), "") if "load_kind" in fl else ""
        at = {(r.strategy, int(r.prefill_workers), int(r.decode_workers)): r.knee_load_value
              for r in knees.itertuples()}
        knee = []
        for s, p, d in zip(fl["strategy"], fl["prefill_workers"], fl["decode_workers"], strict=True):
            key = (s, int(p), int(d))
            if key not in at:
                knee.append("—")
            else:
                v = at[key]
                knee.append("none on the curve" if v is None or pd.isna(v) else f"{v:,g} {unit}".strip())
    return dict(zip(FLEET_NEXT_COLUMNS, (margin, close, lowest, knee), strict=True))


def fleet_styler(table: pd.DataFrame):
    """`fleet_table`'s frame with the recommended row shaded (a pandas Styler for ``st.dataframe``)."""
    shade = "background-color: rgba(44, 160, 44, 0.14); font-weight: bold"
    return table.style.apply(lambda r: [shade if r[""] == RECOMMENDED_MARK else ""] * len(r), axis=1).format(
        precision=1, subset=[c for c in table.columns if c.endswith("(GiB-s)") or c in ("hit rate (%)",
                                                                                     "prefill GPU-s saved")]).format(
        precision=2, subset=[c for c in table.columns if c.startswith("$")])


def slo_words(slo_s: float | None) -> str:
    """The SLO in words: ``p90 TTFT ≤ 1,000 ms``, or ``none (the smallest fleet that keeps up)``."""
    return "none (the smallest fleet that keeps up)" if slo_s is None or pd.isna(slo_s) else \
        f"p90 TTFT ≤ {_ms(slo_s)} ms"


def fleet_headline(fl: pd.DataFrame) -> tuple[list[tuple[str, str, str | None]], str]:
    """A fleet plan's answer: up to four (label, value, help) figures and one sentence, from its
    ``plan_fleets`` rows: the recommended fleet, its GPUs, p90 TTFT against the SLO and cost; or,
    where no fleet meets the SLO, the one closest to it."""
    first = fl.iloc[0]
    load, slo = load_words(first["load_kind"], first["load_value"]), f"SLO {slo_words(first['slo_ttft_p90_s'])}"
    meet = int(fl["meets_slo"].fillna(False).astype(bool).sum())
    rec = fl[fl["recommended"].fillna(False).astype(bool)]
    if rec.empty and meet:
        return [], f"{meet} of {len(fl)} strategies meet the {slo} at {load}; none is marked recommended."
    if rec.empty:
        ok = fl[fl["ttft_p90_s"].notna()].sort_values("ttft_p90_s")
        if ok.empty:
            worst = "; ".join(f"{r.strategy} {overload_text(r.overload_role, r.overload_factor, w)}"
                              for r, w in zip(fl.itertuples(), _words(fl), strict=True))
            return [], f"No fleet searched keeps up with {load}: every strategy's is overloaded ({worst})."
        r = ok.iloc[0]
        fleet = fleet_name(r["prefill_workers"], r["decode_workers"])
        figures = [("closest", f"{r['strategy']} {fleet}", None), ("TTFT p90 (ms)", _ms(r["ttft_p90_s"]), slo)]
        return figures, (f"No fleet searched meets the {slo} at {load}: the closest is {r['strategy']} on {fleet} "
                         f"({r['gpus']:,g} GPUs), p90 TTFT {_ms(r['ttft_p90_s'])} ms.")
    r = rec.iloc[0]
    fleet = fleet_name(r["prefill_workers"], r["decode_workers"])
    figures = [("recommended", f"{r['strategy']} {fleet}", f"{r['strategy']}: {fleet}, {r['gpus']:,g} GPUs"),
               ("GPUs", f"{r['gpus']:,g}", f"{int(r['fleets_searched'])} fleets searched for {r['strategy']}"),
               ("TTFT p90 (ms)", _ms(r["ttft_p90_s"]), slo),
               ("hit rate", f"{r['hit_rate']:.0%}", "later requests reusing any token")]
    if pd.notna(r["usd_per_m_tokens"]):
        figures[3] = ("$ / M tokens", f"{r['usd_per_m_tokens']:,.2f}", f"hit rate {r['hit_rate']:.0%}")
    sentence = (f"Recommended: {r['strategy']} on {fleet} ({r['gpus']:,g} GPUs), forecast p90 TTFT "
                f"{_ms(r['ttft_p90_s'])} ms at {load} ({slo}); {meet} of {len(fl)} strategies meet it, this one "
                "the cheapest.")
    return figures, sentence


def _open_symbol(symbol: str) -> str:
    return symbol if symbol.endswith("-open") else f"{symbol}-open"


def _overload_lanes(order: list[str], top: float, log_y: bool) -> tuple[dict[str, float], tuple[float, float]]:
    """The overload band above every TTFT and the SLO (`top`, ms): one lane per strategy of `order`
    (the first on top), so strategies overloaded at the same load stay apart. Returns (lane y per
    strategy, the band's (bottom, top)), in ms on the y axis's scale."""
    n = len(order)
    if log_y:
        lo, step = top * 1.25, 1.2
        return {st: lo * step ** (n - i - 0.5) for i, st in enumerate(order)}, (lo, lo * step**n)
    lo, step = top * 1.06, top * 0.05
    return {st: lo + step * (n - i - 0.5) for i, st in enumerate(order)}, (lo, lo + step * n)


def _add_curve_traces(fig: go.Figure, curve: pd.DataFrame, order: list[str], lanes: dict[str, float],
                      unit: str) -> None:
    """Each strategy's line (p90 TTFT where it keeps up), its overloaded loads as open markers on
    its lane, and each fleet's knee as a star."""
    for strategy in order:
        one = curve[curve["strategy"] == strategy]
        fleet = fleet_name(one["prefill_workers"].iloc[0], one["decode_workers"].iloc[0])
        colour = mode_color(STRATEGIES.get(strategy))
        symbol = STRATEGY_SYMBOLS.get(strategy, "circle")
        o = one["overloaded"].fillna(False).astype(bool)
        ok, bad = one[~o], one[o]
        fig.add_trace(go.Scatter(
            x=ok["load_value"], y=ok["ttft_p90_s"] * 1000, mode="lines+markers", name=f"{strategy} ({fleet})",
            legendgroup=strategy, customdata=ok["ttft_p50_s"] * 1000,
            line={"color": colour, "dash": "dot" if strategy in HOST_STRATEGIES else "solid", "width": 2},
            marker={"color": colour, "symbol": symbol, "size": 11, "line": {"width": 2, "color": colour}},
            hovertemplate=(f"{strategy} on {fleet}<br>%{{x:,g}} {unit}<br>p90 TTFT %{{y:,.0f}} ms"
                           "<br>p50 TTFT %{customdata:,.0f} ms<extra></extra>")))
        if not bad.empty:
            fig.add_trace(go.Scatter(
                x=bad["load_value"], y=[lanes[strategy]] * len(bad), mode="markers", name=f"{strategy} overloaded",
                legendgroup=strategy, showlegend=False,
                marker={"color": colour, "symbol": _open_symbol(symbol), "size": 10, "line": {"width": 2}},
                hovertext=[f"{strategy} on {fleet} at {v:,g} {unit}: {overload_text(r, f, w)} (no TTFT)" for v, r, f, w in
                           zip(bad["load_value"], bad["overload_role"], bad["overload_factor"], _words(bad),
                               strict=True)],
                hoverinfo="text"))
    knee = curve[curve["knee"].fillna(False).astype(bool) & curve["ttft_p90_s"].notna()] if "knee" in curve else None
    if knee is not None and not knee.empty:   # each fleet's knee: the highest load it serves at the SLO
        fig.add_trace(go.Scatter(
            x=knee["load_value"], y=knee["ttft_p90_s"] * 1000, mode="markers", name="knee (highest load at the SLO)",
            marker={"symbol": "star", "size": 16, "color": "rgba(0,0,0,0)", "line": {"width": 2, "color": "#333"}},
            hovertext=[f"{r.strategy} on {fleet_name(r.prefill_workers, r.decode_workers)}: knee at {r.load_value:,g} "
                       f"{unit}" for r in knee.itertuples()], hoverinfo="text"))


def _add_curve_marks(fig: go.Figure, curve: pd.DataFrame, fl: pd.DataFrame, lanes: dict[str, float],
                     band: tuple[float, float], slo_ms: float | None, log_x: bool, log_y: bool,
                     x_range: tuple[float, float]) -> None:
    """The SLO line, the lanes' names, the overload band, the recommended fleet's overloaded region
    and the load the fleets were sized at."""
    x_start, x_end = x_range
    kind = str(curve["load_kind"].iloc[0])
    over = curve["overloaded"].fillna(False).astype(bool)
    if slo_ms is not None:
        fig.add_trace(go.Scatter(x=[x_start, x_end], y=[slo_ms, slo_ms], mode="lines", name=f"SLO: p90 ≤ {slo_ms:,.0f} ms",
                                 line={"color": ALARM, "dash": "dash", "width": 2}, hoverinfo="name"))
        fig.add_annotation(xref="paper", x=1, xanchor="right", yref="y", y=math.log10(slo_ms) if log_y else slo_ms,
                           yanchor="bottom", showarrow=False, text=f"SLO {slo_ms:,.0f} ms",
                           font={"size": 11, "color": ALARM})
    for strategy, y in lanes.items():  # each lane named at the plot's right
        fig.add_annotation(xref="paper", x=1, xanchor="left", yref="y", y=math.log10(y) if log_y else y,
                           yanchor="middle", showarrow=False, text=f" {strategy}",
                           font={"size": 10, "color": mode_color(STRATEGIES.get(strategy))})
    fig.add_shape(type="rect", name="overloaded band", xref="paper", x0=0, x1=1, yref="y", y0=band[0], y1=band[1],
                  fillcolor=NEUTRAL, opacity=0.15, line={"width": 0}, layer="below")
    fig.add_annotation(xref="paper", x=0, xanchor="left", yref="y", y=math.log10(band[1]) if log_y else band[1],
                       yanchor="bottom", showarrow=False, text="overloaded (no TTFT: arrivals outpace the fleet)",
                       font={"size": 11, "color": NEUTRAL_DARK})
    rec = fl[fl["recommended"].fillna(False).astype(bool)]
    if not rec.empty:
        r = rec.iloc[0]
        mine = curve[(curve["strategy"] == r["strategy"]) & over]
        if not mine.empty:
            x0 = float(mine["load_value"].min())
            fig.add_shape(type="rect", name="recommended fleet overloaded", xref="x", x0=x0, x1=x_end, yref="paper",
                          y0=0, y1=1, fillcolor=ALARM, opacity=0.08, line={"width": 0}, layer="below")
            fig.add_annotation(xref="x", x=math.log10(x0) if log_x else x0, xanchor="left", yref="paper", y=1,
                               yanchor="bottom", showarrow=False, font={"size": 11, "color": ALARM},
                               text=f"recommended {r['strategy']} "
                                    f"{fleet_name(r['prefill_workers'], r['decode_workers'])} overloaded from here")
    sized = float(fl["load_value"].iloc[0])
    fig.add_shape(type="line", name="sized at", xref="x", x0=sized, x1=sized, yref="paper", y0=0, y1=1,
                  line={"color": NEUTRAL_DARK, "dash": "dot", "width": 1})
    fig.add_annotation(xref="x", x=math.log10(sized) if log_x else sized, xanchor="left", yref="paper", y=0.02,
                       yanchor="bottom", showarrow=False, text=f" fleets sized at {load_words(kind, sized)}",
                       font={"size": 11, "color": NEUTRAL_DARK})


def _set_curve_axes(fig: go.Figure, loads: pd.Series, x_range: tuple[float, float], log_x: bool, log_y: bool,
                    low: float, top: float, band: tuple[float, float]) -> None:
    """The x axis over `loads` (log ticks at the loads themselves where `log_x`); the y axis up to
    the band, ticked only up to the highest TTFT (above it the lanes are positions, not TTFTs)."""
    x_start, x_end = x_range
    if log_x:
        fig.update_xaxes(type="log", range=[math.log10(x_start), math.log10(x_end)],
                         tickvals=sorted(set(loads)), ticktext=[f"{v:,g}" for v in sorted(set(loads))])
    else:
        fig.update_xaxes(range=[x_start, x_end])
    if log_y:
        vals, text = log_ticks(pd.Series([low / 1.3, top]))
        vals, text = [v for v in vals if v < band[0]], [t for v, t in zip(vals, text, strict=True) if v < band[0]]
        fig.update_yaxes(type="log", range=[math.log10(low / 1.3), math.log10(band[1] * 1.2)], tickvals=vals,
                         ticktext=text)
    else:  # ticks up to the highest TTFT only: above it the band's lanes are positions, not TTFTs
        tick = next(m * 10.0**e for e in range(math.floor(math.log10(top)) - 1, 12) for m in (1, 2, 2.5, 5)
                    if top / (m * 10.0**e) <= 8)
        vals = [i * tick for i in range(int(top / tick) + 1)]
        fig.update_yaxes(range=[0, band[1] * 1.07], tickvals=vals, ticktext=[f"{v:,g}" for v in vals])


def load_curve_figure(curve: pd.DataFrame, fl: pd.DataFrame, title: str) -> go.Figure:
    """p90 forecast TTFT (ms) against load (``plan_load_curve`` rows; x in ``load_kind``'s unit, log
    when the loads span a factor of 8 or more), one line per strategy's fleet (its mode's colour,
    its ledger marker; dotted: with a host tier). The SLO is a horizontal line; loads at which a
    fleet is overloaded (no TTFT) are open markers on a grey band at the top (one lane per strategy,
    the first on top; the y of a lane is a position, not a TTFT); from the smallest
    load at which the recommended fleet (``plan_fleets``) is overloaded on, the region is shaded;
    a dotted vertical line marks the load the fleets were sized at."""
    fig = go.Figure()
    kind = str(curve["load_kind"].iloc[0])
    slo = fl["slo_ttft_p90_s"].iloc[0]
    slo_ms = None if pd.isna(slo) else float(slo) * 1000
    over = curve["overloaded"].fillna(False).astype(bool)
    ok_ms = curve.loc[~over, "ttft_p90_s"].dropna() * 1000
    shown = [*([] if slo_ms is None else [slo_ms]), *ok_ms.tolist()] or [1000.0]
    top, low = max(shown), min(shown)
    log_y = top / low > 20
    order = [s for s in STRATEGIES if s in set(curve["strategy"])] + sorted(set(curve["strategy"]) - set(STRATEGIES))
    lanes, band = _overload_lanes(order, top, log_y)
    loads = curve["load_value"].astype(float)
    lo_x, hi_x = float(loads.min()), float(loads.max())
    log_x = lo_x > 0 and hi_x / lo_x >= 8
    x_end = hi_x * 1.3 if log_x else hi_x + 0.06 * (hi_x - lo_x or hi_x or 1)
    x_start = lo_x / 1.3 if log_x else lo_x - 0.06 * (hi_x - lo_x or hi_x or 1)
    unit = LOAD_UNITS.get(kind, kind)
    _add_curve_traces(fig, curve, order, lanes, unit)
    _add_curve_marks(fig, curve, fl, lanes, band, slo_ms, log_x, log_y, (x_start, x_end))
    _set_curve_axes(fig, loads, (x_start, x_end), log_x, log_y, low, top, band)
    fig.update_layout(title=f"{title}: p90 TTFT against load, each strategy's fleet",
                      xaxis_title=f"load ({unit})", yaxis_title="p90 TTFT, every request (ms)")
    legend_below(fig, height=540)
    fig.update_layout(margin={"r": 110})
    return fig
