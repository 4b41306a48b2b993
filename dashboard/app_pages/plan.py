"""Plan: what KV reuse across turns would do on a traffic, model and hardware (`turnscope plan`), and
what to deploy for it (`turnscope recommend --store`: the ledger of retention strategies and the
recommended setting as a copyable diff; a fleet plan: the smallest fleet per strategy meeting a TTFT
SLO at a stated load, and each fleet's p90 TTFT at other loads).

Every figure on this page is a FORECAST made with the cost profile it names, with its 80% interval
where the profile has held-out errors; the check against recorded runs (when the plan has one) shows
how far to trust it. The page opens with its answer: a few figures and a sentence.
"""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from analysis import speedup
from analysis.plan_check import CHECK_MEANING, check_summary, headline_check, with_interval
from dashboard import charts, context
from dashboard.figures import plan as plan_figures
from planner.strategies import STRATEGIES
from store import db
from store.queries import plan as plan_queries

sel = context.current()
root = sel.store
st.title("Plan")
st.caption("Forecasts of `turnscope plan` and `turnscope recommend`: the proxy's and vLLM's rules on a traffic, "
           "without serving it (docs/planner/overview.md). The sidebar's run filters do not apply here.")
try:
    plans = db.read(root, plan_queries.plans)
except (db.StoreMissing, db.StoreInvalid, db.StoreBusy) as exc:
    st.info(f"No plans to show: {exc}")
    st.stop()
if plans.empty:
    st.info("No plan yet: run `turnscope plan data/traces/kv-cache-tester --profile data/profiles/vendor-h200.yaml` "
            "or `turnscope recommend ... --store DIR`.")
    st.stop()


def _name(pid: str) -> str:
    r = plans[plans["plan_id"] == pid].iloc[0]
    return f"{r['label'] or pid} · {r['forecast_label']} · {int(r['requests']):,} requests"


pid = st.selectbox("Plan", plans["plan_id"].tolist(), format_func=_name, key="plan_id")
row = plans[plans["plan_id"] == pid].iloc[0]
tag = row["forecast_label"]
st.subheader(tag)
profile = json.loads(row["profile"])
held_out = profile.get("held_out")
sp = db.read(root, plan_queries.speedups, pid)
try:
    led = db.read(root, plan_queries.ledger, pid, STRATEGIES)
    rec_rows = db.read(root, plan_queries.recommendation, pid)
except db.StoreInvalid:   # views of a store written before the ledger was stored
    led, rec_rows = pd.DataFrame(), pd.DataFrame()
try:
    fleets = db.read(root, plan_queries.fleets, pid, STRATEGIES)
except db.StoreInvalid:   # views of a store written before fleets were stored
    fleets = pd.DataFrame()
rec = rec_rows.iloc[0] if not rec_rows.empty else None
figures, sentence = (plan_figures.fleet_headline(fleets) if not fleets.empty else plan_figures.headline(rec, sp))
for col, (label, value, help_) in zip(st.columns(max(len(figures), 1)), figures, strict=False):
    col.metric(label, value, help=help_)
st.markdown(f"**{sentence}** — {tag}")
if not fleets.empty:
    load = fleets.iloc[0]
    st.subheader(f"Fleet per retention strategy ({tag})")
    st.markdown(f"**Load:** {load['load_label'] or plan_figures.load_words(load['load_kind'], load['load_value'])}. "
                f"**SLO:** {plan_figures.slo_words(load['slo_ttft_p90_s'])}, every request.")
    st.caption(f"Per strategy the smallest fleet searched whose forecast p90 TTFT meets the SLO "
               f"({int(fleets['fleets_searched'].sum()):,} fleets searched); {plan_figures.RECOMMENDED_MARK}: the "
               "cheapest that meets it. Overloaded: a role's arrivals outpace it, so no TTFT is forecast.")
    decode_kv = (profile.get("decode_kv_space_bytes") or {}).get("value")
    try:
        knees = db.read(root, plan_queries.fleet_knees, pid)
    except db.StoreInvalid:   # a load curve stored before its knees
        knees = None
    st.dataframe(plan_figures.fleet_styler(plan_figures.fleet_table(fleets, decode_kv, knees)), hide_index=True,
                 key="plan_fleets")
    st.caption("p90 / SLO: the margin; close: within the planner's known error of the SLO (docs/planner/held-out.md). "
               "Where none meets the SLO: the lowest SLO reached, on the row's fleet (the largest allowed).")
    st.caption("Knee: the highest load of the curve below at which that fleet meets the SLO.")
    curve = db.read(root, plan_queries.load_curve, pid, STRATEGIES)
    if not curve.empty:
        charts.note("the load curve")
        charts.show(lambda: plan_figures.load_curve_figure(curve, fleets, f"FORECAST (profile {row['profile_name']})"),
                    "plan_load_curve")
        st.caption("Each strategy's fleet above at other loads: p90 TTFT against the SLO (dashed). Open markers on "
                   "the grey band: overloaded, no TTFT; shaded: where the recommended fleet is overloaded.")
