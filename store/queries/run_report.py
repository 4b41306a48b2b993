"""The read-backs only the commands' run reports need, per run: reuse outcomes, sessions that
stopped early, a prefix sweep's points (``turnscope.commands.summaries``; TTFT by turn index and P's
pulled tokens come from the Overview's own queries, ``store.queries.overview``).

Each takes a read-only DuckDB connection over the store's views (data/schema.sql), as every query
module does (``store.db.read``), so a report never blocks a writer.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from store import hit_rate
from store.queries.common import EXTERNAL_KV_SOURCE, PROMPT_TOKENS_BY_SOURCE


def outcomes(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> pd.DataFrame:
    """Per run and reuse outcome: turn count. Columns: run_id, reuse, turns."""
    return con.execute("""
            SELECT run_id, coalesce(reuse, 'n/a') AS reuse, count(*) AS turns
            FROM turns WHERE run_id IN (SELECT unnest($1)) GROUP BY ALL ORDER BY run_id, turns DESC""",
                           [run_ids]).df()


def stopped_early(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> pd.DataFrame:
    """Per run and stop reason, the sessions that ended before their plan's last turn (``sessions.
    stop_reason`` other than ``complete``; rows written before that column existed are left out).
    Columns: run_id, stop_reason, sessions, turns_not_sent (planned_turns - turns, summed)."""
    return con.execute("""
            SELECT run_id, stop_reason, count(*) AS sessions,
                   sum(planned_turns - turns)::BIGINT AS turns_not_sent
            FROM sessions
            WHERE stop_reason IS NOT NULL AND stop_reason <> 'complete' AND run_id IN (SELECT unnest($1))
            GROUP BY ALL ORDER BY run_id, stop_reason""", [run_ids]).df()


def sweep_summary(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> pd.DataFrame:
    """Per run of a prefix sweep (view ``sweep_points``): its mode, history mode and point, ok
    turns, mean and p90 TTFT (seconds; ``quantile_cont``), hits and later turns (:mod:`store.hit_rate`), and how
    much P's ``external_kv_transfer`` counter rose (tokens pulled from D). Columns: run_id,
    sweep_id, mode, history_mode, prefix_tokens, turns, ttft_mean_s, ttft_p90_s, hits,
    later_turns, external_kv_tokens. Runs that are not sweep points are left out."""
    return con.execute(f"""
            WITH t AS (
                SELECT run_id, count(*) FILTER (WHERE status = 'ok') AS turns,
                       avg(ttft_s) FILTER (WHERE status = 'ok') AS ttft_mean_s,
                       quantile_cont(ttft_s, 0.9) FILTER (WHERE status = 'ok') AS ttft_p90_s,
                       {hit_rate.counts_sql()}
                FROM turns WHERE run_id IN (SELECT unnest($1)) GROUP BY run_id
            ), x AS (
                SELECT run_id, sum(increase) AS external_kv_tokens
                FROM metric_increases
                WHERE role = 'prefill' AND name = $2
                  AND json_extract_string(labels, '$.source') = $3
                  AND run_id IN (SELECT unnest($1))
                GROUP BY run_id
            )
            SELECT p.run_id, p.sweep_id, p.mode, p.history_mode, p.prefix_tokens, coalesce(t.turns, 0) AS turns,
                   t.ttft_mean_s, t.ttft_p90_s, coalesce(t.{hit_rate.HITS}, 0) AS hits,
                   coalesce(t.later_turns, 0) AS later_turns, coalesce(x.external_kv_tokens, 0) AS external_kv_tokens
            FROM sweep_points p LEFT JOIN t USING (run_id) LEFT JOIN x USING (run_id)
            WHERE p.run_id IN (SELECT unnest($1))
            ORDER BY p.history_mode, p.prefix_tokens, p.mode""",
                       [run_ids, PROMPT_TOKENS_BY_SOURCE, EXTERNAL_KV_SOURCE]).df()
