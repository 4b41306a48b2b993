"""SQL over the store's views (data/schema.sql), one function per question.

Each function takes an open DuckDB connection (read-only, see `store.db`) and returns a
pandas DataFrame. Times are in seconds (float64) as stored; instants are UTC timestamps.
Rows are restricted by a `TurnFilter` (the sidebar's selection: runs, archetypes, turn kinds, gap
kinds); a plain sequence of run ids means "these runs, every archetype and kind". Only view
names and columns of data/schema.sql are used here.

One module per page (`overview`, `turns`, `sessions`, `memory`, `compare`, `sweep`, the
sidebar's `sidebar`) and their shared `common` parts; the pages' queries are re-exported here, so
a page calls ``queries.<function>`` and a search for a function finds its module and its callers.
The Traffic, Plan and capacity pages and the other readers import their module by name
(`traffic`, `plan`, `capacity`, `run_report`, `planner_runs`, `recorded_runs`, `ttft_split`,
`worker_cache`, `serve_runs`). A query is SQL and what it needs to run it; logic over its rows sits above the
store (docs/design.md).
"""

from __future__ import annotations

from store.queries.common import (
    EXTERNAL_KV_SOURCE,
    HANDLE_BYTES,
    KV_USAGE,
    NOT_RECORDED,
    PROMPT_TOKENS_BY_SOURCE,
    TURN_ROWS_SQL,
    TurnFilter,
    as_filter,
)
from store.queries.compare import compare_samples, compare_stats, side_hit_rates
from store.queries.memory import (
    cache_config,
    decode_kv_space,
    hit_rate_timeline,
    memory_timeline,
    reuse_cost,
    run_config,
    whatif_ttl,
)
from store.queries.overview import (
    decode_prompt_sources,
    external_kv_tokens,
    reuse_outcomes,
    run_canaries,
    run_schedules,
    run_summary,
    runs,
    ttft_by_turn,
    ttft_samples,
    ttft_stats,
)
from store.queries.sessions import session_list, session_turns, task_split
from store.queries.sidebar import GAP_KINDS, TURN_KINDS, filter_options
from store.queries.sweep import sweep_points, sweep_transfer, sweep_turns
from store.queries.turns import (
    REUSE_FROM_D_MODES,
    kv_transfer,
    latency_by,
    reuse_shortfalls,
    reuse_vs_expected,
    server_side,
    time_split,
    xfer_rates,
)

__all__ = ["EXTERNAL_KV_SOURCE", "GAP_KINDS", "HANDLE_BYTES", "KV_USAGE", "NOT_RECORDED", "PROMPT_TOKENS_BY_SOURCE", "REUSE_FROM_D_MODES", "TURN_KINDS", "TURN_ROWS_SQL", "TurnFilter", "as_filter", "cache_config", "compare_samples", "compare_stats", "decode_kv_space", "decode_prompt_sources", "external_kv_tokens", "filter_options", "hit_rate_timeline", "kv_transfer", "latency_by", "memory_timeline", "reuse_cost", "reuse_outcomes", "reuse_shortfalls", "reuse_vs_expected", "run_canaries", "run_config", "run_schedules", "run_summary", "runs", "server_side", "session_list", "session_turns", "side_hit_rates", "sweep_points", "sweep_transfer", "sweep_turns", "task_split", "time_split", "ttft_by_turn", "ttft_samples", "ttft_stats", "whatif_ttl", "xfer_rates"]
