"""The Overview page's queries: runs, TTFT by turn and the headline's samples and exact
statistics, reuse outcomes, the run table and P's external KV tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from store import hit_rate
from store.queries.common import (
    EXTERNAL_KV_SOURCE,
    PROMPT_TOKENS_BY_SOURCE,
    TurnFilter,
    as_filter,
    id_list,
    run_sql,
    where_sql,
)

_RUNS = """
SELECT r.run_id, r.label, r.mode, r.workload, r.history_mode, r.model, r.status, r.started_at, r.finished_at,
       c.prefill_routing, c.decode_routing
FROM runs r LEFT JOIN run_config c USING (run_id)
ORDER BY r.started_at DESC NULLS LAST, r.run_id
"""

_TTFT_BY_TURN = """
SELECT mode, workload, history_mode, turn_index,
       count(ttft_s)              AS turns,
       quantile_cont(ttft_s, 0.5) AS ttft_p50_s,
       quantile_cont(ttft_s, 0.9) AS ttft_p90_s
FROM turn_rows
WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, workload, history_mode, turn_index
"""

# Whole sessions are sampled by a hash of (run_id, session_id), so the same sessions are kept on
# every call and a kept session keeps all its turns. mode, workload and history_mode are the run's
# (turn_rows joins runs), so a group's turn count is the sum of its runs' counts: the turns are read
# once (MATERIALIZED) and joined back on run_id only.
_TTFT_SAMPLES = """
WITH b AS MATERIALIZED (
    SELECT run_id, mode, workload, history_mode, session_id, turn_index, ttft_s
    FROM turn_rows
    WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL AND turn_index >= $min_turn_index
), per_run AS (
    SELECT run_id, any_value(mode) AS mode, any_value(workload) AS workload,
           any_value(history_mode) AS history_mode, count(*) AS run_turns
    FROM b GROUP BY run_id
), n AS (
    SELECT run_id, sum(run_turns) OVER (PARTITION BY mode, workload, history_mode) AS group_turns FROM per_run
)
SELECT b.run_id, b.mode, b.workload, b.history_mode, b.session_id, b.turn_index, b.ttft_s
FROM b JOIN n USING (run_id)
WHERE $max_turns::BIGINT IS NULL OR n.group_turns <= $max_turns::BIGINT
   OR hash(b.run_id, b.session_id) % 1000000 < 1000000.0 * $max_turns::BIGINT / n.group_turns
ORDER BY b.run_id, b.session_id, b.turn_index
"""

# Sessions are counted per run, then summed per group (a session belongs to one run).
_TTFT_STATS = """
WITH b AS MATERIALIZED (
    SELECT run_id, session_id, mode, workload, history_mode, ttft_s
    FROM turn_rows
    WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL AND turn_index >= $min_turn_index
), per_run AS (
    SELECT run_id, count(*) AS sessions FROM (SELECT run_id, session_id FROM b GROUP BY ALL) GROUP BY run_id
), session_counts AS (
    SELECT r.mode, r.workload, r.history_mode, sum(p.sessions) AS sessions
    FROM per_run p JOIN (SELECT run_id, any_value(mode) AS mode, any_value(workload) AS workload,
                                any_value(history_mode) AS history_mode FROM b GROUP BY run_id) r USING (run_id)
    GROUP BY ALL
), medians AS (
    SELECT mode, workload, history_mode, count(*) AS turns, quantile_cont(ttft_s, 0.5) AS ttft_p50_s
    FROM b
    GROUP BY ALL
)
SELECT m.mode, m.workload, m.history_mode, m.turns, CAST(s.sessions AS BIGINT) AS sessions, m.ttft_p50_s
FROM medians m JOIN session_counts s ON m.mode IS NOT DISTINCT FROM s.mode AND m.workload IS NOT DISTINCT FROM s.workload
                               AND m.history_mode IS NOT DISTINCT FROM s.history_mode
ORDER BY ALL
"""

_REUSE_OUTCOMES = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse,
       count(*)                                          AS turns,
       count(*) FILTER (WHERE turn_index >= $min_turn_index) AS later_turns
FROM turn_rows
WHERE {where}
GROUP BY ALL
ORDER BY mode, reuse
"""

_RUN_SUMMARY = f"""
WITH later AS (
    SELECT run_id, {hit_rate.counts_sql()}
    FROM turns WHERE list_contains($run_ids::VARCHAR[], run_id)
    GROUP BY run_id
), own_cache AS (
    SELECT run_id, sum(hit_tokens) / nullif(sum(queried_tokens), 0) AS {hit_rate.PREFIX_CACHE}
    FROM run_prefix_cache WHERE list_contains($run_ids::VARCHAR[], run_id)
    GROUP BY run_id
)
SELECT s.*, coalesce(later.later_turns, 0) AS later_turns, coalesce(later.later_hits, 0) AS later_hits,
       own_cache.{hit_rate.PREFIX_CACHE}
FROM run_summary s LEFT JOIN later USING (run_id) LEFT JOIN own_cache USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], s.run_id)
ORDER BY s.started_at NULLS LAST, s.run_id
"""

