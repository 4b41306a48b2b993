"""Compare: two runs or modes on the same workload, favourable and unfavourable turns side by side,
as speed-ups B / A (``analysis.speedup``) with bootstrap confidence intervals and a plain-language
verdict."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis import compare as compare_stats
from analysis import headline, speedup
from dashboard import cards, charts, context, figures, html_reports, tables
from dashboard.figures import MODE_ORDER
from dashboard.loader import load
from store import db, hit_rate, queries


@st.cache_data(ttl=db.CACHE_TTL_S, show_spinner="Bootstrapping confidence intervals…")
def _analyse(
    samples: pd.DataFrame, stats: pd.DataFrame, a_name: str, b_name: str
) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """`compare_stats.side_ratios`, `compare_stats.ratio_by_turn` and `compare_stats.case_table`, cached."""
    return (
        compare_stats.side_ratios(samples, a_name, b_name, stats),
        compare_stats.ratio_by_turn(samples, stats),
        compare_stats.case_table(samples, stats),
    )


sel = context.current()
st.title("Compare")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()
f = sel.filter
runs = sel.selected_runs

by = st.segmented_control("Compare", ["modes", "runs"], default="modes", key="cmp_by")
if by == "runs":
    options = runs["run_id"].astype(str).tolist()
    labels = {
        r.run_id: " · ".join(
            x for x in (r.label if isinstance(r.label, str) and r.label else r.run_id, r.mode,
                        compare_stats.routing_text(r.prefill_routing, r.decode_routing), r.history_mode) if x
        )
        for r in runs.itertuples()
    }
    default_a, default_b = 0, 1
else:
    histories = sorted(str(h) for h in runs["history_mode"].dropna().unique())
    if len(histories) > 1:  # comparing modes pools their runs: keep one way of carrying history
        history = st.radio("History mode", [*histories, "pooled"], horizontal=True, key="cmp_history",
                           help="Runs of one history mode each side; `pooled` mixes them.")
        if history != "pooled":
            runs = runs[runs["history_mode"] == history]
    runs = runs.assign(arm=compare_stats.compare_arms(runs))  # a mode, or mode · routing when that varies
    present = [str(m) for m in runs["arm"].dropna().unique()]
    order = {m: i for i, m in enumerate(MODE_ORDER)}
    options = sorted(present, key=lambda arm: (order.get(arm.split(" · ")[0], len(order)), arm))
    labels = {m: m for m in options}
    pair = next(((t, b) for t, b in headline.PAIRS if t in options and b in options), None)
    default_a, default_b = (options.index(pair[0]), options.index(pair[1])) if pair else (0, 1)
if len(options) < 2:
    st.info(f"Comparing needs two {by} among the selected runs; the sidebar's filters keep {len(options)}.")
    st.stop()

left, right = st.columns(2)
a = left.selectbox("A (treatment)", options, index=default_a, format_func=labels.get, key=f"cmp_a_{by}")
b = right.selectbox("B (baseline)", options, index=default_b, format_func=labels.get, key=f"cmp_b_{by}")
if a == b:
    st.info("Pick two different ones.")
    st.stop()
if by == "runs":
    a_runs, b_runs = runs[runs["run_id"] == a], runs[runs["run_id"] == b]
else:
    a_runs, b_runs = runs[runs["arm"] == a], runs[runs["arm"] == b]
a_ids, b_ids = tuple(a_runs["run_id"].astype(str)), tuple(b_runs["run_id"].astype(str))
a_name, b_name = labels[a], labels[b]


def _workloads(df: pd.DataFrame) -> set[tuple[str, str]]:
    return {(str(w), str(h)) for w, h in zip(df["workload"], df["history_mode"], strict=True)}


wa, wb = _workloads(a_runs), _workloads(b_runs)
if wa != wb:
    st.warning(compare_stats.workload_mismatch(wa, wb))


def _one_mode(df: pd.DataFrame) -> str | None:
    modes = df["mode"].dropna().unique()
    return str(modes[0]) if len(modes) == 1 else None


a_mode, b_mode = _one_mode(a_runs), _one_mode(b_runs)

# Exact medians and counts over every turn; the bootstraps see whole sessions sampled to about
# compare_stats.SAMPLE_TURNS turns per side (all of them in smaller stores).
stats = load(sel.root, queries.compare_stats, a_ids, b_ids, f, headline.MIN_TURN_INDEX)
samples = load(sel.root, queries.compare_samples, a_ids, b_ids, f, compare_stats.SAMPLE_TURNS)
if samples.empty or not {"A", "B"} <= set(samples["side"]):
    st.info("One side has no ok turns with a TTFT in the selection yet.")
    st.stop()
ratios, by_turn, cases = _analyse(samples, stats, a_name, b_name)

# --- the numbers ------------------------------------------------------------------------------
st.subheader(f"{a_name} vs {b_name}: TTFT from the second turn on")
pct = int(headline.CONFIDENCE * 100)
cols = st.columns(3)
titles = {
    "all": ("all later turns", "every ok turn with turn_index ≥ 1"),
    "favourable": ("favourable turns", "continued (kind `turn`) within the proxy's TTL"),
    "unfavourable": ("unfavourable turns", "fresh, resumed, edited, retried, or continued after the TTL"),
}
for col, (key, (title, what)) in zip(cols, titles.items(), strict=True):
    r = ratios[key]
    if r is None:
        col.metric(title, "n/a", help=f"{what}: one side has no such turns")
        continue
    cards.speedup_card(col, title, r, f"Here baseline = B, bidirectional = A; ok turns: {what}.")
rates = load(sel.root, queries.side_hit_rates, a_ids, b_ids, f).set_index("side")["hit_rate"]


def _pct(side: str) -> str:
    v = rates.get(side)
    return "n/a" if v is None or pd.isna(v) else f"{100 * v:.0f}%"


st.caption(f"{hit_rate.LABEL.capitalize()}: A {_pct('A')}, B {_pct('B')}"
           + (" (n/a: no proxy outcome, as in aggregated serving)." if "n/a" in (_pct("A"), _pct("B")) else "."))
fav_a, all_a = ratios["favourable"], ratios["all"]
share = (fav_a.n_treatment if fav_a else 0) / all_a.n_treatment if all_a else None
verdict = compare_stats.verdict(ratios, share)
st.markdown("\n\n".join(verdict))
st.caption(
    f"{speedup.LABEL.capitalize()} = median TTFT of B / median TTFT of A (above 1: A is faster), {pct}% bootstrap "
    "CI over whole sessions. Favourable: continued (kind `turn`) within the proxy's TTL; unfavourable: the rest."
)

# --- by turn index ----------------------------------------------------------------------------
charts.note("the speed-up by turn index and the cases side by side")
charts.show(lambda: figures.compare_by_turn(by_turn, a_name, b_name), "compare_by_turn")
if bool(by_turn["ci_subsampled"].any()) if not by_turn.empty else False:
    st.caption(
        f"Turn indexes with more than {compare_stats.MAX_CI_TURNS_PER_INDEX} turns on a side are bootstrapped on a "
        "random subset of them: their intervals are wider than with all."
    )

# --- side by side -----------------------------------------------------------------------------
st.subheader("Favourable and unfavourable turns, side by side")
left, right = st.columns([1, 1]) if charts.on() else (None, st)
charts.show(lambda: figures.compare_cases(cases, a_name, b_name, a_mode, b_mode), "compare_cases", left)
case_view = tables.case_table(cases)
right.dataframe(case_view, hide_index=True, key="compare_case_table", column_config={
    c: st.column_config.NumberColumn(format="%.1f", width="small") for c in ("p50 A (ms)", "p50 B (ms)")
})  # fmt: skip
right.caption("turns and median TTFT per case, A and B; a case only one side has shows blanks.")

ratio_table = tables.ratio_table(ratios)
description = f"A = {a_name} ({len(a_ids)} run(s)), B = {b_name} ({len(b_ids)} run(s)); {sel.describe()}"
st.download_button(
    "Export this comparison as HTML",
    data=lambda: html_reports.compare_report(
        a_name, b_name, description, verdict, ratio_table, figures.compare_by_turn(by_turn, a_name, b_name),
        figures.compare_cases(cases, a_name, b_name, a_mode, b_mode), case_view,
    ),
    file_name=f"turnscope-compare-{a}-vs-{b}.html".replace("/", "_"),
    mime="text/html",
    icon=":material/download:",
    key="export_compare",
)
