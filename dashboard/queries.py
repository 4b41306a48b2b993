"""SQL over the store's views (data/schema.sql), one function per question.

Each function takes an open DuckDB connection (read-only, see `dashboard.db`) and returns a
pandas DataFrame. Times are in seconds (float64) as stored; instants are UTC timestamps.
Rows are restricted by a `TurnFilter` (the sidebar's selection: runs, archetypes, turn kinds, gap
kinds); a plain sequence of run ids means "these runs, every archetype and kind". Only view
names and columns of data/schema.sql are used here.
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


# Row filters over turn_breakdown (turns) and session_tasks (sessions), parameterised by
# TurnFilter.params(). The empty-list casts give DuckDB the list's type.
_WHERE_TURNS = """list_contains($run_ids::VARCHAR[], run_id)
  AND (len($archetypes::VARCHAR[]) = 0 OR list_contains($archetypes::VARCHAR[], archetype))
  AND (len($kinds::VARCHAR[]) = 0 OR list_contains($kinds::VARCHAR[], kind))
  AND (len($gap_kinds::VARCHAR[]) = 0 OR list_contains($gap_kinds::VARCHAR[], gap_kind))"""
_WHERE_SESSIONS = """list_contains($run_ids::VARCHAR[], run_id)
  AND (len($archetypes::VARCHAR[]) = 0 OR list_contains($archetypes::VARCHAR[], archetype))"""

#: Reuse outcome label for turns without one (aggregated serving: no proxy).
NOT_RECORDED = "not recorded"
#: Proxy gauge of the bytes of KV that D holds for live handles.
HANDLE_BYTES = "turnscope_handle_bytes_live"
#: vLLM gauge of the KV cache in use, 0..1.
KV_USAGE = "vllm:kv_cache_usage_perc"

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
WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, workload, history_mode, turn_index
"""

_TTFT_SAMPLES = """
SELECT run_id, mode, workload, history_mode, session_id, turn_index, ttft_s
FROM turn_breakdown
WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL
  AND turn_index >= $min_turn_index
ORDER BY run_id, session_id, turn_index
"""

_REUSE_OUTCOMES = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse,
       count(*)                                          AS turns,
       count(*) FILTER (WHERE turn_index >= $min_turn_index) AS later_turns
FROM turn_breakdown
WHERE {where}
GROUP BY ALL
ORDER BY mode, reuse
"""

_RUN_SUMMARY = """
SELECT *
FROM run_summary
WHERE list_contains($run_ids::VARCHAR[], run_id)
ORDER BY started_at NULLS LAST, run_id
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


def _ids(run_ids: Sequence[str]) -> list[str]:
    return [str(r) for r in run_ids]


def _run(con: duckdb.DuckDBPyConnection, sql: str, params: dict) -> pd.DataFrame:
    """`sql` with the named `params` it uses (DuckDB refuses unused ones), as a DataFrame."""
    used = {k: v for k, v in params.items() if re.search(rf"\${k}\b", sql)}
    return con.execute(sql, used).df()


def runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every run's latest status row (view ``runs``), newest first.

    Columns: run_id, label, mode, workload, history_mode, model, status, started_at,
    finished_at (UTC timestamps). One row per run.
    """
    return con.execute(_RUNS).df()


def ttft_by_turn(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """TTFT percentiles of ok turns by mode and turn index (0-based), pooled over the runs of `f`.

    Columns: mode, workload, history_mode, turn_index, turns (count of ok turns with a TTFT),
    ttft_p50_s, ttft_p90_s (seconds, linear interpolation like ``mode_ab``). One row per
    (mode, workload, history_mode, turn_index).
    """
    return _run(con, _TTFT_BY_TURN.format(where=_WHERE_TURNS), as_filter(f).params())


def ttft_samples(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Raw TTFT of every ok turn with ``turn_index >= min_turn_index`` that `f` keeps.

    Columns: run_id, mode, workload, history_mode, session_id, turn_index, ttft_s (seconds).
    One row per turn; the input of the headline ratio (`dashboard.headline`).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return _run(con, _TTFT_SAMPLES.format(where=_WHERE_TURNS), params)


def reuse_outcomes(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Count of turns (any status) by mode and the proxy's reuse outcome.

    Columns: mode, reuse (outcome; ``not recorded`` where the turn has none, e.g. no proxy),
    turns (all turns), later_turns (turns with ``turn_index >= min_turn_index``, those that
    could reuse a handle). One row per (mode, reuse).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return _run(con, _REUSE_OUTCOMES.format(where=_WHERE_TURNS), params)


def run_summary(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The ``run_summary`` view for `run_ids`, oldest first.

    Columns as in data/schema.sql: run_id, label, mode, workload, history_mode, status,
    started_at, finished_at, turns, ok_turns, failed_turns, hits, ttft_p50_s, ttft_p90_s,
    ttft_mean_s (seconds), reused_tokens (tokens). One row per run.
    """
    return con.execute(_RUN_SUMMARY, {"run_ids": _ids(as_filter(run_ids).run_ids)}).df()


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
        "run_ids": _ids(as_filter(run_ids).run_ids),
        "name": PROMPT_TOKENS_BY_SOURCE,
        "source": EXTERNAL_KV_SOURCE,
    }
    return _run(con, _PREFILL_COUNTER, params)


# --- filters ----------------------------------------------------------------------------------

_FILTER_OPTIONS = """
SELECT 'archetype' AS field, archetype AS value, count(*) AS n
FROM session_tasks WHERE list_contains($run_ids::VARCHAR[], run_id) AND archetype IS NOT NULL GROUP BY ALL
UNION ALL
SELECT 'kind', kind, count(*) FROM turns
WHERE list_contains($run_ids::VARCHAR[], run_id) AND kind IS NOT NULL GROUP BY ALL
UNION ALL
SELECT 'gap_kind', gap_kind, count(*) FROM turns
WHERE list_contains($run_ids::VARCHAR[], run_id) AND gap_kind IS NOT NULL GROUP BY ALL
ORDER BY field, value
"""


def filter_options(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The values the sidebar's archetype, turn-kind and gap-kind filters can take in `run_ids`.

    Columns: field (``archetype`` | ``kind`` | ``gap_kind``), value, n (sessions for archetypes,
    turns otherwise). One row per (field, value) present.
    """
    return _run(con, _FILTER_OPTIONS, {"run_ids": _ids(run_ids)})


# --- Turns --------------------------------------------------------------------------------------

_LATENCY_BY_TURN = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse, turn_index AS x,
       count(*)                      AS turns,
       quantile_cont(ttft_s, 0.5)    AS ttft_p50_s,
       quantile_cont(itl_p50_s, 0.5) AS itl_p50_s,
       quantile_cont(e2e_s, 0.5)     AS e2e_p50_s
FROM turn_breakdown
WHERE {where} AND status = 'ok'
GROUP BY ALL
ORDER BY mode, reuse, x
"""

# Prompt length in tokens (the history plus the new turn), in bins of a "nice" width (1, 2 or 5
# x a power of ten) giving about $bins bins.
_LATENCY_BY_HISTORY = """
WITH f AS (
    SELECT mode, coalesce(reuse, 'not recorded') AS reuse, prompt_tokens, ttft_s, itl_p50_s, e2e_s
    FROM turn_breakdown
    WHERE {where} AND status = 'ok' AND prompt_tokens IS NOT NULL
), w AS (
    SELECT greatest(max(prompt_tokens) / $bins, 1) AS w0 FROM f
), n AS (
    SELECT w0, pow(10, floor(log10(w0))) AS mag FROM w
), width AS (
    SELECT mag * CASE WHEN w0 <= mag THEN 1 WHEN w0 <= 2 * mag THEN 2 WHEN w0 <= 5 * mag THEN 5 ELSE 10 END
               AS bin_tokens
    FROM n
)
SELECT mode, reuse, floor(prompt_tokens / bin_tokens) * bin_tokens AS x, any_value(bin_tokens) AS bin_tokens,
       count(*)                      AS turns,
       quantile_cont(ttft_s, 0.5)    AS ttft_p50_s,
       quantile_cont(itl_p50_s, 0.5) AS itl_p50_s,
       quantile_cont(e2e_s, 0.5)     AS e2e_p50_s
FROM f CROSS JOIN width
GROUP BY mode, reuse, x
ORDER BY mode, reuse, x
"""


def latency_by(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], by: str = "turn_index", bins: int = 20
) -> pd.DataFrame:
    """Median TTFT, ITL and E2E of ok turns by mode and reuse outcome, against `by`.

    `by`: ``turn_index`` (x = the 0-based turn index) or ``history`` (x = the lower edge of the
    turn's prompt-length bin in tokens; bins of a 1/2/5 x 10^k width, about `bins` of them).
    Columns: mode, reuse (outcome, ``not recorded`` without a proxy), x, turns (count),
    ttft_p50_s, itl_p50_s (median over turns of each turn's median inter-token latency),
    e2e_p50_s (seconds), and with ``history`` also bin_tokens (the bin width). One row per
    (mode, reuse, x).
    """
    ff = as_filter(f)
    if by == "turn_index":
        return _run(con, _LATENCY_BY_TURN.format(where=_WHERE_TURNS), ff.params())
    if by == "history":
        params = {**ff.params(), "bins": max(int(bins), 1)}
        return _run(con, _LATENCY_BY_HISTORY.format(where=_WHERE_TURNS), params)
    raise ValueError(f"latency_by: by must be 'turn_index' or 'history', got {by!r}")


