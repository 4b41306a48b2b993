"""Read a finished evaluation back from the store: the numbers ``turnscope eval`` prints.

All queries run on a read-only DuckDB connection over the store's views (data/schema.sql), so a
report never blocks a writer.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd

from turnscope.core.store import connect_read_only

EXTERNAL_KV_METRIC = "vllm:prompt_tokens_by_source_total"


def _connect(store: Path) -> duckdb.DuckDBPyConnection:
    return connect_read_only(store)


def ttft_by_turn(store: Path, run_ids: list[str]) -> pd.DataFrame:
    """Per run and turn index: ok turns, TTFT p50 and p90 (seconds; linear interpolation,
    DuckDB ``quantile_cont``). Columns: run_id, mode, history_mode, turn_index, turns, ttft_p50_s,
    ttft_p90_s."""
    with _connect(store) as con:
        return con.execute("""
            SELECT run_id, mode, history_mode, turn_index, count(*) AS turns,
                   quantile_cont(ttft_s, 0.5) AS ttft_p50_s, quantile_cont(ttft_s, 0.9) AS ttft_p90_s
            FROM turn_breakdown WHERE status = 'ok' AND run_id IN (SELECT unnest($1))
            GROUP BY ALL ORDER BY run_id, turn_index""", [run_ids]).df()


def outcomes(store: Path, run_ids: list[str]) -> pd.DataFrame:
    """Per run and reuse outcome: turn count. Columns: run_id, reuse, turns."""
    with _connect(store) as con:
        return con.execute("""
            SELECT run_id, coalesce(reuse, 'n/a') AS reuse, count(*) AS turns
            FROM turns WHERE run_id IN (SELECT unnest($1)) GROUP BY ALL ORDER BY run_id, turns DESC""",
                           [run_ids]).df()


def stopped_early(store: Path, run_ids: list[str]) -> pd.DataFrame:
    """Per run and stop reason, the sessions that ended before their plan's last turn (``sessions.
    stop_reason`` other than ``complete``; rows written before that column existed are left out).
    Columns: run_id, stop_reason, sessions, turns_not_sent (planned_turns - turns, summed)."""
    with _connect(store) as con:
        return con.execute("""
            SELECT run_id, stop_reason, count(*) AS sessions,
                   sum(planned_turns - turns)::BIGINT AS turns_not_sent
            FROM sessions
            WHERE stop_reason IS NOT NULL AND stop_reason <> 'complete' AND run_id IN (SELECT unnest($1))
            GROUP BY ALL ORDER BY run_id, stop_reason""", [run_ids]).df()


def external_kv_tokens(store: Path, run_ids: list[str]) -> pd.DataFrame:
    """Per run: how much the prefill worker's ``prompt_tokens_by_source_total{source=
    "external_kv_transfer"}`` rose during the run (tokens P pulled from D, restarts handled by
    the ``metric_increases`` view). Columns: run_id, external_kv_tokens."""
    with _connect(store) as con:
        return con.execute("""
            SELECT run_id, sum(increase) AS external_kv_tokens
            FROM metric_increases
            WHERE role = 'prefill' AND name = $2 AND json_extract_string(labels, '$.source') = 'external_kv_transfer'
              AND run_id IN (SELECT unnest($1))
            GROUP BY run_id ORDER BY run_id""", [run_ids, EXTERNAL_KV_METRIC]).df()


def sweep_summary(store: Path, run_ids: list[str]) -> pd.DataFrame:
    """Per run of a prefix sweep (view ``sweep_points``): its mode, history mode and point, ok
    turns, mean and p90 TTFT (seconds; ``quantile_cont``), hits, turns after the first, and how
    much P's ``external_kv_transfer`` counter rose (tokens pulled from D). Columns: run_id,
    sweep_id, mode, history_mode, prefix_tokens, turns, ttft_mean_s, ttft_p90_s, hits,
    later_turns, external_kv_tokens. Runs that are not sweep points are left out."""
    with _connect(store) as con:
        return con.execute("""
            WITH t AS (
                SELECT run_id, count(*) FILTER (WHERE status = 'ok') AS turns,
                       avg(ttft_s) FILTER (WHERE status = 'ok') AS ttft_mean_s,
                       quantile_cont(ttft_s, 0.9) FILTER (WHERE status = 'ok') AS ttft_p90_s,
                       count(*) FILTER (WHERE reuse = 'hit') AS hits,
                       count(*) FILTER (WHERE turn_index >= 1) AS later_turns
                FROM turns WHERE run_id IN (SELECT unnest($1)) GROUP BY run_id
            ), x AS (
                SELECT run_id, sum(increase) AS external_kv_tokens
                FROM metric_increases
                WHERE role = 'prefill' AND name = $2
                  AND json_extract_string(labels, '$.source') = 'external_kv_transfer'
                  AND run_id IN (SELECT unnest($1))
                GROUP BY run_id
            )
            SELECT p.run_id, p.sweep_id, p.mode, p.history_mode, p.prefix_tokens, coalesce(t.turns, 0) AS turns,
                   t.ttft_mean_s, t.ttft_p90_s, coalesce(t.hits, 0) AS hits,
                   coalesce(t.later_turns, 0) AS later_turns, coalesce(x.external_kv_tokens, 0) AS external_kv_tokens
            FROM sweep_points p LEFT JOIN t USING (run_id) LEFT JOIN x USING (run_id)
            WHERE p.run_id IN (SELECT unnest($1))
            ORDER BY p.history_mode, p.prefix_tokens, p.mode""", [run_ids, EXTERNAL_KV_METRIC]).df()
