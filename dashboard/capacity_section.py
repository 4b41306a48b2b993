"""The Memory page's capacity section: the ramp of ``turnscope capacity`` (load on x, goodput,
TTFT and D's KV usage on y, one line per mode), the crossing in words, and each step's numbers."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import charts, db, loader, queries
from dashboard.context import Selection
from dashboard.figures import capacity as capacity_figures
from dashboard.queries import capacity as capacity_queries
from turnscope.analysis import capacity_crossing as capacity
from turnscope.analysis import schedule_text


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
        "hits": steps["hits"],
    })


def render(sel: Selection) -> None:
    """Draw the section for the capacity ramps among the selected runs (a note when there is none)."""
    st.subheader("Capacity: when holding KV costs sessions")
    try:
        # the pages' cache (dashboard.loader), but a store that cannot be read only hides this section
        steps = loader.fetch(sel.root, capacity_queries.capacity_steps, tuple(sel.run_ids))
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
    scheduled = loader.fetch(sel.root, queries.run_schedules, tuple(mine["run_id"]))
    played = "How the steps were played: " + " ".join(schedule_text.describe_json(scheduled["schedule"]))
    st.caption(
        f"Ramp `{cid}` ({first['capacity_workload']} workload, history {first['history_mode']}): each step is its own "
        f"run per mode, every step of a mode on one start of its workers. {played} SLO: TTFT ≤ "
        f"{first['slo_ttft_s'] * 1e3:,.0f} ms and TPOT ≤ {first['slo_tpot_s'] * 1e3:,.0f} ms; goodput = ok turns "
        "meeting both per second of the step (first turn sent to last turn finished; DistServe, Zhong et al., "
        f"OSDI'24). D's KV space: {kv / 2**20:,.0f} MiB in both modes (P keeps the topology's); D pins a "
        f"finished turn's blocks until P pulls them (or, below the recompute threshold, frees them unread) or "
        f"{first['decoder_kv_blocks_ttl_s']:.0f} s pass (pd-bidir). Crossing: the smallest step from which pd-bidir "
        f"stays behind pd at every larger step (goodput lower by more than {crossing.tolerance:.0%}, or TTFT p90 "
        f"higher by more than {crossing.tolerance:.0%} and beyond its sampling noise: the bootstrap "
        f"{capacity.P90_CONFIDENCE:.0%} interval of the two p90s' ratio above 1). Compare a step across modes with "
        "its E2E and D's numbers beside it."
    )
    st.dataframe(
        steps_table(mine.sort_values(["users", "mode"])), hide_index=True, key="capacity_table",
        column_config={
            "goodput (turns/s)": st.column_config.NumberColumn(format="%.2f"),
            **{c: st.column_config.NumberColumn(format="%.0f") for c in (
                "TTFT p50 (ms)", "TTFT p90 (ms)", "E2E p50 (ms)", "E2E p90 (ms)", "D KV start (%)", "D KV peak (%)",
                "D waiting peak", "D preemptions")},
            "held handles peak (MiB)": st.column_config.NumberColumn(format="%.1f"),
        },
    )