_TIME_SPLIT = """
WITH f AS (
    SELECT t.mode, t.turn_index, t.ttft_s, t.e2e_s, t.prefill_leg_s, t.reused_tokens,
           k.xfer_s_per_token,
           t.prefill_leg_s IS NOT NULL AS split,
           -- least() skips NULLs in DuckDB: without a measured rate the estimate is NULL (counted 0)
           CASE WHEN coalesce(t.reused_tokens, 0) = 0 THEN 0.0
                WHEN k.xfer_s_per_token IS NULL OR t.prefill_leg_s IS NULL THEN NULL
                ELSE least(t.reused_tokens * k.xfer_s_per_token, t.prefill_leg_s) END AS xfer_est_s
    FROM turn_breakdown t LEFT JOIN run_kv_transfer k USING (run_id)
    WHERE {where} AND t.status = 'ok' AND t.ttft_s IS NOT NULL AND t.e2e_s IS NOT NULL
)
SELECT mode, turn_index,
       count(*)                                                                  AS turns,
       count(*) FILTER (WHERE split)                                             AS split_turns,
       avg(CASE WHEN split THEN greatest(ttft_s - prefill_leg_s, 0) ELSE 0 END)  AS proxy_s,
       avg(CASE WHEN split THEN prefill_leg_s - coalesce(xfer_est_s, 0) ELSE 0 END) AS prefill_s,
       avg(CASE WHEN split THEN coalesce(xfer_est_s, 0) ELSE 0 END)              AS kv_transfer_est_s,
       avg(e2e_s - ttft_s)                                                       AS decode_s,
       avg(CASE WHEN split THEN 0 ELSE ttft_s END)                               AS unsplit_ttft_s,
       avg(e2e_s)                                                                AS e2e_mean_s,
       count(*) FILTER (WHERE split AND coalesce(reused_tokens, 0) > 0 AND xfer_s_per_token IS NULL)
                                                                                 AS transfer_unknown_turns
FROM f
GROUP BY ALL
ORDER BY mode, turn_index
"""


