"""Overview: did KV reuse across turns pay off, per serving mode (README, "A five-minute tour")."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis import headline, pd_check, schedule_text, speedup
from dashboard import cards, charts, context, figures, html_reports, tables
from dashboard.loader import load
from store import db, hit_rate, queries


@st.cache_data(ttl=db.CACHE_TTL_S, show_spinner="Bootstrapping the headline's confidence intervals…")
def _ratios(samples: pd.DataFrame, stats: pd.DataFrame) -> list[headline.Ratio]:
    """`headline.headline_ratios`, cached: the bootstrap takes a moment on large runs."""
    return headline.headline_ratios(samples, stats=stats)


sel = context.current()
st.title("Overview")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()

run_ids = sel.run_ids
f = sel.filter

# --- headline ---------------------------------------------------------------------------------
st.subheader("Headline: TTFT from the second turn on")
st.caption(
    f"{speedup.MEANING}, medians of ok turns from the second on; {int(headline.CONFIDENCE * 100)}% bootstrap CI "
    "over whole sessions. Same convention in Compare, Sweep, the exports and the CLI (docs/design.md)."
)
# Exact medians and counts over every turn; the bootstrap sees whole sessions sampled to about
# MAX_CI_TURNS turns per mode (all of them in smaller stores).
stats = load(sel.root, queries.ttft_stats, f, headline.MIN_TURN_INDEX)
samples = load(sel.root, queries.ttft_samples, f, headline.MIN_TURN_INDEX, headline.MAX_CI_TURNS)
later_modes = {str(m) for m in stats["mode"].unique()}  # modes with ok turns after the first
ratios = _ratios(samples, stats)
scopes = list(dict.fromkeys((r.workload, r.history_mode) for r in ratios))
for workload, history_mode in scopes:
    mine = [r for r in ratios if (r.workload, r.history_mode) == (workload, history_mode)]
    if len(scopes) > 1:  # a row of cards per workload and history mode keeps the card titles short
        st.markdown(f"**{workload or 'unnamed workload'} · history {history_mode or 'unknown'}**")
    for col, r in zip(st.columns(len(headline.PAIRS)), mine, strict=False):
        cards.speedup_card(col, f"{r.treatment} vs {r.baseline}", r,
                           "Turn index ≥ 1, ok turns, whole sessions resampled.")
if ratios:
    st.markdown(f"**{headline.answer(ratios)}**")
    scheduled = load(sel.root, queries.run_schedules, run_ids)
    st.caption("How the runs were played: " + " ".join(schedule_text.describe_json(scheduled["schedule"])))
    with st.expander("The numbers behind each verdict"):
        for r in ratios:
            st.markdown(headline.verdict(r))
if not ratios:
    present = ", ".join(f"`{m}`" for m in sorted(later_modes)) or "none"
    st.info(
        "No headline yet: it compares `pd-bidir` with `pd` and with `aggregated`, and `pd-bidir-nocache` "
        f"with `pd-nocache`, on the same workload, and the selected runs have none of these pairs "
        f"(modes with ok turns after the first: {present})."
    )
if ratios:
    for line in headline.missing_pairs(later_modes):
        st.caption(line)
# the outcomes after the headline's numbers: a page sends its numbers before what explains them
outcomes = load(sel.root, queries.reuse_outcomes, f, headline.MIN_TURN_INDEX)
for line in headline.all_miss_warnings(outcomes):
    st.warning(line)
for run_id, line in pd_check.failed_runs(load(sel.root, queries.decode_prompt_sources, run_ids)).items():
    st.error(f"Run `{run_id}` failed its P/D check. {line}")
for run_id, line in pd_check.canary_failures(load(sel.root, queries.run_canaries, run_ids)).items():
    st.error(f"Run `{run_id}` failed its P/D check. {line}")

# --- per mode ---------------------------------------------------------------------------------
charts.note("TTFT by turn index, the reuse outcomes and P's external KV tokens")
if charts.on():
    left, right = st.columns([3, 2])
    charts.show(lambda: figures.ttft_by_turn(load(sel.root, queries.ttft_by_turn, f)), "ttft_by_turn", left)
    charts.show(lambda: figures.reuse_outcomes(outcomes), "reuse_outcomes", right)

ext = load(sel.root, queries.external_kv_tokens, run_ids) if charts.on() else None
if ext is not None and not ext.empty:  # an empty chart would only repeat the sentence below
    charts.show(lambda: figures.external_kv_tokens(ext), "external_kv_tokens")
elif ext is not None:
    st.caption(
        'No prefill scrapes of `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` '
        "in the selected runs (aggregated runs have no prefill worker)."
    )

# --- per run ----------------------------------------------------------------------------------
st.subheader("Runs")
if f.narrows_turns:
    st.caption("The run table counts every turn of each run; the archetype and kind filters apply above.")
summary = load(sel.root, queries.run_summary, run_ids)
st.dataframe(
    # a run without proxy outcomes (aggregated) has no hit rate: a blank, not Streamlit's "None"
    tables.blank_missing(tables.run_summary_table(summary),
                         {hit_rate.LABEL: "{:.1%}", hit_rate.PREFIX_CACHE_LABEL: "{:.1%}"}),
    hide_index=True,
    key="run_summary",
    column_config={
        "TTFT p50 (ms)": st.column_config.NumberColumn(format="%.1f"),
        "TTFT p90 (ms)": st.column_config.NumberColumn(format="%.1f"),
        "TTFT mean (ms)": st.column_config.NumberColumn(format="%.1f"),
        "reused tokens": st.column_config.NumberColumn(format="%d"),
        "started (UTC)": st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss"),
    },
)

st.download_button(
    "Export these runs as HTML",
    data=lambda: html_reports.run_report(sel.store, f, sel.describe()),
    file_name="turnscope-runs.html",
    mime="text/html",
    icon=":material/download:",
    help="One self-contained HTML file (plotly.js inlined) with this page's numbers and the Turns, "
    "Sessions and Memory figures of the selection.",
    key="export_runs",
)
