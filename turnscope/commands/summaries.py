"""What ``eval``, ``sweep`` and ``demo`` print when their runs end: TTFT by turn index, reuse outcomes,
P's external KV tokens, whether the run started cold, and the bottom line (speed-ups with their CIs and verdicts)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
from rich.table import Table

from analysis import pd_check
from store import db, queries
from store.queries import run_report
from turnscope.commands.app import (
    console,
)
from turnscope.conductor import console_text, schedule
from turnscope.conductor.prefix_sweep import SWEEP_MODES


def print_summary(store: Path, run_ids: list[str]) -> None:
    """Print TTFT p50/p90 by turn index, reuse outcomes, P's external KV tokens and the sessions
    that stopped before their last planned turn (e.g. at ``max_prompt_tokens``) per run, then
    the bottom line; every line fits the console's width (80 in a log file) without cutting a name."""
    location = db.StoreLocation(store)
    # per run, with the Overview's own queries (one run each: its groups are that run's)
    ttft = pd.concat([db.read(location, queries.ttft_by_turn, [run_id]).assign(run_id=run_id)
                      for run_id in run_ids], ignore_index=True)
    pulled = db.read(location, queries.external_kv_tokens, run_ids)
    ext = pulled.groupby("run_id")["tokens"].max().to_dict()  # cumulative per run: its last value
    outs = db.read(location, run_report.outcomes, run_ids)
    stopped = db.read(location, run_report.stopped_early, run_ids)
    pd_failed = pd_check.pd_check_failures(store, run_ids)
    cold = db.read(location, run_report.cold_start, run_ids).set_index("run_id")
    canaries = db.read(location, queries.run_canaries, run_ids).set_index("run_id")
    runs = db.read(location, queries.runs).set_index("run_id")
    for run_id in run_ids:
        rows = ttft[ttft.run_id == run_id]
        what = (f": {runs.at[run_id, 'mode']}, history {runs.at[run_id, 'history_mode']}"
                if run_id in runs.index else "")
        console_text.print_text(console, f"{run_id}{what}")
        table = Table(show_lines=False)
        for col in ("turn", "turns", "TTFT p50 (ms)", "TTFT p90 (ms)"):
            table.add_column(col, justify="right", overflow="fold")
        for r in rows.itertuples():
            table.add_row(str(r.turn_index), str(r.turns), f"{r.ttft_p50_s * 1000:.0f}", f"{r.ttft_p90_s * 1000:.0f}")
        console_text.print_table(console, table)
        o = outs[outs.run_id == run_id]
        console_text.print_list(console, "  reuse: ", [f"{r.reuse}={r.turns}" for r in o.itertuples()])
        console_text.print_text(console, f"prefill external_kv_transfer tokens: {int(ext.get(run_id) or 0)}", "  ")
        if run_id in cold.index:
            console_text.print_text(console, cold_start_line(cold.loc[run_id]), "  ")
        if run_id in canaries.index:
            c = canaries.loc[run_id]
            console_text.print_text(console, f"known-answer canaries: {int(c.canaries)}, "
                                    f"{int(c.mismatched)} with wrong tokens, {int(c.errors)} failed", "  ")
        if run_id in pd_failed:
            console_text.print_text(console, f"FAILED: {pd_failed[run_id]}", "  ")
        cut = [f"{r.sessions} by {r.stop_reason} ({r.turns_not_sent} planned turns not sent)"
               for r in stopped[stopped.run_id == run_id].itertuples()]
        if cut:
            console_text.print_list(console, "  sessions stopped early: ", cut)
    print_bottom_line(store, run_ids)


def cold_start_line(row) -> str:
    """The summary's line on whether a run started cold (a row of ``run_report.cold_start``): what its
    first ok turn found cached, as vLLM counted that request (the run's own cache_salt should leave
    nothing to find; a cache tier the salt does not reach would)."""
    turn = (f"first turn (session {row.session_id}, turn {row.turn_index}, "
            f"{int(row.prompt_tokens or 0):,} prompt tokens)")
    if pd.isna(row.cold):
        return f"cold start: not checked, the {turn} carries no cached-token count"
    if row.cold:
        return f"cold start: checked, the {turn} found 0 tokens cached"
    local = int(row.local_hit_tokens)
    external = 0 if pd.isna(row.external_tokens) else int(row.external_tokens)
    where = "P" if row.counted_by == "prefill" else "the worker"
    return (f"NOT A COLD START: the {turn} found {local + external:,} tokens cached on {where} "
            f"({local:,} in its own prefix cache, {external:,} loaded from elsewhere)")


def bottom_line_blocks(ratios: list) -> list[list[str]]:
    """The bottom line's text, one block of lines per comparison (``analysis.headline.Ratio``):
    the comparison and history mode; the speed-up (``analysis.speedup``: the same number, label
    and verdict as the Overview's cards) with its CI; medians and counts; for an undecided
    verdict, the forecast sessions per side (``analysis.sample_size``)."""
    from analysis import headline, speedup

    pct = round(headline.CONFIDENCE * 100)
    out = []
    for r in ratios:
        s = speedup.of(r)
        lines = [
            (f"{r.treatment} vs {r.baseline} (history {r.history_mode or 'unknown'}, "
            f"workload {r.workload or 'unnamed'})"),
            (f"  {speedup.LABEL} {speedup.fmt(s.value)}, {pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)}: "
            f"{s.verdict.value}"),
            (f"  median TTFT {r.median_treatment_s * 1e3:.0f} vs {r.median_baseline_s * 1e3:.0f} ms over "
            f"{r.n_treatment} vs {r.n_baseline} turns ({r.sessions_treatment} vs {r.sessions_baseline} sessions)"),
        ]
        need = headline.sessions_needed(r)
        if need is not None:
            lines.append("  " + need.sentence())
        out.append(lines)
    return out