def time_split(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Where each ok turn's time went, averaged by mode and turn index (seconds per turn).

    Per turn, with the proxy's prefill leg known (P/D modes):
    proxy_s = TTFT - prefill leg (proxy, queueing, D's pull of P's KV and D's first token);
    kv_transfer_est_s = reused_tokens x the run's measured NIXL seconds per pulled token
    (``run_kv_transfer``; an estimate, transfers are not timed per turn), at most the prefill leg;
    prefill_s = prefill leg - that estimate; decode_s = E2E - TTFT. Without a prefill leg
    (aggregated) the whole TTFT is unsplit_ttft_s. The five means add up to e2e_mean_s.
    Columns: mode, turn_index, turns, split_turns, proxy_s, prefill_s, kv_transfer_est_s,
    decode_s, unsplit_ttft_s, e2e_mean_s, transfer_unknown_turns (turns that pulled tokens in a
    run without a NIXL timing, counted as 0 transfer time).
    """
    return _run(con, _TIME_SPLIT.format(where=_WHERE_TURNS), as_filter(f).params())


_REUSE_VS_EXPECTED = """
SELECT mode, turn_index,
       count(*)                          AS turns,
       avg(expected_reusable_tokens)     AS expected_tokens,
       avg(measured_reused_tokens)       AS measured_tokens,
       count(*) FILTER (WHERE expected_reusable_tokens - measured_reused_tokens >= $min_shortfall)
                                         AS short_turns
FROM turn_breakdown
WHERE {where} AND status = 'ok' AND turn_index >= 1
  AND expected_reusable_tokens IS NOT NULL AND measured_reused_tokens IS NOT NULL
GROUP BY ALL
ORDER BY mode, turn_index
"""


def reuse_vs_expected(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_shortfall_tokens: int = 128
) -> pd.DataFrame:
    """Expected against measured reuse of ok later turns (turn_index >= 1), by mode and turn index.

    expected: ``expected_reusable_tokens`` (the longest common prefix of the previous turn's
    prompt + output ids and this prompt's ids); measured: ``turn_breakdown.measured_reused_tokens``
    (P's pull from D plus P's prefix-cache hit; the server's cached_tokens without a proxy). Turns
    lacking either are left out. Columns: mode, turn_index, turns, expected_tokens,
    measured_tokens (means, tokens per turn), short_turns (turns whose shortfall is at least
    `min_shortfall_tokens`).
    """
    params = {**as_filter(f).params(), "min_shortfall": int(min_shortfall_tokens)}
    return _run(con, _REUSE_VS_EXPECTED.format(where=_WHERE_TURNS), params)


_REUSE_SHORTFALLS = """
SELECT run_id, run_label, mode, session_id, turn_index, kind, gap_kind, gap_before_s, reuse,
       expected_reusable_tokens, measured_reused_tokens,
       expected_reusable_tokens - measured_reused_tokens AS shortfall_tokens,
       reused_tokens, prefill_cached_tokens, cached_tokens, divergence_position, handle_age_s,
       count(*) OVER () AS total
FROM turn_breakdown
WHERE {where} AND status = 'ok' AND turn_index >= 1
  AND expected_reusable_tokens IS NOT NULL AND measured_reused_tokens IS NOT NULL
  AND expected_reusable_tokens - measured_reused_tokens >= $min_shortfall
ORDER BY shortfall_tokens DESC, run_id, session_id, turn_index
LIMIT $limit
"""


def reuse_shortfalls(
    con: duckdb.DuckDBPyConnection,
    f: TurnFilter | Sequence[str],
    min_shortfall_tokens: int = 128,
    limit: int = 200,
) -> pd.DataFrame:
    """The ok later turns where the engine reused at least `min_shortfall_tokens` fewer tokens
    than expected (see `reuse_vs_expected`), the largest shortfall first, at most `limit` rows.

    Columns: run_id, run_label, mode, session_id, turn_index, kind, gap_kind, gap_before_s (s),
    reuse, expected_reusable_tokens, measured_reused_tokens, shortfall_tokens, reused_tokens,
    prefill_cached_tokens, cached_tokens, divergence_position, handle_age_s (s), total (number of
    such turns before the limit).
    """
    params = {**as_filter(f).params(), "min_shortfall": int(min_shortfall_tokens), "limit": int(limit)}
    return _run(con, _REUSE_SHORTFALLS.format(where=_WHERE_TURNS), params)


# --- Sessions -----------------------------------------------------------------------------------

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
    return _run(con, _TASK_SPLIT.format(where=_WHERE_SESSIONS), as_filter(f).params())


_SESSION_LIST = """
SELECT run_id, run_label, mode, session_id, archetype, turns, task_latency_s, llm_s, tool_wait_s,
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
    return _run(con, _SESSION_LIST.format(where=_WHERE_SESSIONS), params)


_SESSION_TURNS = """
SELECT run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at,
       epoch(sent_at - min(sent_at) OVER ()) AS start_s,
       ttft_s, e2e_s, status, coalesce(reuse, 'not recorded') AS reuse, prompt_tokens,
       completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s
FROM turn_breakdown
WHERE run_id = $run_id AND session_id = $session_id
ORDER BY turn_index
"""


def session_turns(con: duckdb.DuckDBPyConnection, run_id: str, session_id: str) -> pd.DataFrame:
    """Every turn of one session (any status), in order: the input of the session timeline.

    Columns: run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at (UTC),
    start_s (seconds from the session's first request to this one's), ttft_s, e2e_s, status,
    reuse, prompt_tokens, completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s.
    """
    return _run(con, _SESSION_TURNS, {"run_id": str(run_id), "session_id": str(session_id)})


# --- Memory -------------------------------------------------------------------------------------

# Per-pid copies of a gauge: the live one is the non-zero copy (loadgen/prom.gauge_value), so the
# max over copies of one endpoint's scrape. Endpoints of one role are averaged (usage, 0..1) or
# summed (handle bytes) per time bucket.
_MEMORY_TIMELINE = """
WITH s AS (
    SELECT m.run_id, m.role, m.name, m.endpoint, m.scraped_at, max(m.value) AS value
    FROM metric_samples m
    WHERE list_contains($run_ids::VARCHAR[], m.run_id)
      AND ((m.name = $kv_usage AND m.role IN ('prefill', 'decode', 'aggregated'))
           OR (m.name = $handle_bytes AND m.role = 'proxy'))
    GROUP BY ALL
), e AS (
    SELECT s.*, epoch(s.scraped_at - coalesce(r.started_at, min(s.scraped_at) OVER (PARTITION BY s.run_id)))
               AS elapsed_s
    FROM s JOIN runs r USING (run_id)
), b AS (
    SELECT e.*, greatest(max(elapsed_s) OVER (PARTITION BY run_id) / $buckets, $min_bucket_s) AS bucket_s
    FROM e
), per_endpoint AS (
    SELECT run_id, role, name, endpoint, floor(elapsed_s / bucket_s) * bucket_s AS elapsed_s,
           any_value(bucket_s) AS bucket_s, avg(value) AS value
    FROM b GROUP BY run_id, role, name, endpoint, floor(elapsed_s / bucket_s) * bucket_s
)
SELECT p.run_id, coalesce(r.label, p.run_id) AS run_label, r.mode, p.role, p.name, p.elapsed_s,
       any_value(p.bucket_s) AS bucket_s,
       CASE WHEN p.name = $handle_bytes THEN sum(p.value) ELSE avg(p.value) END AS value,
       count(DISTINCT p.endpoint) AS endpoints
FROM per_endpoint p JOIN runs r USING (run_id)
GROUP BY p.run_id, r.label, r.mode, p.role, p.name, p.elapsed_s
ORDER BY p.run_id, p.role, p.name, p.elapsed_s
"""


def memory_timeline(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], buckets: int = 300, min_bucket_s: float = 1.0
) -> pd.DataFrame:
    """KV usage of P, D (or the aggregated worker) and the proxy's live handle bytes over time.

    From ``metric_samples`` of the runs of `f` (turn filters do not apply to scrapes): vLLM's
    ``vllm:kv_cache_usage_perc`` (fraction 0..1) on prefill/decode/aggregated endpoints and
    ``turnscope_handle_bytes_live`` (bytes) on the proxy. Time is bucketed per run into about
    `buckets` buckets of at least `min_bucket_s` seconds; a bucket holds the mean of its scrapes,
    averaged over a role's endpoints (usage) or summed over them (bytes).
    Columns: run_id, run_label, mode, role, name, elapsed_s (bucket start, seconds since the run
    started), bucket_s (bucket width, s), value, endpoints (count). One row per (run, role, name,
    bucket).
    """
    params = {
        "run_ids": _ids(as_filter(f).run_ids),
        "kv_usage": KV_USAGE,
        "handle_bytes": HANDLE_BYTES,
        "buckets": max(int(buckets), 1),
        "min_bucket_s": float(min_bucket_s),
    }
    return _run(con, _MEMORY_TIMELINE, params)


_HIT_RATE_TIMELINE = """
WITH f AS (
    SELECT t.run_id, t.reuse,
           epoch(t.sent_at - coalesce(r.started_at, min(t.sent_at) OVER (PARTITION BY t.run_id))) AS elapsed_s
    FROM turn_breakdown t JOIN runs r USING (run_id)
    WHERE {where} AND t.turn_index >= 1 AND t.reuse IS NOT NULL AND t.sent_at IS NOT NULL
), b AS (
    SELECT f.*, greatest(max(elapsed_s) OVER (PARTITION BY run_id) / $buckets, $min_bucket_s) AS bucket_s
    FROM f
)
SELECT b.run_id, coalesce(r.label, b.run_id) AS run_label, r.mode,
       floor(elapsed_s / bucket_s) * bucket_s AS elapsed_s, any_value(bucket_s) AS bucket_s,
       count(*) AS later_turns, count(*) FILTER (WHERE reuse = 'hit') AS hits,
       count(*) FILTER (WHERE reuse = 'hit') / count(*) AS hit_rate
FROM b JOIN runs r USING (run_id)
GROUP BY b.run_id, r.label, r.mode, floor(elapsed_s / bucket_s) * bucket_s
ORDER BY b.run_id, elapsed_s
"""


def hit_rate_timeline(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], buckets: int = 60, min_bucket_s: float = 1.0
) -> pd.DataFrame:
    """Reuse hit rate of later turns (turn_index >= 1, with a proxy outcome) over time, per run.

    Turns are bucketed by when they were sent (about `buckets` buckets per run, each at least
    `min_bucket_s` seconds). Columns: run_id, run_label, mode, elapsed_s (bucket start, seconds
    since the run started), bucket_s, later_turns, hits, hit_rate (hits / later_turns, 0..1).
    """
    params = {**as_filter(f).params(), "buckets": max(int(buckets), 1), "min_bucket_s": float(min_bucket_s)}
    return _run(con, _HIT_RATE_TIMELINE.format(where=_WHERE_TURNS), params)


# Handle bytes held: the step integral of the proxy's gauge over the run's scrapes (each scrape's
# value held until the next one). Prefill seconds saved: tokens pulled from D x the run's compute
# seconds per token (prefill leg / recomputed tokens over the turns that pulled nothing), less
# the measured NIXL transfer time.
_REUSE_COST = """
WITH hb AS (
    SELECT run_id, endpoint, scraped_at, max(value) AS bytes
    FROM metric_samples
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'proxy' AND name = $handle_bytes
    GROUP BY ALL
), steps AS (
    SELECT run_id, bytes,
           bytes * epoch(lead(scraped_at) OVER (PARTITION BY run_id, endpoint ORDER BY scraped_at) - scraped_at)
               AS byte_s
    FROM hb
), held AS (
    SELECT run_id, sum(byte_s) AS held_byte_s, max(bytes) AS peak_bytes FROM steps GROUP BY run_id
), tk AS (
    SELECT run_id,
           count(*) FILTER (WHERE reuse = 'hit')                        AS hits,
           count(*) FILTER (WHERE turn_index >= 1 AND reuse IS NOT NULL) AS later_turns,
           sum(reused_tokens)                                           AS reused_tokens,
           sum(prefill_leg_s) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                      AND prefill_leg_s IS NOT NULL)    AS compute_s,
           sum(recomputed_tokens) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                          AND prefill_leg_s IS NOT NULL) AS compute_tokens
    FROM turns
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND status = 'ok'
    GROUP BY run_id
), j AS (
    SELECT r.run_id, coalesce(r.label, r.run_id) AS run_label, r.mode,
           held.held_byte_s / 1073741824.0 AS held_gib_s, held.peak_bytes,
           tk.hits, tk.later_turns, tk.reused_tokens,
           tk.compute_s / nullif(tk.compute_tokens, 0) AS prefill_s_per_token,
           k.xfer_s
    FROM runs r
    LEFT JOIN held USING (run_id) LEFT JOIN tk USING (run_id) LEFT JOIN run_kv_transfer k USING (run_id)
    WHERE list_contains($run_ids::VARCHAR[], r.run_id) AND (held.run_id IS NOT NULL OR tk.reused_tokens > 0)
)
SELECT *, reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0) AS saved_s,
       CASE WHEN reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0) > 0
            THEN held_gib_s / (reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0)) END AS gib_s_per_saved_s
FROM j
ORDER BY run_id
"""


def reuse_cost(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The memory cost of reuse per run: GiB-seconds of handle KV held per second of prefill saved.

    For the runs of `f` that have handle-byte scrapes or pulled tokens (whole runs: turn filters
    do not apply). held_gib_s: step integral of ``turnscope_handle_bytes_live`` over the scrapes
    (GiB x s); prefill_s_per_token: sum of prefill legs / sum of recomputed tokens over the ok
    turns that pulled nothing (s/token); saved_s (estimate) = reused_tokens x prefill_s_per_token
    - xfer_s (the run's measured NIXL time, ``run_kv_transfer``); gib_s_per_saved_s =
    held_gib_s / saved_s, NULL when nothing was saved.
    Columns: run_id, run_label, mode, held_gib_s, peak_bytes, hits, later_turns, reused_tokens,
    prefill_s_per_token, xfer_s, saved_s, gib_s_per_saved_s.
    """
    params = {"run_ids": _ids(as_filter(f).run_ids), "handle_bytes": HANDLE_BYTES}
    return _run(con, _REUSE_COST, params)


# --- What-if TTL --------------------------------------------------------------------------------

# Per turn (all turns of the selected runs, so each turn's successor is known before filtering):
# the KV D would hold after it (prompt + output tokens of an ok turn) for min(gap to the next
# turn, TTL), or the whole TTL after a session's last turn. A later turn hits when it is not
# `fresh` and its gap is below TTL - the proxy's margin.
_WHATIF_TTL = """
WITH base AS (
    SELECT t.run_id, t.turn_index, t.kind, t.gap_kind, t.archetype, t.gap_before_s,
           CASE WHEN t.status = 'ok' THEN coalesce(t.prompt_tokens, 0) + coalesce(t.completion_tokens, 0)
                ELSE 0 END AS held_tokens,
           lead(t.gap_before_s) OVER (PARTITION BY t.run_id, t.session_id ORDER BY t.turn_index) AS next_gap_s,
           c.handle_ttl_margin_s, c.kv_bytes_per_token
    FROM turn_breakdown t JOIN run_config c USING (run_id)
    WHERE list_contains($run_ids::VARCHAR[], t.run_id)
), f AS (
    SELECT * FROM base WHERE {where}
), ttl AS (
    SELECT unnest($ttls::DOUBLE[]) AS ttl_s
)
SELECT ttl_s,
       count(*) FILTER (WHERE turn_index >= 1)                                        AS later_turns,
       count(*) FILTER (WHERE turn_index >= 1 AND kind IS DISTINCT FROM 'fresh'
                          AND gap_before_s < ttl_s - handle_ttl_margin_s)             AS hits,
       sum(held_tokens * least(coalesce(next_gap_s, ttl_s), ttl_s))                   AS held_token_s,
       sum(held_tokens * kv_bytes_per_token * least(coalesce(next_gap_s, ttl_s), ttl_s)) / 1073741824.0
                                                                                      AS held_gib_s,
       count(*) FILTER (WHERE kv_bytes_per_token IS NULL AND held_tokens > 0)         AS turns_without_kv_bytes
FROM f CROSS JOIN ttl
GROUP BY ttl_s
ORDER BY ttl_s
"""


def whatif_ttl(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], ttls_s: Sequence[float]
) -> pd.DataFrame:
    """What other ``decoder_kv_blocks_ttl`` values would have given, replayed from recorded gaps.

    For each TTL in `ttls_s` (seconds) over the turns `f` keeps: a later turn (turn_index >= 1,
    not ``fresh``) hits when its gap_before_s < TTL - the run's handle margin (``run_config``);
    after each ok turn D holds its prompt + output tokens for min(gap to the session's next turn,
    TTL), the whole TTL after the last turn recorded. Other causes of a miss (mismatch, transfer
    failure) are not modelled. Columns: ttl_s, later_turns, hits, held_token_s (tokens x s),
    held_gib_s (GiB x s, using runs.config kv_bytes_per_token; NULL parts skipped),
    turns_without_kv_bytes (ok turns of runs with no kv_bytes_per_token). One row per TTL.
    """
    params = {**as_filter(f).params(), "ttls": [float(t) for t in ttls_s]}
    return _run(con, _WHATIF_TTL.format(where=_WHERE_TURNS), params)


_RUN_CONFIG = """
SELECT c.*, r.mode, coalesce(r.label, r.run_id) AS run_label, r.workload, r.history_mode
FROM run_config c JOIN runs r USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], c.run_id)
ORDER BY c.run_id
"""


def run_config(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Per-run settings (view ``run_config``) for the runs of `f`.

    Columns: run_id, decoder_kv_blocks_ttl_s (s), handle_ttl_margin_s (s), kv_bytes_per_token
    (bytes, NULL when unknown), mode, run_label, workload, history_mode.
    """
    return con.execute(_RUN_CONFIG, {"run_ids": _ids(as_filter(f).run_ids)}).df()


# --- Compare ------------------------------------------------------------------------------------

# Favourable: a continuation (kind 'turn') within the proxy's TTL (decoder_kv_blocks_ttl minus the
# margin), the case reuse is made for. Everything else after the first turn is unfavourable.
_COMPARE_SAMPLES = """
SELECT CASE WHEN list_contains($a::VARCHAR[], t.run_id) THEN 'A' ELSE 'B' END AS side,
       t.run_id, t.session_id, t.turn_index, t.kind, t.ttft_s,
       coalesce(t.kind = 'turn' AND t.gap_before_s < c.decoder_kv_blocks_ttl_s - c.handle_ttl_margin_s, false)
           AS favourable
FROM turn_breakdown t JOIN run_config c USING (run_id)
WHERE (list_contains($a::VARCHAR[], t.run_id) OR list_contains($b::VARCHAR[], t.run_id))
  AND (len($archetypes::VARCHAR[]) = 0 OR list_contains($archetypes::VARCHAR[], t.archetype))
  AND (len($kinds::VARCHAR[]) = 0 OR list_contains($kinds::VARCHAR[], t.kind))
  AND (len($gap_kinds::VARCHAR[]) = 0 OR list_contains($gap_kinds::VARCHAR[], t.gap_kind))
  AND t.status = 'ok' AND t.ttft_s IS NOT NULL
ORDER BY side, t.run_id, t.session_id, t.turn_index
"""


def compare_samples(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
) -> pd.DataFrame:
    """TTFT of every ok turn of side A (`a_run_ids`, the treatment) and side B (the baseline).

    `f`'s archetype, kind and gap-kind filters apply (its run ids do not). A run in both lists
    counts as A. Columns: side (``A`` | ``B``), run_id, session_id, turn_index, kind, ttft_s
    (seconds), favourable (a ``turn`` continued within the run's proxy TTL: gap_before_s <
    decoder_kv_blocks_ttl - handle margin). One row per turn.
    """
    ff = f or TurnFilter(())
    params = {**ff.params(), "a": _ids(a_run_ids), "b": _ids(b_run_ids)}
    params.pop("run_ids")
    return _run(con, _COMPARE_SAMPLES, params)