_PREFILL_COUNTER = """
WITH inc AS (
    SELECT run_id, endpoint, scraped_at, increase
    FROM metric_increases
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'prefill' AND name = $name
      AND json_extract_string(labels, '$.source') = $source
)
SELECT i.run_id, coalesce(r.label, i.run_id) AS run_label, r.mode, i.endpoint, i.scraped_at,
       epoch(i.scraped_at - coalesce(r.started_at, min(i.scraped_at) OVER (PARTITION BY i.run_id)))
           AS elapsed_s,
       sum(i.increase) OVER (PARTITION BY i.run_id ORDER BY i.scraped_at, i.endpoint
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS tokens
FROM inc i JOIN runs r USING (run_id)
ORDER BY i.run_id, i.scraped_at, i.endpoint
"""


def runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every run's latest status row (view ``runs``), newest first.

    Columns: run_id, label, mode, workload, history_mode, model, status, started_at,
    finished_at (UTC timestamps), prefill_routing, decode_routing (the proxy's policies, view
    ``run_config``; None when the run did not record them). One row per run.
    """
    return con.execute(_RUNS).df()


def ttft_by_turn(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """TTFT percentiles of ok turns by mode and turn index (0-based), pooled over the runs of `f`.

    Columns: mode, workload, history_mode, turn_index, turns (count of ok turns with a TTFT),
    ttft_p50_s, ttft_p90_s (seconds, linear interpolation like ``mode_ab``). One row per
    (mode, workload, history_mode, turn_index).
    """
    return run_sql(con, _TTFT_BY_TURN.format(where=where_sql(as_filter(f))), as_filter(f).params())


def ttft_samples(
    con: duckdb.DuckDBPyConnection,
    f: TurnFilter | Sequence[str],
    min_turn_index: int = 1,
    max_turns: int | None = None,
) -> pd.DataFrame:
    """Raw TTFT of the ok turns with ``turn_index >= min_turn_index`` that `f` keeps.

    With `max_turns`, a (mode, workload, history_mode) group of more turns is sampled by whole
    sessions (a hash of run and session id, so the same ones every time) to about `max_turns`
    turns: the bootstrap's input. Exact medians and counts come from `ttft_stats`.
    Columns: run_id, mode, workload, history_mode, session_id, turn_index, ttft_s (seconds).
    One row per turn (kept), ordered by run, session and turn.
    """
    params = {
        **as_filter(f).params(),
        "min_turn_index": int(min_turn_index),
        "max_turns": None if max_turns is None else int(max_turns),
    }
    return run_sql(con, _TTFT_SAMPLES.format(where=where_sql(as_filter(f))), params)


def ttft_stats(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Exact counts and median TTFT of the ok turns with ``turn_index >= min_turn_index`` that
    `f` keeps, per (mode, workload, history_mode): the headline's point estimates.

    Columns: mode, workload, history_mode, turns, sessions (distinct run and session),
    ttft_p50_s (seconds, linear interpolation: numpy's median).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return run_sql(con, _TTFT_STATS.format(where=where_sql(as_filter(f))), params)


def reuse_outcomes(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Count of turns (any status) by mode and the proxy's reuse outcome.

    Columns: mode, reuse (outcome; ``not recorded`` where the turn has none, e.g. no proxy),
    turns (all turns), later_turns (turns with ``turn_index >= min_turn_index``, those that
    could reuse a handle). One row per (mode, reuse).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return run_sql(con, _REUSE_OUTCOMES.format(where=where_sql(as_filter(f))), params)


def run_summary(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The ``run_summary`` view for `run_ids`, oldest first.

    Columns as in data/schema.sql: run_id, label, mode, workload, history_mode, status,
    started_at, finished_at, turns, ok_turns, failed_turns, hits, ttft_p50_s, ttft_p90_s,
    ttft_mean_s (seconds), reused_tokens (tokens), then later_turns and later_hits
    (``store.hit_rate``) and prefix_cache_hit_rate (the workers' own prefix cache,
    0..1, view ``run_prefix_cache``; NaN where no worker exposed the counters). One row per run.
    """
    return con.execute(_RUN_SUMMARY, {"run_ids": id_list(as_filter(run_ids).run_ids)}).df()


