"""The Memory page's capacity section: the ramp of ``turnscope capacity`` (load on x, goodput,
TTFT and D's KV usage on y, one line per mode), the crossing in words, and each step's numbers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis import capacity_crossing as capacity
from analysis import eviction_window, schedule_text, speedup
from dashboard import charts, loader
from dashboard.context import Selection
from dashboard.figures import capacity as capacity_figures
from store import db, queries
from store.queries import capacity as capacity_queries


def steps_table(steps: pd.DataFrame) -> pd.DataFrame:
    """The step rows as the page shows them: ms, %, MiB; blanks (NaN) where a value does not apply."""
    return pd.DataFrame({
        "sessions (concurrent)": steps["users"], "mode": steps["mode"], "sessions played": steps["sessions"],
        "turns": steps["turns"], "met SLO": steps["slo_turns"],
        "goodput (turns/s)": steps["goodput_per_s"], "TTFT p50 (ms)": steps["ttft_p50_s"] * 1e3,
        "TTFT p90 (ms)": steps["ttft_p90_s"] * 1e3, "E2E p50 (ms)": steps["e2e_p50_s"] * 1e3,
        "E2E p90 (ms)": steps["e2e_p90_s"] * 1e3, "D KV start (%)": steps["decode_kv_usage_start"] * 100,
        "D KV peak (%)": steps["decode_kv_usage_max"] * 100,
        "held handles peak (MiB)": steps["handle_bytes_max"] / 2**20,
        "D waiting peak": steps["decode_waiting_max"], "D preemptions": steps["decode_preemptions"],
        "hits": steps["hits"], "P hit rate (%)": steps["p_hit_rate"] * 100,
        "pulled from D (tokens)": steps["pulled_tokens"],
    })


def window_table(sp: pd.DataFrame) -> pd.DataFrame:
    """The eviction window's step rows as the page shows them (``eviction_window.step_speedups``)."""
    return pd.DataFrame({
        "sessions (concurrent)": sp["users"], "pd P hit rate (%)": sp["p_hit_rate_baseline"] * 100,
        "pd-bidir P hit rate (%)": sp["p_hit_rate_treatment"] * 100,
        "pulled from D (tokens)": sp["pulled_tokens"],
        "median TTFT pd (ms)": sp["median_baseline_s"] * 1e3, "median TTFT pd-bidir (ms)": sp["median_treatment_s"] * 1e3,
        speedup.LABEL: [speedup.fmt(v) for v in sp["speedup"]],
        "95% CI": [speedup.fmt_ci(lo, hi) for lo, hi in zip(sp["ci_low"], sp["ci_high"], strict=True)],
        "verdict": sp["verdict"], "pd-bidir D KV peak (%)": sp["decode_kv_usage_max"] * 100,
        "pd-bidir D preemptions": sp["decode_preemptions"],
    })


def render_window(sel: Selection, mine: pd.DataFrame) -> None:
    """P's eviction ladder (a ramp recorded with ``--prefill-kv-tokens``): the window in words, its
    figure (sessions on x; P hit rate, speed-up with its CI, D's KV usage on y) and its table."""
    st.markdown("#### P's own prefix cache under eviction: the window")
    turns = loader.fetch(sel.root, capacity_queries.capacity_turns, tuple(mine["run_id"]))
    w = eviction_window.find_window(mine, turns)
    st.markdown(eviction_window.window_words(w))
    charts.show(lambda: capacity_figures.eviction_window(w.speedups, w.steps, w.ends_at), "eviction_window")
    first = mine.iloc[0]
    agg = first.get("aggregated_kv_cache_bytes")
    st.caption(
        f"P's KV space {first['prefill_kv_cache_bytes'] / 2**20:,.0f} MiB in both P/D modes, D's "
        f"{first['decode_kv_cache_bytes'] / 2**20:,.0f} MiB"
        + (f", the aggregated worker's {agg / 2**20:,.0f} MiB (P's plus D's)" if pd.notna(agg) else "")
        + ". P hit rate: of the prompt tokens P looked up in its own prefix cache, the share it found there "
        "(vLLM's prefix_cache_hits over prefix_cache_queries; view capacity_prefill_cache). Speed-up: pd's median "
        "TTFT over pd-bidir's, turns from each session's second on, with its 95% session-level bootstrap "
        "interval (the Overview's headline ratio). The window (shaded): from the smallest step where pd-bidir "
        "is faster beyond noise at every step up to the crossing (dashed: D's own KV space runs out).")
    st.dataframe(window_table(w.speedups), hide_index=True, key="eviction_table", column_config={
        c: st.column_config.NumberColumn(format="%.1f") for c in ("pd P hit rate (%)", "pd-bidir P hit rate (%)")
    } | {c: st.column_config.NumberColumn(format="%.0f") for c in (
        "median TTFT pd (ms)", "median TTFT pd-bidir (ms)", "pd-bidir D KV peak (%)", "pulled from D (tokens)")})


