"""SQL over the store's views (data/schema.sql), one function per question.

Each function takes an open DuckDB connection (read-only, see `dashboard.db`) and returns a
pandas DataFrame. Times are in seconds (float64) as stored; instants are UTC timestamps.
`run_ids` always restricts the rows to those runs (the sidebar's selection); pass every run id
for "all runs". Only view names and columns of data/schema.sql are used here.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

#: The prefill worker's counter of prompt tokens by where their KV came from (vLLM /metrics).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: Its label value for tokens whose KV was pulled from another worker (D, over NIXL).
EXTERNAL_KV_SOURCE = "external_kv_transfer"

_RUNS = """
SELECT run_id, label, mode, workload, history_mode, model, status, started_at, finished_at
FROM runs
ORDER BY started_at DESC NULLS LAST, run_id
"""

_TTFT_BY_TURN = """
SELECT mode, workload, history_mode, turn_index,
       count(ttft_s)              AS turns,
       quantile_cont(ttft_s, 0.5) AS ttft_p50_s,
       quantile_cont(ttft_s, 0.9) AS ttft_p90_s
FROM turn_breakdown
WHERE list_contains($run_ids, run_id) AND status = 'ok' AND ttft_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, workload, history_mode, turn_index
"""

_TTFT_SAMPLES = """
SELECT run_id, mode, workload, history_mode, session_id, turn_index, ttft_s
FROM turn_breakdown
WHERE list_contains($run_ids, run_id) AND status = 'ok' AND ttft_s IS NOT NULL
  AND turn_index >= $min_turn_index
ORDER BY run_id, session_id, turn_index
"""

_REUSE_OUTCOMES = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse,
       count(*)                                          AS turns,
       count(*) FILTER (WHERE turn_index >= $min_turn_index) AS later_turns
FROM turn_breakdown
WHERE list_contains($run_ids, run_id)
GROUP BY ALL
ORDER BY mode, reuse
"""

_RUN_SUMMARY = """
SELECT *
FROM run_summary
WHERE list_contains($run_ids, run_id)
ORDER BY started_at NULLS LAST, run_id
"""

_PREFILL_COUNTER = """
WITH inc AS (
    SELECT run_id, endpoint, scraped_at, increase
    FROM metric_increases
    WHERE list_contains($run_ids, run_id) AND role = 'prefill' AND name = $name
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


def _ids(run_ids: Sequence[str]) -> list[str]:
    return [str(r) for r in run_ids]


def runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every run's latest status row (view ``runs``), newest first.

    Columns: run_id, label, mode, workload, history_mode, model, status, started_at,
    finished_at (UTC timestamps). One row per run.
    """
    return con.execute(_RUNS).df()


def ttft_by_turn(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """TTFT percentiles of ok turns by mode and turn index (0-based), pooled over `run_ids`.

    Columns: mode, workload, history_mode, turn_index, turns (count of ok turns with a TTFT),
    ttft_p50_s, ttft_p90_s (seconds, linear interpolation like ``mode_ab``). One row per
    (mode, workload, history_mode, turn_index).
    """
    return con.execute(_TTFT_BY_TURN, {"run_ids": _ids(run_ids)}).df()


def ttft_samples(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Raw TTFT of every ok turn with ``turn_index >= min_turn_index`` in `run_ids`.

    Columns: run_id, mode, workload, history_mode, session_id, turn_index, ttft_s (seconds).
    One row per turn; the input of the headline ratio (`dashboard.headline`).
    """
    params = {"run_ids": _ids(run_ids), "min_turn_index": int(min_turn_index)}
    return con.execute(_TTFT_SAMPLES, params).df()


def reuse_outcomes(
    con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Count of turns (any status) by mode and the proxy's reuse outcome.

    Columns: mode, reuse (outcome; ``not recorded`` where the turn has none, e.g. no proxy),
    turns (all turns), later_turns (turns with ``turn_index >= min_turn_index``, those that
    could reuse a handle). One row per (mode, reuse).
    """
    params = {"run_ids": _ids(run_ids), "min_turn_index": int(min_turn_index)}
    return con.execute(_REUSE_OUTCOMES, params).df()


def run_summary(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The ``run_summary`` view for `run_ids`, oldest first.

    Columns as in data/schema.sql: run_id, label, mode, workload, history_mode, status,
    started_at, finished_at, turns, ok_turns, failed_turns, hits, ttft_p50_s, ttft_p90_s,
    ttft_mean_s (seconds), reused_tokens (tokens). One row per run.
    """
    return con.execute(_RUN_SUMMARY, {"run_ids": _ids(run_ids)}).df()


def external_kv_tokens(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """Prompt tokens whose KV prefill workers pulled from elsewhere, cumulative over each run.

    From ``metric_increases`` (counter deltas that tolerate restarts) of
    ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` on ``role='prefill'``
    endpoints, summed over endpoints. The first scrape of each series counts 0, so tokens from
    before the run (workers reused across runs) are not counted.

    Columns: run_id, run_label, mode, endpoint, scraped_at (UTC), elapsed_s (seconds since the
    run's started_at, else since its first scrape), tokens (cumulative tokens, float). One row
    per scrape of a prefill endpoint, ordered by run and time.
    """
    params = {"run_ids": _ids(run_ids), "name": PROMPT_TOKENS_BY_SOURCE, "source": EXTERNAL_KV_SOURCE}
    return con.execute(_PREFILL_COUNTER, params).df()