st.caption(f"Intervals: 80%, from the profile's held-out errors ({held_out['split']})." if held_out else
           "No held-out interval: this profile was never checked on runs it was not fitted on "
           "(`turnscope plan-check --write-profile`).")
for note in json.loads(row["notes"] or "[]"):
    if fleets.empty or not note.startswith("Load: "):   # a fleet plan's load is stated above its table
        st.caption(f"Note: {note}")
if not sp.empty:
    st.caption(f"{speedup.MEANING}; as on the Overview: median TTFT from the second turn on, with its 95% CI over "
               "sessions.")
for r in sp.itertuples():
    head = with_interval(speedup.fmt(r.speedup), r.speedup_interval_low, r.speedup_interval_high,
                         lambda x: f"{x:.2f}", "x")
    st.markdown(f"**{r.treatment} vs {r.baseline}**: {speedup.LABEL} {head}, 95% CI "
                f"{speedup.fmt_ci(r.speedup_ci_low, r.speedup_ci_high)}; median TTFT "
                f"{r.treatment_ttft_median_s * 1e3:,.1f} ms vs {r.baseline_ttft_median_s * 1e3:,.1f} ms over "
                f"{r.later_requests:,} later requests ({r.treatment_hits:,} hits) — {tag}")
if not sp.empty:
    st.caption("Secondary figures: mean TTFT over every request, and its share spent queueing: for a prefill "
               "worker and on D for room in its KV space.")
    st.dataframe(plan_figures.secondary_table(sp), hide_index=True, key="plan_secondary")
parts = db.read(root, plan_queries.ttft_parts, pid)
if not parts.empty:
    st.caption(f"Forecast TTFT per mode, its wait for a prefill (or aggregated) worker and its wait on D for room "
               f"in D's KV space (pinned handles and running requests), each first come first served ({tag}). A "
               f"large queue share: the speed-ups come from less queueing, i.e. from the arrival rate and D's space.")
    st.dataframe(plan_figures.ttft_parts_table(parts), hide_index=True, key="plan_ttft_parts")
outcomes = db.read(root, plan_queries.outcomes, pid)
if not outcomes.empty:
    st.caption(f"Requests per forecast outcome and mode ({tag}); `none`: aggregated serving. `miss_d_full`: the "
               "handle was not kept because D's KV space was full.")
    st.dataframe(plan_figures.outcome_table(outcomes), key="plan_outcomes")
fr = db.read(root, plan_queries.frontier, pid)
if not fr.empty:
    charts.note()
    charts.show(lambda: plan_figures.frontier_figure(fr, tag), "plan_frontier")
    st.caption(f"The points that matter ({tag}): the current one, the best hit rate, and where the hit rate "
               "changes along the TTL and along the D space.")
    st.dataframe(plan_figures.frontier_highlights_table(fr), hide_index=True, key="plan_frontier_rows")
    st.caption("Each point re-plans the mode with another `decoder_kv_blocks_ttl` (colour) and D KV space (hover); "
               "up: more reuse from D, right: more KV pinned. The diamond is the current point.")
