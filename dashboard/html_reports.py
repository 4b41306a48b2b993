"""The HTML exports of the dashboard: a run report (Overview) and a comparison (Compare).

`run_report` reads the store itself (short read-only connections, `store.db.read`) because
Streamlit calls an export's data function on a separate thread, outside the page script and its
cache. Both return one self-contained HTML document (`dashboard.export`).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from analysis import headline, speedup
from analysis.headline import Ratio
from dashboard import export, figures, tables
from dashboard.export import Section
from store import db, queries
from store.queries import TurnFilter

TRANSFER_NOTE = (
    "KV transfer per turn is an estimate: the turn's reused tokens x the run's measured NIXL seconds per "
    "token (vllm:nixl_xfer_time_seconds on the prefill worker); transfers are not timed per turn."
)


def ratio_line(r: Ratio) -> str:
    """One headline number in words: the speed-up (``analysis.speedup``), its CI and verdict,
    medians and counts."""
    pct = round(headline.CONFIDENCE * 100)
    s = speedup.of(r)
    ci = f"{pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)}" if s.has_ci else "no CI (fewer than 2 sessions)"
    return (
        f"{r.treatment} vs {r.baseline}: {speedup.LABEL} {speedup.fmt(s.value)} ({ci}; {s.verdict.value}); "
        f"median TTFT {r.median_treatment_s * 1e3:.1f} ms vs {r.median_baseline_s * 1e3:.1f} ms over "
        f"{r.n_treatment} vs {r.n_baseline} turns ({r.sessions_treatment} vs {r.sessions_baseline} sessions)."
    )


def run_report(store: db.StoreLocation, f: TurnFilter, description: str = "") -> str:
    """The Overview of the runs of `f`, with the Turns, Sessions and Memory figures, as HTML.

    Runs every query it needs on `store` (read-only). Returns the document (str).
    """

    def q(query, *args: object) -> pd.DataFrame:
        return db.read(store, query, *args)

    samples = q(queries.ttft_samples, f, headline.MIN_TURN_INDEX, headline.MAX_CI_TURNS)
    stats = q(queries.ttft_stats, f, headline.MIN_TURN_INDEX)
    outcomes = q(queries.reuse_outcomes, f, headline.MIN_TURN_INDEX)
    ratios = headline.headline_ratios(samples, stats=stats)
    head: list[str | go.Figure | pd.DataFrame] = [speedup.MEANING + ".", headline.answer(ratios)]
    for r in ratios:
        head += [ratio_line(r), headline.verdict(r)]
    if not ratios:
        head.append("No headline: the selection lacks both modes of every pair (pd-bidir-nocache vs pd-nocache, "
                    "pd-bidir vs aggregated).")  # fmt: skip
    head += headline.all_miss_warnings(outcomes)
    summary = tables.run_summary_table(q(queries.run_summary, f)).drop(columns=["started (UTC)"])
    sections = [
        Section("Headline: TTFT from the second turn on", tuple(head)),
        Section("Runs", (summary,)),
        Section(
            "Per mode",
            (
                figures.ttft_by_turn(q(queries.ttft_by_turn, f)),
                figures.reuse_outcomes(outcomes),
                figures.external_kv_tokens(q(queries.external_kv_tokens, f)),
            ),
        ),
        Section(
            "Turns",
            (
                figures.latency_panels(q(queries.latency_by, f, "turn_index"), "turn_index"),
                figures.time_split(q(queries.time_split, f)),
                TRANSFER_NOTE,
                figures.reuse_vs_expected(q(queries.reuse_vs_expected, f)),
            ),
        ),
        Section("Sessions", (figures.task_split(q(queries.task_split, f)),)),
        Section(
            "Memory",
            (
                figures.memory_timeline(q(queries.memory_timeline, f), q(queries.hit_rate_timeline, f)),
                tables.reuse_cost_table(q(queries.reuse_cost, f)),
            ),
        ),
    ]
    return export.html_report("turnscope: runs", sections, subtitle=f"store {store.root} · {description}")


def compare_report(
    a_name: str,
    b_name: str,
    description: str,
    verdict: list[str],
    ratio_table: pd.DataFrame,
    by_turn_fig: go.Figure,
    cases_fig: go.Figure,
    cases: pd.DataFrame,
) -> str:
    """The Compare page as HTML: verdict sentences, the ratio table, both figures and the case
    table (all already computed by the page)."""
    sections = [
        Section(f"{a_name} (A) vs {b_name} (B)", (*verdict, ratio_table)),
        Section(f"{speedup.LABEL.capitalize()} by turn index", (by_turn_fig,)),
        Section("Favourable and unfavourable turns", (cases_fig, cases)),
    ]
    return export.html_report(f"turnscope: {a_name} vs {b_name}", sections, subtitle=description)