def external_kv_tokens(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Prompt tokens whose KV prefill workers pulled from elsewhere, cumulative over each run.

    From ``metric_increases`` (counter deltas that tolerate restarts) of
    ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` on ``role='prefill'``
    endpoints, summed over endpoints. The first scrape of each series counts 0, so tokens from
    before the run (workers reused across runs) are not counted.

    Columns: run_id, run_label, mode, endpoint, scraped_at (UTC), elapsed_s (seconds since the
    run's started_at, else since its first scrape), tokens (cumulative tokens, float). One row
    per scrape of a prefill endpoint, ordered by run and time.
    """
    params = {
        "run_ids": id_list(as_filter(run_ids).run_ids),
        "name": PROMPT_TOKENS_BY_SOURCE,
        "source": EXTERNAL_KV_SOURCE,
    }
    return run_sql(con, _PREFILL_COUNTER, params)



_DECODE_PROMPT_SOURCES = """
WITH t AS (
    SELECT run_id, count(*) FILTER (WHERE reuse IS NOT NULL) AS pd_turns
    FROM turns WHERE run_id IN (SELECT unnest($run_ids)) GROUP BY run_id
), d AS (
    SELECT run_id,
           sum(increase) FILTER (WHERE json_extract_string(labels, '$.source') = 'local_compute') AS local_compute,
           sum(increase) FILTER (WHERE json_extract_string(labels, '$.source') = 'external_kv_transfer') AS external_kv
    FROM metric_increases
    WHERE role = 'decode' AND name = $name AND run_id IN (SELECT unnest($run_ids))
    GROUP BY run_id
)
SELECT r.run_id, r.mode, coalesce(t.pd_turns, 0) AS pd_turns, d.local_compute, d.external_kv
FROM runs r LEFT JOIN t USING (run_id) LEFT JOIN d USING (run_id)
WHERE r.run_id IN (SELECT unnest($run_ids))
ORDER BY r.run_id
"""


def decode_prompt_sources(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Per run of ``run_ids``: the turns the proxy sent through P and where the decode worker's
    prompt tokens came from, the inputs of ``analysis.pd_check.failed_runs``, read on a DuckDB
    connection to the store's views.

    ``pd_turns``: turns with a reuse outcome (P answered and D was called). ``local_compute`` /
    ``external_kv``: how much :data:`PROMPT_TOKENS_BY_SOURCE` rose on ``role='decode'`` endpoints
    for ``source="local_compute"`` / ``"external_kv_transfer"`` (tokens, from the
    ``metric_increases`` view; NULL when D was not scraped). Returns a DataFrame with columns
    run_id, mode, pd_turns, local_compute, external_kv, one row per run.
    """
    return con.execute(_DECODE_PROMPT_SOURCES, {"run_ids": id_list(as_filter(run_ids).run_ids), "name": PROMPT_TOKENS_BY_SOURCE}).df()


_CANARIES = """
WITH c AS (
    SELECT run_id, canary_id, any_value(result) AS result,
           min(turn) FILTER (WHERE first_mismatch IS NOT NULL) AS first_turn,
           arg_min(first_mismatch, turn) FILTER (WHERE first_mismatch IS NOT NULL) AS first_token
    FROM run_canaries WHERE run_id IN (SELECT unnest($run_ids)) GROUP BY run_id, canary_id
)
SELECT run_id, count(*) AS canaries, count(*) FILTER (WHERE result = 'mismatch') AS mismatched,
       count(*) FILTER (WHERE result = 'error') AS errors, min(first_turn) AS first_turn,
       arg_min(first_token, first_turn) AS first_token
FROM c GROUP BY run_id ORDER BY run_id
"""


def run_canaries(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Per run of ``run_ids`` with known-answer canaries (the store's ``run_canaries``, one row per
    turn of each canary): ``canaries``, ``mismatched``, ``errors`` (counts of canaries by result)
    and the first mismatch's ``first_turn`` / ``first_token`` (NULL: none), the inputs of
    ``analysis.pd_check.canary_failures``. A DataFrame, one row per run."""
    return con.execute(_CANARIES, {"run_ids": id_list(as_filter(run_ids).run_ids)}).df()


_RUN_SCHEDULES = """
SELECT run_id, mode, history_mode, json_extract(workload_spec, '$.schedule')::VARCHAR AS schedule
FROM runs WHERE list_contains($run_ids, run_id)
ORDER BY started_at, run_id
"""


def run_schedules(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """How each run of `run_ids` was scheduled (``turnscope.conductor.schedule``: interleaved with the modes it
    is compared with, or sequential), from ``runs.workload_spec.schedule``.

    Columns: run_id, mode, history_mode, schedule (JSON text; NULL for a run that recorded none,
    e.g. one made before turnscope recorded schedules). One row per run, oldest first.
    """
    return con.execute(_RUN_SCHEDULES, {"run_ids": id_list(as_filter(run_ids).run_ids)}).df()