def render(sel: Selection) -> None:
    """Draw the section for the capacity ramps among the selected runs (a note when there is none)."""
    st.subheader("Capacity: when holding KV costs sessions")
    try:
        # the pages' cache (dashboard.loader), but a store that cannot be read only hides this section
        # which runs are ramp steps first (their rows only): the steps' query reads every selected
        # run's turns, scrapes and counter increases, seconds on a store of many scrapes
        ramp = loader.fetch(sel.root, capacity_queries.capacity_run_ids, tuple(sel.run_ids))
        steps = (loader.fetch(sel.root, capacity_queries.capacity_steps, tuple(ramp["run_id"].astype(str)))
                 if not ramp.empty else ramp)
    except (db.StoreBusy, db.StoreMissing, db.StoreInvalid) as exc:
        st.warning(f"The capacity steps cannot be read: {exc}")
        return
    if steps.empty:
        st.info("No capacity ramp among the selected runs: `turnscope capacity` ramps concurrent sessions against "
                "`pd` and `pd-bidir` with the same small D KV space (about 9 minutes on the embedded default).")
        return
    ids = list(dict.fromkeys(steps["capacity_id"]))  # newest first
    cid = st.selectbox("Capacity ramp", ids, key="capacity_id") if len(ids) > 1 else ids[0]
    mine = steps[steps["capacity_id"] == cid]
    first = mine.iloc[0]
    crossing = capacity.find_crossing(mine)
    st.markdown(capacity.crossing_words(crossing))
    charts.show(lambda: capacity_figures.capacity_curve(mine, crossing.users), "capacity_curve")
    kv = first["decode_kv_cache_bytes"]
    p_kv = first.get("prefill_kv_cache_bytes")
    p_note = (" (P keeps the topology's)" if pd.isna(p_kv) else f", P's {p_kv / 2**20:,.0f} MiB (the eviction ladder)")
    scheduled = loader.fetch(sel.root, queries.run_schedules, tuple(mine["run_id"]))
    played = "How the steps were played: " + " ".join(schedule_text.describe_json(scheduled["schedule"]))
    st.caption(
        f"Ramp `{cid}` ({first['capacity_workload']} workload, history {first['history_mode']}): each step is its own "
        f"run per mode, every step of a mode on one start of its workers. {played} SLO: TTFT ≤ "
        f"{first['slo_ttft_s'] * 1e3:,.0f} ms and TPOT ≤ {first['slo_tpot_s'] * 1e3:,.0f} ms; goodput = ok turns "
        "meeting both per second of the step (first turn sent to last turn finished; DistServe, Zhong et al., "
        f"OSDI'24). D's KV space: {kv / 2**20:,.0f} MiB in both modes{p_note}; D pins a "
        f"finished turn's blocks until P pulls them (or, below the recompute threshold, frees them unread) or "
        f"{first['decoder_kv_blocks_ttl_s']:.0f} s pass (pd-bidir). Crossing: the smallest step from which pd-bidir "
        f"stays behind pd at every larger step (goodput lower by more than {crossing.tolerance:.0%}, or TTFT p90 "
        f"higher by more than {crossing.tolerance:.0%} and beyond its sampling noise: the bootstrap "
        f"{capacity.P90_CONFIDENCE:.0%} interval of the two p90s' ratio above 1). Compare a step across modes with "
        "its E2E and D's numbers beside it."
    )
    if mine["prefill_kv_cache_bytes"].notna().any():
        render_window(sel, mine)
    st.dataframe(
        steps_table(mine.sort_values(["users", "mode"])), hide_index=True, key="capacity_table",
        column_config={
            "goodput (turns/s)": st.column_config.NumberColumn(format="%.2f"),
            **{c: st.column_config.NumberColumn(format="%.0f") for c in (
                "TTFT p50 (ms)", "TTFT p90 (ms)", "E2E p50 (ms)", "E2E p90 (ms)", "D KV start (%)", "D KV peak (%)",
                "D waiting peak", "D preemptions")},
            "held handles peak (MiB)": st.column_config.NumberColumn(format="%.1f"),
            "P hit rate (%)": st.column_config.NumberColumn(format="%.1f"),
        },
    )
