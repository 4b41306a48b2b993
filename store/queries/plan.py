"""The Plan page's SQL over the store's plan_* tables (docs/schema/plans.md): one function per query,
``(con, ...) -> DataFrame``, run through ``store.db.read``. Every row is a FORECAST. The queries of
per-strategy rows take the strategies' order (``planner.strategies.STRATEGIES``, the ledger's) as
``order``: a strategy not in it comes last, by name."""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd


def plans(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every plan, newest first: plan_id, label, created_at, profile_name, forecast_label, requests,
    notes (JSON text), profile (JSON text), settings (JSON text)."""
    return con.execute("SELECT plan_id, label, created_at, profile_name, forecast_label, requests, notes, profile, "
                       "settings FROM plan_log ORDER BY created_at DESC").df()


def speedups(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """The plan's speed-ups per mode pair (plan_speedups' columns)."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_speedups WHERE plan_id = ?", [plan_id]).df()


def outcomes(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """Requests per mode and outcome ('none' for aggregated): mode, outcome, requests."""
    return con.execute("SELECT mode, coalesce(outcome, 'none') AS outcome, count(*) AS requests FROM plan_requests "
                       "WHERE plan_id = ? GROUP BY ALL ORDER BY mode, requests DESC", [plan_id]).df()


def ttft_parts(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """Forecast TTFT per mode and the parts of it spent queueing: for the prefill (or aggregated)
    worker (the planner's FIFO queue, planner/queueing.py) and on D for room in its KV
    space (planner/decode_admission.py): mode, requests, ttft_mean_s, ttft_p50_s,
    ttft_p95_s, queue_wait_mean_s, queue_wait_p95_s (the prefill worker), decode_wait_mean_s
    (seconds; 0 for plans written before it), queue_share (both waits / TTFT, summed, 0..1; NULL
    when the TTFT sums to 0). Requests with no forecast TTFT are left out of the figures, not
    counted as 0."""
    return con.execute("""
        SELECT mode, count(ttft_s) AS requests,
               avg(ttft_s) AS ttft_mean_s, quantile_cont(ttft_s, 0.5) AS ttft_p50_s,
               quantile_cont(ttft_s, 0.95) AS ttft_p95_s,
               avg(coalesce(queue_wait_s, 0)) FILTER (WHERE ttft_s IS NOT NULL) AS queue_wait_mean_s,
               quantile_cont(coalesce(queue_wait_s, 0), 0.95) FILTER (WHERE ttft_s IS NOT NULL) AS queue_wait_p95_s,
               avg(coalesce(decode_wait_s, 0)) FILTER (WHERE ttft_s IS NOT NULL) AS decode_wait_mean_s,
               sum(coalesce(queue_wait_s, 0) + coalesce(decode_wait_s, 0)) FILTER (WHERE ttft_s IS NOT NULL)
                   / nullif(sum(ttft_s), 0) AS queue_share
        FROM plan_requests WHERE plan_id = ? GROUP BY mode ORDER BY mode""", [plan_id]).df()


def frontier(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """The plan's TTL x D-memory frontier (plan_frontier's columns)."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_frontier WHERE plan_id = ? "
                       "ORDER BY mode, decoder_kv_blocks_ttl_s, decode_kv_space_bytes", [plan_id]).df()


def sessions(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """Sessions whose pauses or edits defeat reuse, most tokens lost first."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_sessions WHERE plan_id = ? ORDER BY lost_tokens DESC",
                       [plan_id]).df()


def checks(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """The plan's turn-by-turn check against recorded runs (plan_checks' columns)."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_checks WHERE plan_id = ? "
                       "ORDER BY checked_run_id, session_id, turn_index", [plan_id]).df()


def ledger(con: duckdb.DuckDBPyConnection, plan_id: str, order: Sequence[str]) -> pd.DataFrame:
    """The plan's ledger of retention strategies (plan_ledger's columns; empty for a plan of
    `turnscope plan`, which writes none), in the ledger's order."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_ledger WHERE plan_id = ? ORDER BY list_position("
                       "?, strategy), strategy", [plan_id, list(order)]).df()


def recommendation(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """The plan's recommendation (plan_recommendations' columns; no row for a plan of `turnscope plan`)."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_recommendations WHERE plan_id = ?", [plan_id]).df()


def fleets(con: duckdb.DuckDBPyConnection, plan_id: str, order: Sequence[str]) -> pd.DataFrame:
    """The plan's fleet per retention strategy at its load (plan_fleets' columns: seconds, bytes,
    GiB x s, USD per million tokens; empty for a plan without a fleet search), in the ledger's order."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_fleets WHERE plan_id = ? ORDER BY list_position("
                       "?, strategy), strategy", [plan_id, list(order)]).df()


def load_curve(con: duckdb.DuckDBPyConnection, plan_id: str, order: Sequence[str]) -> pd.DataFrame:
    """Each strategy's fleet at several loads (plan_load_curve's columns), in the ledger's order of
    strategies, then by load (ascending, in ``load_kind``'s unit)."""
    return con.execute("SELECT * EXCLUDE (plan_id) FROM plan_load_curve WHERE plan_id = ? ORDER BY list_position("
                       "?, strategy), strategy, load_value", [plan_id, list(order)]).df()


def fleet_knees(con: duckdb.DuckDBPyConnection, plan_id: str) -> pd.DataFrame:
    """Each fleet of the plan's load curve and its knee (plan_load_curve's ``knee``: the highest load it
    serves at the SLO, every lower load of the curve too): strategy, prefill_workers, decode_workers,
    curve_points (loads forecast), knee_load_value (in ``load_kind``'s unit; NULL: it serves not even
    the lowest load); no row for a fleet not on the curve."""
    return con.execute("SELECT strategy, prefill_workers, decode_workers, count(*) AS curve_points, "
                       "max(load_value) FILTER (WHERE knee) AS knee_load_value FROM plan_load_curve "
                       "WHERE plan_id = ? GROUP BY ALL", [plan_id]).df()
