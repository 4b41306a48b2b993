"""The Sessions page's queries: task latency split per archetype, the session list and one
session's turns.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from store.queries.common import TurnFilter, as_filter, run_sql, where_sql

_TASK_SPLIT = """
SELECT mode, coalesce(archetype, 'unknown') AS archetype,
       count(*)                           AS sessions,
       avg(task_latency_s)                AS task_latency_s,
       quantile_cont(task_latency_s, 0.5) AS task_latency_p50_s,
       avg(llm_s)                         AS llm_s,
       avg(tool_wait_s)                   AS tool_wait_s,
       avg(think_s)                       AS think_s,
       avg(pause_s)                       AS pause_s
FROM session_tasks
WHERE {where} AND task_latency_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, archetype
"""


def task_split(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Mean task latency of finished sessions split into LLM time, tool wait, think and pause.

    By mode and archetype (``unknown`` when the session has none); the turn-kind and gap-kind
    filters do not apply to whole sessions. Columns: mode, archetype, sessions, task_latency_s
    (mean), task_latency_p50_s, llm_s (sum of the turns' E2E), tool_wait_s, think_s, pause_s
    (means, seconds per session). task_latency_s minus the four parts is the client's own time
    between turns (rendering, tokenizing).
    """
    return run_sql(con, _TASK_SPLIT.format(where=where_sql(as_filter(f), sessions=True)), as_filter(f).params())


_SESSION_LIST = """
SELECT run_id, run_label, mode,
       (SELECT r.history_mode FROM runs r WHERE r.run_id = session_tasks.run_id) AS history_mode,
       session_id, archetype, turns, task_latency_s, llm_s, tool_wait_s,
       think_s, pause_s, status, started_at, count(*) OVER () AS total
FROM session_tasks
WHERE {where}
ORDER BY task_latency_s DESC NULLS LAST, run_id, session_id
LIMIT $limit
"""


def session_list(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], limit: int = 500
) -> pd.DataFrame:
    """The sessions `f` keeps (runs and archetypes), slowest task first, at most `limit` rows.

    Columns: run_id, run_label, mode, session_id, archetype, turns, task_latency_s, llm_s,
    tool_wait_s, think_s, pause_s (seconds), status, started_at (UTC), total (sessions before
    the limit).
    """
    params = {**as_filter(f).params(), "limit": int(limit)}
    return run_sql(con, _SESSION_LIST.format(where=where_sql(as_filter(f), sessions=True)), params)


_SESSION_TURNS = """
SELECT run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at,
       epoch(sent_at - min(sent_at) OVER ()) AS start_s,
       ttft_s, e2e_s, status, coalesce(reuse, 'not recorded') AS reuse, prompt_tokens,
       completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s
FROM turn_rows
WHERE run_id = $run_id AND session_id = $session_id
ORDER BY turn_index
"""


def session_turns(con: duckdb.DuckDBPyConnection, run_id: str, session_id: str) -> pd.DataFrame:
    """Every turn of one session (any status), in order: the input of the session timeline.

    Columns: run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at (UTC),
    start_s (seconds from the session's first request to this one's), ttft_s, e2e_s, status,
    reuse, prompt_tokens, completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s.
    """
    return run_sql(con, _SESSION_TURNS, {"run_id": str(run_id), "session_id": str(session_id)})