#: The middle regime, recorded on a ladder and not measured by the demo (README's headline table,
#: docs/eviction.md): P's own prefix cache evicting sessions between their turns.
EVICTION_LADDER = ("P's cache really evicts (recorded 2026-12-07 on the eviction ladder, idle, docs/eviction.md; "
                   "not this run): pd vs pd-bidir at 6 concurrent sessions, P's hit rate 33%: 6.68x "
                   "(95% CI 4.91-9.13x); at 2 sessions (hit rate 82%) no gain (1.01x); D full at 6 sessions")


def print_regimes() -> None:
    """After the demo's bottom line: the three regimes of P's prefix cache side by side, the demo's
    two ends (its cache always hits: ``pd`` vs ``pd-bidir``; its cache off: ``pd-nocache`` vs
    ``pd-bidir-nocache``) and the middle, recorded (:data:`EVICTION_LADDER`)."""
    console.print()
    console_text.print_text(console, "P's prefix cache, three regimes: always hits (pd vs pd-bidir above), off "
                                     "(pd-nocache vs pd-bidir-nocache above), and")
    console_text.print_text(console, EVICTION_LADDER, "  ")


def print_bottom_line(store: Path, run_ids: list[str]) -> None:
    """Print the Overview page's headline for these runs: each pair of analysis.headline.PAIRS
    with its speed-up (baseline / bidirectional median TTFT from the second turn on), 95% bootstrap
    CI by session, verdict and, when undecided, the sessions a decision needs (`bottom_line_blocks`)."""
    from analysis import headline, speedup
    from store import db, queries

    f = queries.TurnFilter(run_ids=tuple(run_ids))
    dstore = db.StoreLocation(store)
    samples = db.read(dstore, queries.ttft_samples, f, headline.MIN_TURN_INDEX, headline.MAX_CI_TURNS)
    stats = db.read(dstore, queries.ttft_stats, f, headline.MIN_TURN_INDEX)
    ratios = headline.headline_ratios(samples, stats=stats)
    if not ratios:
        return
    console.print()
    console_text.print_text(console, "Bottom line: TTFT from the second turn on (the dashboard's Overview)")
    console_text.print_text(console, speedup.MEANING + "; verdict: whether the 95% CI excludes 1")
    for line in schedule.describe_json(db.read(dstore, queries.run_schedules, run_ids)["schedule"]):
        console_text.print_text(console, line)
    for block in bottom_line_blocks(ratios):
        for line in block:
            console_text.print_text(console, line.strip(), "  " if line.startswith("  ") else "")


def compact_quietly(store: Path) -> None:
    """Compact the store's finished runs (`store.compact`: one file per table of a finished run);
    a failure is said, not raised: the shards stay as they are and every view still reads them."""
    from store.compact import compact_finished
    from store.writer import Store

    try:
        compact_finished(Store(store))
    except (OSError, ValueError, duckdb.Error) as exc:
        console.print(f"[yellow]compaction skipped[/yellow] ({exc}); `turnscope rollup` does it later",
                      highlight=False)


def roll_up_quietly(store: Path) -> None:
    """Compact (`compact_quietly`) and roll up the store's finished runs after a run (`turnscope
    rollup`); a failure is said, not raised: the rows are stored and the dashboard reads the plain
    views meanwhile."""
    from planner.recorded_whatif import whatif_ttl_d_limit
    from store.rollup import Rollups
    from store.writer import Store

    compact_quietly(store)
    try:
        Rollups(Store(store), whatif=whatif_ttl_d_limit).write_finished()
    except (OSError, duckdb.Error) as exc:
        console.print(f"[yellow]rollup skipped[/yellow] ({exc}); `turnscope rollup` makes it later", highlight=False)


def print_sweep_summary(store: Path, run_ids: list[str]) -> None:
    """Print mean / p90 TTFT (ms) per point and mode, with hits and P's external_kv_transfer tokens:
    one row per (prefix, mode), so the table fits 80 columns whatever the number of modes."""
    df = db.read(db.StoreLocation(store), run_report.sweep_summary, run_ids)
    for history, g in df.groupby("history_mode", sort=True):
        console_text.print_text(console, f"Sweep, history {history}: TTFT mean / p90 (ms) by prefix tokens; hits of "
                                         "later turns; P's external_kv_transfer tokens")
        modes = [m for m in SWEEP_MODES if m in set(g["mode"])] + sorted(set(g["mode"]) - set(SWEEP_MODES))
        table = Table()
        for col in ("prefix", "mode", "TTFT mean / p90", "hits", "P ext. tokens"):
            table.add_column(col, justify="left" if col == "mode" else "right", overflow="fold")
        for prefix, row in g.groupby("prefix_tokens", sort=True):
            for i, m in enumerate(modes):
                r = row[row["mode"] == m]
                if r.empty or r.iloc[0]["turns"] == 0:
                    table.add_row(str(prefix) if i == 0 else "", m, "-", "-", "-", end_section=i == len(modes) - 1)
                    continue
                r = r.iloc[0]
                table.add_row(str(prefix) if i == 0 else "", m, f"{r.ttft_mean_s * 1e3:.0f} / {r.ttft_p90_s * 1e3:.0f}",
                              f"{r.hits}/{r.later_turns}" if r.later_turns else "-", f"{int(r.external_kv_tokens)}",
                              end_section=i == len(modes) - 1)
        console_text.print_table(console, table)
