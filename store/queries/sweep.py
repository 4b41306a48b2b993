"""The Sweep page's queries: a prefix sweep's points, turns and P's transfers.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from store.queries.common import (
    EXTERNAL_KV_SOURCE,
    PROMPT_TOKENS_BY_SOURCE,
    TurnFilter,
    as_filter,
    id_list,
    run_sql,
    where_sql,
)

_SWEEP_POINTS = """
SELECT run_id, label, mode, history_mode, status, started_at, finished_at, sweep_id, sweep_name,
       swept_field, sweep_scale, prefix_tokens, point_index, sessions, users
FROM sweep_points
WHERE list_contains($run_ids::VARCHAR[], run_id)
ORDER BY started_at DESC NULLS LAST, sweep_id, history_mode, prefix_tokens, mode
"""


def sweep_points(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The runs among `run_ids` that are points of a prefix sweep (view ``sweep_points``).

    Columns: run_id, label, mode, history_mode, status, started_at, finished_at (UTC), sweep_id,
    sweep_name, swept_field, sweep_scale, prefix_tokens (tokens), point_index, sessions, users.
    One row per run, newest first.
    """
    return run_sql(con, _SWEEP_POINTS, {"run_ids": id_list(run_ids)})


_SWEEP_TURNS = """
SELECT p.sweep_id, p.history_mode, p.prefix_tokens, t.run_id, t.mode, t.session_id, t.turn_index,
       t.status, t.ttft_s, t.prompt_tokens, t.expected_reusable_tokens, t.reuse, t.reused_tokens,
       t.prefill_cached_tokens
FROM sweep_points p JOIN turn_rows t ON t.run_id = p.run_id
WHERE {where} AND p.sweep_id = $sweep_id
ORDER BY p.history_mode, p.prefix_tokens, t.mode, t.run_id, t.session_id, t.turn_index
"""


def sweep_turns(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], sweep_id: str) -> pd.DataFrame:
    """Every turn (any status) of sweep `sweep_id` among the runs of `f` (its turn filters apply).

    Columns: sweep_id, history_mode, prefix_tokens (the point, tokens), run_id, mode, session_id,
    turn_index, status, ttft_s (seconds), prompt_tokens, expected_reusable_tokens, reuse,
    reused_tokens, prefill_cached_tokens (tokens). One row per turn.
    """
    ff = as_filter(f)
    return run_sql(con, _SWEEP_TURNS.format(where=where_sql(ff, "t")), ff.params() | {"sweep_id": str(sweep_id)})


_SWEEP_TRANSFER = """
WITH ext AS (
    SELECT run_id, sum(increase) AS external_kv_tokens
    FROM metric_increases
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'prefill' AND name = $name
      AND json_extract_string(labels, '$.source') = $source
    GROUP BY run_id
)
SELECT p.sweep_id, p.history_mode, p.prefix_tokens, p.mode, p.run_id,
       k.xfer_s, k.xfers, k.xfer_bytes, k.xfer_bytes_per_s, k.reused_tokens,
       c.kv_bytes_per_token, coalesce(ext.external_kv_tokens, 0) AS external_kv_tokens
FROM sweep_points p
LEFT JOIN run_kv_transfer k USING (run_id) LEFT JOIN run_config c USING (run_id) LEFT JOIN ext USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], p.run_id) AND p.sweep_id = $sweep_id
ORDER BY p.history_mode, p.prefix_tokens, p.mode, p.run_id
"""


def sweep_transfer(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], sweep_id: str) -> pd.DataFrame:
    """Per run of sweep `sweep_id` among `run_ids`: the prefill workers' measured NIXL transfers
    (``run_kv_transfer``: xfer_s seconds, xfers, xfer_bytes bytes, xfer_bytes_per_s bytes/s,
    reused_tokens tokens the proxy saw pulled), the model's kv_bytes_per_token (``run_config``)
    and external_kv_tokens: how much P's ``vllm:prompt_tokens_by_source_total{source=
    "external_kv_transfer"}`` rose (tokens vLLM says it pulled). Columns: sweep_id, history_mode,
    prefix_tokens, mode, run_id and those. One row per run.
    """
    params = {"run_ids": id_list(run_ids), "sweep_id": str(sweep_id), "name": PROMPT_TOKENS_BY_SOURCE,
              "source": EXTERNAL_KV_SOURCE}
    return run_sql(con, _SWEEP_TRANSFER, params)
