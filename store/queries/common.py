"""The queries' shared parts: the sidebar's `TurnFilter`, the ``turn_rows`` temp view, the
row filter and the runner, and the metric names the queries read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb
import pandas as pd


@dataclass(frozen=True)
class TurnFilter:
    """The rows the pages show. Each field is a tuple of str; an empty tuple means "all".

    `run_ids` is never "all": pass every run id for all runs (an empty tuple selects nothing).
    `archetypes` matches ``sessions.archetype`` (known once a session's row is written, at its
    end), `kinds` ``turns.kind`` and `gap_kinds` ``turns.gap_kind``. Hashable, so it can be a
    cache key.
    """

    run_ids: tuple[str, ...]
    archetypes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    gap_kinds: tuple[str, ...] = ()

    def params(self) -> dict[str, list[str]]:
        """The named parameters the ``_WHERE`` fragments use."""
        return {
            "run_ids": [str(r) for r in self.run_ids],
            "archetypes": [str(a) for a in self.archetypes],
            "kinds": [str(k) for k in self.kinds],
            "gap_kinds": [str(g) for g in self.gap_kinds],
        }

    @property
    def narrows_turns(self) -> bool:
        """True when archetype, kind or gap-kind filters are set (not only runs)."""
        return bool(self.archetypes or self.kinds or self.gap_kinds)


def as_filter(f: TurnFilter | Sequence[str]) -> TurnFilter:
    """`f` itself, or a `TurnFilter` of those run ids and nothing else."""
    return f if isinstance(f, TurnFilter) else TurnFilter(tuple(str(r) for r in f))


#: ``turn_rows``: ``turn_breakdown`` (data/schema.sql) without its archetype column, as a TEMP
#: view of each connection (temp objects are allowed on a read-only connection and vanish with
#: it). The view's archetype comes from a join on ``sessions`` that DuckDB performs even when the
#: column is unused, which costs 0.2-0.5 s per query at a million turns; the dashboard filters by
#: archetype with a semi-join instead (`where_sql`). tests/integration/test_dashboard_pages.py
#: checks that turn_rows holds exactly turn_breakdown's rows and columns, less the archetype.
TURN_ROWS_SQL = """
CREATE OR REPLACE TEMP VIEW turn_rows AS
SELECT t.*, r.mode, r.label AS run_label, r.workload, r.history_mode,
       t.e2e_s - t.ttft_s AS decode_s,
       greatest(t.ttft_s - coalesce(t.prefill_leg_s, 0), 0) AS after_prefill_s,
       CASE WHEN t.reuse IS NOT NULL
            THEN coalesce(t.reused_tokens, 0) + coalesce(t.prefill_cached_tokens, 0)
            ELSE t.cached_tokens END AS measured_reused_tokens
FROM turns t JOIN runs r USING (run_id)
"""


def where_sql(f: TurnFilter, alias: str = "", sessions: bool = False) -> str:
    """The row filter of `f` over turn_rows (or, with `sessions`, session_tasks: runs and
    archetypes only), parameterised by `TurnFilter.params`. Filters that are "all" are left
    out; an archetype filter on turns is a semi-join on ``sessions`` (the archetype lives on
    the session row)."""
    p = f"{alias}." if alias else ""
    parts = [f"list_contains($run_ids::VARCHAR[], {p}run_id)"]
    if f.archetypes and sessions:
        parts.append(f"list_contains($archetypes::VARCHAR[], {p}archetype)")
    elif f.archetypes:  # a semi-join on the sessions of those archetypes
        parts.append(
            f"({p}run_id, {p}session_id) IN (SELECT (run_id, session_id) FROM sessions "
            "WHERE list_contains($archetypes::VARCHAR[], archetype))"
        )
    if not sessions and f.kinds:
        parts.append(f"list_contains($kinds::VARCHAR[], {p}kind)")
    if not sessions and f.gap_kinds:
        parts.append(f"list_contains($gap_kinds::VARCHAR[], {p}gap_kind)")
    return "(" + " AND ".join(parts) + ")"


#: Reuse outcome label for turns without one (aggregated serving: no proxy).
NOT_RECORDED = "not recorded"
#: Proxy gauge of the bytes of KV that D holds for live handles.
HANDLE_BYTES = "turnscope_handle_bytes_live"
#: vLLM gauge of the KV cache in use, 0..1.
KV_USAGE = "vllm:kv_cache_usage_perc"

#: vLLM's counter of prompt tokens by where their KV came from (``PromptTokenStats``; the P/D check
#: reads it, ``analysis.pd_check``).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: Its label value for tokens whose KV was pulled from another worker (D, over NIXL).
EXTERNAL_KV_SOURCE = "external_kv_transfer"


def id_list(run_ids: Sequence[str]) -> list[str]:
    """``run_ids`` as a list of strings (a DuckDB ``VARCHAR[]`` parameter)."""
    return [str(r) for r in run_ids]


def run_sql(con: duckdb.DuckDBPyConnection, sql: str, params: dict) -> pd.DataFrame:
    """`sql` with the named `params` it uses (DuckDB refuses unused ones), as a DataFrame. The
    connection gets the ``turn_rows`` temp view first when `sql` reads it."""
    if "turn_rows" in sql:
        con.execute(TURN_ROWS_SQL)
    used = {k: v for k, v in params.items() if re.search(rf"\${k}\b", sql)}
    return con.execute(sql, used).df()