if not led.empty:
    st.subheader(f"Ledger of retention strategies ({tag})")
    st.caption("Where a session's KV waits between turns, for how long, and what it saves, at the current setting "
               "(`turnscope recommend`); an interval of None: none (the notes below say why).")
    st.dataframe(plan_figures.ledger_table(led), hide_index=True, key="plan_ledger")
    charts.show(lambda: plan_figures.ledger_figure(led, tag), "plan_ledger_fig")
    st.caption("One point per strategy, coloured by the mode it is costed as (open: with a host tier); bars: 80% "
               "intervals of TTFT saved and D's pinned KV.")
    for note in dict.fromkeys(n for v in led["interval_note"].dropna() for n in str(v).split("; ") if n):
        st.caption(f"Interval note: {note}")
if rec is not None:
    st.subheader("Recommended setting: the diff to deploy it")
    st.caption(f"`vllm serve` flags of each role, current -> recommended ({tag}; "
               f"{int(rec['settings_searched'])} settings searched).")
    st.code(rec["flags_diff"] or "(no change)", language="diff")
    st.caption("The topology file (data/topologies/*.yaml), current -> recommended, and the recommended file whole.")
    st.code(rec["topology_diff"] or "(no change)", language="diff")
    with st.expander("Recommended topology file"):
        st.code(rec["recommended_topology"], language="yaml")
    changes = json.loads(rec["what_would_change"] or "[]")
    if changes:
        st.caption(f"What would make bidirectional transfer pay ({tag}):")
        st.markdown("\n".join(f"- {line}" for line in changes))
defeated = db.read(root, plan_queries.sessions, pid)
if not outcomes.empty:
    st.subheader(f"Sessions whose pauses or edits defeat reuse ({tag})")
    if defeated.empty:
        st.caption("None: no session lost reuse to a pause past the TTL, an edit, a full D or an overlapping request.")
    else:
        st.dataframe(defeated.head(50), hide_index=True, key="plan_sessions")
ch = db.read(root, plan_queries.checks, pid)
if not ch.empty:
    st.subheader("Checked against the recorded runs")
    summ = check_summary(ch)
    st.caption(f"What this table calculates: {CHECK_MEANING}.")
    st.dataframe(pd.DataFrame({"mode": summ["mode"], "ok turns": summ["ok_turns"],
                               "outcome matches": summ["outcome_matches"], "outcome check": summ["outcome_check"],
                               "TTFT MARE": summ["ttft_mare"], "TTFT check (<= 25%)": summ["ttft_check"]}),
                 hide_index=True, key="plan_check_summary",
                 column_config={"TTFT MARE": st.column_config.NumberColumn(format="percent")})
    hc = headline_check(ch)
    if not hc.empty:
        st.caption("The Overview's speed-up of these runs (median TTFT from the second turn on), over the measured "
                   "TTFTs and over the forecast ones (each run planned alone in its own mode):")
        st.dataframe(pd.DataFrame({"treatment": hc["treatment"], "baseline": hc["baseline"],
                                   "measured speed-up": hc["measured_speedup"].round(2),
                                   "forecast speed-up": hc["forecast_speedup"].round(2),
                                   "forecast error": hc["forecast_error"]}),
                     hide_index=True, key="plan_headline_check",
                     column_config={"forecast error": st.column_config.NumberColumn(format="percent")})
    charts.show(lambda: plan_figures.check_figure(ch), "plan_check_fig")
    diff = ch[ch["why"].notna()]
    if not diff.empty:
        st.caption("Turns whose forecast outcome differs from the recorded one, and why:")
        st.dataframe(diff[["checked_run_id", "session_id", "turn_index", "recorded_outcome", "predicted_outcome", "why"]],
                     hide_index=True, key="plan_check_diff")
if held_out:
    st.subheader("Held-out errors of this profile (the intervals' source)")
    st.caption(f"{held_out['split']}: {held_out['runs']} runs, {held_out['turns']:,} ok turns not fitted on. Per mode the "
               "10th and 90th percentiles of measured / forecast TTFT and of recorded minus forecast hit rate.")
    st.dataframe(plan_figures.held_out_table(held_out), hide_index=True, key="plan_held_out")
with st.expander("The profile (every figure with its source)"):
    st.json(json.loads(row["profile"]))
